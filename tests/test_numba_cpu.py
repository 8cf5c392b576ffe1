"""The fused Numba CPU kernel (implementation "numba_cpu"): its exponential, every rule of
§4.1 against the float64 oracle, DESIGN §4's NaN and inf semantics, and concurrent callers.

Runs where Numba is installed (``nox -s numba_cpu``); skipped elsewhere with the reason.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, ref_attention

import polyattn
from polyattn import scaled_dot_product_attention as sdpa

pytest.importorskip("numba", reason="the numba_cpu kernel needs Numba (pip install numba)")
from polyattn.implementations import numba_cpu

# --- the exponential ---------------------------------------------------------------------

@pytest.mark.parametrize(("dtype", "tol"), [(np.float32, 2.5e-7), (np.float64, 1e-15)])
def test_exp_accuracy(dtype, tol):
    lo = numba_cpu.EXP_MIN[np.dtype(dtype)]
    x = np.concatenate([np.linspace(lo, 0.0, 200001), -np.logspace(-30, 0, 301)]).astype(dtype)
    got = numba_cpu.exp(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) <= tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_edges(dtype):
    lo = numba_cpu.EXP_MIN[np.dtype(dtype)]
    x = np.array([-np.inf, np.nan, 0.0, -0.0, lo, np.nextafter(dtype(lo), dtype(-np.inf)),
                  -745.2, -1e30, 1e-30], dtype=dtype)
    got = numba_cpu.exp(x)
    assert got[0] == 0.0                           # -inf
    assert np.isnan(got[1])                        # NaN stays NaN
    assert got[2] == 1.0 and got[3] == 1.0
    assert got[4] >= np.finfo(dtype).tiny          # the smallest argument: a normal result
    assert got[5] == 0.0 and got[6] == 0.0 and got[7] == 0.0   # subnormal results: 0
    assert abs(got[8] - 1.0) <= np.finfo(dtype).eps


# --- every rule against the oracle --------------------------------------------------------

def _inputs(rng, b=2, h=4, hkv=2, tq=37, tk=300, e=8, ev=6):
    return (rng.standard_normal((b, h, tq, e)), rng.standard_normal((b, hkv, tk, e)),
            rng.standard_normal((b, hkv, tk, ev)))


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal_bottom_right": {"is_causal": True, "alignment": "bottom_right"},
    "window": {"window": (40, 7)},
    "causal_window_softcap": {"is_causal": True, "alignment": "bottom_right",
                              "window": (25, 0), "softcap": 2.0},
    "alibi": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "alibi_per_batch": {"alibi_slopes": np.array([[0.5, 0.2, 0.1, 0.05], [0.3, 0.2, 0.1, 0.0]])},
    "key_lengths": {"key_lengths": np.array([170, 300])},
    "key_lengths_bottom_right": {"key_lengths": np.array([130, 9]), "is_causal": True,
                                 "alignment": "bottom_right", "window": (50, 0)},
    "lengths_alibi_softcap": {"key_lengths": np.array([299, 41]), "softcap": 5.0,
                              "alibi_slopes": np.array([0.3, 0.2, 0.1, 0.05])},
    "bool_mask": {"mask": "bool"},
    "float_mask_causal": {"mask": "float", "is_causal": True},
    "head_mask_window": {"mask": "heads", "window": (None, 3)},
}


def _options(case, rng, tq, tk):
    ours, oracle = {}, {}
    for name, value in case.items():
        if name == "mask":
            m = {"bool": lambda: rng.random((2, 1, tq, tk)) > 0.3,
                 "float": lambda: rng.standard_normal((1, 4, tq, tk)),
                 "heads": lambda: rng.random((4, 1, tk)) > 0.2}[value]()
            ours["attn_mask"] = oracle["mask"] = m
        elif name == "alignment":
            ours["causal_alignment"] = oracle["alignment"] = value
        else:
            ours[name] = oracle[name] = value
    return ours, oracle


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_oracle(case, dtype):
    rng = np.random.default_rng(sorted(CASES).index(case))
    q, k, v = _inputs(rng)
    ours, oracle = _options(CASES[case], rng, 37, 300)
    args = [x.astype(dtype) for x in (q, k, v)]
    out, lse = sdpa(*args, enable_gqa=True, return_lse=True, implementation="numba_cpu", **ours)
    ref, ref_lse, _ = ref_attention(q, k, v, enable_gqa=True, **oracle)
    assert out.dtype == np.dtype(dtype)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)


def test_layouts_broadcasts_and_long_queries():
    """(B, T, H, E) views, a key/value batch axis broadcast, more queries than keys."""
    rng = np.random.default_rng(30)
    q = rng.standard_normal((3, 700, 4, 16))                 # (B, T, H, E)
    k = rng.standard_normal((1, 260, 2, 16))
    v = rng.standard_normal((1, 260, 2, 16))
    kw = {"is_causal": True, "causal_alignment": "bottom_right", "enable_gqa": True}
    got = sdpa(q, k, v, layout="BTHE", implementation="numba_cpu", **kw)
    want = sdpa(q, k, v, layout="BTHE", implementation="reference", **kw)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_nan_and_inf():
    rng = np.random.default_rng(31)
    q, k, v = _inputs(rng, b=1, tq=20, tk=20)
    mask = np.ones((20, 20), dtype=bool)
    mask[4] = False                                          # a fully masked row
    q[0, 1, 7, 0] = np.nan                                   # a NaN query row
    k[0, 0, 15, 3] = np.inf                                  # an inf key
    with np.errstate(invalid="ignore"):
        want, want_lse = sdpa(q, k, v, attn_mask=mask, enable_gqa=True, is_causal=True,
                              return_lse=True, implementation="reference")
    got, lse = sdpa(q, k, v, attn_mask=mask, enable_gqa=True, is_causal=True,
                    return_lse=True, implementation="numba_cpu")
    assert np.all(got[..., 4, :] == 0) and np.all(lse[..., 4] == -np.inf)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-12, atol=1e-12)


def test_padding_past_key_lengths_is_never_read():
    rng = np.random.default_rng(32)
    q, k, v = _inputs(rng, b=2, tq=5, tk=200)
    k[:, :, 120:] = np.nan
    v[:, :, 120:] = np.inf
    got = sdpa(q, k, v, enable_gqa=True, key_lengths=np.array([120, 64]),
               implementation="numba_cpu")
    want = sdpa(q[..., :, :], k[:, :, :120], v[:, :, :120], enable_gqa=True,
                key_lengths=np.array([120, 64]), implementation="reference")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_concurrent_callers_get_the_sequential_results():
    rng = np.random.default_rng(33)
    problems = [_inputs(rng, tq=300, tk=300, e=32, ev=32) for _ in range(8)]
    problems = [tuple(x.astype(np.float32) for x in p) for p in problems]
    kw = {"enable_gqa": True, "is_causal": True, "implementation": "numba_cpu"}
    sequential = [sdpa(*p, **kw) for p in problems]
    results: list[np.ndarray | None] = [None] * 8
    start = threading.Barrier(8)

    def run(i):
        start.wait()
        results[i] = sdpa(*problems[i], **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, sequential, strict=True):
        np.testing.assert_array_equal(got, want)
    assert numba_cpu.threading_layer() in ("tbb", "omp", "workqueue")


# --- what it does not do yet, said plainly --------------------------------------------------

def test_refusals_name_the_reason():
    q = np.zeros((1, 2, 8, 4))
    with pytest.raises(ValueError, match=r"numba_cpu.*dropout"):
        sdpa(q, q, q, dropout_p=0.1, dropout_seed=1, implementation="numba_cpu")
    with pytest.raises(ValueError, match=r"numba_cpu.*no backward pass"):
        polyattn.attention_vjp(q, q, q, implementation="numba_cpu")
    strict = pytest.importorskip("array_api_strict")
    qs = strict.asarray(q)
    with pytest.raises(ValueError, match=r"numba_cpu.*NumPy arrays"):
        sdpa(qs, qs, qs, implementation="numba_cpu")
    assert polyattn.explain(q, q, q, implementation="numba_cpu").implementation == "numba_cpu"
    assert polyattn.explain(q, q, q).implementation != "numba_cpu"     # not chosen by "auto"
