"""Choosing an implementation: what ``implementation="auto"`` does, and why.

The rule (DESIGN §5), a preference list walked in order: torch and JAX
arrays go to ``"native"`` (the library's own fused attention) where it
expresses the call exactly; arrays on a CUDA device with a working Numba
CUDA kernel go to ``"numba_cuda"``, unless they require gradients (the kernel
has no backward pass); otherwise ``"reference"`` while the score matrix fits
the score budget, else ``"chunked"``.

The budget is :data:`SCORE_BUDGET_BYTES` (64 MiB, a memory bound) for every
namespace but NumPy. On NumPy arrays ``"chunked"`` runs
:mod:`polyattn.implementations.numpy_chunked`, the multi-threaded blocked
path, which was measured faster than materialising the scores from a score
matrix of about 32 KiB on (2-core x86-64, OpenBLAS; see ``benchmarks/``), so
NumPy uses :data:`NUMPY_SCORE_BUDGET_BYTES`. The environment variable
``POLYATTN_SCORE_BUDGET`` (bytes) overrides both: a large value keeps the
reference path, ``0`` always streams.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ._compat import device_of, library_name
from ._problem import Problem
from .implementations import native

#: Largest score matrix (bytes, in the compute dtype) that ``"auto"`` lets the
#: reference path materialise; above it the chunked path runs. Override with the
#: ``POLYATTN_SCORE_BUDGET`` environment variable (bytes).
SCORE_BUDGET_BYTES = 64 * 2**20
#: The same for NumPy arrays, where ``"chunked"`` is the NumPy fast path: the
#: measured crossover (float32 and float64, 2 cores) lies between score matrices of
#: 16 KiB (reference 0.14 ms, blocked 0.19 ms) and 64 KiB (reference 24 ms once
#: OpenBLAS splits its product over threads, blocked 0.22 ms).
NUMPY_SCORE_BUDGET_BYTES = 32 * 2**10


def score_budget(xp: Any = None) -> int:
    """The score-matrix budget in bytes for namespace ``xp`` (environment override included).

    ``POLYATTN_SCORE_BUDGET`` wins when set; otherwise NumPy arrays get
    :data:`NUMPY_SCORE_BUDGET_BYTES` and every other namespace (or ``xp=None``)
    :data:`SCORE_BUDGET_BYTES`.
    """
    env = os.environ.get("POLYATTN_SCORE_BUDGET")
    if env:
        try:
            return int(float(env))
        except ValueError as exc:
            raise ValueError(
                f"POLYATTN_SCORE_BUDGET must be a number of bytes; got {env!r}") from exc
    if xp is not None and is_numpy(xp):
        return NUMPY_SCORE_BUDGET_BYTES
    return SCORE_BUDGET_BYTES


def is_numpy(xp: Any) -> bool:
    """Whether ``xp`` is NumPy (where "chunked" runs the NumPy fast path)."""
    return library_name(xp) == "numpy"


@dataclass(frozen=True)
class Explanation:
    """Which implementation runs for a call, and why.

    ``str()`` gives one readable paragraph; the fields are there for programs.
    """

    implementation: str
    reason: str
    library: str
    device: str
    dtype: str
    compute_dtype: str
    shape: dict[str, tuple[int, ...]] = field(default_factory=dict)
    score_bytes: int = 0
    score_budget: int = 0
    kernel_available: bool = False
    kernel_reason: str = ""
    module: str = ""
    #: For ``"auto"``: each implementation -> why it was not chosen ("" for the one that was).
    candidates: dict[str, str] = field(default_factory=dict)
    layout: str = "BHTE"
    #: The position and score keywords in use (window, softcap, ALiBi, key lengths).
    features: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        shapes = ", ".join(f"{k} {v}" for k, v in self.shape.items())
        lines = [
            f"implementation: {self.implementation}",
            f"reason: {self.reason}",
            f"inputs: {self.library} arrays on {self.device}, dtype {self.dtype} "
            f"(computed in {self.compute_dtype}); {shapes}",
            f"score matrix: {_mib(self.score_bytes)} (budget {_mib(self.score_budget)})",
            f"numba_cuda kernel: {'usable' if self.kernel_available else 'not usable'}"
            f" ({self.kernel_reason})",
        ]
        if self.module:
            lines.insert(1, f"module: {self.module}")
        if self.layout != "BHTE":
            lines.append(f"layout: {self.layout} (query, key, value and out are (B…, T, H, E); "
                         "shapes above are their (B…, H, T, E) views)")
        if self.features:
            lines.append("features: " + ", ".join(f"{k} {v}" for k, v in self.features.items()))
        if self.candidates:
            lines.append("candidates, in order of preference:")
            lines += [f"  {name}: {'chosen' if not why else 'not chosen: ' + why}"
                      for name, why in self.candidates.items()]
        return "\n".join(lines)


def _mib(n: int) -> str:
    """A byte count for people: KiB below 1 MiB, else MiB."""
    return f"{n / 2**10:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def is_cuda(problem: Problem) -> bool:
    """Whether the inputs live on a CUDA device (CuPy, or torch CUDA tensors)."""
    lib = library_name(problem.xp)
    if lib == "cupy":
        return True
    dev = device_of(problem.q)
    return lib == "torch" and getattr(dev, "type", None) == "cuda"


def load_kernel_module() -> ModuleType:
    """Import the Numba CUDA implementation (only when it is wanted)."""
    return importlib.import_module("polyattn.implementations.numba_cuda")


def kernel_status(problem: Problem) -> tuple[bool, str]:
    """(usable, reason) for the Numba CUDA kernel on these inputs."""
    simulator = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    if not is_cuda(problem) and not simulator:
        return False, f"inputs are {library_name(problem.xp)} arrays on the CPU, not CUDA arrays"
    try:
        module = load_kernel_module()
    except ImportError as exc:
        return False, f"numba-cuda is not installed ({exc})"
    return module.availability(problem.xp, (problem.q, problem.k, problem.v))


def module_name(name: str, xp: Any = None) -> str:
    """The module that runs implementation ``name`` on namespace ``xp``."""
    if name == "native" and xp is not None:
        return {"torch": "torch.nn.functional.scaled_dot_product_attention",
                "jax": "jax.nn.dot_product_attention"}.get(library_name(xp),
                                                           "polyattn.implementations.native")
    if name == "chunked" and xp is not None and is_numpy(xp):
        name = "numpy_chunked"
    return f"polyattn.implementations.{name}"


def load(name: str, xp: Any = None) -> ModuleType:
    """The module of implementation ``name``; on NumPy, "chunked" is the NumPy fast path."""
    if name == "numba_cuda":
        return load_kernel_module()
    if name == "native":
        return native
    return importlib.import_module(module_name(name, xp))


def native_status(problem: Problem, return_lse: bool) -> str | None:
    """Why the input library's own attention cannot run this call (``None``: it can)."""
    return native.unavailable(problem.xp, problem.q, problem.k, problem.v,
                              return_lse=return_lse, rules=problem.rules)


