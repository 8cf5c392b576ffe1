"""The score rules of docs/semantics.rst, each written once and run over every backend x
every implementation that claims it, against the float64 oracle of ``helpers.py``.

Implementations are the case ids of :data:`_support.EVERY_IMPLEMENTATION`:
``reference``, ``chunked``, ``auto``, ``native`` (torch, JAX), ``numba_cpu`` (NumPy,
with Numba), ``distributed`` (Dask) and the CUDA kernel families ``numba_cuda-rows``,
``numba_cuda-tiled``, ``numba_cuda-tc`` (simulator or GPU). ``pytest -k numba_cpu``,
``-k numba_cuda``, ``-k numba_cuda-tiled``, ``-k distributed`` select one. Shapes are
small and have more than 16 query rows, so that each CUDA family takes them
(``explain()`` is checked to name the family); on the CUDA simulator, which runs every
thread in Python, each family runs the few cases of :data:`SIMULATOR_CASES`.

Covered here, for every implementation: causal masking in both alignments, windows,
key lengths (and that keys past them are never read), soft-capping, ALiBi, boolean and
float masks with broadcasting, GQA/MQA, fully masked rows, lse, dropout (the same
weights dropped everywhere), gradients (``attention_vjp``, and torch autograd on torch
tensors) and float32/float64/float16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from _support import (
    EVERY_IMPLEMENTATION,
    NO_VJP,
    SIMULATOR,
    cuda_family_ran,
    rounded,
    use_implementation,
)
from helpers import (
    TOLERANCE,
    Backend,
    assert_close,
    assert_lse_close,
    assert_namespace_device,
    dtype_of,
    public_name,
    ref_attention,
    ref_attention_vjp,
    rel_error,
    to_numpy,
    to_xp,
)

import polyattn

B, H, HKV, TQ, TK, E, EV = 2, 4, 2, 20, 24, 8, 6
#: Gradient tolerance by dtype (relative, against the float64 oracle of the rounded inputs).
GRAD_TOL = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-3}


@dataclass(frozen=True)
class Impl:
    case: str  # the test id: "numba_cuda-tiled"
    name: str  # what ``implementation=`` gets: "numba_cuda"
    heads: dict = field(default_factory=dict)  # make_problem's h and hkv where not H, HKV
    #: The backward pass is another case's, which runs it here: the tensor-core family's
    #: is the register-tiled one (numba_cuda-tiled), so on the simulator its cases check
    #: the forward pass only (a GPU runs both).
    backward_elsewhere: bool = False


@pytest.fixture(params=["float32", pytest.param("float64", marks=pytest.mark.exhaustive)])
def dtype_name(request) -> str:
    """The dtypes of every rule: float64 is ``exhaustive`` here, as the Array-API paths'
    code is the same in both (the JAX and Dask sessions run the float32 cases; every other
    session both; float64 on JAX: test_attention.py, test_contract.py)."""
    return request.param


@pytest.fixture(params=EVERY_IMPLEMENTATION)
def impl(request, backend, monkeypatch) -> Impl:
    heads = {}
    if SIMULATOR and public_name(request.param) == "numba_cuda":
        few_on_the_simulator(request)
        heads = SIMULATOR_HEADS
    return Impl(request.param, use_implementation(request.param, backend, monkeypatch), heads,
                backward_elsewhere=SIMULATOR and request.param == "numba_cuda-tc")


#: What each CUDA family runs on the simulator (which runs every thread in Python): float32,
#: 2 query heads over 1 key/value head (MQA), and per test the parameters below. Together:
#: the forward of every rule (``every_rule`` holds all but the boolean masks, which
#: ``head_mask_window`` and the fully masked rows' ``bool_mask`` hold), gradients (softcap
#: and ALiBi among them), dropout, fully masked rows, garbage past the key lengths, and
#: float16. A GPU runs every case.
SIMULATOR_CASES = {
    "test_rule_matches_the_oracle": {"rule": "head_mask_window"},
    "test_fully_masked_rows_give_zero_and_minus_inf": {"kind": "bool_mask"},
    "test_keys_past_key_lengths_are_never_read": {"rule": "every_rule", "garbage": "mixed"},
    "test_gradients_match_the_oracle": {"rule": "every_rule"},
    "test_dropout_drops_the_same_weights_everywhere": {"rule": "every_rule"},
    "test_float16": {"rule": "every_rule"},
}
SIMULATOR_HEADS = {"h": 2, "hkv": 1}


def few_on_the_simulator(request) -> None:
    """Skip the simulator's share of a CUDA case beyond :data:`SIMULATOR_CASES`."""
    wanted = SIMULATOR_CASES.get(request.node.originalname)
    params = request.node.callspec.params
    if (wanted is None or params.get("dtype_name", "float32") != "float32"
            or any(params.get(key) != value for key, value in wanted.items())):
        pytest.skip("the CUDA simulator runs a few cases of each family (a GPU runs them all)")


