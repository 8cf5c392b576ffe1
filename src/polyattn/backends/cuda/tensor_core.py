"""Attention on tensor cores: a Numba CUDA kernel built on warp-wide ``mma.sync``.

Both products of attention, ``S = Q Kᵀ`` and ``O = P V``, run as
``mma.sync`` instructions (:mod:`.mma`), with the softmax and the
accumulators in float32 registers:

``"f16"`` / ``"bf16"``
    ``m16n8k16`` with float16 / bfloat16 operands. Q, K and V are converted
    to the operand type as they are loaded (exact when the caller's arrays were
    float16 / bfloat16, the case ``"auto"`` sends here), the probabilities P
    are rounded to it in registers before ``P V``; every sum is float32.
``"3xtf32"``
    float32 inputs through ``m16n8k8`` TF32 products, each operand split into a
    large and a small TF32 part (``cvt.rna.tf32.f32``) and three products summed,
    small terms first: near float32 accuracy on the tensor cores. Opt-in only
    (``POLYATTN_CUDA_FLOAT32=3xtf32``, for every float32 call that runs the CUDA
    kernel, ``"auto"`` included) until a GPU run shows it meets the float32
    contract and beats the exact kernel.

Work split (FlashAttention-2)
-----------------------------
A block of 128 threads (four warps) owns 64 query rows of one (batch, head)
pair; each warp owns 16 rows, and keeps their Q fragments, their running
maximum ``m`` and sum ``l`` and their 16 × Ev output accumulator in registers
for the whole key loop. The block loads a tile of ``block_k`` keys of K and
of V into shared memory (K row-major, V transposed, as packed pairs of 16-bit
values in 32-bit words, rows padded so that a warp's fragment loads hit 32
different banks). Each warp then walks the tile 16 keys at a time: two
``mma.sync`` chains give its 16 × 16 block of S (a lane holds two rows and
two columns of each 8 keys: ``c_position``), every score rule is applied to
those eight values, the online softmax is updated with maxima over the four
lanes of a group (two warp shuffles), and the probabilities, repacked in
registers as the A operand (the C layout of two 8-key tiles is the A layout
of one 16-key step), are multiplied with the V tile. Steps of 16 keys keep a
lane's scores in eight registers (a whole tile's 32 went to local memory).

The rules are those of :mod:`.rows` (docs/semantics.rst), applied to each
element of S by the functions of :mod:`polyattn.rules.element`: scale,
soft-capping, ALiBi, the mask (read through its strides), causality, windows
and key lengths as visibility, dropout by Philox counters on the weight's flat
index. Blocks load only the key tiles their rows can see (segment ids and
block masks included: :mod:`.blocks`).
Rows that see no key give 0 and ``lse = -inf``; a NaN score makes its row NaN.

Limits
------
* Head sizes up to ``MAX_HEAD[arithmetic]`` (128 for f16/bf16: the 16 × Ev
  accumulator then takes 64 registers per lane; 64 for 3xTF32, whose Q
  fragments are held twice).
* No split-K: decoding shapes (``Tq <= DECODE_MAX_TQ``) go to the exact
  kernel of :mod:`.rows`, which splits long caches across blocks.
* f16/bf16 fragments of K and V come from shared memory by ``ldmatrix`` (x4:
  two 8×16 fragments per instruction); the tiles are stored by plain 32-bit
  stores (no ``cp.async``) and are not double-buffered; 3xTF32 reads its
  float32 tiles word by word.
* The forward pass only: gradients come from the exact backward kernels of
  :mod:`.rows_backward`, which recompute the weights in float32 from the
  saved ``lse``.

On Numba's CUDA simulator the same kernel source runs with
:func:`.mma.simulated_ops`: each ``mma.sync`` gathers the warp's registers,
rebuilds the matrices through the PTX layouts and multiplies them, so the
kernel's index arithmetic is tested without a GPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from polyattn._interop import simulator_enabled
from polyattn.backends.cuda import blocks
from polyattn.backends.cuda import mma as _mma
from polyattn.backends.cuda.environment import MASK_KINDS, _cuda, kernel_choice
from polyattn.backends.cuda.inputs import common_dtype
from polyattn.backends.cuda.launch import DECODE_MAX_TQ, launch_tiles
from polyattn.backends.cuda.philox import philox_function
from polyattn.backends.cuda.user_rules import UserKey, buffer_types, device_functions, suffix
from polyattn.rules import element
from polyattn.rules.lowering import lower, parameter_types
from polyattn.rules.visibility import Rules

Array = Any

ARITHMETICS = ("f16", "bf16", "3xtf32")
BLOCK_Q = 64  # query rows per block: 16 per warp
WARPS = 4
THREADS = WARPS * 32
HEAD_DIM_BUCKETS = (16, 32, 64, 128)
MAX_HEAD = {"f16": 128, "bf16": 128, "3xtf32": 64}

# ``numba.cuda``, bound by the kernel factory; the kernels name it as a module
# global, which the CUDA simulator swaps for its own.
cuda: Any = None


def block_k(arithmetic: str, bucket: int) -> int:
    """Keys per tile: 64, or 32 where float32 tiles of 128 features would not fit
    Numba's 48 KiB of static shared memory."""
    return 64 if arithmetic != "3xtf32" or bucket <= 64 else 32


