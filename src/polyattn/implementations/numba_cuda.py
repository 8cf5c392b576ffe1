"""Fused attention on CUDA GPUs: one Numba kernel, online softmax, no T×T matrix.

Algorithm
---------
The kernel computes ``out = softmax(scale · q kᵀ + mask) v`` and the row
log-sum-exp ``lse`` in one pass over the keys (the online softmax of
FlashAttention). One launch covers every (batch, head) pair:

* a thread block owns ``BLOCK_Q`` query rows of one (batch, head) pair, one
  thread per row; the grid is flat, heaviest causal tiles first;
* the block streams the keys in tiles of ``block_k`` rows: the threads load a
  K tile and a V tile together into shared memory, then every thread scores
  its query row against the tile;
* each thread keeps the running maximum ``m``, the running sum ``l`` and the
  accumulator ``acc`` (one value per value feature) in registers, in float32
  for float32 inputs and float64 for float64 inputs; a tile updates them as

      m_new = max(m, max_j s_j)
      l     = l · exp(m − m_new) + Σ_j exp(s_j − m_new)
      acc   = acc · exp(m − m_new) + Σ_j exp(s_j − m_new) v_j

* at the end ``out = acc / l`` and ``lse = m + log(l)``; a row that saw no
  visible key (``l = 0``) writes ``out = 0`` and ``lse = -inf``.

Scores never leave the thread that computed them: the T×T matrix is never
written, and memory use is that of q, k, v and the outputs.

Specialisation
--------------
A kernel factory builds one kernel per (dtype, head-size bucket, mask kind):
the per-thread query row and accumulator are local arrays whose size is a
compile-time constant, the bucket ``HEAD_DIM_BUCKETS`` entry that holds
``max(E, Ev)``. Shared tiles and the query row are zero-padded to the bucket,
so the feature loops have constant trip counts the compiler can unroll.
Causality is not a specialisation: a key ``j`` is visible to query ``i`` iff
``j <= i + causal_offset``, and a non-causal call passes ``causal_offset = Tk``.
Key tiles past the last visible key of a block are never loaded.

Masks are read in place through their strides: a size-1 axis is indexed at 0,
and the leading batch axes, which may broadcast in any pattern, are reached
through a small table ``mask_batch`` (batch index -> mask batch index), so a
broadcast mask is never materialised.

Arrays
------
Any array exposing ``__cuda_array_interface__`` (CuPy arrays, torch CUDA
tensors) is used in place, strides included; outputs are allocated by the
input library and returned as its arrays. The kernel runs on the library's
current stream. Leading batch axes are merged with ``reshape`` (a copy only
when their strides cannot be merged). With ``NUMBA_ENABLE_CUDASIM=1``, NumPy
arrays run on Numba's CPU simulator (slow; for testing the kernel logic).

Limits and costs
----------------
* Head sizes up to ``MAX_HEAD_DIM`` (256); larger ones raise ``ValueError``
  (the ``chunked`` implementation has no limit).
* One thread per query row means one shared-memory load per multiply-add and
  no tensor cores. ptxas (sm_90) keeps ``q_row`` and ``acc`` in registers for
  float32 head sizes up to 64 (about 220 registers, no spills); the 128 and
  256 buckets, and float64 from 64 up, keep part of them in local memory.
* The K and V tiles use at most ``SHARED_MEMORY_BYTES`` of static shared
  memory (Numba's static limit is 48 KiB).
* Leading batch axes whose strides cannot be merged, and a mask whose batch
  axes cannot be merged, are copied once (never broadcast).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

Array = Any

# Tile sizes and limits.
BLOCK_Q = 64  # query rows per thread block (one thread per row)
MAX_BLOCK_K = 64  # most key rows per shared-memory tile
SHARED_MEMORY_BYTES = 32 * 1024  # budget for one K tile plus one V tile
HEAD_DIM_BUCKETS = (8, 16, 32, 64, 128, 256)  # compile-time sizes of q row and acc
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
MAX_GRID_BLOCKS = 2**31 - 1  # one flat grid of B·H·ceil(Tq / BLOCK_Q) blocks
MASK_KINDS = ("none", "bool", "float")
DTYPES = ("float32", "float64")


# --------------------------------------------------------------------------- #
# Environment
# --------------------------------------------------------------------------- #

def simulator_enabled() -> bool:
    """Whether Numba's CUDA simulator is switched on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def _numba_cuda_installed() -> bool:
    return importlib.util.find_spec("numba_cuda") is not None


