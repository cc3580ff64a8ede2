#!/usr/bin/python3
"""Every ```toml block of the project's docs passes `loom check`, as written.

Usage: check_toml_blocks.py LOOM PLUGIN_DIR SOURCE_DIR

Reads README.md, docs/*.md and sdk/*/README.md under SOURCE_DIR. Each ```toml block is
written to its own temporary folder and checked with `LOOM check FILE --plugin-path
PLUGIN_DIR`:

- a Loom manifest: relative `plugin_path` entries are created (empty) beside the file, so
  they resolve as they would for a reader who saved the block and pointed --plugin-path at
  the build's plugins;
- a trainer config (a top-level [manifest] table naming a manifest file): the manifest it
  names is copied beside it from examples/, where the reference configs live.

Errors are reported at the doc's own line (DOC:LINE:COL). Exit status 0 when every block
passes, 1 otherwise.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

FENCE = re.compile(r"^(\s*)```\s*([A-Za-z0-9_+-]*)\s*$")


def blocks(path):
    """(language, first line of the block's text (1-based), text) for each fenced block."""
    found = []
    lines = open(path, encoding="utf-8").read().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start, body = m.group(2).lower(), i + 2, []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise SystemExit(f"{path}:{start - 1}: unterminated ``` fence")
        found.append((lang, start, "\n".join(body) + "\n"))
        i += 1
    return found


def run_check(loom, plugin_dir, path):
    env = dict(os.environ)
    env.pop("LOOM_PLUGIN_PATH", None)  # only the build's plugins, and the block's own folders
    env["LOOM_LOG_LEVEL"] = "error"
    env.setdefault("UCX_LOG_LEVEL", "error")
    try:
        p = subprocess.run([loom, "check", path, "--plugin-path", plugin_dir], env=env,
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return 124, "loom check did not finish in 60 s"
    return p.returncode, (p.stdout + p.stderr).strip()


def relocate(output, path, doc, first_line):
    """Rewrites TMPFILE:LINE:COL as DOC:LINE':COL, LINE' being the doc's line."""
    def sub(m):
        return f"{doc}:{first_line + int(m.group(1)) - 1}:{m.group(2)}"
    return re.sub(re.escape(path) + r":(\d+):(\d+)", sub, output).replace(path, doc)


def prepare_dataset(loom, home, data):
    """A trainer config's dataset, made where the config names it (a small generated corpus),
    so that `loom check` can validate the dataset as it would on a user's machine."""
    named = data.get("data", {}).get("dataset")
    if not isinstance(named, str) or os.path.isabs(named):
        return None
    target = os.path.normpath(os.path.join(home, named))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    corpus = os.path.join(home, "corpus.txt")
    words = ["loom", "weaves", "plugins", "into", "one", "run", "of", "the", "trainer", "a"]
    with open(corpus, "w") as f:
        for i in range(20000):
            f.write(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8)) + "\n")
    p = subprocess.run([loom, "data", "prepare", "--input", corpus, "--output", target,
                        "--heldout-fraction", "0.1"], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return f"loom data prepare for {named} failed:\n{p.stdout}{p.stderr}"
    return None


def place_manifest(tmp, data):
    """The folder to write a manifest in: deep enough that every relative plugin_path entry
    (even ../x) lands inside tmp, with each entry created."""
    entries = [e for e in data.get("loom", {}).get("plugin_path", []) if isinstance(e, str)]
    depth = 0
    for e in entries:
        if not os.path.isabs(e):
            depth = max(depth, sum(1 for part in e.split("/") if part == ".."))
    home = os.path.join(tmp, *[f"d{k}" for k in range(depth)]) if depth else tmp
    os.makedirs(home, mode=0o755, exist_ok=True)
    for e in entries:
        if not os.path.isabs(e):
            os.makedirs(os.path.normpath(os.path.join(home, e)), mode=0o755, exist_ok=True)
    return home


def main():
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    loom, plugin_dir, src = sys.argv[1:]
    for p, what in ((loom, "loom"), (plugin_dir, "plugin folder")):
        if not os.path.exists(p):
            raise SystemExit(f"check_toml_blocks: no {what} at {p}")
    os.umask(0o022)  # the host refuses plugin folders that others can write to

    docs = [os.path.join(src, "README.md")] + sorted(glob.glob(os.path.join(src, "docs", "*.md")))
    docs += sorted(glob.glob(os.path.join(src, "sdk", "*", "README.md")))
    failures, checked = [], []
    with tempfile.TemporaryDirectory(prefix="loom-docs-") as root:
        # The harness itself: a block the checker must reject, reported at the doc's line.
        bad_dir = os.path.join(root, "self-test")
        os.makedirs(bad_dir)
        bad = os.path.join(bad_dir, "bad.toml")
        with open(bad, "w") as f:
            f.write('[optimizer.main]\nplugin = "adam"\nlr_decay = 0.1\n')
        rc, out = run_check(loom, plugin_dir, bad)
        out = relocate(out, bad, "SELF", 10)
        if rc != 2 or "SELF:12:1: unknown parameter 'lr_decay'" not in out:
            raise SystemExit("check_toml_blocks: the harness is broken: a manifest with an "
                             f"unknown parameter gave exit status {rc} and:\n{out}")

        for doc_path in docs:
            doc = os.path.relpath(doc_path, src)
            for n, (lang, line, text) in enumerate(blocks(doc_path)):
                if lang != "toml":
                    continue
                where = f"{doc}:{line - 1}"
                try:
                    data = tomllib.loads(text)
                except tomllib.TOMLDecodeError as e:
                    failures.append(f"{where}: the ```toml block is not valid TOML: {e}")
                    continue
                tmp = os.path.join(root, f"{len(checked):03d}")
                os.makedirs(tmp)
                trainer = isinstance(data.get("manifest"), dict)
                kind = "trainer config" if trainer else "Loom manifest"
                if trainer:
                    home = tmp
                    named = data["manifest"].get("path")
                    if isinstance(named, str) and not os.path.isabs(named):
                        source = os.path.join(src, "examples", named)
                        if not os.path.isfile(source):
                            failures.append(f"{where}: trainer config names manifest '{named}', "
                                            f"which is not in examples/")
                            continue
                        os.makedirs(os.path.dirname(os.path.join(home, named)) or home,
                                    exist_ok=True)
                        shutil.copyfile(source, os.path.join(home, named))
                    problem = prepare_dataset(loom, home, data)
                    if problem:
                        failures.append(f"{where}: {problem}")
                        continue
                else:
                    home = place_manifest(tmp, data)
                path = os.path.join(home, f"block{n}.toml")
                with open(path, "w") as f:
                    f.write(text)
                rc, out = run_check(loom, plugin_dir, path)
                out = relocate(out, path, doc, line)
                checked.append(f"{where}: {kind}: " + ("ok" if rc == 0 else f"FAILED (exit {rc})"))
                if rc == 0:
                    continue
                msg = f"{where}: this ```toml block ({kind}) fails `loom check` (exit {rc}):\n"
                msg += "\n".join("    " + s for s in out.splitlines())
                if trainer and re.search(r"unknown (section|table) '?manifest", out):
                    msg += ("\n    -> `loom check` still reads this trainer config as a Loom "
                            "manifest: it does not yet recognise the [manifest] table of "
                            "trainer configs")
                failures.append(msg)

    print("toml blocks checked:")
    for c in checked:
        print("  " + c)
    if not checked:
        failures.append("no ```toml blocks found: the extraction is broken")
    if failures:
        print("\n" + "\n\n".join(failures), file=sys.stderr)
        print(f"\n{len(failures)} of {len(checked)} blocks failed", file=sys.stderr)
        return 1
    print(f"all {len(checked)} blocks pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
