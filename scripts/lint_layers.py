#!/usr/bin/env python3
"""The layer lint: includes that cross Loom's layers the wrong way, and files over 1,000 lines.

Layers (abi <- sdk <- plugins; the host; clients on public headers only):
  abi/      includes only <stdint.h>, <stddef.h>, <dlpack/dlpack.h> and abi headers;
  sdk/      includes abi and sdk (and the standard library, third-party libraries);
  host/     never includes the SDK, plugins/, bench/, examples/ or the trainer;
  plugins/  never include host/ (bar its public host/include) or bench/, examples/, trainer/;
  bench/, examples/, trainer/: public headers only: abi, sdk, host/include, the shared
            program support headers (host/text, host/cli/support), a plugin core's declared
            include/loom/... folder, their own folder's headers, the standard library and
            third-party ones; never a plugin's private header or host/src, host/cli.
An include is resolved as the compiler would: a quoted one beside the including file first,
then against every folder of the tree (the include directories CMake hands out are folders
of the tree). Anything that resolves nowhere in the tree is a system or third-party header.

Size: no git-tracked source (*.c *.cc *.cpp *.h *.hpp *.cu *.cuh *.py *.sh) outside tests/
has over 1,000 lines. Vendored code (a third_party/, vendor/, external/ or _deps/ folder) and
generated files (marked "@generated" or "DO NOT EDIT" near the top) are left out of both checks.

Each finding is printed as FILE:LINE: message; the exit status is 1 when there is any.
--self-test runs the checks over the fixture tree tests/lint/fixtures/layers (plus a few
generated files) and checks that exactly the lines marked "LINT-EXPECT" there are found.
Python 3 standard library only.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

MAX_LINES = 1000
SIZE_EXTENSIONS = (".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".py", ".sh")
INCLUDE_EXTENSIONS = (".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".inc", ".def")
VENDORED_DIRS = {"third_party", "thirdparty", "3rdparty", "vendor", "vendored", "external", "_deps"}
GENERATED_MARKERS = ("@generated", "DO NOT EDIT")
ABI_SYSTEM_HEADERS = {"stdint.h", "stddef.h", "dlpack/dlpack.h"}
# Include roots whose headers are public to every client (bench/, examples/, the trainer).
PUBLIC_ROOTS = {"abi/include", "sdk/include", "host/include", "host/text", "host/cli/support"}
CLIENT_LAYERS = {"bench", "examples", "trainer"}

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def layer_of(path):
    """The layer a tree path belongs to (see the module doc)."""
    top, _, rest = path.partition("/")
    if top == "host":
        if path.startswith(("host/include/", "host/text/", "host/cli/support/")):
            return "host_public"
        return "host"
    if top == "plugins":
        return "plugin_public" if "/include/loom/" in path else "plugin"
    if top in ("abi", "sdk", "bench", "examples", "trainer", "tests"):
        return top
    return "other"


def is_public_root(root):
    """A folder that a client may have on its include path."""
    if root in PUBLIC_ROOTS:
        return True
    # A plugin core's declared interface: plugins/FAMILY[/CORE]/include.
    return root.startswith("plugins/") and root.endswith("/include")


def excluded(path, head):
    parts = path.split("/")
    if any(p in VENDORED_DIRS for p in parts[:-1]) or parts[0] == "build":
        return True
    return any(m in head for m in GENERATED_MARKERS)


def list_files(root):
    """The tree's files, relative to root: git's list where root is in a work tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--", "."], cwd=root,
                             capture_output=True, check=True)
        files = [f for f in out.stdout.decode().split("\0") if f]
        if files:
            return sorted(f for f in files if os.path.isfile(os.path.join(root, f)))
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            files.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(files)


class Tree:
    def __init__(self, root):
        self.root = root
        self.files = list_files(root)
        self.file_set = set(self.files)
        # By basename, so resolving an include looks at few candidates.
        self.by_name = {}
        for f in self.files:
            self.by_name.setdefault(f.rsplit("/", 1)[-1], []).append(f)

    def read(self, path):
        with open(os.path.join(self.root, path), encoding="utf-8", errors="replace") as fh:
            return fh.read().split("\n")

    def resolve(self, including, target, quoted):
        """(the tree files `target` may name, whether it reaches them through a public include
        root). No files: a system or third-party header. Headers under tests/ stand in for
        system ones (tests/cuda_emulation's CUDA runtime) and count as such."""
        if quoted:
            beside = os.path.normpath(os.path.join(os.path.dirname(including), target))
            beside = beside.replace(os.sep, "/")
            if beside in self.file_set:
                return [beside], False
            if target.startswith("../") or "/../" in target:
                return [], False  # leaves the tree, or names nothing: not ours to judge
        norm = os.path.normpath(target).replace(os.sep, "/")
        if norm.startswith("../"):
            return [], False
        found = []
        for f in self.by_name.get(norm.rsplit("/", 1)[-1], []):
            if (f == norm or f.endswith("/" + norm)) and not f.startswith("tests/"):
                found.append((f, f[: -len(norm)].rstrip("/")))
        public = [f for f, r in found if is_public_root(r)]
        if public:
            return public, True
        return [f for f, _ in found], False


