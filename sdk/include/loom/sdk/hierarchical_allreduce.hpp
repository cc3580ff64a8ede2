// The compressed allreduce in two levels, for clusters whose hosts are joined by a slow
// network and whose ranks within a host share a fast one (shared memory, NVLink): full
// precision inside a host, compression only between hosts (the two-level scheme of ZeRO++
// and Bagua).
//
// The communicator is split by host (HostTopology: every host must hold the same number of
// ranks, L). On rank l of its host, for a tensor of N elements padded to a multiple of L:
//   1. intra-host reduce_scatter (average, fp32): rank l gets block l of its host's average;
//   2. between hosts, the ranks with the same l run the compressed allreduce
//      (CompressedAllreduce, error feedback and all) on that block, so each host sends the
//      compressed tensor once, not once per rank;
//   3. intra-host allgather of the blocks: every rank holds the average over all ranks.
// The result is bit-identical on every rank. With one rank per host this is the flat
// compressed allreduce (the same bits); on one host, no compression at all (an exact average).
// The error buffers cover only this rank's block (N / L elements, not N).
//
// Host memory only. Usage:
//
//   #include <loom/sdk/hierarchical_allreduce.hpp>
//
//   loom::sdk::HierarchicalCompressedAllreduce allreduce(ctx, comm, codec, numel);
//   allreduce.run(momentum_tensor);        // in place; collective
//   allreduce.topology();                  // hosts, ranks per host, this rank's place
//
// Threads: one call at a time ([instance] of the comm and codec instances it uses).
#ifndef LOOM_SDK_HIERARCHICAL_ALLREDUCE_HPP
#define LOOM_SDK_HIERARCHICAL_ALLREDUCE_HPP

#include <loom/abi.h>
#include <loom/checksum.h>
#include <loom/kinds/codec.h>
#include <loom/kinds/comm.h>
#include <unistd.h>
#include <loom/sdk/comm.hpp>
#include <loom/sdk/compressed_allreduce.hpp>
#include <loom/sdk/context.hpp>
#include <loom/sdk/state.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::sdk {

// Where this rank sits: `hosts` hosts of `ranks_per_host` ranks each; this rank is rank
// `local` of host `host` (hosts numbered in the order of their first rank).
struct HostTopology {
  int32_t hosts = 1;
  int32_t ranks_per_host = 1;
  int32_t host = 0;
  int32_t local = 0;
};

// This machine's name for the topology: the hostname and the network namespace, so that ranks
// in different network namespaces of one machine (containers) count as different hosts.
inline std::string default_host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) std::strcpy(name, "unknown-host");
  char ns[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  return std::string(name) + (n > 0 ? "/" + std::string(ns, static_cast<std::size_t>(n)) : "");
}

// Collective over comm: every rank passes its host's name (any string; ranks with equal
// names are on one host). Throws FAILED_PRECONDITION when the hosts hold different numbers
// of ranks.
inline HostTopology host_topology(const InstanceRef<loom_comm_v1>& comm, const std::string& host) {
  const int32_t size = comm.call(&loom_comm_v1::size);
  const int32_t rank = comm.call(&loom_comm_v1::rank);
  const std::vector<uint64_t> all =
      comm_allgather_value(comm, loom_fnv1a64(host.data(), host.size(), LOOM_FNV1A64_OFFSET));
  std::map<uint64_t, int32_t> index;  // host hash -> host number, by first rank
  std::vector<int32_t> count;
  HostTopology t;
  for (int32_t r = 0; r < size; ++r) {
    const auto [it, added] =
        index.emplace(all[static_cast<std::size_t>(r)], static_cast<int32_t>(count.size()));
    if (added) count.push_back(0);
    if (r == rank) {
      t.host = it->second;
      t.local = count[static_cast<std::size_t>(it->second)];
    }
    ++count[static_cast<std::size_t>(it->second)];
  }
  t.hosts = static_cast<int32_t>(count.size());
  t.ranks_per_host = count.front();
  for (std::size_t h = 0; h < count.size(); ++h) {
    if (count[h] != t.ranks_per_host) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  "hierarchical allreduce over '" + comm.name() + "': host " + std::to_string(h) +
                      " has " + std::to_string(count[h]) + " rank(s), host 0 has " +
                      std::to_string(t.ranks_per_host) +
                      "; every host must hold the same number of ranks");
    }
  }
  return t;
}

