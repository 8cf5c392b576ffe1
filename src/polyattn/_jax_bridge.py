"""Running an implementation written for NumPy arrays (the ``numba_cpu`` kernel) on JAX CPU
arrays: eagerly, under ``jax.jit``, ``jax.grad``, ``jax.vmap`` and forward-mode transforms.

A call becomes three JAX primitives over its arrays (query, key, value, then those of the
rules: the mask, key lengths, ALiBi slopes, segment ids, ``mod_args``, a traced dropout
seed), each carrying what else the call is (:class:`Call`, fixed while JAX transforms it):

* ``polyattn_forward`` gives ``(out, lse)``;
* ``polyattn_tangent`` gives their tangents, linear in those of query, key and value;
* ``polyattn_backward`` gives the gradients of query, key and value from the cotangents of
  ``out`` and ``lse``.

Evaluated eagerly, each runs the implementation on NumPy views of the arrays (no copy in);
compiled (``jax.jit``) on the CPU, it is an XLA FFI handler doing the same on XLA's buffers
(:mod:`._jax_ffi`), and a host callback (``jax.pure_callback``, which copies) elsewhere
and in a process with several devices. The
forward's JVP rule is the forward plus the tangent; the tangent's transpose (what
``jax.grad`` and ``jax.vjp`` use) is the backward pass: so reverse mode runs the kernel
both ways. The tangent itself, when forward mode asks for it (``jax.jvp``,
``jax.jacfwd``), and any derivative with respect to a rule's array (the mask, slopes,
``mod_args``) come from the call's differentiable Array-API implementation (``generic``),
as do second derivatives. ``jax.vmap`` adds leading batch axes: the kernel takes them as
more batch rows, or, where a batch row's index means something to the rules (dropout's
counters, a user rule's ``b``), runs once per mapped index.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyattn._problem import Problem

Array = Any
#: Operands of a call besides query, key and value, in order (``None`` where absent).
SLOTS = ("mask", "key_lengths", "alibi", "q_ids", "k_ids", "dropout_seed")


@dataclass(frozen=True, eq=False)
class Call:
    """A call with its arrays taken out: the problem they came from, which of
    :data:`SLOTS` and ``mod_args`` are operands, the backend that runs it (NumPy arrays),
    the differentiable one (``generic``, on JAX arrays), and how many leading axes
    ``jax.vmap`` added to every operand (``mapped``). Compared by identity (JAX keys its
    caches by it)."""

    problem: Problem
    present: tuple[str, ...]
    tables: int
    backend: Any
    generic: Any
    mapped: int = 0

    @classmethod
    def of(cls, problem: Problem, backend: Any, generic: Any) -> tuple[Call, list[Array]]:
        """The call of ``problem`` and its operands (query, key, value first)."""
        rules = problem.rules
        seg = rules.segments or (None, None)
        values = {"mask": problem.mask, "key_lengths": rules.key_lengths,
                  "alibi": rules.alibi, "q_ids": seg[0], "k_ids": seg[1],
                  "dropout_seed": rules.dropout_seed if _is_jax(rules.dropout_seed) else None}
        present = tuple(n for n in SLOTS if values[n] is not None)
        tables = () if rules.user is None else tuple(rules.user.mod_args)
        operands = [problem.q, problem.k, problem.v, *(values[n] for n in present), *tables]
        # the arrays leave the template (JAX keeps the call beside its tracers)
        user = None if rules.user is None else dataclasses.replace(rules.user, mod_args=())
        template = dataclasses.replace(
            problem, q=None, k=None, v=None, mask=None, sinks=None,
            rules=dataclasses.replace(rules, key_lengths=None, alibi=None, segments=None,
                                      user=user,
                                      dropout_seed=None if values["dropout_seed"] is not None
                                      else rules.dropout_seed))
        return cls(template, present, len(tables), backend, generic), operands

    @property
    def operands(self) -> int:
        """How many operands the call has (query, key, value included)."""
        return 3 + len(self.present) + self.tables

    def mapped_by(self, n: int) -> Call:
        return dataclasses.replace(self, mapped=self.mapped + n)

    @property
    def separable(self) -> bool:
        """Whether mapped axes can join the batch axes: no rule counts batch rows (dropout,
        a user rule's ``b``) or holds per-row values at hand (sorted segment ids)."""
        rules = self.problem.rules
        return rules.user is None and not rules.dropout and rules.segment_keys is None

    def rebuild(self, operands: list[Array] | tuple[Array, ...], xp: Any = None) -> Problem:
        """The problem on ``operands`` (arrays of namespace ``xp``; ``None``: JAX's)."""
        q, k, v, *rest = operands
        values = dict(zip(self.present, rest, strict=False))
        tables = tuple(rest[len(self.present):])
        problem, rules = self.problem, self.problem.rules
        # the template holds no segments (Call.of takes them out): the operands say
        segments = ((values["q_ids"], values["k_ids"]) if "q_ids" in values else None)
        user = (None if rules.user is None else
                dataclasses.replace(rules.user, mod_args=tables))
        seed = values.get("dropout_seed", rules.dropout_seed)
        if xp is not None and "dropout_seed" in values:
            seed = int(np.asarray(seed).reshape(()))
        rules = dataclasses.replace(
            rules, key_lengths=values.get("key_lengths"), alibi=values.get("alibi"),
            segments=segments, user=user, dropout_seed=seed)
        if self.mapped and rules.lengths_at_hand is not None:
            rules = dataclasses.replace(rules, lengths_at_hand=None)
        return dataclasses.replace(problem, q=q, k=k, v=v, mask=values.get("mask"),
                                   rules=rules, **({"xp": xp} if xp is not None else {}))


def _is_jax(x: Any) -> bool:
    return type(x).__module__.startswith(("jax", "jaxlib"))


# --- the host side: NumPy arrays ----------------------------------------------------------

def _numpy_namespace() -> Any:
    import array_api_compat.numpy as np_xp

    return np_xp


def _on_host(call: Call, arrays: tuple[Any, ...],
             run: Callable[[Problem, list[np.ndarray], Any], tuple[Any, ...]],
             into: Any = None) -> tuple[Any, ...]:
    """``run(problem, extra, into)`` on the call rebuilt over NumPy views of its operands
    (the first of ``arrays``; ``extra``: the rest), once per mapped index where mapped axes
    cannot join the batch axes (an operand's mapped axis of size 1 is shared). ``into``:
    arrays for the results, passed on where the backend writes into them
    (``WRITES_INTO``)."""
    xp = _numpy_namespace()
    host = [np.asarray(a) for a in arrays]
    n = call.operands
    into = into if getattr(call.backend, "WRITES_INTO", False) else None
    if not call.mapped or call.separable:
        return tuple(np.asarray(r) for r in run(call.rebuild(host[:n], xp), host[n:], into))
    lead = tuple(int(s) for s in host[0].shape[:call.mapped])
    single = dataclasses.replace(call, mapped=0)
    pieces = []
    for index in np.ndindex(*lead):
        part = [a[tuple(i if a.shape[d] > 1 else 0 for d, i in enumerate(index))]
                for a in host]
        pieces.append([np.asarray(r) for r in run(single.rebuild(part[:n], xp), part[n:],
                                                  None)])
    return tuple(np.stack([p[r] for p in pieces]).reshape(*lead, *pieces[0][r].shape)
                 for r in range(len(pieces[0])))


def _forward_host(call: Call, *arrays: Any, into: Any = None) -> tuple[Any, ...]:
    def run(problem: Problem, _: list[np.ndarray], into: Any) -> tuple[Any, ...]:
        kw = {} if into is None else {"into": into}
        return call.backend.forward(problem, **kw)

    return _on_host(call, arrays, run, into)


def _backward_host(call: Call, *arrays: Any, into: Any = None) -> tuple[Any, ...]:
    def run(problem: Problem, saved: list[np.ndarray], into: Any) -> tuple[Any, ...]:
        out, lse, g_out, g_lse = saved
        kw = {} if into is None else {"into": into}
        return call.backend.backward(problem, out, lse, np.ascontiguousarray(g_out), g_lse,
                                     **kw)

    return _on_host(call, arrays, run, into)


# --- the differentiable stand-ins (JAX operations) -----------------------------------------

def _forward_generic(*operands: Array, call: Call) -> tuple[Array, Array]:
    out, lse = call.generic.forward(call.rebuild(operands))
    return out, lse


def _tangent_generic(*args: Array, call: Call) -> list[Array]:
    """The tangents of (out, lse) from those of query, key and value (forward mode)."""
    import jax

    n = call.operands
    operands, tangents = args[:n], args[n + 2:]

    def f(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        return _forward_generic(q, k, v, *operands[3:], call=call)

    _, (t_out, t_lse) = jax.jvp(f, tuple(operands[:3]), tuple(tangents))
    return [t_out, t_lse]


def _backward_generic(*args: Array, call: Call) -> list[Array]:
    """(dq, dk, dv) by JAX's own differentiation of the generic forward (for derivatives
    of the backward pass)."""
    import jax

    n = call.operands
    operands, (_, _, g_out, g_lse) = args[:n], args[n:]

    def f(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        return _forward_generic(q, k, v, *operands[3:], call=call)

    _, pullback = jax.vjp(f, *operands[:3])
    return list(pullback((g_out, g_lse)))


# --- the primitives --------------------------------------------------------------------------

@dataclass(frozen=True)
class Primitives:
    forward: Any
    tangent: Any
    backward: Any


def _results(avals: tuple[Any, ...], backward: bool) -> list[Any]:
    from jax.core import ShapedArray

    if backward:
        return [ShapedArray(a.shape, a.dtype) for a in avals[:3]]
    q, v = avals[0], avals[2]
    return [ShapedArray((*q.shape[:-1], v.shape[-1]), q.dtype),
            ShapedArray(q.shape[:-1], q.dtype)]


def _callback(host: Callable[..., tuple[Any, ...]], backward: bool) -> Callable[..., Any]:
    """The body of a compiled primitive: ``host`` as a host callback."""
    import jax

    def body(*args: Array, call: Call) -> list[Array]:
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype)
                  for a in _results(tuple(x.aval for x in args), backward)]
        return list(jax.pure_callback(functools.partial(host, call), shapes, *args))

    return body


def _ffi(host: Callable[..., tuple[Any, ...]], backward: bool) -> Callable[..., Any]:
    """The CPU lowering of a compiled primitive: ``host`` as :mod:`._jax_ffi`'s handler,
    on XLA's buffers without a copy; as a host callback (:func:`_callback`) where the
    process has several CPU devices (the callback's sharding keeps the call on one), and
    with a JAX older than ``jax.ffi``."""
    import jax
    from jax.interpreters import mlir

    from polyattn import _jax_ffi

    fallback = mlir.lower_fun(_callback(host, backward), multiple_results=True)

    def rule(ctx: Any, *args: Any, call: Call) -> Any:
        if not _jax_ffi.available() or len(jax.devices("cpu")) > 1:
            return fallback(ctx, *args, call=call)
        key = _jax_ffi.register(host, call, ctx.avals_in, ctx.avals_out)
        lower = jax.ffi.ffi_lowering(_jax_ffi.ensure_registered())
        return lower(ctx, *args, call=np.int64(key))

    return rule


def _eager(host: Callable[..., tuple[Any, ...]]) -> Callable[..., list[Array]]:
    def impl(*args: Array, call: Call) -> list[Array]:
        import jax.numpy as jnp

        return [jnp.asarray(r) for r in host(call, *args)]

    return impl


def _full(call: Call, index: int, total: int, kept: int) -> bool:
    """Whether operand ``index`` (of ``total``, the call's operands then ``kept`` more) is
    given its mapped axis at full size when it has none (query, key, value, key lengths,
    slopes, segment ids, and the saved arrays and cotangents), rather than of size 1."""
    if index < 3 or index >= total - kept:
        return True
    name = call.present[index - 3] if index - 3 < len(call.present) else "table"
    return name in ("key_lengths", "alibi", "q_ids", "k_ids")


def _batcher(primitive: Any, kept: int) -> Callable[..., Any]:
    def rule(args: tuple[Array, ...], dims: tuple[int | None, ...], *, call: Call
             ) -> tuple[list[Array], list[int]]:
        import jax.numpy as jnp

        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        moved = []
        for index, (a, d) in enumerate(zip(args, dims, strict=True)):
            if d is not None:
                a = jnp.moveaxis(a, d, 0)
            elif _full(call, index, len(args), kept):
                a = jnp.broadcast_to(a[None], (size, *a.shape))
            else:
                a = a[None]
            moved.append(a)
        outs = primitive.bind(*moved, call=call.mapped_by(1))
        return list(outs), [0] * len(outs)

    return rule


@functools.cache
def primitives() -> Primitives:
    """The three primitives, defined once (JAX is imported here)."""
    import jax
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    forward = Primitive("polyattn_forward")
    tangent = Primitive("polyattn_tangent")
    backward = Primitive("polyattn_backward")
    for p in (forward, tangent, backward):
        p.multiple_results = True
    forward.def_impl(_eager(_forward_host))
    backward.def_impl(_eager(_backward_host))
    tangent.def_impl(lambda *args, call: _tangent_generic(*args, call=call))
    forward.def_abstract_eval(lambda *avals, call: _results(avals, False))
    tangent.def_abstract_eval(lambda *avals, call: _results(avals, False))
    backward.def_abstract_eval(lambda *avals, call: _results(avals, True))
    mlir.register_lowering(forward, mlir.lower_fun(_callback(_forward_host, False),
                                                   multiple_results=True))
    mlir.register_lowering(backward, mlir.lower_fun(_callback(_backward_host, True),
                                                    multiple_results=True))
    mlir.register_lowering(forward, _ffi(_forward_host, False), platform="cpu")
    mlir.register_lowering(backward, _ffi(_backward_host, True), platform="cpu")
    mlir.register_lowering(tangent, mlir.lower_fun(_tangent_generic, multiple_results=True))

    def forward_jvp(primals: tuple[Array, ...], tangents: tuple[Any, ...], *, call: Call
                    ) -> tuple[Any, Any]:
        if any(type(t) is not ad.Zero for t in tangents[3:]):
            # a rule's array is differentiated: the generic implementation throughout
            return jax.jvp(functools.partial(_forward_generic, call=call), primals,
                           tuple(ad.instantiate_zeros(t) for t in tangents))
        out, lse = forward.bind(*primals, call=call)
        dq, dk, dv = (ad.instantiate_zeros(t) for t in tangents[:3])
        t_out, t_lse = tangent.bind(*primals, out, lse, dq, dk, dv, call=call)
        return [out, lse], [t_out, t_lse]

    def tangent_transpose(cts: list[Any], *args: Any, call: Call) -> list[Any]:
        n = call.operands
        operands, (out, lse) = args[:n], args[n:n + 2]
        import jax.numpy as jnp

        g_out, g_lse = (jnp.zeros(x.aval.shape, x.aval.dtype) if type(c) is ad.Zero else c
                        for c, x in zip(cts, (out, lse), strict=True))
        grads = backward.bind(*operands, out, lse, g_out, g_lse, call=call)
        return [None] * (n + 2) + list(grads)

    def backward_jvp(primals: tuple[Array, ...], tangents: tuple[Any, ...], *, call: Call
                     ) -> tuple[Any, Any]:
        return jax.jvp(functools.partial(_backward_generic, call=call), primals,
                       tuple(ad.instantiate_zeros(t) for t in tangents))

    ad.primitive_jvps[forward] = forward_jvp
    ad.primitive_jvps[backward] = backward_jvp
    ad.primitive_transposes[tangent] = tangent_transpose
    batching.primitive_batchers[forward] = _batcher(forward, 0)
    batching.primitive_batchers[backward] = _batcher(backward, 4)

    def tangent_batch(args: tuple[Array, ...], dims: tuple[int | None, ...], *, call: Call
                      ) -> tuple[list[Array], list[int]]:
        outs = jax.vmap(functools.partial(_tangent_generic, call=call), in_axes=dims)(*args)
        return list(outs), [0, 0]

    batching.primitive_batchers[tangent] = tangent_batch
    return Primitives(forward, tangent, backward)


# --- entry points ------------------------------------------------------------------------------

def attention(backend: Any, problem: Problem, generic: Any) -> tuple[Array, Array]:
    """``(out, lse)`` of ``backend`` (NumPy arrays) on the JAX arrays of ``problem``,
    differentiable by JAX in both modes; ``generic``: the differentiable implementation
    (JAX operations) for forward mode and the rules' arrays."""
    call, operands = Call.of(problem, backend, generic)
    out, lse = primitives().forward.bind(*operands, call=call)
    return out, lse


def backward(backend: Any, problem: Problem, generic: Any, out: Array, lse: Array,
             grad_out: Array, grad_lse: Array | None) -> tuple[Array, Array, Array]:
    """(dq, dk, dv) of ``backend`` on the JAX arrays of ``problem``."""
    import jax.numpy as jnp

    call, operands = Call.of(problem, backend, generic)
    if grad_lse is None:
        grad_lse = jnp.zeros(lse.shape, lse.dtype)
    dq, dk, dv = primitives().backward.bind(*operands, out, lse, grad_out, grad_lse,
                                            call=call)
    return dq, dk, dv
