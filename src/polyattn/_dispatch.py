"""Choosing an implementation: what ``implementation="auto"`` does, and why.

The rule (DESIGN §5), a preference list walked in order: torch and JAX
arrays go to ``"native"`` (the library's own fused attention) where it
expresses the call exactly; arrays on a CUDA device with a working Numba
CUDA kernel go to ``"numba_cuda"`` (for torch tensors that require
gradients, through a ``torch.autograd.Function`` whose backward pass is the
kernel's, unless ``attn_mask`` or ``alibi_slopes`` require one too);
otherwise ``"reference"`` while the score matrix fits the score budget, else
``"chunked"`` — on NumPy arrays ``"numba_cpu"`` (the fused Numba kernel) in its
place where Numba is installed and the kernel can run the call
(:data:`NUMPY_BLOCKED_PREFERENCE`; ``POLYATTN_NUMBA_CPU=0`` turns that off). On
torch CPU tensors ``"chunked"`` runs the NumPy fast path over NumPy views of
them (differentiable the same way), except while ``torch.compile`` traces.

The budget is :data:`SCORE_BUDGET_BYTES` (64 MiB, a memory bound) for every
namespace but NumPy. On NumPy arrays ``"chunked"`` runs
:mod:`polyattn.backends.numpy.forward`, the multi-threaded blocked
path, so NumPy uses the smaller :data:`NUMPY_SCORE_BUDGET_BYTES`, near the
crossover measured between the two. The environment variable
``POLYATTN_SCORE_BUDGET`` (bytes) overrides both: a large value keeps the
reference path, ``0`` always streams. ``explain()`` states these rules; the
speed figures behind them, each with the machine it was measured on, are in
``benchmarks/results/`` (they differ between machines).
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from polyattn import _autograd
from polyattn._interop import device_of, library_name
from polyattn._problem import Problem
from polyattn.backends.native import fused as native

#: Largest score matrix (bytes, in the compute dtype) that ``"auto"`` lets the
#: reference path materialise; above it the chunked path runs. Override with the
#: ``POLYATTN_SCORE_BUDGET`` environment variable (bytes).
SCORE_BUDGET_BYTES = 64 * 2**20
#: The same for NumPy arrays, where ``"chunked"`` is the NumPy fast path: the
#: measured crossover (float32 and float64, 2 cores) lies between score matrices of
#: 16 KiB (reference 0.14 ms, blocked 0.19 ms) and 64 KiB (reference 24 ms once
#: OpenBLAS splits its product over threads, blocked 0.22 ms).
NUMPY_SCORE_BUDGET_BYTES = 32 * 2**10
#: On NumPy arrays above the score budget, "auto" takes the first of these that can run the
#: call: the fused Numba kernel calls no BLAS and was faster than the NumPy fast path in most
#: cases recorded in ``benchmarks/results/`` (cpu-*.md, contention-*.md, each naming its machine).
NUMPY_BLOCKED_PREFERENCE = ("numba_cpu", "chunked")


def _numba_cpu_first() -> bool:
    """Whether :data:`NUMPY_BLOCKED_PREFERENCE` puts numba_cpu ahead of the NumPy fast path."""
    order = list(NUMPY_BLOCKED_PREFERENCE)
    return "numba_cpu" in order and ("chunked" not in order or
                                     order.index("numba_cpu") < order.index("chunked"))


def score_budget(xp: Any = None) -> int:
    """The score-matrix budget in bytes for namespace ``xp`` (environment override included).

    ``POLYATTN_SCORE_BUDGET`` wins when set; otherwise NumPy arrays get
    :data:`NUMPY_SCORE_BUDGET_BYTES` and every other namespace (or ``xp=None``)
    :data:`SCORE_BUDGET_BYTES`.
    """
    env = os.environ.get("POLYATTN_SCORE_BUDGET")
    if env:
        usage = ("POLYATTN_SCORE_BUDGET must be a finite number of bytes >= 0 (the "
                 "largest score matrix materialised whole, e.g. 1e6; 0 streams every call)")
        try:
            value = float(env)
        except ValueError as exc:
            raise ValueError(f"{usage}; got {env!r}") from exc
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{usage}; got {env!r}")
        return int(value)
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
    #: For ``"distributed"``: the task plan (chunks, tile and merge tasks).
    plan: str = ""
    #: For ``"numba_cpu"``: whether its compiled kernel is ready (in memory, cached, or not).
    compiled: str = ""
    #: For ``"numba_cpu"``: the SIMD vectors and register tiles its products run in.
    tiles: str = ""
    #: For ``"numba_cuda"``: the arithmetic of its products (exact, or which tensor-core mode).
    arithmetic: str = ""

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
        if self.plan:
            lines.append(f"plan: {self.plan}")
        if self.compiled:
            lines.append(f"numba_cpu kernel: {self.compiled}")
        if self.tiles:
            lines.append(f"numba_cpu tiles: {self.tiles}")
        if self.arithmetic:
            lines.append(f"arithmetic: {self.arithmetic}")
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
    return importlib.import_module("polyattn.backends.cuda.rows")


def kernel_status(problem: Problem) -> tuple[bool, str]:
    """(usable, reason) for the Numba CUDA kernel on these inputs."""
    simulator = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    if not is_cuda(problem) and not simulator:
        return False, f"inputs are {library_name(problem.xp)} arrays on the CPU, not CUDA arrays"
    try:
        module = load_kernel_module()
    except ImportError as exc:
        return False, f"numba-cuda is not installed ({exc})"
    if simulator and torch_cpu(problem):
        usable, why = module.availability(None, ())
        if usable:
            why = ("the Numba CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1): torch CPU "
                   "tensors run through NumPy views of them, slowly; for testing")
        return usable, why
    return module.availability(problem.xp, (problem.q, problem.k, problem.v))


def torch_cpu(problem: Problem) -> bool:
    """Whether the inputs are plain torch tensors on the CPU, outside compiler tracing.

    Such tensors can be viewed as NumPy arrays without a copy, so the paths
    written for NumPy (its fast path, the kernel on the simulator) can run on them.
    """
    if library_name(problem.xp) != "torch":
        return False
    import torch

    if torch.compiler.is_compiling():
        return False
    functorch = getattr(torch._C, "_functorch", None)
    for x in (problem.q, problem.k, problem.v, problem.mask):
        if x is None:
            continue
        if type(x) is not torch.Tensor or x.device.type != "cpu" or x.is_sparse:
            return False
        if functorch is not None and functorch.is_functorch_wrapped_tensor(x):
            return False
    return True


def constant_needs_grad(problem: Problem) -> str | None:
    """The argument among ``attn_mask`` and ``alibi_slopes`` that torch records a gradient for.

    The fused backward passes give gradients for query, key and value only.
    """
    if not problem.requires_grad:
        return None
    alibi = None if problem.rules is None else problem.rules.alibi
    for name, x in (("attn_mask", problem.mask), ("alibi_slopes", alibi)):
        if x is not None and getattr(x, "requires_grad", False):
            return name
    return None


def bridged(problem: Problem, name: str) -> bool:
    """Whether implementation ``name`` runs on NumPy views of the problem's torch CPU tensors."""
    if name not in ("chunked", "numba_cuda") or not torch_cpu(problem):
        return False
    return name == "numba_cuda" or constant_needs_grad(problem) is None


