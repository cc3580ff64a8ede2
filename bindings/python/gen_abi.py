#!/usr/bin/env python3
"""Writes bindings/python/loom/_abi/, the ctypes mirror of Loom's C ABI, from the headers:
one module a header (so none grows past the project's 1,000 lines as kinds are added), and
an __init__ that gathers them, so `loom._abi.X` names anything.

    python3 bindings/python/gen_abi.py            # rewrite loom/_abi/
    python3 bindings/python/gen_abi.py --check    # exit 1 when loom/_abi/ is out of date
    python3 bindings/python/gen_abi.py --root R --package P   # write P/_abi/ from R's headers

Reads abi/include/loom/abi.h, quant_format.h, every kind header (the lines of
abi/include/loom/kinds/kinds.def when it exists, else kinds/*.h in name order) and
host/include/loom/embed.h. The headers use a small C subset and this reads exactly that
subset: `typedef struct` / `typedef enum` / opaque struct and function-pointer typedefs,
integer, string and LOOM_STRUCT_SIZE #defines, `#ifdef __cplusplus` / `#if defined(_WIN32)`
blocks (the C, non-Windows branch is taken), LOOM_CHECK_STRUCT_SIZE lines and LOOM_API
function declarations (not mirrored: loom/_lib.py declares the calls it makes). Anything
else stops the generator with the header and line, rather than a guessed layout.

Standard library only: it runs at build time with whatever python3 builds Loom.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple


class HeaderError(Exception):
    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")


class Tok(NamedTuple):
    kind: str  # "id", "num", "str", "punct", "nl"
    text: str
    where: str  # "path:line"


# ------------------------------------------------------------------ tokens

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\f\v]+)
  | (?P<splice>\\\n)
  | (?P<nl>\n)
  | (?P<lc>//[^\n]*)
  | (?P<bc>/\*.*?\*/)
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<num>(?:0[xX][0-9A-Fa-f]+|[0-9]+)[uUlL]*)
  | (?P<str>"(?:[^"\\\n]|\\.)*")
  | (?P<punct><<|>>|[{}()\[\];,*=|&~+\-<>#:.!?/%^])
""", re.VERBOSE | re.DOTALL)


