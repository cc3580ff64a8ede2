// What the trainer hands the moe and quantizer plugin kinds in bf16 mode ([train] precision =
// "bf16", docs/trainer.md "bf16 mode"): the one switch between the two ways.
#pragma once

#include <loom/embed.h>

namespace loom::trainer {

// false: float32 tensors whose values are bf16 (the trainer rounds the weights and the
// activations itself), because the kinds refuse kDLBfloat in this release.
// true: kDLBfloat tensors (16 bits) for the activations and the weights, fp32 accumulation in
// the plugin; the moe kind's weight gradients stay float32 (the master weights' grads).
inline constexpr bool kPluginsTakeBf16 = false;

inline constexpr DLDataType kPluginF32{kDLFloat, 32, 1};
inline constexpr DLDataType kPluginBf16{kDLBfloat, 16, 1};

// The dtype of the activations and weights a plugin call gets in this precision.
inline constexpr DLDataType plugin_dtype(bool bf16) {
  return bf16 && kPluginsTakeBf16 ? kPluginBf16 : kPluginF32;
}

}  // namespace loom::trainer
