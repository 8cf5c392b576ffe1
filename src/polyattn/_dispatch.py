"""Choosing an implementation: what ``implementation="auto"`` does, and why.

A preference list per library and device (the ``*_PREFERENCE`` constants), walked
in order: the first backend (:mod:`polyattn.backends`) whose ``supports(problem)``
has no objection, and that the rules of ``"auto"`` (:func:`_auto_rule`: the score
budget, the native functions' dense masks, ``POLYATTN_NUMBA_CPU``) let through,
runs; :class:`Explanation` is assembled from its ``describe()`` and the objections
of those passed over. ``POLYATTN_SCORE_BUDGET`` (bytes) overrides the budgets: a
large value keeps the reference path, ``0`` always streams. The speed figures
behind these rules, each with its machine, are in ``benchmarks/results/``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from polyattn import _autograd, backends
from polyattn._explanation import Explanation, mib
from polyattn._interop import device_of, library_name
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
class _Budget:
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
    "reference": "{budget}, so it is materialised",
    "chunked": "{budget}, so keys are streamed in blocks with an online softmax",
}


def _auto_rule(name: str, problem: Problem, budget: _Budget) -> str | None:
    """Why ``"auto"`` passes over a backend that could run the call (``None``: it does not)."""
    if name == "reference" and not budget.fits:
        return f"{budget.words()}, so it is not materialised"
    if name in ("chunked", "numba_cpu") and budget.fits:
        return (f"{budget.words()}, so it is materialised" +
                ("; the blocked paths run above it" if name == "numba_cpu" else ""))
    rules = problem.rules
    if name != "native" or rules.simple or budget.fits:
        return None
    # what native runs of the rules beyond causality it folds into one mask
    used = sorted(rules.in_use() - {"causal"})
    return (f"{', '.join(used)} would become a dense mask as large as the "
            f"{mib(budget.score_bytes)} score matrix (over the {mib(budget.limit)} budget), "
            "while the blocked path skips the key blocks no query can see")


def _refusal(name: str, why: str, problem: Problem, needs: frozenset[str]) -> Exception:
    """The error for implementation ``name``, asked for by name, that objects ``why``."""
    gradient = backends.AUTOGRAD in needs and problem.constant_needing_grad is not None
    # "it does not apply …", "it lowers …": the call's rules, not the arrays or the machine
    if name == "numba_cuda" and not gradient and not why.startswith("it "):
        return RuntimeError(
            "implementation='numba_cuda' needs CUDA arrays (CuPy or torch CUDA tensors), a "
            "CUDA GPU and numba-cuda, or the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) for NumPy "
            f"arrays and torch CPU tensors: {why}")
    exactly = " exactly" if name == "native" else ""
    advice = "; use implementation='auto' or detach the inputs" if name == "numba_cuda" else ""
    return ValueError(f"implementation='{name}' cannot run this call{exactly}: {why}{advice}")


def _walk(problem: Problem, needs: frozenset[str], budget: _Budget,
          verdicts: dict[str, str | None]) -> tuple[str, dict[str, str]]:
    """The implementation ``"auto"`` runs, and every candidate's verdict, in order."""
    label, order = preference(problem)
    off = numba_cpu_setting().lower() in ("0", "false", "off", "no")
    chosen, candidates = "", {}
    for name in (*order, *(n for n in IMPLEMENTATIONS if n not in order)):
        if name == "numba_cpu" and off:
            why: str | None = ("turned off for implementation='auto' by "
                               f"POLYATTN_NUMBA_CPU={numba_cpu_setting()}")
        else:
            verdicts[name] = backends.objection(backends.backend(name, problem), problem, needs)
            why = verdicts[name] or _auto_rule(name, problem, budget)
        if why is None and name not in order:
            why = f"{label} leaves it out for these arrays: it runs when asked by name"
        if why is None and not chosen:
            chosen = name
        candidates[name] = "" if name == chosen else why or f"{chosen} comes first"
    return chosen, candidates


