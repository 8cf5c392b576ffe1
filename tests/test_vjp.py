"""``attention_vjp``: gradients on every backend and implementation (DESIGN §3.1, §4.1).

The pullback's gradients are checked against an oracle written without
polyattn: the §4.1 formula (scores → soft-cap → ALiBi → mask → visibility →
softmax → dropout → ·V) written in float64 torch operations and
differentiated by torch autograd (:func:`formula`), where torch is importable
(the numpy and torch sessions). Where it is not (the JAX, Dask and
array-api-strict sessions), the oracle is ``attention_vjp(...,
implementation="reference")`` on float64 NumPy arrays, that is
``reference.backward``, which :func:`test_numpy_reference_matches_the_formula`
holds to the torch formula in the numpy and torch sessions (≤ 1e-12).

Relative error (‖g − g_ref‖ / ‖g_ref‖): ≤ 1e-10 in float64, ≤ 1e-4 in float32,
≤ 2e-3 in float16, against the float64 oracle of the rounded inputs. Besides:
central finite differences, properties that need no oracle (zero gradients
where no query looks, permutations, linearity, no side effects), agreement
with ``scaled_dot_product_attention``'s forward pass, torch's ``gradcheck``
through the NumPy fast path on CPU tensors, and ``jax.grad`` against
``jax.nn.dot_product_attention``.

"chunked" on NumPy arrays (and on torch CPU tensors) is the NumPy fast path
and its blocked backward pass; its blocks, and those of the Array-API
"chunked", are made tiny so that a handful of queries and keys crosses them.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from _support import NUMPY_SESSION_ONLY, rounded, use_implementation
from helpers import (
    Backend,
    assert_namespace_device,
    ref_attention,
    ref_scores,
    rel_error,
    selected_backends,
    to_numpy,
    to_xp,
)

import polyattn
from polyattn.backends.array_api import blocked as chunked
from polyattn.rules import dropout as _dropout

IMPLEMENTATIONS = ("reference", "chunked", "auto")
#: Tests on NumPy arrays alone run in the session that selects NumPy.
NUMPY_ONLY = NUMPY_SESSION_ONLY
#: Gradient tolerance by dtype, against the float64 oracle of the rounded inputs.
GRAD_TOL = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-3}
HAS_TORCH = importlib.util.find_spec("torch") is not None


# --------------------------------------------------------------------------- #
# Cases: NumPy float64 arrays in the caller's layout and the keywords
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Case:
    """An ``attention_vjp`` call: query, key, value, an optional mask and keywords.

    Keywords hold NumPy arrays (slopes, key lengths) where the call takes arrays.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def with_(self, **changes: Any) -> Case:
        fields = {"q": self.q, "k": self.k, "v": self.v, "mask": self.mask,
                  "options": dict(self.options)}
        options = changes.pop("options", {})
        fields.update(changes)
        fields["options"].update(options)
        return Case(**fields)


def _make_cases() -> dict[str, Case]:
    rng = np.random.default_rng(20250612)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape)

    q, k, v = normal(2, 2, 5, 4), normal(2, 2, 7, 4), normal(2, 2, 7, 3)
    bool_mask = rng.random((2, 1, 5, 7)) < 0.6                      # broadcast over heads
    bool_mask[..., 0] = True
    float_mask = np.where(rng.random((5, 7)) < 0.25, -np.inf, normal(5, 7))
    float_mask[:, 1] = normal(5)
    cases = {"plain": Case(q, k, v)}
    for alignment in ("top_left", "bottom_right"):
        for label, tq, tk in (("tq<tk", 5, 7), ("tq=tk", 6, 6), ("tq>tk", 7, 5)):
            cases[f"causal_{alignment}_{label}"] = Case(
                normal(2, 2, tq, 4), normal(2, 2, tk, 4), normal(2, 2, tk, 3),
                options={"is_causal": True, "causal_alignment": alignment})
    cases |= {
        "bool_mask": Case(q, k, v, mask=bool_mask),
        "float_mask": Case(q, k, v, mask=float_mask, options={"is_causal": True}),
        "window": Case(q, k, v, options={"window": (2, 1)}),
        "window_causal": Case(q, k, v, options={"window": (2, 0), "is_causal": True,
                                                "causal_alignment": "bottom_right"}),
        "softcap": Case(3 * q, k, v, options={"softcap": 1.5}),
        "alibi": Case(q, k, v, options={"alibi_slopes": rng.uniform(0.1, 1.0, (2, 2))}),
        "key_lengths": Case(q, k, v, options={"key_lengths": np.array([7, 3])}),
        "key_lengths_bottom_right": Case(q, k, v, options={
            "key_lengths": np.array([6, 3]), "is_causal": True,
            "causal_alignment": "bottom_right"}),
        "gqa": Case(normal(2, 4, 5, 4), k, v, options={"enable_gqa": True, "is_causal": True}),
        # key with fewer batch dimensions, value with a stretched one: both gradients summed
        "broadcast_batch": Case(normal(3, 2, 2, 5, 4), normal(2, 2, 7, 4),
                                normal(1, 2, 2, 7, 3), options={"is_causal": True}),
        "matrix": Case(normal(5, 4), normal(7, 4), normal(7, 3),
                       options={"is_causal": True, "causal_alignment": "bottom_right"}),
        "bthe": Case(normal(2, 5, 2, 4), normal(2, 7, 2, 4), normal(2, 7, 2, 3),
                     options={"layout": "BTHE", "is_causal": True}),
        "dropout": Case(q, k, v, options={"dropout_p": 0.3, "dropout_seed": 1234}),
        "dropout_gqa_causal": Case(normal(2, 4, 5, 4), k, v, options={
            "enable_gqa": True, "is_causal": True, "dropout_p": 0.5,
            "dropout_seed": 2**40 + 17}),
    }
    # every feature at once, with fully masked rows (row 1 of batch 1, and batch 2 of the
    # second lengths row, whose queries all sit before the window)
    every_mask = rng.random((2, 1, 6, 9)) < 0.7
    every_mask[1, 0, 1] = False
    cases["everything"] = Case(
        normal(2, 4, 6, 4), normal(2, 2, 9, 4), normal(2, 2, 9, 3), mask=every_mask,
        options={"enable_gqa": True, "is_causal": True, "causal_alignment": "bottom_right",
                 "window": (3, 0), "softcap": 2.0,
                 "alibi_slopes": rng.uniform(0.1, 0.8, 4), "key_lengths": np.array([9, 4]),
                 "dropout_p": 0.2, "dropout_seed": 99})
    # rows that see no key: masked out, before key 0 (bottom-right, Tq > Tk), a length 0
    dead_mask = rng.random((3, 1, 7, 5)) < 0.7
    dead_mask[0, 0, 2] = False
    cases["fully_masked"] = Case(
        normal(3, 2, 7, 4), normal(3, 2, 5, 4), normal(3, 2, 5, 3), mask=dead_mask,
        options={"is_causal": True, "causal_alignment": "bottom_right",
                 "key_lengths": np.array([5, 0, 3])})
    return cases


