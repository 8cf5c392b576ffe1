"""Register-tiled matrix products for :mod:`.kernels`, written in LLVM IR
(this module imports Numba: import it only where Numba is installed).

``tile_RxV(a, lda, b, ldb, c, ldc, depth, alpha, accumulate)`` computes, for row-major
operands given by address and row stride (in elements),

    C[R × V·L] = alpha · A[R × depth] · B[depth × V·L]   (+ C when ``accumulate``)

with ``L`` lanes per SIMD vector: R·V vector accumulators stay in registers for the
whole ``depth`` loop, each step loads V vectors of one row of B and multiplies them by
R broadcast elements of one column of A (fused multiply-adds). No packing: the attention
kernel lays its operands out for this itself (``Kᵀ`` once per block of keys; the weights
``P`` and the values ``V`` are already rows). On a small product (a few hundred rows
and columns) this runs faster than a general BLAS call, whose packing and dispatch
costs are paid again on every call.

Numba's own loops would not do: it turns off LLVM's SLP vectoriser, and its arrays live
in memory, not in registers. The sums run in the order ``depth = 0, 1, …`` for every
element (as a textbook dot product), whatever the tile shape.

The vector width follows the CPU Numba compiles for (``NUMBA_CPU_FEATURES`` when set,
else the host's): 64 bytes with AVX-512 (32 registers: 12 × 2 accumulators), else 32
bytes (16 registers: 6 × 2).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from llvmlite import binding, ir
from numba.core import cgutils, config, types
from numba.extending import intrinsic

#: LLVM's names of the x86 CPUs with AVX-512 (Intel from Skylake-SP, AMD from Zen 4), for a
#: ``NUMBA_CPU_NAME`` whose features are not spelled out.
AVX512_CPUS = frozenset({
    "skylake-avx512", "skx", "cascadelake", "cooperlake", "cannonlake", "icelake-client",
    "icelake-server", "tigerlake", "rocketlake", "sapphirerapids", "emeraldrapids",
    "graniterapids", "graniterapids-d", "diamondrapids", "knl", "knm", "znver4", "znver5",
    "x86-64-v4"})


def vector_bytes(cpu_name: str | None = None, cpu_features: str | None = None) -> int:
    """Bytes per SIMD register of the CPU Numba compiles for (64 or 32).

    As Numba does: ``NUMBA_CPU_FEATURES`` when set (even empty), else the host's
    features; where they neither add nor remove ``avx512f``, ``NUMBA_CPU_NAME`` (else the
    host's name) decides. So ``NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=""`` compiles
    32-byte vectors on any host, and ``znver4`` 64-byte ones.
    """
    name = cpu_name if cpu_name is not None else getattr(config, "CPU_NAME", None)
    features = cpu_features if cpu_features is not None else getattr(config, "CPU_FEATURES",
                                                                      None)
    if features is None:
        features = binding.get_host_cpu_features().flatten()
    flags = features.split(",")
    if "+avx512f" in flags or "-avx512f" in flags:
        return 64 if "+avx512f" in flags else 32
    cpu = name if name not in (None, "host") else binding.get_host_cpu_name()
    return 64 if cpu.lower() in AVX512_CPUS else 32


VECTOR_BYTES = vector_bytes()
#: Rows of A per tile (the tile has TILE_ROWS × 2 vector accumulators).
TILE_ROWS = 12 if VECTOR_BYTES == 64 else 6
#: Vectors of B per tile.
TILE_VECTORS = 2


def lanes(itemsize: int) -> int:
    """Elements per SIMD vector."""
    return VECTOR_BYTES // itemsize


@contextmanager
def rolled_range(builder: Any, count: Any) -> Iterator[Any]:
    """A loop over ``[0, count)`` (yields its index) that LLVM must not unroll: a tile's
    loop body holds every register the tile has; two copies of it, interleaved by the
    scheduler, would spill accumulators to the stack on every step."""
    i64 = count.type
    cond = builder.append_basic_block("rolled.cond")
    body = builder.append_basic_block("rolled.body")
    end = builder.append_basic_block("rolled.end")
    start = builder.basic_block
    builder.branch(cond)
    with builder.goto_block(cond):
        index = builder.phi(i64)
        builder.cbranch(builder.icmp_signed("<", index, count), body, end)
    with builder.goto_block(body):
        yield index
        step = builder.add(index, ir.Constant(i64, 1))
        back = builder.branch(cond)
        back.set_metadata("llvm.loop", _no_unroll(builder.module))
        index.add_incoming(step, builder.basic_block)
    index.add_incoming(ir.Constant(i64, 0), start)
    builder.position_at_end(end)


def _no_unroll(module: Any) -> Any:
    """A loop's identifier metadata saying "do not unroll" (its first operand is itself,
    as LLVM requires of a loop identifier)."""
    disable = module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])
    loop_id = ir.values.MDValue(module, [], name=str(len(module.metadata)))
    loop_id.operands = (loop_id, disable)
    return loop_id


def _tile(rows: int, vectors: int) -> Any:
    """The intrinsic for one tile shape (rows × vectors), for float32 and float64."""

    def typer(typingctx: Any, a: Any, a_row: Any, a_col: Any, b: Any, ldb: Any, c: Any,
              ldc: Any, depth: Any, alpha: Any, accumulate: Any) -> Any:
        if alpha not in (types.float32, types.float64):
            return None
        i64 = types.int64
        sig = types.void(i64, i64, i64, i64, i64, i64, i64, i64, alpha, types.boolean)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            a, a_row, a_col, b, ldb, c, ldc, depth, alpha_v, acc_flag = args
            vec = _Vec(builder, signature.args[8] == types.float32)
            i64t = ir.IntType(64)
            pa = builder.inttoptr(a, vec.fty.as_pointer())
            pb = builder.inttoptr(b, vec.fty.as_pointer())
            pc = builder.inttoptr(c, vec.fty.as_pointer())
            # accumulators as allocas of the entry block: LLVM keeps them in registers
            accs = [cgutils.alloca_once(builder, vec.vty) for _ in range(rows * vectors)]
            for x in accs:
                builder.store(vec.const(0.0), x)
            row_a = [builder.mul(ir.Constant(i64t, r), a_row) for r in range(rows)]
            with rolled_range(builder, depth) as p:
                b_row = builder.mul(p, ldb)
                a_p = builder.gep(pa, [builder.mul(p, a_col)])
                bv = [builder.load(vec.at(pb, builder.add(b_row, ir.Constant(i64t, v * vec.n))),
                                   align=vec.size) for v in range(vectors)]
                for r in range(rows):
                    av = vec.splat(builder.load(builder.gep(a_p, [row_a[r]])))
                    for v in range(vectors):
                        x = accs[r * vectors + v]
                        builder.store(vec.call("fma", av, bv[v], builder.load(x)), x)
            scale = vec.splat(alpha_v)
            with builder.if_else(acc_flag) as (add, store):
                for branch, accumulate_here in ((add, True), (store, False)):
                    with branch:
                        for r in range(rows):
                            c_row = builder.mul(ir.Constant(i64t, r), ldc)
                            for v in range(vectors):
                                ptr = vec.at(pc, builder.add(c_row, ir.Constant(i64t, v * vec.n)))
                                val = builder.fmul(builder.load(accs[r * vectors + v]), scale)
                                if accumulate_here:
                                    val = builder.fadd(builder.load(ptr, align=vec.size), val)
                                builder.store(val, ptr, align=vec.size)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"tile_{rows}x{vectors}"
    return intrinsic(typer)


# --- row operations on whole vectors: the largest element, and the exponentials --------
#
# A row of n elements is read as n // L whole vectors and one last vector gathered into a
# stack buffer padded with a neutral value, so that every element takes the same
# vector code (the same rounding wherever it sits in a row).

LN2_HI = 0.693145751953125              # ln 2 to 16 bits: n·LN2_HI is exact for |n| < 2¹¹
LN2_LO = 1.4286068203094172321e-06      # ln 2 - LN2_HI
LOG2E = 1.4426950408889634
#: The smallest argument with a normal result (below it: 0).
EXP_LOW = {4: -87.33654, 8: -708.3964185322641}
#: e^r for |r| ≤ ln 2 / 2, highest degree first: in float32 a degree-6 polynomial
#: interpolating e^r at the Chebyshev nodes of the interval (relative error 1e-7), in
#: float64 the Taylor polynomial of degree 12 (3e-16).
EXP_POLY = {4: [1.3941108405412358e-03, 8.375126398192753e-03, 4.166635289712625e-02,
                1.6666415514651783e-01, 0.5000000047117692, 1.0000000377162137, 1.0],
            8: [1.0 / math.factorial(d) for d in range(12, -1, -1)]}


class _Vec:
    """LLVM helpers for one float type and vector width."""

    def __init__(self, builder: Any, single: bool) -> None:
        self.b = builder
        self.size = 4 if single else 8
        self.fty = ir.FloatType() if single else ir.DoubleType()
        self.n = lanes(self.size)
        self.vty = ir.VectorType(self.fty, self.n)
        self.ity = ir.IntType(32 if single else 64)
        self.suffix = f"v{self.n}f{32 if single else 64}"

    def const(self, x: float) -> Any:
        return ir.Constant(self.vty, [x] * self.n)

    def splat(self, x: Any) -> Any:
        i32 = ir.IntType(32)
        undef = ir.Constant(self.vty, ir.Undefined)
        first = ir.Constant(ir.VectorType(i32, self.n), [0] * self.n)
        return self.b.shuffle_vector(self.b.insert_element(undef, x, ir.Constant(i32, 0)),
                                     undef, first)

    def call(self, name: str, *args: Any) -> Any:
        fn = cgutils.get_or_insert_function(
            self.b.module, ir.FunctionType(self.vty, [self.vty] * len(args)),
            f"llvm.{name}.{self.suffix}")
        return self.b.call(fn, list(args))

    def at(self, base: Any, index: Any) -> Any:
        return self.b.bitcast(self.b.gep(base, [index]), self.vty.as_pointer())

    def lanes_of(self, v: Any) -> list[Any]:
        return [self.b.extract_element(v, ir.Constant(ir.IntType(32), i))
                for i in range(self.n)]

    def rows(self, ptr: Any, count: Any, pad: float, body: Any) -> None:
        """``body(vector) -> vector or None`` over the row at ``ptr`` of ``count``
        elements (a result is stored back), the last part padded with ``pad``."""
        b = self.b
        i64 = ir.IntType(64)
        whole = b.sdiv(count, ir.Constant(i64, self.n))
        with cgutils.for_range(b, whole) as loop:
            where = self.at(ptr, b.mul(loop.index, ir.Constant(i64, self.n)))
            res = body(b.load(where, align=self.size))
            if res is not None:
                b.store(res, where, align=self.size)
        start = b.mul(whole, ir.Constant(i64, self.n))
        rest = b.sub(count, start)
        with b.if_then(b.icmp_signed(">", rest, ir.Constant(i64, 0))):
            buf = cgutils.alloca_once(b, self.vty)
            b.store(self.const(pad), buf)
            elems = b.bitcast(buf, self.fty.as_pointer())
            tail = b.gep(ptr, [start])
            with cgutils.for_range(b, rest) as loop:
                b.store(b.load(b.gep(tail, [loop.index])), b.gep(elems, [loop.index]))
            res = body(b.load(buf))
            if res is not None:
                b.store(res, buf)
                with cgutils.for_range(b, rest) as loop:
                    b.store(b.load(b.gep(elems, [loop.index])), b.gep(tail, [loop.index]))

    def exp(self, v: Any) -> Any:
        """e^v lane by lane: Cody–Waite range reduction (``v = k·ln 2 + r``), the
        polynomial for e^r, times 2ᵏ; 0 below the smallest normal result, NaN stays NaN."""
        b = self.b
        low = self.const(EXP_LOW[self.size])
        below = b.fcmp_ordered("<", v, low)
        t = b.select(below, low, v)                  # NaN stays NaN
        k = self.call("floor", self.call("fma", t, self.const(LOG2E), self.const(0.5)))
        r = self.call("fma", b.fneg(k), self.const(LN2_HI), t)
        r = self.call("fma", b.fneg(k), self.const(LN2_LO), r)
        coeffs = EXP_POLY[self.size]
        p = self.const(coeffs[0])
        for c in coeffs[1:]:
            p = self.call("fma", p, r, self.const(c))
        if VECTOR_BYTES == 64:
            # AVX-512's scalef: p·2ᵏ in one instruction (k ≥ -126 / -1022 here)
            name = f"llvm.x86.avx512.mask.scalef.{'ps' if self.size == 4 else 'pd'}.512"
            mask_t = ir.IntType(self.n)
            fn = cgutils.get_or_insert_function(
                b.module, ir.FunctionType(self.vty, [self.vty, self.vty, self.vty, mask_t,
                                                     ir.IntType(32)]), name)
            p = b.call(fn, [p, k, p, ir.Constant(mask_t, -1), ir.Constant(ir.IntType(32), 4)])
        else:
            ivty = ir.VectorType(self.ity, self.n)
            bias, shift = (127, 23) if self.size == 4 else (1023, 52)
            bits = b.shl(b.add(b.fptosi(k, ivty), ir.Constant(ivty, [bias] * self.n)),
                         ir.Constant(ivty, [shift] * self.n))
            p = b.fmul(p, b.bitcast(bits, self.vty))
        return b.select(below, self.const(0.0), p)


def _float_of(alpha: Any) -> bool | None:
    """True for float32, False for float64, None otherwise."""
    return {types.float32: True, types.float64: False}.get(alpha)


def _exp_sum(typingctx: Any, ptr: Any, count: Any, shift: Any) -> Any:
    """``x[j] = e^(x[j] - shift)`` for the ``count`` elements at address ``ptr``, in
    place; returns their sum."""
    single = _float_of(shift)
    if single is None:
        return None
    sig = shift(types.int64, types.int64, shift)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vec = _Vec(builder, single)
        ptr = builder.inttoptr(args[0], vec.fty.as_pointer())
        by = vec.splat(args[2])
        total = cgutils.alloca_once_value(builder, vec.const(0.0))
        # padding: e^(-inf) = 0 adds nothing to the sum
        pad = float("-inf")

        def body(x: Any) -> Any:
            y = vec.exp(builder.fsub(x, by))
            builder.store(builder.fadd(builder.load(total), y), total)
            return y

        vec.rows(ptr, args[1], pad, body)
        parts = vec.lanes_of(builder.load(total))
        out = parts[0]
        for x in parts[1:]:
            out = builder.fadd(out, x)
        return out

    return sig, codegen


exp_sum: Any = intrinsic(_exp_sum)


def _next_item(typingctx: Any, counter: Any) -> Any:
    """``counter[0]``, incremented by one in the same atomic step: the index of the next
    work item for the thread that asks (each index is handed out once)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64
            and counter.ndim == 1 and counter.mutable):
        return None
    sig = types.int64(counter)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1),
                                  "monotonic")

    return sig, codegen


