"""What every CUDA kernel launch shares besides its inputs: plans, grids, outputs, streams.

A call's inputs in the kernels' form come from :mod:`.inputs`. Outputs are
allocated by the input library (time-major where the query is:
:func:`empty_like_layout`) and returned as its arrays; the kernels run on the
library's current stream (:func:`launching`).

:func:`launch_plan` picks the one-thread-per-row kernel's layout from shapes
alone (key lanes for decoding, split-K for small grids); :func:`launch_tiles`
and :func:`launch_backward` are the launchers the tiled, tensor-core and
backward kernels share. Every kernel takes, after its arrays, the two
``parameters`` of :class:`.inputs.KernelInputs`: the scale and the rules' tuple.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from polyattn._interop import simulator_enabled
from polyattn.backends.cuda.environment import _Device
from polyattn.backends.cuda.inputs import (
    common_dtype,
    head_bucket,
    kernel_inputs,
    memory_of,
    vector_loads_fit,
)
from polyattn.rules.visibility import Rules

Array = Any

MAX_GRID_BLOCKS = 2**31 - 1  # one flat grid of B·H·ceil(Tq / rows)·splits blocks
# Decoding and split-K (the one-thread-per-row kernel).
DECODE_MAX_TQ = 16  # up to this many query rows, threads of a row share its keys
TARGET_BLOCKS = 264  # split keys until the grid has about this many blocks (2 per SM)
SPLIT_MIN_KEYS = 256  # fewest keys per split
MAX_SPLITS = 64


# --------------------------------------------------------------------------- #
# Outputs
# --------------------------------------------------------------------------- #

def _time_major(x: Array) -> bool:
    """Whether a (…, H, T, E) array steps through T faster than H in memory: a view of
    a (…, T, H, E) array."""
    if x.ndim < 3 or x.shape[-3] < 2 or x.shape[-2] < 2:
        return False
    strides = x.stride() if callable(getattr(x, "stride", None)) else x.strides
    return bool(strides[-3] < strides[-2])


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


# --------------------------------------------------------------------------- #
# Plans and grids
# --------------------------------------------------------------------------- #

def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_plan(tq: int, tk: int, n_pairs: int, block_q: int, block_k: int, *,
                decode: bool | None = None,
                num_splits: int | None = None) -> tuple[int, int, int]:
    """``(rows, lanes, splits)`` of the one-thread-per-row kernel: query rows per
    block, threads per row, key splits.

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


def check_grid(n_blocks: int, formula: str, q: Array) -> None:
    """ValueError when a flat grid of ``n_blocks`` exceeds the CUDA limit."""
    if n_blocks > MAX_GRID_BLOCKS:
        raise ValueError(
            f"{formula} = {n_blocks} thread blocks exceed the CUDA grid limit "
            f"{MAX_GRID_BLOCKS} (query {tuple(q.shape)}); split the batch"
        )


# --------------------------------------------------------------------------- #
# Launching
# --------------------------------------------------------------------------- #

@contextlib.contextmanager
def launching(dev: _Device) -> Iterator[Any]:
    """Launch context: the input's GPU made current, its library's current stream
    (yielded), and Numba's occupancy warning for small grids silenced (the grid is
    the problem's). On the simulator, whose threads compute in NumPy scalars, NumPy's
    floating-point warnings too: a GPU raises none, and none escapes a call."""
    device_id = dev.device_id()
    on_device = contextlib.nullcontext() if device_id is None else dev.cuda.gpus[device_id]
    with warnings.catch_warnings(), on_device:
        warnings.simplefilter("ignore", category=_performance_warning())
        if simulator_enabled():
            warnings.simplefilter("ignore", category=RuntimeWarning)
        yield dev.stream()


def _performance_warning() -> type[Warning]:
    try:
        from numba.core.errors import NumbaPerformanceWarning
    except ImportError:  # pragma: no cover
        return RuntimeWarning
    return NumbaPerformanceWarning


