"""Scaled dot-product attention: validate, choose an implementation, run it.

Shape letters used throughout: ``B…`` any leading batch dimensions, ``H``
query heads, ``Hkv`` key/value heads, ``Tq``/``Tk`` query/key lengths, ``E``
query/key features, ``Ev`` value features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from polyattn import _dispatch
from polyattn._interop import Array, device_of
from polyattn._problem import Problem, prepare
from polyattn._validation import IMPLEMENTATIONS, check_bool, check_choice
from polyattn.backends import array_api
from polyattn.rules import sinks as _sinks
from polyattn.rules.online import NEG_INF, quiet_floating_point


def _empty_problem(problem: Problem) -> tuple[Array, Array]:
    """No scores: Tk = 0 masks every row fully (out = 0, lse = -inf); else the results are empty.

    Answered here so that no implementation sees an empty reduction (which
    some libraries, Dask among them, cannot compute).
    """
    xp, q, v = problem.xp, problem.q, problem.v
    dev = device_of(q)
    ev = v.shape[-1] if v is not None else 0
    out = xp.zeros((*q.shape[:-1], ev), dtype=problem.compute_dtype, device=dev)
    lse = xp.full(tuple(q.shape[:-1]), NEG_INF, dtype=problem.compute_dtype, device=dev)
    if problem.requires_grad:
        # torch autograd: joined to the inputs that need gradients by a sum over none of
        # their elements (exactly 0, whatever they hold), so that backward() runs and
        # gives them zero gradients, as a fully masked row does
        user = problem.rules.user
        tracked = [x for x in (q, problem.k, v, problem.mask, problem.rules.alibi,
                               *(() if user is None else user.mod_args))
                   if getattr(x, "requires_grad", False)]
        zero = sum(xp.sum(x[..., :0]) for x in tracked)
        out, lse = out + zero, lse + zero
    return out, lse


def with_value_feature(problem: Problem) -> Problem:
    """The problem the implementations run: values with no features (Ev = 0) get one zero
    feature, so that no implementation meets an empty product; the output is then cut back
    to its 0 features while the log-sum-exp, which does not depend on the values, is kept.
    Other problems are returned as they are."""
    v = problem.v
    if v is None or v.shape[-1] != 0:
        return problem
    xp = problem.xp
    zero = xp.zeros((*v.shape[:-1], 1), dtype=v.dtype, device=device_of(v))
    return dataclasses.replace(problem, v=xp.concat([v, zero], axis=-1))


def run(problem: Problem, name: str, *, fallback: bool = False, grad: bool = True,
        ) -> tuple[Problem, Array, Array | None]:
    """Run implementation ``name``: the problem it ran (:func:`with_value_feature`, without
    sinks), and its ``out`` (B…, H, Tq, Ev of that problem) and ``lse``, in the compute
    dtype, with the sinks joined (:func:`polyattn.rules.sinks.join`)."""
    ran = dataclasses.replace(problem, sinks=None)        # the backends never see sinks
    if problem.score_elements == 0:
        out, lse = _empty_problem(problem)
    else:
        ran = with_value_feature(ran)
        out, lse = _dispatch.run(ran, name, fallback=fallback, grad=grad)
    if problem.sinks is not None:
        out, lse = _sinks.join(out, lse, problem.sinks, problem.xp)
    return ran, out, lse


def value_features(problem: Problem, out: Array) -> Array:
    """``out`` of the problem an implementation ran, cut to ``problem``'s value features
    (undoes :func:`with_value_feature`)."""
    ev = 0 if problem.v is None else problem.v.shape[-1]
    return out[..., :ev] if out.shape[-1] != ev else out


def scaled_dot_product_attention(
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
) -> Array | tuple[Array, Array]:
    """``softmax(query · keyᵀ · scale + mask) · value``, on any array library.

    Parameters
    ----------
    query : array (B…, H, Tq, E)
        Queries. Leading dimensions broadcast against ``key`` and ``value``;
        a plain (Tq, E) matrix is accepted too. (B…, Tq, H, E) with
        ``layout="BTHE"``.
    key : array (B…, Hkv, Tk, E)
        Keys; (B…, Tk, Hkv, E) with ``layout="BTHE"``.
    value : array (B…, Hkv, Tk, Ev)
        Values; (B…, Tk, Hkv, Ev) with ``layout="BTHE"``.
    attn_mask : array, optional
        Broadcastable to (B…, H, Tq, Tk). Boolean: True where a query may
        attend to a key. Floating: added to the scaled scores.
    is_causal : bool
        Apply a causal mask (combined with ``attn_mask`` if both are given).
    causal_alignment : {"top_left", "bottom_right"}
        ``"top_left"``: query i sees keys ``j <= i``. ``"bottom_right"``:
        query i sees keys ``j <= i + (Tk - Tq)`` (KV-cache decoding).
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(E)``.
    enable_gqa : bool
        Grouped-query attention: ``H % Hkv == 0`` and query head ``h`` uses
        key/value head ``h // (H // Hkv)``.
    return_lse : bool
        Also return the log-sum-exp of each row's scores, which lets partial
        results over disjoint key sets be merged exactly.

    implementation : {"auto", "native", "reference", "chunked", "numba_cuda", "distributed", \
"numba_cpu"}
        Which implementation runs; :func:`explain` tells what ``"auto"`` picks
        and why the others were not. ``"native"`` is the input library's own
        fused attention (torch's ``scaled_dot_product_attention``, JAX's
        ``dot_product_attention``), used only where it computes this call
        exactly; asked for by name where it cannot, it raises ``ValueError``
        with the reason (``return_lse=True``, float64 on JAX, …).
        ``"distributed"`` (Dask arrays; what ``"auto"`` picks for them) is a
        task graph with one task per (query chunk, key chunk), merged through
        the log-sum-exp, which runs on any Dask scheduler, a cluster included;
        the chunks are those of ``query`` and ``key`` along the sequence axis.
        ``"numba_cpu"`` (NumPy arrays, torch CPU tensors, JAX CPU arrays under
        every transform; ``pip install 'polyattn[numba]'``) is the fused Numba
        CPU kernel, which ``"auto"`` picks for NumPy arrays above the score
        budget and for torch and JAX CPU arrays where it measured faster than
        their own attention, when Numba is installed, unless the environment
        variable ``POLYATTN_NUMBA_CPU`` is ``0``/``false``/``off``/``no``;
        its first call compiles it unless ``python -m polyattn warmup`` has.
    layout : {"BHTE", "BTHE"}
        ``"BHTE"``: query, key, value and out are (B…, H, T, E), as torch.
        ``"BTHE"``: they are (B…, T, H, E), as JAX, Flax, Keras and
        FlashAttention; read through strides, without a transposed copy. In
        both layouts ``attn_mask`` broadcasts to (B…, H, Tq, Tk) and ``lse`` is
        (B…, H, Tq).
    window : (int or None, int or None), optional
        Sliding window ``(left, right)``: query ``i`` sees keys ``j`` with
        ``p_i - left <= j <= p_i + right`` (``None``: unbounded on that side).
        ``(w, 0)`` with ``is_causal=True`` is Mistral's and Gemma's local
        attention over the last ``w + 1`` keys.
    softcap : float, optional
        Logit soft-capping (Gemma 2): scaled scores ``s`` become
        ``softcap · tanh(s / softcap)`` before ALiBi and masks.
    alibi_slopes : array (H,) or (B…, H) (or one value for every head), optional
        ALiBi: adds ``-slope_h · |p_i - j|`` to the scores of head ``h``
        (:func:`polyattn.alibi_slopes` gives the paper's slopes).
    key_lengths : integer array (B…,) or int, optional
        Keys ``j >= key_lengths[b]`` of batch row ``b`` do not exist (ragged
        batches, a preallocated :class:`polyattn.KVCache`). With
        ``causal_alignment="bottom_right"`` query positions count back from
        each row's own length. Values outside ``[0, Tk]`` raise
        ``ValueError`` where they are at hand; under ``jax.jit`` and on Dask
        they are not, and such values give meaningless positions.
    dropout_p : float in [0, 1)
        Drop each attention weight with this probability (after the softmax;
        kept weights are scaled by ``1 / (1 - dropout_p)``). Unlike torch, it
        applies whenever it is > 0: pass 0 for evaluation.
    dropout_seed : int in [0, 2**64), required when ``dropout_p > 0``
        Which weights are dropped is decided by counters keyed by this seed
        (Philox4x32-10 of each weight's flat index in (B…, H, Tq, Tk)): the
        same seed drops the same weights on every library, implementation
        and device, and :func:`attention_vjp` drops them again in the
        backward pass without storing a mask. A 0-d integer array is taken
        too; under ``jax.jit`` a traced seed needs no new compilation.
    sinks : floating array (H,) or (B…, H), optional
        Attention sinks (gpt-oss): one logit per query head for a virtual key
        whose value is 0 (any shape that broadcasts to (B…, H) is taken: a
        (1,) array is one sink for every head). Each row's softmax runs over its visible scores and
        the sink, so the weights of the keys sum to less than 1 and a row
        with no visible key gives 0 with ``lse = sinks[h]``; ``lse`` includes
        the sink. A sink of ``-inf`` is no sink; NaN and ``+inf`` give NaN
        rows. Computed in the compute dtype, as ``alibi_slopes``; torch
        and JAX differentiate through them, and :func:`attention_vjp` returns
        their gradient. ``"native"`` cannot take them.
    segment_ids : integer array (B…, T), or a pair ((B…, Tq), (B…, Tk)), optional
        Packed sequences: key ``j`` is visible to query ``i`` only if their
        segment ids are equal (combined with every other rule). One array
        serves queries and keys (self-attention, ``Tq = Tk``); a pair gives
        each its own. Where the ids are at hand (not traced, not lazy) and
        sorted in every row, key blocks outside a query block's segments are
        skipped, so packed documents cost the sum of their squared lengths;
        otherwise they act as a mask. Positions (causal, window, ALiBi) stay
        those of the packed row. Runs on ``"reference"``, ``"chunked"`` (the
        NumPy fast path lowers sorted ids as each query's key range and
        compares unsorted ones per tile), ``"numba_cpu"`` and ``"numba_cuda"``
        (sorted ids, as each query's key range; unsorted ones are refused,
        :func:`explain` says so and ``"auto"`` runs them elsewhere),
        ``"distributed"`` and ``"native"`` (as a dense mask).
    score_mod : function, optional
        A rule of yours on the scores: ``score_mod(score, b, h, q_idx,
        kv_idx, *mod_args) -> score``, applied after soft-capping and ALiBi
        and before the float ``attn_mask`` (FlexAttention's meaning). ``b`` is
        the flat index over the batch dimensions, ``h`` the query head,
        ``q_idx``/``kv_idx`` the query row and key indices. Written with
        Python operators, numbers, indexing of ``mod_args`` by the indices and
        the functions of :mod:`polyattn.ops` (``ops.where``, not ``if``); it is
        called on tiles of scores with broadcast index arrays, in the inputs'
        library, and compiled into the ``"numba_cpu"`` kernel (docs/rules.rst).
        Differentiable: torch and JAX differentiate through it (and its floating
        ``mod_args``), and :func:`attention_vjp` applies its derivative and
        returns those of its floating ``mod_args``. Runs on ``"reference"`` and
        ``"chunked"`` (the Array-API paths, every library), ``"numba_cpu"``,
        ``"numba_cuda"`` (every kernel family) and ``"distributed"``;
        ``"native"`` does not take it, and :func:`explain` says why.
    mask_mod : function, optional
        A rule of yours on visibility: ``mask_mod(b, h, q_idx, kv_idx,
        *mod_args) -> bool`` (True = visible), combined with every other rule;
        written and run as ``score_mod``.
    mod_args : tuple of arrays
        The arrays both functions receive after the indices (a bias table,
        slopes, lengths), indexed on every axis by index arrays: ``bias[h]``,
        ``table[h, q_idx - kv_idx + 64]``, ``temperature[()]`` for a 0-d array.
        A negative index counts from the end of its axis; one outside an axis
        is clamped to it.
    block_mask : BlockMask, optional
        The empty, partial and full tiles of a ``mask_mod``
        (:func:`polyattn.block_mask`; it carries its ``mask_mod`` when none is
        given): empty tiles are never computed, and the ``mask_mod`` is not
        evaluated in full ones. Without one, a ``mask_mod`` whose ``mod_args``
        are at hand gets one built at each call (one evaluation of the
        ``mask_mod`` per score): build it once to reuse it across calls.

    Returns
    -------
    out : array (B…, H, Tq, Ev)
        In the inputs' namespace, on their device, with dtype
        ``result_type(query, key, value)``. Fully masked rows are 0.
        (B…, Tq, H, Ev) with ``layout="BTHE"``.
    lse : array (B…, H, Tq)
        Only with ``return_lse=True``; ``-inf`` for fully masked rows
        (``sinks[h]`` with sinks, which they then include). Kept in
        the compute dtype (float32 for float16 inputs).

    Notes
    -----
    Query ``i`` has position ``p_i = i`` (``"top_left"``) or
    ``p_i = i + Tk_b - Tq`` (``"bottom_right"``), where ``Tk_b`` is
    ``key_lengths[b]`` if given, else ``Tk``; causal masking, windows and
    ALiBi all use it. Scores are computed in this order: ``scale · q·k`` →
    soft-capping → ALiBi → ``score_mod`` → float ``attn_mask`` → invisible
    keys removed (``mask_mod`` and ``segment_ids`` included) → sinks join →
    softmax → dropout → ``· value``. Key blocks that no query of a block can
    see are skipped, so the work of causal and windowed calls follows the
    visible area.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import scaled_dot_product_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 8, 16))   # (B, H, Tq, E)
    >>> k = rng.standard_normal((2, 4, 10, 16))  # (B, H, Tk, E)
    >>> v = rng.standard_normal((2, 4, 10, 32))  # (B, H, Tk, Ev)
    >>> scaled_dot_product_attention(q, k, v).shape
    (2, 4, 8, 32)
    >>> out, lse = scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    >>> lse.shape
    (2, 4, 8)

    Arrays laid out (B, T, H, E), as JAX and FlashAttention keep them:

    >>> q_bthe = q.transpose(0, 2, 1, 3)                # (B, Tq, H, E)
    >>> k_bthe, v_bthe = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    >>> scaled_dot_product_attention(q_bthe, k_bthe, v_bthe, layout="BTHE").shape
    (2, 8, 4, 32)

    A causal sliding window over the last 3 keys, soft-capped scores, and a
    batch whose rows have 10 and 6 keys:

    >>> out = scaled_dot_product_attention(
    ...     q, k, v, is_causal=True, causal_alignment="bottom_right", window=(2, 0),
    ...     softcap=30.0, key_lengths=np.array([10, 6]))
    >>> out.shape
    (2, 4, 8, 32)

    A sink per head takes part of each row's weight (gpt-oss):

    >>> sinks = np.array([0.0, 1.0, 2.0, 3.0])            # (H,)
    >>> out, lse = scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    >>> _, lse_keys = scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(lse, np.logaddexp(lse_keys, sinks[:, None])))
    True
    """
    check_choice("implementation", implementation, IMPLEMENTATIONS)
    check_bool("return_lse", return_lse)
    with quiet_floating_point(query):
        problem = prepare(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                          causal_alignment=causal_alignment, scale=scale,
                          enable_gqa=enable_gqa, layout=layout, window=window,
                          softcap=softcap, alibi_slopes=alibi_slopes,
                          key_lengths=key_lengths, dropout_p=dropout_p,
                          dropout_seed=dropout_seed, sinks=sinks,
                          segment_ids=segment_ids, score_mod=score_mod,
                          mask_mod=mask_mod, mod_args=mod_args, block_mask=block_mask)
        choice = _dispatch.choose(problem, implementation, return_lse=return_lse,
                                  describe=False)
        _, out, lse = run(problem, choice.implementation, fallback=implementation == "auto")
        return _finish(problem, value_features(problem, out), lse, return_lse)


def _finish(problem: Problem, out: Array, lse: Array | None,
            return_lse: bool) -> Array | tuple[Array, Array]:
    """The caller's dtype and layout of ``out`` (and ``lse``)."""
    xp = problem.xp
    if out.dtype != problem.result_dtype:
        out = xp.astype(out, problem.result_dtype)
    out = problem.finish_out(out)
    if return_lse:
        return out, problem.finish(lse, 1)
    return out


