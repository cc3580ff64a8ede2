#!/usr/bin/python3
"""A guide's first path runs as written, from a fresh clone, right after the README's build.

Usage: first_path.py GUIDE BUILD_DIR SOURCE_DIR [--keep] [--timeout SECONDS]

GUIDE is a Markdown file, relative to SOURCE_DIR (docs/routing.md). BUILD_DIR is the build
tree the README's build leaves in build/release (it holds bin/loom, bin/loom-train, ...).

The marker. A guide's first path is the commands a new reader runs first, in the order the
guide gives them. Each of its ```sh blocks is marked with this HTML comment on the last
non-blank line before the block's opening fence:

    <!-- first-path -->
    ```sh
    build/release/bin/loom ...
    ```

Markdown renderers show nothing for the comment. Every marker must be followed by a ```sh
block (anything else is an error, so a marker is never silently dropped), and a guide given
to this script must have at least one. The marked blocks are the whole path: a command
outside them that the path needs is a bug in the guide, which this test catches.

What the script does:

1. Copies the repository as a fresh clone has it into SCRATCH/loom (SCRATCH: a new temporary
   folder): the files `git ls-files` lists (tracked, plus untracked files git does not
   ignore, so an uncommitted new file counts), or, outside a git checkout, the tree without
   build/ and .git/.
2. Makes SCRATCH/loom/build/release a symlink to BUILD_DIR, so `build/release/bin/loom`
   resolves as the docs say it does, while every file the commands write (build/data,
   build/runs, build/quant, ...) lands in the copy, never in the source or build tree.
3. Writes the marked blocks, unchanged, into one bash script, SCRATCH/first-path.sh, each
   block at its own line numbers in the guide (every other line blank), and runs it from the
   copy's root with `bash -euo pipefail`, standard input from /dev/null. Shell state (a `cd`,
   a variable, an `export`) carries from one block to the next, as in a reader's terminal.
   Each command is echoed (`set -x`) with the seconds elapsed and its line in the guide, and
   a failing command is reported as GUIDE:LINE.

Nothing is added to the commands. The environment is the caller's, except that
LOOM_PLUGIN_PATH and LOOM_LOG_LEVEL are removed (a new reader has neither) and PATH starts
with a folder of stubs, one per program of BUILD_DIR/bin (loom, loom-train, ...), that fail
with exit status 127: a block that calls a bare `loom` works only when the guide's own
commands put build/release/bin on PATH first (`export PATH=$PWD/build/release/bin:$PATH`),
whatever loom the machine may have installed.

SCRATCH is deleted at the end unless --keep is given (its path is printed). --timeout
(default 540 s, under the ctest TIMEOUT) kills the whole run, mpirun ranks included; so does
a SIGTERM or SIGINT to this script (the run is in its own session, which ctest's kill would
not reach). Exit status 0 when every command ran, 1 when one failed, the time ran out or the
run was interrupted, 2 for a usage error or a guide without a well-formed first path.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MARKER = "<!-- first-path -->"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_toml_blocks import blocks  # noqa: E402  the one reader of fenced blocks


def usage(msg=None):
    if msg:
        print(f"first_path.py: {msg}", file=sys.stderr)
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    sys.exit(2)


def first_path_blocks(path):
    """[(first line of the block's text, 1-based, [lines])] for each marked ```sh block."""
    lines = open(path, encoding="utf-8").read().splitlines()
    fenced = blocks(path)  # check_toml_blocks.py's reader: (language, first text line, text)
    inside = set()
    for _, start, text in fenced:
        inside.update(range(start - 1, start + len(text.splitlines()) + 1))
    markers = [n for n, line in enumerate(lines, 1)
               if line.strip() == MARKER and n not in inside]
    found, used = [], set()
    for lang, start, text in fenced:
        before = start - 2  # the fence's line number minus one
        while before >= 1 and not lines[before - 1].strip():
            before -= 1
        if before < 1 or lines[before - 1].strip() != MARKER:
            continue
        if lang != "sh":
            raise SystemExit(f"{path}:{start - 1}: the {MARKER} marker on line {before} is "
                             f"followed by a ```{lang} block, not ```sh")
        used.add(before)
        found.append((start, text.splitlines()))
    for n in markers:
        if n not in used:
            raise SystemExit(f"{path}:{n}: {MARKER} is not followed by a ```sh block")
    return found


def repository_files(src):
    """Paths relative to src of what a fresh clone holds."""
    try:
        p = subprocess.run(["git", "-C", src, "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=True)
        return [f for f in p.stdout.decode("utf-8", "surrogateescape").split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        pass
    out = []
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        if rel == ".":
            dirs[:] = [d for d in dirs if d not in (".git", "build")]
        for f in files:
            out.append(os.path.normpath(os.path.join(rel, f)))
    return out


def copy_repository(src, dst):
    count = 0
    for rel in repository_files(src):
        a, b = os.path.join(src, rel), os.path.join(dst, rel)
        if not os.path.lexists(a):
            continue  # deleted in the working tree, not yet committed
        os.makedirs(os.path.dirname(b), exist_ok=True)
        if os.path.islink(a):
            os.symlink(os.readlink(a), b)
        elif os.path.isdir(a):  # a submodule: its files as they are
            shutil.copytree(a, b, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        else:
            shutil.copy2(a, b)
        count += 1
    return count


def clean_environment(scratch, build):
    """The caller's environment, less what a new reader has not set, with every program of
    BUILD_DIR/bin shadowed on PATH by a stub that fails (exit status 127)."""
    env = dict(os.environ)
    env.pop("LOOM_PLUGIN_PATH", None)
    env.pop("LOOM_LOG_LEVEL", None)
    stubs = os.path.join(scratch, "stubs")
    os.makedirs(stubs)
    for name in sorted(os.listdir(os.path.join(build, "bin"))):
        if not name.startswith("loom"):
            continue
        stub = os.path.join(stubs, name)
        with open(stub, "w") as f:
            f.write("#!/bin/sh\n"
                    f"echo \"{name}: not on a new reader's PATH: the guide must call it by its "
                    f"path (build/release/bin/{name}) or put build/release/bin on PATH "
                    "first\" >&2\nexit 127\n")
        os.chmod(stub, 0o755)
    env["PATH"] = stubs + ":" + env.get("PATH", "/usr/bin:/bin")
    return env


def script_for(guide_name, blocks):
    """One bash script with each block at its own lines of the guide."""
    last = blocks[-1][0] + len(blocks[-1][1])
    lines = [""] * last
    # Line 1 is the guide's title, never inside a block.
    lines[0] = (f"PS4='+ [${{SECONDS}}s] {guide_name}:${{LINENO}}: '; "
                f"trap '{{ rc=$?; set +x; }} 2>/dev/null; "
                f"echo \"{guide_name}:$LINENO: this command failed (exit status $rc)\" >&2' ERR; "
                "set -x")
    for start, body in blocks:
        for k, text in enumerate(body):
            lines[start - 1 + k] = text
    return "\n".join(lines) + "\n"


def main():
    args = sys.argv[1:]
    keep = "--keep" in args
    args = [a for a in args if a != "--keep"]
    timeout = 540.0
    if "--timeout" in args:
        k = args.index("--timeout")
        try:
            timeout = float(args[k + 1])
        except (IndexError, ValueError):
            usage("--timeout needs a number of seconds")
        del args[k:k + 2]
    if len(args) != 3:
        usage()
    guide, build, src = args
    src = os.path.realpath(src)
    build = os.path.realpath(build)
    doc = os.path.join(src, guide)
    if not os.path.isfile(doc):
        usage(f"no guide at {doc}")
    for prog in ("loom", "loom-train"):
        if not os.access(os.path.join(build, "bin", prog), os.X_OK):
            usage(f"{build}/bin/{prog} is missing: build first")
    try:
        blocks = first_path_blocks(doc)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    if not blocks:
        print(f"{guide}: no ```sh block is marked {MARKER}: the guide has no first path",
              file=sys.stderr)
        return 2

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    os.umask(0o022)
    scratch = tempfile.mkdtemp(prefix="loom-first-path-")
    clone = os.path.join(scratch, "loom")  # the copy; the script and stubs stay beside it
    rc = 1
    try:
        n = copy_repository(src, clone)
        os.makedirs(os.path.join(clone, "build"), exist_ok=True)
        os.symlink(build, os.path.join(clone, "build", "release"))
        script = os.path.join(scratch, "first-path.sh")
        with open(script, "w") as f:
            f.write(script_for(guide, blocks))
        lines = sum(len(b) for _, b in blocks)
        print(f"{guide}: {len(blocks)} first-path blocks ({lines} lines) in a copy of the "
              f"repository ({n} files) at {clone}, build/release -> {build}", flush=True)
        t0 = time.monotonic()
        p = subprocess.Popen(["bash", "-euo", "pipefail", script], cwd=clone,
                             env=clean_environment(scratch, build), stdin=subprocess.DEVNULL,
                             start_new_session=True)
        try:
            status = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            print(f"{guide}: the first path did not finish in {timeout:.0f} s", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            os.killpg(p.pid, signal.SIGKILL)
            raise
        finally:
            try:  # whatever a block left running (a rank, a background job)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        took = time.monotonic() - t0
        if status != 0:
            print(f"{guide}: the first path failed (exit status {status}) after {took:.1f} s",
                  file=sys.stderr)
            return 1
        print(f"{guide}: the first path ran as written in {took:.1f} s")
        rc = 0
    finally:
        if keep:
            print(f"scratch folder kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("first_path.py: interrupted; the run was killed", file=sys.stderr)
        sys.exit(1)
