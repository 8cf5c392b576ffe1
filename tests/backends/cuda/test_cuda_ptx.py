"""Compile the kernel specialisations for sm_80 and sm_90, without a GPU, and read
what ptxas makes of it.

Of the one-thread-per-row forward and backward kernels and the tensor-core
kernels (float16, bfloat16, 3xTF32): at head size 64 a pairwise sample (every
dtype or arithmetic with every mask kind, score modifiers on and off with each
of both), each other head size once per dtype or arithmetic (once in all for the
backward kernels, which only decoding shapes use) with a rotating mask kind and
modifier setting, and the split merges; the register-tiled forward kernels in
their heaviest float32 specialisation (a float mask with modifiers: the most
registers) up to head size 128 (the ones with a register budget), the
register-tiled dQ and dK/dV kernels in theirs at head sizes 64 and 128, and of
the other (dtype, head size) pairs every second one and one more for each head
size left out, with a rotating kernel, mask kind and modifier setting; a sample
of user rules, segment ids and block masks. ``POLYATTN_PTX_SWEEP=all`` (the
``kernel_ptx_all`` session) compiles every specialisation of every family:
about 45 minutes on 2 cores.

Numba's NVVM emits the same PTX for sm_80 and sm_90 but for its ``.target``
line (checked on a sample of every family: ``test_one_ptx_serves_both``), so
each kernel is compiled to PTX once and ptxas assembles that PTX for both
architectures. On the PTX: float32 and float16 kernels touch no float64 at
all (one untyped literal, ``0.0`` instead of ``float32(0.0)``, would put
double-precision instructions in an inner loop); plain kernels carry no score
modifier code; every attention kernel carries the dropout cipher. On ptxas's
report and the SASS (ptxas and cuobjdump from NVIDIA's wheels): the
register-tiled float32 kernels up to head size 128 fit in 128 registers, the
forward ones spill nothing, no float32 kernel touches local memory in an
innermost loop, the longest dependent FFMA chain is at most 8, the tiled
kernels read rows with 16-byte loads; the tensor-core kernels issue
exactly the expected HMMA and LDSM instructions per 16-key step and (float16,
bfloat16) spill nothing. ``pytest -s`` prints the registers and spills.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess

import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed", allow_module_level=True)
if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
    pytest.skip("the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) cannot compile PTX",
                allow_module_level=True)

from numba import cuda

from polyattn.backends.cuda import (
    rows as numba_cuda,
)
from polyattn.backends.cuda import (
    rows_backward as numba_cuda_backward,
)
from polyattn.backends.cuda import (
    tensor_core as numba_cuda_tc,
)
from polyattn.backends.cuda import (
    tiled as numba_cuda_tiled,
)
from polyattn.backends.cuda import (
    tiled_backward as numba_cuda_tiled_backward,
)
from polyattn.rules import dropout as _dropout


def _nvvm_problem() -> str | None:
    """None when NVVM compiles a trivial kernel, else the error."""

    def probe(x):
        x[0] = 1

    try:
        cuda.compile_ptx(probe, "void(int32[::1])", cc=(8, 0))
    except Exception as exc:  # a missing NVVM library surfaces as several types
        return f"{type(exc).__name__}: {exc}"
    return None


_problem = _nvvm_problem()
if _problem is not None:
    pytest.skip(f"NVVM is not usable: {_problem}", allow_module_level=True)

ARCHS = [(8, 0), (9, 0)]
PTX_CC = (8, 0)  # the PTX of every kernel; ptxas assembles it for each of ARCHS

# Any float64 register, operation, conversion, load or store.
F64 = re.compile(r"\.f64\b|%fd\d")
# Double-precision arithmetic (the part that would cost throughput).
F64_ARITHMETIC = re.compile(
    r"\b(add|sub|mul|fma|div|max|min|ex2|lg2|rcp|sqrt|neg|abs)\.[a-z.]*f64\b"
)
# Double-precision SASS instructions (arithmetic, conversions, compares).
F64_SASS = re.compile(r"\b(DADD|DMUL|DFMA|DSETP|DMNMX|DMMA)\b|\bF2F\.F64|\.F64\b")
LOCAL_SASS = re.compile(r"\b(LDL|STL)\b")
# ALiBi's distance |p_i - j| converted from int64 to the compute dtype.
INT_TO_FLOAT = re.compile(r"\bcvt\.rn\.f(32|64)\.s64\b")
# Philox4x32's multipliers, as PTX immediates (unsigned or signed 32-bit).
PHILOX = [re.compile(rf"\b({m}|{m - 2**32})\b") for m in (_dropout.M0, _dropout.M1)]
USED = re.compile(r"Used (\d+) registers")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _nvidia_tool(name: str) -> str | None:
    """``name`` from the NVIDIA wheels of this environment (nvidia-cuda-nvcc,
    nvidia-cuda-cuobjdump: the same CUDA release as Numba's NVVM), else on PATH."""
    import glob
    import sysconfig

    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia",
                                              "*", "bin", name))):
        return path
    return shutil.which(name)


