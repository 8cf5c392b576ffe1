"""The fused SIMD register-tile CPU kernel (``"numba_cpu"``), forward and backward.

On NumPy arrays. The entry points are in :mod:`.launch` (compiling and Numba's cache in
:mod:`.compiler`); this module imports them (and so Numba) only inside its functions.
Its backward pass is its own. The rules travel to it as one
:class:`~polyattn.rules.visibility.Rules` (``Problem.arguments``).
"""

from __future__ import annotations

from typing import Any

from polyattn._interop import library_name

NAME = "numba_cpu"
DIFFERENTIATED = "autograd"
HOST = True
#: The score rules it handles (named one by one: a rule added to polyattn is not
#: given to it until it is listed here).
RULES = frozenset({"causal", "window", "key_lengths", "softcap", "alibi", "dropout",
                   "segment_ids", "score_mod", "mask_mod"})


def supports(problem: Any, *, needs: frozenset[str] = frozenset()) -> str | None:
    """Why the kernel cannot run this call (``None``: it can). With ``"compiled"`` in
    ``needs`` it compiles the kernel (or loads it from Numba's cache) now."""
    if library_name(problem.xp) != "numpy":
        return f"it takes NumPy arrays; these are {library_name(problem.xp)} arrays"
    rules = problem.rules
    if rules.segments is not None and rules.segment_keys is None:
        return ("it lowers segment ids sorted in every row (packed sequences) as key "
                "ranges, and these are not sorted")
    from polyattn.backends.numba_cpu import compiler, user_rules

    usable, why = compiler.availability()
    if usable and rules.user is not None:
        why_not = user_rules.check(rules)
        if why_not is not None:
            return why_not
    if usable and "compiled" in needs:
        try:
            compiler.kernels()
        except compiler.KernelUnavailable as exc:
            return str(exc)
    return None if usable else why


def forward(problem: Any) -> tuple[Any, Any]:
    from polyattn.backends.numba_cpu import launch

    return launch.attention(problem.q, problem.k, problem.v, **problem.arguments())


def backward(problem: Any, out: Any, lse: Any, grad_out: Any,
             grad_lse: Any) -> tuple[Any, Any, Any]:
    from polyattn.backends.numba_cpu import launch

    return launch.backward(problem.q, problem.k, problem.v, out, lse, grad_out,
                           grad_lse=grad_lse, **problem.arguments())


def describe(problem: Any) -> dict[str, str]:
    """Whether the kernel is compiled, cached on disk or still to compile; its tiles."""
    from polyattn.backends.numba_cpu import compiler, launch

    return {"module": launch.__name__, "numba_cpu kernel": compiler.cache_state(),
            "numba_cpu tiles": compiler.tiles()}
