"""A fused CPU kernel compiled with Numba: attention in SIMD register tiles, no BLAS.

The work split of :mod:`.numpy_chunked` (work items of (batch row, key/value
head, query block) holding the G query heads of a group, keys in blocks), with
every step in SIMD vectors across query rows:

- **Transposed panels.** An item's query rows are taken W at a time (two SIMD
  vectors: 32 float32 or 16 float64 rows with AVX-512). For a block of keys the
  kernel computes ``Sᵀ = scale·K·Qᵀ`` (keys × W), so that each query row is a
  column: its running maximum and sum, its exponentials and the rescale of its
  accumulated output are lanes of vector operations (:mod:`.tiles`), and
  ``Oᵀ += Vᵀ·Pᵀ`` follows. The scores' transform (docs/semantics.rst: soft-capping, ALiBi,
  the mask, the visible key range) runs column by column where it applies;
  keys no row of a panel may see are not computed.
- **Register tiles.** Both products are written in LLVM IR (Numba's own loops
  keep arrays in memory, and it turns LLVM's SLP vectoriser off): a tile keeps
  12 rows × 2 vectors of accumulators in registers (6 × 2 without AVX-512)
  while it runs down the shared dimension, one broadcast element of the left
  operand times two vector loads of the right one per step. Keys and values
  are read in place; ``Qᵀ`` is laid out once per item.
- **Exponentials**: Cody–Waite range reduction (``x = n·ln 2 + r``,
  ``|r| ≤ ln 2 / 2``), a polynomial for ``e^r`` (degree 6 in float32, 12 in
  float64) and ``2ⁿ`` (AVX-512's ``scalef``, else built in the exponent bits).
  Arguments below the smallest normal result give 0 (``e^-87.3`` in float32,
  ``e^-708.3`` in float64): such weights are below the rounding of a row whose
  largest weight is 1. ``-inf`` gives 0, NaN stays NaN.
- **Floating-point semantics kept.** ``fastmath`` allows reassociation and
  contraction but not the "no NaN / no inf" assumptions: ``-inf`` marks
  invisible keys as everywhere else in polyattn, and NaN and inf inputs
  propagate as docs/semantics.rst says.
- **Parallel over items** with ``prange``. Work items are independent, each
  writes its own rows of ``out`` and ``lse``: the result does not depend on
  the number of threads.

This module imports Numba when it is first used; :func:`availability` says
whether it can run. A call that has to compile the kernel because Numba's cache
does not hold it says so first, in one line on the logger ``"polyattn"``
(level WARNING, so it reaches stderr where logging is not configured;
``logging.getLogger("polyattn").setLevel(logging.ERROR)`` silences it), naming
``python -m polyattn warmup``. The NumPy code around the kernel computes under
``np.errstate(all="ignore")``: non-finite inputs give non-finite results
(docs/semantics.rst, "Non-finite inputs"), never a floating-point warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import math
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from polyattn.rules.dropout import key_words, threshold
from polyattn.rules.element import position
from polyattn.rules.lowering import reach
from polyattn.rules.visibility import Rules

Array = Any

#: Query rows per work item, summed over the G heads of a group (float32; half in float64).
BLOCK_ROWS = 512
#: Keys per block: the scores of one block against one panel of query rows (256 × 32
#: float32, 256 × 16 float64) are 32 KiB, within the L1 cache.
BLOCK_K = 256

_lock = threading.Lock()
#: Where a compile that nothing cached forces is announced (a child of "polyattn").
logger = logging.getLogger("polyattn.numba_cpu")


def availability() -> tuple[bool, str]:
    """(usable, reason): whether Numba is installed and the kernel has not failed to compile
    in this process."""
    try:
        import numba
    except ImportError as exc:
        return False, f"{exc.name or 'Numba'} is not installed; pip install 'polyattn[numba]'"
    if _compiled and _compiled[0].startswith("failed"):
        return False, _compiled[0]
    return True, f"Numba {numba.__version__}"


# --- the exponential ---------------------------------------------------------------------

#: Below these, e^x is subnormal (or 0) and the kernel returns 0.
EXP_MIN = {np.dtype(np.float32): -87.33654, np.dtype(np.float64): -708.3964185322641}


class KernelUnavailable(RuntimeError):
    """The kernel could not be compiled (the message says why)."""


#: The kernel's functions, defined (not yet compiled) on first use.
_definitions: dict[str, Any] = {}
#: What happened when :func:`kernels` compiled: "compiled", "loaded" (from Numba's cache)
#: or "failed: <why>"; empty before.
_compiled: list[str] = []


def _dispatchers() -> dict[str, Any]:
    """The kernel's Numba functions, defined but not compiled (cheap)."""
    with _lock:
        if not _definitions:
            import numba

            _choose_threading_layer(numba)
            from polyattn.backends.numba_cpu import kernels as compiled

            _definitions.update({name: getattr(compiled, name) for name in
                                 ("exp32", "exp64", "attend_item", "forward")})
        return _definitions