HAVE_SASS_TOOLS = _nvidia_tool("ptxas") is not None and _nvidia_tool("cuobjdump") is not None
needs_sass_tools = pytest.mark.skipif(
    not HAVE_SASS_TOOLS,
    reason="ptxas and cuobjdump are not installed (nvidia-cuda-nvcc, nvidia-cuda-cuobjdump)")


def _instructions(ptx: str) -> list[str]:
    """PTX lines without comments and blank lines."""
    lines = (line.split("//", 1)[0].strip() for line in ptx.splitlines())
    return [line for line in lines if line]


def compile_ptx(fn, sig, bounds=None, cc=PTX_CC) -> str:
    """The PTX of one kernel, with the launch bounds it is compiled with."""
    options = {} if bounds is None else {"launch_bounds": bounds}
    return cuda.compile_ptx(fn, sig, cc=cc, **options)[0]


def ptxas_and_sass(ptx: str, cc: tuple[int, int], sass: bool = True) -> tuple[str, str]:
    """(ptxas -v report, cuobjdump -sass text, or "" without ``sass``) of one kernel's
    PTX for sm_XY."""
    import tempfile

    ptxas, cuobjdump = _nvidia_tool("ptxas"), _nvidia_tool("cuobjdump")
    assert ptxas and cuobjdump
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        run = subprocess.run([ptxas, "-v", f"-arch=sm_{cc[0]}{cc[1]}", "-", "-o", cubin],
                             input=ptx, capture_output=True, text=True, check=True)
        text = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout if sass else ""
    return run.stderr, text


def assembled(ptx: str, sass: bool = True) -> dict[tuple[int, int], tuple[str, str]]:
    """{architecture: (ptxas report, SASS or "")} of one PTX for every one of ARCHS."""
    return {cc: ptxas_and_sass(ptx, cc, sass) for cc in ARCHS}


def usage(report: str) -> tuple[int, int, int]:
    """(registers, stack bytes, spill-store bytes) from a ptxas -v report."""
    used, frame = USED.search(report), FRAME.search(report)
    assert used and frame, report
    return int(used.group(1)), int(frame.group(1)), int(frame.group(2))


def has_philox(body: list[str]) -> bool:
    return all(any(m.search(line) for line in body) for m in PHILOX)


def assert_float64_only_where_asked(name: str, body: list[str]) -> None:
    if "float64" not in name:
        f64 = [line for line in body if F64.search(line)]
        assert not f64, f"{name} uses float64:\n" + "\n".join(f64[:20])
    else:
        assert any(F64_ARITHMETIC.search(line) for line in body)


def assert_ptx_basics(name: str, ptx: str, mods: bool, dropout: bool = True) -> list[str]:
    """The checks every kernel's PTX passes; its instructions."""
    body = _instructions(ptx)
    assert any(f".target sm_{PTX_CC[0]}{PTX_CC[1]}" in line for line in body)
    assert any(".entry" in line for line in body)
    assert_float64_only_where_asked(name, body)
    assert has_philox(body) == dropout, name
    assert any(INT_TO_FLOAT.search(line) for line in body) == mods, name
    return body


def _normalised(ptx: str) -> str:
    """PTX without what differs between two compilations of one kernel: the target
    line, the mangled names (a compilation counter is part of them) and the
    numbering of shared arrays."""
    ptx = re.sub(r"^\.target sm_\d+", ".target", ptx, flags=re.M)
    return re.sub(r"_cudapy_smem_\d+", "SMEM", re.sub(r"_ZN\w+", "NAME", ptx))


# --------------------------------------------------------------------------- #
# The one-thread-per-row kernels (0.1), forward and split merge: a sample
# --------------------------------------------------------------------------- #

#: ``POLYATTN_PTX_SWEEP=all`` (the ``kernel_ptx_all`` session): every specialisation of
#: every family; by default a sample of those a family has many of.
SWEEP_ALL = os.environ.get("POLYATTN_PTX_SWEEP", "") == "all"


def pairwise(dtype_index: int, mask_index: int) -> bool:
    """The modifier setting of (dtype, mask kind) in a pairwise sample: every dtype with
    every mask kind, and the modifiers on and off with each dtype and with each mask
    kind (the full product, every dtype × mask kind × modifiers, is twice the size)."""
    return (dtype_index + mask_index) % 2 == 1


