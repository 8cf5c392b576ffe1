"""The one-thread-per-row CUDA kernel: online softmax, no T×T matrix, key lanes, split-K.

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
written, and no mask is built, on the host or on the device. Every score
follows the rules of docs/semantics.rst, one (query, key) pair at a time
through :mod:`polyattn.rules.element` (positions, visibility, the key range
of a block, soft-capping and ALiBi), then the mask; dropout decides each
weight by the Philox counter of its flat index (:mod:`.philox`): ``l`` and
``lse`` take the undropped weights, ``acc`` the kept ones times ``1/(1 - p)``.

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
from shapes alone (:func:`.launch.launch_plan`).

Specialisation
--------------
A kernel factory builds one kernel per (dtype, head-size bucket, mask kind,
score modifiers): the per-thread query row and accumulator are local arrays
whose size is a compile-time constant, the bucket ``HEAD_DIM_BUCKETS`` entry
that holds ``max(E, Ev)``; shared tiles and the query row are zero-padded to
it, so the feature loops have constant trip counts the compiler can unroll.
``mods`` kernels carry soft-capping and ALiBi (a zero slope when only
soft-capping is asked for, a zero cap meaning none); plain kernels have
neither in their inner loop. Causality, windows, key lengths, positions,
dropout, the lane layout and the number of splits are run-time values, not
specialisations: the rules' come in one tuple argument
(:func:`polyattn.rules.lowering.kernel_parameters`) that only the functions of
:mod:`polyattn.rules.element` read. A user's ``score_mod`` and ``mask_mod``
(:mod:`.user_rules`), and whether segment ids and a block mask are read
(:mod:`.blocks`: the block's keys narrowed to its rows' segments and to the
block mask's non-empty blocks, empty key tiles skipped, no ``mask_mod`` in full
ones), are specialisations too; kernels without them compile to the code they
had before. The merge kernel has one specialisation per dtype.

Limits and costs
----------------
* One thread per query row (per key lane when decoding) means one
  shared-memory load per multiply-add and no tensor cores. ptxas (sm_90)
  keeps ``q_row`` and ``acc`` in registers for float32 head sizes up to 64;
  the 128 and 256 buckets, and float64 from 64 up, keep part of them in
  local memory.
* The K and V tiles use about ``SHARED_MEMORY_BYTES`` of static shared
  memory (Numba's static limit is 48 KiB). Split-K scratch holds
  ``num_splits · B·H·Tq·(Ev + 1)`` values.
* Dropout costs one Philox evaluation (ten rounds of two 32×32-bit
  products, done as 64-bit products) per visible weight, a few registers and
  no spills (sm_90, float32, head size 64: 220 registers instead of 217).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from polyattn.backends.cuda import blocks
from polyattn.backends.cuda.environment import DTYPES, HEAD_DIM_BUCKETS, MASK_KINDS, _cuda, _Device
from polyattn.backends.cuda.inputs import common_dtype, head_bucket, kernel_inputs
from polyattn.backends.cuda.launch import check_grid, empty_like_layout, launch_plan, launching
from polyattn.backends.cuda.philox import philox_function
from polyattn.backends.cuda.user_rules import UserKey, buffer_types, device_functions, suffix
from polyattn.rules import element
from polyattn.rules.lowering import lower, parameter_types
from polyattn.rules.visibility import Rules

Array = Any

# Tile sizes.
BLOCK_Q = 64  # threads per block: query rows (one thread each), or rows × key lanes
MAX_BLOCK_K = 64  # most key rows per shared-memory tile
SHARED_MEMORY_BYTES = 32 * 1024  # budget for one K tile plus one V tile (before padding)
MERGE_THREADS = 128  # threads per block of the split-merge kernel

# ``numba.cuda``, bound by the kernel factories; the kernels name it as a module
# global, which the CUDA simulator swaps for its own.
cuda: Any = None


# --------------------------------------------------------------------------- #
# Kernel factories
# --------------------------------------------------------------------------- #

def default_block_k(dtype: str, bucket: int) -> int:
    """Key rows per tile: as many as fit ``SHARED_MEMORY_BYTES`` (K and V), at most 64."""
    itemsize = np.dtype(dtype).itemsize
    return max(1, min(MAX_BLOCK_K, SHARED_MEMORY_BYTES // (2 * bucket * itemsize)))



def _signature(dtype: str, mask_kind: str) -> Any:
    """Numba signature of the attention kernel: strided inputs and outputs, C scratch."""
    from numba import types

    t = getattr(types, dtype)
    strided = types.Array(t, 4, "A")
    mask_t = types.Array(types.boolean if mask_kind == "bool" else t, 4, "A")
    table = types.Array(types.int64, 1, "A")
    i64 = types.int64
    return types.void(
        strided, strided, strided,  # q, k, v
        mask_t, table,  # mask, mask_batch
        table, types.Array(t, 2, "A"),  # key lengths (B|1,), ALiBi slopes (B|1, H|1)
        strided, types.Array(t, 3, "A"),  # out, lse
        types.Array(t, 5, "C"), types.Array(t, 4, "C"),  # split scratch: out, lse
        t, parameter_types(dtype),  # scale, the rules (lowering.kernel_parameters)
        i64, i64, i64,  # rows per block, lanes per row, splits
        *buffer_types(dtype),  # mod_args buffers fb, ib, meta (.user_rules)
        *blocks.table_types(),  # segments, block-mask kinds, its block (.blocks)
    )


def _merge_signature(dtype: str) -> Any:
    """Numba signature of the split-merge kernel."""
    from numba import types

    t = getattr(types, dtype)
    return types.void(types.Array(t, 5, "C"), types.Array(t, 4, "C"),
                      types.Array(t, 4, "A"), types.Array(t, 3, "A"))


@functools.cache
def make_kernel_function(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                         block_k: int | None = None, user: UserKey | None = None,
                         masks: blocks.MaskKey | None = None) -> Any:
    """The Python kernel function for one specialisation (not yet compiled); ``user``:
    the call's ``score_mod`` and ``mask_mod`` (:func:`.user_rules.user_key`); ``masks``:
    whether it reads segment ids and a block mask (:func:`.blocks.mask_key`)."""
    global cuda
    cuda = _cuda()
    from numba import types

    if block_k is None:
        block_k = default_block_k(dtype, bucket)
    acc_t = getattr(types, dtype)
    np_t = np.dtype(dtype).type
    ZERO, ONE, NEG_INF = np_t(0.0), np_t(1.0), np_t(-np.inf)
    HEAD, BK = bucket, block_k
    PADDED = HEAD + 1  # tile rows padded by one column: lanes reading different keys
    CAP = 2 * BK  # lane states the two tiles hold at once when lanes merge
    BOOL_MASK, FLOAT_MASK, MODS = mask_kind == "bool", mask_kind == "float", mods
    USER_SCORE = user is not None and user[0] is not None
    USER_MASK = user is not None and user[1] is not None
    score_element, mask_element = device_functions(user, dtype)
    SEGMENTS, BLOCKS = masks or (False, False)
    segment_of, segment_span, blocks_keys, _, tile_kind, _ = blocks.device_functions()

    keep_word = philox_function()  # Philox4x32-10's first word for a weight's index
    # The score element (positions, visibility, key ranges, modifiers, dropout), in np_t.
    (row_position, key_length, visible, block_keys, head_modifiers, mask_steps, modify, drops,
     dropout_key, kept, kept_scale) = (
        lower(f, "cuda", np_t) for f in (
            element.row_position, element.key_length, element.visible, element.block_keys,
            element.head_modifiers, element.mask_steps, element.modify, element.drops,
            element.dropout_key, element.kept, element.kept_scale))

    def attention_kernel(q, k, v, mask, mask_batch, lengths, slopes, out, lse, o_part,
                         lse_part, scale, rules, rows, lanes, n_splits, fb, ib, meta, segments,
                         kinds, bq, bk):
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

        # This row's position; keys [lo, hi) that some row of the block may see,
        # and this split's share of them, [k_start, k_end), in whole tiles.
        len_b = key_length(lengths, b)
        pos_offset = row_position(0, rules, len_b)  # row i is at i + pos_offset
        p = i + pos_offset
        first_row = qt * rows
        last_row = min(first_row + rows, tq) - 1
        lo, hi = block_keys(first_row, last_row, pos_offset, rules, tk, len_b)
        if SEGMENTS:  # the keys of the rows' segments; this row's, [s_lo, s_hi)
            lo, hi = segment_span(segments, b, first_row, last_row, lo, hi)
            s_lo, s_hi = segment_of(segments, b, min(i, tq - 1))
        if BLOCKS:  # the key blocks the block mask leaves to the rows
            lo, hi = blocks_keys(kinds, b, h, first_row, last_row, bq, bk, lo, hi)
        n_tiles_all = max(0, (hi - lo + BK - 1) // BK)
        per_split = (n_tiles_all + n_splits - 1) // n_splits * BK
        k_start = lo + split * per_split
        k_end = min(hi, k_start + per_split)
        n_ktiles = max(0, (k_end - k_start + BK - 1) // BK)

        # Where this thread reads the mask: size-1 axes broadcast at index 0.
        mb, mh, mi_step, mj_step = mask_steps(BOOL_MASK or FLOAT_MASK, mask, mask_batch,
                                              b, h)
        mi = 0
        if row_ok:
            mi = i * mi_step

        # Dropout: weight (b, h, i, j) has the flat index row_n + j.
        dropping = drops(rules)
        row_n = ((b * n_heads + h) * tq + i) * tk

        # Score modifiers: soft-capping (cap > 0) and this head's ALiBi slope.
        cap, inv_cap, slope = head_modifiers(MODS, rules, slopes, b, h, ONE)

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
            if BLOCKS:  # the same for every thread: skip an empty tile; a full one
                # needs no mask_mod
                kind = tile_kind(kinds, b, h, first_row, last_row, j0,
                                 min(j0 + BK, k_end) - 1, bq, bk)
                if kind == 0:
                    continue

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
                        x = modify(x, p, j, cap, inv_cap, slope)
                    if USER_SCORE:
                        x, _ = score_element(x, b, h, i, j, fb, ib, meta)
                    if not visible(j, p, rules, k_end):
                        x = NEG_INF
                    elif SEGMENTS and (j < s_lo or j >= s_hi):
                        x = NEG_INF
                    elif USER_MASK and not (BLOCKS and kind == 2) and not mask_element(
                            b, h, i, j, fb, ib, meta):
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
                            if kept(keep_word(row_n + j0 + jj, dropout_key(rules)), rules):
                                weight *= kept_scale(rules)
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

    mods_name = "_mods" if mods else ""
    name = (f"attention_{dtype}_head{bucket}_{mask_kind}{mods_name}_k{block_k}{suffix(user)}"
            f"{blocks.suffix(masks)}")
    attention_kernel.__name__ = attention_kernel.__qualname__ = name
    return attention_kernel


@functools.cache
def make_merge_function(dtype: str) -> Any:
    """The kernel that merges split-K partials by log-sum-exp (not yet compiled)."""
    global cuda
    cuda = _cuda()
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
                    block_k: int | None = None, user: UserKey | None = None,
                    masks: blocks.MaskKey | None = None) -> Any:
    """The kernel for one specialisation, compiled on first use and cached.

    It is compiled for exactly one signature, so a launch skips type dispatch:
    the launcher checks dtypes, and allocates the scratch contiguous.
    """
    fn = make_kernel_function(dtype, bucket, mask_kind, mods, block_k, user, masks)
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

def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
              scale: float, xp: Any, block_q: int | None = None,
              block_k: int | None = None, decode: bool | None = None,
              num_splits: int | None = None) -> tuple[Array, Array]:
    """``(out, lse)`` from this kernel, in one launch (two with split keys).

    Arguments as :func:`.facade.attention`; ``block_q`` and ``block_k`` override
    the tile sizes (threads per block, key rows per tile), ``decode`` and
    ``num_splits`` the launch plan (:func:`.launch.launch_plan`).
    """
    *batch_list, n_heads, tq, e = q.shape
    tk, ev = v.shape[-2:]
    batch = tuple(batch_list)
    bucket = head_bucket(e, ev)
    dtype = common_dtype(query=q, key=k, value=v)
    dev = _Device(q)
    n_batch = math.prod(batch)

    out = empty_like_layout(dev, q, (n_batch, n_heads, tq, ev), xp)  # (B, H, Tq, Ev)
    lse = dev.empty((n_batch, n_heads, tq), q.dtype)  # (B, H, Tq)
    if n_batch * n_heads * tq > 0:
        inputs = kernel_inputs(q, k, v, mask, rules, scale, xp, dev)
        bq = BLOCK_Q if block_q is None else int(block_q)
        bk = default_block_k(dtype, bucket) if block_k is None else int(block_k)
        rows, lanes, splits = launch_plan(tq, tk, n_batch * n_heads, bq, bk, decode=decode,
                                          num_splits=num_splits)
        kernel = compiled_kernel(dtype, bucket, inputs.mask_kind, inputs.mods,
                                 None if block_k is None else bk, inputs.user, inputs.masks)
        n_blocks = n_batch * n_heads * -(-tq // rows) * splits
        check_grid(n_blocks, f"B·H·ceil(Tq/{rows})·{splits}", q)
        # Split-K scratch in the compute dtype (a placeholder without splits).
        scratch_shape = (splits, n_batch, n_heads, tq) if splits > 1 else (1, 1, 1, 1)
        o_part = dev.view(dev.empty((*scratch_shape, ev if splits > 1 else 1),
                                    q.dtype))  # (S, B, H, Tq, Ev)
        lse_part = dev.view(dev.empty(scratch_shape, q.dtype))  # (S, B, H, Tq)
        out_d, lse_d = dev.view(out), dev.view(lse)
        args = [*inputs.arrays, out_d, lse_d, o_part, lse_part, *inputs.parameters, rows,
                lanes, splits, *inputs.buffers, *inputs.tables]
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