def signatures() -> list[Any]:
    """The forward kernel's signatures: float32 and float64."""
    from polyattn.backends.numba_cpu import kernels as compiled

    return [compiled.signature(np.float32), compiled.signature(np.float64)]


def _cached(function: Any, sig: Any) -> tuple[bool | None, str]:
    """(whether Numba's cache on disk holds ``function`` compiled for ``sig``, the cache's
    folder); ``(None, the exception's name)`` where Numba's cache internals cannot say."""
    try:
        cache = function._cache
        index = cache._cache_file._load_index()
        return cache._index_key(sig, function.targetctx.codegen()) in index, cache.cache_path
    except Exception as exc:  # Numba's cache internals differ: unknown rather than a guess
        return None, type(exc).__name__


def _announce_compile(what: str, wanted: list[tuple[Any, Any]]) -> None:
    """One line on :data:`logger` before a compile that Numba's cache cannot spare."""
    found = [_cached(function, sig) for function, sig in wanted]
    if any(hit is False for hit, _ in found):
        where = next(path for hit, path in found if hit is False)
        logger.warning(
            "polyattn: compiling the numba_cpu %s kernel (float32 and float64), which "
            "Numba's cache (%s) does not hold yet: this call waits for it (tens of seconds, "
            "once per machine); `python -m polyattn warmup` compiles it ahead", what, where)