def head_bucket(arithmetic: str, e: int, ev: int) -> int | None:
    """The compile-time head size for ``max(e, ev)``; None above ``MAX_HEAD``."""
    size = max(e, ev, 1)
    for bucket in HEAD_DIM_BUCKETS:
        if size <= bucket <= MAX_HEAD[arithmetic]:
            return bucket
    return None


def unsupported(arithmetic: str, tq: int, e: int, ev: int) -> str | None:
    """Why the tensor-core kernel cannot take a call, or None when it can."""
    if arithmetic not in ARITHMETICS:
        return f"unknown tensor-core arithmetic {arithmetic!r} (one of {ARITHMETICS})"
    if head_bucket(arithmetic, e, ev) is None:
        return (f"head size {max(e, ev)} exceeds the tensor-core kernel's maximum "
                f"{MAX_HEAD[arithmetic]} for {arithmetic}")
    if tq <= DECODE_MAX_TQ:
        return (f"{tq} query rows: decoding shapes use the exact kernel's key lanes and "
                "split-K")
    return None


def _signature(mask_kind: str) -> Any:
    """Numba signature: float32 strided inputs and outputs."""
    from numba import types

    t = types.float32
    strided = types.Array(t, 4, "A")
    mask_t = types.Array(types.boolean if mask_kind == "bool" else t, 4, "A")
    table = types.Array(types.int64, 1, "A")
    return types.void(
        strided, strided, strided,  # q, k, v
        mask_t, table,  # mask, mask_batch
        table, types.Array(t, 2, "A"),  # key lengths, ALiBi slopes
        strided, types.Array(t, 3, "A"),  # out, lse
        t, parameter_types("float32"),  # scale, the rules (lowering.kernel_parameters)
        *buffer_types("float32"),  # mod_args buffers fb, ib, meta (.user_rules)
        *blocks.table_types(),  # segments, block-mask kinds, its block (.blocks)
    )