#: The module that runs each implementation.
MODULES = {"reference": "polyattn.backends.array_api.reference",
           "chunked": "polyattn.backends.array_api.blocked",
           "numpy_chunked": "polyattn.backends.numpy.forward",
           "native": "polyattn.backends.native.fused",
           "numba_cpu": "polyattn.backends.numba_cpu.launch",
           "numba_cuda": "polyattn.backends.cuda.rows",
           "distributed": "polyattn.backends.dask.plan"}


def module_name(name: str, xp: Any = None, problem: Problem | None = None) -> str:
    """The module that runs implementation ``name`` on namespace ``xp`` (for ``problem``)."""
    if problem is not None and name == "chunked" and bridged(problem, name):
        return "polyattn.backends.numpy.forward"
    if name == "native" and xp is not None:
        return {"torch": "torch.nn.functional.scaled_dot_product_attention",
                "jax": "jax.nn.dot_product_attention"}.get(library_name(xp),
                                                           "polyattn.backends.native.fused")
    if name == "chunked" and xp is not None and is_numpy(xp):
        name = "numpy_chunked"
    return MODULES[name]


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
    name = _budget_name(numpy)
    if score_bytes <= budget:
        if numpy:
            return "reference", (
                f"the {_mib(score_bytes)} score matrix fits the {_mib(budget)} budget "
                f"for NumPy arrays ({name}), so it is materialised")
        return "reference", (f"the {_mib(score_bytes)} score matrix fits the {_mib(budget)} "
                             f"budget ({name}), so it is materialised")
    if numpy:
        return "chunked", (
            f"the {_mib(score_bytes)} score matrix exceeds the {_mib(budget)} budget "
            f"for NumPy arrays ({name}), so the multi-threaded blocked NumPy path "
            "(numpy_chunked) streams keys in blocks with an online softmax")
    return "chunked", (f"the {_mib(score_bytes)} score matrix exceeds the {_mib(budget)} "
                       f"budget ({name}), so keys are streamed in blocks with an online "
                       "softmax")


