"""The ctypes mirrors in loom._abi against the C headers: every struct's size and every
field's offset as a C compiler lays them out (skipped without a C compiler). loom/_abi is
generated from the headers (bindings/python/gen_abi.py); this checks the generator's layouts,
for the structs listed here and for every struct it wrote."""
import ctypes
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT
from loom import _abi

# (ctypes struct, C type, header)
STRUCTS = [
    (_abi.CurriculumPlanArgs, "loom_curriculum_plan_args", "loom/kinds/curriculum.h"),
    (_abi.CurriculumSamples, "loom_curriculum_samples", "loom/kinds/curriculum.h"),
    (_abi.CurriculumCountArgs, "loom_curriculum_count_args", "loom/kinds/curriculum.h"),
    (_abi.CurriculumScoreArgs, "loom_curriculum_score_args", "loom/kinds/curriculum.h"),
    (_abi.CurriculumAtArgs, "loom_curriculum_at_args", "loom/kinds/curriculum.h"),
    (_abi.CurriculumV1, "loom_curriculum_v1", "loom/kinds/curriculum.h"),
    (_abi.MoePlanArgs, "loom_moe_plan_args", "loom/kinds/moe.h"),
    (_abi.MoeWeights, "loom_moe_weights", "loom/kinds/moe.h"),
    (_abi.MoeStats, "loom_moe_stats", "loom/kinds/moe.h"),
    (_abi.MoeForwardArgs, "loom_moe_forward_args", "loom/kinds/moe.h"),
    (_abi.MoeBackwardArgs, "loom_moe_backward_args", "loom/kinds/moe.h"),
    (_abi.MoeDispatchArgs, "loom_moe_dispatch_args", "loom/kinds/moe.h"),
    (_abi.MoeReduceArgs, "loom_moe_reduce_args", "loom/kinds/moe.h"),
    (_abi.MoeV1, "loom_moe_v1", "loom/kinds/moe.h"),
    (_abi.QuantFormat, "loom_quant_format", "loom/quant_format.h"),
    (_abi.QuantizerLayoutArgs, "loom_quantizer_layout_args", "loom/kinds/quantizer.h"),
    (_abi.QuantizerQuantizeArgs, "loom_quantizer_quantize_args", "loom/kinds/quantizer.h"),
    (_abi.QuantizerMatmulArgs, "loom_quantizer_matmul_args", "loom/kinds/quantizer.h"),
    (_abi.QuantizerV1, "loom_quantizer_v1", "loom/kinds/quantizer.h"),
    (_abi.RouterPlanArgs, "loom_router_plan_args", "loom/kinds/router.h"),
    (_abi.RouterSelectArgs, "loom_router_select_args", "loom/kinds/router.h"),
    (_abi.RouterBackwardArgs, "loom_router_backward_args", "loom/kinds/router.h"),
]
# Every other struct gen_abi.py wrote: its docstring names the C struct and the header.
_listed = {c for _, c, _ in STRUCTS}
for _name, _cls in sorted(vars(_abi).items()):
    if not (isinstance(_cls, type) and issubclass(_cls, ctypes.Structure)):
        continue
    _m = re.fullmatch(r"(loom_\w+) \((?:abi|host)/include/(loom/[\w/]+\.h)\)\.",
                      _cls.__doc__ or "")
    if _m and _m.group(1) not in _listed:
        STRUCTS.append((_cls, _m.group(1), _m.group(2)))