def attention_weights(
    query: Array, key: Array, /, *, attn_mask: Array | None = None, is_causal: bool = False,
    causal_alignment: str = "top_left", scale: float | None = None, enable_gqa: bool = False,
    layout: str = "BHTE", window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: Array | None = None,
    key_lengths: Array | int | None = None, dropout_p: float = 0.0,
    dropout_seed: int | None = None, sinks: Array | None = None,
    segment_ids: Array | tuple[Array, Array] | None = None,
    score_mod: Callable[..., Any] | None = None, mask_mod: Callable[..., Any] | None = None,
    mod_args: tuple[Array, ...] = (), block_mask: Any = None,
) -> Array:
    """The attention weights ``α = softmax(query · keyᵀ · scale + mask)``.

    Row ``i`` says how much query ``i`` attends to every key; it sums to 1
    (to 0 for a fully masked row). The arguments mean what they mean in
    :func:`scaled_dot_product_attention`; with ``layout="BTHE"`` query and
    key are (B…, T, H, E) and the weights are still (B…, H, Tq, Tk). With
    ``dropout_p > 0`` they are the weights after dropout (dropped ones 0, kept
    ones scaled by ``1 / (1 - dropout_p)``), the same ones that
    :func:`scaled_dot_product_attention` multiplies by the values. With
    ``sinks`` the sink's weight is left out: rows sum to less than 1. This
    materialises the (B…, H, Tq, Tk) matrix, with the reference
    implementation on every library (differentiable where the library is).

    Returns
    -------
    array (B…, H, Tq, Tk)
        dtype ``result_type(query, key)``, in the inputs' namespace and device.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import attention_weights
    >>> q = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> k = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    >>> w = attention_weights(q, k, scale=10.0)
    >>> w.round(3)
    array([[1., 0., 0.],
           [0., 1., 0.]])
    >>> w.sum(axis=-1)
    array([1., 1.])
    """
    with quiet_floating_point(query):
        problem = prepare(query, key, None, attn_mask=attn_mask, is_causal=is_causal,
                          causal_alignment=causal_alignment, scale=scale,
                          enable_gqa=enable_gqa, layout=layout, window=window,
                          softcap=softcap, alibi_slopes=alibi_slopes,
                          key_lengths=key_lengths, dropout_p=dropout_p,
                          dropout_seed=dropout_seed, sinks=sinks,
                          segment_ids=segment_ids, score_mod=score_mod,
                          mask_mod=mask_mod, mod_args=mod_args, block_mask=block_mask)
        return _weights(problem)


