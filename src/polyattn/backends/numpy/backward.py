"""The backward pass of the NumPy fast path: FlashAttention-2's gradients, blocked and threaded.

With ``P = exp(s - lse)`` (the softmax before dropout, recomputed from ``q``,
``k`` and the saved ``lse``), ``Z`` the dropout factor ``keep / (1 - p)`` (or
1) and ``D = rowsum(dO ∘ O) - dlse`` (Dao 2023, Algorithm 2)::

    dV = (P∘Z)ᵀ dO        dP = (dO Vᵀ)∘Z        dS = P ∘ (dP - D)
    dQ = scale·dS K       dK = scale·dSᵀ Q

with ``dS`` times the soft-cap's derivative ``1 - tanh²(scale·q·k / c)``
where a cap applies, and times a ``score_mod``'s derivative with respect to the
score (from the same call of it that gives the scores, on values that carry a
derivative). The gradients of floating ``mod_args`` are not this module's: one
pass of the Array-API paths gives them, whichever implementation ran. ``dK`` and
``dV`` are summed over the ``G`` query heads that share a key/value head. ALiBi
slopes and float masks are constants: they receive no gradient. Rows that see no
key (``lse = -inf``) get zero gradients.

The machinery is the forward pass's: the same scores in the order of
docs/semantics.rst (:func:`.scores._scores`, :func:`.scores._hide`), the same plan
(:mod:`.plan`), the same
visible band (only tiles some row sees are computed: cost and memory follow
the band), the same thread pool and BLAS policy. No (Tq, Tk) matrix is
stored; memory is O(T·block) besides copies of the inputs' size.

- **Folded shifts.** The queries carry the column ``-lse`` and the keys a
  column of ones, so ``[q·scale | -lse] @ [k | 1]ᵀ`` is ``s - lse`` at once;
  likewise ``[dO | -D] @ [v | 1]ᵀ`` is ``dP - D`` (without dropout, whose
  factor must come before ``D``). Scaling the queries once also makes
  ``dSᵀ (q·scale)`` the key gradient directly. These extended arrays are
  built once per (batch row, key/value head), before any tile.
- **No reductions across items.** The fused pass has one item per (batch
  row, key/value head): it walks the key blocks, and for each the query
  tiles that see it (the G heads stacked into one product), adding to the
  block's ``dK`` and ``dV`` and to a ``dQ`` of all its rows; five matrix
  products per tile. Where that leaves too few items for the cores
  (:func:`fused`), two passes run instead: pass 1 items (batch row,
  key/value head, key block) own their rows of ``dK`` and ``dV``, pass 2
  items (batch row, key/value head, query block) their rows of ``dQ``; seven
  products per tile. Either way every gradient is summed by one item in a
  fixed order, so the results do not depend on the number of threads. Jobs
  start largest first (by the area of scores they compute).
- **Keys past ``key_lengths``** are never read (no tile reaches them), so
  NaN or inf there cannot leak; their ``dk`` and ``dv`` are 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from polyattn.backends.numpy.plan import _band_tiles, _flat, _Item, _output, _Problem
from polyattn.backends.numpy.scores import _dropout_factor, _hide, _scores, _shift_column
from polyattn.backends.numpy.threads import _run_jobs, num_threads, threading_mode
from polyattn.rules.visibility import Rules

#: Fewest (batch row, key/value head) pairs for the fused pass (:func:`fused`); ``None``:
#: decided by the cost of each way.
FUSED_MIN_PAIRS: int | None = None


class _Head:
    """The extended arrays of one (batch row, key/value head), shared by its items.

    ``qe`` (G, Tq, E + 1) ``[q·scale | -lse]`` (last column 0 with soft-capping,
    where ``lse`` is subtracted after the cap); ``lse`` (G, Tq) with -inf (rows
    that see no key) replaced by 0; ``de`` (G, Tq, Ev + 1) ``[dO | -D]`` (last
    column 0 with dropout); ``d`` (G, Tq) ``D``; ``ke`` (Tk, E + 1) ``[k | 1]``;
    ``ve`` (Tk, Ev + 1) ``[v | 1]``.
    """

    __slots__ = ("d", "de", "ke", "lse", "qe", "ve")

    def __init__(self, p: _Problem, b: tuple[int, ...], hk: int, out: np.ndarray,
                 lse: np.ndarray, grad_out: np.ndarray, grad_lse: np.ndarray | None) -> None:
        g, e, ev = p.g, p.e, p.ev
        ix: tuple[Any, ...] = (*b, slice(hk * g, (hk + 1) * g))
        lse_h = lse[ix]                                   # (G, Tq)
        self.lse = np.where(np.isneginf(lse_h), 0.0, lse_h).astype(p.dtype, copy=False)
        self.qe = np.empty((g, p.tq, e + 1), dtype=p.dtype)
        np.multiply(p.q[ix], p.qscale, out=self.qe[..., :e])
        _shift_column(p, self.lse, self.qe[..., e])
        do = grad_out[ix]                                 # (G, Tq, Ev)
        self.d = np.einsum("gte,gte->gt", do, out[ix])    # rowsum(dO ∘ O)
        if grad_lse is not None:
            self.d -= grad_lse[ix]
        self.de = np.empty((g, p.tq, ev + 1), dtype=p.dtype)
        self.de[..., :ev] = do
        if p.rules.dropout:
            self.de[..., ev] = 0.0
        else:
            np.negative(self.d, out=self.de[..., ev])
        self.ke = np.empty((p.tk, e + 1), dtype=p.dtype)
        pair: tuple[Any, ...] = (*b, hk)
        self.ke[:, :e] = p.k[pair]
        self.ke[:, e] = 1.0
        self.ve = np.empty((p.tk, ev + 1), dtype=p.dtype)
        self.ve[:, :ev] = p.v[pair]
        self.ve[:, ev] = 1.0


def _tile(p: _Problem, h: _Head, it: _Item, qt: np.ndarray, dt: np.ndarray, r0: int, r1: int,
          k0: int, k1: int) -> tuple[np.ndarray, np.ndarray]:
    """``P∘Z`` and ``dS`` (G, r1 - r0, k1 - k0) of rows r0:r1 of ``it`` and keys k0:k1.

    ``qt`` (G, r, E + 1) and ``dt`` (G, r, Ev + 1) are those rows of ``h.qe`` and
    ``h.de``. Hidden entries are 0 in both results.
    """
    g, w = p.g, k1 - k0
    shape = (g, r1 - r0, w)
    lse = h.lse[:, it.q0 + r0:it.q0 + r1]                # (G, r)
    s = p.buffer("s", shape)
    grad = _scores(p, it, qt, h.ke, lse, r0, r1, k0, k1, s, hide=False, grad=True)
    np.exp(s, out=s)                                      # P, hidden entries then set to 0
    _hide(p, it, s, r0, r1, k0, k1, 0.0)
    ds = p.buffer("ds", shape)
    if qt.flags.c_contiguous and dt.flags.c_contiguous:
        np.matmul(_flat(dt), h.ve[k0:k1].T, out=_flat(ds))   # dO Vᵀ (- D) (G·r, bk)
    else:
        np.matmul(dt, h.ve[k0:k1].T, out=ds)
    pz = s
    if p.rules.dropout:
        pz = _dropout_factor(p, it, r0, r1, k0, k1, p.buffer("z", shape))
        ds *= pz                                          # (dO Vᵀ)∘Z
        ds -= h.d[:, it.q0 + r0:it.q0 + r1, None]         # - D
        pz *= s                                           # P∘Z
    ds *= s                                               # dS = P ∘ (dP - D)
    if grad is not None:                                  # times the scores' derivative
        ds *= grad
    return pz, ds


def _rows(p: _Problem, name: str, x: np.ndarray, q0: int, q1: int) -> np.ndarray:
    """Rows q0:q1 of ``x`` (G, T, F), contiguous (copied into a buffer where G > 1)."""
    if p.g == 1:
        return x[:, q0:q1]
    buf = p.buffer(name, (p.g, q1 - q0, x.shape[-1]))
    np.copyto(buf, x[:, q0:q1])
    return buf


def _key_item(p: _Problem, heads: dict[Any, _Head], b: tuple[int, ...], hk: int, k0: int,
              dk: np.ndarray, dv: np.ndarray, dq_acc: np.ndarray | None = None) -> None:
    """Pass 1: ``dK`` and ``dV`` of keys k0:k0 + block of (b, hk), over the rows that see them.

    With ``dq_acc`` (G, Tq, E), the tiles' ``dS K`` is added to it too (the fused pass).
    """
    h = heads[(b, hk)]
    k1 = min(k0 + p.block_k, p.tk)
    dk_acc = p.buffer("dk", (k1 - k0, p.e))
    dv_acc = p.buffer("dv", (k1 - k0, p.ev))
    dk_acc.fill(0.0)
    dv_acc.fill(0.0)
    _, lo, hi = p.key_ranges(b, 0, p.tq, hk)
    seen = np.flatnonzero((hi > lo) & (lo < k1) & (hi > k0))   # the rows that see the block
    first, stop = (int(seen[0]), int(seen[-1]) + 1) if seen.size else (0, 0)
    for q0 in range(first, stop, p.bq):
        it = _Item(p, b, hk, q0)
        for r0, r1, c0, c1 in _band_tiles(it.lo, it.hi, k1 - k0, k0, k1, it.sees):
            qt = _rows(p, "qt", h.qe, q0 + r0, q0 + r1)    # (G, r, E + 1)
            dt = _rows(p, "dt", h.de, q0 + r0, q0 + r1)    # (G, r, Ev + 1)
            pz, ds = _tile(p, h, it, qt, dt, r0, r1, c0, c1)
            rows = slice(c0 - k0, c1 - k0)
            dv_acc[rows] += _flat(pz).T @ _flat(dt)[:, :p.ev]   # (bk, Ev)
            dk_acc[rows] += _flat(ds).T @ _flat(qt)[:, :p.e]    # (bk, E), scale in qt
            if dq_acc is not None:
                part = p.buffer("part", (p.g, r1 - r0, p.e))
                np.matmul(_flat(ds), h.ke[c0:c1, :p.e], out=_flat(part))  # (G·r, E)
                dq_acc[:, q0 + r0:q0 + r1] += part
    keys: tuple[Any, ...] = (*b, hk, slice(k0, k1))
    dk[keys] = dk_acc
    dv[keys] = dv_acc


def _query_item(p: _Problem, heads: dict[Any, _Head], b: tuple[int, ...], hk: int, q0: int,
                dq: np.ndarray) -> None:
    """Pass 2: ``dQ`` of rows q0:q0 + bq of the G heads of (b, hk), over the keys they see."""
    h = heads[(b, hk)]
    it = _Item(p, b, hk, q0)
    bq = it.q1 - q0
    acc = p.buffer("dq", (p.g, bq, p.e))
    acc.fill(0.0)
    qt = _rows(p, "qt", h.qe, q0, it.q1)                   # (G, bq, E + 1)
    dt = _rows(p, "dt", h.de, q0, it.q1)                   # (G, bq, Ev + 1)
    for r0, r1, k0, k1 in _band_tiles(it.lo, it.hi, p.key_block(bq), sees=it.sees):
        _, ds = _tile(p, h, it, qt[:, r0:r1], dt[:, r0:r1], r0, r1, k0, k1)
        part = p.buffer("part", (p.g, r1 - r0, p.e))
        np.matmul(_flat(ds), h.ke[k0:k1, :p.e], out=_flat(part))  # (G·r, E)
        acc[:, r0:r1] += part
    rows: tuple[Any, ...] = (*b, slice(hk * p.g, (hk + 1) * p.g), slice(q0, it.q1))
    np.multiply(acc, p.qscale, out=dq[rows])


def _head_item(p: _Problem, heads: dict[Any, _Head], b: tuple[int, ...], hk: int,
               dq: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> None:
    """The fused pass: all gradients of (b, hk), key block after key block."""
    dq_acc = np.zeros((p.g, p.tq, p.e), dtype=p.dtype)      # (G, Tq, E)
    for k0 in range(0, p.tk, p.block_k):
        _key_item(p, heads, b, hk, k0, dk, dv, dq_acc)
    heads_of: tuple[Any, ...] = (*b, slice(hk * p.g, (hk + 1) * p.g))
    np.multiply(dq_acc, p.qscale, out=dq[heads_of])


def fused(pairs: int) -> bool:
    """Whether a call with ``pairs`` (batch row, key/value head) pairs takes the fused pass.

    The fused pass makes five matrix products per tile, the two passes seven, but the
    fused pass offers only ``pairs`` items to the threads. It is taken where the items
    run inline (:func:`.threads.threading_mode`), and on the pool where whole
    pairs, dealt to the available CPUs, still cost no more than the two passes spread
    evenly: ``ceil(pairs / cpus)·5 <= pairs·7 / cpus``. :data:`FUSED_MIN_PAIRS`, where
    set, decides instead. The choice never depends on
    :data:`.threads.NUM_THREADS`, so neither do the bits of the result.
    """
    if FUSED_MIN_PAIRS is not None:
        return pairs >= FUSED_MIN_PAIRS
    if threading_mode() != "pool":
        return True
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    return -(-pairs // cpus) * 5 * cpus <= pairs * 7


def _quiet(job: Callable[..., None], *args: Any) -> None:
    """Run ``job`` without floating-point warnings (NumPy's error state is per thread, so
    each job sets it): hidden scores may overflow the exponential before they are zeroed,
    and non-finite inputs give NaN and inf, which the values report (docs/semantics.rst)."""
    with np.errstate(all="ignore"):
        job(*args)


def backward(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, /, *, mask: Any,
             rules: Rules, scale: float, xp: Any, grad_lse: Any = None,
             ) -> tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv) of :func:`.forward.attention` on NumPy arrays.

    Arguments as for ``attention``, plus its ``out`` (B…, H, Tq, Ev) and ``lse``
    (B…, H, Tq), the cotangent ``grad_out`` of ``out`` and, optionally,
    ``grad_lse`` of ``lse``. Returns arrays shaped like ``q``, ``k`` and ``v``
    (``k`` and ``v`` with their Hkv heads), each in its input's memory order.
    Inputs may be strided views; none is modified.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.backends.array_api import reference
    >>> from polyattn.backends.numpy import forward as numpy_chunked
    >>> from polyattn.rules.visibility import Rules
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> kw = dict(mask=None, rules=Rules(5, 5, causal=True), scale=0.5, xp=np)
    >>> out, lse = numpy_chunked.attention(q, k, v, **kw)
    >>> dq, dk, dv = backward(q, k, v, out, lse, np.ones_like(out), **kw)
    >>> want = reference.backward(q, k, v, out, lse, np.ones_like(out), **kw)
    >>> all(np.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip((dq, dk, dv), want))
    True
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    p = _Problem(q, k, v, None if mask is None else np.asarray(mask), scale, rules)
    out, lse, grad_out = np.asarray(out), np.asarray(lse), np.asarray(grad_out)
    grad_lse = None if grad_lse is None else np.asarray(grad_lse)
    dq, dk, dv = _output(q, p.e), _output(k, p.e), _output(v, p.ev)
    if dq.size == 0 or dk.size == 0 or dv.size == 0:
        for grad in (dq, dk, dv):
            grad.fill(0.0)
        return dq, dk, dv
    pairs = [(b, hk) for b in np.ndindex(*p.batch) for hk in range(p.hkv)]
    heads: dict[Any, _Head] = {}

    def build(b: tuple[int, ...], hk: int) -> None:
        with np.errstate(all="ignore"):          # rowsum(dO ∘ O) of non-finite rows
            heads[(b, hk)] = _Head(p, b, hk, out, lse, grad_out, grad_lse)

    # (cost, job): the area of scores each job computes, so that the largest start first
    one_pass = fused(len(pairs))
    costed: list[tuple[int, Callable[[], Any]]] = []
    for b, hk in pairs:
        _, lo, hi = p.key_ranges(b, 0, p.tq, hk)
        seen = np.maximum(hi - lo, 0)                    # keys each query row sees
        starts = range(0, p.tk, p.block_k)
        areas = [] if one_pass else [
            int(np.maximum(np.clip(hi, k0, k0 + p.block_k) - np.clip(lo, k0, k0 + p.block_k),
                           0).sum()) for k0 in starts]
        if one_pass:
            costed.append((int(seen.sum()),
                           partial(_quiet, _head_item, p, heads, b, hk, dq, dk, dv)))
            continue
        costed += [(area, partial(_quiet, _key_item, p, heads, b, hk, k0, dk, dv))
                   for k0, area in zip(starts, areas, strict=True)]
        costed += [(int(seen[q0:q0 + p.bq].sum()),
                    partial(_quiet, _query_item, p, heads, b, hk, q0, dq))
                   for q0 in range(0, p.tq, p.bq)]
    costed.sort(key=lambda job: -job[0])                 # stable: ties keep their order
    jobs = [job for _, job in costed]
    n = min(num_threads(), len(jobs))
    if n == 1 or threading_mode() != "pool":   # inline; BLAS keeps its own threads
        for b, hk in pairs:
            build(b, hk)
        for job in jobs:
            job()
        return dq, dk, dv
    _run_jobs([partial(build, b, hk) for b, hk in pairs], n)
    _run_jobs(jobs, n)
    return dq, dk, dv
