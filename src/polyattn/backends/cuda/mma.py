"""Tensor-core matrix fragments: the PTX layouts, a NumPy emulator, and the Numba ops.

A warp-wide ``mma.sync`` multiplies a 16×K matrix A by a K×8 matrix B and adds a
16×8 matrix C, each spread over the 32 lanes of the warp in a fixed pattern
(the *fragment layout* of the PTX ISA, section "Matrix Fragments for
mma.m16nNkK"). With ``g = lane // 4`` (the group) and ``t = lane % 4`` (the
thread in the group):

``m16n8k16`` (float16 and bfloat16 operands, float32 accumulators)
    A (16×16), eight values per lane in four 32-bit registers of two halves
    (lower index in the lower 16 bits): ``a_i`` sits at row ``g`` for
    ``i ∈ {0, 1, 4, 5}`` and ``g + 8`` otherwise, column ``2t + (i & 1)``,
    plus 8 for ``i ≥ 4``. B (16×8), four values in two registers: ``b_i`` at
    row ``2t + (i & 1)``, plus 8 for ``i ≥ 2``, column ``g``.
``m16n8k8`` (TF32 operands, float32 accumulators)
    A (16×8), four registers: ``a_i`` at row ``g`` for ``i ∈ {0, 2}``, ``g + 8``
    otherwise, column ``t``, plus 4 for ``i ≥ 2``. B (8×8), two registers:
    ``b_i`` at row ``t + 4i``, column ``g``.
C and D (16×8, both shapes)
    ``c_i`` at row ``g``, plus 8 for ``i ≥ 2``, column ``2t + (i & 1)``.

This module writes those rules down once (:func:`a_position`,
:func:`b_position`, :func:`c_position`), emulates a warp's ``mma.sync`` on
NumPy arrays with them (:func:`mma`), and gives the tensor-core kernel its
device operations (:func:`device_ops`): on a GPU, Numba intrinsics that emit
the PTX instructions (``mma.sync``, ``cvt.rn.f16x2.f32``, ``cvt.rn.bf16x2.f32``,
``cvt.rna.tf32.f32``); on Numba's CUDA simulator, Python functions that gather
the 32 lanes' registers, rebuild the matrices through the same rules and
multiply them. A kernel whose own index arithmetic puts a value in the wrong
register therefore computes a wrong product on the simulator too, and the
tests compare it with the float64 oracle.

Examples
--------
>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> a = rng.standard_normal((16, 16)).astype(np.float16).astype(np.float32)
>>> b = rng.standard_normal((16, 8)).astype(np.float16).astype(np.float32)
>>> d = mma("m16n8k16", fragments_a("m16n8k16", a), fragments_b("m16n8k16", b),
...         fragments_c(np.zeros((16, 8), np.float32)))
>>> bool(np.allclose(matrix_c(d), a @ b, rtol=1e-6, atol=1e-6))
True
"""

from __future__ import annotations

import functools
import threading
import types as pytypes
from typing import Any

import numpy as np

SHAPES = {"m16n8k16": (16, 8, 16), "m16n8k8": (16, 8, 8)}  # (M, N, K)
WARP = 32


def a_position(shape: str, lane: int, i: int) -> tuple[int, int]:
    """(row, column) in A of the ``i``-th A value of ``lane``."""
    g, t = lane // 4, lane % 4
    if shape == "m16n8k16":
        row = g if i in (0, 1, 4, 5) else g + 8
        return row, 2 * t + (i & 1) + (8 if i >= 4 else 0)
    if shape == "m16n8k8":
        return (g if i in (0, 2) else g + 8), t + (4 if i >= 2 else 0)
    raise ValueError(f"unknown mma shape {shape!r}")