CASES = _make_cases()
#: Every case in float64; float32 for those that reach the most code.
CASE_DTYPES = [(n, "float64") for n in CASES] + [
    (n, "float32") for n in ("plain", "causal_bottom_right_tq>tk", "float_mask", "gqa",
                             "broadcast_batch", "bthe", "dropout_gqa_causal", "everything")]


#: JAX compiles every operation (or, under ``jax.jit``, every program) and Dask builds a
#: task graph for every call, so there a representative part of this file runs: every
#: feature at once, the layouts, broadcasting, fully masked rows, float32 and float16;
#: the other cases run the same Array-API code on NumPy, torch and array-api-strict.
SLOW_BACKENDS = (Backend.JAX, Backend.DASK)
SLOW_RUNS = {("broadcast_batch", "float64"), ("bthe", "float32"), ("matrix", "float64"),
             ("everything", "float64"), ("everything", "float32"), ("fully_masked", "float64"),
             ("everything", "lse"), ("everything", "float16"), ("everything", "out_lse")}


def thin(backend: Backend, implementation: str, run: tuple[str, str] | None = None) -> None:
    """On JAX and Dask, skip what :data:`SLOW_RUNS` leaves out, and "auto" but once."""
    if backend not in SLOW_BACKENDS:
        return
    if implementation == "auto" and run != ("everything", "float64"):
        pytest.skip(f"on {backend.value} 'auto' runs 'reference' at these sizes; it is checked "
                    "once here, on the case with every feature")
    if run is not None and run not in SLOW_RUNS:
        pytest.skip(f"{backend.value} runs the representative cases of SLOW_RUNS; this one runs "
                    "the same Array-API code on NumPy, torch and array-api-strict")


def cotangent(case: Case, seed: int = 1) -> np.ndarray:
    """A random ``grad_out`` with the shape of the case's output."""
    q, k, v = case.q, case.k, case.v
    if case.options.get("layout") == "BTHE" or case.options.get("enable_gqa"):
        batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        shape = (*batch, *q.shape[-3:-1], v.shape[-1])      # (B…, Tq, H, Ev) for "BTHE"
    else:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        shape = (*lead, q.shape[-2], v.shape[-1])
    return np.random.default_rng(seed).standard_normal(shape)


def lse_cotangent(case: Case, seed: int = 2) -> np.ndarray:
    """A random ``grad_lse`` (B…, H, Tq)."""
    g = cotangent(case)
    shape = g.shape[:-1]
    if case.options.get("layout") == "BTHE":
        shape = (*shape[:-2], shape[-1], shape[-2])
    return np.random.default_rng(seed).standard_normal(shape)


# --------------------------------------------------------------------------- #
# The oracle: §4.1 in float64 torch operations, differentiated by autograd
# --------------------------------------------------------------------------- #

def keep_mask(shape: tuple[int, ...], p: float, seed: int) -> np.ndarray:
    """§4.1's dropout keep-mask of a (B…, H, Tq, Tk) score matrix, from the NumPy Philox.

    Element ``(b…, h, i, j)`` has the flat index ``n`` of a row-major array.
    """
    n = np.arange(math.prod(shape), dtype=np.uint64).reshape(shape)
    x0 = _dropout.philox_numpy(n & np.uint64(0xFFFFFFFF), n >> np.uint64(32), 0, 0, seed)[0]
    return x0 >= np.uint64(_dropout.threshold(p))