def kernels(*, announce: bool = True) -> dict[str, Any]:
    """The compiled functions (compiled, or loaded from Numba's cache, on first use).

    A compile that Numba's cache cannot spare is announced on :data:`logger` first
    (``announce=False``: not, as for ``python -m polyattn warmup``). Raises
    :class:`KernelUnavailable` if compiling fails (and every later call says so).
    """
    found = _dispatchers()
    with _lock:
        if _compiled and _compiled[0].startswith("failed"):
            raise KernelUnavailable(f"the numba_cpu kernel {_compiled[0]}")
        if not _compiled:
            forward = found["forward"]
            if announce:
                _announce_compile("forward", [(forward, sig) for sig in signatures()])
            hits = sum(forward.stats.cache_hits.values())
            try:
                for sig in signatures():
                    forward.compile(sig)
                # every call converts to these signatures ("A" layout, read-only inputs)
                # instead of compiling one more specialisation per memory layout
                forward.disable_compile()
            except Exception as exc:  # a compiler error of any kind: report, fall back
                _compiled.append(f"failed to compile: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
                raise KernelUnavailable(f"the numba_cpu kernel {_compiled[0]}") from exc
            loaded = sum(forward.stats.cache_hits.values()) - hits
            _compiled.append("loaded" if loaded == len(signatures()) else "compiled")
        return found


def backward_kernel(*, announce: bool = True) -> Any:
    """The compiled backward kernel (compiled, or loaded from the cache, on first use;
    announced as by :func:`kernels`)."""
    kernels(announce=announce)
    from polyattn.backends.numba_cpu import kernels as compiled

    with _lock:
        if not _backward:
            if announce:
                _announce_compile("backward", [(compiled.backward,
                                                compiled.backward_signature(dt))
                                               for dt in (np.float32, np.float64)])
            try:
                for dt in (np.float32, np.float64):
                    compiled.backward.compile(compiled.backward_signature(dt))
                compiled.backward.disable_compile()
            except Exception as exc:  # a compiler error of any kind: report it
                raise KernelUnavailable(f"the numba_cpu backward kernel failed to compile: "
                                        f"{type(exc).__name__}: {exc}") from exc
            _backward.append(compiled.backward)
    return _backward[0]


_backward: list[Any] = []


def cache_state() -> str:
    """Whether the compiled kernel is ready: in this process, in Numba's cache on disk
    (then the first call loads it in well under a second), or not yet compiled."""
    if _compiled:
        if _compiled[0].startswith("failed"):
            return _compiled[0]
        return ("loaded from Numba's cache in this process" if _compiled[0] == "loaded"
                else "compiled in this process")
    return cache_state_on_disk()


def cache_state_on_disk() -> str:
    """Whether Numba's cache on disk holds the compiled kernel for this machine."""
    try:
        from polyattn.backends.numba_cpu import kernels as compiled

        wanted = [(_dispatchers()["forward"], sig) for sig in signatures()]
        wanted += [(compiled.backward, compiled.backward_signature(dt))
                   for dt in (np.float32, np.float64)]
    except Exception as exc:  # Numba's cache internals differ: say so rather than guess
        return f"cache state unknown ({type(exc).__name__})"
    looked = [_cached(function, sig) for function, sig in wanted]
    for hit, why in looked:
        if hit is None:
            return f"cache state unknown ({why})"
    found = [bool(hit) for hit, _ in looked]
    where = looked[-1][1]
    if all(found[:2]) and all(found[2:]):
        return f"compiled kernels (forward and backward) cached in {where}"
    if all(found[:2]):
        return (f"forward kernel cached in {where}; the backward kernel compiles on the first "
                "attention_vjp (about 30 s) unless `python -m polyattn warmup` ran")
    return (f"not cached yet (cache: {where}): the first call compiles it, about 10-30 s; "
            "`python -m polyattn warmup` compiles it ahead")


def warmup() -> tuple[str, float]:
    """Compile the forward and backward kernels now, or load them from Numba's cache:
    (what happened to the forward kernel, seconds)."""
    import time

    start = time.perf_counter()
    kernels(announce=False)
    backward_kernel(announce=False)
    for dtype in (np.float32, np.float64):
        exp(np.zeros(4, dtype=dtype))
    return _compiled[0], time.perf_counter() - start


# --- threads -----------------------------------------------------------------------------

#: The Numba threading layer in use once the kernel has run (for ``explain``).
_layer: list[str] = []


def _preload_tbb() -> None:
    """Make the TBB library of the ``tbb`` wheel loadable by Numba (it sits in the
    environment's ``lib`` folder, which the dynamic loader does not search)."""
    for path in sorted(glob.glob(os.path.join(sys.prefix, "lib", "libtbb.so.1[2-9]*"))):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


def _choose_threading_layer(numba: Any) -> None:
    """Prefer a threading layer that is safe with concurrent callers: TBB (also fork-safe),
    else OpenMP; Numba's own "workqueue" is used only when neither loads, and then calls
    are serialised (:func:`_serialised`). ``NUMBA_THREADING_LAYER`` set by the user wins."""
    if os.environ.get("NUMBA_THREADING_LAYER"):
        return
    _preload_tbb()
    safe = []
    for layer, module in (("tbb", "tbbpool"), ("omp", "omppool")):
        try:
            __import__(f"numba.np.ufunc.{module}")
            safe.append(layer)
        except ImportError:
            continue
    numba.config.THREADING_LAYER_PRIORITY = [*safe, *(
        x for x in ("tbb", "omp", "workqueue") if x not in safe)]
    numba.config.THREADING_LAYER = "threadsafe" if safe else "workqueue"


def threading_layer() -> str:
    """The Numba threading layer the kernel runs on ("" before its first call)."""
    return _layer[0] if _layer else ""


@contextmanager
def _serialised() -> Iterator[None]:
    """Calls one at a time where the threading layer is not safe for concurrent callers."""
    with _call_lock if threading_layer() in ("", "workqueue") else nullcontext():
        yield


_call_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """Fresh locks in a child started by ``fork``: one held by another thread at the fork
    (a compile, a serialised call) would stay held there."""
    global _lock, _call_lock
    _lock, _call_lock = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)