def _rotating(buckets, pair_bucket, make, signature, dtypes):
    """At ``pair_bucket``, every dtype with every mask kind, the modifier setting as
    :func:`pairwise` gives it; each other (dtype, head bucket) once with a rotating mask
    kind and modifier setting. ``POLYATTN_PTX_SWEEP=all``: the full product everywhere."""
    specs = []
    n = 0
    for d, dtype in enumerate(dtypes):
        for bucket in buckets(dtype):
            for m, mask_kind in enumerate(numba_cuda.MASK_KINDS):
                for mods in (False, True):
                    if SWEEP_ALL or (mods == pairwise(d, m) if bucket == pair_bucket else (
                            mask_kind == numba_cuda.MASK_KINDS[n % 3] and mods == (n % 2 == 1))):
                        specs.append((make(dtype, bucket, mask_kind, mods),
                                      signature(dtype, mask_kind)))
            n += bucket != pair_bucket
    return specs


ROWS = _rotating(lambda dtype: numba_cuda.HEAD_DIM_BUCKETS, 64, numba_cuda.make_kernel_function,
                 numba_cuda._signature, numba_cuda.DTYPES) + [
    (numba_cuda.make_merge_function(dtype), numba_cuda._merge_signature(dtype))
    for dtype in numba_cuda.DTYPES]


@pytest.mark.parametrize("index", range(len(ROWS)),
                         ids=[fn.__name__.removeprefix("attention_") for fn, _ in ROWS])
def test_row_kernel(index):
    fn, sig = ROWS[index]
    name = fn.__name__
    ptx = compile_ptx(fn, sig)
    assert_ptx_basics(name, ptx, "_mods" in name, dropout=name.startswith("attention_"))
    if HAVE_SASS_TOOLS:
        for cc, (report, _) in assembled(ptx, sass=False).items():
            print(f"{name} sm_{cc[0]}{cc[1]}: registers, stack, spill stores {usage(report)}")


def test_row_sample_covers_every_axis():
    names = [fn.__name__ for fn, _ in ROWS]
    assert len(set(names)) == len(names)
    assert len(names) == (74 if SWEEP_ALL else 18)
    assert sum(name.startswith("merge_splits_") for name in names) == len(numba_cuda.DTYPES)
    for part in (*numba_cuda.DTYPES, *(f"_{m}" for m in numba_cuda.MASK_KINDS), "_mods",
                 *(f"head{b}_" for b in numba_cuda.HEAD_DIM_BUCKETS)):
        assert any(part in name for name in names), part


# --------------------------------------------------------------------------- #
# The one-thread-per-row backward kernels (decoding shapes): a sample
# --------------------------------------------------------------------------- #

def _row_backward_specs() -> list[tuple[object, object]]:
    """Both kernels at head size 64 in the pairwise sample of :func:`pairwise` (the full
    product with ``POLYATTN_PTX_SWEEP=all``), and each other head size once (a rotating
    dtype, mask kind and modifier choice, so that each appears)."""
    if SWEEP_ALL:
        return list(numba_cuda_backward.specializations())
    specs = []
    for d, dtype in enumerate(numba_cuda.DTYPES):
        for m, mask_kind in enumerate(numba_cuda.MASK_KINDS):
            mods = pairwise(d, m)
            specs.append((numba_cuda_backward.make_dq_function(dtype, 64, mask_kind, mods),
                          numba_cuda_backward._signature(dtype, mask_kind, 1)))
            specs.append((numba_cuda_backward.make_dkdv_function(dtype, 64, mask_kind, mods),
                          numba_cuda_backward._signature(dtype, mask_kind, 2)))
    others = [b for b in numba_cuda.HEAD_DIM_BUCKETS if b != 64]
    for n, bucket in enumerate(others):
        dtype = numba_cuda.DTYPES[n % 2]
        mask_kind = numba_cuda.MASK_KINDS[n % 3]
        mods = n % 2 == 1
        specs.append((numba_cuda_backward.make_dq_function(dtype, bucket, mask_kind, mods),
                      numba_cuda_backward._signature(dtype, mask_kind, 1)))
        specs.append((numba_cuda_backward.make_dkdv_function(dtype, bucket, mask_kind, mods),
                      numba_cuda_backward._signature(dtype, mask_kind, 2)))
    return specs


ROW_BACKWARD = _row_backward_specs()


@pytest.mark.parametrize("index", range(len(ROW_BACKWARD)),
                         ids=[fn.__name__.removeprefix("attention_") for fn, _ in ROW_BACKWARD])
def test_row_backward_kernel(index):
    fn, sig = ROW_BACKWARD[index]
    name = fn.__name__
    ptx = compile_ptx(fn, sig)
    assert_ptx_basics(name, ptx, "_mods" in name)  # dropout's keep-mask, recomputed
    if HAVE_SASS_TOOLS:
        for cc, (report, _) in assembled(ptx, sass=False).items():
            print(f"{name} sm_{cc[0]}{cc[1]}: registers, stack, spill stores {usage(report)}")


