"""Dropout by Philox4x32-10 counters (DESIGN §4.1): one keep-mask on every backend.

* The cipher against Random123's known-answer vectors, in Array-API calls on
  this session's backend (on JAX with and without 64-bit types: the uint32
  path) and on NumPy (:func:`~polyattn.rules.dropout.philox_numpy`).
* The keep-mask on this backend is bitwise the one NumPy computes in the same
  process; every session compares against NumPy, so all backends agree.
* The weights that ``attention_weights(dropout_p=...)`` returns, and those that
  ``scaled_dot_product_attention`` multiplies by the values (read back with the
  identity as values), are dropped exactly where §4.1's counters say, on every
  implementation.
* Statistics, on deterministic seeds (a bound that holds once holds always):
  the mean over many seeds approaches the output without dropout; the keep
  rate lies within 4σ of ``1 - p``.
* Errors name ``dropout_p`` and ``dropout_seed``; dropout next to key lengths,
  causal masking and fully masked rows stays finite; ``"native"`` refuses
  dropout (its generator is not ours) and ``"auto"`` passes over it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from _support import (
    CASES,
    NUMPY_SESSION_ONLY,
    SIMULATOR,
    check_dropout_refused,
    check_vjp_refused,
    use_implementation,
)
from helpers import (
    NATIVE_BACKENDS,
    Backend,
    ref_attention,
    rel_error,
    selected_backends,
    to_numpy,
    to_xp,
)

import polyattn
from polyattn.backends.array_api import blocked as chunked
from polyattn.rules import dropout as _dropout

#: The implementation cases that run dropout: every one but "native", which refuses it
#: (:func:`test_native_refuses_dropout`); "distributed" refuses it too (checked where it
#: comes up, :func:`_support.check_dropout_refused`).
IMPLEMENTATIONS = tuple(n for n in CASES if n != "native")
#: Tests on NumPy arrays alone run in the session that selects NumPy.
NUMPY_ONLY = NUMPY_SESSION_ONLY
MASK32 = 0xFFFFFFFF

#: Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key, output).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
KAT_IDS = ["zeros", "ones", "pi"]


def seed_of(key: tuple[int, int]) -> int:
    """The ``dropout_seed`` whose key words are ``key`` (low word first)."""
    return key[0] | (key[1] << 32)


def numpy_keep(shape: tuple[int, ...], p: float, seed: int) -> np.ndarray:
    """§4.1's keep-mask of a (B…, H, Tq, Tk) matrix: element n (row-major flat index) is kept
    iff the first Philox word of counter (n mod 2³², n div 2³², 0, 0) is ≥ ceil(p·2³²)."""
    n = np.arange(math.prod(shape), dtype=np.uint64).reshape(shape)
    x0 = _dropout.philox_numpy(n & np.uint64(MASK32), n >> np.uint64(32), 0, 0, seed)[0]
    return x0 >= np.uint64(_dropout.threshold(p))


def jitted(f: Any, backend: Backend) -> Any:
    """``f`` under ``jax.jit`` on JAX (one compilation rather than one per operation)."""
    if backend is not Backend.JAX:
        return f
    import jax

    return jax.jit(f)


@pytest.fixture
def narrow_jax():
    """JAX with 64-bit types switched off for the test (the uint32 words of the cipher)."""
    jax = pytest.importorskip("jax")
    was = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", False)
    try:
        yield jax
    finally:
        jax.config.update("jax_enable_x64", was)


def _jax_session() -> None:
    if Backend.JAX not in selected_backends():
        pytest.skip("JAX is tested where POLYATTN_TEST_BACKENDS selects jax")


# --------------------------------------------------------------------------- #
# The cipher: known answers
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS, ids=KAT_IDS)
def test_philox_numpy_known_answers(counter, key, expected):
    got = _dropout.philox_numpy(*counter, seed_of(key))
    assert tuple(int(x) for x in got) == expected


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS, ids=KAT_IDS)
def test_philox_known_answers(xp, device, counter, key, expected):
    """The Array-API cipher on int64 words (uint32 where int64 is missing)."""
    words = [xp.asarray([c, 0], dtype=xp.int64, device=device) for c in counter]
    got = _dropout.philox(*words, seed_of(key), xp)
    assert tuple(int(to_numpy(x)[0]) for x in got) == expected
    assert tuple(int(to_numpy(x)[1]) for x in got) == tuple(     # counter 0 under that key
        int(x) for x in _dropout.philox_numpy(0, 0, 0, 0, seed_of(key)))


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS, ids=KAT_IDS)
def test_philox_known_answers_jax_32_bit(narrow_jax, counter, key, expected):
    """JAX without ``jax_enable_x64``: the cipher on uint32 words, the same bits."""
    _jax_session()
    jnp = narrow_jax.numpy
    import array_api_compat

    xp = array_api_compat.array_namespace(jnp.asarray(0))
    words = [jnp.asarray([c], dtype=jnp.uint32) for c in counter]
    got = _dropout.philox(*words, seed_of(key), xp)
    assert all(x.dtype == jnp.uint32 for x in got)
    assert tuple(int(np.asarray(x)[0]) for x in got) == expected


# --------------------------------------------------------------------------- #
# The keep-mask: the same bits on every backend
# --------------------------------------------------------------------------- #

#: Query rows whose flat weight index n = row·Tk + col passes 2³² (the counter's second word).
ROWS = np.array([0, 1, 2, 3, 4_294_967, 4_294_968, 9_000_000, 2**31 - 1], dtype=np.int64)
TK = 1000


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("seed", [0, 7, 2**63 + 12345])
def test_keep_is_numpy_keep(xp, device, p, seed):
    """``keep`` on this backend equals the NumPy definition bit for bit, past n = 2³² too."""
    row = to_xp(ROWS[:, None], xp, device=device)
    col = to_xp(np.arange(TK, dtype=np.int64)[None, :], xp, device=device)
    got = to_numpy(_dropout.keep(row, col, TK, seed, p, xp))
    n = (ROWS[:, None] * TK + np.arange(TK)).astype(np.uint64)
    x0 = _dropout.philox_numpy(n & np.uint64(MASK32), n >> np.uint64(32), 0, 0, seed)[0]
    expected = x0 >= np.uint64(_dropout.threshold(p))
    assert got.dtype == bool and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    assert (n >> np.uint64(32)).max() > 0


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_jax_32_bit_is_numpy_keep(narrow_jax, p):
    """Without 64-bit types the flat index is carried over two uint32 words: same mask."""
    _jax_session()
    import array_api_compat

    jnp = narrow_jax.numpy
    xp = array_api_compat.array_namespace(jnp.asarray(0))
    row = jnp.asarray(ROWS[:, None].astype(np.uint32))
    col = jnp.asarray(np.arange(TK, dtype=np.uint32)[None, :])
    got = np.asarray(_dropout.keep(row, col, TK, 2**63 + 12345, p, xp))
    n = (ROWS[:, None] * TK + np.arange(TK)).astype(np.uint64)
    x0 = _dropout.philox_numpy(n & np.uint64(MASK32), n >> np.uint64(32), 0, 0,
                               2**63 + 12345)[0]
    np.testing.assert_array_equal(got, x0 >= np.uint64(_dropout.threshold(p)))


def test_keep_grouped_tiles_the_whole_mask(xp, device):
    """A tile of the grouped layout (B…, Hkv, G, bq, bk) is the matching block of the
    (B…, H, Tq, Tk) mask, with query head h = hk·G + g."""
    batch, hkv, g, tq, tk = (2, 3), 2, 3, 9, 11
    whole = numpy_keep((*batch, hkv * g, tq, tk), 0.3, 42)
    tile = to_numpy(_dropout.keep_grouped(batch, hkv, g, tq, tk, 2, 7, 4, 10, 42, 0.3, xp,
                                          device))
    expected = whole.reshape(*batch, hkv, g, tq, tk)[..., 2:7, 4:10]
    np.testing.assert_array_equal(tile, expected)


def test_threshold_is_exact():
    """``x0 >= ceil(p·2³²)`` is ``x0 / 2³² >= p`` for every 32-bit word."""
    for p in (0.0, 0.1, 0.25, 0.5, 1 / 3, 0.999, 1 - 2**-33):
        t = _dropout.threshold(p)
        assert (t - 1) / 2**32 < p <= t / 2**32 or (p == 0 and t == 0)
    assert _dropout.threshold(0.5) == 2**31


# --------------------------------------------------------------------------- #
# The weights that attention drops
# --------------------------------------------------------------------------- #

@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, backend, monkeypatch):
    """Each implementation case, with blocks small enough to be crossed (whole on JAX and
    Dask)."""
    name = use_implementation(request.param, backend, monkeypatch)
    if backend is Backend.DASK:
        monkeypatch.setattr(chunked, "BLOCK_Q", 16)
        monkeypatch.setattr(chunked, "BLOCK_K", 16)
    return name


def _problem(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """query (2, 4, 6, 4) and key (2, 2, 9, 4): batch rows, GQA, Tq ≠ Tk, small scores."""
    return 0.5 * rng.standard_normal((2, 4, 6, 4)), 0.5 * rng.standard_normal((2, 2, 9, 4))


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_dropped_weights_follow_the_counters(xp, device, backend, implementation, dtype_name):
    """``attention_weights`` and ``scaled_dot_product_attention`` (value = identity, so out
    is the dropped weights) drop exactly §4.1's weights and scale the kept ones by
    1 / (1 - p); every implementation alike."""
    check_dropout_refused(implementation, xp, device)
    p, seed = 0.4, 31337
    q, k = _problem(np.random.default_rng(0))
    tk = k.shape[-2]
    eye = np.broadcast_to(np.eye(tk), (*k.shape[:-1], tk)).copy()   # (B, Hkv, Tk, Tk)
    qx, kx, vx = (to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, eye))
    opts = {"enable_gqa": True, "dropout_p": p, "dropout_seed": seed}
    weights = jitted(lambda q, k: polyattn.attention_weights(q, k, **opts), backend)(qx, kx)
    out = jitted(lambda q, k, v: polyattn.scaled_dot_product_attention(
        q, k, v, implementation=implementation, **opts), backend)(qx, kx, vx)
    keep = numpy_keep((2, 4, 6, tk), p, seed)
    _, _, undropped = ref_attention(q, np.repeat(k, 2, axis=-3), np.repeat(k, 2, axis=-3))
    tol = 1e-12 if dtype_name == "float64" else 1e-5
    for what, x in (("attention_weights", weights), ("scaled_dot_product_attention", out)):
        x = to_numpy(x)
        assert x.dtype == np.dtype(dtype_name), what
        np.testing.assert_array_equal(x != 0, keep, err_msg=what)
        assert rel_error(x, undropped * keep / (1 - p)) <= tol, what


@pytest.mark.parametrize("implementation_name", ["reference", "chunked"])
def test_dropped_weights_jax_32_bit(narrow_jax, implementation_name, monkeypatch):
    """JAX without 64-bit types (float32, uint32 counters): the same weights are dropped,
    with a seed and a threshold (p > 1/2) past 2³¹."""
    _jax_session()
    use_implementation(implementation_name, Backend.JAX, monkeypatch)
    jnp = narrow_jax.numpy
    p, seed = 0.6, 2**63 + 2**32 + 5
    q, k = _problem(np.random.default_rng(0))
    tk = k.shape[-2]
    eye = np.broadcast_to(np.eye(tk), (*k.shape[:-1], tk))          # (B, Hkv, Tk, Tk)
    qx, kx, vx = (jnp.asarray(a, dtype=jnp.float32) for a in (q, k, eye))
    out = narrow_jax.jit(lambda q, k, v: polyattn.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, implementation=implementation_name, dropout_p=p,
        dropout_seed=seed))(qx, kx, vx)
    np.testing.assert_array_equal(np.asarray(out) != 0, numpy_keep((2, 4, 6, tk), p, seed))


@pytest.mark.parametrize("x64", [False, True])
def test_traced_seed_under_jax_jit(x64, monkeypatch):
    """A seed passed to a jitted function is traced: one compilation for every seed, and
    the same weights dropped as with the seed given as an int, with and without x64."""
    _jax_session()
    jax = pytest.importorskip("jax")
    was = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", x64)
    try:
        jnp = jax.numpy
        p = 0.6
        q, k = _problem(np.random.default_rng(1))
        tk = k.shape[-2]
        eye = np.broadcast_to(np.eye(tk), (*k.shape[:-1], tk))      # out = the weights
        qx, kx, vx = (jnp.asarray(a, dtype=jnp.float32) for a in (q, k, eye))

        def weights(q, k, v, seed):
            return polyattn.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                         dropout_p=p, dropout_seed=seed)

        step = jax.jit(weights)
        grad = jax.jit(jax.grad(lambda q, seed: weights(q, kx, vx, seed).sum()))
        seeds = [0, 7, 2**31 - 1] + ([2**40 + 3] if x64 else [])
        for seed in seeds:
            out = step(qx, kx, vx, seed)
            np.testing.assert_array_equal(np.asarray(out) != 0,
                                          numpy_keep((2, 4, 6, tk), p, seed), err_msg=seed)
            grad(qx, seed)
        assert step._cache_size() == 1 and grad._cache_size() == 1
    finally:
        jax.config.update("jax_enable_x64", was)


def test_seed_as_a_0d_integer_array(xp, device):
    """A concrete 0-d integer array is read as its int; other arrays are refused."""
    q, k = _problem(np.random.default_rng(2))
    args = [to_xp(a, xp, dtype="float64", device=device) for a in (q, k, k)]
    want = polyattn.scaled_dot_product_attention(*args, enable_gqa=True, dropout_p=0.5,
                                                 dropout_seed=11)
    seed = to_xp(np.asarray(11), xp, device=device)
    got = polyattn.scaled_dot_product_attention(*args, enable_gqa=True, dropout_p=0.5,
                                                dropout_seed=seed)
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
    with pytest.raises(TypeError, match="0-d integer array; got an array of shape"):
        polyattn.scaled_dot_product_attention(*args, enable_gqa=True, dropout_p=0.5,
                                              dropout_seed=to_xp(np.arange(2), xp,
                                                                 device=device))
    with pytest.raises(TypeError, match="0-d integer array; got dtype"):
        polyattn.scaled_dot_product_attention(*args, enable_gqa=True, dropout_p=0.5,
                                              dropout_seed=to_xp(np.asarray(1.0), xp,
                                                                 device=device))


def test_dropout_zero_is_no_dropout(xp, device, backend, implementation):
    """``dropout_p=0`` with a seed gives the bits of a call without dropout."""
    q, k = _problem(np.random.default_rng(1))
    qx, kx = (to_xp(a, xp, device=device) for a in (q, k))

    def f(**extra: Any) -> np.ndarray:
        return to_numpy(jitted(lambda q, k: polyattn.scaled_dot_product_attention(
            q, k, k, enable_gqa=True, implementation=implementation, **extra),
            backend)(qx, kx))

    assert f(dropout_p=0.0, dropout_seed=5).tobytes() == f().tobytes()


# --------------------------------------------------------------------------- #
# Statistics on deterministic seeds
# --------------------------------------------------------------------------- #

def _spread(w: np.ndarray, v: np.ndarray, p: float) -> np.ndarray:
    """Standard deviation of each output element under dropout ``p``:
    Var(Σ_j w_j z_j v_j) = p / (1 - p) · Σ_j w_j² v_j², the z_j independent."""
    return np.sqrt(p / (1 - p) * np.einsum("...qk,...kf->...qf", w * w, v * v))


@NUMPY_ONLY
@pytest.mark.parametrize("implementation_name", IMPLEMENTATIONS)
def test_mean_over_seeds_approaches_no_dropout(implementation_name, monkeypatch):
    """The mean of 256 outputs (seeds 0..255) lies within 5 standard errors of the output
    without dropout, element by element, and 1/16 as far from it as one output is."""
    if SIMULATOR and implementation_name.startswith("numba_cuda"):
        pytest.skip("256 launches: on a GPU (the simulator runs dropout in "
                    "test_dropped_weights_follow_the_counters)")
    name = use_implementation(implementation_name, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 7, 4)), \
        rng.standard_normal((2, 2, 7, 3))
    p, n = 0.3, 256
    out, _, w = ref_attention(q, k, v)
    runs = [polyattn.scaled_dot_product_attention(q, k, v, implementation=name, dropout_p=p,
                                                  dropout_seed=s) for s in range(n)]
    mean = np.mean(runs, axis=0)
    z = np.abs(mean - out) / (_spread(w, v, p) / math.sqrt(n))
    assert z.max() <= 5.0, z.max()
    single = np.mean([rel_error(r, out) for r in runs[:8]])
    assert single > 0.1                                  # one output is far from it
    assert rel_error(mean, out) <= 2 * single / math.sqrt(n)


def test_mean_over_batch_copies_approaches_no_dropout(xp, device, backend, implementation):
    """On this backend, one call over 256 copies of a problem (each batch row has its own
    counters, so its own mask): the mean lies within 5 standard errors of no dropout."""
    check_dropout_refused(implementation, xp, device)
    if SIMULATOR and implementation == "numba_cuda":
        pytest.skip("256 batch rows: on a GPU (the simulator runs dropout in "
                    "test_dropped_weights_follow_the_counters)")
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 7, 4)), \
        rng.standard_normal((2, 7, 3))
    p, n = 0.3, 256
    copies = [to_xp(np.broadcast_to(a, (n, *a.shape)).copy(), xp, device=device)
              for a in (q, k, v)]
    runs = to_numpy(jitted(lambda q, k, v: polyattn.scaled_dot_product_attention(
        q, k, v, implementation=implementation, dropout_p=p, dropout_seed=77),
        backend)(*copies))
    out, _, w = ref_attention(q, k, v)
    assert rel_error(runs[0], out) > 0.1
    z = np.abs(runs.mean(axis=0) - out) / (_spread(w, v, p) / math.sqrt(n))
    assert z.max() <= 5.0, z.max()


@pytest.mark.parametrize(("p", "seed"), [(0.1, 0), (0.5, 1), (0.9, 2**64 - 1)])
def test_keep_rate_within_four_sigma(xp, device, backend, p, seed):
    """Over 2¹⁶ weights the kept fraction is within 4σ = 4·sqrt(p(1-p)/n) of 1 - p; and
    the mask of a neighbouring seed is another one (half the weights differ at p = 0.5)."""
    shape = (4, 4, 64, 64)
    row = to_xp(np.arange(math.prod(shape[:-1]), dtype=np.int64)[:, None], xp, device=device)
    col = to_xp(np.arange(shape[-1], dtype=np.int64)[None, :], xp, device=device)
    kept = to_numpy(_dropout.keep(row, col, shape[-1], seed, p, xp))
    n = kept.size
    assert abs(kept.mean() - (1 - p)) <= 4 * math.sqrt(p * (1 - p) / n)
    other = to_numpy(_dropout.keep(row, col, shape[-1], seed ^ 1, p, xp))
    differ = np.mean(kept != other)
    expected = 2 * p * (1 - p)
    assert abs(differ - expected) <= 4 * math.sqrt(expected * (1 - expected) / n)


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #

BAD_P = [(-0.1, ValueError), (1.0, ValueError), (1.5, ValueError), (float("nan"), ValueError),
         (float("inf"), ValueError), ("0.1", TypeError), (True, TypeError), (None, TypeError)]
BAD_SEED = [(None, ValueError), (-1, ValueError), (2**64, ValueError), (1.5, TypeError),
            ("7", TypeError), (True, TypeError)]


def _callers() -> dict[str, Any]:
    """Every public entry point that takes dropout_p, on small NumPy inputs."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 2, 3, 4))
    x = rng.standard_normal((1, 3, 8))
    params = polyattn.MultiHeadAttention(8, 2, seed=0).params
    return {
        "scaled_dot_product_attention":
            lambda **kw: polyattn.scaled_dot_product_attention(q, q, q, **kw),
        "attention_weights": lambda **kw: polyattn.attention_weights(q, q, **kw),
        "explain": lambda **kw: polyattn.explain(q, q, q, **kw),
        "attention_vjp": lambda **kw: polyattn.attention_vjp(q, q, q, **kw),
        "multi_head_attention":
            lambda **kw: polyattn.multi_head_attention(x, x, x, params, num_heads=2, **kw),
    }


