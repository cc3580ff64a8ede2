// The `ucx` transport (loom.comm/1): collectives on host memory over UCX's UCP tag API.
//
// Setup: one UCP context and worker per instance; worker addresses are exchanged through
// the host's bootstrap allgather and every rank opens an endpoint to every peer, then a
// dissemination barrier checks that every peer answers within timeout_s.
//
// Algorithms (docs/comm.md has the details):
//   allreduce  < small_message_bytes: recursive doubling, extra ranks of a non-power-of-two
//              world folded into a partner first; otherwise a ring reduce-scatter + allgather
//              pipelined in chunks of chunk_bytes with pipeline_depth chunks in flight, so the
//              reduction of one chunk overlaps the transfer of the others.
//   allgather  ring, pipelined in chunks.  all_to_all  pairwise exchange.
//   broadcast  binomial tree, pipelined in chunks.  barrier  dissemination.
//
// Process groups: split (one allgather on the parent) makes a sub-communicator over a subset
// of the parent's endpoints, on the same worker (Link, shared and locked: connection.cpp).
//
// Every message's 64-bit tag holds the communicator's number on the receiving rank, the
// collective's sequence number, the step and the chunk, so messages of different
// communicators, calls or steps never match, plus a 12-bit signature of the call
// (collective, op, dtype, element count): a peer that called something else is reported as
// such instead of corrupting data. A rank that fails a collective tells every peer (an abort
// message), so all ranks fail with a clear error instead of waiting; waits without progress
// end after timeout_s with LOOM_ERR_DEADLINE_EXCEEDED naming the silent peer. After such a
// failure the instance refuses further collectives (the ranks no longer agree on where they
// are); argument errors found before any message is sent leave it usable.
//
// Files: ucx.hpp (tags, Link, Round, the Ucx class), connection.cpp (setup, split, aborts,
// teardown), round.cpp (one call's sends, receives, matching and progress), collectives.cpp
// (argument checks and algorithms), this file (the schema and the entry point).
#include <loom/sdk.hpp>

#include "ucx.hpp"

namespace loom::plugins::ucx {

loom::sdk::Schema Ucx::schema() {
  using namespace loom::sdk;
  return {
      Float("timeout_s", 60.0,
            "Seconds a collective (or the connection setup) waits for a peer without any "
            "progress before it fails with DEADLINE_EXCEEDED naming that peer.")
          .range(0.001, 1e6),
      Int("small_message_bytes", 65536,
          "Allreduce below this many bytes uses recursive doubling; at or above it, a "
          "pipelined ring reduce-scatter + allgather.")
          .range(0, 9.0e18),
      Int("chunk_bytes", 1 << 20, "Pipeline chunk of the ring and the broadcast tree.")
          .range(4096, 1 << 30),
      Int("pipeline_depth", 4, "Chunks in flight at once in the pipelined algorithms.")
          .range(1, 256),
  };
}

}  // namespace loom::plugins::ucx

LOOM_PLUGIN("ucx", "1.0.0", "Collectives on host memory over UCX (shared memory, TCP, RDMA)",
            loom::sdk::factory<loom::plugins::ucx::Ucx>());