def b_position(shape: str, lane: int, i: int) -> tuple[int, int]:
    """(row, column) in B (K×8) of the ``i``-th B value of ``lane``."""
    g, t = lane // 4, lane % 4
    if shape == "m16n8k16":
        return 2 * t + (i & 1) + (8 if i >= 2 else 0), g
    if shape == "m16n8k8":
        return t + 4 * i, g
    raise ValueError(f"unknown mma shape {shape!r}")


def c_position(lane: int, i: int) -> tuple[int, int]:
    """(row, column) in C or D (16×8) of the ``i``-th accumulator of ``lane``."""
    g, t = lane // 4, lane % 4
    return g + (8 if i >= 2 else 0), 2 * t + (i & 1)


def values_per_lane(shape: str) -> tuple[int, int]:
    """How many A and B values one lane holds."""
    m, n, k = SHAPES[shape]
    return m * k // WARP, k * n // WARP


def fragments_a(shape: str, a: np.ndarray) -> np.ndarray:
    """(32, values) A values per lane, from the matrix."""
    count = values_per_lane(shape)[0]
    return np.array([[a[a_position(shape, lane, i)] for i in range(count)]
                     for lane in range(WARP)])


def fragments_b(shape: str, b: np.ndarray) -> np.ndarray:
    """(32, values) B values per lane, from the matrix."""
    count = values_per_lane(shape)[1]
    return np.array([[b[b_position(shape, lane, i)] for i in range(count)]
                     for lane in range(WARP)])


def fragments_c(c: np.ndarray) -> np.ndarray:
    """(32, 4) accumulators per lane, from the 16×8 matrix."""
    return np.array([[c[c_position(lane, i)] for i in range(4)] for lane in range(WARP)])


def _matrix(frags: np.ndarray, rows: int, cols: int, where: Any) -> np.ndarray:
    out = np.full((rows, cols), np.nan, dtype=np.float64)
    seen = np.zeros((rows, cols), dtype=np.int64)
    for lane in range(WARP):
        for i in range(frags.shape[1]):
            r, c = where(lane, i)
            out[r, c] = frags[lane, i]
            seen[r, c] += 1
    if not (seen == 1).all():
        raise AssertionError("a fragment layout does not cover its matrix exactly once")
    return out


def matrix_a(shape: str, frags: np.ndarray) -> np.ndarray:
    m, _, k = SHAPES[shape]
    return _matrix(frags, m, k, lambda lane, i: a_position(shape, lane, i))


def matrix_b(shape: str, frags: np.ndarray) -> np.ndarray:
    _, n, k = SHAPES[shape]
    return _matrix(frags, k, n, lambda lane, i: b_position(shape, lane, i))


def matrix_c(frags: np.ndarray) -> np.ndarray:
    return _matrix(frags, 16, 8, c_position)


def ldmatrix(matrices: list[np.ndarray]) -> np.ndarray:
    """A warp's ``ldmatrix.sync.aligned.m8n8.x4.b16`` on NumPy values: four 8×8
    matrices of 16-bit values (given as (8, 8) arrays; each lane of group
    ``8i … 8i+7`` supplies the address of one row of matrix ``i``) give each lane
    four registers, register ``i`` of lane ``l`` holding row ``l // 4``, values
    ``2·(l % 4)`` and ``2·(l % 4) + 1`` of matrix ``i``. Returns (32, 4, 2).

    The four 8×8 quadrants of a 16×16 A tile, in the order (rows 0-7, columns
    0-7), (rows 8-15, columns 0-7), (rows 0-7, 8-15), (rows 8-15, 8-15), give
    exactly its ``m16n8k16`` A fragments (:func:`fragments_a`).
    """
    out = np.zeros((WARP, 4, 2), dtype=np.asarray(matrices[0]).dtype)
    for lane in range(WARP):
        for i, matrix in enumerate(matrices):
            row, pair = lane // 4, lane % 4
            out[lane, i] = np.asarray(matrix)[row, 2 * pair:2 * pair + 2]
    return out