def formula(torch: Any, q: Any, k: Any, v: Any, *, attn_mask: Any = None,
            is_causal: bool = False, causal_alignment: str = "top_left",
            scale: float | None = None, enable_gqa: bool = False, layout: str = "BHTE",
            window: Any = None, softcap: float | None = None, alibi_slopes: Any = None,
            key_lengths: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
            ) -> tuple[Any, Any]:
    """(out, lse) of §4.1 in torch operations; q, k, v torch float64 tensors.

    A float ``attn_mask`` may be a torch tensor (then it can require a
    gradient); a boolean one is a NumPy array. ALiBi, visibility and boolean
    masks are constants, taken from :func:`helpers.ref_scores` of zero
    queries and keys (scores 0, so only the bias and the ``-inf`` remain).
    """
    if layout == "BTHE":
        q, k, v = (x.transpose(-3, -2) for x in (q, k, v))    # (B…, H, T, E)
    matrix = q.ndim == 2
    if matrix:
        q, k, v = q[None], k[None], v[None]                    # (1, T, E)
    h = max(q.shape[-3], k.shape[-3])
    if enable_gqa:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    tq, tk = q.shape[-2], k.shape[-2]
    batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    shape = (*batch, h, tq, tk)
    lengths = np.broadcast_to(tk if key_lengths is None else np.asarray(key_lengths), batch)
    present = torch.tensor(np.arange(tk)[:, None] < lengths[..., None, None, None])
    k = torch.where(present, k, 0.0)                   # (B…, 1, Tk, 1): padding zeroed, NaN
    v = torch.where(present, v, 0.0)                   # there cannot reach a gradient
    float_mask = attn_mask is not None and not (isinstance(attn_mask, np.ndarray)
                                                and attn_mask.dtype == bool)
    const = ref_scores(np.zeros((*batch, h, tq, 1)), np.zeros((*batch, h, tk, 1)),
                       mask=None if float_mask else attn_mask, is_causal=is_causal,
                       alignment=causal_alignment, window=window, alibi_slopes=alibi_slopes,
                       key_lengths=None if key_lengths is None else lengths)
    const = torch.tensor(np.broadcast_to(const, shape).copy())
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale          # (B…, H, Tq, Tk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if float_mask:
        s = s + (attn_mask if torch.is_tensor(attn_mask) else torch.tensor(attn_mask))
    s = torch.where(torch.isneginf(const), -math.inf, s + torch.where(
        torch.isneginf(const), 0.0, const))
    m = s.amax(dim=-1, keepdim=True).detach()                 # a shift: no gradient needed
    m = torch.where(torch.isneginf(m), 0.0, m)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    seen = l > 0
    w = torch.where(seen, p / torch.where(seen, l, 1.0), 0.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), -math.inf)[..., 0]
    if dropout_p:
        keep = torch.tensor(keep_mask(shape, dropout_p, dropout_seed))
        w = w * keep / (1.0 - dropout_p)
    out = torch.matmul(w, v)                                   # (B…, H, Tq, Ev)
    if layout == "BTHE":
        out = out.transpose(-3, -2)                            # (B…, Tq, H, Ev)
    if matrix:
        out, lse = out[0], lse[0]
    return out, lse


def rounded_case(case: Case, dtype_name: str) -> Case:
    """The case as the library sees it in ``dtype_name`` (float arrays rounded)."""
    options = dict(case.options)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = rounded(options["alibi_slopes"], dtype_name)
    mask = case.mask
    if mask is not None and mask.dtype != bool:
        mask = rounded(mask, dtype_name)
    return Case(*(rounded(a, dtype_name) for a in (case.q, case.k, case.v)), mask=mask,
                options=options)