class HierarchicalCompressedAllreduce {
 public:
  // Collective over comm. `host`: this rank's host name (empty: default_host_name()).
  HierarchicalCompressedAllreduce(const Context& ctx, InstanceRef<loom_comm_v1> comm,
                                  InstanceRef<loom_codec_v1> codec, int64_t numel,
                                  CompressedAllreduce::Options options = {},
                                  const std::string& host = {})
      : HierarchicalCompressedAllreduce(&ctx, std::move(comm), std::move(codec), numel,
                                        std::move(options), host) {}
  HierarchicalCompressedAllreduce(InstanceRef<loom_comm_v1> comm, InstanceRef<loom_codec_v1> codec,
                                  int64_t numel, CompressedAllreduce::Options options = {},
                                  const std::string& host = {})
      : HierarchicalCompressedAllreduce(nullptr, std::move(comm), std::move(codec), numel,
                                        std::move(options), host) {}

  // output = average over all ranks of input (fp32, numel elements, host memory); output may
  // be input. Collective.
  void run(const DLTensor& input, DLTensor& output, void* stream = nullptr) {
    expect_tensor(&input, "hierarchical allreduce input");
    expect_tensor(&output, "hierarchical allreduce output");
    for (const DLTensor* t : {&input, static_cast<const DLTensor*>(&output)}) {
      expect_fp32(*t, "hierarchical allreduce tensor");
      expect_contiguous(*t, "hierarchical allreduce tensor");
      expect_cpu(*t, "hierarchical allreduce tensor");
      expect_numel(*t, numel_, "hierarchical allreduce tensor");
    }
    const float* in = data_as<const float>(input);
    float* out = data_as<float>(output);
    last_ = {};
    if (topo_.ranks_per_host == 1) {  // flat
      inter_->run(input, output, stream);
      add(inter_->last_traffic());
      return;
    }
    const CompressedAllreduceTraffic before = intra_stats();
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(whole_.data(), in, static_cast<std::size_t>(numel_) * sizeof(float));
    // The padding holds the last run's gathered output; it must enter the reduction as zeros.
    std::fill(whole_.begin() + numel_, whole_.end(), 0.0f);
    int64_t whole_shape = padded_;
    int64_t block_shape = block_;
    DLTensor whole = flat_view(whole_.data(), DLDevice{kDLCPU, 0}, kF32, &whole_shape);
    DLTensor block = flat_view(block_data(), DLDevice{kDLCPU, 0}, kF32, &block_shape);
    const loom_reduce_scatter_args rs{LOOM_REDUCE_SCATTER_ARGS_SIZE, LOOM_REDUCE_AVG, &whole,
                                      &block, stream};
    comm_reduce_scatter(intra_.ref(), rs);
    uint64_t intra_ns = elapsed_ns(t0);
    if (inter_) {
      inter_->run(block, stream);
      add(inter_->last_traffic());
    }
    const auto t1 = std::chrono::steady_clock::now();
    // The block goes in place of its own part of whole_ (allgather's recv).
    std::memcpy(gather_block_.data(), block_data(), static_cast<std::size_t>(block_) * 4);
    int64_t gb_shape = block_;
    DLTensor gb = flat_view(gather_block_.data(), DLDevice{kDLCPU, 0}, kF32, &gb_shape);
    loom_allgather_args ag{};
    ag.struct_size = LOOM_ALLGATHER_ARGS_SIZE;
    ag.send = &gb;
    ag.recv = &whole;
    ag.stream = stream;
    intra_.ref().call(&loom_comm_v1::allgather, &ag);
    intra_ns += elapsed_ns(t1);
    std::memcpy(out, whole_.data(), static_cast<std::size_t>(numel_) * sizeof(float));
    const CompressedAllreduceTraffic after = intra_stats();
    last_intra_ = {after.bytes_sent - before.bytes_sent,
                   after.bytes_received - before.bytes_received, after.rounds - before.rounds,
                   intra_ns};
    add(last_intra_);
  }
  void run(DLTensor& tensor, void* stream = nullptr) { run(tensor, tensor, stream); }

  const HostTopology& topology() const { return topo_; }
  int64_t numel() const { return numel_; }
  // The elements this rank compresses between hosts (its block; numel on one rank per host).
  int64_t block_numel() const { return topo_.ranks_per_host == 1 ? numel_ : block_; }
  // The last run's traffic: all of it, and the part inside the host (fp32).
  CompressedAllreduceTraffic last_traffic() const { return last_; }
  CompressedAllreduceTraffic last_intra_traffic() const { return last_intra_; }
  // The compressed allreduce between hosts (its error buffers, streams); null on one host.
  CompressedAllreduce* between_hosts() const { return inter_.get(); }

