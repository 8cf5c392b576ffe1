"""What every CUDA kernel launch shares: inputs in the kernels' form, plans, grids, outputs.

A call becomes the kernels' arguments in :func:`kernel_inputs`: (B, H, T, E)
device views of q, k and v (leading batch axes merged with ``reshape``, a copy
only when their strides cannot be merged), the mask read in place through its
strides (a size-1 axis indexed at 0, the leading batch axes reached through a
small table ``mask_batch``, so a broadcast mask is never materialised), the key
lengths (B,) and ALiBi slopes (B|1, H|1) as small device arrays
(:func:`_rule_tables`), the rules as the four integers of
:func:`polyattn.rules.lowering.reach`, and dropout's run-time arguments.
Outputs are allocated by the input library (time-major where the query is:
:func:`empty_like_layout`) and returned as its arrays; the kernels run on the
library's current stream (:func:`launching`).

:func:`launch_plan` picks the one-thread-per-row kernel's layout from shapes
alone (key lanes for decoding, split-K for small grids);
:func:`vector_loads_fit` says whether the register-tiled kernels may read
16 bytes per load; :func:`launch_tiles` and :func:`launch_backward` are the
launchers the tiled, tensor-core and backward kernels share.
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
from polyattn.backends.cuda.environment import DTYPES, HEAD_DIM_BUCKETS, MAX_HEAD_DIM, _Device
from polyattn.rules import dropout as _dropout
from polyattn.rules.lowering import reach
from polyattn.rules.visibility import Rules

Array = Any

MAX_GRID_BLOCKS = 2**31 - 1  # one flat grid of B·H·ceil(Tq / rows)·splits blocks
# Decoding and split-K (the one-thread-per-row kernel).
DECODE_MAX_TQ = 16  # up to this many query rows, threads of a row share its keys
TARGET_BLOCKS = 264  # split keys until the grid has about this many blocks (2 per SM)
SPLIT_MIN_KEYS = 256  # fewest keys per split
MAX_SPLITS = 64


# --------------------------------------------------------------------------- #
# Shapes and dtypes
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


def _dtype_name(x: Array) -> str:
    name = str(x.dtype).rsplit(".", 1)[-1]
    if name not in DTYPES:
        raise TypeError(
            f"the numba_cuda kernel computes in float32 or float64, got {name} "
            "(the caller casts float16 to float32)"
        )
    return name


def common_dtype(**arrays: Array) -> str:
    """The compute dtype's name, the same for every named array (TypeError otherwise)."""
    (first, x0), *rest = arrays.items()
    dtype = _dtype_name(x0)
    for name, x in rest:
        if _dtype_name(x) != dtype:
            raise TypeError(f"`{name}` has dtype {x.dtype} but `{first}` has {x0.dtype}")
    return dtype


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
# Kernel inputs
# --------------------------------------------------------------------------- #

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


def _mask_kind(mask: Array | None, dtype: str) -> str:
    """``"none"``, ``"bool"`` or ``"float"`` (a mask in the compute dtype); TypeError else."""
    if mask is None:
        return "none"
    mask_name = str(mask.dtype).rsplit(".", 1)[-1]
    if mask_name == "bool":
        return "bool"
    if mask_name == dtype:
        return "float"
    raise TypeError(f"`mask` must be bool or {dtype}, got {mask.dtype}")


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
    mask_kind = _mask_kind(mask, dtype)
    if mask is None:
        mask4 = q4[:1, :1, :1, :1]  # never read
        table = np.zeros(1, dtype=np.int64)
    else:
        mask4, table = _mask_layout(mask, batch, (n_heads, tq, tk), xp)
    if rules is None:
        rules = Rules.from_causal_offset(causal_offset, tq, tk)
    lengths, slopes = _rule_tables(rules, batch, n_heads, q.dtype, dev, xp)
    mods = rules.softcap is not None or rules.alibi is not None
    softcap = np_t(0.0 if rules.softcap is None else rules.softcap)
    arrays = tuple(dev.view(a) for a in (q4, k4, v4, mask4, dev.from_numpy(table), lengths,
                                         slopes))
    scalars = (np_t(scale), softcap, *dropout_arguments(rules, dtype), *reach(rules))
    sources = (q4, k4, v4) if dev.simulated else arrays[:3]
    return KernelInputs(mask_kind, mods, arrays, scalars,
                        vector_loads_fit(*(_memory(x) for x in sources)))


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


def dropout_arguments(rules: Rules | None, dtype: str) -> tuple[Any, Any, Any, Any]:
    """The kernels' dropout arguments: ``1/(1-p)`` in ``dtype``, and the threshold and
    the two Philox key words as uint64 (threshold 0: no dropout)."""
    np_t = np.dtype(dtype).type
    if rules is None or not rules.dropout:
        return np_t(1.0), np.uint64(0), np.uint64(0), np.uint64(0)
    key0, key1 = _dropout.key_words(rules.dropout_seed)
    return (np_t(rules.dropout_scale), np.uint64(_dropout.threshold(rules.dropout_p)),
            np.uint64(key0), np.uint64(key1))


# --------------------------------------------------------------------------- #
# Memory: vector loads
# --------------------------------------------------------------------------- #

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


def launch_backward(q: Array, k: Array, v: Array, out: Array, lse: Array, grad_out: Array,
                    /, *, mask: Array | None, causal_offset: int | None, scale: float,
                    xp: Any, rules: Rules | None, grad_lse: Array | None,
                    launch: Any) -> tuple[Array, Array, Array]:
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
        inputs = kernel_inputs(q, k, v, mask, causal_offset, rules, scale, xp, dev)
        extra = tuple(dev.view(a) for a in (do4, lse3, delta))
        # vector loads where dO allows them too
        do_memory = _memory(do4 if dev.simulated else extra[0])
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
