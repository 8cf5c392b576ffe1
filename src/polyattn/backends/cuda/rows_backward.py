"""The backward pass of the Numba CUDA kernel: two kernels, no atomics, deterministic.

Given the forward's ``out`` and ``lse``, the gradient ``dO`` of the output
(and optionally ``dlse`` of the log-sum-exp), the gradients follow
FlashAttention-2 (docs/semantics.rst), every score recomputed from
``q``, ``k`` and ``lse``:

    P  = exp(s − lse)                 (0 for a row with lse = −inf)
    Z  = keep / (1 − p)               (1 without dropout; the same Philox counters)
    D  = rowsum(dO ∘ O) − dlse        (computed with the input library before launch)
    dV = (P ∘ Z)ᵀ dO
    dS = P ∘ ((dO Vᵀ) ∘ Z − D) ∘ (1 − tanh²(raw / cap))
    dQ = scale · dS K,   dK = scale · dSᵀ Q

with ``raw = scale·q·k`` the score before soft-capping at ``cap``. Float masks and
ALiBi slopes are constants: they get no gradient.

* **dQ kernel.** A block owns ``block_q`` query rows of one (batch, head)
  pair, one thread per row, and streams the K and V tiles of the keys that
  any of its rows can see through shared memory (the forward's key range).
  Each thread keeps its query row, its ``dO`` row and its ``dq`` in local
  arrays.
* **dK/dV kernel.** A block owns ``block_q`` key rows of one (batch, key/value
  head) pair, one thread per key. It loops over the ``G`` query heads sharing
  that key/value head and, for each, over the query tiles that can see any of
  its keys (the visible range run backwards: query ``i`` sees key ``j`` iff
  ``p_i − left ≤ j ≤ p_i + right``, so ``i`` runs from ``j − right − offset``
  to ``j + left − offset``), loading Q, ``dO``, ``lse`` and ``D`` tiles into
  shared memory. Each thread sums its key's ``dk`` and ``dv`` over all of
  them: the sums over the query heads of a group need no atomics.

Keys at or past ``key_lengths[b]`` are never read: their ``dk`` and ``dv``
are 0. A pair (query row, key) that is invisible, or whose weight ``P`` is 0,
adds nothing (and is not multiplied, so an infinite ``dO·v`` there cannot
give NaN). Fully masked rows give zero gradients.

Scores are recomputed by the forward's functions (:mod:`polyattn.rules.element`;
``modify_and_grad`` gives the modified score and the soft-cap derivative with one
``tanh``). Specialisations are those of the forward (dtype × head bucket × mask kind ×
score modifiers); dropout is the run-time threshold of the forward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from polyattn.backends.cuda import blocks, environment
from polyattn.backends.cuda import rows as fwd
from polyattn.backends.cuda.environment import DTYPES, HEAD_DIM_BUCKETS, MASK_KINDS
from polyattn.backends.cuda.launch import check_grid, launch_backward
from polyattn.backends.cuda.philox import philox_function
from polyattn.backends.cuda.user_rules import UserKey, buffer_types, device_functions, suffix
from polyattn.rules import element
from polyattn.rules.lowering import lower, parameter_types
from polyattn.rules.visibility import Rules

Array = Any

# ``numba.cuda``, bound on first use; a module global, as in :mod:`.rows`
# (the CUDA simulator swaps module globals that refer to it for its own).
cuda: Any = None


def _cuda() -> Any:
    """The ``numba.cuda`` module (ImportError naming the package when it is missing)."""
    global cuda
    if cuda is None:
        cuda = environment._cuda()
    return cuda


# --------------------------------------------------------------------------- #
# Kernel factories
# --------------------------------------------------------------------------- #

def _signature(dtype: str, mask_kind: str, outputs: int) -> Any:
    """Numba signature of a backward kernel with ``outputs`` gradient arrays."""
    from numba import types

    t = getattr(types, dtype)
    strided = types.Array(t, 4, "A")
    mask_t = types.Array(types.boolean if mask_kind == "bool" else t, 4, "A")
    table = types.Array(types.int64, 1, "A")
    rows = types.Array(t, 3, "A")
    return types.void(
        strided, strided, strided,  # q, k, v
        mask_t, table,  # mask, mask_batch
        table, types.Array(t, 2, "A"),  # key lengths (B|1,), ALiBi slopes (B|1, H|1)
        strided, rows, rows,  # dO, lse, D
        *([strided] * outputs),  # dq, or dk and dv
        t, parameter_types(dtype),  # scale, the rules (lowering.kernel_parameters)
        *buffer_types(dtype),  # mod_args buffers fb, ib, meta (.user_rules)
        *blocks.table_types(),  # segments, block-mask kinds, its block (.blocks)
    )


@functools.cache
def make_dq_function(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                     block_k: int | None = None, user: UserKey | None = None,
                     masks: blocks.MaskKey | None = None) -> Any:
    """The Python dQ kernel function for one specialisation (not yet compiled)."""
    _cuda()
    from numba import types

    if block_k is None:
        block_k = fwd.default_block_k(dtype, bucket)
    acc_t = getattr(types, dtype)
    np_t = np.dtype(dtype).type
    ZERO, ONE, NEG_INF = np_t(0.0), np_t(1.0), np_t(-np.inf)
    HEAD, BK = bucket, block_k
    BOOL_MASK, FLOAT_MASK, MODS = mask_kind == "bool", mask_kind == "float", mods
    USER_SCORE = user is not None and user[0] is not None
    USER_MASK = user is not None and user[1] is not None
    score_element, mask_element = device_functions(user, dtype)
    SEGMENTS, BLOCKS = masks or (False, False)
    segment_of, segment_span, blocks_keys, _, tile_kind, _ = blocks.device_functions()
    keep_word = philox_function()
    (row_position, key_length, visible, block_keys, head_modifiers, mask_steps,
     modify_and_grad, drops, dropout_key, kept, kept_scale) = (
        lower(f, "cuda", np_t) for f in (
            element.row_position, element.key_length, element.visible, element.block_keys,
            element.head_modifiers, element.mask_steps, element.modify_and_grad,
            element.drops, element.dropout_key, element.kept, element.kept_scale))

    def dq_kernel(q, k, v, mask, mask_batch, lengths, slopes, do, lse, delta, dq, scale,
                  rules, fb, ib, meta, segments, kinds, bq, bk):
        """dq of one query tile of one (batch, head) pair; one thread per query row."""
        n_batch, n_heads, tq, e = q.shape
        tk = k.shape[2]
        ev = v.shape[3]
        group = n_heads // k.shape[1]
        n_pairs = n_batch * n_heads
        rows = cuda.blockDim.x
        n_qtiles = (tq + rows - 1) // rows
        pair = cuda.blockIdx.x % n_pairs
        qt = n_qtiles - 1 - cuda.blockIdx.x // n_pairs  # largest causal work first
        b = pair // n_heads
        h = pair % n_heads
        hk = h // group
        i = qt * rows + cuda.threadIdx.x
        row_ok = i < tq

        # This row's position; keys [lo, hi) some row of the block may see.
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
        n_ktiles = max(0, (hi - lo + BK - 1) // BK)

        # Where this thread reads the mask: size-1 axes broadcast at index 0.
        mb, mh, mi_step, mj_step = mask_steps(BOOL_MASK or FLOAT_MASK, mask, mask_batch,
                                              b, h)
        mi = 0
        if row_ok:
            mi = i * mi_step

        # Score modifiers and dropout.
        cap, inv_cap, slope = head_modifiers(MODS, rules, slopes, b, h, ONE)
        dropping = drops(rules)
        row_n = ((b * n_heads + h) * tq + i) * tk

        q_row = cuda.local.array(HEAD, acc_t)
        do_row = cuda.local.array(HEAD, acc_t)
        dq_row = cuda.local.array(HEAD, acc_t)
        k_tile = cuda.shared.array((BK, HEAD), acc_t)
        v_tile = cuda.shared.array((BK, HEAD), acc_t)

        # This row's lse and D; a row with lse = -inf (no visible key) stays 0.
        lse_i = NEG_INF
        d_i = ZERO
        if row_ok:
            lse_i = lse[b, h, i]
            d_i = delta[b, h, i]
        live = row_ok and lse_i != NEG_INF
        for d in range(HEAD):
            x = ZERO
            y = ZERO
            if live and d < e:
                x = q[b, h, i, d] * scale
            if live and d < ev:
                y = do[b, h, i, d]
            q_row[d] = x
            do_row[d] = y
            dq_row[d] = ZERO

        for kt in range(n_ktiles):
            j0 = lo + kt * BK
            if BLOCKS:  # the forward's tiles: an empty one skipped, a full one unmasked
                kind = tile_kind(kinds, b, h, first_row, last_row, j0, min(j0 + BK, hi) - 1,
                                 bq, bk)
                if kind == 0:
                    continue

            # Load one K tile and one V tile; keys past hi (and padding) are zeros.
            for idx in range(cuda.threadIdx.x, BK * HEAD, rows):
                jj = idx // HEAD
                d = idx % HEAD
                j = j0 + jj
                k_val = ZERO
                v_val = ZERO
                if j < hi:
                    if d < e:
                        k_val = k[b, hk, j, d]
                    if d < ev:
                        v_val = v[b, hk, j, d]
                k_tile[jj, d] = k_val
                v_tile[jj, d] = v_val
            cuda.syncthreads()

            if live:
                for jj in range(BK):
                    j = j0 + jj
                    if visible(j, p, rules, hi) and not (SEGMENTS and (j < s_lo or j >= s_hi)):
                        # The score, as in the forward.
                        raw = ZERO
                        for d in range(HEAD):
                            raw += q_row[d] * k_tile[jj, d]
                        x = raw
                        grad = ONE  # d(x) / d(raw)
                        if MODS:
                            x, grad = modify_and_grad(raw, p, j, cap, inv_cap, slope)
                        if USER_SCORE:
                            x, du = score_element(x, b, h, i, j, fb, ib, meta)
                            grad *= du
                        seen = True
                        if BOOL_MASK:
                            seen = mask[mb, mh, mi, j * mj_step]
                        elif FLOAT_MASK:
                            x += mask[mb, mh, mi, j * mj_step]
                        if USER_MASK and seen and not (BLOCKS and kind == 2):
                            seen = mask_element(b, h, i, j, fb, ib, meta)
                        weight = ZERO
                        if seen:
                            weight = math.exp(x - lse_i)
                        if weight != ZERO:
                            # dS = P (dP Z - D) (1 - tanh²); dq += dS k_j.
                            dp = ZERO
                            for d in range(HEAD):
                                dp += do_row[d] * v_tile[jj, d]
                            if dropping:
                                if kept(keep_word(row_n + j, dropout_key(rules)), rules):
                                    dp *= kept_scale(rules)
                                else:
                                    dp = ZERO
                            ds = weight * (dp - d_i)
                            if MODS or USER_SCORE:
                                ds *= grad
                            for d in range(HEAD):
                                dq_row[d] += ds * k_tile[jj, d]
            cuda.syncthreads()

        if row_ok:
            for d in range(HEAD):
                if d < e:
                    dq[b, h, i, d] = dq_row[d] * scale

    mods_name = "_mods" if mods else ""
    name = (f"attention_dq_{dtype}_head{bucket}_{mask_kind}{mods_name}_k{block_k}{suffix(user)}"
            f"{blocks.suffix(masks)}")
    dq_kernel.__name__ = dq_kernel.__qualname__ = name
    return dq_kernel


@functools.cache
def make_dkdv_function(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                       block_k: int | None = None, user: UserKey | None = None,
                       masks: blocks.MaskKey | None = None) -> Any:
    """The Python dK/dV kernel function for one specialisation (not yet compiled);
    ``block_k`` is the number of query rows per shared tile."""
    _cuda()
    from numba import types

    if block_k is None:
        block_k = fwd.default_block_k(dtype, bucket)
    acc_t = getattr(types, dtype)
    np_t = np.dtype(dtype).type
    ZERO, ONE, NEG_INF = np_t(0.0), np_t(1.0), np_t(-np.inf)
    HEAD, BT = bucket, block_k
    BOOL_MASK, FLOAT_MASK, MODS = mask_kind == "bool", mask_kind == "float", mods
    USER_SCORE = user is not None and user[0] is not None
    USER_MASK = user is not None and user[1] is not None
    score_element, mask_element = device_functions(user, dtype)
    SEGMENTS, BLOCKS = masks or (False, False)
    segment_of, segment_span, _, blocks_queries, tile_kind, _ = blocks.device_functions()
    keep_word = philox_function()
    (row_position, key_length, visible, block_queries, head_modifiers, modify_and_grad, drops,
     dropout_key, kept, kept_scale) = (
        lower(f, "cuda", np_t) for f in (
            element.row_position, element.key_length, element.visible, element.block_queries,
            element.head_modifiers, element.modify_and_grad_branched, element.drops,
            element.dropout_key, element.kept, element.kept_scale))

    def dkdv_kernel(q, k, v, mask, mask_batch, lengths, slopes, do, lse, delta, dk, dv,
                    scale, rules, fb, ib, meta, segments, kinds, bq, bk):
        """dk and dv of one key tile of one (batch, key/value head) pair, summed over
        the query heads of its group; one thread per key row."""
        n_batch, n_heads, tq, e = q.shape
        n_kv_heads = k.shape[1]
        tk = k.shape[2]
        ev = v.shape[3]
        group = n_heads // n_kv_heads
        n_pairs = n_batch * n_kv_heads
        cols = cuda.blockDim.x
        pair = cuda.blockIdx.x % n_pairs
        kt = cuda.blockIdx.x // n_pairs  # first keys first: most causal work first
        b = pair // n_kv_heads
        hk = pair % n_kv_heads
        j = kt * cols + cuda.threadIdx.x

        # Keys of this block that exist, and the queries that may see one of them.
        len_b = key_length(lengths, b)
        key_ok = j < tk and j < len_b
        first_key = kt * cols
        last_key = min(first_key + cols, tk, len_b) - 1
        pos_offset = row_position(0, rules, len_b)  # row i is at i + pos_offset
        q_lo, q_hi = block_queries(first_key, last_key, pos_offset, rules, tq)
        if SEGMENTS:  # the queries of the keys' segments; this key's, [s_lo, s_hi)
            if last_key >= first_key:
                q_lo, q_hi = segment_span(segments, b, tq + first_key, tq + last_key, q_lo,
                                          q_hi)
            s_lo, s_hi = segment_of(segments, b, tq + min(j, tk - 1))
        n_qtiles = 0
        if last_key >= first_key:
            n_qtiles = max(0, (q_hi - q_lo + BT - 1) // BT)
        if BLOCKS:
            q_all_lo, q_all_hi = q_lo, q_hi

        mb = 0
        mj = 0
        if BOOL_MASK or FLOAT_MASK:
            mb = mask_batch[b]
            if mask.shape[3] > 1 and key_ok:
                mj = j
        dropping = drops(rules)

        k_row = cuda.local.array(HEAD, acc_t)
        v_row = cuda.local.array(HEAD, acc_t)
        dk_row = cuda.local.array(HEAD, acc_t)
        dv_row = cuda.local.array(HEAD, acc_t)
        q_tile = cuda.shared.array((BT, HEAD), acc_t)
        do_tile = cuda.shared.array((BT, HEAD), acc_t)
        lse_tile = cuda.shared.array(BT, acc_t)
        d_tile = cuda.shared.array(BT, acc_t)

        # This key's row, scaled (raw = q · (scale k)); keys past the length unread.
        for d in range(HEAD):
            x = ZERO
            y = ZERO
            if key_ok and d < e:
                x = k[b, hk, j, d] * scale
            if key_ok and d < ev:
                y = v[b, hk, j, d]
            k_row[d] = x
            v_row[d] = y
            dk_row[d] = ZERO
            dv_row[d] = ZERO

        for g in range(group):
            h = hk * group + g
            mh = 0
            if BOOL_MASK or FLOAT_MASK:
                if mask.shape[1] > 1:
                    mh = h
            cap, inv_cap, slope = head_modifiers(MODS, rules, slopes, b, h, ONE)
            row0 = (b * n_heads + h) * tq  # flat index of row 0 in (B, H, Tq)
            if BLOCKS:  # the query blocks the block mask leaves to this head's keys
                q_lo, q_hi = blocks_queries(kinds, b, h, h, first_key,
                                            max(first_key, last_key), bq, bk, q_all_lo,
                                            q_all_hi)
                if last_key >= first_key:
                    n_qtiles = (q_hi - q_lo + BT - 1) // BT

            for qt in range(n_qtiles):
                i0 = q_lo + qt * BT
                if BLOCKS:  # the forward's tiles: an empty one skipped, a full one unmasked
                    kind = tile_kind(kinds, b, h, i0, min(i0 + BT, q_hi) - 1, first_key,
                                     last_key, bq, bk)
                    if kind == 0:
                        continue

                # Load the Q and dO tiles, lse and D; rows past q_hi get lse = -inf.
                for idx in range(cuda.threadIdx.x, BT * HEAD, cols):
                    ii = idx // HEAD
                    d = idx % HEAD
                    i = i0 + ii
                    q_val = ZERO
                    do_val = ZERO
                    if i < q_hi:
                        if d < e:
                            q_val = q[b, h, i, d]
                        if d < ev:
                            do_val = do[b, h, i, d]
                    q_tile[ii, d] = q_val
                    do_tile[ii, d] = do_val
                for ii in range(cuda.threadIdx.x, BT, cols):
                    i = i0 + ii
                    lse_val = NEG_INF
                    d_val = ZERO
                    if i < q_hi:
                        lse_val = lse[b, h, i]
                        d_val = delta[b, h, i]
                    lse_tile[ii] = lse_val
                    d_tile[ii] = d_val
                cuda.syncthreads()

                if key_ok:
                    for ii in range(BT):
                        i = i0 + ii
                        p = i + pos_offset
                        lse_i = lse_tile[ii]
                        if lse_i != NEG_INF and visible(j, p, rules, len_b) and not (
                                SEGMENTS and (i < s_lo or i >= s_hi)):
                            # The score, as in the forward.
                            raw = ZERO
                            for d in range(HEAD):
                                raw += q_tile[ii, d] * k_row[d]
                            x = raw
                            grad = ONE  # d(x) / d(raw)
                            if MODS:
                                x, grad = modify_and_grad(raw, p, j, cap, inv_cap, slope)
                            if USER_SCORE:
                                x, du = score_element(x, b, h, i, j, fb, ib, meta)
                                grad *= du
                            seen = True
                            if BOOL_MASK or FLOAT_MASK:
                                mi = 0
                                if mask.shape[2] > 1:
                                    mi = i
                                if BOOL_MASK:
                                    seen = mask[mb, mh, mi, mj]
                                else:
                                    x += mask[mb, mh, mi, mj]
                            if USER_MASK and seen and not (BLOCKS and kind == 2):
                                seen = mask_element(b, h, i, j, fb, ib, meta)
                            weight = ZERO
                            if seen:
                                weight = math.exp(x - lse_i)
                            if weight != ZERO:
                                # dv += P Z dO_i; dS = P (dP Z - D) (1 - tanh²); dk += dS q_i.
                                z = ONE
                                if dropping:
                                    if not kept(keep_word((row0 + i) * tk + j,
                                                          dropout_key(rules)), rules):
                                        z = ZERO
                                    else:
                                        z = kept_scale(rules)
                                dp = ZERO
                                for d in range(HEAD):
                                    dp += do_tile[ii, d] * v_row[d]
                                pz = weight * z
                                ds = weight * (dp * z - d_tile[ii])
                                if MODS or USER_SCORE:
                                    ds *= grad
                                for d in range(HEAD):
                                    dv_row[d] += pz * do_tile[ii, d]
                                    dk_row[d] += ds * q_tile[ii, d]
                cuda.syncthreads()

        if j < tk:
            for d in range(HEAD):
                if d < e:
                    dk[b, hk, j, d] = dk_row[d] * scale
                if d < ev:
                    dv[b, hk, j, d] = dv_row[d]

    mods_name = "_mods" if mods else ""
    name = (f"attention_dkdv_{dtype}_head{bucket}_{mask_kind}{mods_name}_k{block_k}"
            f"{suffix(user)}{blocks.suffix(masks)}")
    dkdv_kernel.__name__ = dkdv_kernel.__qualname__ = name
    return dkdv_kernel


@functools.cache
def compiled_dq(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                block_k: int | None = None, user: UserKey | None = None,
                masks: blocks.MaskKey | None = None) -> Any:
    """The dQ kernel for one specialisation, compiled on first use and cached."""
    fn = make_dq_function(dtype, bucket, mask_kind, mods, block_k, user, masks)
    return _cuda().jit(_signature(dtype, mask_kind, 1))(fn)


@functools.cache
def compiled_dkdv(dtype: str, bucket: int, mask_kind: str, mods: bool = False,
                  block_k: int | None = None, user: UserKey | None = None,
                  masks: blocks.MaskKey | None = None) -> Any:
    """The dK/dV kernel for one specialisation, compiled on first use and cached."""
    fn = make_dkdv_function(dtype, bucket, mask_kind, mods, block_k, user, masks)
    return _cuda().jit(_signature(dtype, mask_kind, 2))(fn)


def specializations(buckets: tuple[int, ...] = HEAD_DIM_BUCKETS,
                    ) -> Iterator[tuple[Any, Any]]:
    """Every (Python kernel function, Numba signature) pair of the backward pass with
    a head bucket in ``buckets``."""
    for dtype in DTYPES:
        for bucket in buckets:
            for mask_kind in MASK_KINDS:
                for mods in (False, True):
                    yield (make_dq_function(dtype, bucket, mask_kind, mods),
                           _signature(dtype, mask_kind, 1))
                    yield (make_dkdv_function(dtype, bucket, mask_kind, mods),
                           _signature(dtype, mask_kind, 2))


# --------------------------------------------------------------------------- #
# Launcher
# --------------------------------------------------------------------------- #

def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array, /, *,
             mask: Array | None, rules: Rules, scale: float, xp: Any,
             grad_lse: Array | None = None, block_q: int | None = None,
             block_k: int | None = None) -> tuple[Array, Array, Array]:
    """Gradients ``(dq, dk, dv)`` of :func:`.facade.attention`, shaped like
    ``(q, k, v)``, in two kernel launches.

    ``out`` and ``lse`` are the forward's results, ``grad_out`` (B…, H, Tq, Ev)
    the gradient of ``out``, ``grad_lse`` (B…, H, Tq) that of ``lse`` (or
    ``None``). The arguments follow :func:`.facade.attention` (arrays of
    the input library, strided views included); ``block_q`` (threads per block)
    and ``block_k`` (rows per shared tile) override the tile sizes, for tests.

    Raises
    ------
    ValueError
        A head size above ``MAX_HEAD_DIM`` or a mask that does not broadcast.
    TypeError
        CPU arrays without the simulator, or a dtype other than float32/float64.
    """
    rows = fwd.BLOCK_Q if block_q is None else int(block_q)

    def launch(dtype: str, bucket: int, inputs: Any, arrays: tuple[Any, ...],
               dq_d: Any, dkdv_d: tuple[Any, Any], stream: Any) -> None:
        n_batch, n_heads, tq = arrays[1].shape  # lse (B, H, Tq)
        n_kv_heads, tk = dkdv_d[0].shape[1:3]
        bk = fwd.default_block_k(dtype, bucket) if block_k is None else int(block_k)
        tile = None if block_k is None else bk
        dq_blocks = n_batch * n_heads * -(-tq // rows)
        kv_blocks = n_batch * n_kv_heads * -(-tk // rows)
        check_grid(dq_blocks, f"B·H·ceil(Tq/{rows})", q)
        check_grid(kv_blocks, f"B·Hkv·ceil(Tk/{rows})", q)
        compiled_dq(dtype, bucket, inputs.mask_kind, inputs.mods, tile, inputs.user,
                    inputs.masks)[dq_blocks, rows, stream](
            *inputs.arrays, *arrays, dq_d, *inputs.parameters, *inputs.buffers, *inputs.tables)
        compiled_dkdv(dtype, bucket, inputs.mask_kind, inputs.mods, tile, inputs.user,
                      inputs.masks)[kv_blocks, rows, stream](
            *inputs.arrays, *arrays, *dkdv_d, *inputs.parameters, *inputs.buffers,
            *inputs.tables)

    return launch_backward(q, k, v, out, lse, grad_out, mask=mask, rules=rules, scale=scale,
                           xp=xp, grad_lse=grad_lse, launch=launch)