def formula_vjp(case: Case, g: np.ndarray, g_lse: np.ndarray | None = None,
                ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """float64 (out, lse, [dq, dk, dv]) of ⟨out, g⟩ + ⟨lse, g_lse⟩ by torch autograd."""
    import torch

    xs = [torch.tensor(a, requires_grad=True) for a in (case.q, case.k, case.v)]
    out, lse = formula(torch, *xs, attn_mask=case.mask, **case.options)
    loss = (out * torch.tensor(g)).sum()
    if g_lse is not None:
        loss = loss + torch.where(torch.isneginf(lse), 0.0, lse * torch.tensor(g_lse)).sum()
    grads = torch.autograd.grad(loss, xs)
    return out.detach().numpy(), lse.detach().numpy(), [x.numpy() for x in grads]


def numpy_reference_vjp(case: Case, g: np.ndarray, g_lse: np.ndarray | None = None,
                        ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The same from ``reference.backward`` on float64 NumPy arrays."""
    (out, lse), pullback = polyattn.attention_vjp(
        case.q, case.k, case.v, attn_mask=case.mask, implementation="reference",
        return_lse=True, **case.options)
    return out, lse, list(pullback(g, g_lse))


def oracle(case: Case, g: np.ndarray, g_lse: np.ndarray | None = None, *,
           dtype_name: str = "float64") -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """float64 (out, lse, gradients) of the rounded case: the torch formula where torch is
    importable, else the NumPy reference (held to the formula where torch is)."""
    case = rounded_case(case, dtype_name)
    g = rounded(g, dtype_name)
    g_lse = None if g_lse is None else rounded(g_lse, dtype_name)
    return (formula_vjp if HAS_TORCH else numpy_reference_vjp)(case, g, g_lse)


# --------------------------------------------------------------------------- #
# Running polyattn and comparing
# --------------------------------------------------------------------------- #

@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, backend, monkeypatch):
    """Each implementation, with blocks small enough to be crossed (whole on JAX and Dask,
    where every block shape costs a compilation or a task graph)."""
    name = use_implementation(request.param, backend, monkeypatch)
    if backend is Backend.DASK:
        monkeypatch.setattr(chunked, "BLOCK_Q", 16)
        monkeypatch.setattr(chunked, "BLOCK_K", 16)
    return name


def on_backend(case: Case, xp: Any, device: Any, dtype_name: str) -> tuple[list[Any], dict]:
    """(query, key, value) and keywords in ``xp``: floats in ``dtype_name``."""
    arrays = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (case.q, case.k, case.v)]
    options = {}
    for name, value in {**case.options, "attn_mask": case.mask}.items():
        if isinstance(value, np.ndarray):
            value = to_xp(value, xp, dtype=dtype_name if value.dtype.kind == "f" else None,
                          device=device)
        options[name] = value
    return arrays, options


def run_vjp(xp: Any, device: Any, dtype_name: str, implementation: str, case: Case,
            g: np.ndarray, g_lse: np.ndarray | None = None, **extra: Any,
            ) -> tuple[Any, list[Any], list[Any]]:
    """(result, [dq, dk, dv], inputs) of polyattn on the case in ``xp``.

    On JAX the forward pass and the pullback run under one ``jax.jit`` (one
    compilation instead of one per operation; and attention_vjp must trace).
    """
    arrays, options = on_backend(case, xp, device, dtype_name)
    go = to_xp(g, xp, dtype=dtype_name, device=device)
    gl = None if g_lse is None else to_xp(g_lse, xp, dtype=dtype_name, device=device)

    def both(q: Any, k: Any, v: Any, go: Any, gl: Any) -> tuple[Any, tuple[Any, ...]]:
        result, pullback = polyattn.attention_vjp(q, k, v, implementation=implementation,
                                                  **options, **extra)
        return result, pullback(go, gl) if gl is not None else pullback(go)

    if "jax" in type(arrays[0]).__module__:
        import jax

        both = jax.jit(both)
    result, grads = both(*arrays, go, gl)
    return result, list(grads), arrays


def jitted(f: Any, arrays: list[Any]) -> Any:
    """``f`` under ``jax.jit`` for JAX arrays (one compilation, not one per operation)."""
    if "jax" not in type(arrays[0]).__module__:
        return f
    import jax

    return jax.jit(f)


def vjp(arrays: list[Any], **options: Any) -> tuple[Any, Any]:
    """``attention_vjp(*arrays, **options)``; on JAX, result and pullback under ``jax.jit``."""
    if "jax" not in type(arrays[0]).__module__:
        return polyattn.attention_vjp(*arrays, **options)
    result = jitted(lambda *a: polyattn.attention_vjp(*a, **options)[0], arrays)(*arrays)
    pull = jitted(lambda a, g: polyattn.attention_vjp(*a, **options)[1](g), arrays)
    return result, lambda g: pull(arrays, g)


def assert_grads(grads: list[Any], ref: list[np.ndarray], inputs: list[Any], xp: Any,
                 device: Any, tol: float) -> None:
    """Each gradient: the input's namespace, device, dtype and shape; finite; within ``tol``."""
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, ref, inputs, strict=True):
        assert_namespace_device(g, xp, device, x.dtype)
        got = to_numpy(g)
        assert got.shape == tuple(x.shape) == r.shape, f"{name}: shape {got.shape}"
        assert np.isfinite(got).all(), f"{name}: not finite"
        err = rel_error(got, r)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


# --------------------------------------------------------------------------- #
# The oracle itself
# --------------------------------------------------------------------------- #

@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("name", [n for n in CASES if "dropout" not in n
                                  and "dropout_p" not in CASES[n].options])
def test_formula_forward_is_ref_attention(torch, name):
    """The torch formula's out and lse are :func:`helpers.ref_attention`'s (no dropout)."""
    case = CASES[name]
    out, lse, _ = formula_vjp(case, cotangent(case))
    o = dict(case.options)
    bthe = o.pop("layout", "BHTE") == "BTHE"
    q, k, v = (np.swapaxes(a, -3, -2) if bthe else a for a in (case.q, case.k, case.v))
    if o.pop("enable_gqa", False):
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    ref_out, ref_lse, _ = ref_attention(q, k, v, mask=case.mask,
                                        alignment=o.pop("causal_alignment", "top_left"), **o)
    np.testing.assert_allclose(np.swapaxes(out, -3, -2) if bthe else out, ref_out,
                               rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], ref_lse[np.isfinite(ref_lse)],
                               rtol=1e-13)