def tokenize(path: str, rel: str) -> List[Tok]:
    """C tokens with their lines; comments and line splices removed as the C translation
    phases do, newlines kept (they end preprocessor directives)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out: List[Tok] = []
    pos, line, prev_end = 0, 1, -1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise HeaderError(f"{rel}:{line}", f"cannot read {text[pos:pos + 20]!r}")
        kind = m.lastgroup
        s = m.group()
        if s == "(" and out and out[-1].kind == "id" and prev_end == pos:
            kind = "call"  # '(' glued to a name: what makes a #define function-like
        if kind in ("id", "num", "str", "punct", "call"):
            out.append(Tok(kind, s, f"{rel}:{line}"))
        elif kind == "nl":
            out.append(Tok("nl", "\n", f"{rel}:{line}"))
        line += s.count("\n")
        if kind in ("id", "num", "str", "punct", "call"):
            prev_end = m.end()
        pos = m.end()
    out.append(Tok("nl", "\n", f"{rel}:{line}"))
    return out


# ------------------------------------------------------------------ the model

class CType(NamedTuple):
    """A C type as the generator understands it: a base name and a pointer depth, or a
    function pointer (fn set: (return CType, [param CTypes]))."""
    base: str
    ptr: int = 0
    fn: Optional[Tuple["CType", List["CType"]]] = None
    array: Optional[str] = None  # a field's element count (an int expression)
    pname: str = ""  # a function pointer parameter's name, when it has one


class Field(NamedTuple):
    name: str
    type: CType
    where: str


class Struct(NamedTuple):
    cname: str
    fields: List[Field]
    header: str
    where: str


class Enum(NamedTuple):
    cname: str
    members: List[Tuple[str, int]]
    header: str
    where: str


class FnType(NamedTuple):
    cname: str
    type: CType
    header: str
    where: str


class Const(NamedTuple):
    cname: str
    kind: str  # "int", "str", "size", "alias" (of a size)
    value: object  # int expression (python), string literal, (struct, field), a name
    header: str
    where: str


SCALARS = {
    "int8_t": "ctypes.c_int8", "int16_t": "ctypes.c_int16", "int32_t": "ctypes.c_int32",
    "int64_t": "ctypes.c_int64", "uint8_t": "ctypes.c_uint8", "uint16_t": "ctypes.c_uint16",
    "uint32_t": "ctypes.c_uint32", "uint64_t": "ctypes.c_uint64", "size_t": "ctypes.c_size_t",
    "double": "ctypes.c_double", "float": "ctypes.c_float", "int": "ctypes.c_int",
    "char": "ctypes.c_char",
}
# DLPack 0.6's structs, mirrored by hand in loom/_dlpack.py (a frozen outside format).
DLPACK = ("DLDevice", "DLDataType", "DLTensor", "DLManagedTensor")
# Function-like macros whose meaning the generator knows; any other stops it.
KNOWN_FUNCTION_MACROS = ("LOOM_STRUCT_SIZE", "LOOM_STATIC_ASSERT", "LOOM_CHECK_STRUCT_SIZE")
# Object-like macros that expand to attributes in declarations.
ATTRIBUTE_MACROS = ("LOOM_EXPORT", "LOOM_API")


class Model:
    """What the headers declared so far, in order."""

    def __init__(self):
        self.items: List[object] = []  # Struct, Enum, Const, FnType in header order
        self.structs: Dict[str, Struct] = {}
        self.opaque: Dict[str, str] = {}
        self.enums: Dict[str, Enum] = {}
        self.fntypes: Dict[str, CType] = {}
        self.macros: Dict[str, Const] = {}
        self.empty_macros = set()
        self.defined = set()
        self.pending = ""  # the struct whose fields are being read
        self.includes: Dict[str, List[str]] = {}  # header -> the loom/*.h it includes


# ------------------------------------------------------------------ the reader

def _int_expr(toks: List[Tok], model: Model, where: str) -> str:
    """A C integer constant expression of literals and earlier macros, as Python text."""
    parts: List[str] = []
    for t in toks:
        if t.kind == "num":
            parts.append(str(int(t.text.rstrip("uUlL"), 0)))
        elif t.kind == "id":
            c = model.macros.get(t.text)
            if c is None or c.kind != "int":
                raise HeaderError(where, f"'{t.text}' is not an integer macro defined above")
            parts.append(py_const(t.text))
        elif t.text in ("(", ")", "<<", ">>", "|", "&", "~", "-", "+"):
            parts.append(t.text)
        else:
            raise HeaderError(where, f"'{t.text}' in an integer expression")
    if not parts:
        raise HeaderError(where, "empty integer expression")
    text = ""
    for i, p in enumerate(parts):
        unary = p in ("-", "~") and (i == 0 or parts[i - 1] in ("(", "<<", ">>", "|", "&"))
        if text and not text.endswith("(") and p != ")" and not text.endswith("\0"):
            text += " "
        text += p + ("\0" if unary else "")
    return text.replace("\0", "")


def _eval_int(expr: str, model: Model, where: str) -> int:
    """The value of an expression _int_expr wrote (only literals, names and operators)."""
    try:
        return int(eval(expr, {"__builtins__": {}}, _int_values(model)))  # noqa: S307
    except Exception as e:  # noqa: BLE001 (a header we do not understand stops the run)
        raise HeaderError(where, f"cannot evaluate '{expr}': {e}")


def _int_values(model: Model) -> Dict[str, int]:
    vals: Dict[str, int] = {}
    for n, c in model.macros.items():
        if c.kind == "int":
            vals[py_const(n)] = int(eval(c.value, {"__builtins__": {}}, vals))  # noqa: S307
    return vals


def _directive(toks: List[Tok], model: Model, stack: List[bool], header: str) -> None:
    where = toks[0].where
    if len(toks) < 2 or toks[1].kind != "id":
        raise HeaderError(where, "unknown preprocessor directive")
    d = toks[1].text
    rest = toks[2:]
    active = all(stack)
    if d in ("ifdef", "ifndef"):
        if len(rest) != 1 or rest[0].kind != "id":
            raise HeaderError(where, f"#{d} takes one name")
        stack.append((rest[0].text in model.defined) == (d == "ifdef"))
        return
    if d == "if":
        txt = " ".join(t.text for t in rest)
        m = re.fullmatch(r"defined \( (\w+) \)", txt)
        if not m:
            raise HeaderError(where, f"#if {txt}: only `#if defined(NAME)` is understood")
        stack.append(m.group(1) in model.defined)
        return
    if d == "elif":
        raise HeaderError(where, "#elif is not understood")
    if d == "else":
        if len(stack) == 0:
            raise HeaderError(where, "#else without #if")
        stack[-1] = not stack[-1]
        return
    if d == "endif":
        if len(stack) == 0:
            raise HeaderError(where, "#endif without #if")
        stack.pop()
        return
    if not active:
        return
    if d == "include":
        # Loom's own headers are read in their own right (and their modules imported by
        # this one's); the others are the C library's and DLPack's.
        m = re.fullmatch(r"<(loom/[\w/]+\.(?:h|def))>", "".join(t.text for t in rest))
        if m:
            model.includes.setdefault(header, []).append(m.group(1))
        return
    if d != "define":
        raise HeaderError(where, f"#{d} is not understood")
    if not rest or rest[0].kind != "id":
        raise HeaderError(where, "#define without a name")
    name, body = rest[0].text, rest[1:]
    model.defined.add(name)
    # A function-like macro: the name is followed by '(' with no space between.
    if body and body[0].kind == "call":
        if name not in KNOWN_FUNCTION_MACROS:
            raise HeaderError(where, f"function-like macro {name} is not understood")
        return
    if not body:
        model.empty_macros.add(name)
        return
    if name in ATTRIBUTE_MACROS:
        return
    if len(body) == 1 and body[0].kind == "str":
        c = Const(name, "str", body[0].text, header, where)
    elif len(body) == 1 and model.macros.get(body[0].text, Const("", "", 0, "", "")).kind \
            in ("size", "alias"):
        c = Const(name, "alias", py_const(body[0].text), header, where)
    elif body[0].text == "LOOM_STRUCT_SIZE":
        txt = [t.text for t in body]
        if len(txt) != 6 or txt[1] != "(" or txt[3] != "," or txt[5] != ")":
            raise HeaderError(where, f"{name}: LOOM_STRUCT_SIZE(type, field) expected")
        s = model.structs.get(txt[2])
        if s is None:
            raise HeaderError(where, f"{name}: {txt[2]} is not a struct defined above")
        if txt[4] not in [f.name for f in s.fields]:
            raise HeaderError(where, f"{name}: {txt[2]} has no field {txt[4]}")
        c = Const(name, "size", (txt[2], txt[4]), header, where)
    else:
        expr = _int_expr(body, model, where)
        c = Const(name, "int", expr, header, where)
        model.macros[name] = c
        _int_values(model)  # evaluates now, so a bad expression names its line
        model.items.append(c)
        return
    model.macros[name] = c
    model.items.append(c)


def read_header(path: str, rel: str, model: Model) -> None:
    text_toks = tokenize(path, rel)
    stack: List[bool] = []
    code: List[Tok] = []
    line: List[Tok] = []
    for t in text_toks:
        if t.kind != "nl":
            line.append(t)
            continue
        if not line:
            continue
        if line[0].text == "#":
            code = _flush(code, model, rel)  # a #define may name the struct just declared
            _directive(line, model, stack, rel)
        elif all(stack):
            for x in line:
                if x.kind == "id" and x.text in model.empty_macros:
                    continue
                code.append(x)
        line = []
    if stack:
        raise HeaderError(f"{rel}", "#if without #endif")
    if _flush(code, model, rel):
        raise HeaderError(code[0].where, "declaration without ';'")


# ------------------------------------------------------------------ declarations

def _split(toks: List[Tok], sep: str) -> List[List[Tok]]:
    """Splits at `sep` outside braces and parentheses; the last part may be empty."""
    parts: List[List[Tok]] = [[]]
    depth = 0
    for t in toks:
        if t.text in ("{", "("):
            depth += 1
        elif t.text in ("}", ")"):
            depth -= 1
        if depth == 0 and t.text == sep:
            parts.append([])
        else:
            parts[-1].append(t)
    return parts


def _flush(code: List[Tok], model: Model, header: str) -> List[Tok]:
    """Reads the complete declarations in `code`; returns the unfinished rest."""
    parts = _split(code, ";")
    for st in parts[:-1]:
        if not st:
            raise HeaderError(header, "empty declaration")
        _statement(st, model, header)
    return parts[-1]


def _statement(st: List[Tok], model: Model, header: str) -> None:
    where = st[0].where
    txt = [t.text for t in st]
    if txt[0] == "LOOM_API":
        if "(" not in txt:
            raise HeaderError(where, "LOOM_API without a function declaration")
        return  # the embedding API's functions: loom/_lib.py declares the ones it calls
    if txt[0] == "LOOM_CHECK_STRUCT_SIZE":
        if len(txt) != 6 or txt[1] != "(" or txt[5] != ")" or txt[2] not in model.structs \
                or model.macros.get(txt[4], Const("", "", None, "", "")).kind \
                not in ("size", "alias"):
            raise HeaderError(where, "LOOM_CHECK_STRUCT_SIZE(struct, size macro) expected")
        return
    if txt[0] != "typedef":
        raise HeaderError(where, f"'{txt[0]}': only typedefs and LOOM_API functions "
                          "are understood at file scope")
    if txt[1] == "struct" and len(txt) == 4:
        if txt[2] != txt[3]:
            raise HeaderError(where, "typedef struct X Y with X != Y")
        model.opaque[txt[2]] = header
        return
    if txt[1] in ("struct", "enum"):
        if len(txt) < 6 or txt[3] != "{" or txt[-2] != "}" or txt[2] != txt[-1]:
            raise HeaderError(where, f"typedef {txt[1]} X {{ ... }} X expected")
        body = st[4:-2]
        if txt[1] == "enum":
            _enum(txt[2], body, model, header, where)
        else:
            _struct(txt[2], body, model, header, where)
        return
    if "{" in txt:
        raise HeaderError(where, f"typedef {txt[1]} {{...}}: only struct and enum bodies "
                          "are understood")
    name, ctype = _declarator(st[1:], model, where)
    if ctype.fn is None:
        raise HeaderError(where, "only function-pointer typedefs are understood")
    model.fntypes[name] = ctype
    model.items.append(FnType(name, ctype, header, where))


def _enum(name: str, body: List[Tok], model: Model, header: str, where: str) -> None:
    members: List[Tuple[str, int]] = []
    nxt = 0
    for part in _split(body, ","):
        if not part:
            continue
        w = part[0].where
        if part[0].kind != "id":
            raise HeaderError(w, "enum member name expected")
        if len(part) > 1:
            if part[1].text != "=":
                raise HeaderError(w, "enum member: NAME or NAME = value expected")
            nxt = _eval_int(_int_expr(part[2:], model, w), model, w)
        members.append((part[0].text, nxt))
        model.macros[part[0].text] = Const(part[0].text, "int", str(nxt), header, w)
        nxt += 1
    e = Enum(name, members, header, where)
    model.enums[name] = e
    model.items.append(e)


def _struct(name: str, body: List[Tok], model: Model, header: str, where: str) -> None:
    fields: List[Field] = []
    model.pending = name  # a field may point at the struct itself
    parts = _split(body, ";")
    if parts[-1]:
        raise HeaderError(parts[-1][0].where, "struct field without ';'")
    for part in parts[:-1]:
        w = part[0].where if part else where
        fname, ctype = _declarator(part, model, w)
        fields.append(Field(fname, ctype, w))
    if not fields or fields[0].name != "struct_size" or fields[0].type != CType("uint32_t"):
        raise HeaderError(where, f"{name} does not start with uint32_t struct_size")
    model.pending = ""
    s = Struct(name, fields, header, where)
    model.structs[name] = s
    model.items.append(s)


def _base_type(toks: List[Tok], model: Model, where: str) -> Tuple[str, int]:
    """Reads `[const] [struct] NAME {* [const]}` and returns (NAME, pointer depth)."""
    i = 0
    names = []
    ptr = 0
    while i < len(toks):
        t = toks[i].text
        if t == "const":
            pass
        elif t == "struct":
            if i + 1 >= len(toks) or toks[i + 1].kind != "id":
                raise HeaderError(where, "struct without a name")
        elif t == "*":
            ptr += 1
        elif toks[i].kind == "id" and ptr == 0:
            names.append(t)
        else:
            raise HeaderError(where, f"'{t}' in a type is not understood")
        i += 1
    if len(names) != 1:
        raise HeaderError(where, f"type '{' '.join(x.text for x in toks)}' is not understood")
    n = names[0]
    known = (n in SCALARS or n == "void" or n in DLPACK or n in model.structs or
             n in model.opaque or n in model.fntypes or (n == model.pending and ptr > 0))
    if not known:
        if n in model.enums:
            raise HeaderError(where, f"a field of enum type {n}: the ABI spells enums int32_t")
        raise HeaderError(where, f"unknown type {n}")
    return n, ptr


def _declarator(toks: List[Tok], model: Model, where: str) -> Tuple[str, CType]:
    """`TYPE name`, `TYPE name[N]` or `RET (*name)(params)`; returns (name, CType)."""
    txt = [t.text for t in toks]
    if "(" in txt:
        i = txt.index("(")
        if txt[i + 1:i + 2] != ["*"] or len(txt) < i + 5 or txt[i + 3] != ")" or \
                txt[i + 4] != "(" or txt[-1] != ")" or toks[i + 2].kind != "id":
            raise HeaderError(where, "function pointer `RET (*name)(params)` expected")
        ret = CType(*_base_type(toks[:i], model, where))
        params_toks = toks[i + 5:-1]
        params: List[CType] = []
        if [t.text for t in params_toks] != ["void"]:
            for p in _split(params_toks, ","):
                if not p:
                    raise HeaderError(where, "empty parameter")
                params.append(_param(p, model, where))
        return toks[i + 2].text, CType("", 0, (ret, params))
    array = None
    if txt and txt[-1] == "]":
        if "[" not in txt:
            raise HeaderError(where, "']' without '['")
        j = txt.index("[")
        array = _int_expr(toks[j + 1:-1], model, where)
        toks, txt = toks[:j], txt[:j]
    if len(toks) < 2 or toks[-1].kind != "id":
        raise HeaderError(where, f"declaration '{' '.join(txt)}' is not understood")
    base, ptr = _base_type(toks[:-1], model, where)
    if base == "void" and ptr == 0:
        raise HeaderError(where, "a void field")
    return toks[-1].text, CType(base, ptr, None, array)


def _param(p: List[Tok], model: Model, where: str) -> CType:
    txt = [t.text for t in p]
    if "(" in txt:
        name, t = _declarator(p, model, where)
        return t._replace(pname=name)
    # `TYPE name` or an unnamed `TYPE`: the last name is the parameter's when another name
    # (the type's) comes before it
    keywords = ("const", "struct")
    if p[-1].kind == "id" and p[-1].text not in keywords and \
            any(t.kind == "id" and t.text not in keywords for t in p[:-1]):
        p = p[:-1]
    base, ptr = _base_type(p, model, where)
    return CType(base, ptr)


# ------------------------------------------------------------------ names

def strip_loom(cname: str, where: str = "") -> str:
    if not cname.startswith("loom_"):
        raise HeaderError(where, f"{cname} does not start with loom_")
    return cname[len("loom_"):]


def py_class(cname: str) -> str:
    """loom_curriculum_plan_args -> CurriculumPlanArgs."""
    if cname in DLPACK:
        return cname
    return "".join(w[:1].upper() + w[1:] for w in strip_loom(cname).split("_"))


def py_const(cname: str) -> str:
    """LOOM_ERR_NOT_FOUND -> NOT_FOUND, LOOM_KIND_MOE -> KIND_MOE."""
    for p in ("LOOM_ERR_", "LOOM_"):
        if cname.startswith(p):
            return cname[len(p):]
    return cname


# ------------------------------------------------------------------ the writer

WIDTH = 100  # the package's line length
GENERATED = "GENERATED by bindings/python/gen_abi.py."


def dlpack_names() -> List[str]:
    """The names loom/_dlpack.py gives loom._abi: its __all__."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loom", "_dlpack.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == \
                ["__all__"]:
            return list(ast.literal_eval(node.value))
    raise HeaderError(path, "no __all__")