@functools.cache
def make_kernel_function(arithmetic: str, bucket: int, mask_kind: str,
                         mods: bool = False, user: UserKey | None = None,
                         masks: blocks.MaskKey | None = None) -> Any:
    """The Python kernel function for one specialisation (not yet compiled); ``user``:
    the call's ``score_mod`` and ``mask_mod`` (:func:`.user_rules.user_key`); ``masks``:
    whether it reads segment ids and a block mask (:func:`.blocks.mask_key`)."""
    global cuda
    cuda = _cuda()
    from numba import types

    ops = _mma.device_ops(simulator_enabled())
    HALF_OPERANDS = arithmetic != "3xtf32"
    mma16 = ops.mma_bf16 if arithmetic == "bf16" else ops.mma_f16
    pack = ops.pack_bf16x2 if arithmetic == "bf16" else ops.pack_f16x2
    mma8, tf32, as_f32 = ops.mma_tf32, ops.tf32_bits, ops.bits_to_f32
    quad_max, quad_sum, opaque_zero = ops.quad_max, ops.quad_sum, ops.opaque_zero
    ldmatrix_x4 = ops.ldmatrix_x4
    # ldmatrix reads 16-byte rows: the tiles start on 16 bytes (the simulator
    # takes no alignment).
    ALIGN = None if simulator_enabled() else 16
    keep_word = philox_function()

    f32, u32 = types.float32, types.uint32
    ZERO, ONE, NEG_INF = np.float32(0.0), np.float32(1.0), np.float32(-np.inf)
    (row_position, key_length, visible, block_keys, head_modifiers, mask_steps, modify, drops,
     dropout_key, kept, kept_scale) = (
        lower(f, "cuda", np.float32) for f in (
            element.row_position, element.key_length, element.visible, element.block_keys,
            element.head_modifiers, element.mask_steps, element.modify, element.drops,
            element.dropout_key, element.kept, element.kept_scale))
    HEAD, BK = bucket, block_k(arithmetic, bucket)
    BQ, NTHREADS = BLOCK_Q, THREADS
    STEPS = BK // 16  # 16-key steps per tile: S, softmax and P V, one after another
    NF = HEAD // 8  # 8-feature tiles of the output per warp
    O_LEN = NF * 4  # per-lane output accumulators
    BOOL_MASK, FLOAT_MASK, MODS = mask_kind == "bool", mask_kind == "float", mods
    USER_SCORE = user is not None and user[0] is not None
    USER_MASK = user is not None and user[1] is not None
    score_element, mask_element = device_functions(user, "float32")
    SEGMENTS, BLOCKS = masks or (False, False)
    segment_of, segment_span, blocks_keys, _, tile_kind, _ = blocks.device_functions()
    if HALF_OPERANDS:
        KS = HEAD // 16  # 16-feature steps of Q Kᵀ
        HP, BP = HEAD // 2, BK // 2  # words per K row / per transposed V row
        K_SHAPE, V_SHAPE = (BK, HP + 4), (HEAD, BP + 4)  # +4 words: conflict-free
        TILE_T: Any = u32
        Q_WORDS = KS * 4
    else:
        KS = HEAD // 8  # 8-feature TF32 steps of Q Kᵀ
        HP, BP = HEAD, BK
        K_SHAPE, V_SHAPE = (BK, HEAD + 4), (BK, HEAD + 4)
        TILE_T = f32
        Q_WORDS = KS * 4

    def tc_kernel(q, k, v, mask, mask_batch, lengths, slopes, out, lse, scale, rules, fb, ib,
                  meta, segments, kinds, bq, bk):
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
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        row0 = qt * BQ + warp * 16 + g  # this lane's two rows of S and O
        row1 = row0 + 8

        len_b = key_length(lengths, b)
        pos_offset = row_position(0, rules, len_b)  # row i is at i + pos_offset
        p0 = row0 + pos_offset
        p1 = row1 + pos_offset
        first_row = qt * BQ
        lo, hi = block_keys(first_row, min(first_row + BQ, tq) - 1, pos_offset, rules, tk,
                            len_b)
        if SEGMENTS:  # the keys of the rows' segments; the lane's two rows'
            lo, hi = segment_span(segments, b, first_row, min(first_row + BQ, tq) - 1, lo, hi)
            s_lo0, s_hi0 = segment_of(segments, b, min(row0, tq - 1))
            s_lo1, s_hi1 = segment_of(segments, b, min(row1, tq - 1))
        if BLOCKS:  # the key blocks the block mask leaves to the rows
            lo, hi = blocks_keys(kinds, b, h, first_row, min(first_row + BQ, tq) - 1, bq, bk,
                                 lo, hi)
        n_ktiles = max(0, (hi - lo + BK - 1) // BK)

        mb, mh, mi_step, mj_step = mask_steps(BOOL_MASK or FLOAT_MASK, mask, mask_batch,
                                              b, h)
        mi0 = min(row0, tq - 1) * mi_step
        mi1 = min(row1, tq - 1) * mi_step

        dropping = drops(rules)
        row_n0 = ((b * n_heads + h) * tq + row0) * tk
        row_n1 = ((b * n_heads + h) * tq + row1) * tk

        cap, inv_cap, slope = head_modifiers(MODS, rules, slopes, b, h, ONE)

        k_tile = cuda.shared.array(K_SHAPE, TILE_T, alignment=ALIGN)
        v_tile = cuda.shared.array(V_SHAPE, TILE_T, alignment=ALIGN)
        q_big = cuda.local.array(Q_WORDS, u32)  # Q fragments (TF32: large parts)
        q_small = cuda.local.array(Q_WORDS, u32)  # TF32: small parts
        s = cuda.local.array(8, f32)  # this lane's scores of 16 keys, then weights
        o = cuda.local.array(O_LEN, f32)  # this lane's output accumulators

        # Q fragments (A operands), zero past Tq and past E.
        for ks in range(KS):
            for r in range(4):
                if HALF_OPERANDS:
                    row = row0 if r % 2 == 0 else row1
                    col = ks * 16 + 2 * t + (8 if r >= 2 else 0)
                    x0 = ZERO
                    x1 = ZERO
                    if row < tq:
                        if col < e:
                            x0 = q[b, h, row, col]
                        if col + 1 < e:
                            x1 = q[b, h, row, col + 1]
                    q_big[ks * 4 + r] = pack(x0, x1)
                else:
                    row = row0 if r % 2 == 0 else row1
                    col = ks * 8 + t + (4 if r >= 2 else 0)
                    x = ZERO
                    if row < tq and col < e:
                        x = q[b, h, row, col]
                    big = tf32(x)
                    q_big[ks * 4 + r] = big
                    q_small[ks * 4 + r] = tf32(x - as_f32(big))
        for n in range(O_LEN):
            o[n] = ZERO
        m0 = NEG_INF
        m1 = NEG_INF
        l0 = ZERO
        l1 = ZERO

        for kt in range(n_ktiles):
            j0 = lo + kt * BK
            if BLOCKS:  # the same for every thread: skip an empty tile; a full one
                # needs no mask_mod
                kind = tile_kind(kinds, b, h, first_row, min(first_row + BQ, tq) - 1, j0,
                                 min(j0 + BK, hi) - 1, bq, bk)
                if kind == 0:
                    continue
            # Tiles: K (BK, HEAD) and V, zero past hi and past the head sizes.
            if HALF_OPERANDS:
                for idx in range(tid, BK * HP, NTHREADS):
                    jj = idx // HP
                    d = 2 * (idx % HP)
                    j = j0 + jj
                    x0 = ZERO
                    x1 = ZERO
                    if j < hi:
                        if d < e:
                            x0 = k[b, hk, j, d]
                        if d + 1 < e:
                            x1 = k[b, hk, j, d + 1]
                    k_tile[jj, idx % HP] = pack(x0, x1)
                for idx in range(tid, BP * HEAD, NTHREADS):
                    d = idx % HEAD
                    jp = idx // HEAD
                    j = j0 + 2 * jp
                    x0 = ZERO
                    x1 = ZERO
                    if d < ev:
                        if j < hi:
                            x0 = v[b, hk, j, d]
                        if j + 1 < hi:
                            x1 = v[b, hk, j + 1, d]
                    v_tile[d, jp] = pack(x0, x1)
            else:
                for idx in range(tid, BK * HEAD, NTHREADS):
                    jj = idx // HEAD
                    d = idx % HEAD
                    j = j0 + jj
                    xk = ZERO
                    xv = ZERO
                    if j < hi:
                        if d < e:
                            xk = k[b, hk, j, d]
                        if d < ev:
                            xv = v[b, hk, j, d]
                    k_tile[jj, d] = xk
                    v_tile[jj, d] = xv
            cuda.syncthreads()
            # Fragment reads index the tiles from this per-tile zero, so that their
            # addresses are formed here rather than held in registers across tiles.
            z = opaque_zero()

            for kk in range(STEPS):  # 16 keys at a time: two 8-key tiles of S
                # S = Q Kᵀ for this warp's 16 rows and keys 16kk … 16kk + 15.
                if HALF_OPERANDS:
                    # One ldmatrix per 16 features gives the B fragments of both
                    # 8-key tiles: lane L points at row L % 8 of matrix L // 8, the
                    # keys of tile L // 16 and the lower or upper 8 features.
                    key_row = kk * 16 + (lane // 16) * 8 + lane % 8 + z
                    word = 4 * ((lane // 8) % 2)
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    c4 = ZERO
                    c5 = ZERO
                    c6 = ZERO
                    c7 = ZERO
                    for ks in range(KS):
                        b0, b1, b2, b3 = ldmatrix_x4(k_tile, key_row, ks * 8 + word)
                        c0, c1, c2, c3 = mma16(
                            q_big[ks * 4], q_big[ks * 4 + 1], q_big[ks * 4 + 2],
                            q_big[ks * 4 + 3], b0, b1, c0, c1, c2, c3)
                        c4, c5, c6, c7 = mma16(
                            q_big[ks * 4], q_big[ks * 4 + 1], q_big[ks * 4 + 2],
                            q_big[ks * 4 + 3], b2, b3, c4, c5, c6, c7)
                    s[0] = c0
                    s[1] = c1
                    s[2] = c2
                    s[3] = c3
                    s[4] = c4
                    s[5] = c5
                    s[6] = c6
                    s[7] = c7
                else:
                    for half in range(2):
                        c0 = ZERO
                        c1 = ZERO
                        c2 = ZERO
                        c3 = ZERO
                        key = kk * 16 + half * 8 + g + z
                        for ks in range(KS):
                            y0 = k_tile[key, ks * 8 + t]
                            y1 = k_tile[key, ks * 8 + 4 + t]
                            big0 = tf32(y0)
                            big1 = tf32(y1)
                            small0 = tf32(y0 - as_f32(big0))
                            small1 = tf32(y1 - as_f32(big1))
                            c0, c1, c2, c3 = mma8(
                                q_small[ks * 4], q_small[ks * 4 + 1], q_small[ks * 4 + 2],
                                q_small[ks * 4 + 3], big0, big1, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma8(
                                q_big[ks * 4], q_big[ks * 4 + 1], q_big[ks * 4 + 2],
                                q_big[ks * 4 + 3], small0, small1, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma8(
                                q_big[ks * 4], q_big[ks * 4 + 1], q_big[ks * 4 + 2],
                                q_big[ks * 4 + 3], big0, big1, c0, c1, c2, c3)
                        s[half * 4] = c0
                        s[half * 4 + 1] = c1
                        s[half * 4 + 2] = c2
                        s[half * 4 + 3] = c3

                # The score rules, element by element, and each row's maximum.
                # s[4·half + r]: row g (r < 2) or g + 8, key 16kk + 8·half + 2t + r % 2.
                mt0 = NEG_INF
                mt1 = NEG_INF
                for n in range(8):
                    upper = n % 4 < 2
                    row = row0 if upper else row1
                    p = p0 if upper else p1
                    j = j0 + kk * 16 + (n // 4) * 8 + 2 * t + n % 2
                    x = s[n] * scale
                    if MODS:
                        x = modify(x, p, j, cap, inv_cap, slope)
                    if USER_SCORE and row < tq and visible(j, p, rules, hi):
                        x, _ = score_element(x, b, h, row, j, fb, ib, meta)
                    if row >= tq or not visible(j, p, rules, hi):
                        x = NEG_INF
                    elif SEGMENTS and (j < (s_lo0 if upper else s_lo1)
                                       or j >= (s_hi0 if upper else s_hi1)):
                        x = NEG_INF
                    elif USER_MASK and not (BLOCKS and kind == 2) and not mask_element(
                            b, h, row, j, fb, ib, meta):
                        x = NEG_INF
                    elif BOOL_MASK:
                        if not mask[mb, mh, mi0 if upper else mi1, j * mj_step]:
                            x = NEG_INF
                    elif FLOAT_MASK:
                        x += mask[mb, mh, mi0 if upper else mi1, j * mj_step]
                    s[n] = x
                    if upper:
                        if x > mt0 or x != x:
                            mt0 = x
                    elif x > mt1 or x != x:
                        mt1 = x
                mt0 = quad_max(mt0)
                mt1 = quad_max(mt1)

                # Online softmax: new maxima, rescaled state, weights of the 16 keys.
                mn0 = m0
                if mt0 > m0 or mt0 != mt0:
                    mn0 = mt0
                mn1 = m1
                if mt1 > m1 or mt1 != mt1:
                    mn1 = mt1
                if mn0 != m0 or mn1 != m1:
                    alpha0 = ONE
                    if mn0 != NEG_INF and mn0 != m0:
                        alpha0 = math.exp(m0 - mn0)
                    alpha1 = ONE
                    if mn1 != NEG_INF and mn1 != m1:
                        alpha1 = math.exp(m1 - mn1)
                    l0 *= alpha0
                    l1 *= alpha1
                    for nf in range(NF):
                        o[nf * 4] *= alpha0
                        o[nf * 4 + 1] *= alpha0
                        o[nf * 4 + 2] *= alpha1
                        o[nf * 4 + 3] *= alpha1
                    m0 = mn0
                    m1 = mn1
                for n in range(8):
                    upper = n % 4 < 2
                    m_row = m0 if upper else m1
                    w = ZERO
                    if m_row != NEG_INF:
                        w = math.exp(s[n] - m_row)
                    if upper:  # l (and lse) before dropout, O after it
                        l0 += w
                    else:
                        l1 += w
                    if dropping and w != ZERO:
                        j = j0 + kk * 16 + (n // 4) * 8 + 2 * t + n % 2
                        if kept(keep_word((row_n0 if upper else row_n1) + j,
                                          dropout_key(rules)), rules):
                            w *= kept_scale(rules)
                        else:
                            w = ZERO
                    s[n] = w

                # O += P V over the 16 keys.
                if HALF_OPERANDS:
                    # The C fragments of the two 8-key tiles are one A fragment.
                    a0 = pack(s[0], s[1])
                    a1 = pack(s[2], s[3])
                    a2 = pack(s[4], s[5])
                    a3 = pack(s[6], s[7])
                    # One ldmatrix gives the B fragments of two 8-feature tiles
                    # (V is stored transposed: features are its rows).
                    for nf in range(0, NF, 2):
                        feature_row = (nf + lane // 16) * 8 + lane % 8 + z
                        b0, b1, b2, b3 = ldmatrix_x4(v_tile, feature_row,
                                                     kk * 8 + 4 * ((lane // 8) % 2))
                        o[nf * 4], o[nf * 4 + 1], o[nf * 4 + 2], o[nf * 4 + 3] = mma16(
                            a0, a1, a2, a3, b0, b1, o[nf * 4], o[nf * 4 + 1], o[nf * 4 + 2],
                            o[nf * 4 + 3])
                        o[nf * 4 + 4], o[nf * 4 + 5], o[nf * 4 + 6], o[nf * 4 + 7] = mma16(
                            a0, a1, a2, a3, b2, b3, o[nf * 4 + 4], o[nf * 4 + 5],
                            o[nf * 4 + 6], o[nf * 4 + 7])
                else:
                    # One k8 step per 8-key tile, its keys taken in the order
                    # 2t ↦ column t, 2t + 1 ↦ column t + 4 (in A and in B alike).
                    for half in range(2):
                        w0 = s[half * 4]
                        w1 = s[half * 4 + 2]
                        w2 = s[half * 4 + 1]
                        w3 = s[half * 4 + 3]
                        ab0 = tf32(w0)
                        ab1 = tf32(w1)
                        ab2 = tf32(w2)
                        ab3 = tf32(w3)
                        as0 = tf32(w0 - as_f32(ab0))
                        as1 = tf32(w1 - as_f32(ab1))
                        as2 = tf32(w2 - as_f32(ab2))
                        as3 = tf32(w3 - as_f32(ab3))
                        key = kk * 16 + half * 8 + 2 * t + z
                        for nf in range(NF):
                            y0 = v_tile[key, nf * 8 + g]
                            y1 = v_tile[key + 1, nf * 8 + g]
                            big0 = tf32(y0)
                            big1 = tf32(y1)
                            small0 = tf32(y0 - as_f32(big0))
                            small1 = tf32(y1 - as_f32(big1))
                            c0, c1, c2, c3 = mma8(as0, as1, as2, as3, big0, big1, o[nf * 4],
                                                  o[nf * 4 + 1], o[nf * 4 + 2], o[nf * 4 + 3])
                            c0, c1, c2, c3 = mma8(ab0, ab1, ab2, ab3, small0, small1,
                                                  c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma8(ab0, ab1, ab2, ab3, big0, big1,
                                                  c0, c1, c2, c3)
                            o[nf * 4] = c0
                            o[nf * 4 + 1] = c1
                            o[nf * 4 + 2] = c2
                            o[nf * 4 + 3] = c3
            cuda.syncthreads()

        # Each row's sum over its group of four lanes; normalise and write.
        l0 = quad_sum(l0)
        l1 = quad_sum(l1)
        for r in range(2):
            row = row0 if r == 0 else row1
            m_row = m0 if r == 0 else m1
            l_row = l0 if r == 0 else l1
            if row < tq:
                inv_l = ZERO
                lse_i = NEG_INF
                if l_row != ZERO:
                    inv_l = ONE / l_row
                    lse_i = m_row + math.log(l_row)
                for nf in range(NF):
                    for c in range(2):
                        col = nf * 8 + 2 * t + c
                        if col < ev:
                            out[b, h, row, col] = o[nf * 4 + 2 * r + c] * inv_l
                if t == 0:
                    lse[b, h, row] = lse_i

    mods_name = "_mods" if mods else ""
    name = (f"tc_{arithmetic}_head{bucket}_{mask_kind}{mods_name}{suffix(user)}"
            f"{blocks.suffix(masks)}")
    tc_kernel.__name__ = tc_kernel.__qualname__ = name
    return tc_kernel


@functools.cache
def compiled_kernel(arithmetic: str, bucket: int, mask_kind: str, mods: bool = False,
                    user: UserKey | None = None, masks: blocks.MaskKey | None = None) -> Any:
    """The kernel for one specialisation, compiled on first use and cached."""
    fn = make_kernel_function(arithmetic, bucket, mask_kind, mods, user, masks)
    return _cuda().jit(_signature(mask_kind))(fn)


def specializations() -> list[tuple[Any, Any]]:
    """Every (Python kernel function, Numba signature) pair the launcher may compile."""
    return [(make_kernel_function(arith, bucket, mask_kind, mods), _signature(mask_kind))
            for arith in ARITHMETICS
            for bucket in HEAD_DIM_BUCKETS if bucket <= MAX_HEAD[arith]
            for mask_kind in MASK_KINDS
            for mods in (False, True)]


def hmma_per_step(arithmetic: str, bucket: int) -> int:
    """``mma.sync`` instructions one warp issues per 16-key step (both products): the
    loop body, so also the count in the kernel's SASS."""
    if arithmetic == "3xtf32":
        return 3 * (2 * (bucket // 8) + 2 * (bucket // 8))
    return 2 * (bucket // 16) + bucket // 8


def ldmatrix_per_step(arithmetic: str, bucket: int) -> int:
    """``ldmatrix`` x4 instructions one warp issues per 16-key step: the K fragments of
    two 8-key tiles per 16 features, the V fragments of two 8-feature tiles per
    16 features (none for 3xTF32, whose float32 tiles are read word by word)."""
    return 0 if arithmetic == "3xtf32" else 2 * (bucket // 16)


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
              scale: float, xp: Any, arithmetic: str) -> tuple[Array, Array]:
    """``(out, lse)`` on tensor cores, in float32 (one kernel launch).

    q, k and v are float32 (B…, H, T, E) arrays (float16 and bfloat16 inputs
    arrive converted; the kernel converts them back to the operand type
    exactly); see :func:`.facade.attention` for the other arguments.

    Raises
    ------
    ValueError
        A call the kernel cannot take (:func:`unsupported`).
    TypeError
        Inputs that are not float32.
    """
    tq, e = q.shape[-2:]
    ev = v.shape[-1]
    why = unsupported(arithmetic, tq, e, ev)
    if why is not None:
        raise ValueError(f"the tensor-core kernel cannot take this call: {why}")
    dtype = common_dtype(query=q, key=k, value=v)
    if dtype != "float32":
        raise TypeError(f"the tensor-core kernel takes float32 arrays, got {dtype}")
    bucket = head_bucket(arithmetic, e, ev)
    assert bucket is not None
    return launch_tiles(
        q, k, v, mask=mask, rules=rules, scale=scale, xp=xp,
        kernel_for=lambda mask_kind, mods, user, masks: compiled_kernel(
            arithmetic, bucket, mask_kind, mods, user, masks),
        rows=BLOCK_Q, threads=THREADS, user_rules=True)


#: ``POLYATTN_CUDA_FLOAT32``: how the CUDA kernel computes float32 inputs.
FLOAT32_VARIABLE = "POLYATTN_CUDA_FLOAT32"
FLOAT32_CHOICES = ("exact", "3xtf32")

_DESCRIPTIONS = {
    "f16": ("tensor cores: float16 operands (mma.sync m16n8k16), float32 scores, softmax "
            "and sums, probabilities rounded to float16 for P·V"),
    "bf16": ("tensor cores: bfloat16 operands (mma.sync m16n8k16), float32 scores, "
             "softmax and sums, probabilities rounded to bfloat16 for P·V"),
    "3xtf32": ("tensor cores: float32 operands split into two TF32 parts, three "
               "mma.sync m16n8k8 products each (3xTF32), float32 softmax and sums"),
}


def float32_choice() -> str:
    """``POLYATTN_CUDA_FLOAT32`` (``"exact"`` when unset); ValueError naming the variable
    for any other value than ``FLOAT32_CHOICES``."""
    import os

    value = os.environ.get(FLOAT32_VARIABLE, "exact").strip().lower() or "exact"
    if value not in FLOAT32_CHOICES:
        raise ValueError(f"{FLOAT32_VARIABLE}={os.environ[FLOAT32_VARIABLE]!r}: expected one "
                         f"of {', '.join(FLOAT32_CHOICES)}")
    return value


def choose(result_dtype: str, tq: int, e: int, ev: int) -> tuple[str | None, str]:
    """``(arithmetic, description)`` of the CUDA kernel for a call whose result dtype is
    ``result_dtype``: ``"f16"``/``"bf16"`` tensor cores for float16/bfloat16 results,
    ``"3xtf32"`` for float32 when ``POLYATTN_CUDA_FLOAT32=3xtf32`` asks for it, else
    None (the exact kernel).

    Examples
    --------
    >>> choose("float16", 4096, 64, 64)[0]
    'f16'
    >>> print(choose("float16", 1, 64, 64)[1])  # doctest: +ELLIPSIS
    exact float32 arithmetic (the tensor-core kernel cannot take this call: 1 query rows...
    >>> choose("float64", 4096, 64, 64)
    (None, 'exact float64 arithmetic (FFMA, no tensor cores)')
    """
    name = result_dtype.rsplit(".", 1)[-1]
    wanted = {"float16": "f16", "bfloat16": "bf16"}.get(name)
    # Both variables are checked on every call, whichever dtype it has.
    float32 = float32_choice()
    kernel_choice()
    if name == "float32" and float32 == "3xtf32":
        wanted = "3xtf32"
    compute = "float64" if name == "float64" else "float32"
    if wanted is None:
        return None, f"exact {compute} arithmetic (FFMA, no tensor cores)"
    why = unsupported(wanted, tq, e, ev)
    if why is not None:
        return None, (f"exact float32 arithmetic (the tensor-core kernel cannot take this "
                      f"call: {why})")
    return wanted, _DESCRIPTIONS[wanted]
