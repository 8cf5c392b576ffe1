"""Making the fused paths differentiable for torch, and running NumPy paths on torch tensors.

The CUDA kernel and the NumPy fast path are not made of torch operations,
so torch autograd cannot see through them. :func:`torch_attention` wraps an
implementation's forward and backward passes into one
``torch.autograd.Function``: the forward pass keeps ``q``, ``k``, ``v``,
``out`` and ``lse``; the backward pass is the implementation's own
(FlashAttention-2, scores recomputed). Only ``q``, ``k`` and ``v`` receive
gradients, so dispatch uses it only when neither ``attn_mask`` nor
``alibi_slopes`` requires one.

:func:`numpy_bridge` runs an implementation written for NumPy arrays (the
NumPy fast path, or the CUDA kernel on the Numba simulator) on torch CPU
tensors, sharing their memory both ways (``Tensor.numpy()`` and
``torch.from_numpy``, no copies).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from polyattn._interop import Array, library_name
from polyattn._problem import Problem
from polyattn.backends import Backend

Forward = Callable[[Array, Array, Array], tuple[Array, Array]]
Backward = Callable[[Array, Array, Array, Array, Array, Array, Array | None],
                    tuple[Array, Array, Array]]


def _to_numpy(x: Any) -> Any:
    """A torch CPU tensor as a NumPy array over the same memory (other values unchanged)."""
    if x is None or not hasattr(x, "detach"):
        return x
    return x.detach().numpy()


def _from_numpy(a: Any, like: Any) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(a)).to(like.device)


def numpy_bridge(backend: Backend, problem: Problem) -> tuple[Forward, Backward]:
    """``backend``'s forward and backward passes over NumPy views of torch CPU tensors."""
    import array_api_compat.numpy as np_xp

    rules = problem.rules
    user = rules.user
    if user is not None:
        user = dataclasses.replace(user, mod_args=tuple(_to_numpy(a) for a in user.mod_args))
    segments = (None if rules.segments is None else
                (_to_numpy(rules.segments[0]), _to_numpy(rules.segments[1])))
    rules = dataclasses.replace(rules, key_lengths=_to_numpy(rules.key_lengths),
                                alibi=_to_numpy(rules.alibi), segments=segments, user=user)
    viewed = dataclasses.replace(problem, xp=np_xp, mask=_to_numpy(problem.mask), rules=rules)

    def on(q: Array, k: Array, v: Array) -> Problem:
        return dataclasses.replace(viewed, q=_to_numpy(q), k=_to_numpy(k), v=_to_numpy(v))

    def forward(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        out, lse = backend.forward(on(q, k, v))
        return _from_numpy(out, q), _from_numpy(lse, q)

    def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array,
                 grad_lse: Array | None) -> tuple[Array, Array, Array]:
        grads = backend.backward(on(q, k, v), _to_numpy(out), _to_numpy(lse),
                                 _to_numpy(grad_out), _to_numpy(grad_lse))
        return tuple(_from_numpy(g, q) for g in grads)  # type: ignore[return-value]

    return forward, backward


def direct(backend: Backend, problem: Problem) -> tuple[Forward, Backward]:
    """``backend``'s forward and backward passes on the problem's own arrays."""

    def on(q: Array, k: Array, v: Array) -> Problem:
        if q is problem.q and k is problem.k and v is problem.v:
            return problem
        return dataclasses.replace(problem, q=q, k=k, v=v)

    def forward(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        return backend.forward(on(q, k, v))

    def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array,
                 grad_lse: Array | None) -> tuple[Array, Array, Array]:
        return backend.backward(on(q, k, v), out, lse, grad_out, grad_lse)

    return forward, backward


def passes(backend: Backend, problem: Problem) -> tuple[Forward, Backward]:
    """The passes of ``backend`` for ``problem``: over NumPy views of torch CPU tensors where
    it computes on NumPy arrays (:attr:`Backend.HOST`), else on the arrays themselves."""
    if backend.HOST and problem.torch_cpu:
        return numpy_bridge(backend, problem)
    if backend.HOST and problem.jax_cpu:
        return jax_bridge(backend, problem)
    if not backend.HOST and library_name(problem.xp) == "jax":
        from polyattn import _jax_eager

        compiled = _jax_eager.passes(backend, problem)
        if compiled is not None:
            return compiled
    return direct(backend, problem)