# --- the rules: one table, what the API is given and what the oracle is given ---------------

RULES = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal_bottom_right": {"is_causal": True, "alignment": "bottom_right", "tk": 31},
    "causal_bottom_right_tq_gt_tk": {"is_causal": True, "alignment": "bottom_right", "tk": 13},
    "window": {"window": (5, 2)},
    "window_right_only": {"window": (None, 3)},
    "window_causal_bottom_right": {"window": (6, 0), "is_causal": True,
                                   "alignment": "bottom_right", "tk": 31},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi_slopes": "heads"},
    "alibi_per_batch_causal": {"alibi_slopes": "batch_heads", "is_causal": True},
    "key_lengths": {"key_lengths": [TK, 9]},
    "key_lengths_bottom_right_window": {"key_lengths": [TK, 9], "is_causal": True,
                                        "alignment": "bottom_right", "window": (7, 0)},
    "bool_mask": {"mask": "bool"},
    "float_mask_causal": {"mask": "float", "is_causal": True},
    "head_mask_window": {"mask": "heads", "window": (None, 3)},
    "every_rule": {"mask": "float", "is_causal": True, "alignment": "bottom_right",
                   "window": (9, 1), "softcap": 2.0, "alibi_slopes": "batch_heads",
                   "key_lengths": [21, 12], "tk": 26},
}

#: The rules the gradient tests run (each rule's backward, a few at a time).
GRAD_RULES = ["plain", "causal_bottom_right", "window", "softcap", "alibi_per_batch_causal",
              "key_lengths_bottom_right_window", "bool_mask", "every_rule"]


@dataclass
class Problem:
    q: np.ndarray  # float64, rounded to the dtype under test
    k: np.ndarray
    v: np.ndarray
    ours: dict  # NumPy keyword arguments for the API (converted by ``call_options``)
    oracle: dict  # keyword arguments for ``ref_attention``


def make_problem(rule: str, dtype: str, *, seed: int = 0, h: int = H, hkv: int = HKV,
                 tq: int = TQ) -> Problem:
    spec = dict(RULES[rule])
    tk = spec.pop("tk", TK)
    rng = np.random.default_rng(seed + sorted(RULES).index(rule))
    q = rounded(rng.standard_normal((B, h, tq, E)), dtype)
    k = rounded(rng.standard_normal((B, hkv, tk, E)), dtype)
    v = rounded(rng.standard_normal((B, hkv, tk, EV)), dtype)
    ours, oracle = {"enable_gqa": True}, {"enable_gqa": True}
    for key, value in spec.items():
        if key == "mask":
            mask = {"bool": lambda: rng.random((B, 1, tq, tk)) < 0.7,
                    "float": lambda: rounded(np.where(rng.random((1, h, tq, tk)) < 0.8,
                                                      rng.standard_normal((1, h, tq, tk)),
                                                      -np.inf), dtype),
                    "heads": lambda: rng.random((h, 1, tk)) < 0.7}[value]()
            ours["attn_mask"] = oracle["mask"] = mask
        elif key == "alignment":
            ours["causal_alignment"] = oracle["alignment"] = value
        elif key == "alibi_slopes":
            shape = (h,) if value == "heads" else (B, h)
            ours[key] = oracle[key] = rounded(rng.uniform(0.1, 1.0, shape), dtype)
        elif key == "key_lengths":
            ours[key] = oracle[key] = np.array(value)
        else:
            ours[key] = oracle[key] = value
    return Problem(q, k, v, ours, oracle)


