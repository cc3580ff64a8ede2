// How a rank learns who it is: from MPI when launched by mpirun/srun, from torchrun-style
// environment variables (tcp_bootstrap.hpp), from the embedding trainer's callback, or as a
// world of one.
#pragma once

#include <loom/abi.h>

#include <string>

namespace loom::host {

// A world of one: rank 0 of 1, allgather copies, barrier returns.
const loom_bootstrap* single_process_bootstrap();

// The bootstrap for a process whose caller passed none. LOOM_BOOTSTRAP=mpi|env|single
// forces a choice; otherwise MPI is used when the environment shows an MPI launcher
// (OpenMPI's OMPI_COMM_WORLD_SIZE, or PMIX_RANK / PMI_RANK under Slurm), else the TCP
// rendezvous when one of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is set (torchrun),
// else a world of one. MPI is loaded on demand (libmpi.so.40), so nothing else needs MPI
// installed. Throws loom::host::Error when the chosen bootstrap cannot be used (MPI
// missing, the environment variables incomplete, the ranks not meeting in time). `how`
// receives a line for the log.
const loom_bootstrap* default_bootstrap(std::string* how);

// LOOM_BOOTSTRAP_TIMEOUT in seconds (default 300): how long a rendezvous, allgather or
// barrier waits for the other ranks. Throws INVALID_ARGUMENT unless it is a number > 0.
double bootstrap_timeout_s();

// Ends the job after an error this process cannot recover from, without exit handlers (MPI's
// would wait for the other ranks): under MPI, MPI_Abort (the launcher ends every rank, a
// stopped one too); under the env bootstrap, SIGKILL to the job's other processes on this
// host (ranks on other hosts fail their next collective within their timeout and do the
// same); then _exit(status). stdio is flushed first.
[[noreturn]] void abort_job(int status);

}  // namespace loom::host
