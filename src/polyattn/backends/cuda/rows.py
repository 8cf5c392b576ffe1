"""Fused attention on CUDA GPUs: one Numba kernel, online softmax, no T×T matrix.

Algorithm
---------
The kernel computes ``out = softmax(scores) v`` and the row log-sum-exp
``lse`` in one pass over the keys (the online softmax of FlashAttention).
One launch covers every (batch, head) pair:

* a thread block owns ``block_q`` query rows of one (batch, head) pair, one
  thread per row; the grid is flat, heaviest causal tiles first;
* the block streams the keys in tiles of ``block_k`` rows: the threads load a
  K tile and a V tile together into shared memory, then score their query
  rows against the tile;
* each thread keeps the running maximum ``m``, the running sum ``l`` and the
  accumulator ``acc`` (one value per value feature) in registers, in float32
  for float32 inputs and float64 for float64 inputs; a tile updates them as

      m_new = max(m, max_j s_j)
      l     = l · exp(m − m_new) + Σ_j exp(s_j − m_new)
      acc   = acc · exp(m − m_new) + Σ_j exp(s_j − m_new) v_j

* at the end ``out = acc / l`` and ``lse = m + log(l)``; a row that saw no
  visible key (``l = 0``) writes ``out = 0`` and ``lse = -inf``.

Scores never leave the thread that computed them: the T×T matrix is never
written, and no mask is built, on the host or on the device.

Scores and visibility (DESIGN §4.1)
-----------------------------------
Query row ``i`` of batch row ``b`` has position ``p_i = i + offset`` (or
``i - Tq + key_lengths[b]`` when positions follow the key lengths); key
``j`` is visible iff ``j < key_lengths[b]`` and
``p_i - left <= j <= p_i + right``, where causality and the window are folded
into ``left`` and ``right`` (an unbounded side is a large sentinel). A score
is ``s = scale·q·k`` → ``softcap·tanh(s/softcap)`` → ``- slope_h·|p_i - j|``
→ ``+ attn_mask`` (or ``-inf`` where a boolean mask is False) → ``-inf``
where the key is invisible.

Dropout (DESIGN §4.1) happens in the same pass, with no mask in memory: the
weight of key ``j`` for row ``i`` of head ``h`` and batch row ``b`` has the
flat index ``n = ((b·H + h)·Tq + i)·Tk + j``, and is kept iff the first word
of Philox4x32-10 for the counter ``(n mod 2³², n div 2³², 0, 0)`` under the
seed's key (:func:`philox_function`, the cipher of :mod:`._dropout`) is at
least ``threshold(p)``. ``l`` and ``lse`` take the undropped weights, ``acc``
the kept ones times ``1/(1 - p)``; lanes and splits merge as before. The
threshold is a run-time argument (0: no dropout, no cipher evaluated).

Work follows the visible area: each block computes, from its rows' positions
and its batch row's key length, the keys ``[lo, hi)`` any of its rows can see,
and loads and scores only the key tiles that cover them. Keys outside
``[lo, hi)`` are never read (loads past them are zero-filled), so whatever a
preallocated cache holds past ``key_lengths`` cannot reach the output.

Decoding: lanes and split-K
---------------------------
With few query rows (decoding: ``Tq <= DECODE_MAX_TQ``) one thread per row
would leave most of a block idle. There a block owns the smallest power of
two ``rows ≥ Tq`` rows, and ``lanes`` threads per row (``rows · lanes <=
block_q``, ``lanes <= block_k``, a power of two) share its keys: lane ``c``
takes keys ``c, c + lanes, …`` of every tile, with its own ``m``, ``l`` and
``acc``; at the end the lanes are merged by log-sum-exp in a tree through
shared memory. The block has ``rows · lanes`` threads; only rows past Tq sit idle.
The K and V tiles carry one padding column, so that lanes reading different
keys hit different banks.

When the grid would still be small (few pairs, long keys), the keys
``[lo, hi)`` of each block are also split across ``num_splits`` blocks
(flash-decoding): each writes its normalised partial ``out`` and ``lse`` to
scratch arrays in the compute dtype, and a second small kernel merges the
splits by log-sum-exp (``exp(lse_s - max)`` weights). The plan is chosen
from shapes alone in :func:`launch_plan`.

Other kernels behind this module
--------------------------------
float16 and bfloat16 calls (and float32 with ``POLYATTN_CUDA_FLOAT32=3xtf32``)
run the tensor-core kernel of :mod:`.numba_cuda_tc` (``mma.sync``, FlashAttention-2
work split) wherever it takes them; other float32 and float64 calls run the
register-tiled kernel of :mod:`.numba_cuda_tiled` unless ``POLYATTN_CUDA_KERNEL=rows``
keeps them here. Decoding shapes stay here. :func:`attention` picks (its ``arithmetic`` argument and
:func:`kernel_choice`); ``explain()`` names the arithmetic and the kernel.

Backward
--------
:func:`backward` gives ``(dq, dk, dv)`` from the forward's ``out`` and
``lse`` in two more kernels: those of :mod:`.numba_cuda_tiled_backward`
(register patches, the FlashAttention-2 split: a dQ pass over query tiles, a
dK/dV pass over key tiles) where the forward is register-tiled, else those
of :mod:`.numba_cuda_backward`: one thread per query row for ``dq``, one
thread per key row for ``dk`` and ``dv``. Both sum ``dk`` and ``dv`` over the
query heads of a group without atomics and recompute every score and
dropout decision, with the same rules and specialisations.

Specialisation
--------------
A kernel factory builds one kernel per (dtype, head-size bucket, mask kind,
score modifiers): the per-thread query row and accumulator are local arrays
whose size is a compile-time constant, the bucket ``HEAD_DIM_BUCKETS`` entry
that holds ``max(E, Ev)``; shared tiles and the query row are zero-padded to
it, so the feature loops have constant trip counts the compiler can unroll.
``mods`` kernels carry soft-capping and ALiBi (a zero slope when only
soft-capping is asked for, a zero softcap meaning none); plain kernels have
neither in their inner loop. Causality, windows, key lengths, positions,
dropout, the lane layout and the number of splits are run-time values, not
specialisations. The merge kernel has one specialisation per dtype.

Masks are read in place through their strides: a size-1 axis is indexed at 0,
and the leading batch axes, which may broadcast in any pattern, are reached
through a small table ``mask_batch`` (batch index -> mask batch index), so a
broadcast mask is never materialised. Key lengths (B,) and ALiBi slopes
(B|1, H|1) are small device arrays.

Arrays
------
Any array exposing ``__cuda_array_interface__`` (CuPy arrays, torch CUDA
tensors) is used in place, strides included; outputs are allocated by the
input library and returned as its arrays. The kernels run on the library's
current stream. Leading batch axes are merged with ``reshape`` (a copy only
when their strides cannot be merged). With ``NUMBA_ENABLE_CUDASIM=1``, NumPy
arrays run on Numba's CPU simulator (slow; for testing the kernel logic).

Limits and costs
----------------
* Head sizes up to ``MAX_HEAD_DIM`` (256); larger ones raise ``ValueError``
  (the ``chunked`` implementation has no limit).
* One thread per query row (per key lane when decoding) means one
  shared-memory load per multiply-add and no tensor cores. ptxas (sm_90)
  keeps ``q_row`` and ``acc`` in registers for float32 head sizes up to 64;
  the 128 and 256 buckets, and float64 from 64 up, keep part of them in
  local memory.
* The K and V tiles use about ``SHARED_MEMORY_BYTES`` of static shared
  memory (Numba's static limit is 48 KiB).
* Leading batch axes whose strides cannot be merged, and a mask whose batch
  axes cannot be merged, are copied once (never broadcast). Split-K scratch
  holds ``num_splits · B·H·Tq·(Ev + 1)`` values.
* Dropout costs one Philox evaluation (ten rounds of two 32×32-bit
  products, done as 64-bit products) per visible weight, a few registers and
  no spills (sm_90, float32, head size 64: 220 registers instead of 217).
* This module's backward kernels (decoding shapes, ``POLYATTN_CUDA_KERNEL=rows``)
  are the simple version: at head size 64 (float32, sm_90) they use 255
  registers and spill, and the dK/dV kernel rereads Q and dO once per key
  tile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from polyattn.rules import dropout as _dropout
from polyattn.rules.online import non_finite_rows
from polyattn.rules.visibility import Rules

Array = Any

# Tile sizes and limits.
BLOCK_Q = 64  # threads per block: query rows (one thread each), or rows × key lanes
MAX_BLOCK_K = 64  # most key rows per shared-memory tile
SHARED_MEMORY_BYTES = 32 * 1024  # budget for one K tile plus one V tile (before padding)
HEAD_DIM_BUCKETS = (8, 16, 32, 64, 128, 256)  # compile-time sizes of q row and acc
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
MAX_GRID_BLOCKS = 2**31 - 1  # one flat grid of B·H·ceil(Tq / rows)·splits blocks
MASK_KINDS = ("none", "bool", "float")
DTYPES = ("float32", "float64")
# Decoding and split-K.
DECODE_MAX_TQ = 16  # up to this many query rows, threads of a row share its keys
TARGET_BLOCKS = 264  # split keys until the grid has about this many blocks (2 per SM)
SPLIT_MIN_KEYS = 256  # fewest keys per split
MAX_SPLITS = 64
MERGE_THREADS = 128  # threads per block of the split-merge kernel
# Positions and reaches are int64; an unbounded window side is this far.
UNBOUNDED = 2**40


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
    too_large = [a.shape[-1] for a in arrays if a.ndim >= 1 and a.shape[-1] > MAX_HEAD_DIM]
    if simulator_enabled():
        if too_large:
            return False, (f"head size {too_large[0]} exceeds the kernel's maximum "
                           f"{MAX_HEAD_DIM}")
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


#: ``POLYATTN_CUDA_KERNEL``: which exact kernel runs float32/float64 calls.
KERNEL_VARIABLE = "POLYATTN_CUDA_KERNEL"
KERNEL_CHOICES = ("rows", "tiled")


def kernel_choice() -> str:
    """``POLYATTN_CUDA_KERNEL``: ``"tiled"`` (:mod:`.numba_cuda_tiled`, the default) or
    ``"rows"`` (one thread per query row, for every shape); ValueError naming the
    variable otherwise. Decoding shapes take the one-thread-per-row kernel either way.

    Examples
    --------
    >>> kernel_choice() in KERNEL_CHOICES
    True
    """
    value = os.environ.get(KERNEL_VARIABLE, "tiled").strip().lower() or "tiled"
    if value not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_VARIABLE}={os.environ[KERNEL_VARIABLE]!r}: expected one "
                         f"of {', '.join(KERNEL_CHOICES)}")
    return value


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


@functools.cache
def philox_function() -> Any:
    """The device function ``keep_word(n, key0, key1)``: the first output word x0 of
    Philox4x32-10 for the counter ``(n mod 2³², n div 2³², 0, 0)`` (DESIGN §4.1).

    ``n`` is a weight's flat index in (B, H, Tq, Tk) (int64), ``key0``, ``key1``
    the words of :func:`._dropout.key_words` (uint64 holding 32 bits). Words are
    uint64 holding 32-bit values: a 32 × 32-bit product fits, and its high and
    low words are a shift and a mask. A weight is kept iff the word is at least
    :func:`._dropout.threshold` of ``p``.
    """
    _cuda()
    u64 = np.uint64
    m0, m1, w0, w1 = u64(_dropout.M0), u64(_dropout.M1), u64(_dropout.W0), u64(_dropout.W1)
    mask32, shift32, zero = u64(_dropout.MASK32), u64(32), u64(0)
    rounds = _dropout.ROUNDS

    def keep_word(n, key0, key1):
        """x0 of Philox4x32-10((n mod 2³², n div 2³², 0, 0); (key0, key1))."""
        counter = u64(n)
        c0 = counter & mask32
        c1 = counter >> shift32
        c2 = zero
        c3 = zero
        k0 = key0
        k1 = key1
        for _ in range(rounds):
            p0 = c0 * m0
            p1 = c2 * m1
            c0, c1, c2, c3 = ((p1 >> shift32) ^ c1 ^ k0, p1 & mask32,
                              (p0 >> shift32) ^ c3 ^ k1, p0 & mask32)
            k0 = (k0 + w0) & mask32
            k1 = (k1 + w1) & mask32
        return c0

    if simulator_enabled():
        return keep_word  # the simulator runs device code as Python
    from numba.cuda.extending import intrinsic

    # An intrinsic compiled into each calling kernel for the kernel's target: a
    # ``cuda.jit(device=True)`` function would ask a GPU for its architecture,
    # so kernels calling it could not be compiled to PTX without one.
    @intrinsic
    def keep_word_intrinsic(typingctx: Any, n: Any, key0: Any, key1: Any) -> Any:
        from numba import types

        signature = types.uint64(n, key0, key1)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return context.compile_internal(builder, keep_word, sig, args)

        return signature, codegen

    return keep_word_intrinsic


def dropout_arguments(rules: Rules | None, dtype: str) -> tuple[Any, Any, Any, Any]:
    """The kernels' dropout arguments: ``1/(1-p)`` in ``dtype``, and the threshold and
    the two Philox key words as uint64 (threshold 0: no dropout)."""
    np_t = np.dtype(dtype).type
    if rules is None or not rules.dropout:
        return np_t(1.0), np.uint64(0), np.uint64(0), np.uint64(0)
    key0, key1 = _dropout.key_words(rules.dropout_seed)
    return (np_t(rules.dropout_scale), np.uint64(_dropout.threshold(rules.dropout_p)),
            np.uint64(key0), np.uint64(key1))


def _signature(dtype: str, mask_kind: str) -> Any:
    """Numba signature of the attention kernel: strided inputs and outputs, C scratch."""
    from numba import types

    t = getattr(types, dtype)
    strided = types.Array(t, 4, "A")
    mask_t = types.Array(types.boolean if mask_kind == "bool" else t, 4, "A")
    table = types.Array(types.int64, 1, "A")
    i64, u64 = types.int64, types.uint64
    return types.void(
        strided, strided, strided,  # q, k, v
        mask_t, table,  # mask, mask_batch
        table, types.Array(t, 2, "A"),  # key lengths (B|1,), ALiBi slopes (B|1, H|1)
        strided, types.Array(t, 3, "A"),  # out, lse
        types.Array(t, 5, "C"), types.Array(t, 4, "C"),  # split scratch: out, lse
        t, t,  # scale, softcap (0: none)
        t, u64, u64, u64,  # dropout: 1/(1-p), threshold (0: none), Philox key words
        i64, i64, i64, i64,  # position offset, shift by key length (0/1), left, right
        i64, i64, i64,  # rows per block, lanes per row, splits
    )


def _merge_signature(dtype: str) -> Any:
    """Numba signature of the split-merge kernel."""
    from numba import types

    t = getattr(types, dtype)
    return types.void(types.Array(t, 5, "C"), types.Array(t, 4, "C"),
                      types.Array(t, 4, "A"), types.Array(t, 3, "A"))


@functools.cache
def make_kernel_function(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                         block_k: int | None = None) -> Any:
    """The Python kernel function for one specialisation (not yet compiled)."""
    _cuda()
    from numba import types

    if block_k is None:
        block_k = default_block_k(dtype, bucket)
    acc_t = getattr(types, dtype)
    np_t = np.dtype(dtype).type
    ZERO, ONE, NEG_INF = np_t(0.0), np_t(1.0), np_t(-np.inf)
    U_ZERO = np.uint64(0)
    HEAD, BK = bucket, block_k
    PADDED = HEAD + 1  # tile rows padded by one column: lanes reading different keys
    CAP = 2 * BK  # lane states the two tiles hold at once when lanes merge
    BOOL_MASK, FLOAT_MASK, MODS = mask_kind == "bool", mask_kind == "float", mods

    keep_word = philox_function()  # Philox4x32-10's first word for a weight's index

    def attention_kernel(q, k, v, mask, mask_batch, lengths, slopes, out, lse, o_part,
                         lse_part, scale, softcap, drop_scale, threshold, key0, key1, offset,
                         shift, left, right, rows, lanes, n_splits):
        """Out and lse (or one split's partial) for one query tile of one (batch, head)."""
        n_batch, n_heads, tq, e = q.shape
        tk = k.shape[2]
        ev = v.shape[3]
        group = n_heads // k.shape[1]
        n_pairs = n_batch * n_heads
        n_qtiles = (tq + rows - 1) // rows
        pair = cuda.blockIdx.x % n_pairs
        rest = cuda.blockIdx.x // n_pairs
        split = rest % n_splits
        qt = n_qtiles - 1 - rest // n_splits  # largest causal work first
        b = pair // n_heads
        h = pair % n_heads
        hk = h // group
        tid = cuda.threadIdx.x
        lane = tid // rows  # which keys of a tile this thread scores
        i = qt * rows + tid % rows
        row_ok = i < tq and lane < lanes

        # Positions of this batch row: p_i = i + pos_offset.
        len_b = lengths[0]
        if lengths.shape[0] > 1:
            len_b = lengths[b]
        pos_offset = offset + shift * len_b
        p = i + pos_offset

        # Keys [lo, hi) that some row of the block may see; this split's share
        # of them, [k_start, k_end), in whole tiles.
        first_row = qt * rows
        last_row = min(first_row + rows, tq) - 1
        lo = max(0, first_row + pos_offset - left)
        hi = min(tk, len_b, last_row + pos_offset + right + 1)
        n_tiles_all = max(0, (hi - lo + BK - 1) // BK)
        per_split = (n_tiles_all + n_splits - 1) // n_splits * BK
        k_start = lo + split * per_split
        k_end = min(hi, k_start + per_split)
        n_ktiles = max(0, (k_end - k_start + BK - 1) // BK)

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

        # Dropout: weight (b, h, i, j) has the flat index row_n + j.
        dropping = threshold != U_ZERO
        row_n = ((b * n_heads + h) * tq + i) * tk

        # Score modifiers: soft-capping (softcap > 0) and this head's ALiBi slope.
        cap = ZERO
        inv_cap = ZERO
        slope = ZERO
        if MODS:
            cap = softcap
            if cap > ZERO:
                inv_cap = ONE / cap
            sb = 0
            sh = 0
            if slopes.shape[0] > 1:
                sb = b
            if slopes.shape[1] > 1:
                sh = h
            slope = slopes[sb, sh]

        q_row = cuda.local.array(HEAD, acc_t)
        acc = cuda.local.array(HEAD, acc_t)
        s = cuda.local.array(BK, acc_t)
        k_tile = cuda.shared.array((BK, PADDED), acc_t)
        v_tile = cuda.shared.array((BK, PADDED), acc_t)
        m_lane = cuda.shared.array(CAP, acc_t)
        l_lane = cuda.shared.array(CAP, acc_t)

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

        for kt in range(n_ktiles):
            j0 = k_start + kt * BK

            # Load one K tile and one V tile into shared memory; keys past
            # k_end (and padding features) are zeros, never read.
            for idx in range(tid, BK * HEAD, cuda.blockDim.x):
                jj = idx // HEAD
                d = idx % HEAD
                j = j0 + jj
                k_val = ZERO
                v_val = ZERO
                if j < k_end:
                    if d < e:
                        k_val = k[b, hk, j, d]
                    if d < ev:
                        v_val = v[b, hk, j, d]
                k_tile[jj, d] = k_val
                v_tile[jj, d] = v_val
            cuda.syncthreads()

            if row_ok:
                # Scores of this row against this lane's keys of the tile.
                m_tile = NEG_INF
                for jj in range(lane, BK, lanes):
                    j = j0 + jj
                    x = ZERO
                    for d in range(HEAD):
                        x += q_row[d] * k_tile[jj, d]
                    if MODS:
                        if cap > ZERO:
                            x = cap * math.tanh(x * inv_cap)
                        x -= slope * np_t(abs(p - j))
                    if j >= k_end or j > p + right or j < p - left:
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
                    if m_new != m:
                        alpha = math.exp(m - m_new)
                        l *= alpha
                        for d in range(HEAD):
                            acc[d] *= alpha
                    for jj in range(lane, BK, lanes):
                        weight = math.exp(s[jj] - m_new)
                        l += weight  # l (and lse) before dropout, acc after it
                        if dropping and weight != ZERO:
                            if keep_word(row_n + j0 + jj, key0, key1) >= threshold:
                                weight *= drop_scale
                            else:
                                weight = ZERO
                        for d in range(HEAD):
                            acc[d] += weight * v_tile[jj, d]
                    m = m_new
            cuda.syncthreads()

        # Merge the lanes of each row, a tree through the (now free) tiles:
        # lanes [step, 2·step) hand their state to lanes [0, step), CAP at a time.
        step = lanes // 2
        while step > 0:
            n_slots = step * rows
            for base in range(0, n_slots, CAP):
                if row_ok and lane >= step and lane < 2 * step:
                    slot = (lane - step) * rows + tid % rows - base
                    if slot >= 0 and slot < CAP:
                        for d in range(HEAD):
                            if slot < BK:
                                k_tile[slot, d] = acc[d]
                            else:
                                v_tile[slot - BK, d] = acc[d]
                        m_lane[slot] = m
                        l_lane[slot] = l
                cuda.syncthreads()
                if row_ok and lane < step:
                    slot = lane * rows + tid % rows - base
                    if slot >= 0 and slot < CAP:
                        m_other = m_lane[slot]
                        m_new = m
                        if m_other > m or m_other != m_other:
                            m_new = m_other
                        if m_new != NEG_INF:
                            alpha = math.exp(m - m_new)
                            beta = math.exp(m_other - m_new)
                            l = l * alpha + l_lane[slot] * beta
                            for d in range(HEAD):
                                y = ZERO
                                if slot < BK:
                                    y = k_tile[slot, d]
                                else:
                                    y = v_tile[slot - BK, d]
                                acc[d] = acc[d] * alpha + y * beta
                            m = m_new
                cuda.syncthreads()
            step //= 2

        # Normalise and write (a split writes its partial to the scratch); a row
        # with no visible key gives 0 and -inf (a NaN in l, from a NaN input,
        # propagates to out and lse).
        if row_ok and lane == 0:
            inv_l = ZERO
            lse_i = NEG_INF
            if l != ZERO:
                inv_l = ONE / l
                lse_i = m + math.log(l)
            if n_splits == 1:
                for d in range(HEAD):
                    if d < ev:
                        out[b, h, i, d] = acc[d] * inv_l
                lse[b, h, i] = lse_i
            else:
                for d in range(HEAD):
                    if d < ev:
                        o_part[split, b, h, i, d] = acc[d] * inv_l
                lse_part[split, b, h, i] = lse_i

    suffix = "_mods" if mods else ""
    name = f"attention_{dtype}_head{bucket}_{mask_kind}{suffix}_k{block_k}"
    attention_kernel.__name__ = attention_kernel.__qualname__ = name
    return attention_kernel


@functools.cache
def make_merge_function(dtype: str) -> Any:
    """The kernel that merges split-K partials by log-sum-exp (not yet compiled)."""
    _cuda()
    np_t = np.dtype(dtype).type
    ZERO, NEG_INF = np_t(0.0), np_t(-np.inf)

    def merge_kernel(o_part, lse_part, out, lse):
        """out = Σ_s w_s o_s / Σ_s w_s with w_s = exp(lse_s − max_s lse_s); one thread
        per output element (one per row when Ev = 0)."""
        n_splits, n_batch, n_heads, tq, ev = o_part.shape
        width = max(ev, 1)
        idx = cuda.grid(1)
        if idx < n_batch * n_heads * tq * width:
            d = idx % width
            row = idx // width
            i = row % tq
            b = row // tq // n_heads
            h = row // tq % n_heads
            # The largest partial lse (NaN sticks).
            m = NEG_INF
            for sp in range(n_splits):
                x = lse_part[sp, b, h, i]
                if x > m or x != x:
                    m = x
            # Weighted sum; a row no split saw stays 0 with lse -inf.
            total = ZERO
            value = ZERO
            if m != NEG_INF:
                for sp in range(n_splits):
                    w = math.exp(lse_part[sp, b, h, i] - m)
                    total += w
                    if d < ev:
                        value += w * o_part[sp, b, h, i, d]
            lse_i = NEG_INF
            if total != ZERO:
                value /= total
                lse_i = m + math.log(total)
            if d < ev:
                out[b, h, i, d] = value
            if d == 0:
                lse[b, h, i] = lse_i

    merge_kernel.__name__ = merge_kernel.__qualname__ = f"merge_splits_{dtype}"
    return merge_kernel


@functools.cache
def compiled_kernel(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                    block_k: int | None = None) -> Any:
    """The kernel for one specialisation, compiled on first use and cached.

    It is compiled for exactly one signature, so a launch skips type dispatch:
    the launcher checks dtypes, and allocates the scratch contiguous.
    """
    fn = make_kernel_function(dtype, bucket, mask_kind, mods, block_k)
    return _cuda().jit(_signature(dtype, mask_kind))(fn)


@functools.cache
def compiled_merge(dtype: str) -> Any:
    """The split-merge kernel for ``dtype``, compiled on first use and cached."""
    return _cuda().jit(_merge_signature(dtype))(make_merge_function(dtype))


def specializations() -> Iterator[tuple[Any, Any]]:
    """Every (Python kernel function, Numba signature) pair the launcher may compile."""
    for dtype in DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            for mask_kind in MASK_KINDS:
                for mods in (False, True):
                    yield (make_kernel_function(dtype, bucket, mask_kind, mods),
                           _signature(dtype, mask_kind))
        yield make_merge_function(dtype), _merge_signature(dtype)


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


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_plan(tq: int, tk: int, n_pairs: int, block_q: int, block_k: int, *,
                decode: bool | None = None,
                num_splits: int | None = None) -> tuple[int, int, int]:
    """``(rows, lanes, splits)``: query rows per block, threads per row, key splits.

    A block has ``rows · lanes`` threads. By shape: with ``Tq <= DECODE_MAX_TQ``
    a block holds the smallest power of two of rows that covers Tq (at most
    ``block_q``) and up to ``block_q`` threads in all become key lanes, as many
    as a key tile has keys (a power of two); otherwise one thread per row.
    Keys are split while the grid has fewer than ``TARGET_BLOCKS`` blocks and
    each split keeps at least ``SPLIT_MIN_KEYS`` keys. ``decode`` and
    ``num_splits`` override the choice.

    Examples
    --------
    >>> launch_plan(1, 32768, 8, 64, 64)     # one decoding step over a long cache
    (1, 64, 33)
    >>> launch_plan(4, 32768, 8, 64, 32)     # four tokens; 32-key tiles: 32 lanes at most
    (4, 16, 33)
    >>> launch_plan(4096, 4096, 64, 64, 64)  # prefill: one thread per row, no split
    (64, 1, 1)
    """
    if decode is None:
        decode = tq <= DECODE_MAX_TQ
    rows = min(block_q, _power_of_two_at_least(tq)) if decode else block_q
    lanes = min(block_q // rows, block_k)
    lanes = 1 << (lanes.bit_length() - 1)  # a power of two, for the tree merge
    if num_splits is None:
        blocks = n_pairs * -(-tq // rows)
        num_splits = min(-(-TARGET_BLOCKS // max(blocks, 1)), tk // SPLIT_MIN_KEYS, MAX_SPLITS)
    return rows, lanes, max(1, int(num_splits))


def _visibility(rules: Rules | None, causal_offset: int | None, tq: int,
                tk: int) -> tuple[Rules, int, int, int, int]:
    """The rules, and the kernel's position offset, shift flag, left and right reach."""
    if rules is None:
        rules = Rules.from_causal_offset(causal_offset, tq, tk)
    offset, shift = (-tq, 1) if rules.lengths_shift else (rules.offset, 0)
    left, right = rules.left_reach(), rules.right_reach()

    def bounded(x: int | None) -> int:
        return UNBOUNDED if x is None else max(-UNBOUNDED, min(int(x), UNBOUNDED))

    return rules, bounded(offset), shift, bounded(left), bounded(right)


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None,
              causal_offset: int | None, scale: float, xp: Any, rules: Rules | None = None,
              block_q: int | None = None, block_k: int | None = None,
              decode: bool | None = None, num_splits: int | None = None,
              arithmetic: str | None = None) -> tuple[Array, Array]:
    """Fused attention on a CUDA GPU: ``(out, lse)`` in one kernel launch (two with
    split keys).

    See the module docstring for the algorithm and :mod:`polyattn.backends`
    for the shared contract; ``rules`` (windows, key lengths, soft-capping,
    ALiBi, per-row positions) are applied inside the kernel. ``block_q`` and
    ``block_k`` override the tile sizes (threads per block, key rows per tile),
    ``decode`` and ``num_splits`` the launch plan (:func:`launch_plan`); they
    exist for tests and tuning (and keep this kernel). Other exact calls, but
    decoding shapes, run the register-tiled kernel of :mod:`.numba_cuda_tiled`
    (``POLYATTN_CUDA_KERNEL=rows`` keeps them here).
    ``arithmetic`` (``"f16"``, ``"bf16"``, ``"3xtf32"``) runs the tensor-core
    kernel of :mod:`.numba_cuda_tc` on float32 inputs where it can take the
    call (:func:`.numba_cuda_tc.unsupported`), else the exact kernels.

    Raises
    ------
    ValueError
        A head size above ``MAX_HEAD_DIM`` or a mask that does not broadcast.
    TypeError
        CPU arrays without the simulator, or a dtype other than float32/float64.
    ImportError
        numba-cuda is not installed.
    """
    out, lse = _attention(q, k, v, mask=mask, causal_offset=causal_offset, scale=scale, xp=xp,
                          rules=rules, block_q=block_q, block_k=block_k, decode=decode,
                          num_splits=num_splits, arithmetic=arithmetic)
    # a query row holding NaN or inf is NaN whatever the kernels made of its scores (all
    # -inf: reported as fully masked; soft-capped: finite); NaN never disappears (§4.2)
    bad = non_finite_rows(q, xp)                                       # (B…, H, Tq, 1)
    return out + bad, lse + bad[..., 0]


def _attention(q: Array, k: Array, v: Array, /, *, mask: Array | None,
               causal_offset: int | None, scale: float, xp: Any, rules: Rules | None,
               block_q: int | None, block_k: int | None, decode: bool | None,
               num_splits: int | None, arithmetic: str | None) -> tuple[Array, Array]:
    """:func:`attention` but for non-finite query rows: the kernel that takes the call."""
    *batch, n_heads, tq, e = q.shape
    tk, ev = v.shape[-2:]
    if arithmetic is not None:
        from polyattn.backends.cuda import tensor_core as numba_cuda_tc

        if numba_cuda_tc.unsupported(arithmetic, tq, e, ev) is None:
            return numba_cuda_tc.attention(q, k, v, mask=mask, causal_offset=causal_offset,
                                           scale=scale, xp=xp, arithmetic=arithmetic,
                                           rules=rules)
    if (kernel_choice() == "tiled" and block_q is None and block_k is None and decode is None
            and num_splits is None):
        from polyattn.backends.cuda import tiled as numba_cuda_tiled

        if numba_cuda_tiled.unsupported(tq) is None:
            return numba_cuda_tiled.attention(q, k, v, mask=mask, causal_offset=causal_offset,
                                              scale=scale, xp=xp, rules=rules)
    batch = tuple(batch)
    bucket = head_bucket(e, ev)
    dtype = common_dtype(query=q, key=k, value=v)
    dev = _Device(q)
    n_batch = math.prod(batch)

    out = empty_like_layout(dev, q, (n_batch, n_heads, tq, ev), xp)  # (B, H, Tq, Ev)
    lse = dev.empty((n_batch, n_heads, tq), q.dtype)  # (B, H, Tq)
    if n_batch * n_heads * tq > 0:
        inputs = kernel_inputs(q, k, v, mask, causal_offset, rules, scale, xp, dev)
        bq = BLOCK_Q if block_q is None else int(block_q)
        bk = default_block_k(dtype, bucket) if block_k is None else int(block_k)
        rows, lanes, splits = launch_plan(tq, tk, n_batch * n_heads, bq, bk, decode=decode,
                                          num_splits=num_splits)
        kernel = compiled_kernel(dtype, bucket, inputs.mask_kind, inputs.mods,
                                 None if block_k is None else bk)
        n_blocks = n_batch * n_heads * -(-tq // rows) * splits
        check_grid(n_blocks, f"B·H·ceil(Tq/{rows})·{splits}", q)
        # Split-K scratch in the compute dtype (a placeholder without splits).
        scratch_shape = (splits, n_batch, n_heads, tq) if splits > 1 else (1, 1, 1, 1)
        o_part = dev.view(dev.empty((*scratch_shape, ev if splits > 1 else 1),
                                    q.dtype))  # (S, B, H, Tq, Ev)
        lse_part = dev.view(dev.empty(scratch_shape, q.dtype))  # (S, B, H, Tq)
        out_d, lse_d = dev.view(out), dev.view(lse)
        args = [*inputs.arrays, out_d, lse_d, o_part, lse_part, *inputs.scalars, rows, lanes,
                splits]
        with launching(dev) as stream:
            kernel[n_blocks, rows * lanes, stream](*args)
            if splits > 1:
                # Merge the splits: one thread per output element.
                n_threads = n_batch * n_heads * tq * max(ev, 1)
                per_block = min(MERGE_THREADS, n_threads)
                compiled_merge(dtype)[-(-n_threads // per_block), per_block, stream](
                    o_part, lse_part, out_d, lse_d)
        if dev.simulated:
            out, lse = out_d.copy_to_host(), lse_d.copy_to_host()
    out = xp.reshape(out, (*batch, n_heads, tq, ev))  # (B…, H, Tq, Ev)
    lse = xp.reshape(lse, (*batch, n_heads, tq))  # (B…, H, Tq)
    return out, lse


def launch_tiles(q: Array, k: Array, v: Array, *, mask: Array | None,
                 causal_offset: int | None, scale: float, xp: Any, rules: Rules | None,
                 kernel_for: Any, rows: int, threads: int,
                 vector_flag: bool = False) -> tuple[Array, Array]:
    """``(out, lse)`` from one launch of a kernel whose blocks own ``rows`` query rows
    of one (batch, head) pair each, with ``threads`` threads, and take the arrays
    and scalars of :func:`kernel_inputs` then ``out`` and ``lse``: the tensor-core
    and register-tiled kernels. ``kernel_for(mask_kind, mods)`` gives the compiled
    kernel; with ``vector_flag`` it takes one more scalar, 1 where q, k and v may be
    read by vector loads (:func:`vector_loads_fit`), else 0."""
    *batch, n_heads, tq, _ = q.shape
    ev = v.shape[-1]
    dev = _Device(q)
    n_batch = math.prod(batch)
    out = empty_like_layout(dev, q, (n_batch, n_heads, tq, ev), xp)  # (B, H, Tq, Ev)
    lse = dev.empty((n_batch, n_heads, tq), q.dtype)  # (B, H, Tq)
    if n_batch * n_heads * tq > 0:
        inputs = kernel_inputs(q, k, v, mask, causal_offset, rules, scale, xp, dev)
        kernel = kernel_for(inputs.mask_kind, inputs.mods)
        n_blocks = n_batch * n_heads * -(-tq // rows)
        check_grid(n_blocks, f"B·H·ceil(Tq/{rows})", q)
        out_d, lse_d = dev.view(out), dev.view(lse)
        with launching(dev) as stream:
            flag = (np.int64(inputs.vector_loads),) if vector_flag else ()
            kernel[n_blocks, threads, stream](*inputs.arrays, out_d, lse_d, *inputs.scalars,
                                              *flag)
        if dev.simulated:
            out, lse = out_d.copy_to_host(), lse_d.copy_to_host()
    out = xp.reshape(out, (*batch, n_heads, tq, ev))  # (B…, H, Tq, Ev)
    lse = xp.reshape(lse, (*batch, n_heads, tq))  # (B…, H, Tq)
    return out, lse


def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array, /, *,
             mask: Array | None, causal_offset: int | None, scale: float, xp: Any,
             rules: Rules | None = None, grad_lse: Array | None = None,
             block_q: int | None = None, block_k: int | None = None,
             ) -> tuple[Array, Array, Array]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention` on a CUDA GPU, in two kernel
    launches: the register-tiled kernels of :mod:`.numba_cuda_tiled_backward` where
    the forward runs the register-tiled kernel (:func:`kernel_choice`, not for
    decoding shapes), else those of :mod:`.numba_cuda_backward` (``block_q`` and
    ``block_k`` set their tile sizes and keep them)."""
    from polyattn.backends.cuda import tiled as numba_cuda_tiled
    from polyattn.backends.cuda.rows_backward import backward as kernel_backward

    if (kernel_choice() == "tiled" and block_q is None and block_k is None
            and numba_cuda_tiled.unsupported(q.shape[-2]) is None):
        from polyattn.backends.cuda.tiled_backward import backward as tiled_backward

        return tiled_backward(q, k, v, out, lse, grad_out, mask=mask,
                              causal_offset=causal_offset, scale=scale, xp=xp, rules=rules,
                              grad_lse=grad_lse)
    return kernel_backward(q, k, v, out, lse, grad_out, mask=mask,
                           causal_offset=causal_offset, scale=scale, xp=xp, rules=rules,
                           grad_lse=grad_lse, block_q=block_q, block_k=block_k)



# --------------------------------------------------------------------------- #
# What every launch shares (the forward and the backward kernels)
# --------------------------------------------------------------------------- #

def common_dtype(**arrays: Array) -> str:
    """The compute dtype's name, the same for every named array (TypeError otherwise)."""
    (first, x0), *rest = arrays.items()
    dtype = _dtype_name(x0)
    for name, x in rest:
        if _dtype_name(x) != dtype:
            raise TypeError(f"`{name}` has dtype {x.dtype} but `{first}` has {x0.dtype}")
    return dtype


def empty_like_layout(dev: _Device, x: Array, shape: tuple[int, int, int, int],
                      xp: Any) -> Array:
    """An uninitialised (B, H, T, F) output in ``x``'s dtype; time-major when ``x`` is.

    A (B…, T, H, F) array seen as (B…, H, T, F) (``layout="BTHE"``) gets an output
    laid out the same way, so that the caller's view back is row-major.
    """
    n_batch, heads, t, f = shape
    if _time_major(x):
        out = dev.empty((n_batch, t, heads, f), x.dtype)  # (B, T, H, F)
        return xp.permute_dims(out, (0, 2, 1, 3))  # (B, H, T, F), a view
    return dev.empty(shape, x.dtype)  # (B, H, T, F)


def check_grid(n_blocks: int, formula: str, q: Array) -> None:
    """ValueError when a flat grid of ``n_blocks`` exceeds the CUDA limit."""
    if n_blocks > MAX_GRID_BLOCKS:
        raise ValueError(
            f"{formula} = {n_blocks} thread blocks exceed the CUDA grid limit "
            f"{MAX_GRID_BLOCKS} (query {tuple(q.shape)}); split the batch"
        )


@dataclasses.dataclass(frozen=True)
class KernelInputs:
    """One call in the kernels' form.

    ``arrays``: device views of q (B, H, Tq, E), k, v (B, Hkv, Tk, ·), the mask
    (Bm, Hm, Tqm, Tkm) (a never-read placeholder without one), its batch table,
    the key lengths and the ALiBi slopes. ``scalars``: scale, softcap (0: none),
    the dropout arguments of :func:`dropout_arguments`, the position offset, the
    shift flag and the left and right reach. ``vector_loads``: whether q, k and v
    may be read by vector loads (:func:`vector_loads_fit`).
    """

    mask_kind: str
    mods: bool
    arrays: tuple[Any, ...]
    scalars: tuple[Any, ...]
    vector_loads: bool = False


def kernel_inputs(q: Array, k: Array, v: Array, mask: Array | None,
                  causal_offset: int | None, rules: Rules | None, scale: float, xp: Any,
                  dev: _Device) -> KernelInputs:
    """:class:`KernelInputs` of a call with at least one query row."""
    *batch_list, n_heads, tq, e = q.shape
    *_, n_kv_heads, tk, ev = v.shape
    batch = tuple(batch_list)
    n_batch = math.prod(batch)
    dtype = _dtype_name(q)
    np_t = np.dtype(dtype).type
    q4 = xp.reshape(q, (n_batch, n_heads, tq, e))  # (B, H, Tq, E)
    k4 = xp.reshape(k, (n_batch, n_kv_heads, tk, e))  # (B, Hkv, Tk, E)
    v4 = xp.reshape(v, (n_batch, n_kv_heads, tk, ev))  # (B, Hkv, Tk, Ev)
    if mask is None:
        mask_kind = "none"
        mask4 = q4[:1, :1, :1, :1]  # never read
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
    rules, offset, shift, left, right = _visibility(rules, causal_offset, tq, tk)
    lengths, slopes = _rule_tables(rules, batch, n_heads, q.dtype, dev, xp)
    mods = rules.softcap is not None or rules.alibi is not None
    softcap = np_t(0.0 if rules.softcap is None else rules.softcap)
    arrays = tuple(dev.view(a) for a in (q4, k4, v4, mask4, dev.from_numpy(table), lengths,
                                         slopes))
    scalars = (np_t(scale), softcap, *dropout_arguments(rules, dtype), offset, shift, left,
               right)
    sources = (q4, k4, v4) if dev.simulated else arrays[:3]
    return KernelInputs(mask_kind, mods, arrays, scalars,
                        vector_loads_fit(*(_memory(x) for x in sources)))


Memory = tuple[int, tuple[int, ...], tuple[int, ...], int]


def _memory(x: Any) -> Memory:
    """(address, shape, byte strides, item size) of an array that describes its memory
    (``__cuda_array_interface__``: CuPy, torch CUDA tensors, Numba device arrays;
    ``__array_interface__``: NumPy) or a torch tensor."""
    if callable(getattr(x, "data_ptr", None)) and callable(getattr(x, "stride", None)):
        size = x.element_size()  # torch (whose interface refuses tensors needing grad)
        return x.data_ptr(), tuple(x.shape), tuple(st * size for st in x.stride()), size
    face = getattr(x, "__cuda_array_interface__", None) or x.__array_interface__
    shape = tuple(face["shape"])
    itemsize = np.dtype(face["typestr"]).itemsize
    strides = face.get("strides")
    if strides is None:  # C-contiguous
        strides, step = [], itemsize
        for n in reversed(shape):
            strides.insert(0, step)
            step *= n
    return face["data"][0] or 0, shape, tuple(strides), itemsize


def vector_loads_problem(x: Memory) -> str | None:
    """Why the register-tiled kernel cannot read the array ``x`` (:func:`_memory`) 16
    bytes at a time with 32-bit addresses; None when it can."""
    address, shape, strides, itemsize = x
    if shape[-1] * itemsize % 16:
        return f"its rows are {shape[-1] * itemsize} bytes, not whole 16-byte groups"
    if strides[-1] != itemsize:
        return "the elements of a row are not consecutive in memory"
    if address % 16:
        return f"its first element is {address % 16} bytes past a 16-byte boundary"
    for axis, (n, st) in enumerate(zip(shape[:-1], strides[:-1], strict=True)):
        if n > 1 and (st < 0 or st % 16):
            return (f"axis {axis} steps {st} bytes (of strides {strides}), not a "
                    "non-negative multiple of 16")
    if sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if n > 0) + 16 >= 2**31:
        return "it spans 2 GiB or more (32-bit byte offsets)"
    return None


def vector_loads_fit(*arrays: Memory) -> bool:
    """Whether the register-tiled kernel may read every one of these arrays (given
    by :func:`_memory`) 16 bytes at a time, addressed in 32-bit integers: rows of
    consecutive elements whose length is a multiple of 16 bytes, the other strides
    non-negative multiples of 16 bytes, a 16-byte aligned start, and every byte
    offset below 2³¹ (:func:`vector_loads_problem`). Any (B, H, T, E) or
    (B, T, H, E) array of its own memory with E a multiple of 4 (float32) or 2
    (float64), below 2 GiB, qualifies; other arrays are read one element at a time
    with 64-bit indices.

    >>> x = np.zeros((2, 3, 5, 8), np.float32)
    >>> vector_loads_fit(_memory(x)), vector_loads_fit(_memory(x[..., :6]))
    (True, False)
    """
    return all(vector_loads_problem(x) is None for x in arrays)


def row_loads(**arrays: Any) -> str:
    """How the register-tiled kernel reads the named arrays' rows, for people."""
    for name, x in arrays.items():
        try:
            why = vector_loads_problem(_memory(x))
        except (AttributeError, KeyError, TypeError):
            return "rows read element by element unless the arrays' memory allows 16-byte loads"
        if why is not None:
            return f"rows read element by element, 64-bit indices (`{name}`: {why})"
    return "rows read 16 bytes per load, 32-bit addresses"


@contextlib.contextmanager
def launching(dev: _Device) -> Iterator[Any]:
    """Launch context: the input's GPU made current, its library's current stream
    (yielded), and Numba's occupancy warning for small grids silenced (the grid is
    the problem's). On the simulator, whose threads compute in NumPy scalars, NumPy's
    floating-point warnings too: a GPU raises none, and none escapes a call (§4.2)."""
    device_id = dev.device_id()
    on_device = contextlib.nullcontext() if device_id is None else dev.cuda.gpus[device_id]
    with warnings.catch_warnings(), on_device:
        warnings.simplefilter("ignore", category=_performance_warning())
        if simulator_enabled():
            warnings.simplefilter("ignore", category=RuntimeWarning)
        yield dev.stream()

def _rule_tables(rules: Rules, batch: tuple[int, ...], n_heads: int, dtype: Any,
                 dev: _Device, xp: Any) -> tuple[Array, Array]:
    """Key lengths as int64 (B,) (or (1,) holding Tk) and ALiBi slopes (B, H|1) (or a
    zero (1, 1)), as arrays of the input library on its device."""
    n_batch = math.prod(batch)
    if rules.key_lengths is None:
        lengths = dev.from_numpy(np.full(1, rules.tk, dtype=np.int64))
    else:
        lengths = xp.broadcast_to(rules.key_lengths, batch)  # (B…,)
        lengths = xp.astype(xp.reshape(lengths, (n_batch,)), xp.int64)  # (B,)
    if rules.alibi is None:
        slopes = dev.from_numpy(np.zeros((1, 1), dtype=_dtype_name(dev.like)))
    else:
        heads = n_heads if rules.alibi.shape[-1] > 1 else 1
        slopes = xp.broadcast_to(rules.alibi, (*batch, heads))  # (B…, H|1)
        slopes = xp.astype(xp.reshape(slopes, (n_batch, heads)), dtype)  # (B, H|1)
    return lengths, slopes


def _performance_warning() -> type[Warning]:
    try:
        from numba.core.errors import NumbaPerformanceWarning
    except ImportError:  # pragma: no cover
        return RuntimeWarning
    return NumbaPerformanceWarning