  // Versioned: the topology, then the between-hosts state. Refuses another topology.
  void export_state(StateWriter& out) const {
    out.write_header(kStateMagic, kStateVersion);
    out.write_pod<int64_t>(numel_);
    out.write_pod<int32_t>(topo_.hosts);
    out.write_pod<int32_t>(topo_.ranks_per_host);
    out.write_pod<int32_t>(topo_.local);
    if (inter_) inter_->export_state(out);
  }
  void import_state(StateReader& in) {
    in.read_header(kStateMagic, kStateVersion);
    const auto numel = in.read_pod<int64_t>();
    const auto hosts = in.read_pod<int32_t>();
    const auto per_host = in.read_pod<int32_t>();
    const auto local = in.read_pod<int32_t>();
    if (numel != numel_ || hosts != topo_.hosts || per_host != topo_.ranks_per_host ||
        local != topo_.local) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "hierarchical allreduce state is for " + std::to_string(numel) + " elements on " +
                      std::to_string(hosts) + " host(s) of " + std::to_string(per_host) +
                      " rank(s), this rank " + std::to_string(local) +
                      " on its host; this one has " + std::to_string(numel_) + " on " +
                      std::to_string(topo_.hosts) + " of " + std::to_string(topo_.ranks_per_host) +
                      ", rank " + std::to_string(topo_.local) +
                      " (the error buffers are per block of a host)");
    }
    if (inter_) inter_->import_state(in);
  }

  static constexpr const char* kStateMagic = "loom.hierarchical_allreduce";
  static constexpr uint32_t kStateVersion = 1;

 private:
  static constexpr DLDataType kF32{kDLFloat, 32, 1};

  HierarchicalCompressedAllreduce(const Context* ctx, InstanceRef<loom_comm_v1> comm,
                                  InstanceRef<loom_codec_v1> codec, int64_t numel,
                                  CompressedAllreduce::Options options, const std::string& host)
      : numel_(numel) {
    if (!comm) throw Error(LOOM_ERR_INVALID_ARGUMENT, "hierarchical allreduce: comm is not set");
    if (numel <= 0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "hierarchical allreduce: numel must be positive, got " + std::to_string(numel));
    }
    if (!is_cpu(options.device)) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, "hierarchical allreduce runs on host memory; " +
                                              device_string(options.device) +
                                              " tensors use the flat compressed allreduce");
    }
    topo_ = host_topology(comm, host.empty() ? default_host_name() : host);
    auto make = [&](InstanceRef<loom_comm_v1> over, int64_t n) {
      return ctx != nullptr ? std::make_unique<CompressedAllreduce>(*ctx, over, codec, n, options)
                            : std::make_unique<CompressedAllreduce>(over, codec, n, options);
    };
    if (topo_.ranks_per_host == 1) {
      inter_ = make(comm, numel_);
      return;
    }
    const int64_t l = topo_.ranks_per_host;
    padded_ = (numel_ + l - 1) / l * l;
    block_ = padded_ / l;
    intra_ = comm_split(comm, topo_.host, topo_.local);
    if (topo_.hosts > 1) {
      inter_comm_ = comm_split(comm, topo_.local, topo_.host);
      inter_ = make(inter_comm_.ref(), block_);
    }
    whole_.assign(static_cast<std::size_t>(padded_), 0.0f);
    gather_block_.assign(static_cast<std::size_t>(block_), 0.0f);
    block_store_.assign(static_cast<std::size_t>(block_), 0.0f);
  }

  float* block_data() { return block_store_.data(); }
  static uint64_t elapsed_ns(std::chrono::steady_clock::time_point t0) {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  CompressedAllreduceTraffic intra_stats() const {
    loom_comm_stats s{};
    s.struct_size = LOOM_COMM_STATS_SIZE;
    intra_.ref().call(&loom_comm_v1::stats, &s);
    return {s.bytes_sent, s.bytes_received, s.rounds, 0};
  }
  void add(const CompressedAllreduceTraffic& t) {
    last_.bytes_sent += t.bytes_sent;
    last_.bytes_received += t.bytes_received;
    last_.rounds += t.rounds;
    last_.wait_ns += t.wait_ns;
  }

  int64_t numel_ = 0;
  int64_t padded_ = 0;  // numel rounded up to a multiple of the ranks per host
  int64_t block_ = 0;   // padded / ranks per host
  HostTopology topo_;
  // Declared before the allreduce that uses them, so destroyed after it.
  SubComm intra_;
  SubComm inter_comm_;
  std::unique_ptr<CompressedAllreduce> inter_;
  std::vector<float> whole_;         // padded input, then the gathered output
  std::vector<float> block_store_;   // this rank's block: reduce_scatter's recv
  std::vector<float> gather_block_;  // the block as allgather's send (recv is whole_)
  CompressedAllreduceTraffic last_;
  CompressedAllreduceTraffic last_intra_;
};

}  // namespace loom::sdk

#endif  // LOOM_SDK_HIERARCHICAL_ALLREDUCE_HPP