def _budget_name(numpy: bool) -> str:
    """Where the budget comes from, for people: the setting or the named constant."""
    if os.environ.get("POLYATTN_SCORE_BUDGET"):
        return "set by POLYATTN_SCORE_BUDGET"
    constant = "NUMPY_SCORE_BUDGET_BYTES" if numpy else "SCORE_BUDGET_BYTES"
    return f"{constant}; POLYATTN_SCORE_BUDGET sets another"


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


def choose(problem: Problem, requested: str, *, return_lse: bool = False,
           for_vjp: bool = False) -> Explanation:
    """Decide which implementation runs; raise if a requested one cannot.

    ``"auto"`` walks the preference list native → numba_cuda → distributed →
    reference / numba_cpu / chunked (by the score budget; numba_cpu in place of
    chunked on NumPy arrays where it can run and its products run whole) and
    takes the first that can run the call;
    every candidate's verdict is kept in :attr:`Explanation.candidates`.
    ``for_vjp``: the choice for :func:`polyattn.attention_vjp`, which runs the
    implementations' own backward passes (native has none).
    """
    score_bytes = problem.score_elements * (8 if problem.compute_dtype == problem.xp.float64
                                            else 4)
    budget = score_budget(problem.xp)
    numpy = is_numpy(problem.xp)
    grad = problem.requires_grad

    # --- native: the library's own fused attention, where it maps exactly
    native_why = (native_status(problem, return_lse)
                  if requested in ("auto", "native") else "not considered")
    if for_vjp:
        native_why = ("attention_vjp runs polyattn's own backward passes, and the native "
                      "functions return no log-sum-exp for one")
    if requested == "native" and native_why is not None:
        raise ValueError(f"implementation='native' cannot run this call exactly: {native_why}")
    if requested == "auto" and native_why is None:
        native_why = _dense_mask_cost(problem, score_bytes, budget)

    # --- numba_cuda: CUDA arrays; its backward pass gives gradients of q, k, v only
    usable, kernel_reason = (False, "not considered")
    constant = None if for_vjp else constant_needs_grad(problem)
    no_backward = (f"`{constant}` requires a gradient, and the numba_cuda kernel's backward "
                   "pass gives gradients for query, key and value only, so autograd would "
                   "lose it")
    if requested in ("auto", "numba_cuda"):
        usable, kernel_reason = kernel_status(problem)
        if usable and grad and constant is not None:
            usable, kernel_reason = False, no_backward
    if requested == "numba_cuda" and not usable:
        if grad and constant is not None:
            # the gradient is the reason whatever else rules the kernel out
            besides = "" if kernel_reason == no_backward else f" (besides: {kernel_reason})"
            raise ValueError(f"implementation='numba_cuda' cannot run this call: "
                             f"{no_backward}{besides}; use implementation='auto' or detach "
                             "the inputs")
        raise RuntimeError(
            f"implementation='numba_cuda' needs CUDA arrays (CuPy or torch CUDA tensors), "
            f"a CUDA GPU and numba-cuda, or the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) "
            f"for NumPy arrays and torch CPU tensors: {kernel_reason}"
        )

    # --- numba_cpu: the fused CPU kernel, on NumPy arrays
    cpu_why: str | None = "not considered"
    if requested in ("auto", "numba_cpu"):
        cpu_why = numba_cpu_status(problem, for_vjp, by_name=requested == "numba_cpu")
    if requested == "numba_cpu" and cpu_why is not None:
        raise ValueError(f"implementation='numba_cpu' cannot run this call: {cpu_why}")

    # --- distributed: Dask arrays, one task per (query chunk, key chunk)
    plan_why: str | None = "not considered"
    if requested in ("auto", "distributed"):
        plan_why = distributed_status(problem, for_vjp)
    if requested == "distributed" and plan_why is not None:
        raise ValueError(f"implementation='distributed' cannot run this call: {plan_why}")

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
    elif plan_why is None:
        name, reason = "distributed", (
            "Dask arrays: one task per (query chunk, key chunk) on the fastest local path "
            "for its blocks, merged through the log-sum-exp, tiles no query sees left out")
    elif budget_name == "chunked" and numpy and cpu_why is None and _numba_cpu_first():
        name, reason = "numba_cpu", (
            f"the {_mib(score_bytes)} score matrix exceeds the {_mib(budget)} budget for "
            f"NumPy arrays ({_budget_name(numpy)}), and Numba is installed and its fused "
            "kernel runs the call: above the budget, 'auto' takes numba_cpu ahead of the "
            "NumPy fast path (numpy_chunked) on NumPy arrays (NUMPY_BLOCKED_PREFERENCE; "
            "POLYATTN_NUMBA_CPU=0 leaves it out)")
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
        if name == "distributed":
            candidates["distributed"] = ""
        elif name in ("native", "numba_cuda") and plan_why is None:
            candidates["distributed"] = f"{name} comes first"
        else:
            candidates["distributed"] = plan_why or "not needed"
        if name == "numba_cpu":
            candidates["numba_cpu"] = ""
        elif name in ("native", "numba_cuda", "distributed"):
            candidates["numba_cpu"] = cpu_why or f"{name} comes first"
        elif cpu_why is None and budget_name == "chunked":
            candidates["numba_cpu"] = "chunked comes first (NUMPY_BLOCKED_PREFERENCE)"
        elif cpu_why is None:
            candidates["numba_cpu"] = (
                f"the {_mib(score_bytes)} score matrix fits the {_mib(budget)} budget "
                f"({_budget_name(numpy)}), so it is materialised; the blocked paths run "
                "above it")
        else:
            candidates["numba_cpu"] = cpu_why
        for other in ("reference", "chunked"):
            if other == name:
                candidates[other] = ""
            elif name in ("native", "numba_cuda", "distributed", "numba_cpu"):
                candidates[other] = f"{name} comes first"
            else:
                candidates[other] = budget_why
    if name == "chunked" and numpy and requested != "auto":
        reason += "; on NumPy arrays it runs the multi-threaded blocked path (numpy_chunked)"
    if name == "chunked" and bridged(problem, name):
        reason += ("; on torch CPU tensors it runs the multi-threaded blocked NumPy path "
                   "(numpy_chunked) over NumPy views of them")
    elif name == "chunked" and torch_cpu(problem):
        reason += (f"; `{constant_needs_grad(problem)}` requires a gradient, which the "
                   "NumPy fast path (numpy_chunked) does not give, so the Array-API blocked "
                   "path runs on the torch tensors and autograd differentiates it")
    shape = {"query": tuple(problem.q.shape), "key": tuple(problem.k.shape)}
    if problem.v is not None:
        shape["value"] = tuple(problem.v.shape)
    return Explanation(
        implementation=name,
        reason=reason,
        library=library_name(problem.xp),
        device=str(device_of(problem.q)),
        dtype=str(problem.result_dtype),
        compute_dtype=_dtype_name(problem.compute_dtype),
        shape=shape,
        score_bytes=score_bytes,
        score_budget=budget,
        kernel_available=usable,
        kernel_reason=kernel_reason,
        module=module_name(name, problem.xp, problem),
        candidates=candidates,
        layout=problem.layout,
        features=_features(problem),
        plan=distributed_plan(problem) if name == "distributed" else "",
        compiled=numba_cpu_compiled() if name == "numba_cpu" else "",
        tiles=numba_cpu_tiles() if name == "numba_cpu" else "",
        arithmetic=cuda_arithmetic(problem) if name == "numba_cuda" else "",
    )