def test_row_backward_sample_covers_every_axis():
    names = [fn.__name__ for fn, _ in ROW_BACKWARD]
    assert len(set(names)) == len(names)
    for part in ("dq_", "dkdv_", *numba_cuda.DTYPES, *(f"_{m}" for m in numba_cuda.MASK_KINDS),
                 "_mods", *(f"head{b}_" for b in numba_cuda.HEAD_DIM_BUCKETS)):
        assert any(part in name for name in names), part


# --------------------------------------------------------------------------- #
# The tensor-core kernels: a sample
# --------------------------------------------------------------------------- #

TC = _rotating(lambda arith: [b for b in numba_cuda_tc.HEAD_DIM_BUCKETS
                               if b <= numba_cuda_tc.MAX_HEAD[arith]], 64,
               numba_cuda_tc.make_kernel_function,
               lambda arith, mask_kind: numba_cuda_tc._signature(mask_kind),
               numba_cuda_tc.ARITHMETICS)
MMA_PTX = {"f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
           "bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
           "3xtf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}
HMMA_SASS = {"f16": re.compile(r"\bHMMA\.16816\.F32\b"),
             "bf16": re.compile(r"\bHMMA\.16816\.F32\.BF16\b"),
             "3xtf32": re.compile(r"\bHMMA\.1688\.F32\.TF32\b")}


@pytest.mark.parametrize("index", range(len(TC)), ids=[fn.__name__ for fn, _ in TC])
def test_tensor_core_kernel(index):
    """The right ``mma.sync`` and no float64 in the PTX; for sm_80 and sm_90, each
    16-key step issues exactly the expected HMMA instructions (three per product
    for 3xTF32) and ldmatrix instructions, no double-precision instruction, and
    in the float16 and bfloat16 kernels no spills and no local memory at all (the
    warp's scores, Q fragments and accumulators stay in registers)."""
    fn, sig = TC[index]
    name = fn.__name__
    arith = name.split("_")[1]
    bucket = int(name.split("_head")[1].split("_")[0])
    ptx = compile_ptx(fn, sig)
    body = assert_ptx_basics(name, ptx, "_mods" in name)
    mma = [line for line in body if line.startswith("mma.sync")]
    assert mma and all(MMA_PTX[arith] in line for line in mma), mma[:3]
    if not HAVE_SASS_TOOLS:
        pytest.skip("ptxas and cuobjdump are not installed")
    for cc, (report, sass) in assembled(ptx).items():
        lines = sass.splitlines()
        hmma = [line for line in lines if "HMMA" in line]
        assert all(HMMA_SASS[arith].search(line) for line in hmma), hmma[:3]
        assert len(hmma) == numba_cuda_tc.hmma_per_step(arith, bucket), (name, len(hmma))
        f64 = [line for line in lines if F64_SASS.search(line)]
        assert not f64, f"{name} runs float64 instructions:\n" + "\n".join(f64[:10])
        ldsm = [line for line in lines if "LDSM" in line]
        assert all("LDSM.16.M88.4" in line for line in ldsm), ldsm[:3]
        assert len(ldsm) == numba_cuda_tc.ldmatrix_per_step(arith, bucket), (name, len(ldsm))
        registers, stack, spills = usage(report)
        local = len([line for line in lines if LOCAL_SASS.search(line)])
        if arith != "3xtf32":  # opt-in: at head size 64 its doubled Q fragments spill 8 bytes
            assert (stack, spills, local) == (0, 0, 0), (name, cc, report)
        print(f"{name} sm_{cc[0]}{cc[1]}: registers {registers}, stack {stack} B, spill "
              f"stores {spills} B, local loads/stores {local}, HMMA {len(hmma)}")


# --------------------------------------------------------------------------- #
# The register-tiled exact kernels, forward and backward: a sample
# --------------------------------------------------------------------------- #

FFMA = re.compile(r"\b(FFMA|DFMA)(\.\w+)*\s+(R\d+),\s*(-?\|?R\d+\|?)(\.reuse)?,\s*"
                  r"(-?R\d+|[-\w.+]+)(\.reuse)?,\s*(-?R\d+)")


DEST = re.compile(r"^\s*(?:/\*[0-9a-f]+\*/)?\s*(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s+(R\d+)")


def longest_dependent_run(sass: str) -> int:
    """The longest run of FFMA/DFMA instructions, in program order, each adding to
    the result of the one just before it (``d' = a'·b' + d``): a serial
    accumulation, each waiting for the previous one (the 0.1 kernel's dot product
    was one such run per key, whatever registers hold it). An instruction that
    overwrites that result ends the run."""
    best = run = 0
    previous = None
    for line in sass.splitlines():
        match = FFMA.search(line)
        if not match:
            written = DEST.search(line)
            if written and written.group(2) == previous:
                previous, run = None, 0
            continue
        run = run + 1 if match.group(8).strip("-") == previous else 1
        best = max(best, run)
        previous = match.group(3)
    return best


ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*)")
BRANCH = re.compile(r"\bBRA\s+(?:\S+,\s*)?0x([0-9a-f]+)")


