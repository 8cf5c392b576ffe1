"""Gradients through polyattn: never dropped, always right (DESIGN §4.1, "Gradients").

torch autograd and JAX's ``jax.grad``, ``jax.vjp``, ``jax.jit`` and ``jax.vmap``
must reach every input of :func:`~polyattn.scaled_dot_product_attention`,
:func:`~polyattn.attention_weights`, :func:`~polyattn.multi_head_attention`,
:class:`~polyattn.MultiHeadAttention` and
:func:`~polyattn.sinusoidal_positional_encoding`, whichever subset of the
inputs requires a gradient (or is traced) and whichever arrays are captured
from outside the traced function, on every implementation.

Each gradient is checked against an oracle written without polyattn:

* torch's own ``scaled_dot_product_attention`` and ``torch.nn.MultiheadAttention``
  (float64, relative error ≤ 1e-10), in the torch session;
* a float64 NumPy backward pass written from the formula, in the JAX session
  (it is checked against torch's in the torch session), and plain ``jax.numpy``
  formulas differentiated by JAX for multi-head attention;
* central finite differences along random directions (float64).

JAX's native attention computes in float32, so ``implementation="native"`` refuses
float64 JAX arrays; its gradients are checked in float32.

torch tests run where ``POLYATTN_TEST_BACKENDS`` selects torch, JAX tests where it
selects jax (the numpy session installs torch as an oracle; these tests do not
run again there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from _support import CPU_IMPLEMENTATIONS
from helpers import Backend, assert_close, ref_attention, rel_error, selected_backends, to_numpy

import polyattn
from polyattn import _dispatch, _preferences
from polyattn.backends.array_api import blocked as chunked

#: The implementation cases that take torch and JAX CPU arrays (``"native"`` where torch or
#: JAX is selected): numba_cpu takes NumPy arrays, distributed Dask arrays, numba_cuda
#: CUDA arrays; their gradients are ``attention_vjp``'s (test_rules.py, test_vjp.py).
IMPLEMENTATIONS = CPU_IMPLEMENTATIONS
#: ‖g − g_ref‖ / ‖g_ref‖ allowed for float64 gradients.
GRAD_TOL = 1e-10
#: The same for float32 gradients (JAX's native attention) against the float64 oracle.
GRAD_TOL32 = 1e-5
#: Relative error allowed between central finite differences and the gradient.
FD_TOL = 1e-6
FD_STEP = 1e-5


# --------------------------------------------------------------------------- #
# Libraries: each runs in its own session
# --------------------------------------------------------------------------- #

def _library(backend: Backend, module: str) -> Any:
    """``module`` if this run tests ``backend`` and it is installed; else skip."""
    if backend not in selected_backends():
        pytest.skip(f"gradients on {backend.value} are tested where POLYATTN_TEST_BACKENDS "
                    f"selects {backend.value}")
    return pytest.importorskip(module)


@pytest.fixture
def torch():
    """torch, in runs that test torch."""
    return _library(Backend.TORCH, "torch")


@pytest.fixture
def jax():
    """JAX with float64 enabled, in runs that test JAX."""
    jax = _library(Backend.JAX, "jax")
    jax.config.update("jax_enable_x64", True)
    return jax


def small_blocks(monkeypatch: Any, block_q: int, block_k: int) -> None:
    """Make the chunked implementation cross block boundaries on these small problems."""
    monkeypatch.setattr(chunked, "BLOCK_Q", block_q)
    monkeypatch.setattr(chunked, "BLOCK_K", block_k)


def assert_grads_close(got: list[Any], ref: list[np.ndarray], tol: float = GRAD_TOL,
                       names: tuple[str, ...] = ()) -> None:
    """Every gradient present, finite, of the right shape and within ``tol`` of ``ref``."""
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        what = names[i] if i < len(names) else f"gradient {i}"
        assert g is not None, f"{what}: no gradient (dropped)"
        g = to_numpy(g)
        assert g.shape == r.shape, f"{what}: shape {g.shape} != {r.shape}"
        assert np.isfinite(g).all(), f"{what}: not finite"
        err = rel_error(g, r)
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def check_finite_differences(loss: Any, xs: list[np.ndarray], grads: list[np.ndarray],
                             seed: int = 0, directions: int = 3) -> None:
    """Central differences of ``loss`` along random directions agree with ``grads``.

    ``loss`` maps a list of float64 NumPy arrays (the inputs ``xs``, perturbed)
    to a float.
    """
    rng = np.random.default_rng(seed)
    fd, analytic = [], []
    for _ in range(directions):
        ds = [rng.standard_normal(x.shape) for x in xs]
        plus = loss([x + FD_STEP * d for x, d in zip(xs, ds, strict=True)])
        minus = loss([x - FD_STEP * d for x, d in zip(xs, ds, strict=True)])
        fd.append((plus - minus) / (2 * FD_STEP))
        analytic.append(sum(float(np.sum(np.asarray(g) * d))
                            for g, d in zip(grads, ds, strict=True)))
    err = rel_error(np.array(fd), np.array(analytic))
    assert err <= FD_TOL, f"finite differences {fd} vs gradient {analytic}: {err:.3g}"


# --------------------------------------------------------------------------- #
# Cases: one problem each, float64 NumPy arrays in the caller's layout
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Case:
    """An attention call: arrays in the caller's layout and the keywords."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def float_mask(self) -> bool:
        return self.mask is not None and self.mask.dtype != bool

    def inputs(self, weights: bool = False) -> list[np.ndarray]:
        """The differentiable inputs: query, key, value (not for weights), a float mask."""
        xs = [self.q, self.k] + ([] if weights else [self.v])
        return [*xs, self.mask] if self.float_mask else xs

    def names(self, weights: bool = False) -> tuple[str, ...]:
        return ("query", "key") + (() if weights else ("value",)) + (
            ("attn_mask",) if self.float_mask else ())

    def split(self, xs: list[Any], weights: bool = False) -> tuple[Any, Any, Any, Any]:
        """(query, key, value, mask) from :meth:`inputs`' arrays (a bool mask is constant)."""
        xs = list(xs)
        q, k = xs[0], xs[1]
        v = None if weights else xs[2]
        rest = xs[2 if weights else 3:]
        mask = rest[0] if self.float_mask else self.mask
        return q, k, v, mask

    @property
    def bthe(self) -> bool:
        return self.options.get("layout") == "BTHE"

    def call(self, xs: list[Any], implementation: str = "auto", weights: bool = False,
             to: Any = None) -> Any:
        """polyattn on ``xs``; ``to`` converts a constant bool mask to the library."""
        q, k, v, mask = self.split(xs, weights)
        if mask is not None and not self.float_mask and to is not None:
            mask = to(mask)
        if weights:
            return polyattn.attention_weights(q, k, attn_mask=mask, **self.options)
        return polyattn.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                     implementation=implementation,
                                                     **self.options)