def call_options(ours: dict, xp, device, dtype: str) -> dict:
    """The API's keyword arguments, arrays in ``xp`` (float ones in ``dtype``)."""
    out = {}
    for key, value in ours.items():
        if isinstance(value, np.ndarray):
            floating = value.dtype.kind == "f"
            out[key] = to_xp(value, xp, dtype=dtype if floating else None, device=device)
        else:
            out[key] = value
    return out


def inputs(p: Problem, xp, device, dtype: str):
    return tuple(to_xp(a, xp, dtype=dtype, device=device) for a in (p.q, p.k, p.v))


def check_runs(impl: Impl, q, k, v, **options) -> None:
    """``explain()`` names what ran: the implementation asked for, and its CUDA family."""
    if impl.name in ("auto", "native"):
        return
    why = polyattn.explain(q, k, v, implementation=impl.name, **options)
    assert why.implementation == impl.name, why
    cuda_family_ran(impl.case, why)


# --- forward: every rule, out and lse ---------------------------------------------------------

@pytest.mark.parametrize("rule", list(RULES))
def test_rule_matches_the_oracle(xp, device, dtype_name, impl, rule):
    p = make_problem(rule, dtype_name, **impl.heads)
    q, k, v = inputs(p, xp, device, dtype_name)
    options = call_options(p.ours, xp, device, dtype_name)
    check_runs(impl, q, k, v, **options)
    out, lse = polyattn.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                     implementation=impl.name, **options)
    ref, ref_lse, _ = ref_attention(p.q, p.k, p.v, **p.oracle)
    assert_namespace_device(out, xp, device, dtype_of(xp, dtype_name))
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


@pytest.mark.parametrize(("h", "hkv"), [(4, 1), (3, 3)], ids=["mqa", "mha"])
def test_gqa_and_mqa(xp, device, dtype_name, impl, h, hkv):
    p = make_problem("causal", dtype_name, h=h, hkv=hkv)
    q, k, v = inputs(p, xp, device, dtype_name)
    check_runs(impl, q, k, v, **p.ours)
    out = polyattn.scaled_dot_product_attention(q, k, v, implementation=impl.name, **p.ours)
    assert_close(out, ref_attention(p.q, p.k, p.v, **p.oracle)[0], dtype_name)


@pytest.mark.parametrize("kind", ["bool_mask", "float_mask", "key_lengths", "causal"])
def test_fully_masked_rows_give_zero_and_minus_inf(xp, device, dtype_name, impl, kind):
    p = make_problem("plain", dtype_name, **impl.heads)
    rows = p.q.shape[:-1]  # (B, H, Tq)
    tk = p.k.shape[-2]
    if kind in ("bool_mask", "float_mask"):
        visible = np.ones((*rows, tk), dtype=bool)
        visible[0, 1, 2] = False
        visible[1, :, 15:] = False
        mask = visible if kind == "bool_mask" else np.where(visible, 0.5, -np.inf)
        p.ours["attn_mask"] = p.oracle["mask"] = mask
        dead = ~visible.any(-1)
    elif kind == "key_lengths":  # a batch row without keys
        p.ours["key_lengths"] = p.oracle["key_lengths"] = np.array([0, 11])
        dead = np.zeros(rows, dtype=bool)
        dead[0] = True
    else:  # bottom-right with Tq > Tk: the first Tq - Tk rows see nothing
        p = make_problem("causal_bottom_right_tq_gt_tk", dtype_name, **impl.heads)
        dead = np.zeros(rows, dtype=bool)
        dead[:, :, :TQ - p.k.shape[-2]] = True
    q, k, v = inputs(p, xp, device, dtype_name)
    options = call_options(p.ours, xp, device, dtype_name)
    check_runs(impl, q, k, v, **options)
    out, lse = polyattn.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                     implementation=impl.name, **options)
    ref, ref_lse, _ = ref_attention(p.q, p.k, p.v, **p.oracle)
    got, got_lse = to_numpy(out), to_numpy(lse)
    assert not np.isnan(got).any() and not np.isnan(got_lse).any()
    assert np.all(got[dead] == 0) and np.all(np.isneginf(got_lse[dead]))
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