# ``numba.cuda``, bound on first use. The kernels name it as a module global:
# the CUDA simulator swaps module globals that refer to it for its own.
cuda: Any = None


def _cuda() -> Any:
    """The ``numba.cuda`` module; ImportError naming the package when it is missing."""
    global cuda
    if cuda is None:
        if not _numba_cuda_installed():
            raise ImportError(
                "the numba_cuda implementation needs the numba-cuda package "
                "(pip install 'numba-cuda[cu13]' or 'numba-cuda[cu12]')"
            )
        from numba import cuda as numba_cuda_module

        cuda = numba_cuda_module
    return cuda


def _library(x: Array) -> str:
    """'numpy', 'cupy', 'torch' or the module name of another array type."""
    return type(x).__module__.split(".")[0]


def _is_cuda_array(x: Array) -> bool:
    if _library(x) == "torch":
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def availability(xp: Any = None, arrays: Sequence[Array] = ()) -> tuple[bool, str]:
    """Whether the kernel can run on ``arrays``, and why (for ``explain``).

    Examples
    --------
    >>> usable, reason = availability()
    >>> isinstance(usable, bool) and isinstance(reason, str)
    True
    """
    if not _numba_cuda_installed():
        return False, "numba-cuda is not installed (pip install 'numba-cuda[cu13]')"
    libraries = sorted({_library(a) for a in arrays})
    if simulator_enabled():
        if all(lib == "numpy" for lib in libraries):
            return True, ("the Numba CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1): "
                          "the kernel runs on the CPU, slowly; for testing")
        return False, (f"the Numba CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1), "
                       f"so {', '.join(libraries)} CUDA arrays cannot be used")
    not_cuda = [type(a).__name__ for a in arrays if not _is_cuda_array(a)]
    if not_cuda:
        return False, (f"inputs are not CUDA arrays ({', '.join(sorted(set(not_cuda)))}); "
                       "the kernel needs arrays with __cuda_array_interface__")
    try:
        if not _cuda().is_available():
            return False, "no CUDA GPU or driver found by Numba"
    except Exception as exc:  # driver errors surface as many types
        return False, f"CUDA could not be initialised: {exc}"
    for a in arrays:
        if a.ndim >= 1 and a.shape[-1] > MAX_HEAD_DIM:
            return False, (f"head size {a.shape[-1]} exceeds the kernel's maximum "
                           f"{MAX_HEAD_DIM}")
    return True, "CUDA arrays, a CUDA GPU and numba-cuda"


# --------------------------------------------------------------------------- #
# Kernel factory
# --------------------------------------------------------------------------- #

def head_bucket(e: int, ev: int) -> int:
    """The smallest entry of ``HEAD_DIM_BUCKETS`` that holds both head sizes."""
    size = max(e, ev, 1)
    for bucket in HEAD_DIM_BUCKETS:
        if size <= bucket:
            return bucket
    raise ValueError(
        f"the numba_cuda kernel supports head sizes up to {MAX_HEAD_DIM}, got query/key "
        f"features E = {e} and value features Ev = {ev}; use implementation=\"chunked\""
    )