def tiles() -> str:
    """The SIMD vectors and register tiles the kernel's products run in on this CPU."""
    from polyattn.backends.numba_cpu import tiles as t

    isa = "AVX-512" if t.VECTOR_BYTES == 64 else "32-byte vectors (AVX2 or narrower)"
    return (f"{isa}: {t.lanes(4)} float32 / {t.lanes(8)} float64 lanes, products in "
            f"{t.TILE_ROWS} x {t.TILE_VECTORS}-vector register tiles (no BLAS)")


def exp(x: np.ndarray) -> np.ndarray:
    """The kernel's exponential of a 1-D float32 or float64 array (for tests and checks)."""
    out = np.array(x, copy=True, order="C")
    kernels()["exp32" if out.dtype == np.float32 else "exp64"](out, out.dtype.type(0.0))
    return out


# --- the call ----------------------------------------------------------------------------

def _own(x: np.ndarray, batch: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (B…|1, A, T, F), each batch axis 1 or full, as (B_own, A, T, F) without its
    broadcast batch axes, and the map from each flat index of the problem's batch B… to
    its row of that array."""
    nb = len(batch)
    own_index = tuple(slice(0, 1) if s == 0 and n > 1 else slice(None)
                      for s, n in zip(x.strides[:nb], x.shape[:nb], strict=True))
    own = x[own_index]
    own_batch = own.shape[:nb]
    flat = own.reshape((math.prod(own_batch), *x.shape[nb:]))        # a copy only if needed
    if not batch:
        return flat, np.zeros(1, dtype=np.int64)
    grids = np.indices(batch).reshape(nb, -1)
    idx = tuple(np.where(np.asarray(own_batch)[:, None] == 1, 0, grids))
    return flat, np.ravel_multi_index(idx, own_batch).astype(np.int64)


def _per_batch(x: np.ndarray | None, batch: tuple[int, ...], fill: int, dtype: Any,
               ) -> np.ndarray:
    """A ``len(B…)``-dimensional integer array (or ``None``: ``fill``) as (prod(B…),)."""
    if x is None:
        return np.full(math.prod(batch), fill, dtype=dtype)
    return np.broadcast_to(np.asarray(x), batch).reshape(-1).astype(dtype)


class _Call:
    """What the kernels take for one call: the arrays without their broadcast batch axes,
    the per-batch maps, lengths, offsets, slopes, the work items and the parameters."""

    def __init__(self, q: Any, k: Any, v: Any, mask: Any, causal_offset: int | None,
                 scale: float, rules: Rules | None) -> None:
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        tq, tk = q.shape[-2], k.shape[-2]
        rules = rules or Rules.from_causal_offset(causal_offset, tq, tk)
        self.rules = rules
        nb = q.ndim - 3
        self.batch = batch = tuple(q.shape[:nb])
        self.n_batch = n_batch = math.prod(batch)
        self.dtype = dtype = q.dtype
        self.tq, self.tk, self.h, self.hkv = tq, tk, q.shape[-3], k.shape[-3]
        self.e, self.ev = q.shape[-1], v.shape[-1]
        self.q4, self.qmap = _own(q, batch)
        self.k4, self.kmap = _own(k, batch)
        self.v4, self.vmap = _own(v, batch)
        #: 0: no mask; 1: a float mask (added); 2: a boolean one (hides keys)
        mask_kind = 0
        if mask is None:
            self.mask4, self.mmap = np.zeros((1, 1, 1, 1), dtype=dtype), np.zeros(n_batch,
                                                                                  np.int64)
        else:
            mask = np.asarray(mask)
            mask_kind = 2 if mask.dtype == np.bool_ else 1
            if mask.dtype == np.bool_:
                mask = np.where(mask, dtype.type(0.0), dtype.type(-np.inf))
            self.mask4, self.mmap = _own(mask.astype(dtype, copy=False), batch)
        self.lengths = np.clip(_per_batch(rules.key_lengths, batch, tk, np.int64), 0, tk)
        # p_i = i + offset + shift·Tk_b; keys p_i - left ..= p_i + right (UNBOUNDED: every key)
        offset, shift, left, right = reach(rules, covering=True)
        self.offsets = position(np.zeros(n_batch, np.int64), offset, shift, self.lengths)
        h = self.h
        if rules.alibi is not None:
            slopes = np.broadcast_to(np.asarray(rules.alibi, dtype=dtype),
                                     (*batch, h)).reshape(n_batch, h)
            self.slopes = np.ascontiguousarray(slopes)
        else:
            self.slopes = np.zeros((1, 1), dtype=dtype)
        g = h // self.hkv
        #: query rows per head in a work item
        self.rows = rows = max(1, (BLOCK_ROWS * 4 // dtype.itemsize) // g)
        self.fparams = np.array([scale, rules.softcap or 1.0, 0.0, 1.0, -np.inf,
                                 rules.dropout_scale if rules.dropout else 1.0], dtype=dtype)
        key0, key1 = key_words(int(rules.dropout_seed)) if rules.dropout else (0, 0)
        # (the meaning of each entry: :mod:`.kernels`)
        self.iparams = np.array([
            int(rules.causal), left, right, mask_kind, int(rules.alibi is not None),
            int(rules.softcap is not None), BLOCK_K, int(rules.dropout),
            threshold(rules.dropout_p) if rules.dropout else 0, key0, key1, h, rows,
        ], dtype=np.int64)

    def query_items(self) -> np.ndarray:
        """(b, hk, q0, q1, k_lo, k_hi) per item, the largest first."""
        items = []
        for b in range(self.n_batch):
            off = int(self.offsets[b])
            for q0 in range(0, self.tq, self.rows):
                q1 = min(q0 + self.rows, self.tq)
                lo, hi = self.rules.key_range(q0, q1, (off, off))
                hi = min(hi, int(self.lengths[b]))
                for hk in range(self.hkv):
                    items.append((b, hk, q0, q1, lo, max(lo, hi)))
        return _largest_first(items)

    def key_items(self) -> np.ndarray:
        """(b, hk, k0, k1, 0, Tq) per block of keys below each batch row's length."""
        block = int(self.iparams[6])
        items = [(b, hk, k0, min(k0 + block, self.tk), 0, self.tq)
                 for b in range(self.n_batch) for hk in range(self.hkv)
                 for k0 in range(0, int(self.lengths[b]), block)]
        return _largest_first(items)

    def run(self, kernel: Any, *args: Any) -> None:
        """``kernel(*args)`` with items handed out one at a time to whichever thread is
        free (static chunks of items sorted largest first would leave one thread with the
        large ones), serialised where the threading layer needs it."""
        import numba

        with _serialised():
            before = numba.set_parallel_chunksize(1)
            try:
                kernel(*args)
            finally:
                numba.set_parallel_chunksize(before)
            if not _layer:
                _layer.append(str(numba.threading_layer()))

    def common(self) -> tuple[Any, ...]:
        return (self.q4, self.k4, self.v4, self.qmap, self.kmap, self.vmap, self.mask4,
                self.mmap, self.lengths, self.offsets, self.slopes)


def _largest_first(items: Sequence[tuple[int, ...]]) -> np.ndarray:
    arr = np.asarray(items, dtype=np.int64).reshape(-1, 6)
    return arr[np.argsort(-(arr[:, 3] - arr[:, 2]) * (arr[:, 5] - arr[:, 4]), kind="stable")]


def attention(q: Any, k: Any, v: Any, /, *, mask: Any, causal_offset: int | None,
              scale: float, xp: Any, rules: Rules | None = None) -> tuple[Any, Any]:
    """The fused kernel on NumPy arrays; see :mod:`polyattn.backends`.

    Every rule of :class:`Rules` is done here, dropout included.
    """
    with np.errstate(all="ignore"):        # e.g. a float mask cast to the compute dtype
        call = _Call(q, k, v, mask, causal_offset, scale, rules)
    n_batch, h, tq = call.n_batch, call.h, call.tq
    out = np.empty((n_batch, h, tq, call.ev), dtype=call.dtype)
    lse = np.empty((n_batch, h, tq), dtype=call.dtype)
    items = call.query_items()
    if items.size:
        call.run(kernels()["forward"], *call.common(), items, call.fparams, call.iparams,
                 out, lse)
    _keep_non_finite_rows(call, out, lse)
    return out.reshape((*call.batch, h, tq, call.ev)), lse.reshape((*call.batch, h, tq))


def _keep_non_finite_rows(call: _Call, out: np.ndarray, lse: np.ndarray) -> None:
    """NaN in the rows whose query holds a NaN or an inf, whatever the kernel made of them:
    inf times keys all negative there makes every score -inf (reported as fully masked:
    0, lse -inf), and soft-capping saturates an infinite score to a finite one; NaN never
    disappears (docs/semantics.rst, "Non-finite inputs"), as on the other paths."""
    lost = ~np.isfinite(call.q4).all(axis=-1)[call.qmap]          # (B, H, Tq)
    if lost.any():
        out[lost] = np.nan
        lse[lost] = np.nan


def backward(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, /, *, mask: Any,
             causal_offset: int | None, scale: float, xp: Any, rules: Rules | None = None,
             grad_lse: Any = None) -> tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv) of :func:`attention`, shaped like ``q``, ``k``, ``v``.

    FlashAttention-2's backward pass in two parallel loops: dQ per query item,
    dK and dV per block of keys (summed over the G query heads of a group), the
    weights recomputed from the scores and the saved ``lse``, ``D = rowsum(dO∘O)``
    (less ``grad_lse``), the products in register tiles as in the forward pass.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.backends.array_api import reference
    >>> from polyattn.backends.numba_cpu import launch as numba_cpu
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> kw = dict(mask=None, causal_offset=0, scale=0.5, xp=np)
    >>> out, lse = numba_cpu.attention(q, k, v, **kw)
    >>> grads = numba_cpu.backward(q, k, v, out, lse, np.ones_like(out), **kw)
    >>> want = reference.backward(q, k, v, out, lse, np.ones_like(out), **kw)
    >>> all(np.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(grads, want))
    True
    """
    with np.errstate(all="ignore"):        # D = rowsum(dO∘O) of non-finite rows, casts
        return _backward_call(q, k, v, out, lse, grad_out, mask, causal_offset, scale,
                              rules, grad_lse)


def _backward_call(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any, mask: Any,
                   causal_offset: int | None, scale: float, rules: Rules | None,
                   grad_lse: Any) -> tuple[Any, Any, Any]:
    """:func:`backward`'s work, under its ``np.errstate``."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    call = _Call(q, k, v, mask, causal_offset, scale, rules)
    n_batch, h, hkv, tq, tk = call.n_batch, call.h, call.hkv, call.tq, call.tk
    dt = call.dtype
    go = np.ascontiguousarray(np.broadcast_to(np.asarray(grad_out, dtype=dt),
                                              (*call.batch, h, tq, call.ev))
                              ).reshape(n_batch, h, tq, call.ev)
    o = np.broadcast_to(np.asarray(out, dtype=dt), (*call.batch, h, tq, call.ev)
                        ).reshape(n_batch, h, tq, call.ev)
    lse3 = np.ascontiguousarray(np.broadcast_to(np.asarray(lse, dtype=dt),
                                                (*call.batch, h, tq))).reshape(n_batch, h, tq)
    dd = np.einsum("bhie,bhie->bhi", go, o)                # D = rowsum(dO ∘ O)
    if grad_lse is not None:
        dd -= np.broadcast_to(np.asarray(grad_lse, dtype=dt),
                              (*call.batch, h, tq)).reshape(n_batch, h, tq)
    dq = np.zeros((n_batch, h, tq, call.e), dtype=dt)
    dk = np.zeros((n_batch, hkv, tk, call.e), dtype=dt)
    dv = np.zeros((n_batch, hkv, tk, call.ev), dtype=dt)
    q_items, k_items = call.query_items(), call.key_items()
    if q_items.size or k_items.size:
        call.run(backward_kernel(), *call.common(), go, lse3, dd, q_items, k_items,
                 call.fparams, call.iparams, dq, dk, dv)
    return (_unbroadcast(dq.reshape((*call.batch, h, tq, call.e)), q.shape),
            _unbroadcast(dk.reshape((*call.batch, hkv, tk, call.e)), k.shape),
            _unbroadcast(dv.reshape((*call.batch, hkv, tk, call.ev)), v.shape))


def _unbroadcast(full: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``full`` summed over the batch axes where the input had size 1."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, full.shape, strict=True))
                 if n == 1 and m != 1)
    return full.sum(axis=axes, keepdims=True) if axes else full
