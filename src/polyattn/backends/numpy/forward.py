"""Online-softmax attention tuned for NumPy on the CPU.

The algorithm is the one of :mod:`polyattn.backends.array_api.blocked`
(running maximum ``m``, running sum ``l``, rescaled accumulator ``acc``;
Milakov & Gimelshein 2018, Dao et al. 2022), written against NumPy itself so
that the CPU is used well:

- **Work items.** The problem is cut into independent items, one per
  (batch index, key/value head, query block). The ``G = H // Hkv`` query heads
  that share a key/value head are stacked into one item, so a key block read
  into cache serves all of them and the matrix products are taller.
- **Cache-sized tiles.** An item holds a (BLOCK_Q, BLOCK_K) block of scores,
  1 MiB for the default sizes (float32; float64 items have half the rows),
  which stays in the core's L2 cache while it is exponentiated and
  multiplied by the value block. Without a causal mask, an item with fewer
  rows (a short query sequence) takes wider key blocks of the same area, so
  it makes fewer, larger calls.
- **One pass over the scores.** The scale is folded into the queries once
  per item, and the queries carry one more column holding ``-m``: the product
  ``[q | -m] @ [k | 1]ᵀ`` delivers the scores already shifted. They are
  exponentiated in place, summed by a matrix-vector product and multiplied by
  the value block. The running maximum is only recomputed for a block in
  which some row's maximum rose far enough (``RESCALE_LIMIT``) to matter;
  between such blocks the exponentials may exceed 1 but stay far from
  overflow, and the result is exact either way (the shift cancels in
  ``acc / l`` and is added back in ``lse``).
- **The visible area only.** Each item first computes, per query row, the
  keys ``[lo, hi)`` that its batch row's key length, the causal mask and the
  window leave visible (docs/semantics.rst; both bounds grow with the row). Key
  blocks run from the first such key to the last, and each block is computed
  only for the rows that see some of it (:func:`_band_tiles`), so time and
  memory follow the visible band: T·window under a sliding window, not T².
  Only tiles that straddle an edge of the band write a mask, and only its
  triangles; on the cheap path after the exponential (as zeros): NumPy's
  float64 ``exp`` is about 3× slower per element on -inf. A ``mask_mod``'s block
  mask narrows each row's keys to its query block's non-empty key blocks, and
  the ``mask_mod`` runs on its partial tiles only (:mod:`.tile_rules`).
- **Scores in the order of docs/semantics.rst.** Soft-capping ``c·tanh(s/c)`` cannot take the
  shift inside the product, so with it the queries' extra column stays 0 and
  ``m`` is subtracted after the cap. ALiBi's ``-slope_h·|p_i - j|`` (the slope
  of each query head of the item) and a float mask are added to the shifted
  scores. A ``score_mod`` sees the scores themselves (after the cap and ALiBi):
  with one, the column stays 0 and ``m`` is subtracted from what it returns. Key
  lengths and slopes are read as NumPy arrays.
- **Cores busy, one BLAS thread per worker.** NumPy releases the GIL inside
  BLAS and ufunc loops, so a thread pool runs the items concurrently, each
  writing its own slice of the output, with BLAS on one thread in each worker
  (:mod:`.threads`: the BLAS policy :data:`~.threads.SHARED_BLAS`, the pool,
  its fork handler; :func:`threading_mode` tells whether the items run on the
  pool or inline). A call runs at most :func:`num_threads` items at once. No
  reduction crosses items, so the result does not depend on the number of
  threads or on the order in which items finish.
- **No floating-point warnings.** Non-finite inputs give non-finite results
  (docs/semantics.rst), and hidden scores overflow the cheap path's exponential
  before they are zeroed: every floating-point condition is ignored
  (``np.errstate(all="ignore")``) in the calling thread and in each worker,
  whose error state is not the caller's.
- **Dropout** (docs/semantics.rst). The keep-mask of each tile is recomputed from the
  weights' flat indices by the Philox counters of :mod:`polyattn.rules.dropout`
  (:func:`_dropout_factor`), so nothing is stored and every implementation
  drops the same weights. The running sum ``l`` (and so ``lse``) takes the
  undropped exponentials; only what is multiplied by the values is dropped
  and scaled by ``1 / (1 - p)``.
- **The backward pass** (:func:`backward`) is in :mod:`.backward`: the same
  plan (:mod:`.plan`), scores (:mod:`.scores`) and threads, no reductions across items.
- **Strided inputs.** The matrices of ``q``, ``k`` and ``v`` may have any row
  stride (the (B…, H, T, E) views of (B…, T, H, E) arrays): ``q`` and ``k``
  are only read into per-item buffers, and ``v`` goes to BLAS as it is
  wherever its rows are contiguous. ``out`` follows the memory order of
  ``q``.

Precision: scores, ``m``, ``l`` and ``acc`` are kept in the compute dtype
(float32 or float64; float16 inputs arrive as float32). Folding ``-m`` into
the product adds one term to each dot product, so the shifted scores carry
the rounding error of an (E + 1)-term sum instead of an E-term sum and a
subtraction. ``np.exp`` is used rather than ``np.exp2``: NumPy's float32
``exp2`` falls to a slow path on underflow, which attention hits constantly.
"""
from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from polyattn.backends.numpy import plan, threads
from polyattn.backends.numpy.backward import backward as _backward
from polyattn.backends.numpy.plan import (
    _band_tiles,
    _blas_ready,
    _flat,
    _Item,
    _output,
    _Problem,
    _tiles,
)
from polyattn.backends.numpy.scores import (
    _dropout_factor,
    _dropout_keep,
    _hide,
    _scores,
    _shift_column,
)
from polyattn.backends.numpy.threads import _run_jobs, num_threads, threading_mode
from polyattn.rules.visibility import Rules

