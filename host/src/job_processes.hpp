// The job's processes on this host, as the env bootstrap's rendezvous learned them, so a rank
// that gives up can end the others (what an MPI launcher does on MPI_Abort): a plain launcher
// (a shell loop, a job script) would otherwise leave a stopped or hung rank behind forever.
#pragma once

#include <cstdint>
#include <vector>

namespace loom::host {

// What each rank sends in the rendezvous's allgather: its host name, pid and start time.
struct ProcessRecord {
  char host[256];
  int64_t pid;
  uint64_t start_ticks;  // /proc/PID/stat's starttime: tells a reused pid from the rank
};

ProcessRecord this_process();

// Remembers the records of `all` (one per rank) on this process's host, other than `self`'s.
void remember_job_processes(const std::vector<ProcessRecord>& all, int self);

// SIGKILL to each remembered process that still has the same pid and start time.
void end_same_host_ranks();

}  // namespace loom::host
