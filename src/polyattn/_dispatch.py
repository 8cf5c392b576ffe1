"""Choosing an implementation: what ``implementation="auto"`` does, and why.

The rule (DESIGN §5): arrays on a CUDA device with a working Numba CUDA
kernel go to ``"numba_cuda"``; otherwise ``"reference"`` while the score
matrix fits :data:`SCORE_BUDGET_BYTES`, else ``"chunked"``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ._compat import device_of, library_name
from ._problem import Problem

#: Largest score matrix (bytes, in the compute dtype) that ``"auto"`` lets the
#: reference path materialise; above it the chunked path runs. Override with the
#: ``POLYATTN_SCORE_BUDGET`` environment variable (bytes).
SCORE_BUDGET_BYTES = 64 * 2**20


def score_budget() -> int:
    """The score-matrix budget in bytes (environment override included)."""
    env = os.environ.get("POLYATTN_SCORE_BUDGET")
    if env:
        try:
            return int(float(env))
        except ValueError as exc:
            raise ValueError(f"POLYATTN_SCORE_BUDGET must be a number of bytes; got {env!r}") from exc
    return SCORE_BUDGET_BYTES


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
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


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


def load(name: str) -> ModuleType:
    """The module of implementation ``name``."""
    if name == "numba_cuda":
        return load_kernel_module()
    return importlib.import_module(f"polyattn.implementations.{name}")


def choose(problem: Problem, requested: str) -> Explanation:
    """Decide which implementation runs; raise if a requested one cannot."""
    score_bytes = problem.score_elements * (8 if problem.compute_dtype == problem.xp.float64
                                            else 4)
    budget = score_budget()
    usable, kernel_reason = (False, "not considered")
    if requested in ("auto", "numba_cuda"):
        usable, kernel_reason = kernel_status(problem)
    if requested == "numba_cuda" and not usable:
        raise RuntimeError(
            f"implementation='numba_cuda' needs CUDA arrays (CuPy or torch CUDA tensors), "
            f"a CUDA GPU and numba-cuda, or the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) "
            f"for NumPy arrays: {kernel_reason}"
        )
    if requested != "auto":
        name, reason = requested, "requested by the caller"
    elif usable and is_cuda(problem):
        name, reason = "numba_cuda", "CUDA arrays and a working Numba CUDA kernel"
    elif score_bytes <= budget:
        name = "reference"
        reason = (f"the {_mib(score_bytes)} score matrix fits the {_mib(budget)} budget, "
                  "so materialising it is fastest")
    else:
        name = "chunked"
        reason = (f"the {_mib(score_bytes)} score matrix exceeds the {_mib(budget)} budget, "
                  "so keys are streamed in blocks with an online softmax")
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
    )


def run(problem: Problem, name: str) -> tuple[Any, Any]:
    """Call implementation ``name`` on a prepared problem."""
    return load(name).attention(problem.q, problem.k, problem.v, mask=problem.mask,
                                causal_offset=problem.causal_offset, scale=problem.scale,
                                xp=problem.xp)