__all__ = ["Rules", "_band_tiles", "_blas_ready", "_dropout_keep", "_tiles", "attention",
           "backward", "num_threads", "threading_mode"]

def _attend_item(p: _Problem, b: tuple[int, ...], hk: int, q0: int, out: np.ndarray,
                 lse: np.ndarray) -> None:
    """:func:`_online_softmax` with no floating-point condition warned about or raised.

    A cheap-path block whose exponentials overflow is detected by its row sum and
    redone, exponentials underflow all the time, and non-finite inputs give non-finite
    results (docs/semantics.rst): the values say what happened, whatever the caller's
    ``np.errstate`` (a pool worker has its own).
    """
    with np.errstate(all="ignore"):
        _online_softmax(p, b, hk, q0, out, lse)


def _online_softmax(p: _Problem, b: tuple[int, ...], hk: int, q0: int, out: np.ndarray,
                    lse: np.ndarray) -> None:
    """Online softmax of one work item; writes its slice of ``out`` and ``lse``.

    Per row: ``m`` (a shift at most ``log(RESCALE_LIMIT)`` below the running
    maximum), ``l = Σ exp(s - m)`` and ``acc = Σ exp(s - m) v``, with ``s`` the
    scores of docs/semantics.rst. Each key block takes the cheap path (exponentiate
    the already shifted scores, sum, multiply by ``v``) and is redone exactly
    (new maximum, rescaled ``l`` and ``acc``) only when a row's block sum is
    above ``RESCALE_LIMIT``, or below ``2**-60`` for a row that has no mass yet
    (underflow, or a row fully masked so far). The scores are computed only in
    the rectangles of :func:`_band_tiles`, which follow the visible band. With
    dropout, ``acc`` takes ``exp(s - m)·keep / (1 - p)`` and ``l`` the undropped sum.
    """
    it = _Item(p, b, hk, q0)
    g, e, ev = p.g, p.e, p.ev
    bq = it.q1 - q0
    bk = p.key_block(bq)
    heads = slice(hk * g, (hk + 1) * g)
    ix: tuple[Any, ...] = (*b, heads, slice(q0, it.q1))
    out_slice = out[ix]                              # (G, bq, Ev)
    lse_slice = lse[ix]                              # (G, bq)

    # --- queries of the G heads, scaled once, extended by the column -m (m = 0 at first)
    qe = p.buffer("q", (g, bq, e + 1))
    np.multiply(p.q[ix], p.qscale, out=qe[..., :e])
    qe[..., e] = 0.0
    m = p.buffer("m", (g, bq))
    l = p.buffer("l", (g, bq))
    acc = p.buffer("acc", (g, bq, ev))
    m.fill(0.0)
    l.fill(0.0)
    acc.fill(0.0)
    dropout = p.rules.dropout

    tiles = list(_band_tiles(it.lo, it.hi, bk, sees=it.sees))
    if tiles:                                        # (none where no row sees a key)
        ke = p.extended_keys(b, hk)                  # (Tk, E + 1)
        vb = p.v[(*b, hk)]                           # (Tk, Ev)
    for r0, r1, k0, k1 in tiles:
        rows = slice(r0, r1)
        r = r1 - r0
        s = p.buffer("s", (g, r, k1 - k0))
        l_blk = p.buffer("l_blk", (g, r))
        pv = p.buffer("pv", (g, r, ev))
        qr, mr, lr, accr = qe[:, rows], m[:, rows], l[:, rows], acc[:, rows]
        _scores(p, it, qr, ke, mr, r0, r1, k0, k1, s, hide=False)
        # --- cheap path: p = exp(s - m) in place, hidden entries then set to 0;
        # l_blk = p·1, a matrix-vector product
        np.exp(s, out=s)
        _hide(p, it, s, r0, r1, k0, k1, 0.0)
        np.matmul(s, p.ones[:k1 - k0], out=l_blk)
        # two reductions settle the usual case; the row-wise test only runs when they
        # do not (a large or tiny sum somewhere, or a NaN)
        fine = l_blk.max() <= p.limit and l_blk.min() >= p.tiny
        if fine or not (need := (l_blk > p.limit) | ((lr == 0) & (l_blk < p.tiny))).any():
            if dropout:
                s *= _dropout_factor(p, it, r0, r1, k0, k1, p.buffer("z", s.shape))
            np.matmul(_flat(s), vb[k0:k1], out=_flat(pv))  # (G·r, Ev)
            accr += pv
            lr += l_blk
            continue
        _rescaled_block(p, it, qr, ke, vb, mr, lr, accr, need, r0, r1, k0, k1, s, l_blk, pv)

    _normalise(p, ix, m, l, acc, out_slice, lse_slice)


