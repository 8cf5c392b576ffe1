"""Compile every kernel specialisation to PTX for sm_80 and sm_90, without a GPU.

Every attention kernel (dtype × head bucket × mask kind × plain or with score
modifiers) and the split-merge kernel of each dtype. float32 kernels must not
touch float64 at all: one stray untyped literal (``0.0`` instead of
``float32(0.0)``) would put double-precision instructions, at a fraction of
the float32 rate, into the inner loop. Plain kernels must carry no score
modifier code. Every attention kernel carries the dropout cipher (Philox's
multipliers). Where ``ptxas`` is on PATH, its register and spill report for
sm_90 is printed (``pytest -s``).

The backward kernels (dQ and dK/dV) are compiled for every dtype × mask kind ×
modifier combination at head size 64 (sm_90; float32 also for sm_80, where a
stray float64 would matter most), and once for each other head size (sm_90),
with the same checks: the full product would double the session's time for
code that differs only in constant loop lengths.
"""

from __future__ import annotations

import functools
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

from polyattn.implementations import _dropout, numba_cuda, numba_cuda_backward


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

SPECS = list(numba_cuda.specializations())
ARCHS = [(8, 0), (9, 0)]

# Any float64 register, operation, conversion, load or store.
F64 = re.compile(r"\.f64\b|%fd\d")
# Double-precision arithmetic (the part that would cost throughput).
F64_ARITHMETIC = re.compile(
    r"\b(add|sub|mul|fma|div|max|min|ex2|lg2|rcp|sqrt|neg|abs)\.[a-z.]*f64\b"
)


def _instructions(ptx: str) -> list[str]:
    """PTX lines without comments and blank lines."""
    lines = (line.split("//", 1)[0].strip() for line in ptx.splitlines())
    return [line for line in lines if line]


@functools.cache
def ptx_for(index: int, cc: tuple[int, int]) -> str:
    fn, sig = SPECS[index]
    ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
    return ptx


def _ids() -> list[str]:
    return [fn.__name__.removeprefix("attention_") for fn, _ in SPECS]


# ALiBi's distance |p_i - j| converted from int64 to the compute dtype.
INT_TO_FLOAT = re.compile(r"\bcvt\.rn\.f(32|64)\.s64\b")
# Philox4x32's multipliers, as PTX immediates (unsigned or signed 32-bit).
PHILOX = [re.compile(rf"\b({m}|{m - 2**32})\b") for m in (_dropout.M0, _dropout.M1)]


def has_philox(body: list[str]) -> bool:
    return all(any(m.search(line) for line in body) for m in PHILOX)


def assert_float64_only_where_asked(name: str, body: list[str], cc: tuple[int, int]) -> None:
    if "float32" in name:
        f64 = [line for line in body if F64.search(line)]
        assert not f64, f"{name} uses float64 for sm_{cc[0]}{cc[1]}:\n" + "\n".join(f64[:20])
    else:
        assert any(F64_ARITHMETIC.search(line) for line in body)


