// Declared public interface of loom_moe_core: bench/, the trainer and tests may include this
// header (as <loom/moe/exchange.hpp>); the core's other headers are private to it.
//
// Expert-parallel token exchange and expert-gradient reduction over a loom.comm.
//
// The expert-parallel (EP) groups are consecutive ranks of the world ([0, ep), [ep, 2 ep), ...)
// and the expert-data-parallel groups are the ranks with the same place in theirs
// ({r : r % ep == i}). Global expert e lives on EP rank e / local_experts.
//
// exchange.cpp implements it over the comm's split and variable all_to_all; without a comm
// (ep_size 1, one rank) every move is a copy and every reduction the identity.
#pragma once

#include <dlpack/dlpack.h>
#include <loom/kinds/comm.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace loom::moe {

class Exchange {
 public:
  // comm may be null (then ep_size must be 1). Splits the comm into the expert-parallel
  // groups (consecutive ranks) and the expert-data-parallel groups (same place), once.
  // Collective (split). Throws loom::sdk::Error (a std::runtime_error) on bad input and on
  // a transport error (a peer that does not answer within the comm's timeout included).
  Exchange(const loom_comm_v1* vt, void* comm, int ep_size);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  int ep_size() const;
  int ep_rank() const;
  int world_size() const;
  int world_rank() const;

  // Collective over the EP group. send_counts[e], e = 0..E-1 (global experts): rows this
  // rank sends to expert e; returns recv_counts[local_expert][source_rank] (exchanged first,
  // so unequal counts never hang) and the total.
  struct Plan {
    std::vector<int64_t> send_counts;  // [E]
    std::vector<int64_t> recv_counts;  // [local_experts * ep], local expert major
    int64_t recv_rows = 0;
    int num_experts = 0, local_experts = 0, ep = 1;
  };
  Plan plan(const int64_t* send_counts, int num_experts);

  // rows: send is grouped by global expert (e ascending, in the order the caller built),
  // recv comes out grouped by local expert, then source rank (rank ascending), keeping each
  // source's order. `reverse` does the adjoint (expert-layout rows back to the senders'
  // layout). Row bytes = M * element size; host or CUDA memory (staged through the host when
  // the transport cannot use the device).
  void forward(const Plan&, const void* send, void* recv, int64_t row_bytes, DLDevice,
               void* stream);
  void reverse(const Plan&, const void* recv_layout, void* send_layout, int64_t row_bytes, DLDevice,
               void* stream);

  // Sum over the expert-data-parallel group, divided by world_size(), in place, fp32.
  void reduce_gradients(DLTensor* const* tensors, int64_t count, void* stream);

  // Sum of a small int64 vector over the EP group (bias load, dropless capacity); the max of
  // one value over the EP group.
  void sum_ep(int64_t* v, int64_t n);
  int64_t max_ep(int64_t v);
  // Sum of a small int64 vector over every rank of the comm (the data-parallel copies
  // included): the aux-loss-free bias's load, so every copy moves its bias alike.
  void sum_world(int64_t* v, int64_t n);

  // Collective over the EP group, entered by every rank after its local checks: status 0 =
  // this rank can go on, > 0 = short by that many `unit`, < 0 = another local error (then
  // local_error says which). Returns "" on every rank when every rank is fine, else on
  // every rank at once the error to raise: the failing rank's own message, and on the others
  // which rank stopped the call and by how much it was short.
  std::string agree_ep(int64_t status, const std::string& local_error, const char* unit);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::moe