def innermost_loops(sass: str) -> list[tuple[int, int]]:
    """Address ranges ``(start, end)`` of the innermost loops: a backward branch (to
    ``start``, from ``end``) that the code from ``start`` reaches without leaving the
    range, and whose range holds no other such branch. (A backward branch that does not
    close a loop: the return of a detour ptxas places after the kernel's exit, such as
    the slow path of a warp shuffle after ``BRA.DIV``.)"""
    code = []
    for line in sass.splitlines():
        match = ADDRESS.search(line)
        if match:
            code.append((int(match.group(1), 16), match.group(2)))
    loops = []
    for end, text in code:
        branch = BRANCH.search(text)
        if branch and int(branch.group(1), 16) <= end:
            start = int(branch.group(1), 16)
            if _reaches(code, start, end):
                loops.append((start, end))
    return [(lo, hi) for lo, hi in loops
            if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]


def _reaches(code: list[tuple[int, str]], start: int, end: int) -> bool:
    """Whether the instruction at ``end`` runs after the one at ``start`` by fall-through
    and branches that stay within ``[start, end]``."""
    inside = [(a, text) for a, text in code if start <= a <= end]
    index = {a: i for i, (a, _) in enumerate(inside)}
    seen, todo = set(), [start]
    while todo:
        a = todo.pop()
        if a in seen or a not in index:
            continue
        seen.add(a)
        if a == end:
            return True
        text = inside[index[a]][1]
        branch = BRANCH.search(text)
        if branch and start <= int(branch.group(1), 16) <= end:
            todo.append(int(branch.group(1), 16))
        unconditional = not text.lstrip().startswith("@") and (
            re.match(r"(EXIT|RET|BRA)\b", text.strip()) and not text.strip().startswith("BRA.DIV"))
        if not unconditional and index[a] + 1 < len(inside):
            todo.append(inside[index[a] + 1][0])
    return False


def local_accesses_in_inner_loops(sass: str) -> list[str]:
    """The local-memory loads and stores (LDL, STL) inside an innermost loop."""
    loops = innermost_loops(sass)
    found = []
    for line in sass.splitlines():
        match = ADDRESS.search(line)
        if match and LOCAL_SASS.search(match.group(2)):
            address = int(match.group(1), 16)
            if any(lo <= address <= hi for lo, hi in loops):
                found.append(line.strip())
    return found


def test_innermost_loops_and_their_local_accesses():
    sass = "\n".join([
        "/*0000*/ MOV R1, c[0x0][0x28] ;", "/*0010*/ STL [R1], R2 ;",
        "/*0020*/ LDS R3, [R4] ;", "/*0030*/ LDL R5, [R1] ;",
        "/*0040*/ FFMA R6, R3, R3, R6 ;", "/*0050*/ @P0 BRA 0x20 ;",
        "/*0060*/ LDL R7, [R1] ;", "/*0070*/ @P1 BRA 0x10 ;",
        "/*0080*/ @P2 BRA 0xa0 ;", "/*0090*/ EXIT ;"])
    assert innermost_loops(sass) == [(0x20, 0x50)]
    assert local_accesses_in_inner_loops(sass) == ["/*0030*/ LDL R5, [R1] ;"]
    # a detour after the exit (a shuffle's slow path) branches back but closes no loop
    detour = "\n".join([
        "/*0000*/ BRA.DIV ~URZ, 0x60 ;", "/*0010*/ SHFL.BFLY PT, R4, R2, 0x1, 0x1f ;",
        "/*0020*/ LDL R5, [R1] ;", "/*0030*/ FADD R6, R4, R5 ;", "/*0040*/ STG [R8], R6 ;",
        "/*0050*/ EXIT ;", "/*0060*/ CALL.REL.NOINC 0x90 ;", "/*0070*/ BRA 0x20 ;",
        "/*0080*/ BRA 0x80 ;", "/*0090*/ RET.REL.NODEC R4 0x0 ;"])
    assert innermost_loops(detour) == [(0x80, 0x80)]
    assert local_accesses_in_inner_loops(detour) == []


def test_dependent_run_counts_back_to_back_chains():
    chain = ["FFMA R1, R2, R3, R1 ;", "FFMA R6, R1, R3, R1 ;", "LDS R9, [R8] ;",
             "FFMA R7, R4, R9, R6 ;"]
    assert longest_dependent_run("\n".join(chain)) == 3
    interleaved = ["FFMA R1, R2, R3, R1 ;", "FFMA R5, R2, R3, R5 ;", "FFMA R1, R4, R3, R1 ;"]
    assert longest_dependent_run("\n".join(interleaved)) == 1
    assert longest_dependent_run("FFMA R1, R2, R3, R4 ;\nFFMA R5, R1, R3, R6 ;") == 1
    rewritten = ["FFMA R1, R2, R3, R1 ;", "FADD R1, R2, R3 ;", "FFMA R1, R4, R3, R1 ;"]
    assert longest_dependent_run("\n".join(rewritten)) == 1



