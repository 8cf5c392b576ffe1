"""The libraries' own fused attention (``"native"``): torch SDPA and JAX's.

Used only where the library's function computes the call exactly
(:func:`.fused.unavailable` says why not); the library's autodiff
differentiates it, and it has no backward pass of polyattn's own.
"""

from __future__ import annotations

from typing import Any

from polyattn._interop import library_name

NAME = "native"
DIFFERENTIATED = "library"
HOST = False
#: The score rules it handles (named one by one: a rule added to polyattn is not
#: given to it until it is listed here).
RULES = frozenset({"causal", "window", "key_lengths", "softcap", "alibi", "dropout",
                   "segment_ids", "score_mod", "mask_mod"})
#: The rules of :data:`RULES` that no native function expresses exactly: a call using one is
#: refused with its reason (``{name}``: the library's function), so the dispatcher takes
#: the next implementation. Causality, windows, key lengths and ALiBi become one dense mask.
REFUSED = {
    "softcap": ("softcap: {name} has no logit soft-capping, and tanh cannot be folded into "
                "an additive mask"),
    "dropout": ("dropout_p: {name} draws its dropout mask from its own generator, not from "
                "the Philox counters that give every polyattn implementation the same mask"),
    "score_mod": ("score_mod: {name} takes no score function (torch's flex_attention does, "
                  "fast only under torch.compile, and slower on the CPU than numba_cpu in "
                  "benchmarks/results/flex-cpu-*.md): polyattn's own paths run it"),
    "mask_mod": ("mask_mod: {name} takes no mask function, and the mask it would take "
                 "densely costs T² where a block mask skips the empty tiles: polyattn's own "
                 "paths run it"),
}

#: The function that runs, per library.
FUNCTIONS = {"torch": "torch.nn.functional.scaled_dot_product_attention",
             "jax": "jax.nn.dot_product_attention"}


def supports(problem: Any, *, needs: frozenset[str] = frozenset()) -> str | None:
    """Why the input library's own attention cannot run this call exactly (``None``: it can)."""
    if "backward" in needs:
        return ("attention_vjp runs polyattn's own backward passes, and the native "
                "functions return no log-sum-exp for one")
    from polyattn._interop import library_name
    from polyattn.backends.native import fused

    why = fused.unavailable(problem.xp, problem.q, problem.k, problem.v,
                            return_lse="lse" in needs and problem.sinks is None,
                            rules=problem.rules, refused=REFUSED)
    if why is None and problem.sinks is not None:
        name = FUNCTIONS[library_name(problem.xp)]
        return (f"sinks: {name} has no attention sinks, and polyattn joins them through the "
                "log-sum-exp, which it does not return")
    return why


def forward(problem: Any) -> tuple[Any, Any]:
    """``(out, None)``: the native functions return no log-sum-exp."""
    from polyattn.backends.native import fused

    return fused.attention(problem.q, problem.k, problem.v, **problem.arguments())


def backward(problem: Any, out: Any, lse: Any, grad_out: Any,
             grad_lse: Any) -> tuple[Any, Any, Any]:
    raise NotImplementedError("the native functions are differentiated by their library")


def describe(problem: Any) -> dict[str, str]:
    return {"module": FUNCTIONS.get(library_name(problem.xp), "polyattn.backends.native.fused")}