def test_formula_drops_the_weights_it_should(torch):
    """With dropout the formula's output is the undropped weights times the keep-mask."""
    case = CASES["dropout"]
    o = case.options
    _, _, w = ref_attention(case.q, case.k, case.v)
    keep = keep_mask(w.shape, o["dropout_p"], o["dropout_seed"])
    assert 0.5 < keep.mean() < 0.9                          # p = 0.3 on 70 weights
    out, _, _ = formula_vjp(case, cotangent(case))
    ref = (w * keep / (1 - o["dropout_p"])) @ case.v
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("name", list(CASES))
def test_numpy_reference_matches_the_formula(torch, name):
    """The oracle of the sessions without torch (``reference.backward`` on NumPy, float64)
    is the torch formula's autograd, with ``grad_lse`` too."""
    case = CASES[name]
    g, g_lse = cotangent(case), lse_cotangent(case)
    out, lse, grads = numpy_reference_vjp(case, g, g_lse)
    ref_out, ref_lse, ref_grads = formula_vjp(case, g, g_lse)
    assert rel_error(out, ref_out) <= 1e-13
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    for x, r in zip(grads, ref_grads, strict=True):
        assert x.shape == r.shape
        assert rel_error(x, r) <= 1e-12


# --------------------------------------------------------------------------- #
# Against the oracle, on every backend and implementation
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize(("name", "dtype_name"), CASE_DTYPES)
def test_gradients_match_the_formula(xp, device, backend, implementation, name, dtype_name):
    thin(backend, implementation, (name, dtype_name))
    case = CASES[name]
    g = cotangent(case)
    out, grads, inputs = run_vjp(xp, device, dtype_name, implementation, case, g)
    ref_out, _, ref_grads = oracle(case, g, dtype_name=dtype_name)
    tol = GRAD_TOL[dtype_name]
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert rel_error(to_numpy(out), ref_out) <= tol
    assert_grads(grads, ref_grads, inputs, xp, device, tol)


@pytest.mark.parametrize("name", ["plain", "key_lengths_bottom_right", "everything",
                                  "fully_masked", "bthe", "matrix"])
def test_return_lse_with_grad_lse(xp, device, backend, implementation, name):
    """A loss on out and lse: ``pullback(grad_out, grad_lse)``; lse = -inf rows ignore it."""
    thin(backend, implementation, (name, "lse"))
    case = CASES[name]
    g, g_lse = cotangent(case), lse_cotangent(case)
    (out, lse), grads, inputs = run_vjp(xp, device, "float64", implementation, case, g,
                                        g_lse, return_lse=True)
    ref_out, ref_lse, ref_grads = oracle(case, g, g_lse)
    assert rel_error(to_numpy(out), ref_out) <= 1e-12
    lse = to_numpy(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert rel_error(np.where(np.isneginf(lse), 0, lse),
                     np.where(np.isneginf(ref_lse), 0, ref_lse)) <= 1e-12
    assert_grads(grads, ref_grads, inputs, xp, device, GRAD_TOL["float64"])
    # grad_lse matters: without it the gradients differ
    _, _, without = oracle(case, g)
    assert rel_error(without[0], ref_grads[0]) > 1e-3


@pytest.mark.parametrize("name", ["causal_bottom_right_tq<tk", "dropout_gqa_causal",
                                  "everything"])
def test_float16_gradients(xp, device, backend, implementation, name):
    """float16 inputs: gradients in float16 (computed in float32), within 2e-3."""
    thin(backend, implementation, (name, "float16"))
    if not hasattr(xp, "float16"):
        pytest.skip(f"{xp.__name__} has no float16")
    case = CASES[name]
    g = cotangent(case)
    _, grads, inputs = run_vjp(xp, device, "float16", implementation, case, g)
    _, _, ref_grads = oracle(case, g, dtype_name="float16")
    assert_grads(grads, ref_grads, inputs, xp, device, GRAD_TOL["float16"])


def test_fully_masked_rows_have_zero_gradients(xp, device, backend, implementation):
    """Rows that see no key: zero query gradient, lse -inf, nothing NaN; a batch row with
    no keys at all (key length 0) gives zero key and value gradients."""
    thin(backend, implementation)
    case = CASES["fully_masked"]
    g = cotangent(case)
    (out, lse), grads, _ = run_vjp(xp, device, "float64", implementation, case, g,
                                   return_lse=True)
    dq, dk, dv = (to_numpy(x) for x in grads)
    dead = np.isneginf(to_numpy(lse))                          # (B, H, Tq)
    assert dead[1].all() and dead[0, :, 2].all() and dead[2, :, :4].all()
    assert not dead.all()
    assert np.all(to_numpy(out)[dead] == 0)
    assert np.all(dq[dead] == 0)
    assert np.all(dk[1] == 0) and np.all(dv[1] == 0)
    assert all(np.isfinite(x).all() for x in (dq, dk, dv))
    assert np.abs(dq[~dead]).max() > 0


# --------------------------------------------------------------------------- #
# Finite differences (NumPy, every feature at once)
# --------------------------------------------------------------------------- #

FD_STEP = 1e-5


@NUMPY_ONLY
@pytest.mark.parametrize("implementation_name", IMPLEMENTATIONS)
def test_central_finite_differences(implementation_name, monkeypatch):
    """⟨grad, d⟩ equals (f(x + εd) − f(x − εd)) / 2ε along random directions, float64."""
    name = use_implementation(implementation_name, Backend.NUMPY, monkeypatch)
    case = CASES["everything"]
    g = cotangent(case)
    xs = [case.q, case.k, case.v]
    kw = {"attn_mask": case.mask, "implementation": name, **case.options}
    _, pullback = polyattn.attention_vjp(*xs, **kw)
    grads = pullback(g)

    def f(ys: list[np.ndarray]) -> float:
        return float(np.sum(polyattn.scaled_dot_product_attention(*ys, **kw) * g))

    rng = np.random.default_rng(5)
    fd, analytic = [], []
    for _ in range(3):
        ds = [rng.standard_normal(x.shape) for x in xs]
        plus = f([x + FD_STEP * d for x, d in zip(xs, ds, strict=True)])
        minus = f([x - FD_STEP * d for x, d in zip(xs, ds, strict=True)])
        fd.append((plus - minus) / (2 * FD_STEP))
        analytic.append(sum(float(np.sum(gr * d)) for gr, d in zip(grads, ds, strict=True)))
    assert rel_error(np.array(fd), np.array(analytic)) <= 1e-7, (fd, analytic)


# --------------------------------------------------------------------------- #
# Properties that need no oracle
# --------------------------------------------------------------------------- #

def test_keys_outside_every_window_get_zero_gradients(xp, device, backend, implementation):
    """Queries 0..4 at top-left positions with window (1, 0) see keys 0..4 at most;
    keys 5..8 are outside every window: their gradients are exactly 0."""
    thin(backend, implementation)
    rng = np.random.default_rng(6)
    case = Case(rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 9, 4)),
                rng.standard_normal((2, 2, 9, 3)), options={"window": (1, 0)})
    _, (_, dk, dv), _ = run_vjp(xp, device, "float64", implementation, case,
                                 cotangent(case))
    dk, dv = to_numpy(dk), to_numpy(dv)
    assert np.all(dk[..., 5:, :] == 0) and np.all(dv[..., 5:, :] == 0)
    assert np.all(np.abs(dk[..., :5, :]).max(axis=-1) > 0)
    assert np.all(np.abs(dv[..., :5, :]).max(axis=-1) > 0)


