#!/usr/bin/python3
"""docs/embedding.md's Python example runs as written against an installed Loom.

Usage: embedding_snippet.py CMAKE BUILD_DIR SOURCE_DIR

Installs BUILD_DIR into a temporary prefix (cmake --install), takes the ```python block
from docs/embedding.md and the output the doc promises ("it prints `...`" after the
block), and runs the block with /usr/bin/python3 from an empty folder, with LOOM_PREFIX set
to the prefix and nothing else pointing at Loom (no LD_LIBRARY_PATH, no LOOM_PLUGIN_PATH).
Exit status 0 when it prints exactly what the doc says.
"""
import os
import re
import subprocess
import sys
import tempfile


def main():
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    cmake, build, src = sys.argv[1:]
    doc = os.path.join(src, "docs", "embedding.md")
    text = open(doc, encoding="utf-8").read()
    found = list(re.finditer(r"^```python\n(.*?)^```\n", text, re.S | re.M))
    if len(found) != 1:
        raise SystemExit(f"{doc}: expected one ```python block, found {len(found)}")
    snippet = found[0].group(1)
    promised = re.search(r"prints `([^`]+)`", text[found[0].end():])
    if promised is None:
        raise SystemExit(f"{doc}: no \"prints `...`\" after the ```python block says what it prints")
    expected = promised.group(1)

    with tempfile.TemporaryDirectory(prefix="loom-embed-") as tmp:
        prefix = os.path.join(tmp, "prefix")
        p = subprocess.run([cmake, "--install", build, "--prefix", prefix], capture_output=True,
                           text=True)
        if p.returncode != 0:
            raise SystemExit(f"cmake --install {build} failed:\n{p.stdout}{p.stderr}")
        work = os.path.join(tmp, "work")
        os.makedirs(work)
        path = os.path.join(work, "example.py")
        with open(path, "w") as f:
            f.write(snippet)
        env = {k: v for k, v in os.environ.items()
               if k not in ("LD_LIBRARY_PATH", "LOOM_PLUGIN_PATH", "LOOM_LOG_LEVEL")
               and not k.startswith("PYTHON")}
        env["LOOM_PREFIX"] = prefix
        p = subprocess.run(["/usr/bin/python3", path], cwd=work, env=env, capture_output=True,
                           text=True, timeout=120)
        out = p.stdout.strip()
        if p.returncode != 0 or out != expected:
            raise SystemExit(f"{doc}: the Python example (exit {p.returncode}) printed\n"
                             f"  {out!r}\nwhere the doc says it prints\n  {expected!r}\n"
                             f"stderr:\n{p.stderr}")
        print(f"docs/embedding.md's Python example against {prefix}: printed {out!r}, as the doc says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
