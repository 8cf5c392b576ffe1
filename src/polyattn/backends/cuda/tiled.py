"""Exact attention on CUDA GPUs, register-tiled: the FlashAttention-2 work split in FFMA.

The same online softmax as :mod:`.rows`, in the arithmetic of the inputs
(float32 or float64, no tensor cores), laid out for throughput rather than
one thread per query row:

* a block of 128 threads (256 above head size 64) owns 64 query rows of one
  (batch, head) pair and walks its visible keys in tiles of ``BK`` = 32 keys;
* the 64 × 32 scores of a tile are spread over the threads in patches of
  ``R`` = 4 rows (2 above head size 64) × 4 keys: thread ``tid`` holds rows
  ``R·(tid // 8) + i`` and keys ``4·(tid % 8) + u``. Q and K pass through
  shared memory feature-major (``DC`` features at a time, Qᵀ and Kᵀ), so each
  step of the dot products loads R query values and 4 key values and does
  4·R independent multiply-adds: the accumulators form no long dependent
  chain;
* loops over a thread's patch are unrolled before compilation
  (:mod:`.unroll`), so the patch stays in registers, and each phase of a
  tile indexes from a zero the compiler cannot see through
  (:func:`.mma.gpu_ops`' ``opaque_zero``), so that Numba's 64-bit index
  arithmetic is redone where it is used instead of being held in registers
  across the whole key loop; the mask's and the modifiers' parameters are
  read per tile. With launch bounds of 4 blocks of 128 threads (2 of 256) per
  multiprocessor, ptxas fits float32 up to head size 128 in 128 registers
  without spilling (sm_80 and sm_90; ``test_cuda_ptx.py`` checks all 30);
* a row's maximum and sum are combined over the eight threads that share it
  (neighbouring lanes: three warp shuffles);
* where it fits (float32 up to head size 64, float64 up to 32), the block's
  scaled Qᵀ is loaded once and stays in shared memory for the whole key loop;
  otherwise each key tile reads it again, a chunk at a time. K and V chunks
  are double-buffered through registers: the next chunk's loads are issued
  before the current chunk's multiply-adds and stored to shared memory after
  them (a tile's first V chunk before its softmax);
* where q, k and v allow it (:func:`.inputs.vector_loads_fit`: rows of
  whole 16-byte groups, 16-byte aligned, below 2 GiB, such as any
  (B, H, T, E) or (B, T, H, E) array with E a multiple of 4 in float32, 2 in
  float64), a thread reads up to 16 bytes of a row per load (``ld.global.nc``
  of 4 float32 or 2 float64 values, :func:`.mma.gpu_ops`' ``load_vector``),
  its address computed in 32-bit integers; other inputs are read an element at
  a time with Numba's 64-bit indexing (a kernel argument picks the path; both
  give the same bits);
* the scores go through shared memory (Pᵀ, key-major). A mask (with the
  modifiers, which come before it) is applied there by all the threads
  together, key fastest, so that neighbouring threads read neighbouring mask
  entries; then each thread's rows turn into probabilities in place (the
  visible key range, the online softmax), and ``O = P V``
  is spread the same way: thread ``tid`` keeps rows ``R·(tid // 8) + i`` and
  features ``32·c + 4·(tid % 8) + u`` of the output in registers, fed by one
  probability and one V value per multiply-add, V streamed ``VK`` keys at a
  time.

Every rule of :mod:`.rows` is applied in the kernel, per score, by the functions of
:mod:`polyattn.rules.element` (compiled in with the compute type): scale,
soft-capping, ALiBi, the mask (read through its strides), causality, windows
and key lengths as visibility, dropout by Philox counters on the weight's
flat index; key tiles no row of the block can see are never loaded (segment
ids and block masks narrow them further, and a tile a block mask leaves empty
is skipped: :mod:`.blocks`); rows with no visible key give 0 and
``lse = -inf``; NaN propagates.

Limits: query tiles of fewer than ``DECODE_MAX_TQ`` + 1 rows (decoding) go to
the one-thread-per-row kernel of :mod:`.rows`, whose key lanes and
split-K suit them; so do calls that ask for its tile sizes. The backward pass
is :mod:`.tiled_backward`'s, laid out alike. On Numba's CUDA
simulator the shuffles are emulated (:func:`.mma.simulated_ops`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from polyattn._interop import simulator_enabled
from polyattn.backends.cuda import blocks
from polyattn.backends.cuda import mma as _mma
from polyattn.backends.cuda.environment import DTYPES, HEAD_DIM_BUCKETS, MASK_KINDS, _cuda
from polyattn.backends.cuda.inputs import common_dtype, head_bucket
from polyattn.backends.cuda.launch import DECODE_MAX_TQ, launch_tiles
from polyattn.backends.cuda.philox import philox_function
from polyattn.backends.cuda.unroll import unroll, unrolled
from polyattn.backends.cuda.user_rules import UserKey, buffer_types, device_functions, suffix
from polyattn.rules import element
from polyattn.rules.lowering import lower, parameter_types
from polyattn.rules.visibility import Rules

Array = Any

BLOCK_Q = 64  # query rows per block
DC = 16  # features of Qᵀ and Kᵀ per shared-memory chunk

# ``numba.cuda``, bound by the kernel factory (the simulator swaps it for its own).
cuda: Any = None


def rows_per_thread(bucket: int) -> int:
    """Query rows of a thread's patches: 4, or 2 for head sizes above 64 (whose
    output patch would otherwise hold 64 accumulators: 168 registers at float32
    head size 128, against 128 for 2 rows and twice the threads)."""
    return 2 if bucket > 64 else 4


def threads(bucket: int) -> int:
    """Threads of a block: eight per row group (128 for 4-row patches, 256 for 2)."""
    return 8 * BLOCK_Q // rows_per_thread(bucket)


def launch_bounds(dtype: str, bucket: int) -> tuple[int, ...]:
    """The kernel's launch bounds: its block size and, in float32 up to head size
    128, enough resident blocks per multiprocessor that ptxas keeps to 128
    registers per thread (65536 registers / 128 per thread / threads per block).
    Float64 and head size 256 keep what they need (128 would spill)."""
    n = threads(bucket)
    return (n, 65536 // (128 * n)) if dtype == "float32" and bucket <= 128 else (n,)


def block_k(dtype: str) -> int:
    """Keys per tile: 32 (4-row × 4-key score patches; 64 keys would hold 16 more
    scores per thread: 156 registers instead of 128 at float32 head size 64)."""
    return 32


def v_keys(dtype: str, bucket: int) -> int:
    """Keys of V per shared-memory chunk: 16, or 8 for float64 heads above 128."""
    return 8 if dtype == "float64" and bucket > 128 else 16


def shared_bytes(dtype: str, bucket: int, q_features: int | None = None) -> int:
    """Static shared memory of one block: Qᵀ (all of it, or a chunk), a Kᵀ chunk, a V
    chunk and Pᵀ. ``q_features``: the features of Qᵀ held (default: as compiled)."""
    item = np.dtype(dtype).itemsize
    bk = block_k(dtype)
    dc = min(DC, bucket)
    if q_features is None:
        q_features = bucket if q_resident(dtype, bucket) else dc
    return item * (q_features * (BLOCK_Q + 4) + dc * (bk + 4)
                   + v_keys(dtype, bucket) * (bucket + 4) + bk * (BLOCK_Q + 4))


def q_resident(dtype: str, bucket: int) -> bool:
    """Whether the block's Qᵀ (scaled) stays in shared memory for the whole key loop,
    where it fits in Numba's 48 KiB of static shared memory (float32 up to head size
    64, float64 up to 32); else each key tile reads it again, a chunk at a time."""
    return shared_bytes(dtype, bucket, q_features=bucket) <= 48 * 1024


def unsupported(tq: int) -> str | None:
    """Why this kernel leaves a call to the one-thread-per-row kernel (None: it takes it)."""
    if tq <= DECODE_MAX_TQ:
        return (f"{tq} query rows: decoding shapes use the key lanes and split-K of the "
                "one-thread-per-row kernel")
    return None


def _signature(dtype: str, mask_kind: str) -> Any:
    from numba import types

    t = getattr(types, dtype)
    strided = types.Array(t, 4, "A")
    mask_t = types.Array(types.boolean if mask_kind == "bool" else t, 4, "A")
    table = types.Array(types.int64, 1, "A")
    return types.void(
        strided, strided, strided,  # q, k, v
        mask_t, table,  # mask, mask_batch
        table, types.Array(t, 2, "A"),  # key lengths, ALiBi slopes
        strided, types.Array(t, 3, "A"),  # out, lse
        t, parameter_types(dtype),  # scale, the rules (lowering.kernel_parameters)
        types.int64,  # 1: q, k and v may be read by vector loads (inputs.vector_loads_fit)
        *buffer_types(dtype),  # mod_args buffers fb, ib, meta (.user_rules)
        *blocks.table_types(),  # segments, block-mask kinds, its block (.blocks)
    )


@functools.cache
def make_kernel_function(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                         user: UserKey | None = None,
                         masks: blocks.MaskKey | None = None) -> Any:
    """The Python kernel function for one specialisation (not yet compiled); ``user``:
    the call's ``score_mod`` and ``mask_mod`` (:func:`.user_rules.user_key`); ``masks``:
    whether it reads segment ids and a block mask (:func:`.blocks.mask_key`)."""
    global cuda
    cuda = _cuda()
    from numba import types

    ops = _mma.device_ops(simulator_enabled())
    row_max, row_sum, opaque_zero = ops.octet_max, ops.octet_sum, ops.opaque_zero
    keep_word = philox_function()

    acc_t = getattr(types, dtype)
    np_t = np.dtype(dtype).type
    ZERO, ONE, NEG_INF = np_t(0.0), np_t(1.0), np_t(-np.inf)
    # Scores are kept in base 2 (log2(e) folded into the scale, the soft cap, the
    # ALiBi slope and a float mask): the softmax is then exp2, one instruction
    # fewer per weight than exp; lse goes back to base e at the end.
    LOG2E, LN2 = np_t(math.log2(math.e)), np_t(math.log(2.0))
    (row_position, key_length, row_keys, block_keys, head_modifiers, mask_steps, modify, drops,
     dropout_key, kept, kept_scale) = (
        lower(f, "cuda", np_t) for f in (
            element.row_position, element.key_length, element.row_keys, element.block_keys,
            element.head_modifiers, element.mask_steps, element.modify, element.drops,
            element.dropout_key, element.kept, element.kept_scale))
    HEAD = bucket
    BQ, BK, R, NTHREADS = BLOCK_Q, block_k(dtype), rows_per_thread(bucket), threads(bucket)
    D_CHUNK = min(DC, HEAD)
    VK = v_keys(dtype, bucket)
    KC = BK // 32  # groups of 4 keys per thread in a tile
    OC = (HEAD + 31) // 32  # groups of 4 features per thread in the output
    RS = 4 * R  # values of a thread's patch in one 32-key (or 32-feature) group
    S_LEN = RS * KC  # scores per thread
    O_LEN = RS * OC  # output accumulators per thread
    BOOL_MASK, FLOAT_MASK, MODS = mask_kind == "bool", mask_kind == "float", mods
    MASKED = BOOL_MASK or FLOAT_MASK
    USER_SCORE = user is not None and user[0] is not None
    USER_MASK = user is not None and user[1] is not None
    score_element, mask_element = device_functions(user, dtype)
    SEGMENTS, BLOCKS = masks or (False, False)
    segment_of, segment_span, blocks_keys, _, tile_kind, _ = blocks.device_functions()
    # The whole-tile pass (all threads, key fastest) applies the mask and the user
    # rules, with the modifiers before them.
    TILE_PASS = MASKED or USER_SCORE or USER_MASK
    # Shared tiles, rows padded by 4 values (16-byte aligned rows, fewer bank conflicts).
    Q_RESIDENT = q_resident(dtype, bucket)
    PRE = BK * D_CHUNK // NTHREADS  # K values of a chunk per thread
    VPT = VK * HEAD // NTHREADS  # V values of a chunk per thread
    assert PRE * NTHREADS == BK * D_CHUNK and VPT * NTHREADS == VK * HEAD
    # Values per global load where the inputs allow vector loads (16 bytes at most;
    # ``vec`` says whether they do): Q, K (PRE values a thread in WK-wide loads) and V.
    W_MAX = 16 // np.dtype(dtype).itemsize
    WQ, WK, WV = W_MAX, min(W_MAX, PRE), min(W_MAX, VPT)
    load_q, load_k, load_v = (getattr(ops, f"load_vector{w}") for w in (WQ, WK, WV))
    Q_SHAPE, K_SHAPE = (HEAD if Q_RESIDENT else D_CHUNK, BQ + 4), (D_CHUNK, BK + 4)
    V_SHAPE, P_SHAPE = (VK, HEAD + 4), (BK, BQ + 4)

    def tiled_kernel(q, k, v, mask, mask_batch, lengths, slopes, out, lse, scale, rules, vec,
                     fb, ib, meta, segments, kinds, bq, bk):
        """Out and lse of 64 query rows of one (batch, head) pair."""
        _, n_heads, tq, e = q.shape
        tk = k.shape[2]
        ev = v.shape[3]
        group = n_heads // k.shape[1]
        n_qtiles = (tq + BQ - 1) // BQ
        # Consecutive blocks take the query tiles of one (batch, head) pair, which
        # then read its K and V while they are in L2; largest causal work first.
        pair = cuda.blockIdx.x // n_qtiles
        qt = n_qtiles - 1 - cuda.blockIdx.x % n_qtiles
        b = pair // n_heads
        h = pair % n_heads
        hk = h // group
        tid = cuda.threadIdx.x
        rg = tid // 8  # this thread's rows: R·rg … R·rg + R - 1 of the block
        kg = tid % 8  # its keys 4·kg + 32·c + u, and output features alike
        q0 = qt * BQ
        row_base = q0 + R * rg

        len_b = key_length(lengths, b)
        pos_offset = row_position(0, rules, len_b)  # row i is at i + pos_offset
        lo, hi = block_keys(q0, min(q0 + BQ, tq) - 1, pos_offset, rules, tk, len_b)
        if SEGMENTS:  # the keys of the rows' segments
            lo, hi = segment_span(segments, b, q0, min(q0 + BQ, tq) - 1, lo, hi)
        if BLOCKS:  # the key blocks the block mask leaves to the rows
            lo, hi = blocks_keys(kinds, b, h, q0, min(q0 + BQ, tq) - 1, bq, bk, lo, hi)
        n_ktiles = max(0, (hi - lo + BK - 1) // BK)

        dropping = drops(rules)

        q_chunk = cuda.shared.array(Q_SHAPE, acc_t)  # Qᵀ: feature-major
        k_chunk = cuda.shared.array(K_SHAPE, acc_t)  # Kᵀ
        v_chunk = cuda.shared.array(V_SHAPE, acc_t)
        p_tile = cuda.shared.array(P_SHAPE, acc_t)  # Pᵀ: key-major
        s = cuda.local.array(S_LEN, acc_t)  # s[RS·c + 4i + u]: row i, key 4kg + 32c + u
        o = cuda.local.array(O_LEN, acc_t)  # o[RS·c + 4i + u]: row i, feature 32c + 4kg + u
        m = cuda.local.array(R, acc_t)
        l = cuda.local.array(R, acc_t)
        a = cuda.local.array(R, acc_t)
        k_next = cuda.local.array(PRE, acc_t)  # the K chunk in flight
        v_next = cuda.local.array(VPT, acc_t)  # the V chunk in flight
        for n in unroll(O_LEN):
            o[n] = ZERO
        for i in unroll(R):
            m[i] = NEG_INF
            l[i] = ZERO

        if Q_RESIDENT:
            # Qᵀ, scaled, once for the whole key loop (the loop's first barrier
            # comes before any read of it).
            for idx in range(tid * WQ, BQ * HEAD, NTHREADS * WQ):
                r = idx // HEAD
                d = idx % HEAD
                if vec and q0 + r < tq and d < e:
                    xs = load_q(q, b, h, q0 + r, d)
                    for w in unroll(WQ):
                        q_chunk[d + w, r] = xs[w] * scale * LOG2E
                else:
                    for w in unroll(WQ):
                        x = ZERO
                        if q0 + r < tq and d + w < e:
                            x = q[b, h, q0 + r, d + w] * scale * LOG2E
                        q_chunk[d + w, r] = x

        for kt in range(n_ktiles):
            j0 = lo + kt * BK
            if BLOCKS:  # the same for every thread: an empty tile is skipped
                if tile_kind(kinds, b, h, q0, min(q0 + BQ, tq) - 1, j0, min(j0 + BK, hi) - 1,
                             bq, bk) == 0:
                    continue

            # S = (scale·Q) Kᵀ, through shared memory D_CHUNK features at a time.
            for n in unroll(S_LEN):
                s[n] = ZERO
            for dc in range(0, HEAD, D_CHUNK):
                # Each phase indexes from this thread's indices plus a zero the
                # compiler cannot see through: the index arithmetic (64-bit, two
                # registers a value) is then redone in the phase, not hoisted out
                # of the loops and held in registers across all of them.
                z = opaque_zero()
                tid_c, rg_c, kg_c = tid + z, rg + z, kg + z
                if dc == 0:  # the tile's first K chunk, to registers
                    for n in unroll(PRE // WK):
                        r = (tid_c + n * NTHREADS) * WK // D_CHUNK
                        d = (tid_c + n * NTHREADS) * WK % D_CHUNK
                        if vec and j0 + r < hi and d < e:
                            xs = load_k(k, b, hk, j0 + r, d)
                            for w in unroll(WK):
                                k_next[n * WK + w] = xs[w]
                        else:
                            for w in unroll(WK):
                                x = ZERO
                                if j0 + r < hi and d + w < e:
                                    x = k[b, hk, j0 + r, d + w]
                                k_next[n * WK + w] = x
                cuda.syncthreads()  # the previous chunk (or P·V) is read
                dq0 = z
                if Q_RESIDENT:
                    dq0 += dc  # this chunk's features in the resident Qᵀ
                else:
                    for idx in range(tid_c * WQ, BQ * D_CHUNK, NTHREADS * WQ):
                        r = idx // D_CHUNK
                        d = idx % D_CHUNK
                        if vec and q0 + r < tq and dc + d < e:
                            xs = load_q(q, b, h, q0 + r, dc + d)
                            for w in unroll(WQ):
                                q_chunk[d + w, r] = xs[w] * scale * LOG2E
                        else:
                            for w in unroll(WQ):
                                x = ZERO
                                if q0 + r < tq and dc + d + w < e:
                                    x = q[b, h, q0 + r, dc + d + w] * scale * LOG2E
                                q_chunk[d + w, r] = x
                for n in unroll(PRE // WK):
                    r = (tid_c + n * NTHREADS) * WK // D_CHUNK
                    d = (tid_c + n * NTHREADS) * WK % D_CHUNK
                    for w in unroll(WK):
                        k_chunk[d + w, r] = k_next[n * WK + w]
                cuda.syncthreads()
                # The next K chunk's loads are issued now and land in registers
                # while this chunk's multiply-adds run (a register double buffer).
                if dc + D_CHUNK < HEAD:
                    for n in unroll(PRE // WK):
                        r = (tid_c + n * NTHREADS) * WK // D_CHUNK
                        d = dc + D_CHUNK + (tid_c + n * NTHREADS) * WK % D_CHUNK
                        if vec and j0 + r < hi and d < e:
                            xs = load_k(k, b, hk, j0 + r, d)
                            for w in unroll(WK):
                                k_next[n * WK + w] = xs[w]
                        else:
                            for w in unroll(WK):
                                x = ZERO
                                if j0 + r < hi and d + w < e:
                                    x = k[b, hk, j0 + r, d + w]
                                k_next[n * WK + w] = x
                for d in range(D_CHUNK):
                    for i in unroll(R):
                        a[i] = q_chunk[dq0 + d, R * rg_c + i]
                    for c in unroll(KC):
                        for u in unroll(4):
                            y = k_chunk[d + z, 32 * c + 4 * kg_c + u]
                            for i in unroll(R):
                                s[RS * c + 4 * i + u] += a[i] * y

            # The scores go to Pᵀ in shared memory; the rules and the softmax read
            # them there in loops left rolled (unrolled, they would multiply the
            # kernel's code, and its compile time, by the patch size).
            z = opaque_zero()
            rg_s, kg_s = rg + z, kg + z
            for c in unroll(KC):
                for u in unroll(4):
                    for i in unroll(R):
                        p_tile[32 * c + 4 * kg_s + u, R * rg_s + i] = s[RS * c + 4 * i + u]
            # The tile's first V chunk, to registers: its loads land while the
            # softmax runs.
            for n in unroll(VPT // WV):
                r = (tid + z + n * NTHREADS) * WV // HEAD
                d = (tid + z + n * NTHREADS) * WV % HEAD
                if vec and j0 + r < hi and d < ev:
                    xs = load_v(v, b, hk, j0 + r, d)
                    for w in unroll(WV):
                        v_next[n * WV + w] = xs[w]
                else:
                    for w in unroll(WV):
                        x = ZERO
                        if j0 + r < hi and d + w < ev:
                            x = v[b, hk, j0 + r, d + w]
                        v_next[n * WV + w] = x

            # Read per tile from the kernel's arguments, like the mask's
            # parameters below: held across the key loop, they would take
            # registers the patches need.
            cap, inv_cap, slope = head_modifiers(MODS, rules, slopes, b + z, h + z, LOG2E)
            if TILE_PASS:
                # A mask is applied to the whole tile by all threads together, key
                # fastest (consecutive threads read consecutive mask entries), with
                # the modifiers before it; its parameters are read per tile.
                cuda.syncthreads()
                mb, mh, mi_step, mj_step = mask_steps(MASKED, mask, mask_batch, b + z, h)
                if BLOCKS:  # a full tile needs no mask_mod (its kind read again here:
                    # held from the loop's start, it would take registers)
                    kind = tile_kind(kinds, b + z, h, q0, min(q0 + BQ, tq) - 1, j0,
                                     min(j0 + BK, hi) - 1, bq, bk)
                for idx in range(tid + z, BQ * BK, NTHREADS):
                    jj = idx % BK
                    r = idx // BK
                    row = q0 + z + r
                    if row < tq and j0 + jj < hi:
                        x = p_tile[jj, r]
                        if MODS:
                            x = modify(x, row + pos_offset, j0 + jj, cap, inv_cap, slope)
                        if USER_SCORE:
                            # the rule takes and gives natural-log scores
                            x, _ = score_element(x * LN2, b, h, row, j0 + jj, fb, ib, meta)
                            x *= LOG2E
                        if USER_MASK and not (BLOCKS and kind == 2) and not mask_element(
                                b, h, row, j0 + jj, fb, ib, meta):
                            x = NEG_INF
                        elif BOOL_MASK:
                            if not mask[mb, mh, row * mi_step, (j0 + jj) * mj_step]:
                                x = NEG_INF
                        elif FLOAT_MASK:
                            x += mask[mb, mh, row * mi_step, (j0 + jj) * mj_step] * LOG2E
                        p_tile[jj, r] = x
                cuda.syncthreads()

            if SEGMENTS:  # the batch row redone per row below, not held in a register
                zr = opaque_zero()
            for i in unroll(R):
                row = q0 + R * rg_s + i
                p = row + pos_offset
                # Keys of the tile row i sees: [vis_lo, vis_hi) relative to j0.
                vis_lo, vis_hi = row_keys(p, rules, j0, hi)
                if SEGMENTS:  # and of its segment
                    s_lo, s_hi = segment_of(segments, b + zr, min(row, tq - 1))
                    vis_lo = max(vis_lo, s_lo)
                    vis_hi = min(vis_hi, s_hi)
                vis_lo -= j0
                vis_hi -= j0
                if row >= tq:
                    vis_hi = vis_lo
                mt = NEG_INF
                for n in range(4 * KC):
                    jj = 32 * (n // 4) + 4 * kg_s + n % 4
                    x = p_tile[jj, R * rg_s + i]
                    if MODS and not TILE_PASS:
                        x = modify(x, p, j0 + jj, cap, inv_cap, slope)
                    if jj < vis_lo or jj >= vis_hi:
                        x = NEG_INF
                    p_tile[jj, R * rg_s + i] = x
                    if x > mt or x != x:
                        mt = x
                mt = row_max(mt)

                # Online softmax for row i: new maximum, rescaled state, weights.
                m_new = m[i]
                if mt > m_new or mt != mt:
                    m_new = mt
                if m_new != m[i]:
                    alpha = ZERO
                    if m_new != NEG_INF:
                        alpha = math.exp2(m[i] - m_new)
                    l[i] *= alpha
                    for c in unroll(OC):
                        for u in unroll(4):
                            o[RS * c + 4 * i + u] *= alpha
                    m[i] = m_new
                total = ZERO
                for n in range(4 * KC):
                    jj = 32 * (n // 4) + 4 * kg_s + n % 4
                    w = ZERO
                    if m_new != NEG_INF:
                        w = math.exp2(p_tile[jj, R * rg_s + i] - m_new)
                    total += w
                    p_tile[jj, R * rg_s + i] = w
                l[i] += total  # l (and lse) before dropout, P·V after it

            # Dropout on this thread's weights in Pᵀ, in a loop left rolled: the
            # cipher is long, one copy of it is enough.
            if dropping:
                # weight (b, h, i, j) has the flat index ((b·H + h)·Tq + i)·Tk + j
                pair_n = ((b + opaque_zero()) * n_heads + h) * tq
                for n in range(S_LEN):
                    jj = 32 * (n // RS) + 4 * kg + n % 4
                    ii = R * rg + (n // 4) % R
                    w = p_tile[jj, ii]
                    if w != ZERO:
                        if kept(keep_word((pair_n + q0 + ii) * tk + j0 + jj,
                                          dropout_key(rules)), rules):
                            p_tile[jj, ii] = w * kept_scale(rules)
                        else:
                            p_tile[jj, ii] = ZERO

            # O += P V, V through shared memory VK keys at a time, the next chunk's
            # loads issued before this chunk's multiply-adds (as K's).
            for vc in range(0, BK, VK):
                z = opaque_zero()
                tid_v, rg_v, kg_v = tid + z, rg + z, kg + z
                cuda.syncthreads()  # Pᵀ written; the previous V chunk read
                for n in unroll(VPT // WV):
                    r = (tid_v + n * NTHREADS) * WV // HEAD
                    d = (tid_v + n * NTHREADS) * WV % HEAD
                    for w in unroll(WV):
                        v_chunk[r, d + w] = v_next[n * WV + w]
                cuda.syncthreads()
                if vc + VK < BK:
                    for n in unroll(VPT // WV):
                        r = vc + VK + (tid_v + n * NTHREADS) * WV // HEAD
                        d = (tid_v + n * NTHREADS) * WV % HEAD
                        if vec and j0 + r < hi and d < ev:
                            xs = load_v(v, b, hk, j0 + r, d)
                            for w in unroll(WV):
                                v_next[n * WV + w] = xs[w]
                        else:
                            for w in unroll(WV):
                                x = ZERO
                                if j0 + r < hi and d + w < ev:
                                    x = v[b, hk, j0 + r, d + w]
                                v_next[n * WV + w] = x
                for jj in range(VK):
                    for i in unroll(R):
                        a[i] = p_tile[vc + jj + z, R * rg_v + i]
                    for c in unroll(OC):
                        for u in unroll(4):
                            f = 32 * c + 4 * kg_v + u
                            if f < HEAD:
                                y = v_chunk[jj + z, f]
                                for i in unroll(R):
                                    o[RS * c + 4 * i + u] += a[i] * y

        # Each row's sum over its eight threads; normalise and write.
        for i in unroll(R):
            l_row = row_sum(l[i])
            row = row_base + i
            if row < tq:
                inv_l = ZERO
                lse_i = NEG_INF
                if l_row != ZERO:
                    inv_l = ONE / l_row
                    lse_i = (m[i] + math.log2(l_row)) * LN2
                for c in unroll(OC):
                    for u in unroll(4):
                        f = 32 * c + 4 * kg + u
                        if f < ev:
                            out[b, h, row, f] = o[RS * c + 4 * i + u] * inv_l
                if kg == 0:
                    lse[b, h, row] = lse_i

    kernel = unrolled(tiled_kernel, {**globals(), **locals()})
    mods_name = "_mods" if mods else ""
    kernel.__name__ = kernel.__qualname__ = (
        f"tiled_{dtype}_head{bucket}_{mask_kind}{mods_name}{suffix(user)}"
        f"{blocks.suffix(masks)}")
    return kernel


@functools.cache
def compiled_kernel(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                    user: UserKey | None = None, masks: blocks.MaskKey | None = None) -> Any:
    """The kernel for one specialisation, compiled on first use and cached."""
    fn = make_kernel_function(dtype, bucket, mask_kind, mods, user, masks)
    if simulator_enabled():
        return _cuda().jit(_signature(dtype, mask_kind))(fn)
    return _cuda().jit(_signature(dtype, mask_kind),
                                  launch_bounds=launch_bounds(dtype, bucket))(fn)


def specializations() -> list[tuple[Any, Any]]:
    """Every (Python kernel function, Numba signature) pair the launcher may compile."""
    return [(make_kernel_function(dtype, bucket, mask_kind, mods), _signature(dtype, mask_kind))
            for dtype in DTYPES for bucket in HEAD_DIM_BUCKETS for mask_kind in MASK_KINDS
            for mods in (False, True)]


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
              scale: float, xp: Any) -> tuple[Array, Array]:
    """``(out, lse)`` in the inputs' dtype (float32 or float64), one kernel launch.

    Arguments as :func:`.facade.attention`, which calls this for every call
    it does not keep (:func:`unsupported`).

    Raises
    ------
    ValueError
        A decoding shape (:func:`unsupported`), or a head size above 256.
    """
    tq, e = q.shape[-2:]
    why = unsupported(tq)
    if why is not None:
        raise ValueError(f"the register-tiled kernel cannot take this call: {why}")
    bucket = head_bucket(e, v.shape[-1])
    dtype = common_dtype(query=q, key=k, value=v)
    return launch_tiles(
        q, k, v, mask=mask, rules=rules, scale=scale, xp=xp,
        kernel_for=lambda mask_kind, mods, user, masks: compiled_kernel(
            dtype, bucket, mask_kind, mods, user, masks),
        rows=BLOCK_Q, threads=threads(bucket), vector_flag=True, user_rules=True)