def choose(problem: Problem, requested: str, *, return_lse: bool = False,
           for_vjp: bool = False) -> Explanation:
    """Decide which implementation runs; raise if a requested one cannot.

    ``for_vjp``: the choice for :func:`polyattn.attention_vjp`, which runs the
    backends' own backward passes (native and the Dask plan have none).
    """
    lse = return_lse or for_vjp or problem.sinks is not None   # sinks join through the lse
    needs = frozenset({backends.LSE} if lse else ()) | (
        {backends.BACKWARD} if for_vjp else {backends.AUTOGRAD})
    double = problem.compute_dtype == problem.xp.float64
    budget = _Budget(problem.score_elements * (8 if double else 4), score_budget(problem.xp),
                     library_name(problem.xp) == "numpy")
    verdicts: dict[str, str | None] = {"numba_cuda": "not considered"}
    candidates: dict[str, str] = {}
    if requested == "auto":
        name, candidates = _walk(problem, needs, budget, verdicts)
        if not name:
            raise ValueError("no implementation can run this call: " + "; ".join(
                f"{n}: {why}" for n, why in candidates.items()))
        reason = CHOSEN_BECAUSE[name].format(library=library_name(problem.xp),
                                             budget=budget.words())
    else:
        name, reason = requested, "requested by the caller"
        if name == "numba_cpu":
            numba_cpu_setting()
        verdicts[name] = backends.objection(backends.backend(name, problem), problem, needs)
        if verdicts[name] is not None:
            raise _refusal(name, str(verdicts[name]), problem, needs)
    kernel = verdicts["numba_cuda"]
    lines = {"numba_cuda kernel": "usable" if kernel is None else f"not usable ({kernel})",
             **backends.backend(name, problem).describe(problem)}
    if "reason" in lines:
        reason += "; " + lines.pop("reason")
    dtype = problem.compute_dtype                      # float32, or NumPy's np.float32
    shape = {n: tuple(x.shape) for n, x in (("query", problem.q), ("key", problem.k),
                                             ("value", problem.v)) if x is not None}
    return Explanation(
        implementation=name, reason=reason, library=library_name(problem.xp),
        device=str(device_of(problem.q)), dtype=str(problem.result_dtype),
        compute_dtype=str(getattr(dtype, "__name__", dtype)).rsplit(".", 1)[-1],
        shape=shape, score_bytes=budget.score_bytes, score_budget=budget.limit,
        module=lines.pop("module", ""), candidates=candidates, layout=problem.layout,
        features=problem.features(), details=lines)


def run(problem: Problem, name: str, *, grad: bool = True,
        fallback: bool = False) -> tuple[Any, Any]:
    """Call implementation ``name`` on a prepared problem, differentiable by torch autograd
    (``grad=False``: not); ``fallback`` (for ``"auto"``): run the :data:`FALLBACK` of a
    backend that fails to compile (``explain`` then says why)."""
    runner = backends.backend(name, problem)
    if fallback and name in FALLBACK and runner.supports(
            problem, needs=frozenset({backends.COMPILED})) is not None:
        runner = backends.backend(FALLBACK[name], problem)
    return _autograd.differentiable(runner, problem, backends.family("chunked"), grad=grad)


def run_mod_args_gradients(problem: Problem, out: Any, lse: Any, grad_out: Any,
                           grad_lse: Any) -> list[Any]:
    """The gradients of the floating ``mod_args`` of ``problem``, in order (one Array-API
    pass over the tiles, whichever implementation ran)."""
    from polyattn.backends import array_api

    return array_api.mod_args_gradients(problem, out, lse, grad_out, grad_lse)


def run_backward(problem: Problem, name: str, out: Any, lse: Any, grad_out: Any,
                 grad_lse: Any) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of implementation ``name``, in the backends' layout."""
    _, backward = _autograd.passes(backends.backend(name, problem), problem)
    return backward(problem.q, problem.k, problem.v, out, lse, grad_out, grad_lse)
