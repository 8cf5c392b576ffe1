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

from polyattn._interop import Array
from polyattn._problem import Problem

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


def numpy_bridge(module: Any, problem: Problem) -> tuple[Forward, Backward]:
    """``module``'s forward and backward passes over NumPy views of torch CPU tensors."""
    import array_api_compat.numpy as np_xp

    rules = problem.rules
    if rules is not None:
        rules = dataclasses.replace(rules, key_lengths=_to_numpy(rules.key_lengths),
                                    alibi=_to_numpy(rules.alibi))
    extra = {} if rules is None or rules.simple else {"rules": rules}
    common = {"mask": _to_numpy(problem.mask), "causal_offset": problem.causal_offset,
              "scale": problem.scale, "xp": np_xp, **extra}

    def forward(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        out, lse = module.attention(_to_numpy(q), _to_numpy(k), _to_numpy(v), **common)
        return _from_numpy(out, q), _from_numpy(lse, q)

    def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array,
                 grad_lse: Array | None) -> tuple[Array, Array, Array]:
        grads = module.backward(*(_to_numpy(x) for x in (q, k, v, out, lse, grad_out)),
                                grad_lse=_to_numpy(grad_lse), **common)
        return tuple(_from_numpy(g, q) for g in grads)  # type: ignore[return-value]

    return forward, backward


def direct(module: Any, problem: Problem) -> tuple[Forward, Backward]:
    """``module``'s forward and backward passes on the problem's own arrays."""
    extra = {}
    if problem.rules is not None and not problem.rules.simple:
        extra["rules"] = problem.rules
    common = {"mask": problem.mask, "causal_offset": problem.causal_offset,
              "scale": problem.scale, "xp": problem.xp, **extra}

    forward_only = {}
    if module.__name__.endswith(".numba_cuda"):
        from polyattn.backends.cuda import tensor_core as numba_cuda_tc

        tq, e = problem.q.shape[-2:]
        ev = e if problem.v is None else problem.v.shape[-1]
        forward_only["arithmetic"] = numba_cuda_tc.choose(str(problem.result_dtype), tq, e,
                                                          ev)[0]

    def forward(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
        return module.attention(q, k, v, **common,  # type: ignore[no-any-return]
                                **forward_only)

    def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array,
                 grad_lse: Array | None) -> tuple[Array, Array, Array]:
        return module.backward(q, k, v, out, lse, grad_out,  # type: ignore[no-any-return]
                               grad_lse=grad_lse, **common)

    return forward, backward


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
