"""The backward pass of the register-tiled kernel: FlashAttention-2's split in FFMA.

The gradients of :mod:`.rows_backward` (its docstring gives the maths:
``P = exp(s − lse)``, ``dV = (P∘Z)ᵀ dO``, ``dS = P∘(dP∘Z − D)∘(1 − tanh²)``,
``dQ = scale·dS K``, ``dK = scale·dSᵀ Q``, with ``D = rowsum(dO∘O) − dlse``
computed with the input library before the launch), laid out as the
forward of :mod:`.tiled`: blocks of 64 rows, eight threads per
row group, each thread a patch of ``R`` rows × 4 columns of every 32-column
tile, the operands through shared memory feature-major (``DC`` features at
a time), loops over a patch unrolled (:mod:`.unroll`) so that it stays in
registers, each phase indexing from an opaque zero. Two kernels, no atomics,
deterministic:

* **dQ kernel.** A block owns 64 query rows of one (batch, head) pair and
  walks the key tiles (``BK`` = 32 keys) its rows can see. Per tile, the
  score patch ``S = (scale·Q) Kᵀ`` (Qᵀ and Kᵀ chunks) and then the patch
  ``dP = dO Vᵀ`` (dOᵀ and Vᵀ chunks, the same registers) go to shared
  memory (Sᵀ and dPᵀ, key-major); one loop, left rolled (one copy of the
  rules and of the dropout cipher), turns each of the thread's pairs into
  ``dS`` in place: rules, visibility, ``P``, ``Z``, ``D`` (per row, from
  shared memory), the soft-cap derivative. ``dQ += dS K`` is then spread as
  the forward's ``O = P V``: thread ``tid`` keeps rows ``R·(tid // 8) + i``
  and features ``32·c + 4·(tid % 8) + u`` of dQ in registers, fed by one
  ``dS`` and one K value per multiply-add, K streamed ``VK`` keys at a time.
* **dK/dV kernel.** A block owns 64 keys of one (batch, key/value head) pair
  (``R`` keys per thread, :func:`dkdv_rows_per_thread`), loops over the
  ``G`` query heads of the group and over the query tiles (``BQT`` = 32
  rows) that can see any of its keys, and per tile recomputes the transposed
  patches ``Sᵀ = K (scale·Q)ᵀ`` and ``dPᵀ = V dOᵀ``; the rolled loop leaves
  ``P∘Z`` and ``dS`` in shared memory (query-major), and ``dV += (P∘Z)ᵀ dO``
  and ``dK += dSᵀ Q`` accumulate in two register patches (keys × features),
  dO and then Q streamed ``VK`` rows at a time. The sums over the query heads
  of a group stay in the thread's registers: no atomics.

Every rule is applied per pair as in the forward (:mod:`polyattn.rules.element`,
whose ``modify_and_grad`` gives the soft-cap derivative too): the mask (bool or float,
read through its strides and the batch table), causality, windows and key
lengths as visibility, soft-capping (and its derivative), ALiBi, dropout by
the forward's Philox counters on the weight's flat index
``((b·H + h)·Tq + i)·Tk + j``. A pair that is invisible, or whose weight is
0 (rows with ``lse = −inf`` among them), gives ``dS = 0`` and ``P∘Z = 0``
without any product (an infinite ``dO·v`` there cannot give NaN); NaN in the
inputs propagates to the gradients it reaches, as in the one-thread-per-row
kernels. The dense products ``dS K`` and ``dSᵀ Q`` also multiply the zero
``dS`` of invisible pairs: a K or Q value that is not finite goes into their
row-major chunks as 0, which changes nothing else (such a row's or key's
scores are all NaN or −∞, so each of its ``dS`` is NaN, which still
propagates, or 0, whose product is then 0 as in the row kernels). ``dV +=
(P∘Z)ᵀ dO`` has no such guard: a non-finite ``dO`` row reaches every key of
its tile. Keys past ``min(Tk, key_lengths[b])`` are never read.

Where q, k, v and dO allow it (:func:`.inputs.vector_loads_fit`), the
chunks are read as in the forward, 16 bytes per load with 32-bit address
arithmetic; other inputs element by element with 64-bit indices (a kernel
argument picks the path; both give the same bits).

Registers (float32, the 128-register launch bound of the forward; sm_80 and
sm_90 alike, ``test_cuda_ptx.py``): dQ 112-128 without spills (but 4 bytes in
two head-64 specialisations on sm_90); dK/dV 124-128 with up to 108 bytes of
spill stores (head size 64 with a mask and modifiers; none or a few dozen
bytes elsewhere), none of them in an innermost loop. float64 at head size 256
spills heavily in dK/dV (one key per thread still holds 64 double
accumulators, with 64 registers a thread at 512 threads a block), and its
small head sizes spill up to 196 bytes in some specialisations.

Shared memory: one buffer serves the feature-major chunks and, later in a
tile, the row-major ``VK``-row chunks; with the two 32 × 68 score tiles and
the per-row ``lse`` and ``D``, float64 head sizes above 64 take ``VK`` = 8 or
4 to stay within 48 KiB (:func:`shared_bytes`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from polyattn._interop import simulator_enabled
from polyattn.backends.cuda import blocks
from polyattn.backends.cuda import mma as _mma
from polyattn.backends.cuda import rows_backward as numba_cuda_backward
from polyattn.backends.cuda.environment import DTYPES, HEAD_DIM_BUCKETS, MASK_KINDS, _cuda
from polyattn.backends.cuda.launch import check_grid, launch_backward
from polyattn.backends.cuda.philox import philox_function
from polyattn.backends.cuda.unroll import unroll, unrolled
from polyattn.backends.cuda.user_rules import UserKey, device_functions, suffix
from polyattn.rules import element
from polyattn.rules.lowering import lower
from polyattn.rules.visibility import Rules

#: The functions of :mod:`polyattn.rules.element` both kernels lower.
_ELEMENT = (element.row_position, element.key_length, element.visible, element.head_modifiers,
            element.mask_steps, element.modify_and_grad, element.drops, element.dropout_key,
            element.kept, element.kept_scale)

Array = Any

BLOCK_Q = 64  # query rows per dQ block
BLOCK_KV = 64  # keys per dK/dV block
BK = 32  # keys per tile of the dQ kernel
BQT = 32  # query rows per tile of the dK/dV kernel
DC = 16  # features per feature-major shared-memory chunk
SHARED_LIMIT = 48 * 1024  # static shared memory of one block, bytes

# ``numba.cuda``, bound by the kernel factories (the simulator swaps it for its own).
cuda: Any = None


def dq_rows_per_thread(bucket: int) -> int:
    """Query rows of a dQ thread's patches: the forward's (4, or 2 above head size 64),
    and 1 at head size 256 (sm_90, float32: 2 rows spill 76 bytes under the
    128-register bound, 1 row none)."""
    if bucket <= 64:
        return 4
    return 2 if bucket <= 128 else 1


def dkdv_rows_per_thread(bucket: int) -> int:
    """Keys of a dK/dV thread's patches: it holds two accumulator patches (dK and
    dV) of ``R × 4·ceil(head/32)`` values each, so 2 keys up to head size 64 and
    1 above (sm_90, float32, under the 128-register bound: 4 keys spill from head
    size 32 on, 2 keys at head size 128 spill 220 bytes; 1 key there takes 126
    registers and no spill)."""
    return 2 if bucket <= 64 else 1


def dq_threads(bucket: int) -> int:
    """Threads of a dQ block: eight per row group."""
    return 8 * BLOCK_Q // dq_rows_per_thread(bucket)


def dkdv_threads(bucket: int) -> int:
    """Threads of a dK/dV block: eight per key group."""
    return 8 * BLOCK_KV // dkdv_rows_per_thread(bucket)


def launch_bounds(dtype: str, n_threads: int) -> tuple[int, ...]:
    """A kernel's launch bounds: its block size and, in float32, enough resident
    blocks per multiprocessor that ptxas keeps to 128 registers per thread."""
    return (n_threads, max(1, 65536 // (128 * n_threads))) if dtype == "float32" else (
        n_threads,)


def _chunk_len(bucket: int, vk: int) -> int:
    """Values of the shared chunk buffer: two feature-major chunks (64 and 32 rows
    wide) or ``vk`` row-major rows of the head size."""
    dc = min(DC, bucket)
    return max(dc * (BLOCK_Q + 4) + dc * (BK + 4), vk * (bucket + 4))


def shared_bytes(dtype: str, bucket: int, vk: int | None = None) -> int:
    """Static shared memory of a block of either kernel (the dQ kernel's, the
    larger): the chunk buffer, two 32 × 68 score tiles and 64 rows' lse and D."""
    item = np.dtype(dtype).itemsize
    vk = v_keys(dtype, bucket) if vk is None else vk
    return item * (_chunk_len(bucket, vk) + 2 * BK * (BLOCK_Q + 4) + 2 * BLOCK_Q)