def mma(shape: str, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """A warp's ``D = A·B + C`` on per-lane fragments ((32, ·) arrays): D's fragments.

    Products of float16, bfloat16 or TF32 values are exact in float64; the sum
    is rounded to float32 once (the hardware rounds at least that often).
    """
    d = matrix_a(shape, a) @ matrix_b(shape, b) + matrix_c(c)
    return fragments_c(d.astype(np.float32))


# --------------------------------------------------------------------------- #
# Number formats, on NumPy values (the simulator's view of the registers)
# --------------------------------------------------------------------------- #

def f16_bits(x: Any) -> np.ndarray:
    """float16 bits (uint16) of float32 values, rounded to nearest even."""
    return np.asarray(np.asarray(x, dtype=np.float32).astype(np.float16)).view(np.uint16)


def bf16_bits(x: Any) -> np.ndarray:
    """bfloat16 bits (uint16) of float32 values, rounded to nearest even (NaN kept)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def from_f16_bits(bits: Any) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def from_bf16_bits(bits: Any) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).astype(np.uint32).view(np.float32)


def tf32_round(x: Any) -> np.ndarray:
    """float32 values rounded to TF32 (10 stored mantissa bits), to nearest with ties
    away from zero, as ``cvt.rna.tf32.f32``; inf and NaN unchanged."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(f), rounded, f).astype(np.float32)


def pack(lo: Any, hi: Any) -> np.uint32:
    """Two 16-bit values in one 32-bit register, ``lo`` in the lower half."""
    return np.uint32(int(lo) | (int(hi) << 16))


def unpack(word: Any) -> tuple[int, int]:
    w = int(word)
    return w & 0xFFFF, w >> 16


# --------------------------------------------------------------------------- #
# Device operations
# --------------------------------------------------------------------------- #

OPS = ("mma_f16", "mma_bf16", "mma_tf32", "pack_f16x2", "pack_bf16x2", "tf32_bits",
       "bits_to_f32", "quad_max", "quad_sum", "octet_max", "octet_sum", "ldmatrix_x4",
       "opaque_zero", "load_vector1", "load_vector2", "load_vector4")


class _Warp:
    """One warp's meeting point on the simulator: a barrier, a slot per lane and the
    result of the collective operation."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(WARP, timeout=300)
        self.slots: list[Any] = [None] * WARP
        self.result: Any = None


_warps: dict[tuple[int, int, int, int, int], _Warp] = {}
_warps_lock = threading.Lock()


def _collective(payload: Any, compute: Any) -> Any:
    """A warp-wide operation on the simulator: every lane of the calling thread's
    warp hands in ``payload``; lane 0 computes ``compute(payloads)`` (one entry per
    lane) and each lane gets its own entry. Every lane must call it, as every
    lane executes a warp-wide instruction."""
    me = threading.current_thread()
    tid = me.thread_id  # type: ignore[attr-defined]
    block = me.blockIdx  # type: ignore[attr-defined]
    key = (id(me._manager), block.x, block.y, block.z, tid // WARP)  # type: ignore[attr-defined]
    with _warps_lock:
        warp = _warps.setdefault(key, _Warp())
    lane = tid % WARP
    warp.slots[lane] = payload
    warp.barrier.wait()
    if lane == 0:
        warp.result = compute(warp.slots)
    warp.barrier.wait()
    return warp.result[lane]


@functools.cache
def _index(shape: str, operand: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) as (32, values) integer arrays for operand "a", "b" or "c"."""
    if operand == "c":
        where = [[c_position(lane, i) for i in range(4)] for lane in range(WARP)]
    else:
        count = values_per_lane(shape)[0 if operand == "a" else 1]
        position = a_position if operand == "a" else b_position
        where = [[position(shape, lane, i) for i in range(count)] for lane in range(WARP)]
    rc = np.array(where)
    return rc[..., 0], rc[..., 1]


def _gather(shape: str, operand: str, values: np.ndarray, rows: int, cols: int) -> np.ndarray:
    r, c = _index(shape, operand)
    matrix = np.zeros((rows, cols), dtype=np.float64)
    matrix[r, c] = values
    return matrix


def _halves(words: np.ndarray, decode: Any) -> np.ndarray:
    """(32, 2·n) values from (32, n) packed 32-bit words, lower halves first."""
    w = np.asarray(words, dtype=np.uint64)
    pairs = np.stack([w & 0xFFFF, w >> 16], axis=-1).reshape(w.shape[0], -1)
    return np.asarray(decode(pairs.astype(np.uint16)), dtype=np.float64)


def _simulated_mma(shape: str, decode: Any) -> Any:
    m, n, k = SHAPES[shape]

    def compute(slots: list[Any]) -> np.ndarray:
        a_words = np.array([x[0] for x in slots], dtype=np.uint64)
        b_words = np.array([x[1] for x in slots], dtype=np.uint64)
        if decode is None:  # TF32: registers hold float32 bits
            a = a_words.astype(np.uint32).view(np.float32).astype(np.float64)
            b = b_words.astype(np.uint32).view(np.float32).astype(np.float64)
        else:
            a, b = _halves(a_words, decode), _halves(b_words, decode)
        c = np.array([x[2] for x in slots], dtype=np.float64)
        d = _gather(shape, "a", a, m, k) @ _gather(shape, "b", b, k, n) + \
            _gather(shape, "c", c, m, n)
        r, col = _index(shape, "c")
        return d.astype(np.float32)[r, col]

    def op(a0: Any, a1: Any, a2: Any, a3: Any, b0: Any, b1: Any, c0: Any, c1: Any,
           c2: Any, c3: Any) -> tuple[np.float32, ...]:
        d = _collective(((int(a0), int(a1), int(a2), int(a3)), (int(b0), int(b1)),
                         (float(c0), float(c1), float(c2), float(c3))), compute)
        return tuple(np.float32(x) for x in d)

    return op


def _butterfly(combine: Any, lanes: int, cast: Any = np.float32) -> Any:
    """A reduction over aligned groups of ``lanes`` lanes, as ``shfl.bfly`` steps
    (xor 1, then xor 2, …), in the hardware's order."""

    def compute(slots: list[Any]) -> list[Any]:
        values = list(slots)
        step = 1
        while step < lanes:
            values = [combine(values[n], values[n ^ step]) for n in range(WARP)]
            step *= 2
        return values

    def op(x: Any) -> Any:
        return _collective(cast(x), compute)

    return op


def _simulated_ldmatrix(array: Any, row: Any, col: Any) -> tuple[np.uint32, ...]:
    """``ldmatrix`` x4 on the simulator: lane ``8i + r`` gives the row ``(row, col)``
    (four 32-bit words) of matrix ``i``; lane ``l`` gets word ``l % 4`` of row
    ``l // 4`` of each matrix."""

    def compute(slots: list[Any]) -> list[tuple[np.uint32, ...]]:
        result = []
        for lane in range(WARP):
            words = []
            for i in range(4):
                source, r, c = slots[8 * i + lane // 4]
                words.append(np.uint32(source[r, c + lane % 4]))
            result.append(tuple(words))
        return result

    return _collective((array, int(row), int(col)), compute)  # type: ignore[no-any-return]


def nan_max(x: Any, y: Any) -> Any:
    """max(x, y) where NaN wins (as the kernels' running maximum)."""
    return y if (y > x or y != y) else x


def simulated_ops() -> pytypes.SimpleNamespace:
    """The device operations as Python functions for Numba's CUDA simulator."""
    return pytypes.SimpleNamespace(
        mma_f16=_simulated_mma("m16n8k16", from_f16_bits),
        mma_bf16=_simulated_mma("m16n8k16", from_bf16_bits),
        mma_tf32=_simulated_mma("m16n8k8", None),
        pack_f16x2=lambda lo, hi: pack(f16_bits(lo), f16_bits(hi)),
        pack_bf16x2=lambda lo, hi: pack(bf16_bits(lo), bf16_bits(hi)),
        tf32_bits=lambda x: np.uint32(tf32_round(x).view(np.uint32)),
        bits_to_f32=lambda u: np.uint32(u).view(np.float32),
        quad_max=_butterfly(nan_max, 4),
        quad_sum=_butterfly(lambda x, y: np.float32(x) + np.float32(y), 4),
        octet_max=_butterfly(nan_max, 8, cast=lambda x: x),
        octet_sum=_butterfly(lambda x, y: x + y, 8, cast=lambda x: x),
        ldmatrix_x4=_simulated_ldmatrix,
        opaque_zero=lambda: 0,
        load_vector1=_simulated_load(1),
        load_vector2=_simulated_load(2),
        load_vector4=_simulated_load(4),
    )


def _simulated_load(width: int) -> Any:
    def load(array: Any, i0: Any, i1: Any, i2: Any, i3: Any) -> tuple[Any, ...]:
        return tuple(array[i0, i1, i2, i3 + w] for w in range(width))

    return load


def _intrinsic(name: str, result: str, operands: str, text: str, constraints: str,
               side_effect: bool = False) -> Any:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    operand_names = operands.split(",") if operands else []
    n_out = constraints.count("=")
    ret = (types.UniTuple(getattr(types, result), n_out) if n_out > 1
           else getattr(types, result))
    sig = ret(*(getattr(types, n) for n in operand_names))

    def llvm(type_name: str) -> Any:
        return ir.FloatType() if type_name == "float32" else ir.IntType(32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        outs = [llvm(result)] * n_out
        ret_ty = ir.LiteralStructType(outs) if n_out > 1 else outs[0]
        fnty = ir.FunctionType(ret_ty, [llvm(n) for n in operand_names])
        value = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect),
                             list(args))
        if n_out == 1:
            return value
        return context.make_tuple(builder, signature.return_type,
                                  [builder.extract_value(value, i) for i in range(n_out)])

    params = ", ".join(f"x{i}" for i in range(len(operand_names)))
    namespace: dict[str, Any] = {"sig": sig, "codegen": codegen}
    exec(f"def {name}(typingctx, {params}):\n    return sig, codegen\n", namespace)
    return intrinsic(namespace[name])


def _quad_intrinsic(name: str, reduce: Any) -> Any:
    """An intrinsic compiling ``reduce`` (a float -> the same float) into the calling
    kernel, for float32 or float64 arguments."""
    from numba import types
    from numba.cuda.extending import intrinsic

    def typer(typingctx: Any, x: Any) -> Any:
        if x not in (types.float32, types.float64):
            return None
        sig = x(x)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return context.compile_internal(builder, reduce, signature, args)

        return sig, codegen

    typer.__name__ = name
    return intrinsic(typer)


def _quad_reductions() -> tuple[Any, Any, Any, Any]:
    """Maximum (NaN wins) and sum over aligned groups of four lanes (``shfl.bfly``
    xor 1, then xor 2) and of eight lanes (then xor 4)."""
    from numba import cuda

    full = np.uint32(0xFFFFFFFF)
    one, two, four = np.int32(1), np.int32(2), np.int32(4)

    def quad_max(x: Any) -> Any:
        y = cuda.shfl_xor_sync(full, x, one)
        if y > x or y != y:
            x = y
        y = cuda.shfl_xor_sync(full, x, two)
        if y > x or y != y:
            x = y
        return x

    def quad_sum(x: Any) -> Any:
        x += cuda.shfl_xor_sync(full, x, one)
        return x + cuda.shfl_xor_sync(full, x, two)

    def octet_max(x: Any) -> Any:
        y = cuda.shfl_xor_sync(full, x, one)
        if y > x or y != y:
            x = y
        y = cuda.shfl_xor_sync(full, x, two)
        if y > x or y != y:
            x = y
        y = cuda.shfl_xor_sync(full, x, four)
        if y > x or y != y:
            x = y
        return x

    def octet_sum(x: Any) -> Any:
        x += cuda.shfl_xor_sync(full, x, one)
        x += cuda.shfl_xor_sync(full, x, two)
        return x + cuda.shfl_xor_sync(full, x, four)

    return (_quad_intrinsic("quad_max", quad_max), _quad_intrinsic("quad_sum", quad_sum),
            _quad_intrinsic("octet_max", octet_max), _quad_intrinsic("octet_sum", octet_sum))


def gpu_ops() -> pytypes.SimpleNamespace:
    """The device operations as Numba intrinsics that emit PTX (sm_80 and later).

    Intrinsics, not ``cuda.jit(device=True)`` functions, so that kernels calling
    them compile to PTX without a GPU to ask for its architecture.
    """
    quad_max, quad_sum, octet_max, octet_sum = _quad_reductions()
    mma16 = ("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{$0,$1,$2,$3}}, "
             "{{$4,$5,$6,$7}}, {{$8,$9}}, {{$10,$11,$12,$13}};")
    mma_constraints = "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"
    mma_operands = ",".join(["uint32"] * 6 + ["float32"] * 4)
    return pytypes.SimpleNamespace(
        mma_f16=_intrinsic("mma_f16", "float32", mma_operands, mma16.format(t="f16"),
                           mma_constraints),
        mma_bf16=_intrinsic("mma_bf16", "float32", mma_operands, mma16.format(t="bf16"),
                            mma_constraints),
        # TF32 operands are 32-bit registers holding float32 bits ("r" constraints).
        mma_tf32=_intrinsic(
            "mma_tf32", "float32", mma_operands,
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {$0,$1,$2,$3}, "
            "{$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};", mma_constraints),
        # cvt.rn.{f16,bf16}x2.f32 d, a, b puts a in the upper half: hi first.
        pack_f16x2=_swap(_intrinsic("pack_f16x2_hi_lo", "uint32", "float32,float32",
                                    "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")),
        pack_bf16x2=_swap(_intrinsic("pack_bf16x2_hi_lo", "uint32", "float32,float32",
                                     "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")),
        tf32_bits=_intrinsic("tf32_bits", "uint32", "float32",
                             "cvt.rna.tf32.f32 $0, $1;", "=r,f"),
        bits_to_f32=_intrinsic("bits_to_f32", "float32", "uint32", "mov.b32 $0, $1;",
                               "=f,r"),
        quad_max=quad_max,
        quad_sum=quad_sum,
        octet_max=octet_max,
        octet_sum=octet_sum,
        ldmatrix_x4=_ldmatrix_intrinsic(),
        # A zero the compiler cannot see through: shared-memory indices that add it
        # in a loop are computed there, not hoisted as 64-bit addresses.
        opaque_zero=_intrinsic("opaque_zero", "int32", "", "mov.u32 $0, 0;", "=r",
                               side_effect=True),
        load_vector1=_vector_load(1),
        load_vector2=_vector_load(2),
        load_vector4=_vector_load(4),
    )


def _vector_load(width: int) -> Any:
    """``load_vector{width}(a, i, j, k, l)``: ``a[i, j, k, l : l + width]`` of a 4-D
    float32 or float64 array in global memory, as one load (``ld.global.nc``; a
    vector of 8 or 16 bytes for ``width`` > 1) whose address is computed in 32-bit
    integers.

    The caller guarantees what makes that valid (see
    :func:`.inputs.vector_loads_fit`): the elements are consecutive in memory,
    the address is aligned to ``width`` elements, the array is not written by the
    kernel, and every byte offset in it fits in a signed 32-bit integer.
    """
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    def typer(typingctx: Any, array: Any, i0: Any, i1: Any, i2: Any, i3: Any) -> Any:
        if not (isinstance(array, types.Array) and array.ndim == 4
                and array.dtype in (types.float32, types.float64)
                and width * array.dtype.bitwidth // 8 <= 16
                and all(isinstance(i, types.Integer) for i in (i0, i1, i2, i3))):
            return None
        sig = types.UniTuple(array.dtype, width)(array, i0, i1, i2, i3)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            arrty = signature.args[0]
            ary = context.make_array(arrty)(context, builder, args[0])
            i32 = ir.IntType(32)
            offset = ir.Constant(i32, 0)
            strides = cgutils.unpack_tuple(builder, ary.strides, 4)
            for value, ty, stride in zip(args[1:], signature.args[1:], strides, strict=True):
                index = builder.trunc(context.cast(builder, value, ty, types.int64), i32)
                step = builder.mul(index, builder.trunc(stride, i32), flags=["nsw"])
                offset = builder.add(offset, step, flags=["nsw"])
            base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
            address = builder.gep(base, [builder.sext(offset, ir.IntType(64))])
            element = context.get_value_type(arrty.dtype)
            loaded = ir.VectorType(element, width) if width > 1 else element
            pointer = builder.addrspacecast(builder.bitcast(address, loaded.as_pointer()),
                                            ir.PointerType(loaded, 1))
            value = builder.load(pointer, align=width * arrty.dtype.bitwidth // 8)
            value.set_metadata("invariant.load", builder.module.add_metadata([]))
            items = ([builder.extract_element(value, ir.Constant(i32, w)) for w in range(width)]
                     if width > 1 else [value])
            return context.make_tuple(builder, signature.return_type, items)

        return sig, codegen

    typer.__name__ = f"load_vector{width}"
    return intrinsic(typer)


def _ldmatrix_intrinsic() -> Any:
    """``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` from a 2-D uint32 shared array: the
    lane gives the element that starts its row (16 bytes, 16-byte aligned)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    def ldmatrix_x4(typingctx: Any, array: Any, row: Any, col: Any) -> Any:
        if not (isinstance(array, types.Array) and array.ndim == 2
                and array.dtype == types.uint32):
            return None
        sig = types.UniTuple(types.uint32, 4)(array, row, col)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            arrty = signature.args[0]
            ary = context.make_array(arrty)(context, builder, args[0])
            indices = [context.cast(builder, value, ty, types.intp)
                       for value, ty in zip(args[1:], signature.args[1:], strict=True)]
            pointer = cgutils.get_item_pointer(context, builder, arrty, ary, indices,
                                               wraparound=False)
            i32 = ir.IntType(32)
            shared = builder.addrspacecast(pointer, ir.PointerType(i32, 3))
            address = builder.ptrtoint(shared, i32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
            asm = ir.InlineAsm(
                fnty, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0,$1,$2,$3}, [$4];",
                "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            value = builder.call(asm, [address])
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(value, i) for i in range(4)])

        return sig, codegen

    return intrinsic(ldmatrix_x4)


def _swap(hi_lo: Any) -> Any:
    """``pack(lo, hi)`` from an intrinsic taking ``(hi, lo)``."""
    from numba import types
    from numba.cuda.extending import intrinsic

    def pack_lo_hi(typingctx: Any, lo: Any, hi: Any) -> Any:
        sig = types.uint32(types.float32, types.float32)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            def call(lo: Any, hi: Any) -> Any:
                return hi_lo(hi, lo)

            return context.compile_internal(builder, call, signature, args)

        return sig, codegen

    return intrinsic(pack_lo_hi)


def device_ops(simulated: bool) -> pytypes.SimpleNamespace:
    """:func:`simulated_ops` on the CUDA simulator, else :func:`gpu_ops`."""
    return simulated_ops() if simulated else gpu_ops()
