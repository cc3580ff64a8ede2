#!/usr/bin/env python3
"""CUDA emulation (tests/cuda_emulation): rewrites a .cu file into C++ the emulated headers run.

Usage: rewrite_launches.py INPUT.cu OUTPUT.cpp

Every kernel launch `k<<<grid, block, smem, stream>>>(args)` becomes
`emu::launch(<coop>, "k", k, grid, block, smem, stream, args)` (include/cuda_runtime.h).
<coop> is decided per kernel from the file itself: a kernel runs cooperatively (one OS thread
per CUDA thread of a block, a barrier for __syncthreads) when its body, or the body of any
__device__ function it calls (transitively), uses __syncthreads, warp shuffles/votes or
__shared__ memory; otherwise its threads run one after another on one OS thread (fast). A
kernel whose definition is not in the file runs cooperatively (always correct, only slower),
and the script says so. Line numbers are kept (a #line directive names the original file), so
compiler and sanitizer reports point into the .cu source.
"""
import re
import sys

# What needs all threads of a block alive at once.
COOP_TOKENS = re.compile(
    r"\b(__syncthreads\w*|__syncwarp|__shfl\w*|__ballot\w*|__any_sync|__all_sync|"
    r"__match\w*|__shared__|__activemask)\b")
IDENT = re.compile(r"[A-Za-z_]\w*")
LAUNCH = re.compile(r"(\b(?:[A-Za-z_]\w*::)*[A-Za-z_]\w*(?:\s*<[^<>;]*>)?)(\s*)<<<(.*?)>>>(\s*)\(",
                    re.S)


def blank_comments_and_strings(src):
    """The source with comments and string/char literals replaced by spaces (same offsets)."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def matching(text, i, open_c, close_c):
    """Index just past the bracket that closes the one opened before i."""
    depth = 1
    while depth:
        if i >= len(text):
            raise SystemExit(f"unbalanced {open_c}{close_c}")
        depth += (text[i] == open_c) - (text[i] == close_c)
        i += 1
    return i


def functions(text):
    """{name: [(is_kernel, body)]} for every __global__ / __device__ function defined."""
    found = {}
    for q in re.finditer(r"\b(__global__|__device__)\b", text):
        paren = text.find("(", q.end())
        stop = text.find(";", q.end())
        if paren < 0 or (0 <= stop < paren):
            continue  # a __device__ variable or a declaration
        names = IDENT.findall(text[q.end():paren])
        if not names:
            continue
        close = matching(text, paren + 1, "(", ")")
        m = re.compile(r"[^;{]*\{").match(text, close)
        if not m:
            continue  # declaration only
        body_end = matching(text, m.end(), "{", "}")
        found.setdefault(names[-1], []).append((q.group(1) == "__global__",
                                                 text[m.end():body_end - 1]))
    return found


def cooperative_names(funcs):
    coop = {name for name, defs in funcs.items()
            if any(COOP_TOKENS.search(body) for _, body in defs)}
    changed = True
    while changed:  # a function calling a cooperative function is cooperative
        changed = False
        for name, defs in funcs.items():
            if name in coop:
                continue
            if any(set(IDENT.findall(body)) & coop for _, body in defs):
                coop.add(name)
                changed = True
    return coop


def included_headers(src_path, text):
    """The text of each .cuh that `#include "..."` names, found beside src_path or under one
    of its parent folders (plugins/common/x.cuh from plugins/moe/core/y.cu), recursively."""
    import os
    seen, out, todo = set(), [], [(src_path, text)]
    while todo:
        path, body = todo.pop()
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+\.cuh)"', body, re.M):
            d = os.path.dirname(os.path.abspath(path))
            while True:
                cand = os.path.join(d, inc)
                if os.path.isfile(cand):
                    break
                parent = os.path.dirname(d)
                if parent == d:
                    cand = None
                    break
                d = parent
            if cand is None or cand in seen:
                continue
            seen.add(cand)
            with open(cand, encoding="utf-8") as f:
                h = blank_comments_and_strings(f.read())
            out.append(h)
            todo.append((cand, h))
    return out


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src_path, out_path = sys.argv[1], sys.argv[2]
    with open(src_path, encoding="utf-8") as f:
        src = f.read()
    text = blank_comments_and_strings(src)
    funcs = functions(text)
    for header in included_headers(src_path, src):
        for name, defs in functions(header).items():
            funcs.setdefault(name, []).extend(defs)
    kernels = {n for n, defs in funcs.items() if any(k for k, _ in defs)}
    coop = cooperative_names(funcs)
    out, pos, modes = [], 0, {}
    for m in LAUNCH.finditer(text):
        if m.start() < pos:
            continue
        end = matching(text, m.end(), "(", ")")
        name = m.group(1)
        base = IDENT.findall(name.split("<")[0])[-1]  # ns::kernel<T> -> kernel
        if base not in kernels:
            print(f"{src_path}: kernel {base} is not defined in this file: "
                  "launched cooperatively", file=sys.stderr)
        is_coop = base in coop or base not in kernels
        modes[base] = is_coop
        args = src[m.end():end - 1]
        cfg = src[m.start(3):m.end(3)]
        # <<<grid, block>>> and <<<grid, block, smem>>>: the defaults made explicit.
        depth, commas = 0, 0
        for c in text[m.start(3):m.end(3)]:
            depth += (c in "([{") - (c in ")]}")
            commas += c == "," and depth == 0
        cfg += ", 0" * (commas < 2) + ", nullptr" * (commas < 3)
        # Newlines kept where they were, so line numbers stay those of the .cu file.
        out.append(src[pos:m.start()])
        out.append(f'emu::launch({"true" if is_coop else "false"}, "{" ".join(name.split())}", '
                   f"{name}{m.group(2)}, {cfg},{m.group(4) or ' '}{args})")
        pos = end
    out.append(src[pos:])
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(f'// Generated by tests/cuda_emulation/rewrite_launches.py from {src_path}\n')
        f.write(f'#line 1 "{src_path}"\n')
        f.write("".join(out))
    summary = ", ".join(f"{k}{' (cooperative)' if v else ''}" for k, v in sorted(modes.items()))
    print(f"{src_path}: {len(modes)} kernels launched: {summary}")


if __name__ == "__main__":
    main()
