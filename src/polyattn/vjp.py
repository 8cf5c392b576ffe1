"""Attention with its gradients, on any library: :func:`attention_vjp`.

The backward pass is FlashAttention-2's (Dao 2023): nothing of the forward
pass is kept but ``out`` and the log-sum-exp ``lse`` of each row; the
scores are recomputed block by block, and with ``P = exp(s - lse)``,
``D = rowsum(dO ∘ O)``:

* ``dV = Pᵀ dO``,
* ``dS = P ∘ (dO Vᵀ - D)`` (times ``1 - tanh²`` under soft-capping),
* ``dQ = scale · dS K`` and ``dK = scale · dSᵀ Q``.

Every implementation has one (``reference``, ``chunked``, the NumPy fast
path, the CUDA kernel), so NumPy and CuPy users get exact gradients without
an autodiff library, in O(T·block) memory, in float64 where the inputs are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyattn import _dispatch
from polyattn._interop import (
    Array,
    check_same_device,
    contiguous,
    device_of,
    library_name,
    namespace_of,
)
from polyattn._problem import Problem, prepare, swap_heads_and_time
from polyattn._validation import (
    IMPLEMENTATIONS,
    check_bool,
    check_choice,
    check_floating,
    shape_str,
)
from polyattn.attention import run, value_features
from polyattn.rules import sinks as _sinks
from polyattn.rules.online import NEG_INF, quiet_floating_point

Pullback = Callable[..., tuple[Array, ...]]


def attention_vjp(
    query: Array, key: Array, value: Array, /, *, attn_mask: Array | None = None,
    is_causal: bool = False, causal_alignment: str = "top_left", scale: float | None = None,
    enable_gqa: bool = False, return_lse: bool = False, implementation: str = "auto",
    layout: str = "BHTE", window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: Array | None = None,
    key_lengths: Array | int | None = None, dropout_p: float = 0.0,
    dropout_seed: int | None = None, sinks: Array | None = None,
    segment_ids: Array | tuple[Array, Array] | None = None,
    score_mod: Callable[..., Any] | None = None, mask_mod: Callable[..., Any] | None = None,
    mod_args: tuple[Array, ...] = (), block_mask: Any = None,
) -> tuple[Array | tuple[Array, Array], Pullback]:
    """Scaled dot-product attention and a function that pulls gradients back through it.

    Takes the arguments of :func:`scaled_dot_product_attention` and returns
    its result together with ``pullback``: given the gradient of a loss with
    respect to ``out``, ``pullback(grad_out)`` returns the gradients with
    respect to ``query``, ``key`` and ``value`` (then ``sinks``, when given, and each
    floating array of ``mod_args`` that a ``score_mod`` reads).
    This is what NumPy and CuPy, which have no automatic differentiation,
    need for training; on torch and
    JAX it gives the same numbers as their autodiff (which also works
    through :func:`scaled_dot_product_attention` directly).

    Parameters
    ----------
    query, key, value, **keywords
        As in :func:`scaled_dot_product_attention`. ``implementation`` picks
        the forward and backward pass alike; ``"auto"`` takes the CUDA kernel
        for CUDA arrays where it can run, else ``"reference"`` or
        ``"chunked"`` by the score budget (:func:`explain` tells which; on
        NumPy arrays above the budget, and on torch and JAX CPU arrays from
        its crossovers, the fused ``"numba_cpu"`` kernel where Numba is
        installed, as for the forward pass).
        ``"native"`` is refused: the libraries' own functions neither return
        the log-sum-exp nor take a gradient from outside their autodiff.

    Returns
    -------
    out : array, or (out, lse) with ``return_lse=True``
        Exactly what :func:`scaled_dot_product_attention` returns.
    pullback : callable
        ``pullback(grad_out, grad_lse=None) -> (grad_query, grad_key,
        grad_value)``, then ``grad_sinks`` when ``sinks`` is given, then with a
        ``score_mod`` the gradient of each floating array of ``mod_args``, in
        their order (one gradient per differentiable argument, as ``jax.vjp``;
        integer and boolean ``mod_args`` have none).
        ``grad_out`` has the shape of ``out``; ``grad_lse`` (the shape of
        ``lse``, only meaningful with ``return_lse=True``) adds
        the gradient of a loss that also uses the log-sum-exp. The gradients
        have the shapes, dtypes, namespace, device and layout of ``query``,
        ``key`` and ``value``; where an input was broadcast (batch
        dimensions, one key/value head for many query heads, grouped-query
        attention) its gradient is summed over the copies. ``pullback`` may be
        called any number of times.

    Notes
    -----
    * Rows with no visible key (fully masked) have zero gradients, never NaN;
      keys past ``key_lengths`` and keys no query can see get zero gradients.
    * ``attn_mask`` (also a float one) and ``alibi_slopes`` are constants:
      no gradient is returned for them.
    * Soft-capping's derivative ``1 - tanh²(s / softcap)`` is applied.
    * Sinks: ``grad_sinks[h] = -Σ_i p_sink,i · (rowsum(dO_i ∘ O_i) - dlse_i)``
      over the rows of head ``h`` (and the batch rows a (H,) table is shared
      by), ``p_sink,i = exp(sinks[h] - lse_i)``; the query, key and value
      gradients are FlashAttention-2's with the sink in ``lse``.
    * ``mod_args`` read by a ``score_mod`` (a learned relative-bias table,
      learned ALiBi slopes): the gradient of each floating one sums
      ``dS · ∂score_mod/∂t`` over the scores that read its element ``t``, in one
      more pass over the visible tiles on the Array-API path (about the cost of
      a forward pass per load the rule makes), whichever implementation gave the
      other gradients. A ``mask_mod``'s arrays get none (its result is boolean).
    * Dropout: the backward pass drops the same weights as the forward pass,
      recomputed from ``dropout_seed``; no mask is stored.
    * Memory: besides the inputs and gradients, O(T·block) on the blocked
      paths, as in the forward pass; the scores are recomputed, not kept.
    * The gradients are exact to the numerical contract of the forward pass:
      relative error below 1e-10 in float64 and 1e-4 in float32 against an
      autodiff of the formula in float64.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import attention_vjp
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 8, 16))   # (B, H, Tq, E)
    >>> k = rng.standard_normal((2, 4, 8, 16))
    >>> v = rng.standard_normal((2, 4, 8, 16))
    >>> out, pullback = attention_vjp(q, k, v, is_causal=True)
    >>> loss = (out ** 2).sum()
    >>> dq, dk, dv = pullback(2 * out)          # d loss / d out = 2·out
    >>> dq.shape, dk.shape, dv.shape
    ((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16))

    The last key is visible only to the last query, so the other queries'
    gradients do not involve it:

    >>> g = np.zeros_like(out)
    >>> g[..., :-1, :] = 1.0                     # a loss on all but the last query row
    >>> float(np.abs(pullback(g)[1][..., -1, :]).max())   # d loss / d (last key)
    0.0

    With dropout, the same seed drops the same weights in both passes:

    >>> out, pullback = attention_vjp(q, k, v, dropout_p=0.1, dropout_seed=7)
    >>> dq, dk, dv = pullback(np.ones_like(out))

    With sinks, their gradient comes fourth:

    >>> out, pullback = attention_vjp(q, k, v, sinks=np.zeros(4))
    >>> dq, dk, dv, dsinks = pullback(np.ones_like(out))
    >>> dsinks.shape
    (4,)
    """
    check_choice("implementation", implementation, IMPLEMENTATIONS)
    check_bool("return_lse", return_lse)
    if implementation == "native":
        raise ValueError(
            "attention_vjp cannot use implementation='native': the libraries' own attention "
            "functions return no log-sum-exp for a backward pass; call "
            "scaled_dot_product_attention(..., implementation='native') and differentiate "
            "it with torch.autograd or jax.vjp, or pick another implementation")
    with quiet_floating_point(query):
        problem = prepare(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                          causal_alignment=causal_alignment, scale=scale,
                          enable_gqa=enable_gqa, layout=layout, window=window,
                          softcap=softcap, alibi_slopes=alibi_slopes,
                          key_lengths=key_lengths, dropout_p=dropout_p,
                          dropout_seed=dropout_seed, sinks=sinks,
                          segment_ids=segment_ids, score_mod=score_mod,
                          mask_mod=mask_mod, mod_args=mod_args, block_mask=block_mask)
        choice = _dispatch.choose(problem, implementation, return_lse=True, for_vjp=True,
                                  describe=False)
        ran, out, lse = run(problem, choice.implementation, grad=False)
        result_out = value_features(problem, out)
        if result_out.dtype != problem.result_dtype:
            result_out = problem.xp.astype(result_out, problem.result_dtype)
        result_out = problem.finish_out(result_out)
        result_lse = problem.finish(lse, 1)
    pullback = _pullback(query, key, value, sinks, problem, choice.implementation, ran, out,
                         lse, result_out, result_lse)
    if return_lse:
        return (result_out, result_lse), pullback
    return result_out, pullback


def _pullback(query: Array, key: Array, value: Array, sinks: Array | None, problem: Problem,
              name: str, ran: Problem, out: Array, lse: Array, result_out: Array,
              result_lse: Array) -> Pullback:
    """``pullback`` of :func:`attention_vjp`: ``ran`` is the problem implementation ``name``
    ran (values with no features widened by one, no sinks), ``out`` and ``lse`` what it
    returned with the sinks joined; ``result_out`` and ``result_lse`` what the caller
    received."""
    xp, layout = problem.xp, problem.layout
    empty = problem.score_elements == 0
    assert problem.v is not None and ran.v is not None
    ev = problem.v.shape[-1]
    inputs = {"query": query, "key": key, "value": value}
    shapes = {n: _bhte_shape(x, layout) for n, x in inputs.items()}
    dtypes = {n: x.dtype for n, x in inputs.items()}
    user = problem.rules.user
    tables = ([a for a in user.mod_args if xp.isdtype(a.dtype, "real floating")]
              if user is not None and user.score_mod is not None else [])

    def pullback(grad_out: Array, grad_lse: Array | None = None) -> tuple[Array, ...]:
        with quiet_floating_point(result_out):
            go = _incoming("grad_out", grad_out, result_out, problem, xp)
            go = _to_problem_layout(go, problem)                  # (B…, H, Tq, Ev)
            gl = None
            if grad_lse is not None:
                gl = _incoming("grad_lse", grad_lse, result_lse, problem, xp)
                gl = xp.reshape(gl, tuple(lse.shape))             # (B…, H, Tq)
                gl = xp.where(lse == NEG_INF, 0.0, gl)            # lse is constant there
            assert problem.v is not None and ran.v is not None    # set by prepare
            if empty:
                dq, dk, dv = (xp.zeros(tuple(x.shape), dtype=x.dtype, device=device_of(x))
                              for x in (problem.q, problem.k, problem.v))
            else:
                if ran.v.shape[-1] != ev:                         # no value features
                    zero = xp.zeros((*go.shape[:-1], 1), dtype=go.dtype,
                                    device=device_of(go))
                    go = xp.concat([go, zero], axis=-1)
                dq, dk, dv = _dispatch.run_backward(ran, name, out, lse, go, gl)
                dv = dv[..., :ev] if dv.shape[-1] != ev else dv
            grads = []
            for n, g in zip(inputs, (dq, dk, dv), strict=True):
                g = _unbroadcast(g, shapes[n], xp)
                if g.dtype != dtypes[n]:
                    g = xp.astype(g, dtypes[n])
                if layout == "BTHE":
                    g = contiguous(swap_heads_and_time(g, xp))
                grads.append(g)
            if sinks is not None:
                assert problem.sinks is not None
                gs = _sinks.gradient(out, lse, problem.sinks, go, gl, xp)
                gs = xp.reshape(gs, tuple(sinks.shape))
                grads.append(gs if gs.dtype == sinks.dtype else xp.astype(gs, sinks.dtype))
            if tables:
                got = ([xp.zeros(tuple(t.shape), dtype=t.dtype, device=device_of(t))
                        for t in tables] if empty else
                       _dispatch.run_mod_args_gradients(ran, out, lse, go, gl))
                grads += [g if g.dtype == t.dtype else xp.astype(g, t.dtype)
                          for g, t in zip(got, tables, strict=True)]
            return tuple(grads)

    return pullback


def _bhte_shape(x: Array, layout: str) -> tuple[int, ...]:
    """The shape of ``x`` as the implementations see it: (…, H, T, E)."""
    shape = tuple(x.shape)
    if layout == "BTHE":
        shape = (*shape[:-3], shape[-2], shape[-3], shape[-1])
    return shape


def _incoming(name: str, g: Array, like: Array, problem: Problem, xp: Any) -> Array:
    """A cotangent checked against the result ``like`` it belongs to, in the compute dtype."""
    what = "out" if name == "grad_out" else "lse"
    if not (hasattr(g, "shape") and hasattr(g, "dtype")):
        raise TypeError(f"`{name}` must be an array, the gradient of the loss with respect to "
                        f"`{what}` (shape {shape_str(like)}, dtype {like.dtype}, a "
                        f"{library_name(xp)} array like it); got {type(g).__name__}"
                        + (" (pass zeros for a result the loss does not use)"
                           if g is None else ""))
    namespace_of({what: like, name: g})     # one library, else a TypeError naming both
    check_same_device({what: like, name: g})
    if tuple(g.shape) != tuple(like.shape):
        raise ValueError(f"`{name}` must have the shape of the result it is the gradient of, "
                         f"`{what}` {shape_str(like)}; got {shape_str(g)}")
    check_floating(name, g, xp)
    if xp.result_type(g.dtype, like.dtype) != like.dtype:
        raise TypeError(f"`{name}` is {g.dtype} but `{what}` is {like.dtype}, which would "
                        f"lose precision; pass it as {like.dtype} (the dtype of `{what}`)")
    return g if g.dtype == problem.compute_dtype else xp.astype(g, problem.compute_dtype)


def _to_problem_layout(g: Array, problem: Problem) -> Array:
    """``grad_out`` in the caller's layout -> (B…, H, Tq, Ev), as the implementations take it."""
    xp = problem.xp
    if problem.layout == "BTHE":
        return swap_heads_and_time(g, xp)                          # (B…, H, Tq, Ev), a view
    if problem.squeeze:
        return xp.reshape(g, (1, *g.shape))                        # (Tq, Ev) -> (1, Tq, Ev)
    return g


def _unbroadcast(g: Array, shape: tuple[int, ...], xp: Any) -> Array:
    """Sum ``g`` over the axes that broadcasting added or stretched, to ``shape``."""
    extra = g.ndim - len(shape)
    if extra > 0:
        g = xp.sum(g, axis=tuple(range(extra)))
    elif extra < 0:                                  # (T, E) inputs: a (1,) head axis added
        return xp.reshape(g, shape)
    stretched = tuple(i for i, (a, b) in enumerate(zip(g.shape, shape, strict=True))
                      if b == 1 and a != 1)
    if stretched:
        g = xp.sum(g, axis=stretched, keepdims=True)
    return g
