// The bootstrap for launchers that describe the job in environment variables, as torchrun
// (and torch.distributed's env:// initialisation) does: RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR and MASTER_PORT. Rank 0 listens on MASTER_PORT; every other rank connects to
// MASTER_ADDR:MASTER_PORT (retrying resolution and connection until the deadline, since
// rank 0 may start later; each address gets at most 2 s per try) and sends a hello with its
// rank, its world size and the protocol's magic and version. Rank 0 checks them (every rank
// once, all with the same WORLD_SIZE): a process that does not fit (another WORLD_SIZE, a
// RANK already taken) gets the error at once and is turned away, and rank 0 goes on waiting
// for the job's ranks; its timeout message quotes what it turned away. Connections that
// never say hello are capped and dropped, oldest first.
//
// Collectives go through rank 0: every rank sends its block, rank 0 sends the concatenation
// back. Rank 0 waits at most LOOM_BOOTSTRAP_TIMEOUT seconds for the blocks, then has that
// long again (while bytes move) to send the result; the other ranks wait a grace period
// longer (10%, at least 2 s), so rank 0's verdict, naming the late rank, reaches every rank.
// A peer that closes its connection fails the collective at once (UNAVAILABLE), a silent one
// at the deadline (DEADLINE_EXCEEDED), and rank 0 forwards its error to the other ranks (a
// rank whose result is half sent is only disconnected). A rank whose collective fails shuts
// its connection down, so rank 0 sees it at once. After a failure every later collective
// fails with the same error.
#pragma once

#include <loom/abi.h>

#include <string>

namespace loom::host {

// Whether the environment asks for this bootstrap: one of RANK, WORLD_SIZE, MASTER_ADDR or
// MASTER_PORT is set to a non-empty value. (init_env_bootstrap then requires all four.)
bool env_launch_requested();

// Reads and checks the variables, then runs the rendezvous and one allgather of host names:
// LOCAL_RANK, when unset, is this rank's position among the ranks on the same host.
// Throws loom::host::Error: INVALID_ARGUMENT for a missing or malformed variable, or on a
// process that rank 0 turns away (another WORLD_SIZE, a RANK already taken),
// UNAVAILABLE when rank 0 cannot listen or a peer closes its connection, DEADLINE_EXCEEDED
// when the ranks do not all meet within `timeout_s`. `how` receives a line for the log.
// The bootstrap returned lives until the process exits.
const loom_bootstrap* init_env_bootstrap(double timeout_s, std::string* how);

// SIGKILL to the job's other processes on this host (known from the rendezvous: their pid
// and start time, so a pid the system has since reused is left alone). For abort_job.
void end_same_host_ranks();

}  // namespace loom::host