def module_path(header: str) -> str:
    """abi/include/loom/kinds/moe.h -> _abi/kinds/moe.py (under loom/)."""
    rel = header.replace(os.sep, "/").split("/include/loom/", 1)[1]
    return "_abi/" + rel[:-len(".h")] + ".py"


def _dotted(header: str) -> str:
    return module_path(header)[:-len(".py")].replace("/", ".")


def _relative(importer: str, target: str) -> str:
    """The relative import of loom.<target> from the module loom.<importer>."""
    pkg = importer.split(".")[:-1]  # the importer's package, under loom
    t = target.split(".")
    common = 0
    while common < min(len(pkg), len(t) - 1) and pkg[common] == t[common]:
        common += 1
    return "." * (len(pkg) - common + 1) + ".".join(t[common:])


class Writer:
    """Python text for the model; state is the names given to function-pointer typedefs."""

    def __init__(self, model: Model):
        self.model = model
        self.fn_names: Dict[str, str] = {}  # C typedef -> Python name
        self.taken: Dict[str, str] = {}  # Python name -> where it comes from

    def name(self, py: str, where: str) -> str:
        """Claims a module-level Python name: loom._abi gathers every module's names, so
        two C names that map to one Python name would silently shadow each other."""
        if py in self.taken:
            raise HeaderError(where, f"{py} is also the Python name of {self.taken[py]}")
        self.taken[py] = where
        return py

    def ctype(self, t: CType, *, ret: bool = False) -> str:
        if t.fn is not None:
            r, params = t.fn
            args = [self.ctype(r, ret=True)] + [self.ctype(p) for p in params]
            return f"ctypes.CFUNCTYPE({', '.join(args)})"
        if ret and t.ptr:
            return "ctypes.c_void_p"  # statuses and buffers come back as addresses
        if t.base == "void" and t.ptr == 0:
            return "None"
        text = self.value_type(t.base, t.ptr)
        return f"{text} * ({t.array})" if t.array else text

    def value_type(self, base: str, ptr: int) -> str:
        if ptr == 0:
            if base in SCALARS:
                return SCALARS[base]
            if base in self.fn_names:
                return self.fn_names[base]
            return py_class(base)
        # void* and opaque handles are addresses; so is DLTensor* (the package borrows
        # tensors from DLPack capsules, which hand out addresses); char* is a string.
        if ptr == 1:
            if base == "void" or base in self.model.opaque or base in DLPACK:
                return "ctypes.c_void_p"
            if base == "char":
                return "ctypes.c_char_p"
        return f"ctypes.POINTER({self.value_type(base, ptr - 1)})"

    def fn_assign(self, name: str, t: CType) -> List[str]:
        """NAME = ctypes.CFUNCTYPE(...), broken after commas to stay within WIDTH; a
        function-pointer parameter gets a NAME_<PARAM>_FN of its own first."""
        r, params = t.fn
        pre: List[str] = []
        args = [self.ctype(r, ret=True)]
        for p in params:
            if p.fn is not None:
                if not p.pname:
                    raise HeaderError(name, "a function-pointer parameter needs a name")
                sub = self.name(f"{name[:-len('_FN')]}_{p.pname.upper()}_FN", name)
                pre += self.fn_assign(sub, p)
                args.append(sub)
            else:
                args.append(self.ctype(p))
        return pre + self._call(f"{name} = ctypes.CFUNCTYPE(", args)

    @staticmethod
    def _call(head: str, args: List[str]) -> List[str]:
        one = head + ", ".join(args) + ")"
        if len(one) <= WIDTH:
            return [one]
        lines, cur = [], head
        pad = " " * len(head)
        for i, a in enumerate(args):
            piece = a + ("," if i + 1 < len(args) else ")")
            if cur not in (head, pad) and len(cur) + 1 + len(piece) > WIDTH:
                lines.append(cur)
                cur = pad
            cur += piece if cur in (head, pad) else " " + piece
        lines.append(cur)
        return lines

    def names_dict(self, name: str, members: List[Tuple[str, int]]) -> List[str]:
        """NAME = {value: "member minus the shared prefix, lower case", ...}."""
        pys = [py_const(m) for m, _ in members]
        prefix = os.path.commonprefix([p + "_" for p in pys])
        prefix = prefix[:prefix.rfind("_") + 1]
        items = [f'{v}: "{p[len(prefix):].lower()}"' for p, (_, v) in zip(pys, members)]
        one = f"{name} = {{{', '.join(items)}}}"
        if len(one) <= WIDTH:
            return [one]
        rows: List[str] = []
        for item in items:
            if rows and len(rows[-1]) + len(item) + 2 <= WIDTH:
                rows[-1] += f" {item},"
            else:
                rows.append(f"    {item},")
        return [f"{name} = {{"] + rows + ["}"]

    def modules(self, sources: List[str]) -> Dict[str, str]:
        """The package loom/_abi: one module per header (path under loom/ -> text), each
        star-importing the earlier ones, and an __init__ that gathers them all."""
        for n in dlpack_names():
            self.name(n, "loom/_dlpack.py")
        files: Dict[str, str] = {}
        done: List[str] = []  # dotted names under loom, of the modules written so far
        by_include = {s.replace(os.sep, "/").split("/include/", 1)[1]: s for s in sources}
        for src in sources:
            path = module_path(src)
            dotted = path[:-len(".py")].replace("/", ".")
            # the modules of the headers this one includes (what C lets it use)
            deps = []
            for inc in self.model.includes.get(src, []):
                if inc == "loom/kinds/kinds.def":  # the list of kinds: every kind header
                    deps += [_dotted(s) for s in sources if "/kinds/" in s.replace(os.sep, "/")]
                elif inc in by_include:
                    deps.append(_dotted(by_include[inc]))
            files[path] = self.module(src, dotted, deps)
            done.append(dotted)
        files["_abi/kinds/__init__.py"] = (
            f'"""The kind headers\' mirrors (abi/include/loom/kinds/*.h).\n\n{GENERATED}"""\n')
        lines = [
            '"""ctypes mirror of Loom\'s C ABI, a module a header:',
            *[f"{module_path(s)} from {s}" for s in sources[:-1]],
            f"{module_path(sources[-1])} from {sources[-1]}.",
            "",
            f"{GENERATED} Do not edit: change the headers and rerun",
            "the generator (or build the target loom_python_abi); the test python.abi_generated",
            "fails while these files differ from what it writes. Every name of every module is",
            "here too, as are DLPack 0.6's structs (from loom/_dlpack.py). X_SIZE is LOOM_X_SIZE",
            "(the struct's size up to its last field); a C enum's values also come as X_NAMES,",
            "value -> lower-case name.",
            '"""',
            "from .._dlpack import *  # noqa: F401,F403",
        ]
        lines += [f"from {_relative('_abi.__init__', d)} import *  # noqa: F401,F403"
                  for d in done]
        files["_abi/__init__.py"] = "\n".join(lines) + "\n"
        return files

    def module(self, src: str, dotted: str, earlier: List[str]) -> str:
        items = [it for it in self.model.items if it.header == src]
        out = [f'"""ctypes mirror of {src}.', "", f'{GENERATED} Do not edit."""',
               "import ctypes", "",
               f"from {_relative(dotted, '_dlpack')} import *  # noqa: F401,F403"]
        out += [f"from {_relative(dotted, e)} import *  # noqa: F401,F403" for e in earlier]
        if any(isinstance(it, Const) and it.kind == "size" for it in items):
            out += ["", "", "def _size(struct, last: str) -> int:",
                    '    """LOOM_STRUCT_SIZE(struct, last): the offset of `last` plus its size."""',
                    "    f = getattr(struct, last)", "    return f.offset + f.size"]
        stubs = [it for it in items if isinstance(it, Struct)]
        if stubs:
            out += ["", "", "# The structs first, so fields and function types may point at any."]
        for it in stubs:
            out += [f"class {self.name(py_class(it.cname), it.where)}(ctypes.Structure):",
                    f'    """{it.cname} ({it.header})."""']
        out.append("")
        for it in items:
            if isinstance(it, Const):
                self.name(py_const(it.cname), it.where)
                out += self.const(it)
            elif isinstance(it, Enum):
                out.append(f"# enum {it.cname}")
                out += [f"{self.name(py_const(m), it.where)} = {v}" for m, v in it.members]
                names = self.name(strip_loom(it.cname, it.where).upper() + "_NAMES", it.where)
                out += self.names_dict(names, it.members)
            elif isinstance(it, FnType):
                pn = strip_loom(it.cname, it.where).upper()
                pn = self.name(pn if pn.endswith("_FN") else pn + "_FN", it.where)
                out += self.fn_assign(pn, it.type)
                self.fn_names[it.cname] = pn
            else:
                out += self.struct(it)
        return "\n".join(out).rstrip("\n") + "\n"

    @staticmethod
    def const(c: Const) -> List[str]:
        n = py_const(c.cname)
        if c.kind == "size":
            s, f = c.value
            return [f'{n} = _size({py_class(s)}, "{f}")']
        return [f"{n} = {c.value}"]

    def struct(self, s: Struct) -> List[str]:
        cls = py_class(s.cname)
        prefix = strip_loom(s.cname, s.where).upper()
        out, items = [""], []
        for f in s.fields:
            if f.type.fn is not None:
                fn = self.name(f"{prefix}_{f.name.upper()}_FN", f.where)
                out += self.fn_assign(fn, f.type)
                items.append(f'("{f.name}", {fn}),')
            else:
                items.append(f'("{f.name}", {self.ctype(f.type)}),')
        # C order, as many fields a line as fit (the file stays under 1,000 lines)
        rows: List[str] = []
        for item in items:
            if rows and len(rows[-1]) + 1 + len(item) <= WIDTH:
                rows[-1] += " " + item
            else:
                rows.append("    " + item)
        for r in rows:
            if len(r) > WIDTH:
                raise HeaderError(s.where, f"a field's line is over {WIDTH} characters: {r}")
        return out + [f"{cls}._fields_ = ["] + rows + ["]"]


