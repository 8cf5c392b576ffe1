"""The Numba CUDA kernels (``"numba_cuda"``): rows, tiled and tensor-core, forward and backward.

The entry points are in :mod:`.facade`; this module only answers the
:class:`polyattn.backends.Backend` questions and imports the kernels' modules
inside its functions (so neither Numba nor CuPy is imported with it). Its
backward pass is its own: :mod:`polyattn._autograd` wraps it for torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

from polyattn._interop import device_of, library_name, simulator_enabled

NAME = "numba_cuda"
DIFFERENTIATED = "autograd"
#: On the simulator the kernels run on NumPy arrays (torch CPU tensors as views of them).
HOST = True
#: The score rules it handles (named one by one: a rule added to polyattn is not
#: given to it until it is listed here).
RULES = frozenset({"causal", "window", "key_lengths", "softcap", "alibi", "dropout",
                   "segment_ids", "score_mod", "mask_mod"})
#: The kernels that apply ``score_mod`` and ``mask_mod`` (the others refuse them by name).
USER_RULE_KERNELS = ("one-thread-per-row", "register-tiled", "tensor-core")


def entry_points() -> ModuleType:
    """The module with the kernels' entry points (``attention``, ``backward``,
    ``availability``, ``kernel_choice``, ``row_loads``)."""
    name = "facade" if importlib.util.find_spec(f"{__name__}.facade") else "rows"
    return importlib.import_module(f"{__name__}.{name}")


def _availability(problem: Any) -> tuple[bool, str]:
    """(usable, why) of the kernels for these inputs."""
    if not problem.on_cuda and not simulator_enabled():
        kind = getattr(device_of(problem.q), "type", None)
        where = f"the {kind} device" if isinstance(kind, str) and kind != "cpu" else "the CPU"
        return False, f"inputs are {library_name(problem.xp)} arrays on {where}, not CUDA arrays"
    try:
        module = entry_points()
    except ImportError as exc:
        return False, f"numba-cuda is not installed ({exc})"
    if simulator_enabled() and problem.torch_cpu:
        usable, why = module.availability(None, ())
        if usable:
            why = ("the Numba CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1): torch CPU "
                   "tensors run through NumPy views of them, slowly; for testing")
        return usable, why
    return module.availability(problem.xp, (problem.q, problem.k, problem.v))  # type: ignore[no-any-return]


def supports(problem: Any, *, needs: frozenset[str] = frozenset()) -> str | None:
    """Why the kernels cannot run this call (``None``: they can). Under torch autograd
    (``"autograd"`` in ``needs``) a mask or slopes that require a gradient rule them out."""
    usable, why = _availability(problem)
    from polyattn.backends.cuda import blocks

    user = blocks.refusal(problem.rules) or _user_rules_refused(problem)
    if user is not None:
        return user if usable else f"{user} (besides: {why})"
    constant = problem.constant_needing_grad if "autograd" in needs else None
    if constant is not None:
        grad = (f"`{constant}` requires a gradient, and the numba_cuda kernel's backward "
                "pass gives gradients for query, key and value only, so autograd would "
                "lose it")
        return grad if usable else f"{grad} (besides: {why})"
    return None if usable else why


def _kernel_taking(problem: Any) -> str:
    """The kernel that takes this call: ``"tensor-core"``, ``"register-tiled"`` or
    ``"one-thread-per-row"`` (as :func:`.facade.attention` chooses, untuned)."""
    from polyattn.backends.cuda import tensor_core, tiled
    from polyattn.backends.cuda.environment import kernel_choice

    tq, e = problem.q.shape[-2:]
    ev = e if problem.v is None else problem.v.shape[-1]
    arithmetic = _arithmetic(problem)
    if arithmetic is not None and tensor_core.unsupported(arithmetic, tq, e, ev) is None:
        return "tensor-core"
    if kernel_choice() == "tiled" and tiled.unsupported(tq) is None:
        return "register-tiled"
    return "one-thread-per-row"


def _user_rules_refused(problem: Any) -> str | None:
    """Why the kernel that would take this call cannot apply its ``score_mod`` or
    ``mask_mod`` (``None``: it has none, or the kernel applies them)."""
    rules = getattr(problem, "rules", None)
    used = sorted(rules.in_use() & {"score_mod", "mask_mod"}) if rules is not None else []
    if not used:
        return None
    kernel = _kernel_taking(problem)
    if kernel in USER_RULE_KERNELS:
        return None
    return (f"it does not apply {' or '.join(used)} in its {kernel} kernel, which takes "
            "this call (its one-thread-per-row kernel does: POLYATTN_CUDA_KERNEL=rows, or "
            "decoding shapes)")


def _arithmetic(problem: Any) -> str | None:
    """``"f16"``, ``"bf16"``, ``"3xtf32"`` (tensor cores) or ``None`` (exact) for this call."""
    return _tensor_core_choice(problem)[0]


def _tensor_core_choice(problem: Any) -> tuple[str | None, str]:
    from polyattn.backends.cuda import tensor_core

    tq, e = problem.q.shape[-2:]
    ev = e if problem.v is None else problem.v.shape[-1]
    return tensor_core.choose(str(problem.result_dtype), tq, e, ev)  # type: ignore[no-any-return]


def forward(problem: Any) -> tuple[Any, Any]:
    return entry_points().attention(  # type: ignore[no-any-return]
        problem.q, problem.k, problem.v, arithmetic=_arithmetic(problem),
        **problem.arguments())


def backward(problem: Any, out: Any, lse: Any, grad_out: Any,
             grad_lse: Any) -> tuple[Any, Any, Any]:
    return entry_points().backward(  # type: ignore[no-any-return]
        problem.q, problem.k, problem.v, out, lse, grad_out, grad_lse=grad_lse,
        **problem.arguments())


def describe(problem: Any) -> dict[str, str]:
    """The kernels' verdict and the arithmetic of their products (tensor cores or exact)."""
    from polyattn.backends.cuda import tiled

    module = entry_points()
    _, why = _availability(problem)
    arithmetic, how = _tensor_core_choice(problem)
    tq = problem.q.shape[-2]
    if arithmetic is not None:
        pass
    elif module.kernel_choice() == "tiled" and tiled.unsupported(tq) is None:
        named = {"query": problem.q, "key": problem.k, "value": problem.v}
        how += "; the register-tiled kernel, " + module.row_loads(
            **{n: x for n, x in named.items() if x is not None})
    elif module.kernel_choice() == "rows":
        how += "; the one-thread-per-row kernel (POLYATTN_CUDA_KERNEL=rows)"
    else:
        how += "; the one-thread-per-row kernel (decoding shapes)"
    lines = {"module": module.__name__, "numba_cuda kernel": f"usable ({why})",
             "arithmetic": how}
    from polyattn.backends.cuda import blocks

    masks = blocks.describe(problem.rules)
    if masks is not None:
        lines["numba_cuda masks"] = masks
    return lines