def _rotating_sample(kernels, full, extremes=()) -> list[tuple]:
    """(kernel, dtype, head bucket, mask kind, modifiers) of ``kernels``: the full
    product for the (dtype, head bucket) pairs in ``full``; for the pairs in
    ``extremes``, each kernel's heaviest specialisation (a float mask with
    modifiers, the most registers; a lighter one holds less code); of the other pairs
    every second one, and the first with each head bucket the sample would lack, as one
    specialisation of one kernel, kernel, mask kind and modifier setting rotating so that
    each appears. Each tiled kernel takes 15-35 s to compile; ``POLYATTN_PTX_SWEEP=all``
    takes the full product everywhere."""
    kinds = numba_cuda.MASK_KINDS
    pairs = [(d, b) for d in numba_cuda.DTYPES for b in numba_cuda.HEAD_DIM_BUCKETS]
    specs = []
    others = [p for p in pairs if p not in full and p not in extremes]
    rest = others[::2]
    for pair in others:
        if all(pair[1] != b for _, b in (*full, *extremes, *rest)):
            rest.append(pair)
    for n, (dtype, bucket) in enumerate(rest):
        turn = n // len(kernels)  # each kernel's own turn: its kinds and modifiers rotate
        specs.append((kernels[n % len(kernels)], dtype, bucket, kinds[turn % 3], turn % 2 == 1))
    specs += [(kernel, dtype, bucket, mask_kind, mods) for kernel in kernels
              for dtype, bucket in extremes
              for mask_kind, mods in (("float", True),)
              if (kernel, dtype, bucket, mask_kind, mods) not in specs]
    specs += [(kernel, dtype, bucket, mask_kind, mods) for kernel in kernels
              for dtype, bucket in pairs if (dtype, bucket) in full or SWEEP_ALL
              for mask_kind in kinds for mods in (False, True)
              if (kernel, dtype, bucket, mask_kind, mods) not in specs]
    return specs


# The heaviest float32 specialisation at each head size up to 128 (the largest
# with a register and spill budget); of the other (dtype, head size) pairs, the sample of
# :func:`_rotating_sample`. Every specialisation: kernel_ptx_all.
TILED = [spec[1:] for spec in _rotating_sample(
    ("forward",), [], [("float32", b) for b in numba_cuda.HEAD_DIM_BUCKETS if b <= 128])]
# Loads of 16 bytes (float32 ×4, float64 ×2), read-only path: the vector loads of rows.
VECTOR_LOAD = re.compile(r"\bLDG\.E\.128\.CONSTANT\b")


def _spec_id(spec) -> str:
    return "_".join(map(str, spec))


def assert_exact_kernel_sass(name: str, dtype: str, bucket: int, ptx: str) -> dict:
    """What every register-tiled kernel's SASS shows, for sm_80 and sm_90: no float64
    in float32, no serial FMA chain, and in float32 up to head size 128 at most 128
    registers and no local memory in an innermost loop. {architecture: (registers,
    stack, spill stores)}."""
    found = {}
    for cc, (report, sass) in assembled(ptx).items():
        registers, stack, spills = usage(report)
        run = longest_dependent_run(sass)
        inner = local_accesses_in_inner_loops(sass)
        print(f"{name} sm_{cc[0]}{cc[1]}: registers {registers}, stack {stack} B, spill "
              f"stores {spills} B, longest dependent FMA run {run}, local accesses in "
              f"inner loops {len(inner)}")
        assert F64_SASS.search(sass) is None or dtype == "float64", (name, cc)
        assert run <= 8, (name, cc)
        if dtype == "float32" and bucket <= 128:
            assert registers <= 128, (name, cc, report)
            assert inner == [], (name, cc, inner[:5])
        found[cc] = (registers, stack, spills, sass)
    return found


@pytest.mark.parametrize("spec", TILED, ids=_spec_id)
def test_tiled_kernel(spec):
    """The register-tiled forward kernel, compiled with its launch bounds: the checks
    of :func:`assert_exact_kernel_sass`, no spills at all in float32 up to head size
    128, and rows read by 16-byte loads."""
    dtype, bucket, mask_kind, mods = spec
    fn = numba_cuda_tiled.make_kernel_function(dtype, bucket, mask_kind, mods)
    ptx = compile_ptx(fn, numba_cuda_tiled._signature(dtype, mask_kind),
                      numba_cuda_tiled.launch_bounds(dtype, bucket))
    body = assert_ptx_basics(fn.__name__, ptx, mods)
    assert any(re.match(r"ld\.global\.nc\.v[24]\.f(32|64)", line) for line in body)
    if not HAVE_SASS_TOOLS:
        pytest.skip("ptxas and cuobjdump are not installed")
    for cc, (_, stack, spills, sass) in assert_exact_kernel_sass(
            fn.__name__, dtype, bucket, ptx).items():
        assert VECTOR_LOAD.search(sass), (fn.__name__, cc)
        if dtype == "float32" and bucket <= 128:
            assert (stack, spills) == (0, 0), (fn.__name__, cc)
            assert not LOCAL_SASS.search(sass), (fn.__name__, cc)


