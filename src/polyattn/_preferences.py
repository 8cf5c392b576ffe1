"""The rules of ``implementation="auto"``: the preference lists per library and device,
the score budgets and crossovers behind them, and why each implementation is taken or
passed over. :mod:`polyattn._dispatch` walks them. The speed figures behind these
constants, each with its machine, are in ``benchmarks/results/``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyattn._explanation import mib
from polyattn._interop import library_name
from polyattn._problem import Problem

#: Largest score matrix (bytes, in the compute dtype) that ``"auto"`` lets the
#: reference path materialise; above it the chunked path runs. Override with the
#: ``POLYATTN_SCORE_BUDGET`` environment variable (bytes).
SCORE_BUDGET_BYTES = 64 * 2**20
#: The same for NumPy arrays, where ``"chunked"`` is the NumPy fast path: the
#: measured crossover (float32 and float64, 2 cores) lies between score matrices of
#: 16 KiB (reference 0.14 ms, blocked 0.19 ms) and 64 KiB (reference 24 ms once
#: OpenBLAS splits its product over threads, blocked 0.22 ms).
NUMPY_SCORE_BUDGET_BYTES = 32 * 2**10
#: On NumPy arrays above the score budget, "auto" takes the first of these that can run the
#: call: the fused Numba kernel calls no BLAS and was faster than the NumPy fast path in most
#: cases recorded in ``benchmarks/results/`` (cpu-*.md, contention-*.md, each naming its machine).
NUMPY_BLOCKED_PREFERENCE = ("numba_cpu", "chunked")
#: CUDA arrays (CuPy, torch CUDA tensors): the library's own fused attention where it is
#: exact, else the fused kernel (its backward pass wired into torch autograd).
CUDA_PREFERENCE = ("native", "numba_cuda", "reference", "chunked")
#: Dask arrays: one task per (query chunk, key chunk) on the fastest local path for its
#: blocks; the Array-API paths (lazy on Dask) for what the plan cannot run.
DASK_PREFERENCE = ("distributed", "reference", "chunked")
#: Other CPU arrays (torch, JAX, array-api-strict): the library's own attention where exact,
#: else by the score budget; on torch CPU tensors "chunked" is the NumPy fast path over views.
CPU_PREFERENCE = ("native", "reference", "chunked")
#: torch CPU tensors and JAX CPU arrays with Numba installed: the fused kernel first (on
#: NumPy views of them) from the crossovers below, then as CPU_PREFERENCE.
HOST_KERNEL_PREFERENCE = ("numba_cpu", *CPU_PREFERENCE)
#: Smallest score matrix (elements, B·H·Tq·Tk) from which "auto" runs numba_cpu on JAX CPU
#: arrays ahead of ``jax.nn.dot_product_attention``, forward and ``jax.grad``: on an Intel
#: Xeon (AVX-512, 2 cores) under ``jax.jit``, where the kernel reads XLA's buffers in
#: place (:mod:`polyattn._jax_ffi`), it took 0.49-1.05x JAX's time forward and 0.53-0.92x
#: for ``jax.grad`` at 2**18 score elements, float32 and float64, against 0.76-1.32x and
#: 0.64-1.08x for what "auto" ran there before; at 2**17, 0.84-1.26x and 0.81-1.00x, no
#: better than that (benchmarks/results/routes-cpu-2026-12-05-jax-crossover-ffi.md).
JAX_NUMBA_CPU_MIN_SCORES = 2**18
#: The same on torch CPU tensors, where torch's own fused attention is close to the kernel:
#: from 2**21 score elements numba_cpu took 0.49-0.80x torch's time forward with a causal
#: mask and 0.70-0.96x without (0.9-1.5x at 2**19 and less); so it runs ahead of torch's
#: own call from there, forward, and with autograd where the call is causal, in float64,
#: or from :data:`TORCH_NUMBA_CPU_GRAD_MIN_SCORES`, and for calls whose rules torch would
#: take as a dense mask or not at all (benchmarks/results/routes-cpu-*.md).
TORCH_NUMBA_CPU_MIN_SCORES = 2**21
#: Without a causal mask in float32 (or narrower; float64's margin is wider: the kernel
#: took 0.70-0.77x torch's time there back to back), where the kernel's threads share the
#: cores with torch's OpenMP
#: threads, which keep spinning for a while after each torch operation (the kernel on TBB
#: or the work queue, ``OMP_WAIT_POLICY`` not ``PASSIVE``): a forward call made right after
#: a torch matrix product took 1.11-1.27x torch's time at 2**21 and 2**22 score elements,
#: 0.84-0.95x from 2**24; on Numba's OpenMP layer, or with OMP_WAIT_POLICY=PASSIVE,
#: 0.84-0.93x from 2**21 (AMD EPYC Zen 4, 2 cores;
#: benchmarks/results/after-torch-op-cpu-2026-12-05-*.md).
TORCH_NUMBA_CPU_SPIN_MIN_SCORES = 2**24
#: Under torch autograd without a causal mask in float32 (or narrower), where the kernel's
#: forward and backward passes together measured faster than torch's from 2**23 score
#: elements (0.78-0.91x), not below (0.91-1.02x at 2**21 and 2**22); in float64 they took
#: 0.58-0.79x torch's time from 2**21, as with a causal mask (AMD EPYC Zen 4, 2 cores;
#: benchmarks/results/routes-cpu-2026-12-05-torch-grad-crossover.md).
TORCH_NUMBA_CPU_GRAD_MIN_SCORES = 2**23
#: Every implementation, in the order ``explain()`` lists those a preference list leaves out.
IMPLEMENTATIONS = ("native", "numba_cuda", "distributed", "numba_cpu", "reference", "chunked")
#: What "auto" runs where the backend it chose fails to compile (numba_cpu compiles on first use).
FALLBACK = {"numba_cpu": "chunked"}


def preference(problem: Problem) -> tuple[str, tuple[str, ...]]:
    """(name, order) of the preference list for this call's library and device."""
    if problem.on_cuda:
        return "CUDA_PREFERENCE", CUDA_PREFERENCE
    lib = library_name(problem.xp)
    if lib == "dask":
        return "DASK_PREFERENCE", DASK_PREFERENCE
    if lib == "numpy":   # the score budget, then NUMPY_BLOCKED_PREFERENCE
        return "NUMPY_BLOCKED_PREFERENCE", ("reference", *NUMPY_BLOCKED_PREFERENCE)
    if problem.torch_cpu or problem.jax_cpu:
        return "HOST_KERNEL_PREFERENCE", HOST_KERNEL_PREFERENCE
    return "CPU_PREFERENCE", CPU_PREFERENCE


