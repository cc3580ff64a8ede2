// How a rank learns who it is: from MPI when launched by mpirun/srun, from the embedding
// trainer's callback, or as a world of one.
#pragma once

#include <loom/abi.h>

#include <string>

namespace loom::host {

// A world of one: rank 0 of 1, allgather copies, barrier returns.
const loom_bootstrap* single_process_bootstrap();

// The bootstrap for a process whose caller passed none. LOOM_BOOTSTRAP=mpi|single forces
// a choice; otherwise MPI is used when the environment shows an MPI launcher (OpenMPI's
// OMPI_COMM_WORLD_SIZE, or PMIX_RANK / PMI_RANK under Slurm). MPI is loaded on demand
// (libmpi.so.40), so nothing else needs MPI installed. Throws loom::host::Error when MPI
// was asked for and cannot be used. `how` receives a line for the log.
const loom_bootstrap* default_bootstrap(std::string* how);

}  // namespace loom::host