@pytest.mark.parametrize("cc", ARCHS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("index", range(len(SPECS)), ids=_ids())
def test_compiles_with_float64_only_where_asked(index, cc):
    fn, _ = SPECS[index]
    ptx = ptx_for(index, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx
    body = _instructions(ptx)
    assert_float64_only_where_asked(fn.__name__, body, cc)
    assert has_philox(body) == fn.__name__.startswith("attention_"), fn.__name__


ATTENTION = [i for i, (fn, _) in enumerate(SPECS) if fn.__name__.startswith("attention_")]


@pytest.mark.parametrize("index", ATTENTION, ids=[_ids()[i] for i in ATTENTION])
def test_score_modifiers_only_where_asked(index):
    fn, _ = SPECS[index]
    body = _instructions(ptx_for(index, (9, 0)))
    has_alibi = any(INT_TO_FLOAT.search(line) for line in body)
    assert has_alibi == ("_mods" in fn.__name__), fn.__name__


def test_every_specialisation_is_compiled():
    names = {fn.__name__ for fn, _ in SPECS}
    assert any(name.startswith("merge_splits_") for name in names)
    assert sum("_mods" in name for name in names) == sum(
        name.startswith("attention_") and "_mods" not in name for name in names)


def _ptxas(ptx: str, arch: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ptxas", "-v", f"-arch={arch}", "-", "-o", os.devnull],
                          input=ptx, capture_output=True, text=True, check=False)


def ptxas_report(ptx: str, arch: str = "sm_90") -> str:
    """ptxas's register, stack and spill report; an older ptxas gets the PTX
    ``.version`` it supports (the kernels use no newer PTX feature)."""
    run = _ptxas(ptx, arch)
    supported = re.search(r"current version is '(\d+\.\d+)'", run.stderr)
    if run.returncode != 0 and supported:
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {supported.group(1)}", ptx,
                     count=1, flags=re.M)
        run = _ptxas(ptx, arch)
    if run.returncode != 0:
        return f"ptxas failed: {run.stderr.strip()[:300]}"
    used = re.search(r"Used (\d+) registers", run.stderr)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", run.stderr)
    smem = re.search(r"(\d+) bytes smem", run.stderr)
    return (f"registers {used.group(1) if used else '?'}, "
            f"stack {frame.group(1) if frame else '?'} B, "
            f"spill stores {frame.group(2) if frame else '?'} B, "
            f"spill loads {frame.group(3) if frame else '?'} B, "
            f"shared {smem.group(1) if smem else '0'} B")


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
@pytest.mark.parametrize("index", range(len(SPECS)), ids=_ids())
def test_ptxas_registers_and_spills(index):
    fn, _ = SPECS[index]
    report = ptxas_report(ptx_for(index, (9, 0)))
    print(f"{fn.__name__} sm_90: {report}")
    assert not report.startswith("ptxas failed"), report


# --------------------------------------------------------------------------- #
# The backward kernels
# --------------------------------------------------------------------------- #

def _backward_specs() -> list[tuple[object, object, tuple[tuple[int, int], ...]]]:
    """(function, signature, architectures): the full product at head size 64 for
    sm_90, its float32 half for sm_80 too; each other head size once (a rotating
    dtype, mask kind and modifier choice, so that each appears), for sm_90."""
    specs = [(fn, sig, tuple(ARCHS) if "float32" in fn.__name__ else ((9, 0),))
             for fn, sig in numba_cuda_backward.specializations((64,))]
    others = [b for b in numba_cuda.HEAD_DIM_BUCKETS if b != 64]
    for n, bucket in enumerate(others):
        dtype = numba_cuda.DTYPES[n % 2]
        mask_kind = numba_cuda.MASK_KINDS[n % 3]
        mods = n % 2 == 1
        for make in (numba_cuda_backward.make_dq_function,
                     numba_cuda_backward.make_dkdv_function):
            fn = make(dtype, bucket, mask_kind, mods)
            specs.append((fn, numba_cuda_backward._signature(
                dtype, mask_kind, 1 if make is numba_cuda_backward.make_dq_function else 2),
                ((9, 0),)))
    return specs


BACKWARD = _backward_specs()
BACKWARD_CASES = [(index, cc) for index, (_, _, archs) in enumerate(BACKWARD) for cc in archs]


@functools.cache
def backward_ptx_for(index: int, cc: tuple[int, int]) -> str:
    fn, sig, _ = BACKWARD[index]
    ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
    return ptx


@pytest.mark.parametrize(
    ("index", "cc"), BACKWARD_CASES,
    ids=[f"{BACKWARD[i][0].__name__.removeprefix('attention_')}-sm_{cc[0]}{cc[1]}"
         for i, cc in BACKWARD_CASES])
def test_backward_compiles(index, cc):
    fn, _, _ = BACKWARD[index]
    name = fn.__name__
    ptx = backward_ptx_for(index, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx
    body = _instructions(ptx)
    assert_float64_only_where_asked(name, body, cc)
    assert any(INT_TO_FLOAT.search(line) for line in body) == ("_mods" in name), name
    assert has_philox(body), name  # dropout's keep-mask, recomputed
    if cc == (9, 0) and "head64" in name and shutil.which("ptxas"):
        report = ptxas_report(ptx)
        print(f"{name} sm_90: {report}")
        assert not report.startswith("ptxas failed"), report


def test_backward_cases_cover_every_axis():
    names = [fn.__name__ for fn, _, _ in BACKWARD]
    assert len(set(names)) == len(names)
    for part in ("dq_", "dkdv_", *numba_cuda.DTYPES, *(f"_{m}" for m in numba_cuda.MASK_KINDS),
                 "_mods", *(f"head{b}_" for b in numba_cuda.HEAD_DIM_BUCKETS)):
        assert any(part in name for name in names), part


# --------------------------------------------------------------------------- #
# The tensor-core kernels: PTX, ptxas's report and the SASS
# --------------------------------------------------------------------------- #

from polyattn.implementations import numba_cuda_tc  # noqa: E402

TC_SPECS = numba_cuda_tc.specializations()
# Every specialisation, for sm_80 and sm_90.
TC_CASES = [(i, cc) for i in range(len(TC_SPECS)) for cc in ARCHS]
MMA_PTX = {"f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
           "bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
           "3xtf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}
HMMA_SASS = {"f16": re.compile(r"\bHMMA\.16816\.F32\b"),
             "bf16": re.compile(r"\bHMMA\.16816\.F32\.BF16\b"),
             "3xtf32": re.compile(r"\bHMMA\.1688\.F32\.TF32\b")}
# Double-precision SASS instructions (arithmetic, conversions, compares).
F64_SASS = re.compile(r"\b(DADD|DMUL|DFMA|DSETP|DMNMX|DMMA)\b|\bF2F\.F64|\.F64\b")
LOCAL_SASS = re.compile(r"\b(LDL|STL)\b")


def _nvidia_tool(name: str) -> str | None:
    """``name`` from the NVIDIA wheels of this environment (nvidia-cuda-nvcc,
    nvidia-cuda-cuobjdump: the same CUDA release as Numba's NVVM), else on PATH."""
    import glob
    import sysconfig

    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia",
                                              "*", "bin", name))):
        return path
    return shutil.which(name)


