// The optimizer structs as a caller built against ABI 1.0 lays them out (before 1.1 appended
// loom_optimizer_tensor.exp_avg_mask and loom_optimizer_group.flags): tests pass arrays of
// these to check that optimizers walk them by struct_size and read the new fields as absent.
#pragma once

#include <loom/kinds/optimizer.h>

#include <cstddef>
#include <cstdint>

namespace loom_test {

struct TensorV10 {
  uint32_t struct_size;  // 32
  uint32_t reserved;
  DLTensor* param;
  const DLTensor* grad;
  DLTensor* master;
};
struct GroupV10 {
  uint32_t struct_size;  // 40
  uint32_t reserved;
  const void* tensors;  // TensorV10[tensor_count]
  size_t tensor_count;
  double lr_scale;
  double weight_decay;
};
static_assert(sizeof(TensorV10) == 32 && sizeof(GroupV10) == 40, "ABI 1.0 sizes");

}  // namespace loom_test
