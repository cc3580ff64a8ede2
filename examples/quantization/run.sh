#!/bin/sh
# The quantization runs docs/RESULTS.md reports, in order, from the repository root (after
# the build and build/data/fortunes.bin; see docs/RESULTS.md). Then:
#   python3 examples/quantization/report.py build
set -e
B=build/release/bin/loom
FP32=build/runs/quant_fp32/checkpoints/step_00000500/model.rank0.safetensors
[ -f "$FP32" ] || $B train examples/quantization/fp32.toml --fresh --no-plot
mkdir -p build/quant
# Post-training quantization: the fp32 weights per each scheme's manifest, then evaluated.
for s in ternary binary w8a8 w4a8; do
  $B quantize examples/quantization/$s.toml "$FP32" build/quant/$s.safetensors
done
# XTC: quantization-aware fine-tuning with one-step distillation, then its weights quantized.
for s in ternary binary; do
  $B train examples/quantization/${s}_qat.toml --fresh --no-plot
  $B quantize examples/quantization/$s.toml \
    build/runs/quant_${s}_qat/checkpoints/step_00000100/model.rank0.safetensors \
    build/quant/${s}_qat.safetensors
done
for f in ternary binary ternary_qat binary_qat w8a8 w4a8; do
  $B train examples/quantization/eval.toml --eval-only --weights build/quant/$f.safetensors \
    --run-dir build/runs/quant_eval_$f
done
# ZeroQuant's LKD for W4A8, its distilled weights quantized and evaluated the same way.
$B train examples/quantization/w4a8_lkd.toml --eval-only
$B quantize examples/quantization/w4a8.toml build/runs/quant_w4a8_lkd/lkd.safetensors \
  build/quant/w4a8_lkd.safetensors
$B train examples/quantization/eval.toml --eval-only --weights build/quant/w4a8_lkd.safetensors \
  --run-dir build/runs/quant_eval_w4a8_lkd
# The fp32 model on the same windows, and the control of the QAT runs: the same 100 steps of
# distillation in float.
$B train examples/quantization/eval.toml --eval-only --weights "$FP32" \
  --run-dir build/runs/quant_eval_fp32
$B train examples/quantization/fp32_kd.toml --fresh --no-plot
$B train examples/quantization/eval.toml --eval-only \
  --weights build/runs/quant_fp32_kd/checkpoints/step_00000100/model.rank0.safetensors \
  --run-dir build/runs/quant_eval_fp32_kd
# W4A8 with one scale per row (a harder INT4 setting), without and with LKD.
$B quantize examples/quantization/w4a8_row.toml "$FP32" build/quant/w4a8_row.safetensors
$B train examples/quantization/eval.toml --eval-only --weights build/quant/w4a8_row.safetensors \
  --run-dir build/runs/quant_eval_w4a8_row
$B train examples/quantization/w4a8_row_lkd.toml --eval-only
$B quantize examples/quantization/w4a8_row.toml build/runs/quant_w4a8_row_lkd/lkd.safetensors \
  build/quant/w4a8_row_lkd.safetensors
$B train examples/quantization/eval.toml --eval-only \
  --weights build/quant/w4a8_row_lkd.safetensors --run-dir build/runs/quant_eval_w4a8_row_lkd