def _make_cases() -> dict[str, Case]:
    rng = np.random.default_rng(20250601)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape)

    q, k, v = normal(2, 2, 5, 4), normal(2, 2, 7, 4), normal(2, 2, 7, 4)
    bool_mask = rng.random((2, 1, 5, 7)) < 0.6                    # broadcast over heads
    bool_mask[..., 0] = True
    bool_mask[1, 0, 2] = False                                     # a fully masked row
    float_mask = normal(5, 7)
    float_mask[rng.random((5, 7)) < 0.3] = -np.inf
    float_mask[:, 0] = normal(5)
    float_mask[3] = -np.inf                                        # a fully masked row
    bottom_right = {"is_causal": True, "causal_alignment": "bottom_right"}
    return {
        "plain": Case(q, k, v),
        "causal": Case(q, k, v, options={"is_causal": True}),
        "bottom_right_short": Case(q, k, v, options=bottom_right),           # Tq < Tk
        "bottom_right_long": Case(normal(2, 2, 7, 4), normal(2, 2, 5, 4),    # Tq > Tk: rows
                                  normal(2, 2, 5, 4), options=bottom_right),  # 0, 1 see no key
        "bool_mask": Case(q, k, v, mask=bool_mask),
        "float_mask": Case(q, k, v, mask=float_mask),
        "float_mask_causal": Case(q, k, v, mask=float_mask, options={"is_causal": True}),
        "gqa": Case(normal(2, 4, 5, 4), k, v, options={"enable_gqa": True}),
        "bthe": Case(normal(2, 5, 2, 4), normal(2, 7, 2, 4), normal(2, 7, 2, 4),
                     options={"layout": "BTHE", "is_causal": True}),
        "batch_dims": Case(normal(2, 3, 2, 5, 4), normal(2, 3, 2, 7, 4), normal(2, 3, 2, 7, 4)),
    }


CASES = _make_cases()


def _cotangent(case: Case, weights: bool = False, seed: int = 1) -> np.ndarray:
    out, _, _ = numpy_vjp(case, None, weights)
    return np.random.default_rng(seed).standard_normal(out.shape)


# --------------------------------------------------------------------------- #
# Oracles
# --------------------------------------------------------------------------- #

def _to_bhte(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -3, -2)


