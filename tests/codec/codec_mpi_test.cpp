// The compressed allreduce over the real ucx transport, under mpirun with 2, 3 and 4 ranks
// (or alone): every rank computes the reference model of all ranks locally (inputs are
// seeded by rank and step), runs the real thing, and checks it bit for bit; then the ranks
// allgather a hash of their outputs and check that all are the same. Both codecs (onebit
// and ef8) run over the same transport without either knowing the other. The same for the
// reduce-scatter half (CompressedAllreduce::reduce_scatter).
#include <loom/embed.h>
#include <loom/sdk/compressed_allreduce.hpp>
#include <loom/sdk/hierarchical_allreduce.hpp>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "reference.hpp"

namespace {

using loom::sdk::CompressedAllreduce;
using loom::sdk::HierarchicalCompressedAllreduce;
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

// The two-level allreduce with hosts named by rank: ranks [h * per_host, (h + 1) * per_host)
// are host h. The reference: each host's fp32 average (per_host 1 or 2, so the sum's order
// cannot change its bits), cut into per_host blocks, and block l averaged between hosts by
// the reference compressed allreduce of the ranks with local index l.
void run_hierarchical(const InstanceRef<loom_comm_v1>& comm,
                      const InstanceRef<loom_codec_v1>& codec, bool onebit, int per_host,
                      int64_t numel, bool default_hosts = false) {
  const int rank = comm.call(&loom_comm_v1::rank);
  const int n = comm.call(&loom_comm_v1::size);
  const int hosts = n / per_host;
  const ref::Codec rc{onebit};
  const int64_t block = (numel + per_host - 1) / per_host;
  const uint64_t bpad = rc.padded(static_cast<uint64_t>(block), static_cast<uint64_t>(hosts));
  // Error buffers of the reference, per local index and host.
  std::vector<std::vector<std::vector<float>>> we(
      per_host, std::vector<std::vector<float>>(hosts, std::vector<float>(bpad, 0.0f)));
  std::vector<std::vector<std::vector<float>>> se(
      per_host, std::vector<std::vector<float>>(hosts, std::vector<float>(bpad / hosts, 0.0f)));
  // default_hosts: the machine's own names (each network namespace a host), which the
  // launcher made ranks [h * per_host, (h + 1) * per_host) of namespace h.
  HierarchicalCompressedAllreduce ar(comm, codec, numel, {},
                                     default_hosts ? "" : "host" + std::to_string(rank / per_host));
  EXPECT(ar.topology().hosts == hosts && ar.topology().ranks_per_host == per_host &&
             ar.topology().host == rank / per_host && ar.topology().local == rank % per_host,
         "topology %d x %d, host %d, local %d", ar.topology().hosts, ar.topology().ranks_per_host,
         ar.topology().host, ar.topology().local);
  for (int step = 0; step < 2; ++step) {
    std::vector<std::vector<float>> avg(hosts, std::vector<float>(block * per_host, 0.0f));
    for (int h = 0; h < hosts; ++h) {
      std::vector<std::vector<float>> local(per_host);
      for (int l = 0; l < per_host; ++l) local[l] = input(h * per_host + l, step, numel);
      for (int64_t i = 0; i < numel; ++i) {
        float sum = 0.0f;
        for (int l = 0; l < per_host; ++l) sum += local[l][i];
        avg[h][i] = sum / static_cast<float>(per_host);
      }
    }
    std::vector<float> want(block * per_host);
    for (int l = 0; l < per_host; ++l) {
      std::vector<std::vector<float>> xs(hosts);
      for (int h = 0; h < hosts; ++h) {
        xs[h].assign(avg[h].begin() + l * block, avg[h].begin() + (l + 1) * block);
      }
      // One rank per host is the flat algorithm, which compresses even on one host; more
      // ranks on a single host need no compression at all.
      const std::vector<float> out =
          hosts > 1 || per_host == 1 ? ref::compressed_allreduce(rc, xs, we[l], se[l]) : xs[0];
      std::copy(out.begin(), out.end(), want.begin() + l * block);
    }
    want.resize(numel);
    std::vector<float> got = input(rank, step, numel);
    int64_t shape = numel;
    DLTensor t{got.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    ar.run(t);
    // Up to two ranks per host the reduction's order cannot change a bit; with more, the
    // transport's order may round differently.
    float worst = 0.0f;
    for (int64_t i = 0; i < numel; ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
    EXPECT(
        per_host <= 2 ? std::memcmp(got.data(), want.data(), got.size() * 4) == 0 : worst <= 1e-6f,
        "hierarchical %s %d x %d numel %" PRId64 " step %d differs from the reference by %g",
        codec.name().c_str(), hosts, per_host, numel, step, static_cast<double>(worst));
    // Between hosts, each rank sends compressed chunks of its block only.
    if (hosts > 1 && per_host > 1) {
      const auto all = ar.last_traffic();
      const auto intra = ar.last_intra_traffic();
      EXPECT(all.bytes_sent - intra.bytes_sent <=
                 2 * static_cast<uint64_t>(hosts - 1) * ar.between_hosts()->chunk_bytes(),
             "between hosts %" PRIu64 " bytes", all.bytes_sent - intra.bytes_sent);
      EXPECT(intra.bytes_sent > 0, "no bytes inside the host");
    }
  }
}

// Hosts with different rank counts are refused on every rank, naming the counts.
void refuse_uneven_hosts(const InstanceRef<loom_comm_v1>& comm,
                         const InstanceRef<loom_codec_v1>& codec) {
  const int rank = comm.call(&loom_comm_v1::rank);
  std::string what;
  try {
    HierarchicalCompressedAllreduce ar(comm, codec, 16, {}, rank == 0 ? "a" : "b");
  } catch (const loom::sdk::Error& e) {
    what = e.what();
  }
  EXPECT(what.find("every host must hold the same number of ranks") != std::string::npos,
         "uneven hosts gave '%s'", what.c_str());
}

// reduce_scatter(): this rank's slice of the worker half, bit for bit as the reference, over
// two steps (the worker error carries); the server error stays zero; about half run()'s bytes.
void run_reduce_scatter(const InstanceRef<loom_comm_v1>& comm,
                        const InstanceRef<loom_codec_v1>& codec, bool onebit, int64_t numel) {
  const int rank = comm.call(&loom_comm_v1::rank);
  const int n = comm.call(&loom_comm_v1::size);
  const ref::Codec rc{onebit};
  const uint64_t padded = rc.padded(static_cast<uint64_t>(numel), static_cast<uint64_t>(n));
  std::vector<std::vector<float>> we(n, std::vector<float>(padded, 0.0f));
  CompressedAllreduce ar(comm, codec, numel);
  for (int step = 0; step < 2; ++step) {
    std::vector<std::vector<float>> xs;
    for (int r = 0; r < n; ++r) xs.push_back(input(r, step, numel));
    const std::vector<std::vector<float>> want = ref::compressed_reduce_scatter(rc, xs, we);
    std::vector<float> got(static_cast<size_t>(ar.chunk_numel()));
    int64_t shape = numel, cshape = ar.chunk_numel();
    DLTensor in{xs[rank].data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    DLTensor out{got.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &cshape, nullptr, 0};
    ar.reduce_scatter(in, out);
    EXPECT(std::memcmp(got.data(), want[rank].data(), got.size() * 4) == 0,
           "%s reduce_scatter numel %" PRId64 " step %d differs from the reference",
           codec.name().c_str(), numel, step);
    const auto t = ar.last_traffic();
    // One exchange of (n - 1) chunks, where run() makes two (nothing on one rank).
    const uint64_t cb = ar.chunk_bytes();
    EXPECT(t.bytes_sent >= (n - 1) * cb && (n == 1 || t.bytes_sent < 2 * (n - 1) * cb),
           "%s reduce_scatter sent %" PRIu64 " bytes", codec.name().c_str(), t.bytes_sent);
  }
  EXPECT(std::memcmp(ar.worker_error().data, we[rank].data(), padded * 4) == 0,
         "%s reduce_scatter numel %" PRId64 ": worker error differs", codec.name().c_str(), numel);
  const std::vector<float> zeros(padded / n, 0.0f);
  EXPECT(std::memcmp(ar.server_error().data, zeros.data(), zeros.size() * 4) == 0,
         "%s reduce_scatter: the server error was touched", codec.name().c_str());
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
    for (int64_t numel : {int64_t{13}, int64_t{(1 << 18) + 3}}) {
      run_reduce_scatter(comm, find<loom_codec_v1>(s, "codec", "onebit"), true, numel);
      run_reduce_scatter(comm, find<loom_codec_v1>(s, "codec", "ef8"), false, numel);
    }
    // Two levels: one rank per host (the flat algorithm), two per host, all on one host.
    const int n = comm.call(&loom_comm_v1::size);
    for (int per_host : {1, 2, n > 2 ? n : 0}) {
      if (per_host == 0 || n % per_host != 0) continue;
      for (int64_t numel : {int64_t{13}, int64_t{(1 << 18) + 3}}) {
        run_hierarchical(comm, find<loom_codec_v1>(s, "codec", "onebit"), true, per_host, numel);
      }
    }
    // Under bench/limited-link.sh with HOSTS namespaces: the topology found on its own.
    if (const char* netns = std::getenv("LOOM_TEST_NETNS_HOSTS")) {
      const int hosts = std::atoi(netns);
      EXPECT(hosts > 0 && n % hosts == 0, "LOOM_TEST_NETNS_HOSTS=%s with %d ranks", netns, n);
      if (hosts > 0 && n % hosts == 0) {
        run_hierarchical(comm, find<loom_codec_v1>(s, "codec", "onebit"), true, n / hosts,
                         (1 << 20) + 5, /*default_hosts=*/true);
      }
    }
    if (n == 3) refuse_uneven_hosts(comm, find<loom_codec_v1>(s, "codec", "onebit"));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    ++failures;
  }
  loom_close(s);
  if (failures == 0) std::printf("rank %d: OK\n", rank);
  return failures == 0 ? 0 : 1;
}