def _weights(problem: Problem) -> Array:
    """:func:`attention_weights` of a prepared problem."""
    xp = problem.xp
    if problem.score_elements == 0:
        alpha = xp.zeros((*problem.q.shape[:-1], problem.tk), dtype=problem.compute_dtype,
                         device=device_of(problem.q))
    else:
        alpha = array_api.weights(problem)
    if alpha.dtype != problem.result_dtype:
        alpha = xp.astype(alpha, problem.result_dtype)
    return problem.finish(alpha, 2)


def explain(query: Array, key: Array, value: Array, /, **options: Any) -> _dispatch.Explanation:
    """Which implementation ``scaled_dot_product_attention`` runs for these inputs, and why.

    Takes the same arguments as :func:`scaled_dot_product_attention`
    (``return_lse`` matters: the native implementations cannot return the
    log-sum-exp). Nothing is computed.

    Returns
    -------
    Explanation
        ``.implementation`` and ``.reason``, plus the details behind them
        (library, device, dtypes, shapes, score-matrix size and budget,
        whether the CUDA kernel is usable; for ``"numba_cpu"``, ``.compiled``:
        whether its kernel is compiled, cached on disk or still to compile, and
        ``.tiles``: the SIMD vectors and register tiles its products run in)
        and, for ``"auto"``,
        ``.candidates``: every implementation in order of preference with the
        reason it was not chosen; ``str()`` gives a readable report.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import explain
    >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
    >>> e = explain(q, q, q)
    >>> e.implementation
    'reference'
    >>> print(e.reason)  # doctest: +NORMALIZE_WHITESPACE
    the 0.5 KiB score matrix fits the 32.0 KiB budget for NumPy arrays
    (NUMPY_SCORE_BUDGET_BYTES; POLYATTN_SCORE_BUDGET sets another), so it is
    materialised
    """
    allowed = {"attn_mask", "is_causal", "causal_alignment", "scale", "enable_gqa",
               "return_lse", "implementation", "layout", "window", "softcap", "alibi_slopes",
               "key_lengths", "dropout_p", "dropout_seed", "sinks", "segment_ids", "score_mod",
               "mask_mod", "mod_args", "block_mask"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments: {', '.join(unknown)}")
    implementation = options.pop("implementation", "auto")
    check_choice("implementation", implementation, IMPLEMENTATIONS)
    return_lse = check_bool("return_lse", options.pop("return_lse", False))
    problem = prepare(query, key, value, attn_mask=options.get("attn_mask"),
                      is_causal=options.get("is_causal", False),
                      causal_alignment=options.get("causal_alignment", "top_left"),
                      scale=options.get("scale"), enable_gqa=options.get("enable_gqa", False),
                      layout=options.get("layout", "BHTE"), window=options.get("window"),
                      softcap=options.get("softcap"), alibi_slopes=options.get("alibi_slopes"),
                      key_lengths=options.get("key_lengths"),
                      dropout_p=options.get("dropout_p", 0.0),
                      dropout_seed=options.get("dropout_seed"), sinks=options.get("sinks"),
                      segment_ids=options.get("segment_ids"),
                      score_mod=options.get("score_mod"), mask_mod=options.get("mask_mod"),
                      mod_args=options.get("mod_args", ()),
                      block_mask=options.get("block_mask"))
    return _dispatch.choose(problem, implementation, return_lse=return_lse)
