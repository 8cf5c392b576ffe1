"""Compile every kernel specialisation to PTX for sm_80 and sm_90, without a GPU.

Every attention kernel (dtype × head bucket × mask kind × plain or with score
modifiers) and the split-merge kernel of each dtype. float32 kernels must not
touch float64 at all: one stray untyped literal (``0.0`` instead of
``float32(0.0)``) would put double-precision instructions, at a fraction of
the float32 rate, into the inner loop. Plain kernels must carry no score
modifier code. Where ``ptxas`` is on PATH, its register and spill report for
sm_90 is printed (``pytest -s``).
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

from polyattn.implementations import numba_cuda


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


@pytest.mark.parametrize("cc", ARCHS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("index", range(len(SPECS)), ids=_ids())
def test_compiles_with_float64_only_where_asked(index, cc):
    fn, _ = SPECS[index]
    ptx = ptx_for(index, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx
    body = _instructions(ptx)
    if "float32" in fn.__name__:
        f64 = [line for line in body if F64.search(line)]
        assert not f64, f"{fn.__name__} uses float64 for sm_{cc[0]}{cc[1]}:\n" + "\n".join(
            f64[:20])
    else:
        assert any(F64_ARITHMETIC.search(line) for line in body)


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