next_item: Any = intrinsic(_next_item)


#: Tiles of TILE_ROWS, 8, 4, 2 and 1 rows (any row count is a sum of them) by
#: TILE_VECTORS vectors.
tile_rows: Any = _tile(TILE_ROWS, TILE_VECTORS)
tile_8: Any = _tile(8, TILE_VECTORS)
tile_4: Any = _tile(4, TILE_VECTORS)
tile_2: Any = _tile(2, TILE_VECTORS)
tile_1: Any = _tile(1, TILE_VECTORS)
#: Tiles one vector wide (the second vector of a panel alone), of TILE_ROWS, 4 and 1 rows.
half_rows: Any = _tile(TILE_ROWS, 1)
half_4: Any = _tile(4, 1)
half_1: Any = _tile(1, 1)


def _softmax_step(typingctx: Any, s: Any, n: Any, lds: Any, m: Any, lsum: Any, acc: Any,
                 acc_rows: Any, ldacc: Any, like: Any) -> Any:
    """One block of the online softmax for TILE_VECTORS vectors of columns (one column
    per query row), every step a vector operation:

    - ``s`` (``n`` rows, row stride ``lds``): the scores of ``n`` keys, leaves with their
      weights ``e^(s - shift)``; ``shift`` is the new running maximum (0 where it is
      ``-inf``: no key seen yet);
    - ``m``, ``lsum``: the running maximum (the largest score that is not NaN: IEEE
      maxNum) and sum of weights per column, updated;
    - ``acc`` (``acc_rows`` rows, stride ``ldacc``): the weighted sums so far, rescaled
      by ``e^(m_old - shift)``.
    """
    single = _float_of(like)
    if single is None:
        return None
    i64 = types.int64
    sig = types.void(i64, i64, i64, i64, i64, i64, i64, i64, like)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vec = _Vec(builder, single)
        i64t = ir.IntType(64)
        ptr = vec.fty.as_pointer()
        ps, pm, pl, pacc = (builder.inttoptr(args[i], ptr) for i in (0, 3, 4, 5))
        n, lds, acc_rows, ldacc = args[1], args[2], args[6], args[7]
        offsets = [ir.Constant(i64t, v * vec.n) for v in range(TILE_VECTORS)]
        ninf = vec.const(float("-inf"))
        # the largest score that is not NaN, over ROWS_AT_ONCE rows at a time (independent
        # chains); ``x > best ? x : best`` keeps ``best`` for a NaN ``x`` (one x86 max)
        unroll = 4
        best = [[cgutils.alloca_once_value(builder, ninf) for _ in offsets]
                for _ in range(unroll)]

        def take(row: Any, chain: int) -> None:
            for v, off in enumerate(offsets):
                x = builder.load(vec.at(ps, builder.add(row, off)), align=vec.size)
                old = builder.load(best[chain][v])
                builder.store(builder.select(builder.fcmp_ordered(">", x, old), x, old),
                              best[chain][v])

        groups = builder.sdiv(n, ir.Constant(i64t, unroll))
        with cgutils.for_range(builder, groups) as loop:
            base = builder.mul(loop.index, ir.Constant(i64t, unroll))
            for u in range(unroll):
                take(builder.mul(builder.add(base, ir.Constant(i64t, u)), lds), u)
        with cgutils.for_range(builder, builder.sub(n, builder.mul(
                groups, ir.Constant(i64t, unroll)))) as loop:
            row = builder.add(builder.mul(groups, ir.Constant(i64t, unroll)), loop.index)
            take(builder.mul(row, lds), 0)
        for u in range(1, unroll):
            for v in range(len(offsets)):
                builder.store(vec.call("maxnum", builder.load(best[0][v]),
                                       builder.load(best[u][v])), best[0][v])
        best = best[0]
        shifts, scales = [], []
        totals = [cgutils.alloca_once_value(builder, vec.const(0.0)) for _ in offsets]
        for v, off in enumerate(offsets):
            m_old = builder.load(vec.at(pm, off), align=vec.size)
            m_new = vec.call("maxnum", m_old, builder.load(best[v]))
            unseen = builder.fcmp_ordered("==", m_new, ninf)
            shift = builder.select(unseen, vec.const(0.0), m_new)
            shifts.append(shift)
            scales.append(vec.exp(builder.fsub(m_old, shift)))     # e^-inf = 0
            builder.store(m_new, vec.at(pm, off), align=vec.size)
        with cgutils.for_range(builder, n) as loop:
            row = builder.mul(loop.index, lds)
            for v, off in enumerate(offsets):
                where = vec.at(ps, builder.add(row, off))
                w = vec.exp(builder.fsub(builder.load(where, align=vec.size), shifts[v]))
                builder.store(w, where, align=vec.size)
                builder.store(builder.fadd(builder.load(totals[v]), w), totals[v])
        for v, off in enumerate(offsets):
            where = vec.at(pl, off)
            old = builder.fmul(builder.load(where, align=vec.size), scales[v])
            builder.store(builder.fadd(old, builder.load(totals[v])), where, align=vec.size)
        # the rescale of ``acc``, skipped when no column's maximum changed (every factor 1)
        changed = ir.Constant(ir.IntType(1), 0)
        for v in range(len(offsets)):
            differs = builder.fcmp_unordered("!=", scales[v], vec.const(1.0))
            bits = builder.bitcast(differs, ir.IntType(vec.n))
            changed = builder.or_(changed, builder.icmp_unsigned("!=", bits,
                                                                 ir.Constant(ir.IntType(vec.n), 0)))
        with builder.if_then(changed):
            with cgutils.for_range(builder, acc_rows) as loop:
                row = builder.mul(loop.index, ldacc)
                for v, off in enumerate(offsets):
                    where = vec.at(pacc, builder.add(row, off))
                    builder.store(builder.fmul(builder.load(where, align=vec.size),
                                               scales[v]), where, align=vec.size)
        return context.get_dummy_value()

    return sig, codegen