def _unbroadcast(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``x`` down to ``shape`` (the gradient of a broadcast)."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True)


def numpy_vjp(case: Case, g: np.ndarray | None, weights: bool = False,
              ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """float64 (out, gradients of ⟨out, g⟩ w.r.t. ``case.inputs(weights)``, dead rows).

    The backward pass of ``out = softmax(s) · v``, ``s = scale · q kᵀ + mask``:
    ``dv = αᵀ g``, ``dα = g vᵀ``, ``ds = α ⊙ (dα − rowsum(dα ⊙ α))``,
    ``dq = scale · ds k``, ``dk = scale · dsᵀ q``, ``dmask = ds``. For the
    weights, ``v`` is the identity. ``dead`` (B…, H, Tq) marks rows that see no key.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (case.q, case.k, case.v))
    if case.bthe:
        q, k, v = _to_bhte(q), _to_bhte(k), _to_bhte(v)
    tk, e = k.shape[-2], q.shape[-1]
    if weights:
        v = np.broadcast_to(np.eye(tk), (*k.shape[:-1], tk))
    groups = q.shape[-3] // k.shape[-3] if case.options.get("enable_gqa") else 1
    kr, vr = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    out, _, alpha = ref_attention(q, kr, vr, mask=case.mask,
                                  is_causal=case.options.get("is_causal", False),
                                  alignment=case.options.get("causal_alignment", "top_left"))
    dead = alpha.sum(axis=-1) == 0
    if case.bthe and not weights:
        out = _to_bhte(out)
    if g is None:
        return out, [], dead
    g = _to_bhte(g) if case.bthe and not weights else g
    scale = 1.0 / math.sqrt(e)
    dv = np.swapaxes(alpha, -1, -2) @ g
    dalpha = g @ np.swapaxes(vr, -1, -2)
    ds = alpha * (dalpha - np.sum(dalpha * alpha, axis=-1, keepdims=True))
    dq = scale * ds @ kr
    dk = scale * np.swapaxes(ds, -1, -2) @ q

    def ungroup(x: np.ndarray) -> np.ndarray:
        *lead, h, t, f = x.shape
        x = x.reshape(*lead, h // groups, groups, t, f).sum(axis=-3)
        return _unbroadcast(x, k.shape)

    grads = [dq, ungroup(dk)] + ([] if weights else [ungroup(dv)])
    if case.bthe:
        grads = [_to_bhte(x) for x in grads]
    if case.float_mask:
        grads.append(_unbroadcast(ds, case.mask.shape))
    return out, grads, dead


def _causal_allowed(tq: int, tk: int, alignment: str) -> np.ndarray:
    offset = 0 if alignment == "top_left" else tk - tq
    return np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset


def torch_vjp(torch: Any, case: Case, g: np.ndarray, weights: bool = False,
              ) -> tuple[np.ndarray, list[np.ndarray]]:
    """(out, gradients) from ``torch.nn.functional.scaled_dot_product_attention``.

    Bottom-right causal alignment and causal masks combined with ``attn_mask``
    are passed as one explicit mask (torch's ``is_causal`` is top-left only).
    """
    leaves = [torch.tensor(x, requires_grad=True) for x in case.inputs(weights)]
    q, k, v, mask = case.split(leaves, weights)
    if case.bthe:
        q, k = q.transpose(-3, -2), k.transpose(-3, -2)
        v = None if v is None else v.transpose(-3, -2)
    tq, tk = q.shape[-2], k.shape[-2]
    if weights:
        v = torch.eye(tk, dtype=torch.float64).expand(*k.shape[:-1], tk)
    if mask is not None and not case.float_mask:
        mask = torch.tensor(mask)
    is_causal = case.options.get("is_causal", False)
    alignment = case.options.get("causal_alignment", "top_left")
    if is_causal and (alignment == "bottom_right" or mask is not None):
        allowed = torch.tensor(_causal_allowed(tq, tk, alignment))
        if mask is None:
            mask = allowed
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.masked_fill(~allowed, -math.inf)
        is_causal = False
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal,
        enable_gqa=case.options.get("enable_gqa", False))
    if case.bthe and not weights:
        out = out.transpose(-3, -2)
    grads = torch.autograd.grad(out, leaves, torch.tensor(g))
    return out.detach().numpy(), [x.numpy() for x in grads]


def _assert_dead_rows_zero(dq: Any, dead: np.ndarray, case: Case) -> None:
    """The query gradient of a row that sees no key is exactly 0."""
    dq = to_numpy(dq)
    if case.bthe:
        dq = _to_bhte(dq)
    dq = np.broadcast_to(dq, (*dead.shape, dq.shape[-1]))
    assert np.all(dq[dead] == 0), "rows that see no key have a nonzero query gradient"


# --------------------------------------------------------------------------- #
# The NumPy oracle is torch's
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("weights", [False, True], ids=["sdpa", "weights"])
@pytest.mark.parametrize("name", list(CASES))
def test_numpy_oracle_matches_torch(torch, name, weights):
    case = CASES[name]
    g = _cotangent(case, weights)
    out, grads, _ = numpy_vjp(case, g, weights)
    ref_out, ref_grads = torch_vjp(torch, case, g, weights)
    assert_close(out, ref_out, "float64")
    assert_grads_close(grads, ref_grads, 1e-12, case.names(weights))


def test_cases_have_the_rows_they_are_named_for():
    """The fully masked rows the cases are meant to contain are there."""
    assert not numpy_vjp(CASES["plain"], None)[2].any()
    for name in ("bottom_right_long", "bool_mask", "float_mask", "float_mask_causal"):
        assert numpy_vjp(CASES[name], None)[2].any(), name
    assert numpy_vjp(CASES["bottom_right_long"], None)[2][..., :2].all()


# --------------------------------------------------------------------------- #
# torch autograd
# --------------------------------------------------------------------------- #

def _torch_loss(torch: Any, case: Case, implementation: str, g: np.ndarray,
                weights: bool = False) -> Any:
    """⟨polyattn(x), g⟩ on float64 NumPy inputs, as a float (for finite differences)."""
    def loss(xs: list[np.ndarray]) -> float:
        with torch.no_grad():
            out = case.call([torch.tensor(x) for x in xs], implementation, weights,
                            to=torch.tensor)
        return float(np.sum(to_numpy(out) * g))
    return loss


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_sdpa_gradients(torch, name, implementation, monkeypatch):
    small_blocks(monkeypatch, 3, 4)
    case = CASES[name]
    g = _cotangent(case)
    leaves = [torch.tensor(x, requires_grad=True) for x in case.inputs()]
    out = case.call(leaves, implementation, to=torch.tensor)
    grads = torch.autograd.grad(out, leaves, torch.tensor(g))
    ref_out, ref_grads = torch_vjp(torch, case, g)
    assert_close(out, ref_out, "float64")
    assert_grads_close(list(grads), ref_grads, names=case.names())
    _assert_dead_rows_zero(grads[0], numpy_vjp(case, None)[2], case)
    check_finite_differences(_torch_loss(torch, case, implementation, g), case.inputs(),
                             [x.numpy() for x in grads])


@pytest.mark.parametrize("name", list(CASES))
def test_torch_attention_weights_gradients(torch, name):
    case = CASES[name]
    g = _cotangent(case, weights=True)
    leaves = [torch.tensor(x, requires_grad=True) for x in case.inputs(weights=True)]
    alpha = case.call(leaves, weights=True, to=torch.tensor)
    grads = torch.autograd.grad(alpha, leaves, torch.tensor(g))
    ref_alpha, ref_grads = torch_vjp(torch, case, g, weights=True)
    assert_close(alpha, ref_alpha, "float64", what="weights")
    assert_grads_close(list(grads), ref_grads, names=case.names(weights=True))
    _assert_dead_rows_zero(grads[0], numpy_vjp(case, None)[2], case)
    check_finite_differences(_torch_loss(torch, case, "auto", g, weights=True),
                             case.inputs(weights=True), [x.numpy() for x in grads])


#: Which of (query, key, value, attn_mask) require a gradient.
SUBSETS = {"query": (0,), "key": (1,), "value": (2,), "attn_mask": (3,), "all": (0, 1, 2, 3)}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("subset", list(SUBSETS))
def test_torch_any_subset_requires_grad(torch, subset, implementation, monkeypatch):
    small_blocks(monkeypatch, 3, 4)
    case = CASES["float_mask_causal"]
    wanted = SUBSETS[subset]
    g = _cotangent(case)
    xs = [torch.tensor(x, requires_grad=i in wanted) for i, x in enumerate(case.inputs())]
    out = case.call(xs, implementation)
    assert out.requires_grad
    grads = torch.autograd.grad(out, [xs[i] for i in wanted], torch.tensor(g))
    _, ref_grads = torch_vjp(torch, case, g)
    assert_grads_close(list(grads), [ref_grads[i] for i in wanted],
                       names=tuple(case.names()[i] for i in wanted))


def test_torch_no_gradient_recorded_under_no_grad(torch):
    case = CASES["float_mask"]
    xs = [torch.tensor(x, requires_grad=True) for x in case.inputs()]
    with torch.no_grad():
        out = case.call(xs)
    assert not out.requires_grad


# --------------------------------------------------------------------------- #
# torch: multi-head attention against torch.nn.MultiheadAttention
# --------------------------------------------------------------------------- #

def _torch_modules(torch: Any, d: int = 8, h: int = 2) -> tuple[Any, Any]:
    """A float64 ``torch.nn.MultiheadAttention`` (nonzero biases) and polyattn's copy.

    polyattn's parameters are made leaf tensors that require gradients.
    """
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(d, h, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        m.in_proj_bias.normal_()
        m.out_proj.bias.normal_()
    mha = polyattn.MultiHeadAttention.from_torch(m, xp=torch)
    for p in mha.params.values():
        assert p.dtype == torch.float64 and p.is_leaf
        p.requires_grad_(True)
    return m, mha


def _mha_inputs(seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 7, 8)),
            rng.standard_normal((2, 7, 8))]


def _assert_torch_mha_grads(torch: Any, m: Any, mha: Any) -> None:
    """polyattn's parameter gradients equal torch's (weights transposed, in_proj split)."""
    d = m.embed_dim
    p = {k: v.grad for k, v in mha.params.items()}
    pairs = [
        (m.in_proj_weight.grad, torch.cat([p["w_q"].T, p["w_k"].T, p["w_v"].T]), "w_q|w_k|w_v"),
        (m.in_proj_bias.grad, torch.cat([p["b_q"], p["b_k"], p["b_v"]]), "b_q|b_k|b_v"),
        (m.out_proj.weight.grad, p["w_o"].T, "w_o"),
        (m.out_proj.bias.grad, p["b_o"], "b_o"),
    ]
    assert m.in_proj_weight.grad.shape == (3 * d, d)
    assert_grads_close([got for _, got, _ in pairs], [ref.numpy() for ref, _, _ in pairs],
                       names=tuple(n for _, _, n in pairs))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_multi_head_attention_gradients(torch, implementation, causal, monkeypatch):
    small_blocks(monkeypatch, 3, 4)
    m, mha = _torch_modules(torch)
    xs = _mha_inputs()
    ours = [torch.tensor(x, requires_grad=True) for x in xs]
    theirs = [torch.tensor(x, requires_grad=True) for x in xs]
    torch_mask = None
    if causal:
        torch_mask = torch.tensor(~_causal_allowed(5, 7, "top_left"))   # True = ignore
    out = mha(*ours, is_causal=causal, implementation=implementation)
    ref, _ = m(*theirs, attn_mask=torch_mask, need_weights=False)
    assert_close(out, ref.detach().numpy(), "float64")
    g = torch.tensor(np.random.default_rng(4).standard_normal(tuple(ref.shape)))
    out.backward(g)
    ref.backward(g)
    assert_grads_close([x.grad for x in ours], [x.grad.numpy() for x in theirs],
                       names=("query", "key", "value"))
    _assert_torch_mha_grads(torch, m, mha)


def test_torch_multi_head_attention_weights_gradients(torch):
    m, mha = _torch_modules(torch)
    xs = _mha_inputs()
    ours = [torch.tensor(x, requires_grad=True) for x in xs]
    theirs = [torch.tensor(x, requires_grad=True) for x in xs]
    out, w = polyattn.multi_head_attention(*ours, mha.params, num_heads=2, need_weights=True)
    ref, ref_w = m(*theirs, need_weights=True)
    assert_close(w, ref_w.detach().numpy(), "float64", what="weights")
    rng = np.random.default_rng(5)
    g_out, g_w = (torch.tensor(rng.standard_normal(tuple(x.shape))) for x in (ref, ref_w))
    ((out * g_out).sum() + (w * g_w).sum()).backward()
    ((ref * g_out).sum() + (ref_w * g_w).sum()).backward()
    assert_grads_close([x.grad for x in ours], [x.grad.numpy() for x in theirs],
                       names=("query", "key", "value"))
    _assert_torch_mha_grads(torch, m, mha)


def test_torch_only_parameters_require_grad(torch):
    """Fixed data, trained parameters: the gradient reaches the parameters."""
    m, mha = _torch_modules(torch)
    x = torch.tensor(_mha_inputs()[0])
    out = mha(x)
    (out ** 2).sum().backward()
    (m(x, x, x, need_weights=False)[0] ** 2).sum().backward()
    _assert_torch_mha_grads(torch, m, mha)


def test_torch_gradient_through_positional_encoding(torch):
    m, mha = _torch_modules(torch)
    pe = polyattn.sinusoidal_positional_encoding(5, 8, xp=torch, dtype=torch.float64)
    assert not pe.requires_grad
    x = _mha_inputs()[0]
    ours, theirs = torch.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    y = ours + pe
    out = mha(y, is_causal=True)
    y_ref = theirs + pe
    mask = torch.tensor(~_causal_allowed(5, 5, "top_left"))
    ref, _ = m(y_ref, y_ref, y_ref, attn_mask=mask, need_weights=False)
    g = torch.tensor(np.random.default_rng(6).standard_normal(tuple(ref.shape)))
    out.backward(g)
    ref.backward(g)
    assert_grads_close([ours.grad], [theirs.grad.numpy()], names=("x",))


# --------------------------------------------------------------------------- #
# torch: numba_cuda never takes inputs that require gradients
# --------------------------------------------------------------------------- #

def _torch_qkv(torch: Any, requires_grad: bool) -> list[Any]:
    case = CASES["plain"]
    return [torch.tensor(x, requires_grad=requires_grad) for x in (case.q, case.k, case.v)]


def _torch_float_mask(torch: Any, q: Any, k: Any, requires_grad: bool) -> Any:
    return torch.zeros((q.shape[-2], k.shape[-2]), dtype=q.dtype, requires_grad=requires_grad)


def test_torch_numba_cuda_refuses_a_mask_that_requires_grad(torch):
    """The kernel's backward pass gives q, k, v gradients only: a float mask's would be lost."""
    q, k, v = _torch_qkv(torch, True)
    mask = _torch_float_mask(torch, q, k, True)
    with pytest.raises(ValueError, match="attn_mask") as info:
        polyattn.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              implementation="numba_cuda")
    assert "backward" in str(info.value)
    # q, k, v alone requiring grad are no reason: these CPU tensors are (no CUDA arrays)
    with pytest.raises(RuntimeError, match="CUDA"):
        polyattn.scaled_dot_product_attention(q, k, v, implementation="numba_cuda")


@pytest.mark.parametrize("native", [True, False], ids=["native", "no_native"])
def test_torch_dispatch_sends_gradients_to_numba_cuda(torch, native, monkeypatch):
    """With a usable kernel (simulated), inputs that require grad may reach it (its backward
    pass is wired into autograd), unless a float mask requires a gradient too."""
    from polyattn.backends import cuda
    from polyattn.backends import native as native_backend

    monkeypatch.setattr(cuda, "_availability", lambda problem: (True, "test"))
    monkeypatch.setattr(_dispatch, "preference",
                        lambda problem: ("CUDA_PREFERENCE", _preferences.CUDA_PREFERENCE))
    if not native:
        monkeypatch.setattr(native_backend, "supports", lambda problem, needs: "switched off")
    q, k, v = _torch_qkv(torch, True)
    e = polyattn.explain(q, k, v)
    assert e.implementation == ("native" if native else "numba_cuda")
    assert e.kernel_available
    mask = _torch_float_mask(torch, q, k, True)
    e = polyattn.explain(q, k, v, attn_mask=mask)
    assert e.implementation == ("native" if native else "reference")
    assert not e.kernel_available
    assert "attn_mask" in e.candidates["numba_cuda"]
    with pytest.raises(ValueError, match="attn_mask"):
        polyattn.explain(q, k, v, attn_mask=mask, implementation="numba_cuda")
    # the same mask as a constant: the kernel is usable again
    e = polyattn.explain(q, k, v, attn_mask=mask.detach())
    assert e.implementation == ("native" if native else "numba_cuda")


# --------------------------------------------------------------------------- #
# JAX: grad, vjp, jit, vmap
# --------------------------------------------------------------------------- #

# JAX compiles every operation of an un-jitted call on its own, which on these small
# problems costs far more than compiling the whole function once: most checks run
# under jax.jit, and the eager ones reuse the shapes of the "plain" case.

def _jax_dtype(jax: Any, implementation: str) -> tuple[Any, float]:
    """(dtype, gradient tolerance): native JAX attention runs only in float32."""
    if implementation == "native":
        return jax.numpy.float32, GRAD_TOL32
    return jax.numpy.float64, GRAD_TOL


def _rounded(xs: list[np.ndarray], dtype: Any) -> list[np.ndarray]:
    """The float64 values of ``xs`` as the library sees them in ``dtype``."""
    return [np.asarray(x).astype(dtype).astype(np.float64) for x in xs]


def _jax_case(jax: Any, case: Case, implementation: str, monkeypatch: Any,
              ) -> tuple[Case, list[Any], float]:
    """(case in the dtype this implementation runs, its JAX inputs, the tolerance).

    For ``"native"`` this first checks that float64 JAX arrays are refused
    (JAX's softmax runs in float32), then gives the case rounded to float32.
    """
    small_blocks(monkeypatch, 16, 16)        # JAX compiles every block shape anew
    dtype, tol = _jax_dtype(jax, implementation)
    if implementation == "native":
        wide = [jax.numpy.asarray(x) for x in case.inputs()]
        with pytest.raises(ValueError, match="float32"):
            case.call(wide, "native", to=jax.numpy.asarray)
        q, k, v = _rounded([case.q, case.k, case.v], np.float32)
        mask = _rounded([case.mask], np.float32)[0] if case.float_mask else case.mask
        case = Case(q, k, v, mask, case.options)
    xs = [jax.numpy.asarray(x, dtype=dtype) for x in case.inputs()]
    return case, xs, tol


def _check_jax_vjp(jax: Any, case: Case, implementation: str, xs: list[Any], tol: float,
                   weights: bool = False) -> None:
    """``jax.jit`` of ``jax.vjp``: out and gradients against the oracle, and finite differences."""
    jnp = jax.numpy
    wide = xs[0].dtype == jnp.float64

    @jax.jit
    def vjp(xs: list[Any], g: Any) -> tuple[Any, Any]:
        out, pullback = jax.vjp(
            lambda *a: case.call(list(a), implementation, weights, to=jnp.asarray), *xs)
        return out, pullback(g)

    g = _cotangent(case, weights)
    gj = jnp.asarray(g, dtype=xs[0].dtype)
    out, grads = vjp(xs, gj)
    ref_out, ref_grads, dead = numpy_vjp(case, g, weights)
    assert_close(out, ref_out, "float64" if wide else "float32",
                 what="weights" if weights else "out")
    assert_grads_close(list(grads), ref_grads, tol, case.names(weights))
    _assert_dead_rows_zero(grads[0], dead, case)
    if wide:
        def loss(perturbed: list[np.ndarray]) -> float:
            return float(np.sum(np.asarray(vjp([jnp.asarray(x) for x in perturbed], gj)[0]) * g))

        check_finite_differences(loss, case.inputs(weights), [np.asarray(x) for x in grads])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_jax_sdpa_gradients(jax, name, implementation, monkeypatch):
    case, xs, tol = _jax_case(jax, CASES[name], implementation, monkeypatch)
    _check_jax_vjp(jax, case, implementation, xs, tol)


@pytest.mark.parametrize("name", list(CASES))
def test_jax_attention_weights_gradients(jax, name):
    case = CASES[name]
    xs = [jax.numpy.asarray(x) for x in case.inputs(weights=True)]
    _check_jax_vjp(jax, case, "auto", xs, GRAD_TOL, weights=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("subset", list(SUBSETS))
def test_jax_any_subset_traced(jax, subset, implementation, monkeypatch):
    """``jax.grad`` of some inputs under ``jax.jit``; the others are captured from outside.

    Eager ``jax.grad`` with captured arrays is checked by
    :func:`test_jax_grad_with_key_and_value_captured` (eager JAX compiles every
    operation on its own, which is slow enough to be done once).
    """
    case, xs, tol = _jax_case(jax, CASES["float_mask_causal"], implementation, monkeypatch)
    wanted = SUBSETS[subset]
    g = _cotangent(case)
    gj = jax.numpy.asarray(g, dtype=xs[0].dtype)

    def loss(*traced: Any) -> Any:
        full = list(xs)                       # the rest are captured from outside
        for i, t in zip(wanted, traced, strict=True):
            full[i] = t
        return jax.numpy.sum(case.call(full, implementation) * gj)

    argnums = tuple(range(len(wanted)))
    args = [xs[i] for i in wanted]
    _, ref_grads, _ = numpy_vjp(case, g)
    ref = [ref_grads[i] for i in wanted]
    names = tuple(case.names()[i] for i in wanted)
    assert_grads_close(list(jax.jit(jax.grad(loss, argnums))(*args)), ref, tol, names)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jax_grad_with_key_and_value_captured(jax, implementation, monkeypatch):
    """``jax.grad(lambda q: scaled_dot_product_attention(q, k, v).sum())(q)``.

    In 0.1 this raised: the tracer ``q`` has no device and the captured ``k``
    and ``v`` have one, which the device check took for a mismatch.
    """
    case, (q, k, v), tol = _jax_case(jax, CASES["plain"], implementation, monkeypatch)

    def f(q: Any) -> Any:
        return polyattn.scaled_dot_product_attention(q, k, v,
                                                     implementation=implementation).sum()

    _, ref_grads, _ = numpy_vjp(case, np.ones(case.q.shape))
    assert_grads_close([jax.grad(f)(q)], ref_grads[:1], tol, ("query",))
    assert_grads_close([jax.jit(jax.grad(f))(q)], ref_grads[:1], tol, ("query",))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jax_vmap_of_grad(jax, implementation, monkeypatch):
    """Per-example query gradients with ``jax.vmap``; key and value captured, not mapped."""
    base, (q, k, v), tol = _jax_case(jax, CASES["plain"], implementation, monkeypatch)
    k0, v0 = k[0], v[0]                                      # (H, Tk, E), shared
    g = np.random.default_rng(7).standard_normal(base.q.shape[1:])
    gj = jax.numpy.asarray(g, dtype=q.dtype)

    def f(qi: Any) -> Any:
        out = polyattn.scaled_dot_product_attention(qi, k0, v0, is_causal=True,
                                                    implementation=implementation)
        return jax.numpy.sum(out * gj)

    grads = jax.jit(jax.vmap(jax.grad(f)))(q)
    kb = np.broadcast_to(base.k[0], base.q.shape[:-2] + base.k.shape[-2:])
    vb = np.broadcast_to(base.v[0], kb.shape)
    oracle = Case(base.q, kb, vb, options={"is_causal": True})
    _, ref_grads, _ = numpy_vjp(oracle, np.broadcast_to(g, base.q.shape))
    assert_grads_close([grads], ref_grads[:1], tol, ("jit(vmap(grad))",))


# --------------------------------------------------------------------------- #
# JAX: multi-head attention and the positional encoding
# --------------------------------------------------------------------------- #

def _jnp_mha(jax: Any, xq: Any, xk: Any, xv: Any, p: dict[str, Any], h: int,
             causal: bool) -> Any:
    """Multi-head attention as plain ``jax.numpy`` (the oracle; no polyattn)."""
    jnp = jax.numpy

    def heads(x: Any, w: Any, b: Any) -> Any:
        y = x @ w + b
        return jnp.swapaxes(y.reshape(*y.shape[:-1], h, y.shape[-1] // h), -2, -3)

    q, k, v = heads(xq, p["w_q"], p["b_q"]), heads(xk, p["w_k"], p["b_k"]), heads(
        xv, p["w_v"], p["b_v"])                                           # (B, H, T, E)
    s = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.asarray(_causal_allowed(s.shape[-2], s.shape[-1], "top_left")), s,
                      -jnp.inf)
    o = jnp.swapaxes(jax.nn.softmax(s, axis=-1) @ v, -2, -3)            # (B, Tq, H, Ev)
    return o.reshape(*o.shape[:-2], -1) @ p["w_o"] + p["b_o"]


def _flat(tree: dict[str, Any], names: tuple[str, ...]) -> np.ndarray:
    """The arrays of a params dict, in ``names`` order, as one vector.

    Compared as one vector: the gradient of ``b_k`` is 0 up to rounding (a key
    bias shifts every score of a query row alike), so its own relative error
    would be noise.
    """
    return np.concatenate([np.ravel(np.asarray(tree[n], dtype=np.float64)) for n in names])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jax_multi_head_attention_params_gradient(jax, implementation, monkeypatch):
    """``jax.grad`` of ``multi_head_attention`` with respect to its params dict, under jit."""
    small_blocks(monkeypatch, 16, 16)
    jnp = jax.numpy
    dtype, tol = _jax_dtype(jax, implementation)
    rng = np.random.default_rng(8)
    names = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
    host = {n: rng.standard_normal((8, 8) if n[0] == "w" else (8,)) / math.sqrt(8)
            for n in names}
    params = {n: jnp.asarray(x, dtype=dtype) for n, x in host.items()}
    xq, xk, xv = (jnp.asarray(x, dtype=dtype) for x in _mha_inputs())
    g = jnp.asarray(rng.standard_normal((2, 5, 8)), dtype=dtype)

    def loss(p: dict[str, Any]) -> Any:
        out = polyattn.multi_head_attention(xq, xk, xv, p, num_heads=2, is_causal=True,
                                            implementation=implementation)
        return jnp.sum(out * g)

    def oracle(p: dict[str, Any]) -> Any:
        wide = [x.astype(jnp.float64) for x in (xq, xk, xv)]
        return jnp.sum(_jnp_mha(jax, *wide, p, 2, True) * g.astype(jnp.float64))

    ref = jax.jit(jax.grad(oracle))({n: jnp.asarray(params[n], dtype=jnp.float64)
                                     for n in names})
    grads = jax.jit(jax.grad(loss))(params)
    assert sorted(grads) == sorted(names)
    assert_grads_close([_flat(grads, names)], [_flat(ref, names)], tol, ("params",))
    if implementation != "native":
        jit_loss = jax.jit(loss)
        check_finite_differences(
            lambda xs: float(jit_loss(dict(zip(names, map(jnp.asarray, xs), strict=True)))),
            [host[n] for n in names], [np.asarray(ref[n]) for n in names], directions=2)


@pytest.mark.parametrize("implementation", ["auto", "native"])
def test_jax_multi_head_attention_module_under_jit(jax, implementation):
    """``MultiHeadAttention(..., xp=jax.numpy)``: its params captured, the inputs traced."""
    jnp = jax.numpy
    dtype, tol = _jax_dtype(jax, implementation)
    mha = polyattn.MultiHeadAttention(8, 2, xp=jnp, dtype=dtype, seed=0)
    xs = [jnp.asarray(x, dtype=dtype) for x in _mha_inputs()]
    g = jnp.asarray(np.random.default_rng(10).standard_normal((2, 5, 8)), dtype=dtype)

    def loss(xq: Any, xk: Any, xv: Any) -> Any:
        return jnp.sum(mha(xq, xk, xv, is_causal=True, implementation=implementation) * g)

    def oracle(xq: Any, xk: Any, xv: Any) -> Any:
        return jnp.sum(_jnp_mha(jax, xq, xk, xv, mha.params, 2, True) * g)

    wide = [x.astype(jnp.float64) for x in xs]
    ref = [np.asarray(x) for x in jax.jit(jax.grad(oracle, (0, 1, 2)))(*wide)]
    out = jax.jit(lambda *a: mha(*a, is_causal=True, implementation=implementation))(*xs)
    assert_close(out, np.asarray(_jnp_mha(jax, *wide, mha.params, 2, True)),
                 "float32" if implementation == "native" else "float64")
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(*xs)
    assert_grads_close(list(grads), ref, tol, ("query", "key", "value"))


def test_jax_positional_encoding_under_jit_and_grad(jax):
    jnp = jax.numpy
    pe = polyattn.sinusoidal_positional_encoding

    @jax.jit
    def encoding() -> Any:
        return pe(5, 8, offset=3, xp=jnp, dtype=jnp.float64)

    np.testing.assert_allclose(np.asarray(encoding()), pe(5, 8, offset=3), rtol=0, atol=1e-12)
    mha = polyattn.MultiHeadAttention(8, 2, xp=jnp, dtype=jnp.float64, seed=1)
    x = jnp.asarray(_mha_inputs()[0])
    g = jnp.asarray(np.random.default_rng(11).standard_normal((2, 5, 8)))

    def loss(x: Any) -> Any:
        y = x + pe(x.shape[-2], x.shape[-1], xp=jnp, dtype=x.dtype)
        return jnp.sum(mha(y, is_causal=True) * g)

    def oracle(x: Any) -> Any:
        y = x + jnp.asarray(pe(5, 8))
        return jnp.sum(_jnp_mha(jax, y, y, y, mha.params, 2, True) * g)

    ref = np.asarray(jax.jit(jax.grad(oracle))(x))
    assert_grads_close([jax.jit(jax.grad(loss))(x)], [ref], names=("jit(grad)",))


def test_torch_second_derivatives_through_the_fused_function(torch, monkeypatch):
    """On CPU tensors "chunked" runs the NumPy fast path in a ``torch.autograd.Function``;
    a backward pass recorded with ``create_graph=True`` is differentiable again, and its
    second derivatives match the reference implementation's (``gradgradcheck`` too)."""
    monkeypatch.setattr(_dispatch, "score_budget", lambda xp=None: 0)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn((1, 2, 6, 4), dtype=torch.float64, generator=gen,
                           requires_grad=True) for _ in range(3))
    options = {"is_causal": True, "softcap": 5.0, "window": (3, 0)}

    def attend(implementation, q, k, v):
        return polyattn.scaled_dot_product_attention(q, k, v, implementation=implementation,
                                                     **options)

    out = attend("chunked", q, k, v)
    assert "FusedAttention" in type(out.grad_fn).__name__
    second = []
    for implementation in ("chunked", "reference"):
        out = attend(implementation, q, k, v)
        g = torch.autograd.grad((out ** 2).sum(), (q, k, v), create_graph=True)
        second.append(torch.autograd.grad(sum((x ** 2).sum() for x in g), (q, k, v)))
    for mine, ref in zip(*second, strict=True):
        assert float((mine - ref).norm() / ref.norm()) <= 1e-10
    assert torch.autograd.gradgradcheck(lambda q, k, v: attend("chunked", q, k, v), (q, k, v))