# The Python constants against the header's macros: (python value, C expression).
CONSTANTS = [
    (_abi.CURRICULUM_PLAN_ARGS_SIZE, "LOOM_CURRICULUM_PLAN_ARGS_SIZE"),
    (_abi.CURRICULUM_SAMPLES_SIZE, "LOOM_CURRICULUM_SAMPLES_SIZE"),
    (_abi.CURRICULUM_COUNT_ARGS_SIZE, "LOOM_CURRICULUM_COUNT_ARGS_SIZE"),
    (_abi.CURRICULUM_SCORE_ARGS_SIZE, "LOOM_CURRICULUM_SCORE_ARGS_SIZE"),
    (_abi.CURRICULUM_AT_ARGS_SIZE, "LOOM_CURRICULUM_AT_ARGS_SIZE"),
    (_abi.CURRICULUM_V1_SIZE, "LOOM_CURRICULUM_V1_SIZE"),
    (_abi.CURRICULUM_METRIC, "LOOM_CURRICULUM_METRIC"),
    (_abi.CURRICULUM_SCHEDULE, "LOOM_CURRICULUM_SCHEDULE"),
    (_abi.SEQ_LEN_NONE, "LOOM_SEQ_LEN_NONE"),
    (_abi.SEQ_LEN_TRUNCATE, "LOOM_SEQ_LEN_TRUNCATE"),
    (_abi.SEQ_LEN_RESHAPE, "LOOM_SEQ_LEN_RESHAPE"),
    (_abi.MOE_PLAN_ARGS_SIZE, "LOOM_MOE_PLAN_ARGS_SIZE"),
    (_abi.MOE_WEIGHTS_SIZE, "LOOM_MOE_WEIGHTS_SIZE"),
    (_abi.MOE_STATS_SIZE, "LOOM_MOE_STATS_SIZE"),
    (_abi.MOE_FORWARD_ARGS_SIZE, "LOOM_MOE_FORWARD_ARGS_SIZE"),
    (_abi.MOE_BACKWARD_ARGS_SIZE, "LOOM_MOE_BACKWARD_ARGS_SIZE"),
    (_abi.MOE_DISPATCH_ARGS_SIZE, "LOOM_MOE_DISPATCH_ARGS_SIZE"),
    (_abi.MOE_REDUCE_ARGS_SIZE, "LOOM_MOE_REDUCE_ARGS_SIZE"),
    (_abi.MOE_V1_SIZE, "LOOM_MOE_V1_SIZE"),
    (_abi.QUANT_FORMAT_SIZE, "LOOM_QUANT_FORMAT_SIZE"),
    (_abi.QUANTIZER_LAYOUT_ARGS_SIZE, "LOOM_QUANTIZER_LAYOUT_ARGS_SIZE"),
    (_abi.QUANTIZER_QUANTIZE_ARGS_SIZE, "LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE"),
    (_abi.QUANTIZER_MATMUL_ARGS_SIZE, "LOOM_QUANTIZER_MATMUL_ARGS_SIZE"),
    (_abi.QUANTIZER_V1_SIZE, "LOOM_QUANTIZER_V1_SIZE"),
    (_abi.MOE_RESIDUAL, "LOOM_MOE_RESIDUAL"),
    (_abi.MOE_DROPLESS, "LOOM_MOE_DROPLESS"),
    (_abi.MOE_EXPERT_BIAS, "LOOM_MOE_EXPERT_BIAS"),
    (_abi.MOE_EXPERT_PARALLEL, "LOOM_MOE_EXPERT_PARALLEL"),
    (_abi.QUANT_INT, "LOOM_QUANT_INT"),
    (_abi.QUANT_BINARY, "LOOM_QUANT_BINARY"),
    (_abi.QUANT_TERNARY, "LOOM_QUANT_TERNARY"),
    (_abi.QUANT_PACK_LSB_FIRST, "LOOM_QUANT_PACK_LSB_FIRST"),
    (_abi.QUANT_PACK_MSB_FIRST, "LOOM_QUANT_PACK_MSB_FIRST"),
    (_abi.QUANT_SYMMETRIC, "LOOM_QUANT_SYMMETRIC"),
    (_abi.QUANTIZER_WEIGHT, "LOOM_QUANTIZER_WEIGHT"),
    (_abi.QUANTIZER_ACTIVATION, "LOOM_QUANTIZER_ACTIVATION"),
    (_abi.QUANTIZER_HAS_MATMUL, "LOOM_QUANTIZER_HAS_MATMUL"),
    (_abi.QUANTIZER_INT8_ACTIVATIONS, "LOOM_QUANTIZER_INT8_ACTIVATIONS"),
] + [(k, f"LOOM_MOE_{v.upper()}") for k, v in _abi.MOE_ACTIVATION_NAMES.items()]