@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "float_mask"])
def test_permuting_keys_permutes_their_gradients(xp, device, backend, implementation,
                                                 with_mask):
    """No causal masking, window, ALiBi or dropout: keys are a set. Permuting keys, values
    and the mask's key axis permutes dk and dv and leaves dq (up to rounding)."""
    thin(backend, implementation, None if with_mask else ("unmasked", "float64"))
    rng = np.random.default_rng(7)
    mask = np.where(rng.random((4, 5, 8)) < 0.2, -np.inf, rng.standard_normal((4, 5, 8)))
    mask[..., 0] = 0.0
    case = Case(rng.standard_normal((2, 4, 5, 4)), rng.standard_normal((2, 2, 8, 4)),
                rng.standard_normal((2, 2, 8, 3)), mask=mask if with_mask else None,
                options={"enable_gqa": True, "softcap": 2.0})
    perm = rng.permutation(8)
    permuted = case.with_(k=case.k[..., perm, :], v=case.v[..., perm, :],
                          mask=mask[..., perm] if with_mask else None)
    g = cotangent(case)
    _, grads, _ = run_vjp(xp, device, "float64", implementation, case, g)
    _, pgrads, _ = run_vjp(xp, device, "float64", implementation, permuted, g)
    dq, dk, dv = (to_numpy(x) for x in grads)
    pq, pk, pv = (to_numpy(x) for x in pgrads)
    assert rel_error(pq, dq) <= 1e-13
    assert rel_error(pk, dk[..., perm, :]) <= 1e-13
    assert rel_error(pv, dv[..., perm, :]) <= 1e-13


def test_pullback_is_linear_and_repeatable(xp, device, backend, implementation):
    """``pullback(a·g1 + b·g2) = a·pullback(g1) + b·pullback(g2)``; the same call twice
    gives the same bits."""
    thin(backend, implementation)
    case = CASES["everything"]
    arrays, options = on_backend(case, xp, device, "float64")
    _, pullback = vjp(arrays, implementation=implementation, **options)
    g1, g2 = cotangent(case, 11), cotangent(case, 12)
    a, b = 0.75, -2.5
    r1, r2, r12 = (pullback(to_xp(g, xp, device=device)) for g in (g1, g2, a * g1 + b * g2))
    again = pullback(to_xp(g1, xp, device=device))
    for x1, x2, x12, y in zip(r1, r2, r12, again, strict=True):
        x1, x2, x12 = to_numpy(x1), to_numpy(x2), to_numpy(x12)
        assert rel_error(x12, a * x1 + b * x2) <= 1e-13
        assert to_numpy(y).tobytes() == x1.tobytes()


