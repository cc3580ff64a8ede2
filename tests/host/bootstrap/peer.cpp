// One process of the bootstrap tests (bootstrap_test.cpp starts several with RANK,
// WORLD_SIZE, ... set). The host's bootstrap is process-wide, so each rank is a process:
// this one picks the bootstrap as libloom does (default_bootstrap), then runs allgather
// rounds of many sizes (0 bytes included) with a barrier after each, checks every block
// it receives, and prints one line:
//   how: <the bootstrap's log line>
//   ok rank R of N local L rounds K sum S   (S: a hash of everything received, the same on
//                                            every rank when the gathers agree)
//   error CODE: message                     (exit 3 when choosing the bootstrap failed,
//                                            4 when a collective failed, 5 on bad data)
// Options: --rounds K (default 12); --exit-after K: rank 1 exits right after round K's
// allgather, before its barrier (a peer that dies); --mismatch: rank 1 sends one byte more
// than the others in round 1; --stall R S: rank R sleeps S seconds before round 1's allgather (a
// rank that comes late); --round1-bytes N: round 1 gathers N bytes per rank; --linger S: after an
// error, wait S seconds before exiting (a failed rank that stays alive); --nofile N: limit
// the process to N open files (RLIMIT_NOFILE) before the bootstrap; --stop-at-end R: after the
// rounds, rank R stops itself (SIGSTOP: a hung peer); --abort-at-end S: after the rounds, rank
// 0 ends the job with abort_job(S) instead of returning.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bootstrap.hpp"
#include "status.hpp"

namespace {

uint8_t pattern(int rank, int round, size_t i) {
  return static_cast<uint8_t>((rank * 131 + round * 17 + static_cast<int>(i % 251) * 7) & 0xff);
}

double linger_s = 0;

int report(loom_status* st, int exit_code) {
  const loom::host::TakenStatus t = loom::host::take_status(st);
  std::printf("error %s: %s\n", loom::host::code_name(t.code), t.message.c_str());
  std::fflush(stdout);
  if (linger_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(linger_s));
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 12;
  int exit_after = -1;
  bool mismatch = false;
  int stall_rank = -1;
  double stall_s = 0;
  long round1_bytes = -1;
  int stop_rank = -1;
  int abort_status = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else if (a == "--exit-after" && i + 1 < argc) {
      exit_after = std::atoi(argv[++i]);
    } else if (a == "--mismatch") {
      mismatch = true;
    } else if (a == "--stall" && i + 2 < argc) {
      stall_rank = std::atoi(argv[++i]);
      stall_s = std::atof(argv[++i]);
    } else if (a == "--round1-bytes" && i + 1 < argc) {
      round1_bytes = std::atol(argv[++i]);
    } else if (a == "--stop-at-end" && i + 1 < argc) {
      stop_rank = std::atoi(argv[++i]);
    } else if (a == "--abort-at-end" && i + 1 < argc) {
      abort_status = std::atoi(argv[++i]);
    } else if (a == "--linger" && i + 1 < argc) {
      linger_s = std::atof(argv[++i]);
    } else if (a == "--nofile" && i + 1 < argc) {
      rlimit lim{};
      (void)::getrlimit(RLIMIT_NOFILE, &lim);
      lim.rlim_cur = static_cast<rlim_t>(std::atol(argv[++i]));
      if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) {
        std::perror("setrlimit");
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--rounds K] [--exit-after K] [--mismatch] [--stall R S] "
                   "[--round1-bytes N] [--linger S] [--nofile N] [--stop-at-end R] "
                   "[--abort-at-end S]\n",
                   argv[0]);
      return 2;
    }
  }
  const loom_bootstrap* b = nullptr;
  std::string how;
  try {
    b = loom::host::default_bootstrap(&how);
  } catch (const loom::host::Error& e) {
    std::printf("error %s: %s\n", loom::host::code_name(e.code()), e.what());
    std::fflush(stdout);
    if (linger_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(linger_s));
    return 3;
  }
  std::printf("how: %s\n", how.c_str());
  std::fflush(stdout);

  const size_t sizes[] = {0, 1, 7, 8, 64, 1000, 4096, 65537, 1 << 20, 3, 0, 12345};
  const size_t n_sizes = sizeof sizes / sizeof sizes[0];
  uint64_t sum = 1469598103934665603ULL;  // FNV-1a over everything received
  for (int r = 0; r < rounds; ++r) {
    const size_t bytes = r == 1 && round1_bytes >= 0 ? static_cast<size_t>(round1_bytes)
                                                     : sizes[static_cast<size_t>(r) % n_sizes];
    const size_t mine = bytes + (mismatch && b->rank == 1 && r == 1 ? 1 : 0);
    std::vector<uint8_t> send(mine), recv(mine * static_cast<size_t>(b->size) + 1, 0xee);
    for (size_t i = 0; i < mine; ++i) send[i] = pattern(b->rank, r, i);
    if (r == 1 && b->rank == stall_rank) {
      std::this_thread::sleep_for(std::chrono::duration<double>(stall_s));
    }
    if (loom_status* st = b->allgather(b->ctx, send.data(), mine, recv.data())) {
      return report(st, 4);
    }
    for (int q = 0; q < b->size; ++q) {
      for (size_t i = 0; i < bytes; ++i) {
        const uint8_t got = recv[static_cast<size_t>(q) * bytes + i];
        if (got != pattern(q, r, i)) {
          std::printf("error bad data: round %d, rank %d's byte %zu is %d, expected %d\n", r, q, i,
                      got, pattern(q, r, i));
          return 5;
        }
      }
    }
    if (recv[bytes * static_cast<size_t>(b->size)] != 0xee) {
      std::printf("error bad data: round %d wrote past size * bytes\n", r);
      return 5;
    }
    for (size_t i = 0; i < bytes * static_cast<size_t>(b->size); ++i) {
      sum = (sum ^ recv[i]) * 1099511628211ULL;
    }
    if (r == exit_after && b->rank == 1) {
      std::printf("exiting early after round %d\n", r);
      std::fflush(stdout);
      ::_exit(0);
    }
    if (loom_status* st = b->barrier(b->ctx)) return report(st, 4);
  }
  std::printf("ok rank %d of %d local %d rounds %d sum %llu\n", b->rank, b->size, b->local_rank,
              rounds, static_cast<unsigned long long>(sum));
  std::fflush(stdout);
  if (b->rank == stop_rank) ::raise(SIGSTOP);
  if (b->rank == 0 && abort_status >= 0) {
    // Give the stopping rank time to stop first.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    loom::host::abort_job(abort_status);
  }
  return 0;
}
