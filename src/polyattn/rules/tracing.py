"""A rule users write (``score_mod`` or ``mask_mod``) traced once into an expression.

A kernel works one score at a time, so :func:`trace` calls the function once on symbolic
values (:class:`Node`) that record what it does: arithmetic, comparisons, the functions of
:mod:`polyattn.ops`, and ``mod_args`` indexed by the index arguments. The record is a
small expression graph, which :mod:`.scalar` writes out as source for the kernels.

Tracing raises :class:`TypeError` naming the function and the construct that cannot
become scalar code: Python control flow on an argument, ``math`` or NumPy functions on
one, an array other than ``mod_args``, a power whose exponent is not a number.

>>> from polyattn import ops
>>> rule = trace(lambda s, b, h, q, kv: 30.0 * ops.tanh(s / 30.0), "score_mod", ())
>>> rule.uses_score, rule.kind
(True, 'f')
>>> trace(lambda s, b, h, q, kv: s if q > kv else -s, "score_mod", ())  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
TypeError: score_mod <lambda> cannot be compiled into a kernel: ...
"""

from __future__ import annotations

import dis
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
UNARY = {"exp": "y", "log": "T(1) / v", "tanh": "(T(1) - y * y)", "sqrt": "T(0.5) / y",
         "sin": "math.cos(v)", "cos": "(-math.sin(v))"}
