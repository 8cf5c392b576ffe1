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
                       "segment_ids"})
    MODULE = f"{__name__}.forward"

    def supports(self, problem: Any, *, needs: frozenset[str] = frozenset()) -> str | None:
        """Why the NumPy fast path cannot run this call (``None``: it can)."""
        rules = problem.rules
        if rules.segments is not None and rules.segment_keys is None:
            return ("it lowers segment ids sorted in every row (packed sequences) as key "
                    "ranges, and these are not sorted")
        lib = library_name(problem.xp)
        if lib == "numpy":
            return None
        if not problem.torch_cpu:
            return (f"it takes NumPy arrays and torch CPU tensors (as NumPy views); these are "
                    f"{lib} arrays")
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
        return {"module": self.MODULE, "reason": where}


#: The protocol object of this family.
FAST_PATH = FastPath()
