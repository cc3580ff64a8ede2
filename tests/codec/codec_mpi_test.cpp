// The compressed allreduce over the real ucx transport, under mpirun with 2, 3 and 4 ranks
// (or alone): every rank computes the reference model of all ranks locally (inputs are
// seeded by rank and step), runs the real thing, and checks it bit for bit; then the ranks
// allgather a hash of their outputs and check that all are the same. Both codecs (onebit
// and ef8) run over the same transport without either knowing the other.
#include <loom/embed.h>
#include <loom/sdk/compressed_allreduce.hpp>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "reference.hpp"

namespace {

using loom::sdk::CompressedAllreduce;
using loom::sdk::InstanceRef;

int failures = 0;

#define EXPECT(cond, ...)                                        \
  do {                                                           \
    if (!(cond)) {                                               \
      ++failures;                                                \
      std::fprintf(stderr, "rank %d: FAILED %s: ", rank, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                         \
      std::fprintf(stderr, "\n");                                \
    }                                                            \
  } while (0)

template <class VTable>
InstanceRef<VTable> find(loom_session* s, const char* kind, const char* name) {
  loom_instance* inst = nullptr;
  if (loom_find_instance(s, kind, name, &inst) != 0) {
    std::fprintf(stderr, "%s\n", loom_last_error());
    std::exit(2);
  }
  return {name, loom_instance_object(inst), static_cast<const VTable*>(loom_instance_vtable(inst))};
}

uint64_t fnv1a(const void* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::vector<float> input(int r, int step, int64_t numel) {
  std::mt19937 rng(static_cast<unsigned>(1000 * r + 17 * step + numel));
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<float> v(static_cast<size_t>(numel));
  for (auto& x : v) x = u(rng) + 0.01f * static_cast<float>(r);
  return v;
}

void run_case(const InstanceRef<loom_comm_v1>& comm, const InstanceRef<loom_codec_v1>& codec,
              bool onebit, int64_t numel) {
  const int rank = comm.call(&loom_comm_v1::rank);
  const int n = comm.call(&loom_comm_v1::size);
  const ref::Codec rc{onebit};
  const uint64_t padded = rc.padded(static_cast<uint64_t>(numel), static_cast<uint64_t>(n));
  std::vector<std::vector<float>> we(n, std::vector<float>(padded, 0.0f));
  std::vector<std::vector<float>> se(n, std::vector<float>(padded / n, 0.0f));
  CompressedAllreduce ar(comm, codec, numel);
  for (int step = 0; step < 2; ++step) {
    std::vector<std::vector<float>> xs;
    for (int r = 0; r < n; ++r) xs.push_back(input(r, step, numel));
    const std::vector<float> want = ref::compressed_allreduce(rc, xs, we, se);
    std::vector<float> got = xs[rank];
    int64_t shape = numel;
    DLTensor t{got.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    ar.run(t);
    EXPECT(std::memcmp(got.data(), want.data(), got.size() * 4) == 0,
           "%s numel %" PRId64 " step %d differs from the reference", codec.name().c_str(), numel,
           step);
    // Same bytes on every rank: allgather a hash.
    uint64_t h = fnv1a(got.data(), got.size() * 4);
    std::vector<uint64_t> all(n);
    int64_t one = 1, nn = n;
    DLTensor send{&h, {kDLCPU, 0}, 1, {kDLUInt, 64, 1}, &one, nullptr, 0};
    DLTensor recv{all.data(), {kDLCPU, 0}, 1, {kDLUInt, 64, 1}, &nn, nullptr, 0};
    loom_allgather_args ag{};
    ag.struct_size = LOOM_ALLGATHER_ARGS_SIZE;
    ag.send = &send;
    ag.recv = &recv;
    comm.call(&loom_comm_v1::allgather, &ag);
    for (int r = 0; r < n; ++r) {
      EXPECT(all[r] == h, "%s numel %" PRId64 ": rank %d's result differs", codec.name().c_str(),
             numel, r);
    }
    // Wire volume: each rank sends (n - 1) chunks in each phase.
    const auto t1 = ar.last_traffic();
    EXPECT(t1.bytes_sent >= 2 * (n - 1) * ar.chunk_bytes(), "%s sent only %" PRIu64 " bytes",
           codec.name().c_str(), t1.bytes_sent);
  }
  EXPECT(std::memcmp(ar.worker_error().data, we[rank].data(), padded * 4) == 0,
         "%s numel %" PRId64 ": worker error differs", codec.name().c_str(), numel);
  EXPECT(std::memcmp(ar.server_error().data, se[rank].data(), padded / n * 4) == 0,
         "%s numel %" PRId64 ": server error differs", codec.name().c_str(), numel);
}

}  // namespace

int main() {
  const char* toml =
      "[loom]\nabi = 1\n"
      "[comm.world]\nplugin = \"ucx\"\n"
      "[codec.onebit]\nplugin = \"onebit\"\n"
      "[codec.ef8]\nplugin = \"ef8\"\n";
  loom_session* s = nullptr;
  if (loom_open_string(toml, "codec_mpi.toml", nullptr, &s) != 0) {
    std::fprintf(stderr, "open: %s\n", loom_last_error());
    return 2;
  }
  const auto comm = find<loom_comm_v1>(s, "comm", "world");
  const int rank = comm.call(&loom_comm_v1::rank);
  try {
    for (int64_t numel : {int64_t{1}, int64_t{13}, int64_t{(1 << 20) + 7}}) {
      run_case(comm, find<loom_codec_v1>(s, "codec", "onebit"), true, numel);
    }
    for (int64_t numel : {int64_t{13}, int64_t{100003}}) {
      run_case(comm, find<loom_codec_v1>(s, "codec", "ef8"), false, numel);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    ++failures;
  }
  loom_close(s);
  if (failures == 0) std::printf("rank %d: OK\n", rank);
  return failures == 0 ? 0 : 1;
}