def _dtype_name(dtype: Any) -> str:
    """``float32`` for a dtype object or a NumPy scalar type alike."""
    return str(getattr(dtype, "__name__", dtype)).rsplit(".", 1)[-1]


def cuda_arithmetic(problem: Problem) -> str:
    """How the CUDA kernel computes this call (tensor cores or exact), for people."""
    from polyattn.backends.cuda import (
        rows as numba_cuda,
    )
    from polyattn.backends.cuda import (
        tensor_core as numba_cuda_tc,
    )
    from polyattn.backends.cuda import (
        tiled as numba_cuda_tiled,
    )

    tq, e = problem.q.shape[-2:]
    ev = e if problem.v is None else problem.v.shape[-1]
    arithmetic, how = numba_cuda_tc.choose(str(problem.result_dtype), tq, e, ev)
    if arithmetic is not None:
        return how
    if numba_cuda.kernel_choice() == "tiled" and numba_cuda_tiled.unsupported(tq) is None:
        named = {"query": problem.q, "key": problem.k, "value": problem.v}
        loads = numba_cuda.row_loads(**{n: x for n, x in named.items() if x is not None})
        return how + "; the register-tiled kernel, " + loads
    if numba_cuda.kernel_choice() == "rows":
        return how + "; the one-thread-per-row kernel (POLYATTN_CUDA_KERNEL=rows)"
    return how + "; the one-thread-per-row kernel (decoding shapes)"