CALLERS = _callers()


@NUMPY_ONLY
@pytest.mark.parametrize(("p", "error"), BAD_P, ids=[repr(p) for p, _ in BAD_P])
@pytest.mark.parametrize("caller", list(CALLERS))
def test_bad_dropout_p_raises(caller, p, error):
    with pytest.raises(error, match="dropout_p") as info:
        CALLERS[caller](dropout_p=p, dropout_seed=0)
    assert repr(p) in str(info.value) or str(p) in str(info.value)


@NUMPY_ONLY
@pytest.mark.parametrize(("seed", "error"), BAD_SEED, ids=[repr(s) for s, _ in BAD_SEED])
@pytest.mark.parametrize("caller", list(CALLERS))
def test_bad_or_missing_seed_raises(caller, seed, error):
    with pytest.raises(error, match="dropout_seed"):
        CALLERS[caller](dropout_p=0.1, dropout_seed=seed)


# --------------------------------------------------------------------------- #
# Dropout next to the other rules
# --------------------------------------------------------------------------- #

def test_dropout_with_lengths_causal_and_dead_rows_stays_finite(xp, device, backend,
                                                                 implementation):
    """Key lengths (one row of length 0, NaN in the padding), bottom-right causal masking
    with Tq > Tk (rows before key 0) and a fully masked row: out, lse and gradients are
    finite where they should be; dead rows give out 0, lse -inf and zero gradients."""
    check_dropout_refused(implementation, xp, device)
    check_vjp_refused(implementation, xp, device)
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((3, 2, 6, 4)), rng.standard_normal((3, 2, 5, 4)), \
        rng.standard_normal((3, 2, 5, 4))
    lengths = np.array([5, 0, 3])
    pad = np.arange(5)[None, None, :, None] >= lengths[:, None, None, None]
    k, v = np.where(pad, np.nan, k), np.where(pad, np.nan, v)
    mask = np.ones((3, 1, 6, 5), dtype=bool)
    mask[0, 0, 4] = False
    arrays = [to_xp(a, xp, device=device) for a in (q, k, v)]
    opts = {"attn_mask": to_xp(mask, xp, device=device), "is_causal": True,
            "causal_alignment": "bottom_right", "dropout_p": 0.5, "dropout_seed": 9,
            "key_lengths": to_xp(lengths, xp, device=device), "implementation": implementation,
            "return_lse": True}
    g = to_xp(rng.standard_normal((3, 2, 6, 4)), xp, device=device)

    def both(q: Any, k: Any, v: Any, g: Any) -> tuple[Any, ...]:
        (out, lse), pullback = polyattn.attention_vjp(q, k, v, **opts)
        return (out, lse, *pullback(g))

    out, lse, dq, dk, dv = (to_numpy(x) for x in jitted(both, backend)(*arrays, g))
    dead = np.isneginf(lse)
    # batch 0: p_i = i - 1, so query 0 sees no key, and query 4 is masked out; batch 1 has
    # no keys; batch 2: p_i = i - 3, so queries 0..2 see none
    assert dead[0, :, [0, 4]].all() and dead[1].all() and dead[2, :, :3].all()
    assert not dead[0, :, 1:4].any() and not dead[2, :, 3:].any()
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.isfinite(x).all(), name
    assert np.all(out[dead] == 0) and np.all(dq[dead] == 0)
    assert np.all(dk[np.broadcast_to(pad, dk.shape)] == 0)
    assert np.all(dv[np.broadcast_to(pad, dv.shape)] == 0)
    sdpa_opts = {n: x for n, x in opts.items() if n != "return_lse"}
    plain = to_numpy(jitted(lambda q, k, v: polyattn.scaled_dot_product_attention(
        q, k, v, **sdpa_opts), backend)(*arrays))
    assert plain.tobytes() == out.tobytes()


