"""A call in the CUDA kernels' form: device views, the mask's layout, the rules' tables
and parameters, and whether rows may be read 16 bytes at a time.

:func:`kernel_inputs` gives every kernel launch its arguments: (B, H, T, E)
device views of q, k and v (leading batch axes merged with ``reshape``, a copy
only when their strides cannot be merged), the mask read in place through its
strides (a size-1 axis indexed at 0, the leading batch axes reached through a
small table ``mask_batch``, so a broadcast mask is never materialised), the key
lengths (B,) and ALiBi slopes (B|1, H|1) as small device arrays
(:func:`_rule_tables`), the scale, and the rules' run-time parameters as the one
tuple of :func:`polyattn.rules.lowering.kernel_parameters`, which the kernels
hand to the functions of :mod:`polyattn.rules.element` unread.
:func:`vector_loads_fit` says whether the register-tiled kernels may read
16 bytes per load.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from polyattn.backends.cuda import blocks
from polyattn.backends.cuda.environment import DTYPES, HEAD_DIM_BUCKETS, MAX_HEAD_DIM, _Device
from polyattn.backends.cuda.user_rules import user_key
from polyattn.rules.lowering import kernel_parameters, modifies
from polyattn.rules.visibility import Rules

Array = Any


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


# --------------------------------------------------------------------------- #
# Kernel inputs
# --------------------------------------------------------------------------- #

@dataclasses.dataclass(frozen=True)
class KernelInputs:
    """One call in the kernels' form.

    ``arrays``: device views of q (B, H, Tq, E), k, v (B, Hkv, Tk, ·), the mask
    (Bm, Hm, Tqm, Tkm) (a never-read placeholder without one), its batch table,
    the key lengths and the ALiBi slopes. ``parameters``: the scale in the compute
    dtype and the rules' tuple of :func:`polyattn.rules.lowering.kernel_parameters`,
    the kernels' arguments after their outputs. ``mods``: whether scores are
    modified (:func:`polyattn.rules.lowering.modifies`). ``vector_loads``: whether
    q, k and v may be read by vector loads (:func:`vector_loads_fit`). ``user``: the
    specialisation key of the call's ``score_mod`` and ``mask_mod``
    (:func:`.user_rules.user_key`; ``None`` without them), ``buffers``: the device
    views of its ``mod_args`` buffers ``(fb, ib, meta)`` (placeholders without them).
    ``masks``: the specialisation key of its segment ids and block mask
    (:func:`.blocks.mask_key`; ``None`` without them), ``tables``: the kernels' last
    arguments ``(segments, kinds, bq, bk)`` (:func:`.blocks.tables`; placeholders).
    """

    mask_kind: str
    mods: bool
    arrays: tuple[Any, ...]
    parameters: tuple[Any, Any]
    vector_loads: bool = False
    user: Any = None
    buffers: tuple[Any, ...] = ()
    masks: Any = None
    tables: tuple[Any, ...] = ()


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


def kernel_inputs(q: Array, k: Array, v: Array, mask: Array | None, rules: Rules,
                  scale: float, xp: Any, dev: _Device) -> KernelInputs:
    """:class:`KernelInputs` of a call with at least one query row."""
    *batch_list, n_heads, tq, e = q.shape
    *_, n_kv_heads, tk, ev = v.shape
    batch = tuple(batch_list)
    n_batch = math.prod(batch)
    dtype = _dtype_name(q)
    q4 = xp.reshape(q, (n_batch, n_heads, tq, e))  # (B, H, Tq, E)
    k4 = xp.reshape(k, (n_batch, n_kv_heads, tk, e))  # (B, Hkv, Tk, E)
    v4 = xp.reshape(v, (n_batch, n_kv_heads, tk, ev))  # (B, Hkv, Tk, Ev)
    mask_kind = _mask_kind(mask, dtype)
    if mask is None:
        mask4 = q4[:1, :1, :1, :1]  # never read
        table = np.zeros(1, dtype=np.int64)
    else:
        mask4, table = _mask_layout(mask, batch, (n_heads, tq, tk), xp)
    lengths, slopes = _rule_tables(rules, batch, n_heads, q.dtype, dev, xp)
    arrays = tuple(dev.view(a) for a in (q4, k4, v4, mask4, dev.from_numpy(table), lengths,
                                         slopes))
    parameters = (np.dtype(dtype).type(scale), kernel_parameters(rules, dtype))
    sources = (q4, k4, v4) if dev.simulated else arrays[:3]
    user, host_buffers = user_key(rules, dtype)
    buffers = tuple(dev.view(dev.from_numpy(a)) for a in host_buffers)
    masks, (segments, kinds, bq, bk) = blocks.tables(rules, batch)
    tables = (dev.view(dev.from_numpy(segments)), dev.view(dev.from_numpy(kinds)), bq, bk)
    return KernelInputs(mask_kind, modifies(rules), arrays, parameters,
                        vector_loads_fit(*(memory_of(x) for x in sources)), user, buffers,
                        masks, tables)


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


# --------------------------------------------------------------------------- #
# Memory: vector loads
# --------------------------------------------------------------------------- #

Memory = tuple[int, tuple[int, ...], tuple[int, ...], int]


def memory_of(x: Any) -> Memory:
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
    """Why the register-tiled kernel cannot read the array ``x`` (:func:`memory_of`) 16
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
    by :func:`memory_of`) 16 bytes at a time, addressed in 32-bit integers: rows of
    consecutive elements whose length is a multiple of 16 bytes, the other strides
    non-negative multiples of 16 bytes, a 16-byte aligned start, and every byte
    offset below 2³¹ (:func:`vector_loads_problem`). Any (B, H, T, E) or
    (B, T, H, E) array of its own memory with E a multiple of 4 (float32) or 2
    (float64), below 2 GiB, qualifies; other arrays are read one element at a time
    with 64-bit indices.

    >>> x = np.zeros((2, 3, 5, 8), np.float32)
    >>> vector_loads_fit(memory_of(x)), vector_loads_fit(memory_of(x[..., :6]))
    (True, False)
    """
    return all(vector_loads_problem(x) is None for x in arrays)


def row_loads(**arrays: Any) -> str:
    """How the register-tiled kernel reads the named arrays' rows, for people."""
    for name, x in arrays.items():
        try:
            why = vector_loads_problem(memory_of(x))
        except (AttributeError, KeyError, TypeError):
            return "rows read element by element unless the arrays' memory allows 16-byte loads"
        if why is not None:
            return f"rows read element by element, 64-bit indices (`{name}`: {why})"
    return "rows read 16 bytes per load, 32-bit addresses"
