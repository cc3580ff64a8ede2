// An in-process loom.comm/1 transport for tests: n ranks as n threads of one process,
// collectives through shared pointers and a barrier. Lets the compressed allreduce run on
// 2, 3, 4 ranks without mpirun, with the same code path as a real transport.
#pragma once

#include <loom/kinds/comm.h>
#include <loom/sdk/context.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <barrier>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace test {

class ThreadWorld {
 public:
  explicit ThreadWorld(int n)
      : n_(n), barrier_(n), send_(n), bytes_(n), ranks_(static_cast<size_t>(n)) {
    for (int r = 0; r < n; ++r) {
      ranks_[r].world = this;
      ranks_[r].rank = r;
    }
  }

  int size() const { return n_; }

  loom::sdk::InstanceRef<loom_comm_v1> comm(int rank) {
    return {"thread_world", &ranks_[static_cast<size_t>(rank)], &kVtable};
  }
  const loom_comm_stats& stats(int rank) const { return ranks_[rank].stats; }

  // Runs fn(rank) on n threads and joins them.
  void run(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }

 private:
  struct Rank {
    ThreadWorld* world = nullptr;
    int rank = 0;
    loom_comm_stats stats{LOOM_COMM_STATS_SIZE, 0, 0, 0, 0};
  };

  // Publishes this rank's send buffer; returns an error when the ranks disagree on size.
  static loom_status* exchange(Rank* r, const DLTensor* send, DLTensor* recv, size_t recv_factor,
                               const std::function<void(size_t each)>& copy) {
    ThreadWorld* w = r->world;
    const size_t bytes = send != nullptr ? loom::sdk::nbytes(*send) : 0;
    w->send_[r->rank] = send != nullptr ? send->data : nullptr;
    w->bytes_[r->rank] = bytes;
    w->barrier_.arrive_and_wait();
    bool same = true;
    for (int i = 0; i < w->n_; ++i) same &= w->bytes_[i] == bytes;
    const bool recv_ok = recv != nullptr && loom::sdk::nbytes(*recv) == bytes * recv_factor;
    if (same && recv_ok) copy(bytes);
    w->barrier_.arrive_and_wait();
    if (!same)
      return loom::sdk::make_status(LOOM_ERR_INVALID_ARGUMENT, "ranks sent different sizes");
    if (!recv_ok)
      return loom::sdk::make_status(LOOM_ERR_INVALID_ARGUMENT, "recv has the wrong size");
    ++r->stats.rounds;
    return nullptr;
  }

  static int32_t rank_fn(void* self) { return static_cast<Rank*>(self)->rank; }
  static int32_t size_fn(void* self) { return static_cast<Rank*>(self)->world->n_; }
  static int32_t supports(void*, DLDevice d) { return d.device_type == kDLCPU ? 1 : 0; }
  static loom_status* allreduce(void*, const loom_allreduce_args*) {
    return loom::sdk::make_status(LOOM_ERR_UNIMPLEMENTED, "thread_world has no allreduce");
  }
  static loom_status* allgather(void* self, const loom_allgather_args* a) {
    auto* r = static_cast<Rank*>(self);
    ThreadWorld* w = r->world;
    return exchange(r, a->send, a->recv, static_cast<size_t>(w->n_), [&](size_t each) {
      for (int i = 0; i < w->n_; ++i) {
        std::memcpy(static_cast<char*>(a->recv->data) + i * each, w->send_[i], each);
      }
      r->stats.bytes_sent += each * static_cast<size_t>(w->n_ - 1);
      r->stats.bytes_received += each * static_cast<size_t>(w->n_ - 1);
    });
  }
  static loom_status* all_to_all(void* self, const loom_all_to_all_args* a) {
    auto* r = static_cast<Rank*>(self);
    ThreadWorld* w = r->world;
    if (a->send_counts != nullptr || a->recv_counts != nullptr) {
      return loom::sdk::make_status(LOOM_ERR_UNIMPLEMENTED, "thread_world: equal splits only");
    }
    return exchange(r, a->send, a->recv, 1, [&](size_t each) {
      const size_t part = each / static_cast<size_t>(w->n_);
      for (int i = 0; i < w->n_; ++i) {
        std::memcpy(static_cast<char*>(a->recv->data) + i * part,
                    static_cast<const char*>(w->send_[i]) + r->rank * part, part);
      }
      r->stats.bytes_sent += part * static_cast<size_t>(w->n_ - 1);
      r->stats.bytes_received += part * static_cast<size_t>(w->n_ - 1);
    });
  }
  static loom_status* broadcast(void*, const loom_broadcast_args*) {
    return loom::sdk::make_status(LOOM_ERR_UNIMPLEMENTED, "thread_world has no broadcast");
  }
  static loom_status* barrier(void* self, void*) {
    static_cast<Rank*>(self)->world->barrier_.arrive_and_wait();
    return nullptr;
  }
  static loom_status* stats_fn(void* self, loom_comm_stats* out) {
    const uint32_t size = out->struct_size;
    *out = static_cast<Rank*>(self)->stats;
    out->struct_size = size;
    return nullptr;
  }

  static inline const loom_comm_v1 kVtable = {
      LOOM_COMM_V1_SIZE, 0,           &rank_fn,   &size_fn, &supports, &allreduce,
      &allgather,        &all_to_all, &broadcast, &barrier, &stats_fn, nullptr};

  int n_;
  std::barrier<> barrier_;
  std::vector<const void*> send_;
  std::vector<size_t> bytes_;
  std::vector<Rank> ranks_;
};

}  // namespace test