# ------------------------------------------------------------------ inputs

def kind_headers(root: str) -> List[str]:
    """The kinds, from abi/include/loom/kinds/kinds.def when it exists (one
    `#include <loom/kinds/NAME.h>` a line), else every kinds/*.h in name order."""
    kdir = os.path.join(root, "abi", "include", "loom", "kinds")
    deff = os.path.join(kdir, "kinds.def")
    if not os.path.isfile(deff):
        return sorted(os.path.join("abi", "include", "loom", "kinds", f)
                      for f in os.listdir(kdir) if f.endswith(".h"))
    rel = os.path.relpath(deff, root)
    out = []
    text = open(deff, encoding="utf-8").read()
    # comments out, line numbers kept
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.DOTALL)
    # The list's closing hook for a host built with kinds of its own, which this package
    # does not know: exactly these three lines.
    extra = ["#ifdef LOOM_EXTRA_KINDS", "#include LOOM_EXTRA_KINDS", "#endif"]
    in_extra = 0
    for i, line in enumerate(text.split("\n"), 1):
        line = re.sub(r"//.*", "", line).strip()
        if not line:
            continue
        if in_extra < len(extra) and line == extra[in_extra] and (in_extra or line == extra[0]):
            in_extra += 1
            continue
        if in_extra not in (0, len(extra)):
            raise HeaderError(f"{rel}:{i}", f"'{line}': '{extra[in_extra]}' expected")
        m = re.fullmatch(r"#\s*include\s*<loom/kinds/([a-z0-9_]+\.h)>", line)
        if not m:
            raise HeaderError(f"{rel}:{i}", f"'{line}': `#include <loom/kinds/NAME.h>` expected")
        h = os.path.join("abi", "include", "loom", "kinds", m.group(1))
        if not os.path.isfile(os.path.join(root, h)):
            raise HeaderError(f"{rel}:{i}", f"no header {h}")
        out.append(h)
    return out