softmax_step: Any = intrinsic(_softmax_step)


def _exp_columns(typingctx: Any, s: Any, n: Any, lds: Any, shift: Any, like: Any) -> Any:
    """``s[j, c] = e^(s[j, c] - shift[c])`` for ``n`` rows (stride ``lds``) of
    TILE_VECTORS vectors of columns; ``shift`` holds one value per column."""
    single = _float_of(like)
    if single is None:
        return None
    i64 = types.int64
    sig = types.void(i64, i64, i64, i64, like)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vec = _Vec(builder, single)
        i64t = ir.IntType(64)
        ptr = vec.fty.as_pointer()
        ps, pshift = builder.inttoptr(args[0], ptr), builder.inttoptr(args[3], ptr)
        offsets = [ir.Constant(i64t, v * vec.n) for v in range(TILE_VECTORS)]
        shifts = [builder.load(vec.at(pshift, off), align=vec.size) for off in offsets]
        with cgutils.for_range(builder, args[1]) as loop:
            row = builder.mul(loop.index, args[2])
            for v, off in enumerate(offsets):
                where = vec.at(ps, builder.add(row, off))
                x = builder.load(where, align=vec.size)
                builder.store(vec.exp(builder.fsub(x, shifts[v])), where, align=vec.size)
        return context.get_dummy_value()

    return sig, codegen