ARITH = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%"}
COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
BITS = {"and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}


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
            raise TypeError(f"the operator {BITS[name]} on a floating value (scores, "
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
        if name in UNARY:
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
        return depends(self.result, "score", {})


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
        text, kind = str(exc), type(exc).__name__
        indexed = indexed_array(exc)
        if indexed is not None:
            text, kind = indexed, "TypeError"
        elif "ufunc" in text or "a NumPy function" in text or "Python float" in text:
            if "ufunc" in text:
                text += " (a NumPy function on a rule's argument: use polyattn.ops)"
            text += ops_hint(fn, "; ")
        raise TypeError(f"{what} {_name(fn)} cannot be compiled into a kernel: "
                        f"{kind}: {text}") from exc
    kinds = tuple((t.shape, BOOL if t.dtype == np.bool_ else
                   FLOAT if np.issubdtype(t.dtype, np.floating) else INT) for t in tables)
    return Traced(what=what, result=result, tables=kinds)


#: The functions of :mod:`math` and NumPy that :mod:`polyattn.ops` has, by name: the
#: ``ops`` function to use on a rule's arguments instead.
_OPS_OF = {"exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "sin": "sin",
           "cos": "cos", "fabs": "abs", "abs": "abs", "absolute": "abs", "where": "where",
           "maximum": "maximum", "minimum": "minimum", "fmax": "maximum",
           "fmin": "minimum", "logical_and": "logical_and", "logical_or": "logical_or",
           "logical_not": "logical_not"}


def ops_hint(fn: Any, lead: str = ": ") -> str:
    """The :mod:`math` and NumPy functions with a :mod:`polyattn.ops` form that ``fn``'s
    code calls (``math.exp``, or ``exp`` imported from :mod:`math`, from its globals or
    its closure), as ``lead`` then ``"math.exp -> ops.exp"``, ...; ``""`` where it names
    none (or cannot be read)."""
    try:
        import dis

        glob = getattr(fn, "__globals__", {})
        cells = {name: cell.cell_contents for name, cell in zip(
            fn.__code__.co_freevars, fn.__closure__ or (), strict=False)}
        stack, found = [fn.__code__], []
        while stack:
            code = stack.pop()
            stack.extend(c for c in code.co_consts if hasattr(c, "co_code"))
            module = None                        # the module just loaded, and its name
            for ins in dis.get_instructions(code):
                value = None
                if isinstance(ins.argval, str):
                    value = (glob.get(ins.argval) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                             else cells.get(ins.argval) if ins.opname == "LOAD_DEREF"
                             else None)
                name = ins.argval if isinstance(ins.argval, str) else ""
                if (module is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD")
                        and name in _OPS_OF and hasattr(module[1], name)):
                    found.append(f"{module[0]}.{name} -> ops.{_OPS_OF[name]}")
                elif value is not None and name in _OPS_OF and any(
                        value is getattr(m, name, None) for m in (math, np)):
                    found.append(f"{name} -> ops.{_OPS_OF[name]}")
                module = (name, value) if value is math or value is np else None
        return lead + ", ".join(dict.fromkeys(found)) if found else ""
    except Exception:                            # a hint, never an error of its own
        return ""


def indexed_array(exc: BaseException) -> str | None:
    """What a rule that ``exc`` stopped while tracing it indexed, where that is an array
    (or list, ...) other than a ``mod_args`` one: a message naming the variable and the
    fix; ``None`` where it stopped elsewhere. The subscript in progress is found from the
    traceback: the outermost frame (the rule's, or a function it calls) whose current
    instruction is a subscript; the indexed value is the one that instruction found on the
    stack under the index (:func:`_subscripted`)."""
    try:
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code is trace.__code__:
            tb = tb.tb_next                      # the rule's frame, and those it called
        own = {Node.__array__.__code__, Node.__int__.__code__}
        through_node = False
        found = None
        while tb is not None:
            if found is None:
                found = _subscripted(tb.tb_frame, tb.tb_lasti)
            through_node = through_node or tb.tb_frame.f_code in own
            tb = tb.tb_next
        if found is None:
            return None
        where, name, value = found
        if isinstance(value, (TracedTable, Node)):
            return None                          # its own message says what is wrong
        if value is None and not through_node:
            return None                          # an attribute: not sure it is an array
        what = type(value).__name__ if value is not None else "array"
        shape = getattr(value, "shape", None)
        about = (f"{where} {name}, " if name else "") + (
            f"of shape {tuple(shape)}, " if shape is not None else "")
        fix = f"as mod_args=({name},)" if name and where != "the attribute" else "in mod_args"
        return (f"{'an' if what[0] in 'aeiouAEIOU' else 'a'} {what} in a rule ({about}"
                "indexed by a rule's argument): arrays reach a rule only through mod_args "
                "(indexed by the index arguments), values as Python numbers; pass it "
                f"{fix} and index the argument the rule receives for it")
    except Exception:                            # a better message, never an error
        return None


def _subscripted(frame: Any, at: int) -> tuple[str, str, Any] | None:
    """``(where, name, value)`` of the variable that the instruction at offset ``at`` of
    ``frame`` indexes, where that instruction is a subscript (``value`` ``None`` for an
    attribute, all three empty for a value that is no variable); else ``None``. The
    indexed value is produced by the instruction before the
    index expression, found by going back over the instructions' stack effects until the
    index, one value, is on the stack."""
    import dis

    code = frame.f_code
    before = []
    for ins in dis.get_instructions(code):
        if ins.offset == at:
            if not (ins.opname == "BINARY_SUBSCR"
                    or (ins.opname == "BINARY_OP" and ins.argrepr == "[]")):
                return None
            break
        before.append(ins)
    else:
        return None
    depth = 0
    for n in range(len(before) - 1, -1, -1):
        ins = before[n]
        depth += dis.stack_effect(ins.opcode, ins.arg if ins.opcode >= dis.HAVE_ARGUMENT
                                  else None, jump=False)
        if depth >= 1:
            if depth >= 2 and ins.opname == "LOAD_FAST_LOAD_FAST":
                name = ins.argval[0]
            elif depth == 1 and n > 0:
                ins = before[n - 1]
                name = ins.argval
            else:
                return "", "", None
            break
    else:
        return "", "", None
    if not isinstance(name, str):
        return "", "", None
    op = ins.opname
    if op in ("LOAD_GLOBAL", "LOAD_NAME"):
        value = frame.f_globals.get(name, frame.f_builtins.get(name))
        return "the global", name, value
    if op.startswith(("LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FAST")):
        where = "the closure variable" if name in code.co_freevars else "the variable"
        return where, name, frame.f_locals.get(name)
    if op in ("LOAD_ATTR", "LOAD_METHOD"):
        return "the attribute", name, None
    return "", "", None


#: Values a rule may read from its closure or globals and still be recognised by
#: :func:`fingerprint`: numbers, strings, None (by value) and these modules.
_PLAIN = (bool, int, float, complex, str, bytes, type(None), np.number, np.bool_)


def fingerprint(fn: Any, _depth: int = 0) -> Any:
    """A hashable key that is equal for two rules whose traces are equal: the function's
    code, defaults, and the values of its closure and of the globals its code reads
    (numbers and strings by value, floats by their bits; :mod:`polyattn.ops`, :mod:`math`
    and NumPy, and their functions, by name; other functions by their own fingerprint);
    ``None`` where the function reads anything else
    (an object whose attributes may change): such a rule is traced at every call."""
    code = getattr(fn, "__code__", None)
    if code is None or _depth > 4:
        return None
    from polyattn import ops

    modules = {id(ops): "ops", id(math): "math", id(np): "np"}

    def value(v: Any) -> Any:
        if isinstance(v, (float, np.floating)):         # by their bits: 0.0 is not -0.0
            return (type(v), float(v).hex())
        if isinstance(v, (complex, np.complexfloating)):
            return (type(v), complex(v).real.hex(), complex(v).imag.hex())
        if isinstance(v, _PLAIN):
            return (type(v), v)
        if id(v) in modules:
            return modules[id(v)]
        if callable(v) and getattr(v, "__module__", None) == ops.__name__:
            return ("ops", getattr(v, "__name__", None))       # polyattn.ops by name
        if isinstance(v, np.ufunc):
            return ("np", v.__name__)
        if isinstance(v, type(math.exp)) and getattr(v, "__module__", None) == "math":
            return ("math", v.__name__)
        if isinstance(v, tuple):
            parts = tuple(value(x) for x in v)
            return None if any(x is None for x in parts) else parts
        if getattr(v, "__code__", None) is not None:
            return fingerprint(v, _depth + 1)
        return None

    names: set[str] = set()
    stack = [code]
    while stack:                # the globals the code and the code it nests read (not the
        c = stack.pop()         # attribute names, which co_names holds as well)
        names.update(ins.argval for ins in dis.get_instructions(c)
                     if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        stack.extend(x for x in c.co_consts if hasattr(x, "co_names"))
    glob = getattr(fn, "__globals__", {})
    parts = [("code", code), ("defaults", value(fn.__defaults__ or ())),
             ("kwdefaults", value(tuple(sorted((fn.__kwdefaults__ or {}).items()))))]
    try:
        parts += [("cell", value(c.cell_contents)) for c in fn.__closure__ or ()]
    except ValueError:                                 # a cell not yet assigned
        return None
    parts += [(name, value(glob[name])) for name in sorted(names) if name in glob]
    if any(v is None for _, v in parts):
        return None
    return tuple(parts)


def depends(node: Node, leaf: str, memo: dict[int, bool]) -> bool:
    key = id(node)
    if key not in memo:
        memo[key] = node.op == leaf or any(
            depends(a, leaf, memo) for a in node.args if isinstance(a, Node))
    return memo[key]