def score_budget(xp: Any = None) -> int:
    """The score-matrix budget in bytes for namespace ``xp`` (environment override included)."""
    env = os.environ.get("POLYATTN_SCORE_BUDGET")
    if env:
        try:
            value = float(env)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError("POLYATTN_SCORE_BUDGET must be a finite number of bytes >= 0 (the "
                             "largest score matrix materialised whole, e.g. 1e6; 0 streams "
                             f"every call); got {env!r}")
        return int(value)
    numpy = xp is not None and library_name(xp) == "numpy"
    return NUMPY_SCORE_BUDGET_BYTES if numpy else SCORE_BUDGET_BYTES


def numba_cpu_setting() -> str:
    """``POLYATTN_NUMBA_CPU`` as set ("" when not), once checked (``ValueError`` otherwise)."""
    setting = os.environ.get("POLYATTN_NUMBA_CPU", "").strip()
    if setting.lower() not in ("", "1", "true", "on", "yes", "0", "false", "off", "no"):
        raise ValueError(f"POLYATTN_NUMBA_CPU must be 0/false/off/no (leave numba_cpu out of "
                         f"implementation='auto') or 1/true/on/yes; got {setting!r}")
    return setting


@dataclass(frozen=True)
class Budget:
    """The score matrix of a call (bytes) against its budget."""

    score_bytes: int
    limit: int
    numpy: bool

    def words(self) -> str:
        source = ("set by POLYATTN_SCORE_BUDGET" if os.environ.get("POLYATTN_SCORE_BUDGET")
                  else ("NUMPY_" if self.numpy else "") + "SCORE_BUDGET_BYTES; "
                  "POLYATTN_SCORE_BUDGET sets another")
        return (f"the {mib(self.score_bytes)} score matrix {'fits' if self.fits else 'exceeds'}"
                f" the {mib(self.limit)} budget{' for NumPy arrays' if self.numpy else ''} "
                f"({source})")

    fits = property(lambda self: self.score_bytes <= self.limit)


#: Why "auto" takes each implementation, where its rules let it (reference, chunked: the budget).
CHOSEN_BECAUSE = {
    "native": "{library} arrays, and its own fused attention expresses this call exactly",
    "numba_cuda": "CUDA arrays and a working Numba CUDA kernel",
    "distributed": "Dask arrays: one task per (query chunk, key chunk) on the fastest local "
                   "path for its blocks, merged through the log-sum-exp, tiles no query sees "
                   "left out",
    "numba_cpu": "{budget}, and Numba is installed and its fused kernel runs the call: above "
                 "the budget, 'auto' takes numba_cpu ahead of the NumPy fast path "
                 "(numpy_chunked) on NumPy arrays (NUMPY_BLOCKED_PREFERENCE; "
                 "POLYATTN_NUMBA_CPU=0 leaves it out)",
    "numba_cpu host": "{library} CPU arrays whose score matrix, of {scores} elements, "
                      "reaches the {least} ({LIBRARY}_NUMBA_CPU_MIN_SCORES) from which the "
                      "fused kernel measured "
                      "faster than {library}'s own attention; it runs on NumPy views of "
                      "them (HOST_KERNEL_PREFERENCE; POLYATTN_NUMBA_CPU=0 leaves it out)",
    "reference": "{budget}, so it is materialised",
    "chunked": "{budget}, so keys are streamed in blocks with an online softmax",
}