# The heaviest float32 specialisation at head sizes 64 and 128 (whose
# register patches are the largest of those with a 128-register budget); of the other
# (dtype, head size) pairs, the sample of :func:`_rotating_sample`, by one of the two
# kernels in turn. Every specialisation: kernel_ptx_all.
TILED_BACKWARD = _rotating_sample(("dq", "dkdv"), [], [("float32", 64), ("float32", 128)])


def test_tiled_samples_cover_every_axis():
    pairs = {(d, b) for d in numba_cuda.DTYPES for b in numba_cuda.HEAD_DIM_BUCKETS}
    for specs in (TILED_BACKWARD, [("forward", *spec) for spec in TILED]):
        assert len(set(specs)) == len(specs)
        for n, axis in enumerate((numba_cuda.DTYPES, numba_cuda.HEAD_DIM_BUCKETS,
                                  numba_cuda.MASK_KINDS, (False, True))):
            assert {spec[n + 1] for spec in specs} == set(axis)
        assert SWEEP_ALL is ({(spec[1], spec[2]) for spec in specs} == pairs)
    assert (len(TILED), len(TILED_BACKWARD)) == ((72, 144) if SWEEP_ALL else (9, 11))


@pytest.mark.parametrize("spec", TILED_BACKWARD, ids=_spec_id)
def test_tiled_backward_kernel(spec):
    """The register-tiled dQ and dK/dV kernels, compiled with their launch bounds: the
    checks of :func:`assert_exact_kernel_sass`, and rows read by 16-byte loads."""
    kernel, dtype, bucket, mask_kind, mods = spec
    module = numba_cuda_tiled_backward
    make, threads, outputs = ((module.make_dq_function, module.dq_threads, 1)
                              if kernel == "dq" else
                              (module.make_dkdv_function, module.dkdv_threads, 2))
    fn = make(dtype, bucket, mask_kind, mods)
    ptx = compile_ptx(fn, module._signature(dtype, mask_kind, outputs),
                      module.launch_bounds(dtype, threads(bucket)))
    body = assert_ptx_basics(fn.__name__, ptx, mods)
    assert any(re.match(r"ld\.global\.nc\.v[24]\.f(32|64)", line) for line in body)
    if not HAVE_SASS_TOOLS:
        pytest.skip("ptxas and cuobjdump are not installed")
    for cc, found in assert_exact_kernel_sass(fn.__name__, dtype, bucket, ptx).items():
        assert VECTOR_LOAD.search(found[3]), (fn.__name__, cc)


@pytest.mark.parametrize("family", ["rows", "rows_backward", "tensor_core", "tiled",
                                    *(("tiled_dq", "tiled_dkdv") if SWEEP_ALL else ())])
