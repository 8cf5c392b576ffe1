"""Attention in Array-API calls only: ``"reference"`` and the blocked ``"chunked"``.

Two implementations, so two :class:`polyattn.backends.Backend` objects:
:data:`REFERENCE` (:mod:`.reference`, the formula) and :data:`CHUNKED`
(:mod:`.blocked`, an online softmax over key blocks). Both run on every
library, and its autodiff (torch, JAX) differentiates them.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArrayApiPath:
    """One Array-API implementation: its name and the module below this package."""

    NAME: str
    module: str
    DIFFERENTIATED: str = "library"
    HOST: bool = False
    #: The score rules it handles (named one by one: see polyattn.backends.Backend).
    RULES = frozenset({"causal", "window", "key_lengths", "softcap", "alibi", "dropout",
                       "segment_ids", "score_mod", "mask_mod"})

    def _code(self) -> Any:
        name = f"{__name__}.{self.module}"
        return sys.modules.get(name) or importlib.import_module(name)

    def settings(self) -> tuple[Any, ...]:
        """What besides the call shapes the operations it runs: the blocked path's block
        sizes (read at each call, so that they can be changed)."""
        code = self._code()
        return (getattr(code, "BLOCK_Q", None), getattr(code, "BLOCK_K", None))

    def supports(self, problem: Any, *, needs: frozenset[str] = frozenset()) -> str | None:
        """Always ``None``: every call runs, on every library."""
        return None

    def forward(self, problem: Any) -> tuple[Any, Any]:
        return self._code().attention(  # type: ignore[no-any-return]
            problem.q, problem.k, problem.v, **problem.arguments())

    def backward(self, problem: Any, out: Any, lse: Any, grad_out: Any,
                 grad_lse: Any) -> tuple[Any, Any, Any]:
        return self._code().backward(  # type: ignore[no-any-return]
            problem.q, problem.k, problem.v, out, lse, grad_out, grad_lse=grad_lse,
            **problem.arguments())

    def describe(self, problem: Any) -> dict[str, str]:
        lines = {"module": f"{__name__}.{self.module}"}
        constant = problem.constant_needing_grad if self.NAME == "chunked" else None
        if constant is not None and problem.torch_cpu:
            lines["reason"] = (f"`{constant}` requires a gradient, which the NumPy fast path "
                               "(numpy_chunked) does not give, so the Array-API blocked path "
                               "runs on the torch tensors and autograd differentiates it")
        return lines


#: ``"reference"``: the formula, the score matrix materialised.
REFERENCE = ArrayApiPath("reference", "reference")
#: ``"chunked"`` on libraries other than NumPy: key blocks and an online softmax.
CHUNKED = ArrayApiPath("chunked", "blocked")

# imported now (polyattn's own code only): the first call that TorchDynamo traces
# (torch.compile(fullgraph=True)) cannot import them
for _path in (REFERENCE, CHUNKED):
    _path._code()


def weights(problem: Any) -> Any:
    """The attention weights (B…, H, Tq, Tk) by the formula (:func:`polyattn.attention_weights`),
    the sinks' share of each row left out (:func:`polyattn.rules.sinks.share`).

    A rule the formula does not apply is refused, as the dispatcher refuses it elsewhere."""
    from polyattn.backends.array_api import reference

    missing = sorted(problem.rules.in_use() - REFERENCE.RULES)
    if missing:
        raise ValueError(f"attention_weights cannot apply {' or '.join(missing)}")

    if problem.sinks is None:
        return reference.weights(problem.q, problem.k, **problem.arguments())
    from polyattn.rules import sinks

    alpha, lse = reference.weights_and_lse(problem.q, problem.k, **problem.arguments())
    return alpha * sinks.share(lse, problem.sinks, problem.xp)[..., None]


def mod_args_gradients(problem: Any, out: Any, lse: Any, grad_out: Any,
                       grad_lse: Any) -> list[Any]:
    """The gradients of the call's floating ``mod_args`` arrays, in order (:mod:`.tables`),
    whichever implementation gave those of query, key and value."""
    from polyattn.backends.array_api import tables

    if not tables.floating(problem.rules, problem.xp):
        return []
    return tables.gradients(problem.q, problem.k, problem.v, out, lse, grad_out,  # type: ignore[no-any-return]
                            grad_lse=grad_lse, **problem.arguments())
