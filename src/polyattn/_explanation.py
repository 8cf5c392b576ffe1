"""What ``explain()`` returns: :class:`Explanation`, assembled by :mod:`polyattn._dispatch`
from the choice it made and the lines each backend's ``describe()`` supplies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Explanation", "mib"]


def _detail(label: str, doc: str) -> Any:
    return property(lambda self: self.details.get(label, ""), doc=doc)


@dataclass(frozen=True)
class Explanation:
    """Which implementation runs for a call, and why; ``str()`` gives a readable report."""

    implementation: str
    reason: str
    library: str
    device: str
    dtype: str
    compute_dtype: str
    shape: dict[str, tuple[int, ...]] = field(default_factory=dict)
    score_bytes: int = 0
    score_budget: int = 0
    module: str = ""
    #: For ``"auto"``: each implementation -> why it was not chosen ("" for the one that was).
    candidates: dict[str, str] = field(default_factory=dict)
    layout: str = "BHTE"
    #: The position and score keywords in use (window, softcap, ALiBi, key lengths).
    features: dict[str, str] = field(default_factory=dict)
    #: Lines the backends supply, label -> text: the numba_cuda kernels' verdict, then
    #: the chosen backend's own (``"plan"``, ``"numba_cpu kernel"``, ``"arithmetic"``, ...).
    details: dict[str, str] = field(default_factory=dict)

    plan = _detail("plan", 'For "distributed": the task plan (chunks, tile and merge tasks).')
    compiled = _detail("numba_cpu kernel", 'For "numba_cpu": compiled, cached, or not yet.')
    tiles = _detail("numba_cpu tiles", 'For "numba_cpu": its SIMD vectors and register tiles.')
    arithmetic = _detail("arithmetic", 'For "numba_cuda": exact, or which tensor-core mode.')

    kernel_available = property(lambda self: self.kernel.startswith("usable"),
                                doc="Whether the numba_cuda kernels can run these inputs.")
    kernel_reason = property(lambda self: self.kernel.partition(" (")[2][:-1],
                             doc="Why the numba_cuda kernels can or cannot run them.")
    kernel = _detail("numba_cuda kernel", "Their verdict: usable (why), or not usable (why).")

    def __str__(self) -> str:
        shapes = ", ".join(f"{k} {v}" for k, v in self.shape.items())
        lines = [f"implementation: {self.implementation}"]
        lines += [f"module: {self.module}"] if self.module else []
        lines += [f"reason: {self.reason}",
                  f"inputs: {self.library} arrays on {self.device}, dtype {self.dtype} "
                  f"(computed in {self.compute_dtype}); {shapes}",
                  f"score matrix: {mib(self.score_bytes)} (budget {mib(self.score_budget)})"]
        lines += [f"{label}: {text}" for label, text in self.details.items()]
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


def mib(n: int) -> str:
    """A byte count for people: KiB below 1 MiB, else MiB."""
    return f"{n / 2**10:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"
