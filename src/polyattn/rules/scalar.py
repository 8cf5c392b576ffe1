"""Rules users write as scalar code: a ``score_mod`` or ``mask_mod`` traced once into an
expression, and that expression written out as Python source that the kernels compile.

The Array-API paths call a user's function on tiles (:mod:`.user`). A kernel works one
score at a time, so :func:`trace` calls the function once on symbolic values
(:class:`Node`) that record what it does: arithmetic, comparisons, the functions of
:mod:`polyattn.ops`, and ``mod_args`` indexed by the index arguments. The record is a
small expression graph; :func:`source` writes it as loops over a panel of keys by query
rows (a CPU kernel's tile of scores), or as one score (a GPU thread's), in the compute
type ``T``, with
``d score_mod / d score`` beside the value where the backward pass wants it (forward
differentiation of the graph). The kernels' families compile that source
(``numba_cpu``: a C-callable function its kernels call through a pointer).

A ``mod_args`` array reaches the compiled code flattened, floating ones into one buffer
of the compute type, integer and boolean ones into one int64 buffer, with a table of
offsets, shapes and strides (:func:`pack`); an index outside an axis is clamped to it
after negative indices count from the end, as on the Array-API paths
(:class:`polyattn.rules.user.Table`).

Tracing raises :class:`TypeError` naming the function and the construct that cannot
become scalar code: Python control flow on an argument, ``math`` or NumPy functions on
one, an array other than ``mod_args``, a power whose exponent is not a number.

>>> from polyattn import ops
>>> rule = trace(lambda s, b, h, q, kv: 30.0 * ops.tanh(s / 30.0), "score_mod", ())
>>> rule.uses_score, rule.kind
(True, 'f')
>>> print(source(rule, "score_grad").splitlines()[0])
def score_grad(s, ld, n, w, key0, qs, hs, b, d, fb, ib, meta):
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyattn.ops import _CONTROL_FLOW

#: Kinds of a value: floating (the compute type), integer (int64), boolean.
FLOAT, INT, BOOL = "f", "i", "b"

#: ops functions of one floating argument: (name in math, derivative as source in ``v``
#: the argument and ``y`` the result).
_UNARY = {"exp": "y", "log": "T(1) / v", "tanh": "(T(1) - y * y)", "sqrt": "T(0.5) / y",
          "sin": "math.cos(v)", "cos": "(-math.sin(v))"}
_ARITH = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_BITS = {"and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}


class Node:
    """A value of a rule being traced: an operation on other nodes (or a leaf)."""

    __slots__ = ("args", "kind", "op")
    __array_ufunc__ = None          # NumPy's functions refuse it (raise) instead of looping

    def __init__(self, op: str, args: tuple[Any, ...], kind: str) -> None:
        self.op, self.args, self.kind = op, args, kind

    # --- arithmetic
    def _arith(self, name: str, other: Any, reflected: bool = False) -> Node:
        a, b = (_lift(other), self) if reflected else (self, _lift(other))
        if name == "truediv":
            kind = FLOAT
        elif FLOAT in (a.kind, b.kind):
            kind = FLOAT
        else:
            kind = INT
        return Node(name, (a, b), kind)

    def __add__(self, o: Any) -> Node: return self._arith("add", o)
    def __radd__(self, o: Any) -> Node: return self._arith("add", o, True)
    def __sub__(self, o: Any) -> Node: return self._arith("sub", o)
    def __rsub__(self, o: Any) -> Node: return self._arith("sub", o, True)
    def __mul__(self, o: Any) -> Node: return self._arith("mul", o)
    def __rmul__(self, o: Any) -> Node: return self._arith("mul", o, True)
    def __truediv__(self, o: Any) -> Node: return self._arith("truediv", o)
    def __rtruediv__(self, o: Any) -> Node: return self._arith("truediv", o, True)
    def __floordiv__(self, o: Any) -> Node: return self._arith("floordiv", o)
    def __rfloordiv__(self, o: Any) -> Node: return self._arith("floordiv", o, True)
    def __mod__(self, o: Any) -> Node: return self._arith("mod", o)
    def __rmod__(self, o: Any) -> Node: return self._arith("mod", o, True)

    def __pow__(self, o: Any) -> Node:
        if isinstance(o, bool) or not isinstance(o, (int, float, np.integer, np.floating)):
            raise TypeError("a power whose exponent is not a Python number: write it with "
                            "ops.exp and ops.log")
        return Node("pow", (self, _lift(o)), FLOAT if self.kind == FLOAT or
                    isinstance(o, (float, np.floating)) or o < 0 else INT)

    def __rpow__(self, o: Any) -> Node:
        if isinstance(o, bool) or not isinstance(o, (int, float, np.integer, np.floating)) \
                or o <= 0:
            raise TypeError("a power of a number by a rule's argument needs a positive "
                            f"Python number as its base; got {o!r}")
        return Node("exp", (self * math.log(o),), FLOAT)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a NumPy function on a rule's argument: use the functions of "
                        "polyattn.ops (ops.where, ops.maximum, ...)")

    def __neg__(self) -> Node: return Node("neg", (self,), self.kind if self.kind != BOOL
                                           else INT)
    def __pos__(self) -> Node: return self
    def __abs__(self) -> Node: return Node("abs", (self,), self.kind)

    # --- comparisons, conditions and bits
    def _compare(self, name: str, o: Any) -> Node:
        return Node(name, (self, _lift(o)), BOOL)

    def __lt__(self, o: Any) -> Node: return self._compare("lt", o)
    def __le__(self, o: Any) -> Node: return self._compare("le", o)
    def __gt__(self, o: Any) -> Node: return self._compare("gt", o)
    def __ge__(self, o: Any) -> Node: return self._compare("ge", o)
    def __eq__(self, o: Any) -> Node: return self._compare("eq", o)  # type: ignore[override]
    def __ne__(self, o: Any) -> Node: return self._compare("ne", o)  # type: ignore[override]
    __hash__ = None  # type: ignore[assignment]

    def _bits(self, name: str, o: Any, reflected: bool = False) -> Node:
        a, b = (_lift(o), self) if reflected else (self, _lift(o))
        if FLOAT in (a.kind, b.kind):
            raise TypeError(f"the operator {_BITS[name]} on a floating value (scores, "
                            "floating mod_args)")
        if a.kind == BOOL and b.kind == BOOL and name in ("and", "or", "xor"):
            return Node("l" + name, (a, b), BOOL)
        return Node(name, (a, b), INT)

    def __and__(self, o: Any) -> Node: return self._bits("and", o)
    def __rand__(self, o: Any) -> Node: return self._bits("and", o, True)
    def __or__(self, o: Any) -> Node: return self._bits("or", o)
    def __ror__(self, o: Any) -> Node: return self._bits("or", o, True)
    def __xor__(self, o: Any) -> Node: return self._bits("xor", o)
    def __rxor__(self, o: Any) -> Node: return self._bits("xor", o, True)
    def __lshift__(self, o: Any) -> Node: return self._bits("lshift", o)
    def __rshift__(self, o: Any) -> Node: return self._bits("rshift", o)

    def __invert__(self) -> Node:
        if self.kind == FLOAT:
            raise TypeError("the operator ~ on a floating value (scores, floating mod_args)")
        return Node("lnot" if self.kind == BOOL else "invert", (self,), self.kind)

    # --- what cannot become scalar code
    def __bool__(self) -> bool:
        raise TypeError(_CONTROL_FLOW)

    def __float__(self) -> float:
        raise TypeError("a rule's argument made a Python float (math.* or float() on it): "
                        "use the functions of polyattn.ops")

    def __int__(self) -> int:
        raise TypeError("a rule's argument made a Python int (int() or range() on it): "
                        "use ops.where for choices and mod_args tables for lookups")

    __index__ = __int__

    def __getitem__(self, index: Any) -> Any:
        raise TypeError("indexing a rule's index argument or score: index a mod_args array "
                        "with them instead (table[h, q_idx])")

    def __iter__(self) -> Any:
        raise TypeError("iterating over a rule's argument (it is one number per score)")

    # --- polyattn.ops on traced values
    @classmethod
    def _rule_op(cls, name: str, args: tuple[Any, ...]) -> Node:
        """``polyattn.ops.<name>(*args)`` where some argument is traced."""
        if name in _UNARY:
            (x,) = args
            return Node(name, (_lift(x),), FLOAT)
        if name == "abs":
            return abs(_lift(args[0]))
        if name == "cast":
            x, _ = args
            return Node("cast", (_lift(x),), FLOAT)
        if name == "where":
            c, x, y = (_lift(a) for a in args)
            if c.kind == FLOAT:
                raise TypeError("ops.where's condition must be a comparison (score > 0), not "
                                "a score")
            kinds = {x.kind, y.kind}
            kind = FLOAT if FLOAT in kinds else (INT if INT in kinds else BOOL)
            return Node("where", (c, x, y), kind)
        if name in ("logical_and", "logical_or"):
            x, y = (_lift(a) for a in args)
            if FLOAT in (x.kind, y.kind):
                raise TypeError(f"ops.{name} takes conditions (comparisons), not scores")
            return Node("l" + name.split("_")[1], (x, y), BOOL)
        if name == "logical_not":
            x = _lift(args[0])
            if x.kind == FLOAT:
                raise TypeError("ops.logical_not takes a condition (a comparison), not a score")
            return Node("lnot", (x,), BOOL)
        raise TypeError(f"ops.{name} has no scalar form")


def _lift(x: Any) -> Node:
    """``x`` as a node: a node, or a Python (or NumPy) number as a constant."""
    if isinstance(x, Node):
        return x
    if isinstance(x, (bool, np.bool_)):
        return Node("const", (bool(x),), BOOL)
    if isinstance(x, (int, np.integer)):
        return Node("const", (int(x),), INT)
    if isinstance(x, (float, np.floating)):
        return Node("const", (float(x),), FLOAT)
    raise TypeError(f"a {type(x).__name__} in a rule: arrays reach a rule only through "
                    "mod_args (indexed by the index arguments), values as Python numbers")


class TracedTable:
    """A ``mod_args`` array while a rule is traced: indexed on every axis by index
    arguments or Python ints, it gives a node that loads one element."""

    __slots__ = ("dtype", "number", "shape")

    def __init__(self, number: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.number, self.shape, self.dtype = number, shape, dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: Any) -> Node:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != len(self.shape):    # a 0-d array is read as table[()]
            raise TypeError(f"mod_args[{self.number}] of shape {self.shape} indexed by "
                            f"{len(index)} indices: a kernel indexes every axis (one element "
                            "per score)")
        parts = tuple(_lift(i) for i in index)
        if any(p.kind == FLOAT for p in parts):
            raise TypeError(f"mod_args[{self.number}] indexed by a floating value: indices "
                            "are integers (cast a computed index with // or a table)")
        kind = (BOOL if np.dtype(self.dtype) == np.bool_ else
                FLOAT if np.issubdtype(self.dtype, np.floating) else INT)
        return Node("load", (self.number, *parts), kind)

    def __repr__(self) -> str:
        return f"TracedTable(shape={self.shape}, dtype={self.dtype})"


@dataclass(frozen=True)
class Traced:
    """A traced rule: its result node, what it is, and the ``mod_args`` it reads."""

    what: str                       # "score_mod" or "mask_mod"
    result: Node
    tables: tuple[tuple[tuple[int, ...], str], ...]    # (shape, kind) of each mod_args array

    @property
    def kind(self) -> str:
        return self.result.kind

    @property
    def uses_score(self) -> bool:
        return _depends(self.result, "score", {})


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def trace(fn: Callable[..., Any], what: str, mod_args: tuple[Any, ...]) -> Traced:
    """``fn`` (a ``score_mod`` or ``mask_mod``, ``what``) run once on symbolic values;
    :class:`TypeError` naming the function and the construct where it cannot be."""
    tables = tuple(TracedTable(n, tuple(int(s) for s in a.shape), np.dtype(a.dtype))
                   for n, a in enumerate(mod_args))
    index = tuple(Node(name, (), INT) for name in ("b", "h", "q", "kv"))
    args = ((Node("score", (), FLOAT),) if what == "score_mod" else ()) + index
    try:
        out = fn(*args, *tables)
        result = _lift(out)
        if what == "mask_mod" and result.kind != BOOL:
            raise TypeError("it must return a condition (a comparison, True = visible), not "
                            f"a {'score' if result.kind == FLOAT else 'number'}")
        if what == "score_mod" and result.kind == BOOL:
            raise TypeError("it must return a score, not a condition")
    except Exception as exc:
        text = str(exc)
        if "ufunc" in text:
            text += " (a NumPy function on a rule's argument: use polyattn.ops)"
        raise TypeError(f"{what} {_name(fn)} cannot be compiled into a kernel: "
                        f"{type(exc).__name__}: {text}") from exc
    kinds = tuple((t.shape, BOOL if t.dtype == np.bool_ else
                   FLOAT if np.issubdtype(t.dtype, np.floating) else INT) for t in tables)
    return Traced(what=what, result=result, tables=kinds)


def _depends(node: Node, leaf: str, memo: dict[int, bool]) -> bool:
    key = id(node)
    if key not in memo:
        memo[key] = node.op == leaf or any(
            _depends(a, leaf, memo) for a in node.args if isinstance(a, Node))
    return memo[key]


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
        self.depends: dict[int, bool] = {}

    def _varies(self, node: Node) -> bool:
        """Whether ``node`` changes within the loops (else it is computed once, before)."""
        return any(_depends(node, leaf, {}) for leaf in ("kv", "q", "h", "score"))

    def value(self, node: Node) -> str:
        key = id(node)
        if key in self.values:
            return self.values[key]
        op, args = node.op, node.args
        if op == "const":
            (c,) = args
            text = (f"T({float(c)!r})" if node.kind == FLOAT else repr(c))
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
        (self.lines if self._varies(node) else self.outer).append(f"{name} = {expr}")
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
        if op in _ARITH:
            a, b = args
            kind = FLOAT if op == "truediv" else node.kind
            if kind == INT and op == "truediv":
                kind = FLOAT
            return f"{self._as(a, kind)} {_ARITH[op]} {self._as(b, kind)}"
        if op == "pow":
            a, b = args
            if node.kind == FLOAT:
                return f"T({self._as(a, FLOAT)} ** {self.value(b)})"
            return f"{self.value(a)} ** {self.value(b)}"
        if op == "neg":
            return f"-{self._as(args[0], node.kind)}"
        if op == "abs":
            return f"abs({self.value(args[0])})"
        if op in _COMPARE:
            a, b = args
            kind = FLOAT if FLOAT in (a.kind, b.kind) else INT
            return f"{self._as(a, kind)} {_COMPARE[op]} {self._as(b, kind)}"
        if op in _BITS:
            a, b = args
            return f"{self._as(a, INT)} {_BITS[op]} {self._as(b, INT)}"
        if op == "invert":
            return f"~{self.value(args[0])}"
        if op in ("land", "lor", "lxor"):
            a, b = (self._condition(x) for x in args)
            return {"land": f"{a} and {b}", "lor": f"{a} or {b}", "lxor": f"{a} != {b}"}[op]
        if op == "lnot":
            return f"not {self._condition(args[0])}"
        if op == "tanh":                     # the target binds its own (numba_cpu: tanh32)
            return f"tanh({self._as(args[0], FLOAT)})"
        if op in _UNARY:
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
        if node.kind != FLOAT or not _depends(node, "score", {}):
            self.derivatives[key] = None
            return None
        ds = [self.derivative(a) if isinstance(a, Node) else None for a in args]
        vs = [self.value(a) if isinstance(a, Node) else None for a in args]
        y = self.value(node)
        if op in ("add", "sub"):
            da, db = ds
            if db is None:
                expr = da
            elif da is None:
                expr = db if op == "add" else f"-{db}"
            else:
                expr = f"{da} {_ARITH[op]} {db}"
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
        elif op == "mod":
            expr = ds[0]
        elif op == "pow":
            a, b = args
            n = b.args[0]
            expr = f"T({float(n)!r}) * T({self._as(a, FLOAT)} ** {n - 1!r}) * {ds[0]}"
        elif op == "neg":
            expr = f"-{ds[0]}"
        elif op == "abs":
            v = vs[0]
            expr = f"(T(1) if {v} > 0 else (T(-1) if {v} < 0 else T(0))) * {ds[0]}"
        elif op in _UNARY:
            grad = _UNARY[op].replace("v", f"({vs[0]})").replace("y", y)
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
    ``mask_element`` whether the key is visible. Names it uses: ``T`` (the compute
    type), ``math``, ``clamp``, ``tanh``. ``width``: entries of ``meta`` per array
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
        body = [*w.outer, *w.lines, *tail]
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
    lines = [HEADS[form], *("    " + line for line in w.outer),
             "    for j in range(n):", "        kv = key0 + j",
             "        for c in range(w):", "            q = qs[c]", "            h = hs[c]"]
    if form != "mask":
        lines.append(f"            x = {at}")
    lines += ["            " + line for line in (*w.lines, *tail)]
    return "\n".join(lines) + "\n"


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
