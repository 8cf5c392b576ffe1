"""The Dask task-graph plan (``"distributed"``): blocks of the NumPy and Array-API paths.

One task per (query chunk, key chunk) that some query sees, merged through the
log-sum-exp (:mod:`.plan`). It has no backward pass of its own:
:func:`polyattn.attention_vjp` runs the Array-API blocked path on Dask arrays.
"""

from __future__ import annotations

from typing import Any

from polyattn._interop import library_name

NAME = "distributed"
DIFFERENTIATED = "library"
HOST = False
#: The score rules it handles (named one by one: a rule added to polyattn is not
#: given to it until it is listed here).
RULES = frozenset({"causal", "window", "key_lengths", "softcap", "alibi", "dropout",
                   "segment_ids", "score_mod", "mask_mod"})


def supports(problem: Any, *, needs: frozenset[str] = frozenset()) -> str | None:
    """Why the Dask plan cannot run this call (``None``: it can)."""
    if library_name(problem.xp) != "dask":
        return f"inputs are {library_name(problem.xp)} arrays, not Dask arrays"
    if "backward" in needs:
        return ("the Dask plan has no backward pass; attention_vjp runs the Array-API "
                "blocked path on Dask arrays")
    from polyattn.backends.dask import plan

    return plan.unavailable(problem.q, problem.k, problem.v, problem.mask, problem.rules)


def forward(problem: Any) -> tuple[Any, Any]:
    from polyattn.backends.dask import plan

    return plan.attention(problem.q, problem.k, problem.v, **problem.arguments())


def backward(problem: Any, out: Any, lse: Any, grad_out: Any,
             grad_lse: Any) -> tuple[Any, Any, Any]:
    raise NotImplementedError(supports(problem, needs=frozenset({"backward"})))


def describe(problem: Any) -> dict[str, str]:
    """The plan's tasks for this call, in one line (built from shapes; nothing runs)."""
    from polyattn.backends.dask import plan

    rules = problem.rules
    q, k, _ = plan.rechunked(problem.q, problem.k, problem.v)
    lines = {"module": plan.__name__,
             "plan": plan.make_plan(q, k, rules, rules.lengths_at_hand).describe()}
    if rules.user is not None:
        lines["plan"] += ("; each tile task calls the user's rules with the call's indices "
                          "(its rows, keys and batch rows) and mod_args whole")
    if rules.segments is not None:
        lines["plan"] += ("; segment ids come to each tile task as blocks"
                          + (", and tiles outside every query's segment are left out"
                             if rules.segment_keys is not None else
                             " (not sorted or not at hand: no tile is left out for them)"))
    return lines