def _rescaled_block(p: _Problem, it: _Item, qr: np.ndarray, ke: np.ndarray, vb: np.ndarray,
                    mr: np.ndarray, lr: np.ndarray, accr: np.ndarray, need: np.ndarray,
                    r0: int, r1: int, k0: int, k1: int, s: np.ndarray, l_blk: np.ndarray,
                    pv: np.ndarray) -> None:
    """The exact path of :func:`_online_softmax` for one tile: the rows in ``need`` move
    their shift ``m`` up to the tile's maximum, ``l`` and ``acc`` are rescaled by
    ``exp(-d)``, and the tile's weights are recomputed and added (rows r0:r1 of ``it``,
    keys k0:k1; ``qr``, ``mr``, ``lr``, ``accr`` are those rows of the item's state)."""
    g, e, r = p.g, p.e, r1 - r0
    # d = how far each row's shift moves
    _scores(p, it, qr, ke, mr, r0, r1, k0, k1, s)
    d = p.buffer("d", (g, r))
    alpha = p.buffer("alpha", (g, r))
    np.max(s, axis=-1, out=d)
    has_mass = lr > 0
    np.maximum(d, 0.0, out=d, where=has_mass)     # rows with mass never lower m
    np.copyto(d, 0.0, where=np.isneginf(d))       # still fully masked: keep m
    # rows that did not need it keep their shift, so each row's bits depend on its
    # own scores only (not on whether another row of the block was redone)
    np.copyto(d, 0.0, where=~need)
    np.subtract(s, d[..., None], out=s)
    np.exp(s, out=s)
    np.matmul(s, p.ones[:k1 - k0], out=l_blk)
    if p.rules.dropout:
        s *= _dropout_factor(p, it, r0, r1, k0, k1, p.buffer("z", s.shape))
    np.matmul(_flat(s), vb[k0:k1], out=_flat(pv))
    # --- rescale what was accumulated by exp(-d) (d >= 0 wherever there is mass)
    alpha.fill(0.0)
    np.negative(d, out=alpha, where=has_mass)
    np.exp(alpha, out=alpha, where=has_mass)
    accr *= alpha[..., None]
    accr += pv
    lr *= alpha
    lr += l_blk
    mr += d
    _shift_column(p, mr, qr[..., e])