def numba_cpu_setting() -> str:
    """``POLYATTN_NUMBA_CPU`` as set ("" when not), once checked (``ValueError`` otherwise)."""
    setting = os.environ.get("POLYATTN_NUMBA_CPU", "").strip()
    if setting.lower() not in ("", "1", "true", "on", "yes", "0", "false", "off", "no"):
        raise ValueError(f"POLYATTN_NUMBA_CPU must be 0/false/off/no (leave numba_cpu out of "
                         f"implementation='auto') or 1/true/on/yes; got {setting!r}")
    return setting


def numba_cpu_status(problem: Problem, for_vjp: bool = False, *,
                     by_name: bool = True) -> str | None:
    """Why the fused Numba CPU kernel cannot run this call (``None``: it can).

    ``by_name=False`` (for ``"auto"``) also honours ``POLYATTN_NUMBA_CPU=0``.
    """
    setting = numba_cpu_setting()
    if not by_name and setting.lower() in ("0", "false", "off", "no"):
        return f"turned off for implementation='auto' by POLYATTN_NUMBA_CPU={setting}"
    if not is_numpy(problem.xp):
        return (f"it takes NumPy arrays; these are {library_name(problem.xp)} arrays")
    from polyattn.backends.numba_cpu import launch as numba_cpu

    usable, why = numba_cpu.availability()
    return None if usable else why


