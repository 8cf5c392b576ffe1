"""The fused SIMD register-tile CPU kernel (``"numba_cpu"``), forward and backward.

On NumPy arrays, and on torch CPU tensors through NumPy views of them
(:mod:`polyattn._autograd` makes the views and wires its backward pass into torch
autograd). The entry points are in :mod:`.launch` (compiling and Numba's cache in
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
    lib = library_name(problem.xp)
    if lib != "numpy" and not problem.torch_cpu and not problem.jax_cpu:
        where = (" on a GPU" if problem.on_cuda or lib in ("jax", "cupy") else
                 _torch_where(problem) if lib == "torch" else "")
        return (f"it takes NumPy arrays, and torch and JAX arrays on the CPU; these are "
                f"{lib} arrays{where}")
    rules = problem.rules
    if lib == "torch":
        why = _torch_gradients(problem, needs)
        if why is not None:
            return why
    if rules.segments is not None and rules.segment_keys is None:
        from polyattn._interop import concrete_values

        if any(concrete_values(ids) is None for ids in rules.segments):
            return ("it lowers segment ids as key ranges from their values, and these are "
                    "not at hand (traced): pass them as concrete arrays (closed over, not "
                    "arguments of the traced function), or use another implementation")
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
            compiler.kernels("float64" if "64" in str(problem.compute_dtype) else "float32")
        except compiler.KernelUnavailable as exc:
            return str(exc)
    return None if usable else why


def _torch_where(problem: Any) -> str:
    """What keeps these torch tensors from being viewed as NumPy arrays, in words."""
    import torch

    if torch.compiler.is_compiling():
        return " traced by torch.compile"
    for x in (problem.q, problem.k, problem.v, problem.mask):
        if x is None:
            continue
        if x.device.type != "cpu":
            return f" on the {x.device.type} device"
        if x.is_sparse:
            return " in a sparse layout"
        if type(x) is not torch.Tensor:
            return f" of the subclass {type(x).__name__}"
    return " traced by a torch.func transform"


def _torch_gradients(problem: Any, needs: frozenset[str]) -> str | None:
    """Why torch autograd cannot take this call's gradients from the kernel (``None``: it
    can): the kernel gives those of query, key and value only."""
    if "autograd" not in needs or not problem.requires_grad:
        return None
    constant = problem.constant_needing_grad
    user = problem.rules.user
    if constant is None and user is not None:
        constant = next((f"mod_args[{n}]" for n, a in enumerate(user.mod_args)
                         if getattr(a, "requires_grad", False)), None)
    if constant is None:
        return None
    return (f"`{constant}` requires a gradient, and the kernel's backward pass gives those "
            "of query, key and value only")


#: :func:`forward` and :func:`backward` take ``into``: arrays (shaped and typed as their
#: results) that they write their results into where they can (:mod:`polyattn._jax_ffi`
#: hands them XLA's result buffers).
WRITES_INTO = True


def forward(problem: Any, into: Any = None) -> tuple[Any, Any]:
    from polyattn.backends.numba_cpu import launch

    return launch.attention(problem.q, problem.k, problem.v, into=into,
                            **problem.arguments())


def backward(problem: Any, out: Any, lse: Any, grad_out: Any,
             grad_lse: Any, into: Any = None) -> tuple[Any, Any, Any]:
    from polyattn.backends.numba_cpu import launch

    return launch.backward(problem.q, problem.k, problem.v, out, lse, grad_out,
                           grad_lse=grad_lse, into=into, **problem.arguments())


def describe(problem: Any) -> dict[str, str]:
    """Whether the kernel is compiled, cached on disk or still to compile; its tiles."""
    from polyattn.backends.numba_cpu import compiler, launch

    dtype = "float64" if "float64" in str(problem.compute_dtype) else "float32"
    return {"module": launch.__name__, "numba_cpu kernel": compiler.cache_state(dtype),
            "numba_cpu tiles": compiler.tiles()}