def _normalise(p: _Problem, ix: tuple[Any, ...], m: np.ndarray, l: np.ndarray,
               acc: np.ndarray, out_slice: np.ndarray, lse_slice: np.ndarray) -> None:
    """``out = acc / l`` and ``lse = m + log l`` of an item's rows ``ix``, into its slices."""
    # --- normalise: out = acc / l, lse = m + log l; l == 0 (fully masked, including rows
    # that see no key): 0, -inf. A NaN in l, from a NaN input, propagates to out and lse.
    empty = None if l.all() else l == 0               # (NaN is truthy, and not 0)
    if empty is not None:
        l[empty] = 1.0
    np.divide(acc, l[..., None], out=out_slice)
    np.log(l, out=l)
    np.add(m, l, out=lse_slice, dtype=lse_slice.dtype)
    if empty is not None:
        out_slice[empty] = 0.0
        lse_slice[empty] = -np.inf
    # a query row holding NaN or inf is NaN whatever its scores became: every score -inf
    # (inf times keys all negative there: not a fully masked row) or finite (soft-capping
    # saturates); NaN never disappears (docs/semantics.rst), as on the other paths
    lost = ~np.isfinite(p.q[ix]).all(axis=-1)
    if lost.any():
        out_slice[lost] = np.nan
        lse_slice[lost] = np.nan