def jax_bridge(backend: Backend, problem: Problem) -> tuple[Forward, Backward]:
    """``backend``'s passes on JAX CPU arrays through :mod:`polyattn._jax_bridge`'s
    primitives (an XLA FFI handler under ``jax.jit``), JAX differentiating them in both modes
    with the chunked Array-API path (JAX operations) where the kernel has no pass."""
    from polyattn import _jax_bridge
    from polyattn.backends import family

    generic = family("chunked")

    def on(q: Array, k: Array, v: Array) -> Problem:
        if q is problem.q and k is problem.k and v is problem.v:
            return problem
        return dataclasses.replace(problem, q=q, k=k, v=v)

    def forward(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        return _jax_bridge.attention(backend, on(q, k, v), generic)

    def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array,
                 grad_lse: Array | None) -> tuple[Array, Array, Array]:
        return _jax_bridge.backward(backend, on(q, k, v), generic, out, lse, grad_out,
                                    grad_lse)

    return forward, backward


def differentiable(backend: Backend, problem: Problem, generic: Backend, *,
                   grad: bool = True) -> tuple[Array, Array]:
    """``(out, lse)`` of ``backend``; where torch autograd records the call and the backend
    is not made of torch operations (:data:`polyattn.backends.BY_AUTOGRAD`), through one
    ``torch.autograd.Function`` whose second derivatives come from ``generic``."""
    forward, backward = passes(backend, problem)
    if grad and backend.DIFFERENTIATED == "autograd" and problem.requires_grad:
        return torch_attention(problem, (forward, backward), direct(generic, problem))
    return forward(problem.q, problem.k, problem.v)


@functools.cache
def _function() -> Any:
    """The ``torch.autograd.Function`` class (torch is imported only when it is needed)."""
    import torch

    class FusedAttention(torch.autograd.Function):
        """Attention whose backward pass is the implementation's own.

        That backward pass is not made of torch operations. When the backward
        pass itself is recorded (``create_graph=True``, for second derivatives),
        the same gradients are computed instead by ``differentiable``: the
        blocked Array-API forward and backward passes on the saved tensors, in
        torch operations that autograd can differentiate again.
        """

        @staticmethod
        def forward(ctx: Any, q: Array, k: Array, v: Array, forward: Forward,
                    backward: Backward, differentiable: tuple[Forward, Backward],
                    ) -> tuple[Array, Array]:
            out, lse = forward(q.detach(), k.detach(), v.detach())
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.passes = backward, differentiable
            return out, lse

        @staticmethod
        def backward(ctx: Any, grad_out: Array, grad_lse: Array
                     ) -> tuple[Array | None, ...]:
            q, k, v, out, lse = ctx.saved_tensors
            backward, (generic_forward, generic_backward) = ctx.passes
            if grad_out is None:
                grad_out = torch.zeros_like(out)
            if grad_lse is not None:
                grad_lse = torch.where(torch.isneginf(lse), 0.0, grad_lse)
            if torch.is_grad_enabled():      # create_graph=True: stay in torch operations
                out, lse = generic_forward(q, k, v)
                dq, dk, dv = generic_backward(q, k, v, out, lse, grad_out, grad_lse)
            else:
                dq, dk, dv = backward(q.detach(), k.detach(), v.detach(), out, lse,
                                      grad_out.contiguous(), grad_lse)
            return dq, dk, dv, None, None, None

    return FusedAttention


def torch_attention(problem: Problem, passes: tuple[Forward, Backward],
                    differentiable: tuple[Forward, Backward]) -> tuple[Array, Array]:
    """``(out, lse)`` through the implementation's passes, differentiable by torch autograd.

    ``differentiable``: passes made of torch operations, used for the backward pass
    when it is itself differentiated (second derivatives).
    """
    forward, backward = passes
    out, lse = _function().apply(problem.q, problem.k, problem.v, forward, backward,
                                 differentiable)
    return out, lse