def _generated_constants():
    """Every integer, enum and size constant gen_abi.py read from the headers, as
    (python value, C name), and the headers they need."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "gen_abi", os.path.join(ROOT, "bindings", "python", "gen_abi.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    model = gen.Model()
    for rel in gen.headers(ROOT):
        gen.read_header(os.path.join(ROOT, rel), rel, model)
    out = [(getattr(_abi, gen.py_const(n)), n) for n, c in model.macros.items()
           if c.kind in ("int", "size", "alias")]
    return out, [h.split("include/", 1)[1] for h in gen.headers(ROOT)]


GENERATED_CONSTANTS, GENERATED_HEADERS = _generated_constants()
CONSTANTS += GENERATED_CONSTANTS


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("clang") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler to read the headers' layouts with")
    d = tmp_path_factory.mktemp("abi")
    headers = sorted({h for _, _, h in STRUCTS} | set(GENERATED_HEADERS))
    lines = ["#include <stddef.h>", "#include <stdio.h>"]
    lines += [f"#include <{h}>" for h in headers]
    lines.append("int main(void) {")
    for py, c, _ in STRUCTS:
        # "#size": not a C name, so a field called size (loom_bootstrap's) cannot clash
        lines.append(f'  printf("{c} #size %zu\\n", sizeof({c}));')
        for name, _t in py._fields_:
            lines.append(f'  printf("{c} {name} %zu\\n", offsetof({c}, {name}));')
    for i, (_v, expr) in enumerate(CONSTANTS):
        lines.append(f'  printf("const {i} %lld\\n", (long long)({expr}));')
    lines.append("  return 0;\n}")
    src = d / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = d / "layout"
    r = subprocess.run([cc, "-std=c11", "-I", os.path.join(ROOT, "abi", "include"), "-I",
                        os.path.join(ROOT, "host", "include"), str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    table = {}
    for line in out.splitlines():
        a, b, v = line.split()
        table[(a, b)] = int(v)
    return table


@pytest.mark.parametrize("py,c", [(p, c) for p, c, _ in STRUCTS], ids=[c for _, c, _ in STRUCTS])
def test_struct_matches_header(c_layout, py, c):
    assert ctypes.sizeof(py) == c_layout[(c, "#size")], f"sizeof({c})"
    for name, _t in py._fields_:
        assert getattr(py, name).offset == c_layout[(c, name)], f"offsetof({c}, {name})"


def test_constants_match_header(c_layout):
    for i, (value, expr) in enumerate(CONSTANTS):
        assert value == c_layout[("const", str(i))], expr


def test_every_kind_header_is_mirrored():
    """gen_abi.py read every kind: each kind header's LOOM_KIND_* ID is in _abi."""
    kinds = os.path.join(ROOT, "abi", "include", "loom", "kinds")
    for h in sorted(os.listdir(kinds)):
        if h.endswith(".h"):
            name = h[:-2].upper()
            assert getattr(_abi, f"KIND_{name}", None) == f"loom.{h[:-2]}/1", h


def test_abi_is_what_the_generator_writes():
    """loom/_abi/ is exactly what bindings/python/gen_abi.py writes from today's headers
    (as the ctest python.abi_generated checks, here for pytest runs too)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "gen_abi", os.path.join(ROOT, "bindings", "python", "gen_abi.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    package = os.path.dirname(os.path.dirname(os.path.abspath(_abi.__file__)))  # loom/
    assert gen.on_disk(package) == gen.generate(ROOT), \
        "loom/_abi is out of date: run python3 bindings/python/gen_abi.py"


def test_no_generated_module_nears_the_size_limit():
    """A module a header keeps each file far below the project's 1,000 lines."""
    folder = os.path.dirname(os.path.abspath(_abi.__file__))
    for d, _dirs, files in os.walk(folder):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    assert sum(1 for _ in fh) < 500, f
