"""The NumPy fast path (``"chunked"`` on NumPy arrays): blocks on a thread pool.

It runs on NumPy arrays, and on torch CPU tensors through NumPy views of them
(:mod:`polyattn._autograd` makes the views and wraps its backward pass for
torch autograd). The family's modules :mod:`.forward` and :mod:`.backward`
hold the names ``forward`` and ``backward`` of this package, so its
:class:`polyattn.backends.Backend` is the object :data:`FAST_PATH`; it imports
those modules only inside its methods.
"""

from __future__ import annotations

import importlib
from typing import Any

from polyattn._interop import library_name


class FastPath:
    """The NumPy fast path as a :class:`polyattn.backends.Backend`."""

    NAME = "chunked"
    DIFFERENTIATED = "autograd"
    HOST = True
    #: The score rules it handles (named one by one: see polyattn.backends.Backend).
    RULES = frozenset({"causal", "window", "key_lengths", "softcap", "alibi", "dropout",
                       "segment_ids", "score_mod", "mask_mod"})
    MODULE = f"{__name__}.forward"

    def supports(self, problem: Any, *, needs: frozenset[str] = frozenset()) -> str | None:
        """Why the NumPy fast path cannot run this call (``None``: it can)."""
        lib = library_name(problem.xp)
        if lib == "numpy":
            return None
        if not problem.torch_cpu:
            return (f"it takes NumPy arrays and torch CPU tensors (as NumPy views); these are "
                    f"{lib} arrays")
        if problem.rules.user is not None:
            return ("it calls score_mod and mask_mod on NumPy arrays, and on torch tensors "
                    "they are called on torch tensors (where autograd differentiates them "
                    "and their mod_args)")
        constant = problem.constant_needing_grad if "autograd" in needs else None
        if constant is not None:
            return (f"`{constant}` requires a gradient, which the NumPy fast path "
                    "(numpy_chunked) does not give")
        return None

    def forward(self, problem: Any) -> tuple[Any, Any]:
        return importlib.import_module(self.MODULE).attention(  # type: ignore[no-any-return]
            problem.q, problem.k, problem.v, **problem.arguments())

    def backward(self, problem: Any, out: Any, lse: Any, grad_out: Any,
                 grad_lse: Any) -> tuple[Any, Any, Any]:
        return importlib.import_module(self.MODULE).backward(  # type: ignore[no-any-return]
            problem.q, problem.k, problem.v, out, lse, grad_out, grad_lse=grad_lse,
            **problem.arguments())

    def describe(self, problem: Any) -> dict[str, str]:
        where = ("on torch CPU tensors it runs the multi-threaded blocked NumPy path "
                 "(numpy_chunked) over NumPy views of them" if problem.torch_cpu else
                 "on NumPy arrays it runs the multi-threaded blocked path (numpy_chunked)")
        lines = {"module": self.MODULE, "reason": where}
        user = problem.rules.user
        if user is not None:
            lines["numpy_chunked rules"] = _user_rules(problem.rules)
        return lines


def _user_rules(rules: Any) -> str:
    """How the NumPy fast path applies a call's ``score_mod`` and ``mask_mod`` (for explain())."""
    parts = []
    if rules.user.score_mod is not None:
        parts.append("score_mod called on each tile of scores it computes (NumPy index "
                     "arrays broadcast to the tile)")
    if rules.user.mask_mod is not None:
        blocks = rules.blocks
        if blocks is None:
            parts.append("mask_mod called on every tile (no block mask)")
        else:
            c = blocks.counts
            parts.append(f"mask_mod called on the partial tiles of its block mask only "
                         f"({c['partial']} partial of {sum(c.values())} tiles of "
                         f"{tuple(blocks.block)}); its {c['empty']} empty tiles are not "
                         f"computed and its {c['full']} full ones not masked")
    return "; ".join(parts)


#: The protocol object of this family.
FAST_PATH = FastPath()