# --- keys past key_lengths are never read (forward and backward) ----------------------------

def past_key_lengths(a: np.ndarray, lengths: np.ndarray, fill) -> np.ndarray:
    """``a`` (B, H, Tk, F) with the positions past each batch row's length set to ``fill``:
    a scalar, or an array of a's shape to take the values from."""
    pad = (np.arange(a.shape[-2]) >= lengths[:, None])[:, None, :, None]
    return np.where(pad, fill, a)


def garbage_for(kind: str, a: np.ndarray, dtype: str, seed: int) -> np.ndarray:
    """What a preallocated cache may hold: NaN, inf (-inf in values), or a mix of NaN,
    +-inf and the dtype's largest finite value."""
    if kind == "nan":
        return np.full(a.shape, np.nan)
    if kind == "inf":
        return np.full(a.shape, np.inf)
    values = np.array([np.nan, np.inf, -np.inf, np.finfo(dtype).max])
    return np.random.default_rng(seed).choice(values, a.shape)


@pytest.mark.parametrize("rule", ["key_lengths", "key_lengths_bottom_right_window",
                                  "every_rule"])
@pytest.mark.parametrize("garbage", [pytest.param("nan", marks=pytest.mark.exhaustive),
                                     pytest.param("inf", marks=pytest.mark.exhaustive),
                                     "mixed"])
def test_keys_past_key_lengths_are_never_read(xp, device, dtype_name, impl, rule, garbage):
    """NaN, inf or a mix (with the largest finite value) in keys and values past each
    row's length (a preallocated cache) has no effect: out, lse and every gradient are
    bitwise those of zeros there, and within tolerance of the oracle; the gradients of
    the padding are 0."""
    p = make_problem(rule, dtype_name, **impl.heads)
    lengths = p.ours["key_lengths"]
    bad_k = garbage_for(garbage, p.k, dtype_name, 1)
    bad_v = -garbage_for(garbage, p.v, dtype_name, 2)
    dirty = [past_key_lengths(a, lengths, bad) for a, bad in ((p.k, bad_k), (p.v, bad_v))]
    clean = [past_key_lengths(a, lengths, 0.0) for a in (p.k, p.v)]
    q = to_xp(p.q, xp, dtype=dtype_name, device=device)
    kv = {which: [to_xp(a, xp, dtype=dtype_name, device=device) for a in arrays]
          for which, arrays in (("dirty", dirty), ("clean", clean))}
    options = call_options(p.ours, xp, device, dtype_name)
    check_runs(impl, q, *kv["dirty"], **options)
    results = {which: [to_numpy(x) for x in polyattn.scaled_dot_product_attention(
        q, *arrays, return_lse=True, implementation=impl.name, **options)]
        for which, arrays in kv.items()}
    ref, ref_lse, _ = ref_attention(p.q, p.k, p.v, **p.oracle)
    assert_close(results["dirty"][0], ref, dtype_name)
    assert_lse_close(results["dirty"][1], ref_lse, dtype_name)
    for what, got, want in zip(("out", "lse"), results["dirty"], results["clean"],
                               strict=True):
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: not that of zero padding")
    if impl.name in NO_VJP or impl.backward_elsewhere:
        return  # test_gradients_match_the_oracle checks that it says why
    g = to_xp(rounded(np.random.default_rng(5).standard_normal(ref.shape), dtype_name), xp,
              dtype=dtype_name, device=device)
    grads = {}
    for which, arrays in kv.items():
        _, pullback = polyattn.attention_vjp(q, *arrays, implementation=impl.name, **options)
        grads[which] = [to_numpy(x) for x in pullback(g)]
    want = ref_attention_vjp(p.q, p.k, p.v, to_numpy(g), **p.oracle)
    for name, got, same, ref_grad in zip("qkv", grads["dirty"], grads["clean"], want,
                                         strict=True):
        assert np.isfinite(got).all(), f"d{name}: not finite"
        assert rel_error(got, ref_grad) <= GRAD_TOL[dtype_name], f"d{name}"
        np.testing.assert_array_equal(got, same, err_msg=f"d{name}: not that of zero padding")
    for grad in grads["dirty"][1:]:
        assert np.all(past_key_lengths(grad, lengths, 0.0) == grad), "padding gradient not 0"


