"""Choosing an implementation: what ``implementation="auto"`` does, and why.

A preference list per library and device (the ``*_PREFERENCE`` constants of
:mod:`polyattn._preferences`), walked in order: the first backend
(:mod:`polyattn.backends`) whose ``supports(problem)`` has no objection, and that the
rules of ``"auto"`` (:func:`~polyattn._preferences.auto_rule`: the score budget, the
crossovers of the fused CPU kernel on torch and JAX arrays, the native functions' dense
masks, ``POLYATTN_NUMBA_CPU``) let through, runs; :class:`Explanation` is assembled from
its ``describe()`` and the objections of those passed over. ``POLYATTN_SCORE_BUDGET``
(bytes) overrides the budgets: a large value keeps the reference path, ``0`` always
streams.
"""

from __future__ import annotations

from typing import Any

from polyattn import _autograd, backends
from polyattn._explanation import Explanation
from polyattn._interop import device_of, library_name
from polyattn._preferences import (
    CHOSEN_BECAUSE,
    FALLBACK,
    IMPLEMENTATIONS,
    JAX_NUMBA_CPU_MIN_SCORES,
    TORCH_NUMBA_CPU_MIN_SCORES,
    Budget,
    auto_rule,
    numba_cpu_setting,
    preference,
    score_budget,
)
from polyattn._problem import Problem


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


def _walk(problem: Problem, needs: frozenset[str], budget: Budget,
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
            why = verdicts[name] or auto_rule(
                name, problem, budget,
                native_runs=lambda: _verdict("native", problem, needs, verdicts) is None)
        if why is None and name not in order:
            why = f"{label} leaves it out for these arrays: it runs when asked by name"
        if why is None and not chosen:
            chosen = name
        candidates[name] = "" if name == chosen else why or f"{chosen} comes first"
    return chosen, candidates


def _verdict(name: str, problem: Problem, needs: frozenset[str],
             verdicts: dict[str, str | None]) -> str | None:
    """Why implementation ``name`` cannot run the call (``None``: it can), once."""
    if name not in verdicts:
        verdicts[name] = backends.objection(backends.backend(name, problem), problem, needs)
    return verdicts[name]


def choose(problem: Problem, requested: str, *, return_lse: bool = False,
           for_vjp: bool = False, describe: bool = True) -> Explanation:
    """Decide which implementation runs; raise if a requested one cannot.

    ``for_vjp``: the choice for :func:`polyattn.attention_vjp`, which runs the
    backends' own backward passes (native and the Dask plan have none).
    ``describe=False``: leave out the chosen backend's own lines (its ``describe()``:
    a compiled kernel's cache on disk, a Dask plan), which ``explain()`` reports and a
    call that only runs the choice does not need.
    """
    lse = return_lse or for_vjp or problem.sinks is not None   # sinks join through the lse
    needs = frozenset({backends.LSE} if lse else ()) | (
        {backends.BACKWARD} if for_vjp else {backends.AUTOGRAD})
    double = problem.compute_dtype == problem.xp.float64
    budget = Budget(problem.score_elements * (8 if double else 4), score_budget(problem.xp),
                     library_name(problem.xp) == "numpy")
    verdicts: dict[str, str | None] = {"numba_cuda": "not considered"}
    candidates: dict[str, str] = {}
    if requested == "auto":
        name, candidates = _walk(problem, needs, budget, verdicts)
        if not name:
            raise ValueError("no implementation can run this call: " + "; ".join(
                f"{n}: {why}" for n, why in candidates.items()))
        lib = library_name(problem.xp)
        key = "numba_cpu host" if name == "numba_cpu" and lib != "numpy" else name
        least = TORCH_NUMBA_CPU_MIN_SCORES if lib == "torch" else JAX_NUMBA_CPU_MIN_SCORES
        reason = CHOSEN_BECAUSE[key].format(library=lib, LIBRARY=lib.upper(),
                                            budget=budget.words(),
                                            scores=problem.score_elements, least=least)
    else:
        name, reason = requested, "requested by the caller"
        if name == "numba_cpu":
            numba_cpu_setting()
        verdicts[name] = backends.objection(backends.backend(name, problem), problem, needs)
        if verdicts[name] is not None:
            raise _refusal(name, str(verdicts[name]), problem, needs)
    kernel = verdicts["numba_cuda"]
    runner = backends.backend(name, problem)
    lines = {"numba_cuda kernel": "usable" if kernel is None else f"not usable ({kernel})",
             **(runner.describe(problem) if describe else {})}
    if describe and library_name(problem.xp) == "jax" and not runner.HOST:
        from polyattn import _jax_eager

        lines["jax eager"] = _jax_eager.describe(runner, problem)
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