def attention(q: Any, k: Any, v: Any, /, *, mask: Any, rules: Rules, scale: float, xp: Any,
              threads: int | None = None, lse_dtype: Any = None) -> tuple[Any, Any]:
    """Blocked, multi-threaded attention on NumPy arrays; see :mod:`polyattn.backends`.

    ``xp`` is accepted for the common signature; the arrays must be NumPy arrays. They
    may be strided views (no copy is made of ``q`` or ``k``, nor of ``v`` where its rows
    are contiguous), and ``out`` follows the memory order of ``q`` (:func:`_output`).
    ``rules`` are the call's rules (causal, windows, key lengths, soft-capping, ALiBi,
    dropout, segment ids, ``score_mod`` and ``mask_mod`` with a block mask); their key
    lengths and slopes are read as NumPy arrays. ``threads``
    caps the worker threads of this call (default :func:`num_threads`; 1 runs inline);
    ``lse_dtype`` (e.g. float64 for float32 inputs) is the dtype of ``lse`` = ``m + log l``,
    summed in it, so that partial results with large scores merge exactly enough.

    Examples
    --------
    A causal sliding window of 2 keys to the left on a (B, H, T, E) problem:

    >>> import numpy as np
    >>> from polyattn.backends.numpy import forward as numpy_chunked
    >>> from polyattn.rules.visibility import Rules
    >>> q = k = v = np.ones((1, 2, 6, 4))
    >>> rules = Rules(tq=6, tk=6, causal=True, window=(2, 0))
    >>> out, lse = numpy_chunked.attention(q, k, v, mask=None, rules=rules, scale=0.5, xp=np)
    >>> out.shape, np.exp(lse[0, 0] - 0.5 * 4).round(6).tolist()   # keys seen per row
    ((1, 2, 6, 4), [1.0, 2.0, 3.0, 3.0, 3.0, 3.0])
    """
    q, k = np.asarray(q), np.asarray(k)   # read into per-item buffers only: any strides
    v = _blas_ready(np.asarray(v))        # a BLAS operand as it is
    with np.errstate(all="ignore"):       # e.g. a scale beyond float32 becomes inf, silently
        problem = _Problem(q, k, v, None if mask is None else np.asarray(mask), scale, rules)
    out = _output(q, problem.ev)                  # (B…, H, Tq, Ev)
    lse = np.empty(q.shape[:-1], dtype=lse_dtype or q.dtype)   # (B…, H, Tq)
    items = [(b, hk, q0) for b in np.ndindex(*q.shape[:-3]) for hk in range(problem.hkv)
             for q0 in range(0, problem.tq, problem.bq)]
    if not items:
        return out, lse
    # later query blocks see more keys under a causal mask: start them first
    items.sort(key=lambda item: -item[2])
    # Threads over items only where each worker's BLAS runs on one thread without
    # changing any other thread's: a pool on top of BLAS's own threads oversubscribes
    # the cores.
    n = min(num_threads() if threads is None else max(1, int(threads)), len(items))
    if n == 1 or threading_mode() != "pool":  # inline; BLAS keeps its own threads
        for b, hk, q0 in items:
            _attend_item(problem, b, hk, q0, out, lse)
        return out, lse
    # the extended keys are built by the pool too, queued ahead of the items (so an item
    # waits only on a build that has started)
    keys = list(dict.fromkeys((b, hk) for b, hk, _ in items))
    for key in keys:
        problem.pending[key] = threading.Event()
    jobs: list[Callable[[], Any]] = [partial(problem.build_pending, b, hk) for b, hk in keys]
    jobs += [partial(_attend_item, problem, b, hk, q0, out, lse) for b, hk, q0 in items]
    _run_jobs(jobs, n)
    return out, lse


def backward(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, /, *, mask: Any,
             rules: Rules, scale: float, xp: Any, grad_lse: Any = None,
             ) -> tuple[Any, Any, Any]:
    """The gradients (dq, dk, dv) of :func:`attention`; see :func:`.backward.backward`."""
    return _backward(q, k, v, out, lse, grad_out, mask=mask, rules=rules, scale=scale, xp=xp,
                     grad_lse=grad_lse)


# --- settings: the plan's block sizes and the threads' settings, set here or there --------

#: Names of :mod:`.plan` and :mod:`.threads` read and set through this module too, so that
#: ``forward.NUM_THREADS = 1`` changes what every call of the path reads.
SETTINGS = {
    plan: ("BLOCK_Q", "BLOCK_K", "RESCALE_LIMIT"),
    threads: ("NUM_THREADS", "SHARED_BLAS", "_blas_libs", "_blas_lock", "_held", "_hold_lock",
              "_holders", "_pool", "_pool_lock", "_pool_size"),
}


def __getattr__(name: str) -> Any:
    """A name of :mod:`.threads` or :mod:`.plan` not defined here (read only)."""
    for home in (threads, plan):
        if name in vars(home):
            return vars(home)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _passed_on(home: types.ModuleType, name: str) -> property:
    return property(lambda _: getattr(home, name),
                    lambda _, value: setattr(home, name, value),
                    doc=f"``{home.__name__}.{name}``")


class _Settings(types.ModuleType):
    """This module's type: each name of :data:`SETTINGS` is its home module's."""


for _home, _names in SETTINGS.items():
    for _name in _names:
        setattr(_Settings, _name, _passed_on(_home, _name))
sys.modules[__name__].__class__ = _Settings
