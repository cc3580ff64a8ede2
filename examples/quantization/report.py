"""The figures docs/RESULTS.md quotes for the quantization runs, from what `loom train` and
`loom quantize` wrote (examples/quantization/run.sh runs them all):

- per scheme (fp32; W8A8 and W4A8 through zeroquant's INT8 GEMM, W4A8 after ZeroQuant's LKD;
  ternary and binary through xtc's packed kernels, post-training and after QAT with one-step
  distillation; the float control of the QAT runs): the eval loss and perplexity of the
  `loom quantize` file evaluated through the quantizers' matmuls (`loom train
  examples/quantization/eval.toml --eval-only --weights FILE`, RUN_DIR/eval.json), its
  change against fp32 and against the control, the same codes decoded through the float
  matmuls, the file's size and its ratio to the fp32 checkpoint's, and the ratio over the
  quantized tensors alone (float32 bytes / codes + scales + zero points);
- LKD's per-block output MSE before and after its steps;
- the QAT runs' own evaluations (their blocks quantized in memory, the head float) and the
  last logged loss terms.

    python3 examples/quantization/report.py build
"""
import json
import os
import sys

ROWS = [  # (eval run, label, file)
    ("fp32", "fp32", None),
    ("w8a8", "W8A8 (zeroquant, INT8 GEMM)", "w8a8"),
    ("w4a8", "W4A8 (zeroquant, groups of 64)", "w4a8"),
    ("w4a8_lkd", "W4A8 + LKD (50 steps a block)", "w4a8_lkd"),
    ("w4a8_row", "W4A8, one scale per row", "w4a8_row"),
    ("w4a8_row_lkd", "W4A8, one scale per row, + LKD", "w4a8_row_lkd"),
    ("ternary", "ternary, post-training (xtc)", "ternary"),
    ("binary", "binary, post-training (xtc)", "binary"),
    ("ternary_qat", "ternary, QAT + KD, 100 steps", "ternary_qat"),
    ("binary_qat", "binary, QAT + KD, 100 steps", "binary_qat"),
    ("fp32_kd", "control: fp32 + the same 100 steps of KD", None),
]


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    runs = os.path.join(build, "runs")
    fp32_file = os.path.join(runs, "quant_fp32", "checkpoints", "step_00000500",
                             "model.rank0.safetensors")
    fp32_bytes = os.path.getsize(fp32_file)
    ev = {}
    for name, _, _ in ROWS:
        p = os.path.join(runs, "quant_eval_" + name, "eval.json")
        if os.path.exists(p):
            ev[name] = load(p)
    base = ev["fp32"]["eval_ppl"]
    control = ev.get("fp32_kd", {}).get("eval_ppl")
    print(f"fp32 checkpoint: {fp32_bytes} bytes; eval on {16 * 128} heldout tokens "
          "(eval.toml: eval_batches 1 x batch_size 16 x seq_len 128)\n")
    print("| scheme | eval loss | perplexity | vs fp32 | vs control | decoded, float matmuls | "
          "file | smaller | quantized tensors smaller | quantized matmul calls |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, label, f in ROWS:
        if name not in ev:
            print(f"| {label} | (not run) |")
            continue
        e = ev[name]
        ppl = e["eval_ppl"]
        vs = f"{100 * (ppl / base - 1):+.2f}%"
        vc = f"{100 * (ppl / control - 1):+.2f}%" if control and "qat" in name else ""
        if f is None:
            size, ratio, qratio, deq = "", "", "", ""
        else:
            b = os.path.getsize(os.path.join(build, "quant", f + ".safetensors"))
            size = f"{b / 1024:.1f} KiB"
            ratio = f"{fp32_bytes / b:.2f}x"
            qratio = f"{e['float_bytes'] / e['packed_bytes']:.2f}x"
            deq = f"{e['dequantized_eval_ppl']:.3f}"
        print(f"| {label} | {e['eval_loss']:.4f} | {ppl:.3f} | {vs} | {vc} | {deq} | {size} | "
              f"{ratio} | {qratio} | {e.get('quantized_matmuls', 0)} |")
    print(f"\nfp32 checkpoint: {fp32_bytes / 1024:.1f} KiB")
    for run in ("quant_w4a8_lkd", "quant_w4a8_row_lkd"):
        lkd = os.path.join(runs, run, "eval.json")
        if not os.path.exists(lkd):
            continue
        e = load(lkd)
        print(f"\nLKD ({run}): block output MSE against the fp32 teacher, first batch")
        print("| block | before | after | ratio |")
        print("|---|---|---|---|")
        for r in e["lkd"]:
            print(f"| {r['layer']} | {r['mse_before']:.3g} | {r['mse_after']:.3g} | "
                  f"{r['mse_before'] / r['mse_after']:.1f}x |")
        print(f"in-memory W4A8 eval after LKD: perplexity {e['eval_ppl']:.3f} "
              f"(fp32 {e['fp32_eval_ppl']:.3f})")
    for name in ("ternary_qat", "binary_qat", "fp32_kd"):
        d = os.path.join(runs, "quant_" + name)
        if not os.path.exists(os.path.join(d, "summary.json")):
            continue
        s = load(os.path.join(d, "summary.json"))
        train = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
        evals = [t for t in train if t["type"] == "eval"]
        last = [t for t in train if t["type"] == "train"][-1]
        print(f"\n{name}: in-run evals (blocks {s['quantizer']} in memory, head float): " +
              ", ".join(f"step {t['step']} ppl {t['eval_ppl']:.3f}" for t in evals) +
              f"; float weights at the end: ppl {2.718281828459045 ** s['final_fp32_eval_loss']:.3f}"
              f"; last step's terms: CE {last['kd_ce']:.4f}, soft CE {last['kd_soft_ce']:.4f}, "
              f"hidden MSE {last['kd_hidden_mse']:.4g}; {s['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
