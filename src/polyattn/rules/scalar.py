"""Rules users write as scalar code: a traced ``score_mod`` or ``mask_mod``
(:mod:`.tracing`) written out as Python source that the kernels compile.

The Array-API paths call a user's function on tiles (:mod:`.user`). A kernel works one
score at a time: :func:`source` writes the traced expression as loops over a panel of
keys by query rows (a CPU kernel's tile of scores), or as one score (a GPU thread's), in
the compute type ``T``, with ``d score_mod / d score`` beside the value where the backward
pass wants it (forward differentiation of the graph). The kernels' families compile that
source (``numba_cpu``: a C-callable function its kernels call through a pointer).

A ``mod_args`` array reaches the compiled code flattened, floating ones into one buffer
of the compute type, integer and boolean ones into one int64 buffer, with a table of
offsets, shapes and strides (:func:`pack`); an index outside an axis is clamped to it
after negative indices count from the end, as on the Array-API paths
(:class:`polyattn.rules.user.Table`).

>>> from polyattn import ops
>>> from polyattn.rules.tracing import trace
>>> rule = trace(lambda s, b, h, q, kv: 30.0 * ops.tanh(s / 30.0), "score_mod", ())
>>> print(source(rule, "score_grad").splitlines()[0])
def score_grad(s, ld, n, w, key0, qs, hs, b, d, fb, ib, meta):
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from polyattn.rules.tracing import (
    ARITH,
    BITS,
    BOOL,
    COMPARE,
    FLOAT,
    INT,
    UNARY,
    Node,
    Traced,
    depends,
)

# --------------------------------------------------------------------------- #
# Source code
# --------------------------------------------------------------------------- #

#: The signatures of the generated functions. A panel: keys ``key0 + j``, ``j < n``, by
#: ``w`` query rows (row ``c``: query ``qs[c]`` of head ``hs[c]``, batch row ``b``), scores
#: ``s[j·ld + c]`` (rows contiguous: the loop over them runs in SIMD vectors), derivatives
#: ``d[j·ld + c]``, ``on[c]``: whether row ``c`` takes the mask; buffers ``fb``, ``ib``,
#: ``meta`` (:func:`pack`).
HEADS = {
    "score": "def score(s, ld, n, w, key0, qs, hs, b, fb, ib, meta):",
    "score_grad": "def score_grad(s, ld, n, w, key0, qs, hs, b, d, fb, ib, meta):",
    "mask": "def mask(s, ld, n, w, key0, qs, hs, b, on, fb, ib, meta):",
    # one score at a time (a GPU thread's): the value and derivative; whether it is visible
    "score_element": "def score_element(x, b, h, q, kv, fb, ib, meta):",
    "mask_element": "def mask_element(b, h, q, kv, fb, ib, meta):",
}


class _Writer:
    """Source lines for the nodes of one traced rule, each once."""

    def __init__(self, traced: Traced, grad: bool, width: int) -> None:
        self.traced, self.grad, self.width = traced, grad, width
        self.lines: list[str] = []
        self.values: dict[int, str] = {}
        self.derivatives: dict[int, str | None] = {}
        self.outer: list[str] = []           # loop-invariant lines (no kv, no score)
        self.per_key: list[str] = []         # lines of the key alone (kv, no q, h, score)
        self.per_row: list[tuple[str, str, str]] = []  # (name, expression, kind) of the
        # query row alone (q or h; no kv, no score): computed once per row, before the
        # loops (a panel reads them as a vector, not an element at a time)
        self.memo: dict[str, dict[int, bool]] = {leaf: {} for leaf in ("score", "kv", "q", "h")}

    def _level(self, node: Node) -> str:
        """Where ``node`` is computed: once ("outer"), per key ("key"), per query row
        ("row") or per score ("inner")."""
        memo = self.memo
        if depends(node, "score", memo["score"]):
            return "inner"
        key = depends(node, "kv", memo["kv"])
        row = depends(node, "q", memo["q"]) or depends(node, "h", memo["h"])
        return "inner" if key and row else "key" if key else "row" if row else "outer"

    def value(self, node: Node) -> str:
        key = id(node)
        if key in self.values:
            return self.values[key]
        op, args = node.op, node.args
        if op == "const":
            (c,) = args
            text = (_float_literal(float(c)) if node.kind == FLOAT else repr(c))
            self.values[key] = text
            return text
        if op in ("b", "h", "q", "kv"):
            self.values[key] = op
            return op
        if op == "score":
            self.values[key] = "x"
            return "x"
        expr = self._expression(node)
        name = f"v{len(self.values)}"
        level = self._level(node)
        if level == "row":
            self.per_row.append((name, expr, node.kind))
        else:
            {"outer": self.outer, "key": self.per_key, "inner": self.lines}[level].append(
                f"{name} = {expr}")
        self.values[key] = name
        return name

    def _as(self, node: Node, kind: str) -> str:
        v = self.value(node)
        if kind == FLOAT and node.kind != FLOAT:
            return f"T({v})"
        if kind == INT and node.kind == BOOL:
            return f"int({v})"
        return v

    def _expression(self, node: Node) -> str:
        op, args = node.op, node.args
        if op in ARITH:
            a, b = args
            kind = FLOAT if op == "truediv" else node.kind
            if kind == INT and op == "truediv":
                kind = FLOAT
            return f"{self._as(a, kind)} {ARITH[op]} {self._as(b, kind)}"
        if op == "pow":
            a, b = args
            if node.kind == FLOAT:
                return f"T({self._as(a, FLOAT)} ** {self.value(b)})"
            return f"{self.value(a)} ** {self.value(b)}"
        if op == "neg":
            return f"-{self._as(args[0], node.kind)}"
        if op == "abs":
            return f"abs({self.value(args[0])})"
        if op in COMPARE:
            a, b = args
            kind = FLOAT if FLOAT in (a.kind, b.kind) else INT
            return f"{self._as(a, kind)} {COMPARE[op]} {self._as(b, kind)}"
        if op in BITS:
            a, b = args
            return f"{self._as(a, INT)} {BITS[op]} {self._as(b, INT)}"
        if op == "invert":
            return f"~{self.value(args[0])}"
        if op in ("land", "lor", "lxor"):
            a, b = (self._condition(x) for x in args)
            return {"land": f"{a} and {b}", "lor": f"{a} or {b}", "lxor": f"{a} != {b}"}[op]
        if op == "lnot":
            return f"not {self._condition(args[0])}"
        if op == "tanh":                     # the target binds its own (numba_cpu: tanh32)
            return f"tanh({self._as(args[0], FLOAT)})"
        if op in UNARY:
            return f"math.{op}({self._as(args[0], FLOAT)})"
        if op == "cast":
            return self._as(args[0], FLOAT)
        if op == "where":
            c, x, y = args
            return (f"{self._as(x, node.kind)} if {self._condition(c)} else "
                    f"{self._as(y, node.kind)}")
        if op == "load":
            number, *index = args
            return self._load(number, index, node.kind)
        raise AssertionError(f"no source for {op}")

    def _condition(self, node: Node) -> str:
        v = self.value(node)
        return v if node.kind == BOOL else f"({v} != 0)"

    def _load(self, number: int, index: list[Node], kind: str) -> str:
        """Element ``index`` of ``mod_args[number]``: row ``number`` of ``meta`` (flat, rows
        of :func:`meta_width`) holds its offset in its buffer, then (size, stride) per
        axis."""
        row = number * self.width
        terms = [f"meta[{row}]"]
        for axis, i in enumerate(index):
            terms.append(f"clamp({self._as(i, INT)}, meta[{row + 1 + 2 * axis}]) * "
                         f"meta[{row + 2 + 2 * axis}]")
        flat = " + ".join(terms)
        if kind == FLOAT:
            return f"fb[{flat}]"
        if kind == BOOL:
            return f"ib[{flat}] != 0"
        return f"ib[{flat}]"

    def derivative(self, node: Node) -> str | None:
        """The derivative of ``node`` with respect to the score, as a name (``None``: 0)."""
        key = id(node)
        if key in self.derivatives:
            return self.derivatives[key]
        op, args = node.op, node.args
        expr: str | None = None
        if op == "score":
            expr = None
            self.derivatives[key] = "T(1)"
            return "T(1)"
        if node.kind != FLOAT or not depends(node, "score", self.memo["score"]):
            self.derivatives[key] = None
            return None
        ds = [self.derivative(a) if isinstance(a, Node) else None for a in args]
        if all(d is None for d in ds):           # a flat function of the score (s // c)
            self.derivatives[key] = None
            return None
        vs = [self.value(a) if isinstance(a, Node) else None for a in args]
        y = self.value(node)
        if op in ("add", "sub"):
            da, db = ds
            if db is None:
                expr = da
            elif da is None:
                expr = db if op == "add" else f"-{db}"
            else:
                expr = f"{da} {ARITH[op]} {db}"
        elif op == "mul":
            a, b = args
            parts = []
            if ds[0] is not None:
                parts.append(f"{ds[0]} * {self._as(b, FLOAT)}")
            if ds[1] is not None:
                parts.append(f"{self._as(a, FLOAT)} * {ds[1]}")
            expr = " + ".join(parts)
        elif op == "truediv":
            a, b = args
            bv = self._as(b, FLOAT)
            if ds[1] is None:
                expr = f"{ds[0]} / {bv}"
            else:
                da = ds[0] or "T(0)"
                expr = f"({da} * {bv} - {self._as(a, FLOAT)} * {ds[1]}) / ({bv} * {bv})"
        elif op == "floordiv":
            expr = None
        elif op == "mod":                        # a % b = a - (a // b) * b
            a, b = args
            if ds[1] is None:
                expr = ds[0]
            else:
                floor = f"(({self._as(a, FLOAT)}) // ({self._as(b, FLOAT)}))"
                expr = f"{ds[0] or 'T(0)'} - {floor} * {ds[1]}"
        elif op == "pow":
            a, b = args
            n = b.args[0]
            expr = f"T({float(n)!r}) * T({self._as(a, FLOAT)} ** {n - 1!r}) * {ds[0]}"
        elif op == "neg":
            expr = f"-{ds[0]}"
        elif op == "abs":
            v = vs[0]
            expr = f"(T(1) if {v} > 0 else (T(-1) if {v} < 0 else T(0))) * {ds[0]}"
        elif op in UNARY:
            grad = UNARY[op].replace("v", f"({vs[0]})").replace("y", y)
            expr = f"{grad} * {ds[0]}"
        elif op == "cast":
            expr = ds[0]
        elif op == "where":
            c, _, _ = args
            expr = f"{ds[1] or 'T(0)'} if {self._condition(c)} else {ds[2] or 'T(0)'}"
        if expr is None:
            self.derivatives[key] = None
            return None
        name = f"d{len(self.derivatives)}"
        self.lines.append(f"{name} = {expr}")
        self.derivatives[key] = name
        return name


def source(traced: Traced, form: str, width: int | None = None) -> str:
    """Python source of ``traced`` as the function ``form`` (of :data:`HEADS`).

    Over a panel of keys by query rows (:data:`HEADS`): ``score`` replaces each score
    by the rule's, ``score_grad`` does so and multiplies ``d`` by the rule's
    derivative, ``mask`` puts ``-inf`` on the keys it hides from the rows ``on``.
    One score at a time: ``score_element`` returns the rule's score and its derivative,
    ``mask_element`` whether the key is visible. In a panel, what depends on the query
    row alone is computed once per row, before the loops, and what depends on the key
    alone once per key. Names it uses: ``T`` (the compute type), ``math``, ``np``,
    ``clamp``, ``tanh``. ``width``: entries of ``meta`` per array
    (:func:`pack`; default :func:`meta_width`), for buffers that hold more arrays
    than this rule reads after its own."""
    w = _Writer(traced, grad=form in ("score_grad", "score_element"),
                width=meta_width(traced) if width is None else width)
    w.value(traced.result)
    if form in ("score_element", "mask_element"):
        if form == "score_element":
            grad = w.derivative(traced.result)
            tail = [f"return {w._as(traced.result, FLOAT)}, {grad or 'T(0)'}"]
        else:
            tail = [f"return {w._condition(traced.result)}"]
        body = [*w.outer, *w.per_key, *(f"{name} = {expr}" for name, expr, _ in w.per_row),
                *w.lines, *tail]
        return "\n".join([HEADS[form], *("    " + line for line in body)]) + "\n"
    at = "s[j * ld + c]"
    if form == "score":
        tail = [f"{at} = {w._as(traced.result, FLOAT)}"]
    elif form == "score_grad":
        grad = w.derivative(traced.result)
        tail = [f"{at} = {w._as(traced.result, FLOAT)}",
                f"d[j * ld + c] = d[j * ld + c] * {grad or 'T(0)'}"]
    elif form == "mask":
        tail = [f"if on[c] != 0 and not ({w._condition(traced.result)}):",
                f"    {at} = -T(math.inf)"]
    else:
        raise ValueError(f"form must be one of {sorted(HEADS)}, got {form!r}")
    lines = [HEADS[form], *("    " + line for line in w.outer)]
    if form != "mask" and not w.per_row and not w.per_key and not any(
            re.search(r"\b(q|h|kv)\b", line) for line in (*w.lines, *tail)):
        # a rule of the score alone: where the rows of the panel are contiguous, one loop
        # over all of it (long SIMD runs, no loop set up per key)
        flat = [line.replace("j * ld + c", "t") for line in (*w.lines, *tail)]
        lines += ["    if ld == w:", "        for t in range(n * w):", "            x = s[t]",
                  *("            " + line for line in flat), "        return"]
    dtypes = {FLOAT: "T", INT: "np.int64", BOOL: "np.bool_"}
    if w.per_row:                        # the values of each query row, in one array each
        lines += [f"    r{name} = np.empty(w, {dtypes[kind]})" for name, _, kind in w.per_row]
        lines += ["    for c in range(w):", "        q = qs[c]", "        h = hs[c]"]
        for name, expr, _ in w.per_row:
            lines += [f"        {name} = {expr}", f"        r{name}[c] = {name}"]
    lines += ["    for j in range(n):", "        kv = key0 + j",
              *("        " + line for line in w.per_key),
              "        for c in range(w):", "            q = qs[c]", "            h = hs[c]",
              *(f"            {name} = r{name}[c]" for name, _, _ in w.per_row)]
    if form != "mask":
        lines.append(f"            x = {at}")
    lines += ["            " + line for line in (*w.lines, *tail)]
    return "\n".join(lines) + "\n"


def _float_literal(c: float) -> str:
    """A floating constant as source in the compute type ``T``: ``inf``, ``-inf`` and
    ``nan`` by name (their ``repr`` is no Python literal)."""
    if math.isnan(c):
        return "T(math.nan)"
    if math.isinf(c):
        return "T(math.inf)" if c > 0 else "T(-math.inf)"
    return f"T({c!r})"


def meta_width(traced: Traced) -> int:
    """Entries of ``meta`` per ``mod_args`` array: the offset, then (size, stride) per axis
    of the array with the most axes."""
    return 1 + 2 * max([len(shape) for shape, _ in traced.tables], default=0)


def clamp(i, n):  # type: ignore[no-untyped-def]
    """Index ``i`` of an axis of ``n`` (negative: from the end), clamped to it."""
    if i < 0:
        i += n
    return min(max(i, 0), n - 1)


def pack(mod_args: tuple[Any, ...], dtype: Any, width: int,
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fb, ib, meta)``: the floating arrays of ``mod_args`` flattened into one buffer of
    ``dtype``, the integer and boolean ones into one int64 buffer, and, ``width`` entries
    per array (:func:`meta_width`), its offset in its buffer then (size, stride) per axis
    (int64, flat). Each buffer holds one element at least.

    >>> fb, ib, meta = pack((np.ones((2, 3)), np.arange(4)), np.float32, 5)
    >>> fb.shape, ib.tolist(), meta.tolist()
    ((7,), [0, 1, 2, 3, 0], [0, 2, 3, 3, 1, 0, 4, 1, 0, 0])
    """
    floats: list[np.ndarray] = []
    ints: list[np.ndarray] = []
    meta = np.zeros(max(1, width * len(mod_args)), dtype=np.int64)
    f_at = i_at = 0
    for number, a in enumerate(mod_args):
        a = np.asarray(a)
        if np.issubdtype(a.dtype, np.floating):
            floats.append(a.astype(dtype).reshape(-1))
            at, f_at = f_at, f_at + a.size
        else:
            ints.append(a.astype(np.int64).reshape(-1))
            at, i_at = i_at, i_at + a.size
        row = [at]
        for axis, n in enumerate(a.shape):
            row += [n, math.prod(a.shape[axis + 1:])]
        meta[number * width:number * width + len(row)] = row
    fb = np.concatenate([*floats, np.zeros(1, dtype=dtype)])
    ib = np.concatenate([*ints, np.zeros(1, dtype=np.int64)])
    return np.ascontiguousarray(fb, dtype=dtype), np.ascontiguousarray(ib), meta