def auto_rule(name: str, problem: Problem, budget: Budget, *,
              native_runs: Callable[[], bool] = lambda: True) -> str | None:
    """Why ``"auto"`` passes over a backend that could run the call (``None``: it does not).
    ``native_runs``: whether the library's own attention can run it (asked only where
    the choice leans on it)."""
    if name == "reference" and not budget.fits:
        return f"{budget.words()}, so it is not materialised"
    if name == "numba_cpu" and not budget.numpy:
        return host_kernel_rule(problem, native_runs)
    if name in ("chunked", "numba_cpu") and budget.fits:
        return (f"{budget.words()}, so " +
                ("it is materialised; the blocked paths run above it" if name == "numba_cpu"
                 else "the reference path, which materialises it, comes first"))
    rules = problem.rules
    if name != "native" or rules.simple or budget.fits:
        return None
    # what native runs of the rules beyond causality it folds into one mask
    used = sorted(rules.in_use() - {"causal"})
    return (f"{', '.join(used)} would become a dense mask as large as the "
            f"{mib(budget.score_bytes)} score matrix (over the {mib(budget.limit)} budget), "
            "while the blocked path skips the key blocks no query can see")


def _jax_cpu_devices() -> int:
    """How many CPU devices JAX has in this process (``--xla_force_host_platform_device_count``
    makes more than one)."""
    import jax

    try:
        return len(jax.devices("cpu"))
    except RuntimeError:              # no CPU backend
        return 0


def host_kernel_rule(problem: Problem,
                     native_runs: Callable[[], bool] = lambda: True) -> str | None:
    """Why ``"auto"`` passes over numba_cpu on torch or JAX CPU arrays (``None``: it runs):
    below the crossover; or, under torch autograd without a causal mask in float32 below
    :data:`TORCH_NUMBA_CPU_GRAD_MIN_SCORES`, for torch's own attention, where that can run
    the call (it cannot give ``lse``, nor take sinks)."""
    lib = library_name(problem.xp)
    if lib == "jax":
        devices = _jax_cpu_devices()
        if devices > 1:
            return (f"the process has {devices} JAX CPU devices: the kernel runs as a host "
                    "callback placed on one of them, which gathers arrays sharded over them "
                    "and leaves its result unsharded; JAX's own attention keeps the sharding")
    least = TORCH_NUMBA_CPU_MIN_SCORES if lib == "torch" else JAX_NUMBA_CPU_MIN_SCORES
    if problem.score_elements < least:
        return (f"the score matrix has {problem.score_elements} elements, below the "
                f"{least} ({lib.upper()}_NUMBA_CPU_MIN_SCORES) from which the kernel "
                f"measured faster than {lib}'s own attention")
    if lib != "torch" or not problem.rules.simple:
        return None
    if (not problem.rules.causal and problem.score_elements < TORCH_NUMBA_CPU_SPIN_MIN_SCORES
            and problem.compute_dtype != problem.xp.float64 and native_runs()):
        from polyattn.backends.numba_cpu import threads

        if threads.beside_spinning_torch():
            return (f"without a causal mask in float32, the score matrix has "
                    f"{problem.score_elements} "
                    f"elements, below the {TORCH_NUMBA_CPU_SPIN_MIN_SCORES} "
                    "(TORCH_NUMBA_CPU_SPIN_MIN_SCORES) from which the kernel measured faster "
                    "than torch's own attention right after other torch work, whose OpenMP "
                    "threads keep spinning beside the kernel's (Numba's threading layer: "
                    f"{threads.layer_in_words()}); NUMBA_THREADING_LAYER=omp, or "
                    "OMP_WAIT_POLICY=PASSIVE set before torch starts, lifts this")
    if (problem.requires_grad and not problem.rules.causal
            and problem.score_elements < TORCH_NUMBA_CPU_GRAD_MIN_SCORES
            and problem.compute_dtype != problem.xp.float64 and native_runs()):
        return (f"under autograd without a causal mask, the score matrix has "
                f"{problem.score_elements} elements, below the "
                f"{TORCH_NUMBA_CPU_GRAD_MIN_SCORES} (TORCH_NUMBA_CPU_GRAD_MIN_SCORES) from "
                "which the kernel's forward and backward passes measured faster than "
                "torch's own in float32")
    return None