exp_columns: Any = intrinsic(_exp_columns)


def _transpose(typingctx: Any, src: Any, lds: Any, dst: Any, ldd: Any, rows: Any,
               cols: Any, like: Any) -> Any:
    """``dst[c, r] = src[r, c]`` for ``r < rows``, ``c < cols`` (row-major operands by
    address and row stride in elements): whole L × L blocks (L lanes) in registers,
    log2(L) rounds of swapping the off-diagonal halves of every block of rows, the
    edges element by element."""
    single = _float_of(like)
    if single is None:
        return None
    i64 = types.int64
    sig = types.void(i64, i64, i64, i64, i64, i64, like)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vec = _Vec(builder, single)
        i64t = ir.IntType(64)
        i32 = ir.IntType(32)
        ptr = vec.fty.as_pointer()
        ps, pd = builder.inttoptr(args[0], ptr), builder.inttoptr(args[2], ptr)
        lds, ldd, rows, cols = args[1], args[3], args[4], args[5]
        n = vec.n
        width = ir.Constant(i64t, n)
        masks = {}
        half = n // 2
        while half:
            masks[half] = (
                ir.Constant(ir.VectorType(i32, n),
                            [c if not c & half else n + c - half for c in range(n)]),
                ir.Constant(ir.VectorType(i32, n),
                            [c + half if not c & half else n + c for c in range(n)]))
            half //= 2
        row_blocks, col_blocks = builder.sdiv(rows, width), builder.sdiv(cols, width)
        with cgutils.for_range(builder, row_blocks) as rb:
            r0 = builder.mul(rb.index, width)
            with cgutils.for_range(builder, col_blocks) as cb:
                c0 = builder.mul(cb.index, width)
                vs = [builder.load(vec.at(ps, builder.add(
                    builder.mul(builder.add(r0, ir.Constant(i64t, i)), lds), c0)),
                    align=vec.size) for i in range(n)]
                half = n // 2
                while half:
                    first, second = masks[half]
                    for i in range(n):
                        if not i & half:
                            a, b = vs[i], vs[i + half]
                            vs[i] = builder.shuffle_vector(a, b, first)
                            vs[i + half] = builder.shuffle_vector(a, b, second)
                    half //= 2
                for i in range(n):
                    where = builder.add(builder.mul(builder.add(c0, ir.Constant(i64t, i)),
                                                    ldd), r0)
                    builder.store(vs[i], vec.at(pd, where), align=vec.size)

        def element(r: Any, c: Any) -> None:
            x = builder.load(builder.gep(ps, [builder.add(builder.mul(r, lds), c)]))
            builder.store(x, builder.gep(pd, [builder.add(builder.mul(c, ldd), r)]))

        done_rows, done_cols = builder.mul(row_blocks, width), builder.mul(col_blocks, width)
        with cgutils.for_range(builder, done_rows) as r:        # the columns past the blocks
            with cgutils.for_range(builder, cols, start=done_cols) as c:
                element(r.index, c.index)
        with cgutils.for_range(builder, rows, start=done_rows) as r:   # the rows past them
            with cgutils.for_range(builder, cols) as c:
                element(r.index, c.index)
        return context.get_dummy_value()

    return sig, codegen


transpose: Any = intrinsic(_transpose)