def numba_cpu_compiled() -> str:
    """Whether the numba_cpu kernel is compiled, cached on disk, or still to compile."""
    from polyattn.backends.numba_cpu import launch as numba_cpu

    return numba_cpu.cache_state()


def numba_cpu_tiles() -> str:
    """The SIMD vectors and register tiles of the numba_cpu kernel on this CPU."""
    from polyattn.backends.numba_cpu import launch as numba_cpu

    return numba_cpu.tiles()


def distributed_status(problem: Problem, for_vjp: bool = False) -> str | None:
    """Why the Dask plan cannot run this call (``None``: it can)."""
    if library_name(problem.xp) != "dask":
        return f"inputs are {library_name(problem.xp)} arrays, not Dask arrays"
    if for_vjp:
        return ("the Dask plan has no backward pass; attention_vjp runs the Array-API "
                "blocked path on Dask arrays")
    from polyattn.backends.dask import plan as distributed

    return distributed.unavailable(problem.q, problem.k, problem.v, problem.mask,
                                   problem.rules)


def distributed_plan(problem: Problem) -> str:
    """The Dask plan's tasks for this call, in one line (built from shapes; nothing runs)."""
    from polyattn.backends.dask import plan as distributed

    rules = problem.rules
    assert rules is not None
    q, k, _ = distributed.rechunked(problem.q, problem.k, problem.v)
    return distributed.make_plan(q, k, rules, rules.lengths_at_hand).describe()


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
    if rules.dropout:
        found["dropout_p"] = f"{rules.dropout_p} (seed {rules.dropout_seed})"
    if rules.key_lengths is not None:
        found["key_lengths"] = str(tuple(rules.key_lengths.shape)) + (
            " (query positions count back from each row's length)"
            if rules.lengths_shift else "")
    return found


def _passes(problem: Problem, name: str) -> tuple[_autograd.Forward, _autograd.Backward]:
    """The forward and backward passes of implementation ``name`` for this problem."""
    if bridged(problem, name):
        import numpy

        return _autograd.numpy_bridge(load(name, numpy), problem)
    return _autograd.direct(load(name, problem.xp), problem)


def run(problem: Problem, name: str, *, grad: bool = True,
        fallback: bool = False) -> tuple[Any, Any]:
    """Call implementation ``name`` on a prepared problem.

    Paths that torch autograd cannot see through (the CUDA kernel, NumPy code
    on torch CPU tensors) are wrapped in a ``torch.autograd.Function`` when
    the inputs require gradients (``grad=False``: never). ``fallback``: where
    ``"auto"`` chose ``"numba_cpu"`` and its kernel fails to compile, run the
    NumPy fast path instead (``explain`` then says why numba_cpu is not usable).
    """
    if name == "numba_cpu" and fallback:
        from polyattn.backends.numba_cpu import launch as numba_cpu

        try:
            numba_cpu.kernels()
        except numba_cpu.KernelUnavailable:
            name = "chunked"
    forward, backward = _passes(problem, name)
    fused = name == "numba_cuda" or bridged(problem, name)
    if grad and fused and problem.requires_grad:
        generic = _autograd.direct(load("chunked", problem.xp), problem)
        return _autograd.torch_attention(problem, (forward, backward), generic)
    return forward(problem.q, problem.k, problem.v)


def run_backward(problem: Problem, name: str, out: Any, lse: Any, grad_out: Any,
                 grad_lse: Any) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of implementation ``name``, in the implementations' layout."""
    _, backward = _passes(problem, name)
    return backward(problem.q, problem.k, problem.v, out, lse, grad_out, grad_lse)