def test_inputs_are_not_modified(xp, device, backend, implementation):
    """Neither the forward pass nor the pullback writes to query, key, value, mask,
    slopes, key lengths or the cotangent."""
    if backend is Backend.JAX:
        pytest.skip("JAX arrays are immutable")
    thin(backend, implementation)
    case = CASES["everything"]
    arrays, options = on_backend(case, xp, device, "float64")
    g = to_xp(cotangent(case), xp, device=device)
    named = {"query": arrays[0], "key": arrays[1], "value": arrays[2], "grad_out": g,
             **{n: x for n, x in options.items() if hasattr(x, "shape")}}
    before = {n: to_numpy(x).copy() for n, x in named.items()}
    _, pullback = polyattn.attention_vjp(*arrays, implementation=implementation, **options)
    pullback(g)
    for n, x in named.items():
        np.testing.assert_array_equal(to_numpy(x), before[n], err_msg=n)


@NUMPY_ONLY
@pytest.mark.parametrize("implementation_name", IMPLEMENTATIONS)
def test_read_only_numpy_inputs(implementation_name, monkeypatch):
    """Read-only NumPy arrays (every argument, the cotangents too) work."""
    name = use_implementation(implementation_name, Backend.NUMPY, monkeypatch)
    case = CASES["everything"]
    g, g_lse = cotangent(case), lse_cotangent(case)
    arrays = [case.q.copy(), case.k.copy(), case.v.copy(), case.mask.copy(), g, g_lse,
              case.options["alibi_slopes"].copy(), case.options["key_lengths"].copy()]
    for a in arrays:
        a.setflags(write=False)
    q, k, v, mask, g, g_lse, slopes, lengths = arrays
    options = {**case.options, "alibi_slopes": slopes, "key_lengths": lengths}
    (out, lse), pullback = polyattn.attention_vjp(q, k, v, attn_mask=mask, return_lse=True,
                                                  implementation=name, **options)
    grads = pullback(g, g_lse)
    ref_out, ref_lse, ref = numpy_reference_vjp(case, cotangent(case), lse_cotangent(case))
    assert rel_error(out, ref_out) <= 1e-12
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    for x, r in zip(grads, ref, strict=True):
        assert rel_error(x, r) <= 1e-12


def test_gradients_take_each_inputs_dtype(xp, device, backend, implementation):
    """query float32 with float64 key and value: the result is float64, and each gradient
    has its own input's dtype."""
    thin(backend, implementation)
    case = CASES["gqa"]
    q = to_xp(case.q, xp, dtype="float32", device=device)
    k, v = (to_xp(a, xp, dtype="float64", device=device) for a in (case.k, case.v))
    out, pullback = vjp([q, k, v], implementation=implementation, **case.options)
    assert_namespace_device(out, xp, device, xp.float64)
    g = cotangent(case)
    grads = pullback(to_xp(g, xp, device=device))
    _, _, ref = oracle(case.with_(q=rounded(case.q, "float32")), g)
    for x, like, r in zip(grads, (q, k, v), ref, strict=True):
        assert_namespace_device(x, xp, device, like.dtype)
        assert tuple(x.shape) == tuple(like.shape)
        assert rel_error(to_numpy(x), r) <= 1e-6       # dq rounded to float32


# --------------------------------------------------------------------------- #
# attention_vjp's result is scaled_dot_product_attention's
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out_lse"])
@pytest.mark.parametrize("name", ["everything", "bthe", "matrix"])
def test_result_is_sdpa(xp, device, backend, implementation, name, return_lse):
    """The same implementation gives the same bits; "auto" (which for
    scaled_dot_product_attention may pick the library's native function) the same
    numbers."""
    thin(backend, implementation, (name, "out_lse" if return_lse else "out"))
    case = CASES[name]
    arrays, options = on_backend(case, xp, device, "float64")
    result, _ = vjp(arrays, implementation=implementation, return_lse=return_lse, **options)
    expected = jitted(lambda *a: polyattn.scaled_dot_product_attention(
        *a, implementation=implementation, return_lse=return_lse, **options), arrays)(*arrays)
    if not return_lse:
        result, expected = (result,), (expected,)
    for x, y in zip(result, expected, strict=True):
        assert_namespace_device(x, xp, device, y.dtype)
        x, y = to_numpy(x), to_numpy(y)
        if implementation == "auto":
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
        else:
            assert x.tobytes() == y.tobytes()


# --------------------------------------------------------------------------- #
# torch: gradcheck through the NumPy fast path on CPU tensors
# --------------------------------------------------------------------------- #

def _torch_session() -> Any:
    if Backend.TORCH not in selected_backends():
        pytest.skip("torch autograd is tested where POLYATTN_TEST_BACKENDS selects torch")
    return pytest.importorskip("torch")