@pytest.mark.parametrize("rule", ["key_lengths_bottom_right_window", "every_rule"])
def test_attention_weights_never_read_keys_past_key_lengths(xp, device, dtype_name, rule):
    """``attention_weights`` (one implementation, no ``implementation=``): a mix of NaN,
    +-inf and the largest finite value past the lengths gives the oracle's weights, 0
    past the lengths."""
    p = make_problem(rule, dtype_name)
    lengths = p.ours["key_lengths"]
    k = past_key_lengths(p.k, lengths, garbage_for("mixed", p.k, dtype_name, 3))
    w = polyattn.attention_weights(to_xp(p.q, xp, dtype=dtype_name, device=device),
                                   to_xp(k, xp, dtype=dtype_name, device=device),
                                   **call_options(p.ours, xp, device, dtype_name))
    _, _, ref_w = ref_attention(p.q, p.k, p.v, **p.oracle)
    assert_close(w, ref_w, dtype_name, what="weights")
    past = np.arange(p.k.shape[-2]) >= lengths[:, None, None, None]          # (B, 1, 1, Tk)
    assert np.all(to_numpy(w)[np.broadcast_to(past, ref_w.shape)] == 0)


# --- dropout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["plain", "every_rule"])
def test_dropout_drops_the_same_weights_everywhere(xp, device, dtype_name, impl, rule):
    """The same seed drops the same weights on every implementation: the result is the
    float64 reference implementation's on the same values."""
    p = make_problem(rule, dtype_name, **impl.heads)
    q, k, v = inputs(p, xp, device, dtype_name)
    options = call_options(p.ours, xp, device, dtype_name)
    options.update(dropout_p=0.3, dropout_seed=2**40 + 11)
    if impl.name == "distributed":
        with pytest.raises(ValueError, match="dropout"):
            polyattn.scaled_dot_product_attention(q, k, v, implementation=impl.name,
                                                  **options)
        return
    check_runs(impl, q, k, v, **options)
    out, lse = polyattn.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                     implementation=impl.name, **options)
    numpy_options = dict(p.ours, dropout_p=0.3, dropout_seed=2**40 + 11)
    want, want_lse = polyattn.scaled_dot_product_attention(
        p.q, p.k, p.v, return_lse=True, implementation="reference", **numpy_options)
    plain = ref_attention(p.q, p.k, p.v, **p.oracle)[0]
    assert rel_error(want, plain) > 0.01  # something was dropped
    assert_close(out, want, dtype_name)
    assert_lse_close(lse, want_lse, dtype_name)  # lse is of the scores before dropout