def v_keys(dtype: str, bucket: int) -> int:
    """Rows per row-major chunk (K in dQ; dO and Q in dK/dV): 16, or fewer where
    the block's shared memory would pass 48 KiB (float64, head sizes above 64)."""
    for vk in (16, 8, 4):
        if shared_bytes(dtype, bucket, vk) <= SHARED_LIMIT:
            return vk
    raise ValueError(f"no chunk size fits {dtype} head size {bucket} in shared memory")


def _signature(dtype: str, mask_kind: str, outputs: int) -> Any:
    """The signature of :func:`.rows_backward._signature` and one more int64: 1
    where q, k, v and dO may be read by vector loads
    (:func:`.inputs.vector_loads_fit`)."""
    from numba import types

    base = numba_cuda_backward._signature(dtype, mask_kind, outputs)
    return types.void(*base.args, types.int64)


def _constants(dtype: str, bucket: int, rows: int) -> dict[str, Any]:
    """The compile-time constants both kernels share (``rows``: R)."""
    np_t = np.dtype(dtype).type
    vk = v_keys(dtype, bucket)
    d_chunk = min(DC, bucket)
    return dict(
        np_t=np_t, ZERO=np_t(0.0), ONE=np_t(1.0), NEG_INF=np_t(-np.inf),
        HEAD=bucket, R=rows, NTHREADS=8 * 64 // rows, D_CHUNK=d_chunk, VK=vk,
        KC=1,  # groups of 32 columns (keys in dQ, queries in dK/dV) per tile
        OC=(bucket + 31) // 32,  # groups of 4 features per thread in an accumulator
        RS=4 * rows, S_LEN=4 * rows, O_LEN=4 * rows * ((bucket + 31) // 32),
        A_STRIDE=64 + 4,  # feature-major chunk of the block's 64 rows
        B_STRIDE=32 + 4,  # feature-major chunk of the tile's 32 columns
        B_OFF=d_chunk * (64 + 4),
        ROW_STRIDE=bucket + 4,  # row-major chunk
        CHUNK_LEN=_chunk_len(bucket, vk),
        P_SHAPE=(32, 64 + 4),  # score tiles: 32 tile columns × the block's 64 rows
    )


@functools.cache
def make_dq_function(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                     user: UserKey | None = None, masks: blocks.MaskKey | None = None) -> Any:
    """The Python dQ kernel function for one specialisation (not yet compiled)."""
    global cuda
    cuda = _cuda()
    from numba import types

    ops = _mma.device_ops(simulator_enabled())
    opaque_zero = ops.opaque_zero
    # Values per global load where the inputs allow vector loads (``vec``): 16 bytes.
    W = 16 // np.dtype(dtype).itemsize
    load = getattr(ops, f"load_vector{W}")
    keep_word = philox_function()
    acc_t = getattr(types, dtype)
    BOOL_MASK, FLOAT_MASK, MODS = mask_kind == "bool", mask_kind == "float", mods
    USER_SCORE = user is not None and user[0] is not None
    USER_MASK = user is not None and user[1] is not None
    score_element, mask_element = device_functions(user, dtype)
    SEGMENTS, BLOCKS = masks or (False, False)
    _, segment_span, blocks_keys, _, tile_kind, segment_hides = blocks.device_functions()
    BQ = BLOCK_Q
    consts = _constants(dtype, bucket, dq_rows_per_thread(bucket))
    (row_position, key_length, visible, head_modifiers, mask_steps, modify_and_grad, drops,
     dropout_key, kept, kept_scale) = (lower(f, "cuda", consts["np_t"]) for f in _ELEMENT)
    block_keys = lower(element.block_keys, "cuda", consts["np_t"])
    np_t, ZERO, ONE, NEG_INF = (consts[n] for n in ("np_t", "ZERO", "ONE", "NEG_INF"))
    HEAD, R, NTHREADS, D_CHUNK, VK = (consts[n] for n in ("HEAD", "R", "NTHREADS", "D_CHUNK",
                                                         "VK"))
    KC, OC, RS, S_LEN, O_LEN = (consts[n] for n in ("KC", "OC", "RS", "S_LEN", "O_LEN"))
    A_STRIDE, B_STRIDE, B_OFF, ROW_STRIDE, CHUNK_LEN, P_SHAPE = (
        consts[n] for n in ("A_STRIDE", "B_STRIDE", "B_OFF", "ROW_STRIDE", "CHUNK_LEN",
                            "P_SHAPE"))

    def tiled_dq_kernel(q, k, v, mask, mask_batch, lengths, slopes, do, lse, delta, dq,
                        scale, rules, fb, ib, meta, segments, kinds, bq, bk, vec):
        """dq of 64 query rows of one (batch, head) pair."""
        _, n_heads, tq, e = q.shape
        tk = k.shape[2]
        ev = v.shape[3]
        group = n_heads // k.shape[1]
        n_qtiles = (tq + BQ - 1) // BQ
        # Consecutive blocks take the query tiles of one pair; largest causal work first.
        pair = cuda.blockIdx.x // n_qtiles
        qt = n_qtiles - 1 - cuda.blockIdx.x % n_qtiles
        b = pair // n_heads
        h = pair % n_heads
        hk = h // group
        tid = cuda.threadIdx.x
        rg = tid // 8  # this thread's rows: R·rg … R·rg + R - 1 of the block
        kg = tid % 8  # its keys 4·kg + 32·c + u, and dQ features 32·c + 4·kg + u
        q0 = qt * BQ

        len_b = key_length(lengths, b)
        pos_offset = row_position(0, rules, len_b)  # row i is at i + pos_offset
        lo, hi = block_keys(q0, min(q0 + BQ, tq) - 1, pos_offset, rules, tk, len_b)
        if SEGMENTS:  # the keys of the rows' segments
            lo, hi = segment_span(segments, b, q0, min(q0 + BQ, tq) - 1, lo, hi)
        if BLOCKS:  # the key blocks the block mask leaves to the rows
            lo, hi = blocks_keys(kinds, b, h, q0, min(q0 + BQ, tq) - 1, bq, bk, lo, hi)
        n_ktiles = max(0, (hi - lo + BK - 1) // BK)
        dropping = drops(rules)

        chunk = cuda.shared.array(CHUNK_LEN, acc_t)  # Qᵀ|Kᵀ, dOᵀ|Vᵀ, then K rows
        s_tile = cuda.shared.array(P_SHAPE, acc_t)  # Sᵀ: key-major
        ds_tile = cuda.shared.array(P_SHAPE, acc_t)  # dPᵀ, then dSᵀ
        row_lse = cuda.shared.array(BQ, acc_t)
        row_d = cuda.shared.array(BQ, acc_t)
        s = cuda.local.array(S_LEN, acc_t)  # s[RS·c + 4i + u]: row i, key 4kg + 32c + u
        acc = cuda.local.array(O_LEN, acc_t)  # acc[RS·c + 4i + u]: row i, feature 32c+4kg+u
        a = cuda.local.array(R, acc_t)
        for n in unroll(O_LEN):
            acc[n] = ZERO
        # lse and D of the block's rows (read after the first chunk's barrier).
        for r in range(tid, BQ, NTHREADS):
            x = NEG_INF
            y = ZERO
            if q0 + r < tq:
                x = lse[b, h, q0 + r]
                y = delta[b, h, q0 + r]
            row_lse[r] = x
            row_d[r] = y

        for kt in range(n_ktiles):
            j0 = lo + kt * BK
            if BLOCKS:  # the forward's tiles: an empty one is skipped
                if tile_kind(kinds, b, h, q0, min(q0 + BQ, tq) - 1, j0, min(j0 + BK, hi) - 1,
                             bq, bk) == 0:
                    continue

            # Phase 0: S = (scale·Q) Kᵀ; phase 1: dP = dO Vᵀ; each to its shared tile.
            for ph in unroll(2):
                width = e
                if ph == 1:
                    width = ev
                for n in unroll(S_LEN):
                    s[n] = ZERO
                for dc in range(0, width, D_CHUNK):
                    # Indices from an opaque zero: recomputed here, not held in registers.
                    z = opaque_zero()
                    tid_c, rg_c, kg_c = tid + z, rg + z, kg + z
                    cuda.syncthreads()  # the previous chunk (or tile) is read
                    for idx in range(tid_c * W, BQ * D_CHUNK, NTHREADS * W):
                        r = idx // D_CHUNK
                        d = idx % D_CHUNK
                        if vec and q0 + r < tq and dc + d < width:
                            if ph == 0:
                                xs = load(q, b, h, q0 + r, dc + d)
                                for w in unroll(W):
                                    chunk[(d + w) * A_STRIDE + r] = xs[w] * scale
                            else:
                                xs = load(do, b, h, q0 + r, dc + d)
                                for w in unroll(W):
                                    chunk[(d + w) * A_STRIDE + r] = xs[w]
                        else:
                            for w in unroll(W):
                                x = ZERO
                                if q0 + r < tq and dc + d + w < width:
                                    if ph == 0:
                                        x = q[b, h, q0 + r, dc + d + w] * scale
                                    else:
                                        x = do[b, h, q0 + r, dc + d + w]
                                chunk[(d + w) * A_STRIDE + r] = x
                    for idx in range(tid_c * W, BK * D_CHUNK, NTHREADS * W):
                        r = idx // D_CHUNK
                        d = idx % D_CHUNK
                        if vec and j0 + r < hi and dc + d < width:
                            if ph == 0:
                                xs = load(k, b, hk, j0 + r, dc + d)
                            else:
                                xs = load(v, b, hk, j0 + r, dc + d)
                            for w in unroll(W):
                                chunk[B_OFF + (d + w) * B_STRIDE + r] = xs[w]
                        else:
                            for w in unroll(W):
                                x = ZERO
                                if j0 + r < hi and dc + d + w < width:
                                    if ph == 0:
                                        x = k[b, hk, j0 + r, dc + d + w]
                                    else:
                                        x = v[b, hk, j0 + r, dc + d + w]
                                chunk[B_OFF + (d + w) * B_STRIDE + r] = x
                    cuda.syncthreads()
                    for d in range(D_CHUNK):
                        for i in unroll(R):
                            a[i] = chunk[(d + z) * A_STRIDE + R * rg_c + i]
                        for c in unroll(KC):
                            for u in unroll(4):
                                y = chunk[B_OFF + (d + z) * B_STRIDE + 32 * c + 4 * kg_c + u]
                                for i in unroll(R):
                                    s[RS * c + 4 * i + u] += a[i] * y
                z = opaque_zero()
                rg_s, kg_s = rg + z, kg + z
                for c in unroll(KC):
                    for u in unroll(4):
                        for i in unroll(R):
                            if ph == 0:
                                s_tile[32 * c + 4 * kg_s + u, R * rg_s + i] = s[RS * c + 4 * i + u]
                            else:
                                ds_tile[32 * c + 4 * kg_s + u, R * rg_s + i] = s[RS * c + 4 * i
                                                                                 + u]

            # dS of the thread's pairs, in place in dPᵀ, in a loop left rolled: one
            # copy of the rules and of the dropout cipher. Parameters read per tile.
            z = opaque_zero()
            rg_s, kg_s = rg + z, kg + z
            mb, mh, mi_step, mj_step = mask_steps(BOOL_MASK or FLOAT_MASK, mask, mask_batch,
                                                  b + z, h)
            cap, inv_cap, slope = head_modifiers(MODS, rules, slopes, b + z, h + z, ONE)
            if BLOCKS:  # a full tile needs no mask_mod (read here, not held across the tile)
                kind = tile_kind(kinds, b + z, h, q0, min(q0 + BQ, tq) - 1, j0,
                                 min(j0 + BK, hi) - 1, bq, bk)
            # weight (b, h, i, j) has the flat index ((b·H + h)·Tq + i)·Tk + j
            pair_n = ((b + z) * n_heads + h) * tq
            for n in range(S_LEN):
                jj = 32 * (n // RS) + 4 * kg_s + n % 4
                ii = R * rg_s + (n // 4) % R
                row = q0 + ii
                j = j0 + jj
                p = row + pos_offset
                lse_i = row_lse[ii]
                ds = ZERO
                if row < tq and visible(j, p, rules, hi) and lse_i != NEG_INF and not (
                        SEGMENTS and segment_hides(segments, b, row, j)):
                    raw = s_tile[jj, ii]
                    x = raw
                    grad = ONE  # d(x) / d(raw)
                    if MODS:
                        x, grad = modify_and_grad(raw, p, j, cap, inv_cap, slope)
                    if USER_SCORE:
                        x, du = score_element(x, b, h, row, j, fb, ib, meta)
                        grad *= du
                    seen = True
                    if BOOL_MASK:
                        seen = mask[mb, mh, row * mi_step, j * mj_step]
                    elif FLOAT_MASK:
                        x += mask[mb, mh, row * mi_step, j * mj_step]
                    if USER_MASK and seen and not (BLOCKS and kind == 2):
                        seen = mask_element(b, h, row, j, fb, ib, meta)
                    w = ZERO
                    if seen:
                        w = math.exp(x - lse_i)
                    if w != ZERO:
                        dp = ds_tile[jj, ii]
                        if dropping:
                            if kept(keep_word((pair_n + row) * tk + j, dropout_key(rules)),
                                    rules):
                                dp *= kept_scale(rules)
                            else:
                                dp = ZERO
                        ds = w * (dp - row_d[ii])
                        if MODS or USER_SCORE:
                            ds *= grad
                ds_tile[jj, ii] = ds

            # dQ += dS K, K through shared memory VK keys at a time.
            for vc in range(0, min(BK, hi - j0), VK):
                z = opaque_zero()
                tid_v, rg_v, kg_v = tid + z, rg + z, kg + z
                cuda.syncthreads()  # dSᵀ written; the previous K chunk read
                for idx in range(tid_v * W, VK * HEAD, NTHREADS * W):
                    r = idx // HEAD
                    d = idx % HEAD
                    if vec and j0 + vc + r < hi and d < e:
                        xs = load(k, b, hk, j0 + vc + r, d)
                        for w in unroll(W):
                            x = xs[w]
                            if not math.isfinite(x):
                                x = ZERO  # its pairs' dS are NaN or 0: see the docstring
                            chunk[r * ROW_STRIDE + d + w] = x
                    else:
                        for w in unroll(W):
                            x = ZERO
                            if j0 + vc + r < hi and d + w < e:
                                x = k[b, hk, j0 + vc + r, d + w]
                                if not math.isfinite(x):
                                    x = ZERO
                            chunk[r * ROW_STRIDE + d + w] = x
                cuda.syncthreads()
                for jj in range(VK):
                    for i in unroll(R):
                        a[i] = ds_tile[vc + jj + z, R * rg_v + i]
                    for c in unroll(OC):
                        for u in unroll(4):
                            f = 32 * c + 4 * kg_v + u
                            if f < HEAD:
                                y = chunk[(jj + z) * ROW_STRIDE + f]
                                for i in unroll(R):
                                    acc[RS * c + 4 * i + u] += a[i] * y

        for i in unroll(R):
            row = q0 + R * rg + i
            if row < tq:
                for c in unroll(OC):
                    for u in unroll(4):
                        f = 32 * c + 4 * kg + u
                        if f < e:
                            dq[b, h, row, f] = acc[RS * c + 4 * i + u] * scale

    kernel = unrolled(tiled_dq_kernel, {**globals(), **locals()})
    mods_name = "_mods" if mods else ""
    kernel.__name__ = kernel.__qualname__ = (
        f"tiled_dq_{dtype}_head{bucket}_{mask_kind}{mods_name}{suffix(user)}"
        f"{blocks.suffix(masks)}")
    return kernel


@functools.cache
def make_dkdv_function(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                       user: UserKey | None = None,
                       masks: blocks.MaskKey | None = None) -> Any:
    """The Python dK/dV kernel function for one specialisation (not yet compiled)."""
    global cuda
    cuda = _cuda()
    from numba import types

    ops = _mma.device_ops(simulator_enabled())
    opaque_zero = ops.opaque_zero
    # Values per global load where the inputs allow vector loads (``vec``): 16 bytes.
    W = 16 // np.dtype(dtype).itemsize
    load = getattr(ops, f"load_vector{W}")
    keep_word = philox_function()
    acc_t = getattr(types, dtype)
    BOOL_MASK, FLOAT_MASK, MODS = mask_kind == "bool", mask_kind == "float", mods
    USER_SCORE = user is not None and user[0] is not None
    USER_MASK = user is not None and user[1] is not None
    score_element, mask_element = device_functions(user, dtype)
    SEGMENTS, BLOCKS = masks or (False, False)
    _, segment_span, _, blocks_queries, tile_kind, segment_hides = blocks.device_functions()
    BKV = BLOCK_KV
    consts = _constants(dtype, bucket, dkdv_rows_per_thread(bucket))
    (row_position, key_length, visible, head_modifiers, mask_steps, modify_and_grad, drops,
     dropout_key, kept, kept_scale) = (lower(f, "cuda", consts["np_t"]) for f in _ELEMENT)
    block_queries = lower(element.block_queries, "cuda", consts["np_t"])
    np_t, ZERO, ONE, NEG_INF = (consts[n] for n in ("np_t", "ZERO", "ONE", "NEG_INF"))
    HEAD, R, NTHREADS, D_CHUNK, VK = (consts[n] for n in ("HEAD", "R", "NTHREADS", "D_CHUNK",
                                                         "VK"))
    KC, OC, RS, S_LEN, O_LEN = (consts[n] for n in ("KC", "OC", "RS", "S_LEN", "O_LEN"))
    A_STRIDE, B_STRIDE, B_OFF, ROW_STRIDE, CHUNK_LEN, P_SHAPE = (
        consts[n] for n in ("A_STRIDE", "B_STRIDE", "B_OFF", "ROW_STRIDE", "CHUNK_LEN",
                            "P_SHAPE"))

    def tiled_dkdv_kernel(q, k, v, mask, mask_batch, lengths, slopes, do, lse, delta, dk, dv,
                          scale, rules, fb, ib, meta, segments, kinds, bq, bk, vec):
        """dk and dv of 64 keys of one (batch, key/value head) pair, summed over the
        query heads of its group."""
        _, n_heads, tq, e = q.shape
        n_kv_heads = k.shape[1]
        tk = k.shape[2]
        ev = v.shape[3]
        group = n_heads // n_kv_heads
        n_ktiles = (tk + BKV - 1) // BKV
        pair = cuda.blockIdx.x // n_ktiles
        kt = cuda.blockIdx.x % n_ktiles  # first keys first: most causal work first
        b = pair // n_kv_heads
        hk = pair % n_kv_heads
        tid = cuda.threadIdx.x
        rg = tid // 8  # this thread's keys: R·rg … R·rg + R - 1 of the block
        kg = tid % 8  # its queries 4·kg + 32·c + u, and dK/dV features 32·c + 4·kg + u
        k0 = kt * BKV

        # Keys of this block that exist, and the queries that may see one of them.
        len_b = key_length(lengths, b)
        pos_offset = row_position(0, rules, len_b)  # row i is at i + pos_offset
        hi = min(tk, len_b)
        last_key = min(k0 + BKV, hi) - 1
        q_lo, q_hi = block_queries(k0, last_key, pos_offset, rules, tq)
        if SEGMENTS and last_key >= k0:  # the queries of the keys' segments
            q_lo, q_hi = segment_span(segments, b, tq + k0, tq + last_key, q_lo, q_hi)
        if BLOCKS and last_key >= k0:  # the query blocks it leaves to some head's keys
            q_lo, q_hi = blocks_queries(kinds, b, hk * group, hk * group + group - 1, k0,
                                        last_key, bq, bk, q_lo, q_hi)
        n_qtiles = 0
        if last_key >= k0:
            n_qtiles = max(0, (q_hi - q_lo + BQT - 1) // BQT)
        dropping = drops(rules)

        chunk = cuda.shared.array(CHUNK_LEN, acc_t)  # Kᵀ|Qᵀ, Vᵀ|dOᵀ, then dO or Q rows
        p_tile = cuda.shared.array(P_SHAPE, acc_t)  # Sᵀ, then P∘Z: query-major
        ds_tile = cuda.shared.array(P_SHAPE, acc_t)  # dPᵀ, then dS
        row_lse = cuda.shared.array(BQT, acc_t)
        row_d = cuda.shared.array(BQT, acc_t)
        s = cuda.local.array(S_LEN, acc_t)  # s[RS·c + 4i + u]: key i, query 4kg + 32c + u
        dk_acc = cuda.local.array(O_LEN, acc_t)  # [RS·c + 4i + u]: key i, feature 32c+4kg+u
        dv_acc = cuda.local.array(O_LEN, acc_t)
        a = cuda.local.array(R, acc_t)
        for n in unroll(O_LEN):
            dk_acc[n] = ZERO
            dv_acc[n] = ZERO

        for g in range(group):
            h = hk * group + g
            for qt in range(n_qtiles):
                i0 = q_lo + qt * BQT
                if BLOCKS:  # the forward's tiles: an empty one (for this head) is skipped
                    if tile_kind(kinds, b, h, i0, min(i0 + BQT, q_hi) - 1, k0, last_key, bq,
                                 bk) == 0:
                        continue
                # lse and D of the tile's rows (read after the first chunk's barrier;
                # the previous tile's reads are behind its own barriers).
                for r in range(tid, BQT, NTHREADS):
                    x = NEG_INF
                    y = ZERO
                    if i0 + r < q_hi:
                        x = lse[b, h, i0 + r]
                        y = delta[b, h, i0 + r]
                    row_lse[r] = x
                    row_d[r] = y

                # Phase 0: Sᵀ = K (scale·Q)ᵀ; phase 1: dPᵀ = V dOᵀ.
                for ph in unroll(2):
                    width = e
                    if ph == 1:
                        width = ev
                    for n in unroll(S_LEN):
                        s[n] = ZERO
                    for dc in range(0, width, D_CHUNK):
                        z = opaque_zero()
                        tid_c, rg_c, kg_c = tid + z, rg + z, kg + z
                        cuda.syncthreads()  # the previous chunk (or tile) is read
                        for idx in range(tid_c * W, BKV * D_CHUNK, NTHREADS * W):
                            r = idx // D_CHUNK
                            d = idx % D_CHUNK
                            if vec and k0 + r < hi and dc + d < width:
                                if ph == 0:
                                    xs = load(k, b, hk, k0 + r, dc + d)
                                else:
                                    xs = load(v, b, hk, k0 + r, dc + d)
                                for w in unroll(W):
                                    chunk[(d + w) * A_STRIDE + r] = xs[w]
                            else:
                                for w in unroll(W):
                                    x = ZERO
                                    if k0 + r < hi and dc + d + w < width:
                                        if ph == 0:
                                            x = k[b, hk, k0 + r, dc + d + w]
                                        else:
                                            x = v[b, hk, k0 + r, dc + d + w]
                                    chunk[(d + w) * A_STRIDE + r] = x
                        for idx in range(tid_c * W, BQT * D_CHUNK, NTHREADS * W):
                            r = idx // D_CHUNK
                            d = idx % D_CHUNK
                            if vec and i0 + r < q_hi and dc + d < width:
                                if ph == 0:
                                    xs = load(q, b, h, i0 + r, dc + d)
                                    for w in unroll(W):
                                        chunk[B_OFF + (d + w) * B_STRIDE + r] = xs[w] * scale
                                else:
                                    xs = load(do, b, h, i0 + r, dc + d)
                                    for w in unroll(W):
                                        chunk[B_OFF + (d + w) * B_STRIDE + r] = xs[w]
                            else:
                                for w in unroll(W):
                                    x = ZERO
                                    if i0 + r < q_hi and dc + d + w < width:
                                        if ph == 0:
                                            x = q[b, h, i0 + r, dc + d + w] * scale
                                        else:
                                            x = do[b, h, i0 + r, dc + d + w]
                                    chunk[B_OFF + (d + w) * B_STRIDE + r] = x
                        cuda.syncthreads()
                        for d in range(D_CHUNK):
                            for i in unroll(R):
                                a[i] = chunk[(d + z) * A_STRIDE + R * rg_c + i]
                            for c in unroll(KC):
                                for u in unroll(4):
                                    y = chunk[B_OFF + (d + z) * B_STRIDE + 32 * c + 4 * kg_c
                                              + u]
                                    for i in unroll(R):
                                        s[RS * c + 4 * i + u] += a[i] * y
                    z = opaque_zero()
                    rg_s, kg_s = rg + z, kg + z
                    for c in unroll(KC):
                        for u in unroll(4):
                            for i in unroll(R):
                                if ph == 0:
                                    p_tile[32 * c + 4 * kg_s + u, R * rg_s + i] = s[
                                        RS * c + 4 * i + u]
                                else:
                                    ds_tile[32 * c + 4 * kg_s + u, R * rg_s + i] = s[
                                        RS * c + 4 * i + u]

                # P∘Z and dS of the thread's pairs, in place, in a loop left rolled.
                z = opaque_zero()
                rg_s, kg_s = rg + z, kg + z
                mb, mh, mi_step, mj_step = mask_steps(BOOL_MASK or FLOAT_MASK, mask, mask_batch,
                                                      b + z, h)
                cap, inv_cap, slope = head_modifiers(MODS, rules, slopes, b + z, h + z, ONE)
                if BLOCKS:  # a full tile needs no mask_mod (read here, not held)
                    kind = tile_kind(kinds, b + z, h, i0, min(i0 + BQT, q_hi) - 1, k0,
                                     last_key, bq, bk)
                pair_n = ((b + z) * n_heads + h) * tq
                for n in range(S_LEN):
                    ii = 32 * (n // RS) + 4 * kg_s + n % 4
                    jj = R * rg_s + (n // 4) % R
                    i = i0 + ii
                    j = k0 + jj
                    p = i + pos_offset
                    lse_i = row_lse[ii]
                    pz = ZERO
                    ds = ZERO
                    if visible(j, p, rules, hi) and lse_i != NEG_INF and not (
                            SEGMENTS and segment_hides(segments, b, tq + j, i)):
                        raw = p_tile[ii, jj]
                        x = raw
                        grad = ONE  # d(x) / d(raw)
                        if MODS:
                            x, grad = modify_and_grad(raw, p, j, cap, inv_cap, slope)
                        if USER_SCORE:
                            x, du = score_element(x, b, h, i, j, fb, ib, meta)
                            grad *= du
                        seen = True
                        if BOOL_MASK:
                            seen = mask[mb, mh, i * mi_step, j * mj_step]
                        elif FLOAT_MASK:
                            x += mask[mb, mh, i * mi_step, j * mj_step]
                        if USER_MASK and seen and not (BLOCKS and kind == 2):
                            seen = mask_element(b, h, i, j, fb, ib, meta)
                        w = ZERO
                        if seen:
                            w = math.exp(x - lse_i)
                        if w != ZERO:
                            zf = ONE
                            if dropping:
                                if kept(keep_word((pair_n + i) * tk + j, dropout_key(rules)),
                                        rules):
                                    zf = kept_scale(rules)
                                else:
                                    zf = ZERO
                            pz = w * zf
                            ds = w * (ds_tile[ii, jj] * zf - row_d[ii])
                            if MODS or USER_SCORE:
                                ds *= grad
                    p_tile[ii, jj] = pz
                    ds_tile[ii, jj] = ds

                # Pass 0: dV += (P∘Z)ᵀ dO; pass 1: dK += dSᵀ Q; rows VK at a time.
                for ps in unroll(2):
                    width = ev
                    if ps == 1:
                        width = e
                    for vc in range(0, min(BQT, q_hi - i0), VK):
                        z = opaque_zero()
                        tid_v, rg_v, kg_v = tid + z, rg + z, kg + z
                        cuda.syncthreads()  # the weights written; the previous chunk read
                        for idx in range(tid_v * W, VK * HEAD, NTHREADS * W):
                            r = idx // HEAD
                            d = idx % HEAD
                            if vec and i0 + vc + r < q_hi and d < width:
                                if ps == 0:
                                    xs = load(do, b, h, i0 + vc + r, d)
                                else:
                                    xs = load(q, b, h, i0 + vc + r, d)
                                for w in unroll(W):
                                    x = xs[w]
                                    if ps == 1 and not math.isfinite(x):
                                        x = ZERO  # its pairs' dS are NaN or 0
                                    chunk[r * ROW_STRIDE + d + w] = x
                            else:
                                for w in unroll(W):
                                    x = ZERO
                                    if i0 + vc + r < q_hi and d + w < width:
                                        if ps == 0:
                                            x = do[b, h, i0 + vc + r, d + w]
                                        else:
                                            x = q[b, h, i0 + vc + r, d + w]
                                            if not math.isfinite(x):
                                                x = ZERO
                                    chunk[r * ROW_STRIDE + d + w] = x
                        cuda.syncthreads()
                        for ii in range(VK):
                            for i in unroll(R):
                                if ps == 0:
                                    a[i] = p_tile[vc + ii + z, R * rg_v + i]
                                else:
                                    a[i] = ds_tile[vc + ii + z, R * rg_v + i]
                            for c in unroll(OC):
                                for u in unroll(4):
                                    f = 32 * c + 4 * kg_v + u
                                    if f < HEAD:
                                        y = chunk[(ii + z) * ROW_STRIDE + f]
                                        for i in unroll(R):
                                            if ps == 0:
                                                dv_acc[RS * c + 4 * i + u] += a[i] * y
                                            else:
                                                dk_acc[RS * c + 4 * i + u] += a[i] * y

        for i in unroll(R):
            j = k0 + R * rg + i
            if j < tk:
                for c in unroll(OC):
                    for u in unroll(4):
                        f = 32 * c + 4 * kg + u
                        if f < e:
                            dk[b, hk, j, f] = dk_acc[RS * c + 4 * i + u] * scale
                        if f < ev:
                            dv[b, hk, j, f] = dv_acc[RS * c + 4 * i + u]

    kernel = unrolled(tiled_dkdv_kernel, {**globals(), **locals()})
    mods_name = "_mods" if mods else ""
    kernel.__name__ = kernel.__qualname__ = (
        f"tiled_dkdv_{dtype}_head{bucket}_{mask_kind}{mods_name}{suffix(user)}"
        f"{blocks.suffix(masks)}")
    return kernel


@functools.cache
def compiled_dq(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                user: UserKey | None = None, masks: blocks.MaskKey | None = None) -> Any:
    """The dQ kernel for one specialisation, compiled on first use and cached."""
    fn = make_dq_function(dtype, bucket, mask_kind, mods, user, masks)
    sig = _signature(dtype, mask_kind, 1)
    if simulator_enabled():
        return _cuda().jit(sig)(fn)
    return _cuda().jit(sig, launch_bounds=launch_bounds(dtype, dq_threads(bucket)))(
        fn)


@functools.cache
def compiled_dkdv(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                  user: UserKey | None = None, masks: blocks.MaskKey | None = None) -> Any:
    """The dK/dV kernel for one specialisation, compiled on first use and cached."""
    fn = make_dkdv_function(dtype, bucket, mask_kind, mods, user, masks)
    sig = _signature(dtype, mask_kind, 2)
    if simulator_enabled():
        return _cuda().jit(sig)(fn)
    return _cuda().jit(
        sig, launch_bounds=launch_bounds(dtype, dkdv_threads(bucket)))(fn)


def specializations() -> list[tuple[Any, Any]]:
    """Every (Python kernel function, Numba signature) pair the launcher may compile:
    a dQ and a dK/dV kernel per dtype × head bucket × mask kind × modifiers."""
    specs = []
    for dtype in DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            for mask_kind in MASK_KINDS:
                for mods in (False, True):
                    specs.append((make_dq_function(dtype, bucket, mask_kind, mods),
                                  _signature(dtype, mask_kind, 1)))
                    specs.append((make_dkdv_function(dtype, bucket, mask_kind, mods),
                                  _signature(dtype, mask_kind, 2)))
    return specs


def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array, /, *,
             mask: Array | None, rules: Rules, scale: float, xp: Any,
             grad_lse: Array | None = None) -> tuple[Array, Array, Array]:
    """Gradients ``(dq, dk, dv)`` of :func:`.facade.attention`, shaped like
    ``(q, k, v)``, in two kernel launches.

    The contract of :func:`.rows_backward.backward` (without its tile
    sizes): ``out`` and ``lse`` are the forward's results, ``grad_out``
    (B…, H, Tq, Ev) the gradient of ``out``, ``grad_lse`` (B…, H, Tq) that of
    ``lse`` (or ``None``).

    Raises
    ------
    ValueError
        A head size above ``MAX_HEAD_DIM`` or a mask that does not broadcast.
    TypeError
        CPU arrays without the simulator, or a dtype other than float32/float64.
    """
    def launch(dtype: str, bucket: int, inputs: Any, arrays: tuple[Any, ...],
               dq_d: Any, dkdv_d: tuple[Any, Any], stream: Any) -> None:
        n_batch, n_heads, tq = arrays[1].shape  # lse (B, H, Tq)
        n_kv_heads, tk = dkdv_d[0].shape[1:3]
        dq_blocks = n_batch * n_heads * -(-tq // BLOCK_Q)
        kv_blocks = n_batch * n_kv_heads * -(-tk // BLOCK_KV)
        check_grid(dq_blocks, f"B·H·ceil(Tq/{BLOCK_Q})", q)
        check_grid(kv_blocks, f"B·Hkv·ceil(Tk/{BLOCK_KV})", q)
        vec = np.int64(inputs.vector_loads)
        compiled_dq(dtype, bucket, inputs.mask_kind, inputs.mods, inputs.user, inputs.masks)[
            dq_blocks, dq_threads(bucket), stream](*inputs.arrays, *arrays, dq_d,
                                                   *inputs.parameters, *inputs.buffers,
                                                   *inputs.tables, vec)
        compiled_dkdv(dtype, bucket, inputs.mask_kind, inputs.mods, inputs.user,
                      inputs.masks)[kv_blocks, dkdv_threads(bucket), stream](
            *inputs.arrays, *arrays, *dkdv_d, *inputs.parameters, *inputs.buffers,
            *inputs.tables, vec)

    return launch_backward(
        q, k, v, out, lse, grad_out, mask=mask, rules=rules, scale=scale, xp=xp,
        grad_lse=grad_lse, launch=launch)
