// The bootstrap for launchers that describe the job in environment variables, as torchrun
// (and torch.distributed's env:// initialisation) does: RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR and MASTER_PORT. Rank 0 listens on MASTER_PORT; every other rank connects to
// MASTER_ADDR:MASTER_PORT (retrying until the deadline, since rank 0 may start later) and
// sends a hello with its rank, its world size and the protocol's magic and version. Rank 0
// checks them (every rank once, all with the same WORLD_SIZE) and answers each with a
// welcome or with the error, so every rank fails with the same clear message.
//
// Collectives go through rank 0: every rank sends its block, rank 0 sends the concatenation
// back. Each waits at most LOOM_BOOTSTRAP_TIMEOUT seconds; a peer that closes its connection
// fails the collective at once (UNAVAILABLE), a silent one at the deadline
// (DEADLINE_EXCEEDED), and rank 0 forwards its error to the other ranks. After a failure
// every later collective fails with the same error.
#pragma once

#include <loom/abi.h>

#include <string>

namespace loom::host {

// Whether the environment asks for this bootstrap: one of RANK, WORLD_SIZE, MASTER_ADDR or
// MASTER_PORT is set to a non-empty value. (init_env_bootstrap then requires all four.)
bool env_launch_requested();

// Reads and checks the variables, then runs the rendezvous and one allgather of host names:
// LOCAL_RANK, when unset, is this rank's position among the ranks on the same host.
// Throws loom::host::Error: INVALID_ARGUMENT for a missing or malformed variable or an
// inconsistent job (ranks disagreeing on WORLD_SIZE, two processes with the same RANK),
// UNAVAILABLE when rank 0 cannot listen or a peer closes its connection, DEADLINE_EXCEEDED
// when the ranks do not all meet within `timeout_s`. `how` receives a line for the log.
// The bootstrap returned lives until the process exits.
const loom_bootstrap* init_env_bootstrap(double timeout_s, std::string* how);

}  // namespace loom::host