# --- gradients ------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", GRAD_RULES)
def test_gradients_match_the_oracle(xp, device, dtype_name, impl, rule):
    """``attention_vjp``: out and the gradients of ``out·g + lse·g_lse``."""
    if impl.backward_elsewhere:
        pytest.skip("the tensor-core family's backward pass is the register-tiled one, "
                    "which numba_cuda-tiled runs on the simulator")
    p = make_problem(rule, dtype_name, **impl.heads)
    q, k, v = inputs(p, xp, device, dtype_name)
    options = call_options(p.ours, xp, device, dtype_name)
    if impl.name in NO_VJP:
        with pytest.raises(ValueError, match=NO_VJP[impl.name]):
            polyattn.attention_vjp(q, k, v, implementation=impl.name, **options)
        return
    check_runs(impl, q, k, v, **options)
    rng = np.random.default_rng(7)
    ref, ref_lse, _ = ref_attention(p.q, p.k, p.v, **p.oracle)
    g = rounded(rng.standard_normal(ref.shape), dtype_name)
    g_lse = rounded(rng.standard_normal(ref_lse.shape), dtype_name)
    (out, lse), pullback = polyattn.attention_vjp(q, k, v, return_lse=True,
                                                  implementation=impl.name, **options)
    grads = pullback(to_xp(g, xp, dtype=dtype_name, device=device),
                     to_xp(g_lse, xp, dtype=dtype_name, device=device))
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)
    want = ref_attention_vjp(p.q, p.k, p.v, g, np.where(np.isneginf(ref_lse), 0, g_lse),
                             **p.oracle)
    for name, got, x, ref_grad in zip("qkv", grads, (q, k, v), want, strict=True):
        assert_namespace_device(got, xp, device, x.dtype)
        err = rel_error(to_numpy(got), ref_grad)
        assert err <= GRAD_TOL[dtype_name], f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("rule", ["causal_bottom_right", "every_rule"])
def test_torch_autograd_matches_the_oracle(backend, dtype_name, impl, rule):
    """On torch tensors every implementation is differentiable by autograd."""
    if backend is not Backend.TORCH:
        pytest.skip("torch autograd: the torch backend")
    import torch

    p = make_problem(rule, dtype_name)
    q, k, v = (torch.tensor(a, dtype=getattr(torch, dtype_name), requires_grad=True)
               for a in (p.q, p.k, p.v))
    options = {key: torch.tensor(x) if isinstance(x, np.ndarray) else x
               for key, x in p.ours.items()}
    for key in ("attn_mask", "alibi_slopes"):
        if key in options and options[key].dtype.is_floating_point:
            options[key] = options[key].to(getattr(torch, dtype_name))
    out = polyattn.scaled_dot_product_attention(q, k, v, implementation=impl.name, **options)
    ref = ref_attention(p.q, p.k, p.v, **p.oracle)[0]
    g = rounded(np.random.default_rng(8).standard_normal(ref.shape), dtype_name)
    (out * torch.tensor(g, dtype=out.dtype)).sum().backward()
    assert_close(out, ref, dtype_name)
    for name, x, ref_grad in zip("qkv", (q, k, v), ref_attention_vjp(p.q, p.k, p.v, g,
                                                                     **p.oracle), strict=True):
        err = rel_error(x.grad.numpy(), ref_grad)
        assert err <= GRAD_TOL[dtype_name], f"d{name}: relative error {err:.3g}"


# --- float16 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["causal", "every_rule"])
def test_float16(backend, xp, device, impl, rule):
    """float16 inputs: computed with float32 scores and statistics, a float16 result within
    the float16 contract (on the CUDA kernel: the tensor cores' f16 arithmetic)."""
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend.value} has no float16")
    # more than 16 query rows go to the tensor cores, whichever exact kernel is chosen
    tq = 8 if impl.case == "numba_cuda-rows" else TQ
    p = make_problem(rule, "float16", tq=tq, **impl.heads)
    q, k, v = inputs(p, xp, device, "float16")
    options = call_options(p.ours, xp, device, "float16")
    if impl.case == "numba_cuda-tiled":
        pytest.skip("float16 runs on the tensor cores (numba_cuda-tc), or on the rows kernel")
    check_runs(impl, q, k, v, **options)
    out = polyattn.scaled_dot_product_attention(q, k, v, implementation=impl.name, **options)
    assert_namespace_device(out, xp, device, xp.float16)
    ref = ref_attention(p.q, p.k, p.v, **p.oracle)[0]
    err = rel_error(to_numpy(out), ref)
    assert err <= TOLERANCE["float16"], f"relative error {err:.3g}"


def test_every_implementation_has_an_id_with_its_name():
    for case in EVERY_IMPLEMENTATION:
        assert public_name(case) in case
        assert public_name(case) in ("reference", "chunked", "auto", "native", "numba_cpu",
                                     "numba_cuda", "distributed")