def headers(root: str) -> List[str]:
    return ([os.path.join("abi", "include", "loom", "abi.h"),
             os.path.join("abi", "include", "loom", "quant_format.h")] + kind_headers(root) +
            [os.path.join("host", "include", "loom", "embed.h")])


def generate(root: str) -> Dict[str, str]:
    """The files of loom/_abi: path under loom/ -> text."""
    model = Model()
    srcs = headers(root)
    for rel in srcs:
        read_header(os.path.join(root, rel), rel, model)
    return Writer(model).modules(srcs)


def on_disk(package: str) -> Dict[str, str]:
    """The .py files of package/_abi now: path under package/ -> text."""
    out: Dict[str, str] = {}
    for d, dirs, files in os.walk(os.path.join(package, "_abi")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                full = os.path.join(d, f)
                with open(full, encoding="utf-8") as fh:
                    out[os.path.relpath(full, package).replace(os.sep, "/")] = fh.read()
    return out


def main(argv: Optional[List[str]] = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.normpath(os.path.join(here, "..", "..")),
                    help="the repository root (default: this file's checkout)")
    ap.add_argument("--package", default=os.path.join(here, "loom"),
                    help="the loom package folder to write _abi/ in (default: beside this file)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when PACKAGE/_abi differs from the headers")
    a = ap.parse_args(argv)
    try:
        files = generate(a.root)
    except HeaderError as e:
        print(f"gen_abi.py: {e}", file=sys.stderr)
        return 2
    old = on_disk(a.package)
    stale = sorted(set(old) - set(files))
    changed = sorted(p for p, text in files.items() if old.get(p) != text)
    if a.check:
        if stale or changed:
            print(f"gen_abi.py: {os.path.join(a.package, '_abi')} is out of date with the "
                  f"headers ({', '.join(changed + stale)}); run python3 "
                  "bindings/python/gen_abi.py (or build the target loom_python_abi)",
                  file=sys.stderr)
            return 1
        return 0
    for p in stale:
        os.remove(os.path.join(a.package, p))
    for p in changed:
        full = os.path.join(a.package, p)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(files[p])
    return 0


if __name__ == "__main__":
    sys.exit(main())