def launch_tiles(q: Array, k: Array, v: Array, *, mask: Array | None, rules: Rules,
                 scale: float, xp: Any, kernel_for: Any, rows: int, threads: int,
                 vector_flag: bool = False, user_rules: bool = False) -> tuple[Array, Array]:
    """``(out, lse)`` from one launch of a kernel whose blocks own ``rows`` query rows
    of one (batch, head) pair each, with ``threads`` threads, and take the arrays of
    :func:`.inputs.kernel_inputs`, ``out`` and ``lse``, then its parameters: the
    tensor-core and register-tiled kernels. ``kernel_for(mask_kind, mods)`` gives the
    compiled kernel; with ``vector_flag`` it takes one more scalar, 1 where q, k and v
    may be read by vector loads (:func:`.inputs.vector_loads_fit`), else 0. With
    ``user_rules`` the kernel applies ``score_mod`` and ``mask_mod``, segment ids and
    block masks: ``kernel_for(mask_kind, mods, user, masks)`` (``user``:
    :func:`.user_rules.user_key`'s key, ``masks``: :func:`.blocks.mask_key`'s) and the
    kernel takes the ``mod_args`` buffers ``(fb, ib, meta)`` and then the tables of
    :func:`.blocks.tables` last."""
    *batch, n_heads, tq, _ = q.shape
    ev = v.shape[-1]
    dev = _Device(q)
    n_batch = math.prod(batch)
    out = empty_like_layout(dev, q, (n_batch, n_heads, tq, ev), xp)  # (B, H, Tq, Ev)
    lse = dev.empty((n_batch, n_heads, tq), q.dtype)  # (B, H, Tq)
    if n_batch * n_heads * tq > 0:
        inputs = kernel_inputs(q, k, v, mask, rules, scale, xp, dev)
        if user_rules:
            kernel = kernel_for(inputs.mask_kind, inputs.mods, inputs.user, inputs.masks)
        else:
            kernel = kernel_for(inputs.mask_kind, inputs.mods)
        n_blocks = n_batch * n_heads * -(-tq // rows)
        check_grid(n_blocks, f"B·H·ceil(Tq/{rows})", q)
        out_d, lse_d = dev.view(out), dev.view(lse)
        with launching(dev) as stream:
            flag = (np.int64(inputs.vector_loads),) if vector_flag else ()
            buffers = (*inputs.buffers, *inputs.tables) if user_rules else ()
            kernel[n_blocks, threads, stream](*inputs.arrays, out_d, lse_d,
                                              *inputs.parameters, *flag, *buffers)
        if dev.simulated:
            out, lse = out_d.copy_to_host(), lse_d.copy_to_host()
    out = xp.reshape(out, (*batch, n_heads, tq, ev))  # (B…, H, Tq, Ev)
    lse = xp.reshape(lse, (*batch, n_heads, tq))  # (B…, H, Tq)
    return out, lse


def launch_backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array,
                    /, *, mask: Array | None, rules: Rules, scale: float, xp: Any,
                    grad_lse: Array | None, launch: Any) -> tuple[Array, Array, Array]:
    """What the backward launchers share: dtype and head bucket, ``D = rowsum(dO ∘ O)
    − dlse`` with the input library, the kernels' inputs, the gradients' arrays
    (zeros where there is no score), and shapes back. ``launch(dtype, bucket,
    inputs, (dO, lse, D), dq, (dk, dv), stream)`` launches the kernels, the
    arrays flattened to (B, H, …) device views; ``inputs.vector_loads`` covers dO
    too."""
    *batch_list, n_heads, tq, e = q.shape
    *_, n_kv_heads, tk, ev = v.shape
    batch = tuple(batch_list)
    bucket = head_bucket(e, ev)
    named = {"query": q, "key": k, "value": v, "out": out, "lse": lse, "grad_out": grad_out}
    if grad_lse is not None:
        named["grad_lse"] = grad_lse
    dtype = common_dtype(**named)
    dev = _Device(q)
    n_batch = math.prod(batch)

    dq = empty_like_layout(dev, q, (n_batch, n_heads, tq, e), xp)  # (B, H, Tq, E)
    dk = empty_like_layout(dev, k, (n_batch, n_kv_heads, tk, e), xp)  # (B, Hkv, Tk, E)
    dv = empty_like_layout(dev, v, (n_batch, n_kv_heads, tk, ev), xp)  # (B, Hkv, Tk, Ev)
    if n_batch * n_heads * tq * tk == 0:
        # No score: every gradient is 0.
        dq, dk, dv = (xp.zeros_like(a) for a in (dq, dk, dv))
    else:
        # D = rowsum(dO ∘ O) − dlse, with the input library.
        delta = xp.sum(grad_out * out, axis=-1)  # (B…, H, Tq)
        if grad_lse is not None:
            delta = delta - grad_lse
        delta = xp.reshape(delta, (n_batch, n_heads, tq))  # (B, H, Tq)
        lse3 = xp.reshape(lse, (n_batch, n_heads, tq))  # (B, H, Tq)
        do4 = xp.reshape(grad_out, (n_batch, n_heads, tq, ev))  # (B, H, Tq, Ev)
        inputs = kernel_inputs(q, k, v, mask, rules, scale, xp, dev)
        extra = tuple(dev.view(a) for a in (do4, lse3, delta))
        # vector loads where dO allows them too
        do_memory = memory_of(do4 if dev.simulated else extra[0])
        inputs = dataclasses.replace(
            inputs, vector_loads=inputs.vector_loads and vector_loads_fit(do_memory))
        dq_d, dk_d, dv_d = dev.view(dq), dev.view(dk), dev.view(dv)
        with launching(dev) as stream:
            launch(dtype, bucket, inputs, extra, dq_d, (dk_d, dv_d), stream)
        if dev.simulated:
            dq, dk, dv = dq_d.copy_to_host(), dk_d.copy_to_host(), dv_d.copy_to_host()
    dq = xp.reshape(dq, (*batch, n_heads, tq, e))  # (B…, H, Tq, E)
    dk = xp.reshape(dk, (*batch, n_kv_heads, tk, e))  # (B…, Hkv, Tk, E)
    dv = xp.reshape(dv, (*batch, n_kv_heads, tk, ev))  # (B…, Hkv, Tk, Ev)
    return dq, dk, dv