def _budget_reason(score_bytes: int, budget: int, numpy: bool) -> tuple[str, str]:
    """("reference" or "chunked", why) by the score-matrix budget."""
    if score_bytes <= budget:
        if numpy:
            return "reference", (
                f"the {_mib(score_bytes)} score matrix fits the {_mib(budget)} budget "
                "for NumPy arrays, below which materialising it was measured fastest")
        return "reference", (f"the {_mib(score_bytes)} score matrix fits the {_mib(budget)} "
                             "budget, so materialising it is fastest")
    if numpy:
        return "chunked", (
            f"the {_mib(score_bytes)} score matrix exceeds the {_mib(budget)} budget "
            "for NumPy arrays, above which the multi-threaded blocked NumPy path "
            "(numpy_chunked) was measured faster; keys are streamed in blocks with "
            "an online softmax")
    return "chunked", (f"the {_mib(score_bytes)} score matrix exceeds the {_mib(budget)} "
                       "budget, so keys are streamed in blocks with an online softmax")


def _dense_mask_cost(problem: Problem, score_bytes: int, budget: int) -> str | None:
    """Why "auto" passes over native for a window, key lengths or ALiBi (``None``: it doesn't).

    The native functions take those only as one dense (B…, H, Tq, Tk) mask,
    which costs the whole score matrix in memory and time, while the blocked
    path skips the key blocks no query can see. Past the score budget the
    blocked path wins (measured on torch and under ``jax.jit``: 1.8–10× at
    T = 4096 with a 128-key window), so "auto" takes it there.
    """
    rules = problem.rules
    if rules is None or rules.simple or score_bytes <= budget:
        return None
    used = [name for name, value in (("window", rules.window),
                                     ("key_lengths", rules.key_lengths),
                                     ("alibi_slopes", rules.alibi)) if value is not None]
    return (f"{', '.join(used)} would become a dense mask as large as the "
            f"{_mib(score_bytes)} score matrix (over the {_mib(budget)} budget), while the "
            "blocked path skips the key blocks no query can see")


