"""KVCache: appends, ragged appends, capacity, JAX's functional form, and decoding.

The decoding tests run a prompt and then one token at a time through the
cache and compare every output with one causal call over the whole sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import CPU_IMPLEMENTATIONS, use_implementation
from helpers import Backend, assert_close, assert_namespace_device, to_numpy, to_xp

import polyattn
from polyattn import KVCache, scaled_dot_product_attention

#: Backends whose update writes in place and returns the cache itself.
IN_PLACE = (Backend.NUMPY, Backend.TORCH, Backend.ARRAY_API_STRICT, Backend.CUPY)


def make(xp, device, batch=(2,), hkv=3, capacity=8, e=4, ev=None, dtype_name="float64"):
    return KVCache(batch, hkv, capacity, e, value_dim=ev, xp=xp, dtype=getattr(xp, dtype_name),
                   device=device)


def kv(rng, shape, ev=None):
    k = rng.standard_normal(shape)
    v = rng.standard_normal((*shape[:-1], ev or shape[-1]))
    return k, v


def test_construction(xp, device, dtype_name):
    c = make(xp, device, batch=(2, 5), hkv=3, capacity=7, e=4, ev=6, dtype_name=dtype_name)
    assert_namespace_device(c.keys, xp, device, getattr(xp, dtype_name))
    assert_namespace_device(c.values, xp, device, getattr(xp, dtype_name))
    assert tuple(c.keys.shape) == (2, 5, 3, 7, 4) and tuple(c.values.shape) == (2, 5, 3, 7, 6)
    assert tuple(c.lengths.shape) == (2, 5) and xp.isdtype(c.lengths.dtype, "integral")
    assert (c.capacity, c.batch_shape, c.num_kv_heads, c.head_dim, c.value_dim) == \
        (7, (2, 5), 3, 4, 6)
    assert not to_numpy(c.lengths).any() and not to_numpy(c.keys).any()
    assert "capacity=7" in repr(c)
    unbatched = KVCache((), 2, 4, 8, xp=xp, device=device)
    assert tuple(unbatched.keys.shape) == (2, 4, 8) and tuple(unbatched.lengths.shape) == ()
    assert KVCache(3, 1, 2, 2).batch_shape == (3,)


def test_default_dtype_follows_library():
    assert KVCache((1,), 1, 2, 2).keys.dtype == np.float64
    torch = pytest.importorskip("torch")
    assert KVCache((1,), 1, 2, 2, xp=torch).keys.dtype == torch.get_default_dtype()


def test_appends(backend, xp, device, dtype_name):
    rng = np.random.default_rng(0)
    c = make(xp, device, dtype_name=dtype_name)
    k1, v1 = kv(rng, (2, 3, 3, 4))
    k2, v2 = kv(rng, (2, 3, 2, 4))
    c1 = c.update(to_xp(k1, xp, dtype=dtype_name, device=device),
                  to_xp(v1, xp, dtype=dtype_name, device=device))
    c2 = c1.update(to_xp(k2, xp, dtype=dtype_name, device=device),
                   to_xp(v2, xp, dtype=dtype_name, device=device))
    assert (c1 is c) == (c2 is c1) == (backend in IN_PLACE)
    np.testing.assert_array_equal(to_numpy(c2.lengths), [5, 5])
    keys, values = to_numpy(c2.keys), to_numpy(c2.values)
    want_k = np.concatenate([k1, k2], axis=-2).astype(dtype_name)
    want_v = np.concatenate([v1, v2], axis=-2).astype(dtype_name)
    np.testing.assert_array_equal(keys[..., :5, :], want_k)
    np.testing.assert_array_equal(values[..., :5, :], want_v)
    assert not keys[..., 5:, :].any() and not values[..., 5:, :].any()
    assert_namespace_device(c2.keys, xp, device, getattr(xp, dtype_name))
    if backend not in IN_PLACE:     # immutable: the first cache is as it was
        np.testing.assert_array_equal(to_numpy(c.lengths), [0, 0])
        assert not to_numpy(c.keys).any()


def test_ragged_appends(xp, device):
    rng = np.random.default_rng(1)
    c = make(xp, device, batch=(2,), ev=5)
    k1, v1 = kv(rng, (2, 3, 4, 4), ev=5)
    k2, v2 = kv(rng, (2, 3, 2, 4), ev=5)
    c = c.update(to_xp(k1, xp, device=device), to_xp(v1, xp, device=device),
                 lengths=to_xp(np.array([4, 1]), xp, device=device))
    np.testing.assert_array_equal(to_numpy(c.lengths), [4, 1])
    c = c.update(to_xp(k2, xp, device=device), to_xp(v2, xp, device=device))
    np.testing.assert_array_equal(to_numpy(c.lengths), [6, 3])
    keys, values = to_numpy(c.keys), to_numpy(c.values)
    np.testing.assert_array_equal(keys[0, :, :6], np.concatenate([k1[0], k2[0]], axis=-2))
    np.testing.assert_array_equal(values[1, :, :3],
                                  np.concatenate([v1[1, :, :1], v2[1]], axis=-2))
    assert not keys[1, :, 3:].any(), "padding tokens were stored"
    # an int counts for every row; 0 appends nothing
    c = c.update(to_xp(k2, xp, device=device), to_xp(v2, xp, device=device), lengths=0)
    np.testing.assert_array_equal(to_numpy(c.lengths), [6, 3])


def test_ragged_appends_with_two_batch_dimensions(xp, device):
    rng = np.random.default_rng(2)
    c = make(xp, device, batch=(2, 2), hkv=1, capacity=6, e=3)
    k, v = kv(rng, (2, 2, 1, 3, 3))
    counts = np.array([[3, 0], [1, 2]])
    c = c.update(to_xp(k, xp, device=device), to_xp(v, xp, device=device),
                 lengths=to_xp(counts, xp, device=device))
    c = c.update(to_xp(k, xp, device=device), to_xp(v, xp, device=device),
                 lengths=to_xp(np.array([1, 2]), xp, device=device))       # broadcast over rows
    np.testing.assert_array_equal(to_numpy(c.lengths), counts + np.array([1, 2]))
    keys = to_numpy(c.keys)
    for i in range(2):
        for j in range(2):
            n, m = counts[i, j], [1, 2][j]
            want = np.concatenate([k[i, j, :, :n], k[i, j, :, :m]], axis=-2)
            np.testing.assert_array_equal(keys[i, j, :, :n + m], want)


def test_overflow_raises_naming_the_capacity(backend, xp, device):
    rng = np.random.default_rng(3)
    c = make(xp, device, capacity=5)
    k, v = kv(rng, (2, 3, 4, 4))
    c = c.update(to_xp(k, xp, device=device), to_xp(v, xp, device=device),
                 lengths=to_xp(np.array([4, 1]), xp, device=device))
    if backend is Backend.DASK:
        pytest.skip("Dask's values are not computed by update (documented: no check)")
    before = to_numpy(c.keys).copy()
    with pytest.raises(ValueError, match=r"capacity is 5 tokens per row.*holding 4.*needs 6"):
        c.update(to_xp(k[..., :2, :], xp, device=device), to_xp(v[..., :2, :], xp, device=device))
    np.testing.assert_array_equal(to_numpy(c.lengths), [4, 1])
    np.testing.assert_array_equal(to_numpy(c.keys), before)
    c = c.update(to_xp(k[..., :1, :], xp, device=device), to_xp(v[..., :1, :], xp, device=device))
    np.testing.assert_array_equal(to_numpy(c.lengths), [5, 2])


def test_overflow_on_dask_drops_and_stops_at_capacity():
    da = pytest.importorskip("dask.array")
    import array_api_compat

    xp = array_api_compat.array_namespace(da.asarray(0.0))
    k, v = kv(np.random.default_rng(4), (1, 1, 4, 2))
    c = KVCache((1,), 1, 3, 2, xp=xp, dtype=xp.float64)
    c = c.update(da.asarray(k), da.asarray(v))
    np.testing.assert_array_equal(to_numpy(c.lengths), [3])
    np.testing.assert_array_equal(to_numpy(c.keys), k[..., :3, :])


@pytest.mark.parametrize(("make_args", "error", "match"), [
    (lambda xp, d: (np.ones((2, 3, 1, 5)), np.ones((2, 3, 1, 4))), ValueError,
     r"`key` must be \(B…, Hkv, Tnew, E\) = \(2, 3, Tnew, 4\).*got shape \(2, 3, 1, 5\)"),
    (lambda xp, d: (np.ones((2, 2, 1, 4)), np.ones((2, 2, 1, 4))), ValueError,
     r"`key` must be .*\(2, 3, Tnew, 4\)"),
    (lambda xp, d: (np.ones((3, 1, 4)), np.ones((3, 1, 4))), ValueError, r"`key` must be"),
    (lambda xp, d: (np.ones((2, 3, 1, 4)), np.ones((2, 3, 1, 6))), ValueError,
     r"`value` must be \(B…, Hkv, Tnew, Ev\) = \(2, 3, Tnew, 4\)"),
    (lambda xp, d: (np.ones((2, 3, 2, 4)), np.ones((2, 3, 1, 4))), ValueError,
     r"`key` has 2 new tokens but `value` has 1"),
    (lambda xp, d: (np.ones((2, 3, 1, 4), dtype=int), np.ones((2, 3, 1, 4))), TypeError,
     r"`key` must have a real floating dtype"),
])
def test_update_shape_and_dtype_errors(make_args, error, match):
    c = make(np, None)
    k, v = make_args(np, None)
    with pytest.raises(error, match=match):
        c.update(k, v)


def test_update_never_downcasts_and_upcasts_exactly():
    c = make(np, None, dtype_name="float32")
    with pytest.raises(TypeError, match=r"`key` is float64 but the cache holds float32.*"
                                        r"dtype=float64"):
        c.update(np.ones((2, 3, 1, 4)), np.ones((2, 3, 1, 4), dtype=np.float32))
    half = np.random.default_rng(5).standard_normal((2, 3, 1, 4)).astype(np.float16)
    c.update(half, half)
    assert c.keys.dtype == np.float32
    np.testing.assert_array_equal(c.keys[..., :1, :], half.astype(np.float32))


@pytest.mark.parametrize(("lengths", "error", "match"), [
    (np.array([1.0, 2.0]), TypeError, r"`lengths` must have an integer dtype.*float64"),
    (np.array([3, 1]), ValueError, r"`lengths` must lie in \[0, Tnew\] = \[0, 2\].*to 3"),
    (np.array([-1, 1]), ValueError, r"`lengths` must lie in"),
    # a uint64 beyond int64 is quoted as given, not as the index dtype wraps it (-1)
    (np.array([2**64 - 1, 1], dtype=np.uint64), ValueError,
     r"`lengths` must lie in .*from 1 to 18446744073709551615"),
    (3, ValueError, r"`lengths` must lie in \[0, Tnew\] = \[0, 2\].*got 3"),
    (2**70, ValueError, r"`lengths` must lie in .*got 1180591620717411303424"),
    (np.array([1, 1, 1]), ValueError, r"`lengths` must broadcast to .* \(2,\); got shape \(3,\)"),
    (1.5, TypeError, r"`lengths` must be an integer array \(B…,\) or an int; got float"),
    (True, TypeError, r"`lengths` must be an integer array"),
])
def test_update_lengths_errors(lengths, error, match):
    c = make(np, None)
    with pytest.raises(error, match=match):
        c.update(np.ones((2, 3, 2, 4)), np.ones((2, 3, 2, 4)), lengths=lengths)


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), [
    (((2,), 0, 4, 4), {}, ValueError, r"`num_kv_heads` must be at least 1"),
    (((2,), 1, 0, 4), {}, ValueError, r"`capacity` must be at least 1"),
    (((2,), 1, 4, 0), {}, ValueError, r"`head_dim` must be at least 1"),
    (((2,), 1, 4, 4), {"value_dim": 2.0}, TypeError, r"`value_dim` must be an integer"),
    (("2", 1, 4, 4), {}, TypeError, r"`batch_shape` must be a tuple"),
    (((2, -1), 1, 4, 4), {}, ValueError, r"`batch_shape\[1\]` must be at least 0"),
    (((2,), 1, 4, 4), {"dtype": np.int64}, TypeError, r"`dtype` must be a real floating"),
])
def test_construction_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        KVCache(*args, **kwargs)


def test_inputs_of_another_library_are_refused():
    torch = pytest.importorskip("torch")
    c = make(np, None)
    with pytest.raises(TypeError, match=r"`cache.keys` is a numpy array but `key` is a torch"):
        c.update(torch.ones(2, 3, 1, 4, dtype=torch.float64), np.ones((2, 3, 1, 4)))


def test_update_does_not_modify_its_inputs():
    c = make(np, None)
    k, v = kv(np.random.default_rng(6), (2, 3, 2, 4))
    for a in (k, v):
        a.flags.writeable = False
    c.update(k, v)
    c.keys[...] = 7.0                   # writes to the cache never reach the inputs
    assert not (k == 7.0).any()


# --------------------------------------------------------------------------- #
# JAX: functional updates, jit
# --------------------------------------------------------------------------- #

def test_jax_cache_is_a_pytree_usable_under_jit():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(7)
    k, v = kv(rng, (2, 3, 6, 4))
    c0 = KVCache((2,), 3, 5, 4, xp=jnp, dtype=jnp.float64)
    leaves, treedef = jax.tree_util.tree_flatten(c0)
    assert len(leaves) == 3 and isinstance(jax.tree_util.tree_unflatten(treedef, leaves),
                                           KVCache)
    traces = []

    @jax.jit
    def append(cache, k, v, n):
        traces.append(1)
        return cache.update(k, v, lengths=n)

    c1 = append(c0, jnp.asarray(k[..., :2, :]), jnp.asarray(v[..., :2, :]), jnp.asarray([2, 1]))
    c2 = append(c1, jnp.asarray(k[..., 2:4, :]), jnp.asarray(v[..., 2:4, :]),
                jnp.asarray([2, 2]))
    assert len(traces) == 1, "a new cache state or new lengths retraced the function"
    assert isinstance(c2, KVCache) and c2.capacity == 5
    np.testing.assert_array_equal(np.asarray(c2.lengths), [4, 3])
    np.testing.assert_array_equal(np.asarray(c2.keys)[0, :, :4], k[0, :, :4])
    np.testing.assert_array_equal(np.asarray(c2.values)[1, :, :3],
                                  np.concatenate([v[1, :, :1], v[1, :, 2:4]], axis=-2))
    np.testing.assert_array_equal(np.asarray(c0.lengths), [0, 0])     # unchanged
    # traced lengths cannot be checked: past the capacity tokens are dropped
    c3 = append(c2, jnp.asarray(k[..., :2, :]), jnp.asarray(v[..., :2, :]), jnp.asarray([2, 2]))
    np.testing.assert_array_equal(np.asarray(c3.lengths), [5, 5])
    np.testing.assert_array_equal(np.asarray(c3.keys)[0, :, 4], k[0, :, 0])
    np.testing.assert_array_equal(np.asarray(c3.keys)[1, :, 3:5], k[1, :, :2])
    # eager JAX values are at hand: checked
    with pytest.raises(ValueError, match="capacity is 5"):
        c2.update(jnp.asarray(k[..., :2, :]), jnp.asarray(v[..., :2, :]))


# --------------------------------------------------------------------------- #
# Decoding through the cache equals one causal call over the whole sequence
# --------------------------------------------------------------------------- #

CASES = {
    "plain": {},
    "gqa": {"hkv": 2},
    "window": {"window": (2, 0)},
    "alibi": {"alibi": True},
    "all": {"hkv": 1, "window": (3, 0), "alibi": True, "softcap": 5.0},
}


def _case(name, rng, b, h, t, e):
    spec = CASES[name]
    hkv = spec.get("hkv", h)
    q = rng.standard_normal((b, h, t, e))
    k, v = kv(rng, (b, hkv, t, e), ev=e + 1)
    options = {"is_causal": True, "enable_gqa": hkv != h, "window": spec.get("window"),
               "softcap": spec.get("softcap")}
    slopes = polyattn.alibi_slopes(h) if spec.get("alibi") else None
    return q, k, v, hkv, options, slopes


#: Every implementation in float64; "auto" in float32 too (fewer compilations on eager JAX).
RUNS = [(name, "float64") for name in CPU_IMPLEMENTATIONS] + [("auto", "float32")]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("name", "dtype_name"), RUNS)
def test_decode_equals_full_recompute(backend, xp, device, dtype_name, case, name,
                                      monkeypatch):
    if backend is Backend.JAX and name != "auto" and case != "all":
        pytest.skip("eager JAX compiles every operation of every step: on JAX each "
                    "implementation decodes the 'all' case, which combines these keywords")
    implementation = use_implementation(name, backend, monkeypatch)
    rng = np.random.default_rng(8)
    b, h, t, e, prompt = 2, 4, 9, 4, 4
    q, k, v, hkv, options, slopes = _case(case, rng, b, h, t, e)
    conv = lambda a: to_xp(a, xp, dtype=dtype_name, device=device)     # noqa: E731
    if slopes is not None:
        options["alibi_slopes"] = conv(slopes)
    full = to_numpy(scaled_dot_product_attention(conv(q), conv(k), conv(v), **options))

    cache = KVCache((b,), hkv, 12, e, value_dim=e + 1, xp=xp, dtype=getattr(xp, dtype_name),
                    device=device)
    outs = []
    for lo, hi in [(0, prompt), *((s, s + 1) for s in range(prompt, t))]:
        cache = cache.update(conv(k[..., lo:hi, :]), conv(v[..., lo:hi, :]))
        outs.append(scaled_dot_product_attention(
            conv(q[..., lo:hi, :]), cache.keys, cache.values, key_lengths=cache.lengths,
            causal_alignment="bottom_right", implementation=implementation, **options))
    assert_namespace_device(outs[-1], xp, device, getattr(xp, dtype_name))
    steps = np.concatenate([to_numpy(o) for o in outs], axis=-2)
    assert_close(steps, full, dtype_name)


@pytest.mark.parametrize("case", ["plain", "all"])
def test_ragged_prompts_then_decode_equal_each_rows_full_call(xp, device, case):
    """Right-padded prompts of 5 and 2 tokens: prefill top-left, then decode bottom-right."""
    rng = np.random.default_rng(9)
    b, h, t, e = 2, 4, 9, 4
    q, k, v, hkv, options, slopes = _case(case, rng, b, h, t, e)
    conv = lambda a: to_xp(a, xp, device=device)                          # noqa: E731
    if slopes is not None:
        options["alibi_slopes"] = conv(slopes)
    full = to_numpy(scaled_dot_product_attention(conv(q), conv(k), conv(v), **options))
    prompt = np.array([5, 2])
    cache = KVCache((b,), hkv, 16, e, value_dim=e + 1, xp=xp, dtype=xp.float64, device=device)
    cache = cache.update(conv(k[..., :5, :]), conv(v[..., :5, :]), lengths=conv(prompt))
    out = to_numpy(scaled_dot_product_attention(
        conv(q[..., :5, :]), cache.keys, cache.values, key_lengths=cache.lengths,
        causal_alignment="top_left", **options))
    for row in range(b):
        n = prompt[row]
        assert_close(out[row, :, :n], full[row, :, :n], "float64")
    def pick(a, pos):
        """Row r's token at position pos[r]: (B, heads, 1, F)."""
        return np.stack([a[r, :, p:p + 1] for r, p in enumerate(pos)])

    for step in range(4):
        pos = prompt + step                                    # each row's next token
        cache = cache.update(conv(pick(k, pos)), conv(pick(v, pos)))
        out = to_numpy(scaled_dot_product_attention(
            conv(pick(q, pos)), cache.keys, cache.values, key_lengths=cache.lengths,
            causal_alignment="bottom_right", **options))
        assert_close(out, pick(full, pos), "float64")
    np.testing.assert_array_equal(to_numpy(cache.lengths), prompt + 4)


def test_jit_decoding_loop_equals_full_recompute():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(10)
    b, h, t, e = 2, 4, 8, 4
    q, k, v, hkv, options, _ = _case("gqa", rng, b, h, t, e)
    slopes = jnp.asarray(polyattn.alibi_slopes(h))
    full = scaled_dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                        alibi_slopes=slopes, **options)
    traces = []

    @jax.jit
    def step(cache, q, k, v):
        traces.append(1)
        cache = cache.update(k, v)
        out = scaled_dot_product_attention(q, cache.keys, cache.values,
                                           key_lengths=cache.lengths,
                                           causal_alignment="bottom_right",
                                           alibi_slopes=slopes, **options)
        return out, cache

    cache = KVCache((b,), hkv, 10, e, value_dim=e + 1, xp=jnp, dtype=jnp.float64)
    outs = []
    for s in range(t):
        out, cache = step(cache, *(jnp.asarray(a[..., s:s + 1, :]) for a in (q, k, v)))
        outs.append(np.asarray(out))
    assert len(traces) == 1
    assert_close(np.concatenate(outs, axis=-2), np.asarray(full), "float64")