def default_block_k(dtype: str, bucket: int) -> int:
    """Key rows per tile: as many as fit ``SHARED_MEMORY_BYTES`` (K and V), at most 64."""
    itemsize = np.dtype(dtype).itemsize
    return max(1, min(MAX_BLOCK_K, SHARED_MEMORY_BYTES // (2 * bucket * itemsize)))


def _signature(dtype: str, mask_kind: str) -> Any:
    """Numba signature of the kernel: strided inputs, contiguous outputs."""
    from numba import types

    t = getattr(types, dtype)
    strided = types.Array(t, 4, "A")
    mask_t = types.Array(types.boolean if mask_kind == "bool" else t, 4, "A")
    return types.void(
        strided, strided, strided,  # q, k, v
        mask_t, types.Array(types.int64, 1, "A"),  # mask, mask_batch
        types.Array(t, 4, "C"), types.Array(t, 3, "C"),  # out, lse
        t, types.int64,  # scale, causal_offset
    )


@functools.cache
def make_kernel_function(dtype: str, bucket: int, mask_kind: str,
                         block_q: int = BLOCK_Q, block_k: int | None = None) -> Any:
    """The Python kernel function for one specialisation (not yet compiled)."""
    _cuda()
    from numba import types

    if block_k is None:
        block_k = default_block_k(dtype, bucket)
    acc_t = getattr(types, dtype)
    np_t = np.dtype(dtype).type
    ZERO, ONE, NEG_INF = np_t(0.0), np_t(1.0), np_t(-np.inf)
    HEAD, BQ, BK = bucket, block_q, block_k
    BOOL_MASK, FLOAT_MASK = mask_kind == "bool", mask_kind == "float"

    def attention_kernel(q, k, v, mask, mask_batch, out, lse, scale, causal_offset):
        """Out and lse for BQ query rows of one (batch, head) pair."""
        n_batch, n_heads, tq, e = q.shape
        tk = k.shape[2]
        ev = v.shape[3]
        group = n_heads // k.shape[1]
        n_pairs = n_batch * n_heads
        n_qtiles = (tq + BQ - 1) // BQ
        pair = cuda.blockIdx.x % n_pairs
        qt = n_qtiles - 1 - cuda.blockIdx.x // n_pairs  # largest causal work first
        b = pair // n_heads
        h = pair % n_heads
        hk = h // group
        tid = cuda.threadIdx.x
        i = qt * BQ + tid
        row_ok = i < tq

        # Where this thread reads the mask: size-1 axes broadcast at index 0.
        mb = 0
        mh = 0
        mi = 0
        mj_step = 0
        if BOOL_MASK or FLOAT_MASK:
            mb = mask_batch[b]
            if mask.shape[1] > 1:
                mh = h
            if mask.shape[2] > 1 and row_ok:
                mi = i
            if mask.shape[3] > 1:
                mj_step = 1

        q_row = cuda.local.array(HEAD, acc_t)
        acc = cuda.local.array(HEAD, acc_t)
        s = cuda.local.array(BK, acc_t)
        k_tile = cuda.shared.array((BK, HEAD), acc_t)
        v_tile = cuda.shared.array((BK, HEAD), acc_t)

        # Load the scaled query row (zero-padded to HEAD) and clear the state.
        # Feature loops run to the constant HEAD so q_row and acc can live in
        # registers once the loops are unrolled.
        for d in range(HEAD):
            x = ZERO
            if row_ok and d < e:
                x = q[b, h, i, d] * scale
            q_row[d] = x
            acc[d] = ZERO
        m = NEG_INF
        l = ZERO

        # Keys past the last one visible to the block's last row are skipped.
        last_row = min(qt * BQ + BQ, tq) - 1
        key_end = min(tk, last_row + causal_offset + 1)
        n_ktiles = max(0, (key_end + BK - 1) // BK)

        for kt in range(n_ktiles):
            j0 = kt * BK

            # Load one K tile and one V tile into shared memory, zero-padded.
            for idx in range(tid, BK * HEAD, BQ):
                jj = idx // HEAD
                d = idx % HEAD
                j = j0 + jj
                k_val = ZERO
                v_val = ZERO
                if j < tk:
                    if d < e:
                        k_val = k[b, hk, j, d]
                    if d < ev:
                        v_val = v[b, hk, j, d]
                k_tile[jj, d] = k_val
                v_tile[jj, d] = v_val
            cuda.syncthreads()

            if row_ok:
                # Scores of this row against the tile, masked keys at -inf.
                m_tile = NEG_INF
                for jj in range(BK):
                    j = j0 + jj
                    x = ZERO
                    for d in range(HEAD):
                        x += q_row[d] * k_tile[jj, d]
                    if j >= tk or j > i + causal_offset:
                        x = NEG_INF
                    elif BOOL_MASK:
                        if not mask[mb, mh, mi, j * mj_step]:
                            x = NEG_INF
                    elif FLOAT_MASK:
                        x += mask[mb, mh, mi, j * mj_step]
                    s[jj] = x
                    if x > m_tile or x != x:  # a larger score, or NaN (which then sticks)
                        m_tile = x

                # Online softmax: rescale l and acc to the new maximum, add the tile.
                m_new = m
                if m_tile > m or m_tile != m_tile:
                    m_new = m_tile
                if m_new != NEG_INF:
                    alpha = math.exp(m - m_new)
                    l *= alpha
                    for d in range(HEAD):
                        acc[d] *= alpha
                    for jj in range(BK):
                        p = math.exp(s[jj] - m_new)
                        l += p
                        for d in range(HEAD):
                            acc[d] += p * v_tile[jj, d]
                    m = m_new
            cuda.syncthreads()

        # Normalise and write; a row with no visible key gives 0 and -inf
        # (a NaN in l, from a NaN input, propagates to out and lse).
        if row_ok:
            inv_l = ZERO
            lse_i = NEG_INF
            if l != ZERO:
                inv_l = ONE / l
                lse_i = m + math.log(l)
            for d in range(HEAD):
                if d < ev:
                    out[b, h, i, d] = acc[d] * inv_l
            lse[b, h, i] = lse_i

    name = f"attention_{dtype}_head{bucket}_{mask_kind}_q{block_q}_k{block_k}"
    attention_kernel.__name__ = attention_kernel.__qualname__ = name
    return attention_kernel


@functools.cache
def compiled_kernel(dtype: str, bucket: int, mask_kind: str,
                    block_q: int = BLOCK_Q, block_k: int | None = None) -> Any:
    """The kernel for one specialisation, compiled on first use and cached.

    It is compiled for exactly one signature, so a launch skips type dispatch:
    the launcher checks dtypes, and allocates ``out`` and ``lse`` contiguous.
    """
    fn = make_kernel_function(dtype, bucket, mask_kind, block_q, block_k)
    return _cuda().jit(_signature(dtype, mask_kind))(fn)


def specializations() -> Iterator[tuple[Any, Any]]:
    """Every (Python kernel function, Numba signature) pair the launcher may compile."""
    for dtype in DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            for mask_kind in MASK_KINDS:
                yield make_kernel_function(dtype, bucket, mask_kind), _signature(dtype, mask_kind)


# --------------------------------------------------------------------------- #
# Launcher
# --------------------------------------------------------------------------- #

def _mask_layout(mask: Array, batch: tuple[int, ...], full: tuple[int, int, int],
                 xp: Any) -> tuple[Array, np.ndarray]:
    """The mask as (Bm, Hm, Tqm, Tkm) and the table batch index -> mask batch index."""
    mbatch = tuple(mask.shape[:-3])
    expected = (*batch, *full)
    if mask.ndim != len(expected) or any(
        m not in (1, f) for m, f in zip(mask.shape, expected, strict=True)
    ):
        raise ValueError(
            f"`mask` of shape {tuple(mask.shape)} does not broadcast to {expected} "
            "axis by axis (each axis must be 1 or the full size)"
        )
    n_mask_batch = math.prod(mbatch)
    table = np.broadcast_to(np.arange(n_mask_batch, dtype=np.int64).reshape(mbatch), batch)
    mask4 = xp.reshape(mask, (n_mask_batch, *mask.shape[-3:]))  # (Bm, Hm, Tqm, Tkm)
    return mask4, np.ascontiguousarray(table).reshape(-1)


class _Device:
    """Moves arrays between the input library and Numba, and picks stream and GPU."""

    def __init__(self, like: Array) -> None:
        self.cuda = _cuda()
        self.lib = _library(like)
        self.like = like
        self.simulated = self.lib == "numpy"
        if self.simulated and not simulator_enabled():
            raise TypeError(
                "implementation='numba_cuda' needs CUDA arrays (CuPy arrays or torch CUDA "
                f"tensors); got {type(like).__module__}.{type(like).__name__} on the CPU. "
                "Use implementation='reference' or 'chunked' for CPU arrays, or set "
                "NUMBA_ENABLE_CUDASIM=1 to run the kernel on the Numba CUDA simulator"
            )
        if not self.simulated and simulator_enabled():
            raise RuntimeError(
                "the Numba CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1): it runs "
                f"the kernel on NumPy arrays only, not on {self.lib} CUDA arrays"
            )
        if not self.simulated and not _is_cuda_array(like):
            raise TypeError(
                "implementation='numba_cuda' needs CUDA arrays exposing "
                f"__cuda_array_interface__; got {type(like).__name__}"
            )

    def device_id(self) -> int | None:
        if self.lib == "cupy":
            return int(self.like.device.id)
        if self.lib == "torch":
            index = self.like.device.index
            if index is None:
                import torch

                index = torch.cuda.current_device()
            return int(index)
        return None

    def stream(self) -> Any:
        """Numba's view of the input library's current stream."""
        cuda = self.cuda
        ptr = 0
        if self.lib == "cupy":
            import cupy

            ptr = cupy.cuda.get_current_stream().ptr
        elif self.lib == "torch":
            import torch

            ptr = torch.cuda.current_stream(self.like.device).cuda_stream
        return cuda.external_stream(ptr) if ptr else cuda.default_stream()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Array:
        """An uninitialised output array of the input library on the input device."""
        if self.lib == "cupy":
            import cupy

            with self.like.device:
                return cupy.empty(shape, dtype=dtype)
        if self.lib == "torch":
            import torch

            return torch.empty(shape, dtype=dtype, device=self.like.device)
        if self.simulated:
            return np.empty(shape, dtype=dtype)
        return self.cuda.device_array(shape, dtype=np.dtype(str(dtype)))

    def from_numpy(self, a: np.ndarray) -> Array:
        """A small host table as an array of the input library on the input device."""
        if self.lib == "cupy":
            import cupy

            with self.like.device:
                return cupy.asarray(a)
        if self.lib == "torch":
            import torch

            return torch.as_tensor(a, device=self.like.device)
        if self.simulated:
            return a
        return self.cuda.to_device(a)

    def view(self, x: Array) -> Any:
        """A Numba device array over ``x`` without copying (simulator: a contiguous copy)."""
        if self.simulated:
            return self.cuda.to_device(np.ascontiguousarray(x))
        if self.lib == "torch":
            x = x.detach()
        return self.cuda.as_cuda_array(x, sync=False)


def _time_major(x: Array) -> bool:
    """Whether a (…, H, T, E) array steps through T faster than H in memory: a view of
    a (…, T, H, E) array."""
    if x.ndim < 3 or x.shape[-3] < 2 or x.shape[-2] < 2:
        return False
    strides = x.stride() if callable(getattr(x, "stride", None)) else x.strides
    return bool(strides[-3] < strides[-2])


def _dtype_name(x: Array) -> str:
    name = str(x.dtype).rsplit(".", 1)[-1]
    if name not in DTYPES:
        raise TypeError(
            f"the numba_cuda kernel computes in float32 or float64, got {name} "
            "(the caller casts float16 to float32)"
        )
    return name


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None,
              causal_offset: int | None, scale: float, xp: Any,
              block_q: int | None = None, block_k: int | None = None) -> tuple[Array, Array]:
    """Fused attention on a CUDA GPU: ``(out, lse)`` in one kernel launch.

    See the module docstring for the algorithm and :mod:`polyattn.implementations`
    for the shared contract. ``block_q`` and ``block_k`` override the tile sizes
    (query rows per block, key rows per tile); they exist for tests and tuning.

    Raises
    ------
    ValueError
        A head size above ``MAX_HEAD_DIM`` or a mask that does not broadcast.
    TypeError
        CPU arrays without the simulator, or a dtype other than float32/float64.
    ImportError
        numba-cuda is not installed.
    """
    *batch, n_heads, tq, e = q.shape
    *_, n_kv_heads, tk, ev = v.shape
    batch = tuple(batch)
    bucket = head_bucket(e, ev)
    dtype = _dtype_name(q)
    for name, x in (("key", k), ("value", v)):
        if _dtype_name(x) != dtype:
            raise TypeError(f"`{name}` has dtype {x.dtype} but `query` has {q.dtype}")
    dev = _Device(q)
    cuda = dev.cuda
    n_batch = math.prod(batch)

    if _time_major(q):
        # a (B…, Tq, H, E) array seen as (B…, H, Tq, E) (layout="BTHE"): the output is
        # laid out the same way, so that the caller's view back is row-major
        out = dev.empty((n_batch, tq, n_heads, ev), q.dtype)  # (B, Tq, H, Ev)
        out = xp.permute_dims(out, (0, 2, 1, 3))  # (B, H, Tq, Ev), a view
    else:
        out = dev.empty((n_batch, n_heads, tq, ev), q.dtype)  # (B, H, Tq, Ev)
    lse = dev.empty((n_batch, n_heads, tq), q.dtype)  # (B, H, Tq)
    if n_batch * n_heads * tq > 0:
        q4 = xp.reshape(q, (n_batch, n_heads, tq, e))  # (B, H, Tq, E)
        k4 = xp.reshape(k, (n_batch, n_kv_heads, tk, e))  # (B, Hkv, Tk, E)
        v4 = xp.reshape(v, (n_batch, n_kv_heads, tk, ev))  # (B, Hkv, Tk, Ev)
        if mask is None:
            mask_kind = "none"
            mask4 = xp.reshape(q, (n_batch, n_heads, tq, e))[:1, :1, :1, :1]  # never read
            table = np.zeros(1, dtype=np.int64)
        else:
            mask_name = str(mask.dtype).rsplit(".", 1)[-1]
            if mask_name == "bool":
                mask_kind = "bool"
            elif mask_name == dtype:
                mask_kind = "float"
            else:
                raise TypeError(f"`mask` must be bool or {dtype}, got {mask.dtype}")
            mask4, table = _mask_layout(mask, batch, (n_heads, tq, tk), xp)
        # Causality as a visibility window; non-causal = every key visible.
        offset = tk if causal_offset is None else max(-tq, min(int(causal_offset), tk))

        bq = BLOCK_Q if block_q is None else int(block_q)
        kernel = compiled_kernel(dtype, bucket, mask_kind, bq,
                                 None if block_k is None else int(block_k))
        n_blocks = n_batch * n_heads * ((tq + bq - 1) // bq)
        if n_blocks > MAX_GRID_BLOCKS:
            raise ValueError(
                f"B·H·ceil(Tq/{bq}) = {n_blocks} thread blocks exceed the CUDA grid limit "
                f"{MAX_GRID_BLOCKS} (query {tuple(q.shape)}); split the batch"
            )
        args = [dev.view(a) for a in (q4, k4, v4, mask4, dev.from_numpy(table))]
        out_d, lse_d = dev.view(out), dev.view(lse)
        np_t = np.dtype(dtype).type
        device_id = dev.device_id()
        with warnings.catch_warnings():
            # Small grids trigger Numba's occupancy warning; the grid is the problem's.
            warnings.simplefilter("ignore", category=_performance_warning())
            if device_id is None:
                kernel[n_blocks, bq, dev.stream()](*args, out_d, lse_d, np_t(scale), offset)
            else:
                with cuda.gpus[device_id]:
                    kernel[n_blocks, bq, dev.stream()](*args, out_d, lse_d, np_t(scale),
                                                       offset)
        if dev.simulated:
            out, lse = out_d.copy_to_host(), lse_d.copy_to_host()
    out = xp.reshape(out, (*batch, n_heads, tq, ev))  # (B…, H, Tq, Ev)
    lse = xp.reshape(lse, (*batch, n_heads, tq))  # (B…, H, Tq)
    return out, lse


def _performance_warning() -> type[Warning]:
    try:
        from numba.core.errors import NumbaPerformanceWarning
    except ImportError:  # pragma: no cover
        return RuntimeWarning
    return NumbaPerformanceWarning
