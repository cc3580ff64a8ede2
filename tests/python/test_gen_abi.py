"""bindings/python/gen_abi.py, the generator of loom/_abi/: it reads the kinds from
kinds/kinds.def when there is one, and stops with the header and line at C it does not
understand instead of guessing a layout."""
import importlib.util
import os
import shutil

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location(
        "gen_abi", os.path.join(ROOT, "bindings", "python", "gen_abi.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def text_of(gen, root):
    return "".join(gen.generate(str(root)).values())


@pytest.fixture
def root(tmp_path):
    """A copy of the headers gen_abi.py reads."""
    for part in (os.path.join("abi", "include", "loom"), os.path.join("host", "include", "loom")):
        shutil.copytree(os.path.join(ROOT, part), tmp_path / part)
    return tmp_path


def test_the_kinds_come_from_kinds_def_when_it_exists(gen, root):
    kinds = root / "abi" / "include" / "loom" / "kinds"
    assert "KIND_SAMPLER = " in text_of(gen, root)  # no kinds.def: every kinds/*.h
    (kinds / "kinds.def").write_text(
        "/* the kinds, one a line */\n#include <loom/kinds/sampler.h>\n\n"
        "#include <loom/kinds/optimizer.h>  // a comment\n", encoding="utf-8")
    text = text_of(gen, root)
    assert [ln.split()[0] for ln in text.splitlines() if ln.startswith("KIND_")] == \
        ["KIND_SAMPLER", "KIND_OPTIMIZER"]
    (kinds / "kinds.def").write_text("#include <loom/kinds/sampler.h>\nKIND(moe)\n",
                                     encoding="utf-8")
    with pytest.raises(gen.HeaderError, match=r"kinds\.def:2: 'KIND\(moe\)'"):
        gen.generate(str(root))


@pytest.mark.parametrize("decl,line,what", [
    ("typedef struct loom_x {\n  uint32_t struct_size;\n  uint32_t bits : 3;\n} loom_x;\n",
     3, "'uint32_t bits : 3' is not understood"),
    ("typedef struct loom_x {\n  uint32_t struct_size;\n  long long n;\n} loom_x;\n",
     3, "type 'long long'"),
    ("typedef struct loom_x {\n  uint32_t struct_size;\n  loom_nothing* p;\n} loom_x;\n",
     3, "unknown type loom_nothing"),
    ("typedef struct loom_x {\n  int32_t n;\n} loom_x;\n", 1, "uint32_t struct_size"),
    ("typedef union loom_x {\n  uint32_t struct_size;\n} loom_x;\n", 1, "typedef union {...}"),
    ("#define LOOM_X_SIZE sizeof(loom_status)\n", 1, "'sizeof'"),
    ("#define LOOM_X(a) (a)\n", 1, "function-like macro LOOM_X"),
    ("#if LOOM_ABI_MINOR > 4\n#endif\n", 1, "only `#if defined"),
    ("#pragma pack(1)\n", 1, "#pragma"),
])
def test_what_it_does_not_understand_stops_it_with_the_line(gen, root, decl, line, what):
    h = root / "abi" / "include" / "loom" / "kinds" / "sampler.h"
    text = h.read_text(encoding="utf-8")
    at = text.index("#ifdef __cplusplus\n}")  # inside extern "C", before the guard's end
    h.write_text(text[:at] + decl + text[at:], encoding="utf-8")
    first = text[:at].count("\n") + line
    with pytest.raises(gen.HeaderError) as e:
        gen.generate(str(root))
    assert f"abi/include/loom/kinds/sampler.h:{first}: " in str(e.value)
    assert what in str(e.value)


def test_check_mode_reports_an_edited_or_stale_file(gen, root, tmp_path, capsys):
    pkg = tmp_path / "loom"
    args = ["--root", str(root), "--package", str(pkg)]
    assert gen.main(args) == 0
    assert gen.main(args + ["--check"]) == 0
    moe = pkg / "_abi" / "kinds" / "moe.py"
    moe.write_text(moe.read_text(encoding="utf-8") + "# edited by hand\n", encoding="utf-8")
    assert gen.main(args + ["--check"]) == 1
    assert "_abi/kinds/moe.py" in capsys.readouterr().err
    assert gen.main(args) == 0 and "edited" not in moe.read_text(encoding="utf-8")
    (pkg / "_abi" / "kinds" / "gone.py").write_text("", encoding="utf-8")  # a removed kind's
    assert gen.main(args + ["--check"]) == 1
    assert "_abi/kinds/gone.py" in capsys.readouterr().err
    assert gen.main(args) == 0 and not (pkg / "_abi" / "kinds" / "gone.py").exists()


def test_two_c_names_for_one_python_name_stop_it(gen, root):
    """loom._abi gathers every module's names: LOOM_ERR_X and LOOM_X would both be X."""
    h = root / "abi" / "include" / "loom" / "kinds" / "sampler.h"
    text = h.read_text(encoding="utf-8")
    at = text.index("#ifdef __cplusplus\n}")
    h.write_text(text[:at] + "#define LOOM_NOT_FOUND 7\n" + text[at:], encoding="utf-8")
    with pytest.raises(gen.HeaderError, match=r"sampler\.h:\d+: NOT_FOUND is also the Python "
                                              r"name of abi/include/loom/abi\.h:\d+"):
        gen.generate(str(root))