@pytest.mark.parametrize("options", [
    {"is_causal": True},
    {"window": (1, 1), "softcap": 1.0},
    {"is_causal": True, "causal_alignment": "bottom_right", "dropout_p": 0.25,
     "dropout_seed": 3},
], ids=["causal", "window_softcap", "dropout"])
def test_torch_gradcheck_through_the_numpy_fast_path(options, monkeypatch):
    torch = _torch_session()
    use_implementation("chunked", Backend.TORCH, monkeypatch)
    rng = np.random.default_rng(8)
    q, k, v = (torch.tensor(rng.standard_normal(s), requires_grad=True)
               for s in ((1, 2, 4, 3), (1, 2, 5, 3), (1, 2, 5, 2)))
    e = polyattn.explain(q, k, v, implementation="chunked", **options)
    assert e.module == "polyattn.backends.numpy.forward", str(e)

    def f(q: Any, k: Any, v: Any) -> Any:
        return polyattn.scaled_dot_product_attention(q, k, v, implementation="chunked",
                                                     **options)

    assert f(q, k, v).grad_fn is not None
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_torch_float_mask_requiring_grad_takes_the_generic_path(monkeypatch):
    """A float mask that requires a gradient: chunked runs the Array-API blocked path
    (autograd through torch operations), explain says why, and every gradient is right."""
    torch = _torch_session()
    use_implementation("chunked", Backend.TORCH, monkeypatch)
    case = CASES["float_mask"]
    leaves = [torch.tensor(a, requires_grad=True) for a in (case.q, case.k, case.v, case.mask)]
    q, k, v, mask = leaves
    e = polyattn.explain(q, k, v, attn_mask=mask, implementation="chunked", **case.options)
    assert e.module == "polyattn.backends.array_api.blocked", str(e)
    assert "attn_mask" in e.reason, e.reason
    detached = polyattn.explain(q, k, v, attn_mask=mask.detach(), implementation="chunked",
                                **case.options)
    assert detached.module == "polyattn.backends.numpy.forward"
    out = polyattn.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                implementation="chunked", **case.options)
    g = torch.tensor(cotangent(case))
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [torch.tensor(a, requires_grad=True)
                  for a in (case.q, case.k, case.v, case.mask)]
    ref_out, _ = formula(torch, *ref_leaves[:3], attn_mask=ref_leaves[3], **case.options)
    ref = torch.autograd.grad(ref_out, ref_leaves, g)
    for name, x, r in zip(("query", "key", "value", "attn_mask"), grads, ref, strict=True):
        x, r = x.numpy(), r.numpy()
        assert np.isfinite(x).all(), name
        assert rel_error(x, r) <= 1e-10, name
    assert np.abs(grads[3].numpy()).max() > 0


# --------------------------------------------------------------------------- #
# JAX: jax.grad against jax.nn.dot_product_attention and finite differences
# --------------------------------------------------------------------------- #

def _jax_session() -> Any:
    if Backend.JAX not in selected_backends():
        pytest.skip("jax.grad is tested where POLYATTN_TEST_BACKENDS selects jax")
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


@pytest.mark.parametrize("implementation_name", ["reference", "chunked"])
def test_jax_grad_matches_jax_nn(implementation_name, monkeypatch):
    """float32, (B, T, H, E) layout, GQA, causal: jax.grad of ⟨out, g⟩ through polyattn
    and through ``jax.nn.dot_product_attention``."""
    options = {"is_causal": True}
    jax = _jax_session()
    jnp = jax.numpy
    use_implementation(implementation_name, Backend.JAX, monkeypatch)
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype=jnp.float32)
               for s in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)))
    g = jnp.asarray(rng.standard_normal((2, 6, 4, 8)), dtype=jnp.float32)

    def ours(q: Any, k: Any, v: Any) -> Any:
        out = polyattn.scaled_dot_product_attention(
            q, k, v, layout="BTHE", enable_gqa=True, implementation=implementation_name,
            **options)
        return jnp.sum(out * g)

    def theirs(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, **options) * g)

    got = jax.jit(jax.grad(ours, (0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(theirs, (0, 1, 2)))(q, k, v)
    for name, x, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert x.dtype == jnp.float32, name
        assert rel_error(np.asarray(x), np.asarray(r)) <= 1e-4, name


@pytest.mark.parametrize("implementation_name", ["reference", "chunked"])
def test_jax_grad_finite_differences(implementation_name, monkeypatch):
    """float64 jax.grad (under jit) with every feature on, against central differences."""
    jax = _jax_session()
    jnp = jax.numpy
    use_implementation(implementation_name, Backend.JAX, monkeypatch)
    case = CASES["everything"]
    g = jnp.asarray(cotangent(case))
    kw = {"attn_mask": jnp.asarray(case.mask), "implementation": implementation_name,
          **{n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
             for n, x in case.options.items()}}

    @jax.jit
    def f(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(polyattn.scaled_dot_product_attention(q, k, v, **kw) * g)

    xs = [jnp.asarray(a) for a in (case.q, case.k, case.v)]
    grads = jax.jit(jax.grad(f, (0, 1, 2)))(*xs)
    _, _, ref = numpy_reference_vjp(case, cotangent(case))
    for x, r in zip(grads, ref, strict=True):
        assert rel_error(np.asarray(x), r) <= GRAD_TOL["float64"]
    rng = np.random.default_rng(10)
    fd, analytic = [], []
    for _ in range(2):
        ds = [rng.standard_normal(a.shape) for a in xs]
        plus = f(*(x + FD_STEP * d for x, d in zip(xs, ds, strict=True)))
        minus = f(*(x - FD_STEP * d for x, d in zip(xs, ds, strict=True)))
        fd.append(float(plus - minus) / (2 * FD_STEP))
        analytic.append(sum(float(np.sum(np.asarray(x) * d))
                            for x, d in zip(grads, ds, strict=True)))
    assert rel_error(np.array(fd), np.array(analytic)) <= 1e-7, (fd, analytic)