def _arith(name: str) -> str:
    return name.split("_")[1]


@functools.cache
def tc_ptx_for(index: int, cc: tuple[int, int]) -> str:
    fn, sig = TC_SPECS[index]
    ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
    return ptx


def ptxas_and_sass(ptx: str, cc: tuple[int, int]) -> tuple[str, str]:
    """(ptxas -v report, cuobjdump -sass text) of one kernel's PTX."""
    import tempfile

    ptxas, cuobjdump = _nvidia_tool("ptxas"), _nvidia_tool("cuobjdump")
    assert ptxas and cuobjdump
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        run = subprocess.run([ptxas, "-v", f"-arch=sm_{cc[0]}{cc[1]}", "-", "-o", cubin],
                             input=ptx, capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    return run.stderr, sass


@functools.cache
def tc_sass_for(index: int, cc: tuple[int, int]) -> tuple[str, str]:
    """(ptxas -v report, cuobjdump -sass text) of one tensor-core kernel."""
    return ptxas_and_sass(tc_ptx_for(index, cc), cc)


@pytest.mark.parametrize(("index", "cc"), TC_CASES,
                         ids=[f"{TC_SPECS[i][0].__name__}-sm_{cc[0]}{cc[1]}"
                              for i, cc in TC_CASES])
def test_tensor_core_kernel_ptx(index, cc):
    name = TC_SPECS[index][0].__name__
    body = _instructions(tc_ptx_for(index, cc))
    assert any(f".target sm_{cc[0]}{cc[1]}" in line for line in body)
    f64 = [line for line in body if F64.search(line)]
    assert not f64, f"{name} uses float64:\n" + "\n".join(f64[:20])
    mma = [line for line in body if line.startswith("mma.sync")]
    assert mma and all(MMA_PTX[_arith(name)] in line for line in mma), mma[:3]
    assert has_philox(body), name
    assert any(INT_TO_FLOAT.search(line) for line in body) == ("_mods" in name), name


needs_sass_tools = pytest.mark.skipif(
    _nvidia_tool("ptxas") is None or _nvidia_tool("cuobjdump") is None,
    reason="ptxas and cuobjdump are not installed (nvidia-cuda-nvcc, nvidia-cuda-cuobjdump)")


@needs_sass_tools
@pytest.mark.parametrize(("index", "cc"), TC_CASES,
                         ids=[f"{TC_SPECS[i][0].__name__}-sm_{cc[0]}{cc[1]}"
                              for i, cc in TC_CASES])
def test_tensor_core_kernel_sass(index, cc):
    """The 16-key step issues exactly the expected HMMA instructions (three per
    product for 3xTF32) and ldmatrix instructions; no double-precision
    instruction; in the float16 and bfloat16 kernels no spills and no local
    memory at all (the warp's scores, Q fragments and accumulators stay in
    registers)."""
    fn, _ = TC_SPECS[index]
    name = fn.__name__
    report, sass = tc_sass_for(index, cc)
    arith = _arith(name)
    bucket = int(name.split("_head")[1].split("_")[0])
    hmma = [line for line in sass.splitlines() if "HMMA" in line]
    assert all(HMMA_SASS[arith].search(line) for line in hmma), hmma[:3]
    assert len(hmma) == numba_cuda_tc.hmma_per_step(arith, bucket), (name, len(hmma))
    f64 = [line for line in sass.splitlines() if F64_SASS.search(line)]
    assert not f64, f"{name} runs float64 instructions:\n" + "\n".join(f64[:10])
    ldsm = [line for line in sass.splitlines() if "LDSM" in line]
    assert all("LDSM.16.M88.4" in line for line in ldsm), ldsm[:3]
    assert len(ldsm) == numba_cuda_tc.ldmatrix_per_step(arith, bucket), (name, len(ldsm))
    used = re.search(r"Used (\d+) registers", report)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", report)
    local = len([line for line in sass.splitlines() if LOCAL_SASS.search(line)])
    if arith != "3xtf32":  # opt-in: at head size 64 its doubled Q fragments spill 8 bytes
        assert frame and frame.groups() == ("0", "0", "0"), report
        assert local == 0, name
    print(f"{name} sm_{cc[0]}{cc[1]}: registers {used.group(1) if used else '?'}, "
          f"stack {frame.group(1) if frame else '?'} B, spills "
          f"{frame.group(2) if frame else '?'}/{frame.group(3) if frame else '?'} B, "
          f"local loads/stores {local}, HMMA {len(hmma)}")


# --------------------------------------------------------------------------- #
# The register-tiled exact kernel (opt-in): a sample of its specialisations
# --------------------------------------------------------------------------- #

from polyattn.implementations import numba_cuda_tiled  # noqa: E402

# Each takes 15-30 s to compile: one per dtype, mask kind and modifier setting.
# Every float32 specialisation up to head size 128 (the register budget is theirs),
# and a float64 sample.
TILED_SPECS = [("float32", bucket, mask_kind, mods)
               for bucket in numba_cuda.HEAD_DIM_BUCKETS if bucket <= 128
               for mask_kind in numba_cuda.MASK_KINDS for mods in (False, True)]
TILED_SPECS += [("float64", 32, "float", False), ("float64", 128, "bool", True)]
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
    """Address ranges ``(start, end)`` of the innermost loops: a backward branch
    (to ``start``, from ``end``) whose range holds no other backward branch."""
    loops = []
    for line in sass.splitlines():
        match = ADDRESS.search(line)
        branch = BRANCH.search(match.group(2)) if match else None
        if match and branch and int(branch.group(1), 16) <= int(match.group(1), 16):
            loops.append((int(branch.group(1), 16), int(match.group(1), 16)))
    return [(lo, hi) for lo, hi in loops
            if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]


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


def test_dependent_run_counts_back_to_back_chains():
    chain = ["FFMA R1, R2, R3, R1 ;", "FFMA R6, R1, R3, R1 ;", "LDS R9, [R8] ;",
             "FFMA R7, R4, R9, R6 ;"]
    assert longest_dependent_run("\n".join(chain)) == 3
    interleaved = ["FFMA R1, R2, R3, R1 ;", "FFMA R5, R2, R3, R5 ;", "FFMA R1, R4, R3, R1 ;"]
    assert longest_dependent_run("\n".join(interleaved)) == 1
    assert longest_dependent_run("FFMA R1, R2, R3, R4 ;\nFFMA R5, R1, R3, R6 ;") == 1
    rewritten = ["FFMA R1, R2, R3, R1 ;", "FADD R1, R2, R3 ;", "FFMA R1, R4, R3, R1 ;"]
    assert longest_dependent_run("\n".join(rewritten)) == 1


@pytest.mark.parametrize("spec", TILED_SPECS, ids=lambda s: "_".join(map(str, s)))
def test_tiled_kernel_ptx_and_sass(spec):
    """PTX and SASS of the register-tiled kernel, with the launch bounds it is
    compiled with: no float64 in float32, no serial FMA chain, at most 128
    registers per thread in float32 up to head size 128, and no local memory in
    its inner loops."""
    dtype, bucket, mask_kind, mods = spec
    fn = numba_cuda_tiled.make_kernel_function(dtype, bucket, mask_kind, mods)
    ptx, _ = cuda.compile_ptx(fn, numba_cuda_tiled._signature(dtype, mask_kind), cc=(9, 0),
                              launch_bounds=numba_cuda_tiled.launch_bounds(dtype, bucket))
    body = _instructions(ptx)
    assert any(".target sm_90" in line for line in body)
    assert_float64_only_where_asked(f"{fn.__name__}", body, (9, 0))
    assert has_philox(body)
    assert any(INT_TO_FLOAT.search(line) for line in body) == mods
    if _nvidia_tool("ptxas") is None or _nvidia_tool("cuobjdump") is None:
        pytest.skip("ptxas and cuobjdump are not installed")
    report, sass = ptxas_and_sass(ptx, (9, 0))
    used = re.search(r"Used (\d+) registers", report)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", report)
    print(f"{fn.__name__} sm_90: registers {used.group(1) if used else '?'}, stack "
          f"{frame.group(1) if frame else '?'} B, spill stores "
          f"{frame.group(2) if frame else '?'} B, longest dependent FMA run "
          f"{longest_dependent_run(sass)}")
    assert F64_SASS.search(sass) is None or dtype == "float64"
    assert longest_dependent_run(sass) <= 8
    assert local_accesses_in_inner_loops(sass) == []
    if dtype == "float32":
        assert used and int(used.group(1)) <= 128, report
        # At most one 4-byte value spilled, stored before the key loop and reloaded
        # once per key tile, never in an inner loop (asserted above): sm_90, two
        # specialisations of 30 (head size 64 with a mask, no modifiers).
        assert frame and int(frame.group(2)) <= 4, report


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
# The register-tiled backward kernels
# --------------------------------------------------------------------------- #

from polyattn.implementations import numba_cuda_tiled_backward  # noqa: E402

TILED_BACKWARD_SPECS = [(kernel, dtype, bucket, mask_kind, mods)
                        for kernel in ("dq", "dkdv")
                        for dtype, bucket in (("float32", 64), ("float32", 128),
                                              ("float64", 64))
                        for mask_kind, mods in (("none", False), ("bool", True))]


@pytest.mark.parametrize("spec", TILED_BACKWARD_SPECS, ids=lambda s: "_".join(map(str, s)))
def test_tiled_backward_ptx_and_sass(spec):
    """The register-tiled dQ and dK/dV kernels, compiled with their launch bounds:
    no float64 in float32, no serial FMA chain, at most 128 registers per thread
    in float32, no local memory in their inner loops."""
    kernel, dtype, bucket, mask_kind, mods = spec
    module = numba_cuda_tiled_backward
    make, threads, outputs = ((module.make_dq_function, module.dq_threads, 1)
                              if kernel == "dq" else
                              (module.make_dkdv_function, module.dkdv_threads, 2))
    fn = make(dtype, bucket, mask_kind, mods)
    ptx, _ = cuda.compile_ptx(fn, numba_cuda_backward._signature(dtype, mask_kind, outputs),
                              cc=(9, 0), launch_bounds=module.launch_bounds(dtype, threads(bucket)))
    assert_float64_only_where_asked(fn.__name__, _instructions(ptx), (9, 0))
    assert has_philox(_instructions(ptx))
    if _nvidia_tool("ptxas") is None or _nvidia_tool("cuobjdump") is None:
        pytest.skip("ptxas and cuobjdump are not installed")
    report, sass = ptxas_and_sass(ptx, (9, 0))
    used = re.search(r"Used (\d+) registers", report)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", report)
    print(f"{fn.__name__} sm_90: registers {used.group(1) if used else '?'}, spill stores "
          f"{frame.group(2) if frame else '?'} B, longest dependent FMA run "
          f"{longest_dependent_run(sass)}, local accesses in inner loops "
          f"{len(local_accesses_in_inner_loops(sass))}")
    assert F64_SASS.search(sass) is None or dtype == "float64"
    assert longest_dependent_run(sass) <= 8
    if dtype == "float32":
        assert used and int(used.group(1)) <= 128, report
        assert local_accesses_in_inner_loops(sass) == []


@pytest.mark.parametrize("kernel", ["forward", "dq", "dkdv"])
@pytest.mark.parametrize("spec", [("float32", 64, "none", False), ("float64", 128, "bool", True)],
                         ids=lambda s: "_".join(map(str, s)))
def test_tiled_kernels_compile_for_sm80(kernel, spec):
    """The register-tiled kernels use nothing beyond sm_80 (warp shuffles, barriers)."""
    dtype, bucket, mask_kind, mods = spec
    if kernel == "forward":
        fn = numba_cuda_tiled.make_kernel_function(dtype, bucket, mask_kind, mods)
        sig = numba_cuda_tiled._signature(dtype, mask_kind)
    else:
        module = numba_cuda_tiled_backward
        make = module.make_dq_function if kernel == "dq" else module.make_dkdv_function
        fn = make(dtype, bucket, mask_kind, mods)
        sig = numba_cuda_backward._signature(dtype, mask_kind, 1 if kernel == "dq" else 2)
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(8, 0))
    body = _instructions(ptx)
    assert any(".target sm_80" in line for line in body)
    assert_float64_only_where_asked(fn.__name__, body, (8, 0))