def include_problem(src_layer, target, resolved, via_public_root):
    """Why an include from src_layer of `target` (resolving to `resolved`, through a public
    include root or not) is wrong, or None."""
    layers = {layer_of(r) for r in resolved}
    if src_layer == "abi":
        if target in ABI_SYSTEM_HEADERS or (resolved and layers == {"abi"}):
            return None
        return "abi/ includes only <stdint.h>, <stddef.h>, <dlpack/dlpack.h> and abi headers"
    if not resolved:
        return None  # the standard library or a third-party header
    if src_layer == "sdk":
        if layers <= {"abi", "sdk"}:
            return None
        return "sdk/ includes only abi and sdk headers, not " + resolved[0]
    if src_layer in ("host", "host_public"):
        bad = layers & {"sdk", "plugin", "plugin_public", "bench", "examples", "trainer"}
        if not bad:
            return None
        return "host/ never includes the SDK, plugins or clients: " + resolved[0]
    if src_layer in ("plugin", "plugin_public"):
        # A plugin may include the host's public C API only (not the programs' support).
        host_private = [r for r in resolved
                        if r.startswith("host/") and not r.startswith("host/include/")]
        if host_private or layers & {"bench", "examples", "trainer"}:
            return "plugins/ never include host internals or clients: " + resolved[0]
        return None
    if src_layer in CLIENT_LAYERS:
        # Flagged only when every file the include may name is private (a declared header
        # reached through a private include root, as "metric_index.hpp" would, is too).
        if not via_public_root and layers <= {"plugin", "plugin_public", "host"}:
            if layers & {"plugin", "plugin_public"}:
                private = [r for r in resolved if layer_of(r) == "plugin"] or resolved
                return (f"{src_layer}/ uses public headers only, not plugins' {private[0]}"
                        " (include a core's declared header as <loom/FAMILY/...>)")
            return f"{src_layer}/ uses public headers only, not the host's internal {resolved[0]}"
        return None
    return None


def check(root):
    """Every finding as (path, line, message)."""
    tree = Tree(root)
    findings = []
    for path in tree.files:
        size_checked = path.endswith(SIZE_EXTENSIONS) and not path.startswith("tests/")
        src_layer = layer_of(path)
        include_checked = path.endswith(INCLUDE_EXTENSIONS) and src_layer not in ("tests", "other")
        if not (size_checked or include_checked):
            continue
        lines = tree.read(path)
        if excluded(path, "\n".join(lines[:10])):
            continue
        count = len(lines) - (1 if lines and lines[-1] == "" else 0)
        if size_checked and count > MAX_LINES:
            findings.append((path, MAX_LINES + 1,
                             f"{count} lines, over the {MAX_LINES:,}-line limit: split the file"))
        if not include_checked:
            continue
        for number, text in enumerate(lines, 1):
            m = INCLUDE_RE.match(text)
            if not m:
                continue
            quoted, target = m.group(1) == '"', m.group(2).strip()
            problem = include_problem(src_layer, target, *tree.resolve(path, target, quoted))
            if problem:
                close = ">" if m.group(1) == "<" else '"'
                findings.append((path, number, f"#include {m.group(1)}{target}{close}: {problem}"))
    return findings


def report(findings):
    for path, line, message in findings:
        print(f"{path}:{line}: {message}")
    if findings:
        print(f"lint_layers: {len(findings)} problem(s)", file=sys.stderr)
    else:
        print("lint_layers: ok")


def self_test(repo):
    """The checks over the fixture tree find exactly its LINT-EXPECT lines, and nothing in
    the vendored and generated files added to it."""
    fixture = os.path.join(repo, "tests", "lint", "fixtures", "layers")
    with tempfile.TemporaryDirectory() as work:
        tree = os.path.join(work, "tree")
        shutil.copytree(fixture, tree)
        body = "".join(f"int v{i} = {i};\n" for i in range(MAX_LINES + 1))
        extra = {
            "plugins/fam/big.cpp": "// LINT-EXPECT-SIZE\n" + body,
            "plugins/fam/third_party/vendored.cpp": body,
            "bench/fam/generated.cpp": "// @generated by a tool\n#include \"../../plugins/fam/"
                                       "private.hpp\"\n" + body,
            "tests/fam/long_test.cpp": body,
            "plugins/fam/exactly.cpp": "".join(f"int w{i};\n" for i in range(MAX_LINES)),
        }
        for rel, text in extra.items():
            os.makedirs(os.path.dirname(os.path.join(tree, rel)), exist_ok=True)
            with open(os.path.join(tree, rel), "w", encoding="utf-8") as fh:
                fh.write(text)
        expected = set()
        for dirpath, _, names in os.walk(tree):
            for name in names:
                if not name.endswith(INCLUDE_EXTENSIONS):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, tree).replace(os.sep, "/")
                with open(full, encoding="utf-8") as fh:
                    for number, text in enumerate(fh.read().split("\n"), 1):
                        if "LINT-EXPECT-SIZE" in text:
                            expected.add((rel, MAX_LINES + 1))
                        elif "LINT-EXPECT" in text:
                            expected.add((rel, number))
        # The copy is no git work tree: the walk lists its files.
        found = check(tree)
        got = {(p, n) for p, n, _ in found}
    for path, line, message in found:
        print(f"  found {path}:{line}: {message}")
    if got != expected or not expected:
        for p, n in sorted(expected - got):
            print(f"self-test: missed {p}:{n}", file=sys.stderr)
        for p, n in sorted(got - expected):
            print(f"self-test: unexpected {p}:{n}", file=sys.stderr)
        print("lint_layers self-test: FAILED", file=sys.stderr)
        return 1
    print(f"lint_layers self-test: ok ({len(expected)} planted problems found, nothing else)")
    return 0


def main():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", default=repo, help="the tree to check (default: this repo)")
    parser.add_argument("--self-test", action="store_true",
                        help="check the checker against tests/lint/fixtures/layers")
    args = parser.parse_args()
    if args.self_test:
        return self_test(repo)
    findings = check(args.root)
    report(findings)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