def choose(problem: Problem, requested: str, *, return_lse: bool = False) -> Explanation:
    """Decide which implementation runs; raise if a requested one cannot.

    ``"auto"`` walks the preference list native → numba_cuda → reference /
    chunked (by the score budget) and takes the first that can run the call;
    every candidate's verdict is kept in :attr:`Explanation.candidates`.
    """
    score_bytes = problem.score_elements * (8 if problem.compute_dtype == problem.xp.float64
                                            else 4)
    budget = score_budget(problem.xp)
    numpy = is_numpy(problem.xp)
    grad = problem.requires_grad

    # --- native: the library's own fused attention, where it maps exactly
    native_why = (native_status(problem, return_lse)
                  if requested in ("auto", "native") else "not considered")
    if requested == "native" and native_why is not None:
        raise ValueError(f"implementation='native' cannot run this call exactly: {native_why}")
    if requested == "auto" and native_why is None:
        native_why = _dense_mask_cost(problem, score_bytes, budget)

    # --- numba_cuda: CUDA arrays, no backward pass yet
    usable, kernel_reason = (False, "not considered")
    no_backward = ("the inputs require gradients and the numba_cuda kernel has no backward "
                   "pass, so autograd would lose them")
    if requested in ("auto", "numba_cuda"):
        usable, kernel_reason = kernel_status(problem)
        if usable and grad:
            usable, kernel_reason = False, no_backward
    if requested == "numba_cuda" and not usable:
        if grad:
            # the gradient is the reason whatever else rules the kernel out
            besides = "" if kernel_reason == no_backward else f" (besides: {kernel_reason})"
            raise ValueError(f"implementation='numba_cuda' cannot run this call: "
                             f"{no_backward}{besides}; use implementation='auto' or detach "
                             "the inputs")
        raise RuntimeError(
            f"implementation='numba_cuda' needs CUDA arrays (CuPy or torch CUDA tensors), "
            f"a CUDA GPU and numba-cuda, or the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) "
            f"for NumPy arrays: {kernel_reason}"
        )

    budget_name, budget_why = _budget_reason(score_bytes, budget, numpy)
    candidates: dict[str, str] = {}
    if requested != "auto":
        name, reason = requested, "requested by the caller"
    elif native_why is None:
        name = "native"
        reason = (f"{library_name(problem.xp)} arrays, and its own fused attention "
                  "expresses this call exactly")
    elif usable and is_cuda(problem):
        name, reason = "numba_cuda", "CUDA arrays and a working Numba CUDA kernel"
    else:
        name, reason = budget_name, budget_why
    if requested == "auto":
        candidates["native"] = "" if name == "native" else native_why or "not needed"
        if name == "numba_cuda":
            candidates["numba_cuda"] = ""
        elif name == "native" and usable:
            candidates["numba_cuda"] = "usable, but native comes first"
        elif usable:
            candidates["numba_cuda"] = "runs on the CUDA simulator only when asked by name"
        else:
            candidates["numba_cuda"] = kernel_reason
        for other in ("reference", "chunked"):
            if other == name:
                candidates[other] = ""
            elif name in ("native", "numba_cuda"):
                candidates[other] = f"{name} comes first"
            else:
                candidates[other] = budget_why
    if name == "chunked" and numpy and requested != "auto":
        reason += "; on NumPy arrays it runs the multi-threaded blocked path (numpy_chunked)"
    shape = {"query": tuple(problem.q.shape), "key": tuple(problem.k.shape)}
    if problem.v is not None:
        shape["value"] = tuple(problem.v.shape)
    return Explanation(
        implementation=name,
        reason=reason,
        library=library_name(problem.xp),
        device=str(device_of(problem.q)),
        dtype=str(problem.result_dtype),
        compute_dtype=str(problem.compute_dtype),
        shape=shape,
        score_bytes=score_bytes,
        score_budget=budget,
        kernel_available=usable,
        kernel_reason=kernel_reason,
        module=module_name(name, problem.xp),
        candidates=candidates,
        layout=problem.layout,
        features=_features(problem),
    )


def _features(problem: Problem) -> dict[str, str]:
    """The §4.1 keywords of a call, for people."""
    rules = problem.rules
    if rules is None:
        return {}
    found = {}
    if rules.window is not None:
        found["window"] = str(rules.window)
    if rules.softcap is not None:
        found["softcap"] = str(rules.softcap)
    if rules.alibi is not None:
        found["alibi_slopes"] = str(tuple(rules.alibi.shape))
    if rules.key_lengths is not None:
        found["key_lengths"] = str(tuple(rules.key_lengths.shape)) + (
            " (query positions count back from each row's length)"
            if rules.lengths_shift else "")
    return found


def run(problem: Problem, name: str) -> tuple[Any, Any]:
    """Call implementation ``name`` on a prepared problem."""
    extra = {}
    if problem.rules is not None and not problem.rules.simple:
        extra["rules"] = problem.rules
    return load(name, problem.xp).attention(problem.q, problem.k, problem.v, mask=problem.mask,
                                causal_offset=problem.causal_offset, scale=problem.scale,
                                xp=problem.xp, **extra)
