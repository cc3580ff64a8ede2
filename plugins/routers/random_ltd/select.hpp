// random_ltd's selection kernels (select_key.hpp defines the choice): the host path
// (select_cpu.cpp) and the CUDA path (select_cuda.cu), behind a plain C++ interface.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom::routers::ltd {

struct SelectJob {
  uint64_t seed = 0;
  int64_t step = 1;
  int32_t layer = 0;
  int64_t first_sample = 0;
  int64_t batch = 0;
  int64_t seq_len = 0;
  int64_t kept = 0;  // 1 .. seq_len
};

// The workspace select needs on CUDA: the keys of every position, batch * seq_len uint64
// (0 when kept == seq_len). Throws OUT_OF_RANGE when that does not fit 64 bits.
uint64_t workspace_bytes(int64_t batch, int64_t seq_len, int64_t kept);

// Host: indices [batch, kept] int32; sequences over the host pool, per sequence O(seq_len)
// (the keys, an nth_element for the threshold, then an ordered scan).
void select_cpu(const SelectJob& job, int32_t* indices);

namespace cuda {
// Device: one block per sequence (keys into `workspace`, a radix select of the threshold over
// the 64-bit keys, an ordered compaction with a block scan), stream-ordered on `stream`,
// `device` made current for the call. CUDA failures throw loom::sdk::Error (UNAVAILABLE).
void select(const SelectJob& job, int32_t* indices, void* workspace, int device, void* stream);
}  // namespace cuda

}  // namespace loom::routers::ltd
