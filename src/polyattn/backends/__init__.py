"""The interchangeable attention implementations: one protocol, one package per family.

Each family package (``array_api``, ``native``, ``numpy``, ``numba_cpu``,
``cuda``, ``dask``) exports the names of :class:`Backend`, except two that
export objects with them: ``array_api`` holds two implementations
(``REFERENCE`` and ``CHUNKED``), and in ``numpy`` the modules ``forward.py``
and ``backward.py`` take those names (``FAST_PATH``). :func:`backend` imports
a family only when it is wanted, and a family's ``__init__`` imports its own
modules only inside its functions, so importing polyattn imports no Numba,
CuPy or torch (docs/architecture.rst).

A backend receives a validated ``Problem`` (:mod:`polyattn._problem`):

q (B…, H, Tq, E), k (B…, Hkv, Tk, E), v (B…, Hkv, Tk, Ev)
    One leading batch shape B… (already broadcast), one floating dtype (the
    compute dtype: float32 or float64), ``H % Hkv == 0``; query head ``h``
    reads key/value head ``h // (H // Hkv)``.
mask
    ``None`` or an array with ``q.ndim`` dimensions, each 1 or the full size
    of (B…, H, Tq, Tk); bool (True = attend) or the compute dtype (added to
    the scaled scores).
scale
    Python float multiplying ``q · k``.
rules
    A :class:`polyattn.rules.visibility.Rules`, always: causality, windows,
    key lengths, soft-capping, ALiBi and dropout (docs/semantics.rst). The
    modules below the families take it as ``rules=``, with the mask, the scale
    and the namespace (``Problem.arguments()``): causality travels in the rules
    (``rules.causal_offset`` is the plain causal form of it).

``forward`` returns ``out`` (B…, H, Tq, Ev) and ``lse`` (B…, H, Tq) in the
compute dtype. A fully masked row gives ``out = 0`` and ``lse = -inf``. Every
problem has at least one score: the caller answers Tq, Tk, B or H = 0 itself.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Protocol

#: ``needs``: the call returns the log-sum-exp (``return_lse=True``).
LSE = "lse"
#: ``needs``: :func:`polyattn.attention_vjp` runs the backend's own backward pass.
BACKWARD = "backward"
#: ``needs``: torch autograd records the call (a backend it wraps gives gradients of
#: query, key and value only, so a mask or slopes requiring one rule it out).
AUTOGRAD = "autograd"
#: ``needs``: the backend's code must be compiled now (``"auto"`` falls back where not).
COMPILED = "compiled"

#: ``DIFFERENTIATED``: the input library's autodiff sees through the backend's operations.
BY_LIBRARY = "library"
#: ``DIFFERENTIATED``: its own backward pass, wrapped by :mod:`polyattn._autograd` for torch.
BY_AUTOGRAD = "autograd"


class Backend(Protocol):
    """What a family package (or, for ``array_api``, each of its two objects) offers."""

    #: The public implementation name (``"numba_cpu"``, ...).
    NAME: str
    #: :data:`BY_LIBRARY` or :data:`BY_AUTOGRAD`.
    DIFFERENTIATED: str
    #: The score rules it handles (names of :data:`polyattn.rules.visibility.RULE_NAMES`),
    #: listed one by one: it lowers each, or refuses a call with a reason of its own (native
    #: and soft-capping, say). A call using another is not given to it (:func:`objection`).
    RULES: frozenset[str]
    #: Whether it computes on NumPy arrays, so that torch CPU tensors reach it as NumPy
    #: views of them (:func:`polyattn._autograd.numpy_bridge`).
    HOST: bool

    def supports(self, problem: Any, *, needs: frozenset[str] = frozenset()) -> str | None:
        """Why it cannot run the call with ``needs`` (:data:`LSE`, ...); ``None``: it can."""

    def forward(self, problem: Any) -> tuple[Any, Any]:
        """``(out, lse)`` of the call."""

    def backward(self, problem: Any, out: Any, lse: Any, grad_out: Any,
                 grad_lse: Any) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)``, FlashAttention-2's backward pass from ``out`` and ``lse``."""

    def describe(self, problem: Any) -> dict[str, str]:
        """Lines for ``explain()``: ``"module"`` (what runs), ``"reason"`` (appended to the
        reason it was chosen, optional), and lines of its own (label -> text)."""


#: Implementation name -> (family package, object in it; ``None``: the package itself).
FAMILIES: dict[str, tuple[str, str | None]] = {
    "reference": ("array_api", "REFERENCE"),
    "chunked": ("array_api", "CHUNKED"),
    "native": ("native", None),
    "numba_cpu": ("numba_cpu", None),
    "numba_cuda": ("cuda", None),
    "distributed": ("dask", None),
}


def family(name: str) -> Backend:
    """The backend of implementation ``name`` (its family imported now); for
    ``"chunked"`` the Array-API blocked path (:func:`backend` picks the NumPy one)."""
    package, attribute = FAMILIES[name]
    module = _imported(f"{__name__}.{package}")
    return module if attribute is None else getattr(module, attribute)  # type: ignore[return-value]


def numpy_path() -> Backend:
    """The NumPy fast path: what ``"chunked"`` runs on NumPy arrays."""
    return _imported(f"{__name__}.numpy").FAST_PATH  # type: ignore[no-any-return]


def _imported(name: str) -> Any:
    """Module ``name``, imported now if it is not yet (``sys.modules`` first: TorchDynamo
    does not trace ``importlib.import_module``, so ``torch.compile(fullgraph=True)``
    needs the lookup once the module is there)."""
    return sys.modules.get(name) or importlib.import_module(name)


def objection(runner: Backend, problem: Any, needs: frozenset[str] = frozenset()) -> str | None:
    """Why ``runner`` cannot run ``problem`` with ``needs``: a rule it does not lower, or its
    own :meth:`Backend.supports`; ``None``: it can."""
    rules = problem.rules
    missing = sorted(rules.in_use() - runner.RULES) if rules is not None else []
    if missing:
        lowered = ", ".join(sorted(runner.RULES))
        return f"it does not apply {' or '.join(missing)} (it applies {lowered})"
    return runner.supports(problem, needs=needs)


def backend(name: str, problem: Any) -> Backend:
    """The backend that runs implementation ``name`` for ``problem``: ``"chunked"`` is the
    NumPy fast path wherever it can run the call (NumPy arrays, NumPy views of torch CPU
    tensors), else the Array-API blocked path."""
    if name == "chunked":
        fast = numpy_path()
        if objection(fast, problem, frozenset({AUTOGRAD})) is None:
            return fast
    return family(name)


def _import_families() -> None:
    """Import every family package now (each is light: CuPy, Numba, torch and JAX are
    imported only when used), so that the first call traced by TorchDynamo
    (``torch.compile(fullgraph=True)``) finds them in ``sys.modules``."""
    for package in {package for package, _ in FAMILIES.values()} | {"numpy"}:
        importlib.import_module(f"{__name__}.{package}")


_import_families()