def test_one_ptx_serves_both_architectures(family):
    """NVVM's PTX for sm_90 is its PTX for sm_80 but for the target line (and the
    names and numbering a new compilation gets), so that assembling the sm_80 PTX
    for sm_90 is what compiling for sm_90 gives. The register-tiled forward stands for
    the two register-tiled backward kernels, built the same way, whose two compilations
    take a minute (``POLYATTN_PTX_SWEEP=all`` checks them too)."""
    module = numba_cuda_tiled_backward
    fn, sig, bounds = {
        "rows": (*ROWS[len(ROWS) // 2], None),
        "rows_backward": (*ROW_BACKWARD[7], None),
        "tensor_core": (*TC[len(TC) - 1], None),
        "tiled": (numba_cuda_tiled.make_kernel_function("float32", 16, "bool", True),
                  numba_cuda_tiled._signature("float32", "bool"),
                  numba_cuda_tiled.launch_bounds("float32", 16)),
        "tiled_dq": (module.make_dq_function("float64", 8, "float", False),
                     module._signature("float64", "float", 1),
                     module.launch_bounds("float64", module.dq_threads(8))),
        "tiled_dkdv": (module.make_dkdv_function("float32", 8, "none", True),
                       module._signature("float32", "none", 2),
                       module.launch_bounds("float32", module.dkdv_threads(8))),
    }[family]
    sm80, sm90 = (compile_ptx(fn, sig, bounds, cc=cc) for cc in ARCHS)
    assert ".target sm_80" in sm80 and ".target sm_90" in sm90
    assert _normalised(sm80) == _normalised(sm90)


@pytest.mark.skipif(_nvidia_tool("ptxas") is None or _nvidia_tool("cuobjdump") is None,
                    reason="ptxas and cuobjdump are not installed")
def test_dependent_run_finds_the_row_kernels_serial_dot_product():
    """The metric against the one-thread-per-row kernel, whose dot product is one
    serial chain per key: what the tiled kernel removes."""
    import tempfile

    fn = numba_cuda.make_kernel_function("float32", 64, "none", False)
    ptx, _ = cuda.compile_ptx(fn, numba_cuda._signature("float32", "none"), cc=(9, 0))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run([_nvidia_tool("ptxas"), "-arch=sm_90", "-", "-o", cubin], input=ptx,
                       capture_output=True, text=True, check=True)
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    run = longest_dependent_run(sass)
    print(f"{fn.__name__} sm_90: longest dependent FMA run {run}")
    assert run >= 32


# --------------------------------------------------------------------------- #
# The kernels with a user rule (score_mod, mask_mod, mod_args)
# --------------------------------------------------------------------------- #

def _user_rule_specs() -> list[tuple[object, object, object]]:
    """The one-thread-per-row and register-tiled forward, dQ and dK/dV kernels and the
    3xTF32 tensor-core forward at float32, head size 64, with the sample user rule of
    :func:`polyattn.backends.cuda.user_rules.sample_key` (and their launch bounds); the
    two forward kernels also reading segment ids and a block mask (:mod:`.blocks`)."""
    from polyattn.backends.cuda.user_rules import sample_key

    user = sample_key("float32")
    tiled, tiled_bw = numba_cuda_tiled, numba_cuda_tiled_backward
    return [(numba_cuda.make_kernel_function("float32", 64, "none", False, user=user),
             numba_cuda._signature("float32", "none"), None),
            (numba_cuda_backward.make_dq_function("float32", 64, "none", False, user=user),
             numba_cuda_backward._signature("float32", "none", 1), None),
            (numba_cuda_backward.make_dkdv_function("float32", 64, "none", False, user=user),
             numba_cuda_backward._signature("float32", "none", 2), None),
            (tiled.make_kernel_function("float32", 64, "none", False, user=user),
             tiled._signature("float32", "none"), tiled.launch_bounds("float32", 64)),
            (tiled_bw.make_dq_function("float32", 64, "none", False, user=user),
             tiled_bw._signature("float32", "none", 1),
             tiled_bw.launch_bounds("float32", tiled_bw.dq_threads(64))),
            (tiled_bw.make_dkdv_function("float32", 64, "none", False, user=user),
             tiled_bw._signature("float32", "none", 2),
             tiled_bw.launch_bounds("float32", tiled_bw.dkdv_threads(64))),
            (numba_cuda_tc.make_kernel_function("3xtf32", 64, "none", False, user=user),
             numba_cuda_tc._signature("none"), None),
            (numba_cuda.make_kernel_function("float32", 64, "none", False, user=user,
                                             masks=(True, True)),
             numba_cuda._signature("float32", "none"), None),
            (tiled.make_kernel_function("float32", 64, "none", False, user=user,
                                        masks=(True, True)),
             tiled._signature("float32", "none"), tiled.launch_bounds("float32", 64))]


USER_RULES = _user_rule_specs()


@pytest.mark.parametrize("index", range(len(USER_RULES)),
                         ids=[fn.__name__.removeprefix("attention_") for fn, _, _ in USER_RULES])
def test_user_rule_kernel(index):
    """float32 throughout and the dropout cipher; in the register-tiled kernels no local
    memory in an innermost loop, and in their forward and dQ kernels, which spill
    nothing without a rule, no spills with one either."""
    fn, sig, bounds = USER_RULES[index]
    name = fn.__name__
    assert "_user" in name
    ptx = compile_ptx(fn, sig, bounds)
    assert_ptx_basics(name, ptx, mods=False)  # float32 throughout, dropout's cipher
    if not HAVE_SASS_TOOLS:
        return
    tiled = name.startswith("tiled_")
    for cc, (report, sass) in assembled(ptx, sass=tiled).items():
        registers, stack, spills = usage(report)
        print(f"{name} sm_{cc[0]}{cc[1]}: registers, stack, spill stores "
              f"{(registers, stack, spills)}")
        if tiled:
            assert registers <= 128, (name, cc, report)
            assert local_accesses_in_inner_loops(sass) == [], (name, cc)
            if "_segments" in name and "_blocks" in name:
                # a rule with segment ids and a block mask together: the forward keeps
                # a few values held across its key loop on the stack (28-48 B of spill
                # stores), stored before the loop and read per tile and after it, never
                # in an innermost loop (asserted above)
                continue
            if not name.startswith("tiled_dkdv_"):
                assert (stack, spills) == (0, 0), (name, cc, report)