# --------------------------------------------------------------------------- #
# native: not our generator
# --------------------------------------------------------------------------- #

def test_native_refuses_dropout(xp, device, backend):
    """Asked by name, "native" raises naming dropout_p; explain says why "auto" passed over
    it, and "auto" runs something else (whose dropout is §4.1's)."""
    if backend not in NATIVE_BACKENDS:
        pytest.skip(f"{backend.value} has no native attention (torch and JAX have)")
    q = to_xp(np.random.default_rng(6).standard_normal((1, 2, 4, 8)), xp, dtype="float32",
              device=device)
    opts = {"dropout_p": 0.25, "dropout_seed": 3}
    assert polyattn.explain(q, q, q).implementation == "native"     # without dropout
    with pytest.raises(ValueError, match="dropout_p"):
        polyattn.explain(q, q, q, implementation="native", **opts)
    with pytest.raises(ValueError, match="dropout_p"):
        polyattn.scaled_dot_product_attention(q, q, q, implementation="native", **opts)
    e = polyattn.explain(q, q, q, **opts)
    assert e.implementation != "native"
    assert "dropout_p" in e.candidates["native"], e.candidates
    out = to_numpy(polyattn.scaled_dot_product_attention(q, q, q, **opts))
    ref = to_numpy(polyattn.scaled_dot_product_attention(q, q, q, implementation="reference",
                                                         **opts))
    assert rel_error(out, ref) <= 1e-5
