"""The numba_cpu kernel on torch CPU tensors and JAX CPU arrays: results and gradients equal
the float64 oracle (polyattn's reference on NumPy arrays) for every rule and dtype, under
torch autograd, and under ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.jvp``; and the
kernel is what ran (its entry points are counted).

Runs in the numba_cpu session (Numba, torch and JAX installed); skipped where one is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_lse_close

import polyattn
from polyattn import ops
from polyattn import scaled_dot_product_attention as sdpa

pytest.importorskip("numba", reason="the numba_cpu kernel needs Numba (pip install numba)")
from polyattn.backends.numba_cpu import launch


def _doc_mask(b, h, q, kv, doc):  # type: ignore[no-untyped-def]
    return ops.logical_and(doc[q] == doc[kv], q >= kv)


def _capped(s, b, h, q, kv, bias):  # type: ignore[no-untyped-def]
    return 5.0 * ops.tanh(s / 5.0) + bias[h]


#: Each rule as keywords over NumPy arrays: (B, H, Hkv, Tq, Tk) = (2, 4, 2, 9, 13).
def _rules(rng: np.random.Generator) -> dict[str, dict]:
    doc = np.repeat(np.arange(4), 4)[:13]
    return {
        "plain": {},
        "causal": {"is_causal": True},
        "bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
        "window": {"window": (3, 2)},
        "softcap": {"softcap": 2.0, "is_causal": True},
        "alibi": {"alibi_slopes": rng.uniform(0.1, 1.0, (4,))},
        "key_lengths": {"key_lengths": np.array([13, 5])},
        "mask": {"attn_mask": rng.uniform(size=(2, 1, 9, 13)) > 0.3},
        "segment_ids": {"segment_ids": (np.repeat(np.arange(3), 3)[None].repeat(2, 0),
                                        np.repeat(np.arange(3), 5)[None, :13].repeat(2, 0))},
        "score_mod": {"score_mod": _capped, "mod_args": (rng.standard_normal(4),)},
        "mask_mod": {"mask_mod": _doc_mask, "mod_args": (doc,)},
        "block_mask": {"mask_mod": _doc_mask, "mod_args": (doc,),
                       "block_mask": polyattn.block_mask(_doc_mask, None, None, 9, 13,
                                                         mod_args=(doc,), block=(4, 4))},
        "dropout": {"dropout_p": 0.25, "dropout_seed": 7, "is_causal": True},
    }


RULES = tuple(_rules(np.random.default_rng(0)))


def _inputs(seed: int = 1):
    rng = np.random.default_rng(seed)
    shapes = ((2, 4, 9, 8), (2, 2, 13, 8), (2, 2, 13, 6))
    return tuple(rng.standard_normal(s) for s in shapes), _rules(rng)


def _oracle(q, k, v, kw, grad_out=None):
    """(out, lse) and, with ``grad_out``, (dq, dk, dv) of the reference in float64."""
    out, lse = sdpa(q, k, v, implementation="reference", return_lse=True, enable_gqa=True,
                    **kw)
    if grad_out is None:
        return out, lse
    _, pullback = polyattn.attention_vjp(q, k, v, implementation="reference",
                                         enable_gqa=True, **kw)
    return out, lse, pullback(grad_out)


@pytest.fixture
def counted(monkeypatch):
    """How many times the kernel's forward and backward entry points ran."""
    calls = {"forward": 0, "backward": 0}
    for name, entry in (("forward", "attention"), ("backward", "backward")):
        original = getattr(launch, entry)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(launch, entry, spy)
    return calls


def _convert(kw, to):
    """The keywords with their arrays converted by ``to`` (callables and numbers kept)."""
    def one(x):
        if isinstance(x, np.ndarray):
            return to(x)
        if isinstance(x, tuple):
            return tuple(one(y) for y in x)
        return x
    return {name: one(value) for name, value in kw.items()}


# --- torch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rule", RULES)
def test_torch_cpu_tensors_forward_and_autograd(rule, dtype, counted):
    torch = pytest.importorskip("torch")
    (q, k, v), rules = _inputs()
    kw = rules[rule]
    g = np.random.default_rng(2).standard_normal((2, 4, 9, 6))
    want_out, want_lse, want_grads = _oracle(q, k, v, kw, g)
    tdtype = getattr(torch, dtype)
    def to(a):
        return (torch.from_numpy(a) if a.dtype.kind in "biu"
              else torch.from_numpy(a).to(tdtype))
    tq, tk, tv = (to(x).requires_grad_() for x in (q, k, v))
    tkw = _convert(kw, to)
    out, lse = sdpa(tq, tk, tv, implementation="numba_cpu", return_lse=True,
                    enable_gqa=True, **tkw)
    assert counted["forward"] == 1
    assert out.dtype == tdtype
    assert_close(out.detach(), want_out, dtype)
    assert_lse_close(lse.detach(), want_lse, dtype)
    out = sdpa(tq, tk, tv, implementation="numba_cpu", enable_gqa=True, **tkw)
    out.backward(torch.from_numpy(g).to(tdtype))
    assert counted["backward"] == 1
    for name, x, want in zip("qkv", (tq, tk, tv), want_grads[:3], strict=True):
        assert_close(x.grad, np.asarray(want), dtype, what=f"d{name}")
    # inputs untouched
    assert np.array_equal(tq.detach().numpy(), q.astype(dtype))


def test_torch_refuses_what_its_backward_pass_does_not_give():
    torch = pytest.importorskip("torch")
    (q, k, v), _ = _inputs()
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    slopes = torch.ones(4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"alibi_slopes. requires a gradient"):
        sdpa(tq, tk, tv, implementation="numba_cpu", enable_gqa=True, alibi_slopes=slopes)
    bias = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"mod_args\[0\]. requires a gradient"):
        sdpa(tq, tk, tv, implementation="numba_cpu", enable_gqa=True, score_mod=_capped,
             mod_args=(bias,))
    # "auto" takes another implementation that differentiates them
    out = sdpa(tq, tk, tv, enable_gqa=True, score_mod=_capped, mod_args=(bias,))
    out.sum().backward()
    assert bias.grad is not None and torch.isfinite(bias.grad).all()
    # the same where only the table or the slopes require a gradient (q, k, v do not)
    cq, ck, cv = (torch.from_numpy(x) for x in (q, k, v))
    table = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64, requires_grad=True)

    def relative(s, b, h, q_idx, kv_idx, t):  # type: ignore[no-untyped-def]
        return s + t[ops.minimum(ops.abs(q_idx - kv_idx), 3)]

    for kw, leaf in (({"score_mod": relative, "mod_args": (table,)}, table),
                     ({"alibi_slopes": slopes}, slopes)):
        with pytest.raises(ValueError, match="requires a gradient"):
            sdpa(cq, ck, cv, implementation="numba_cpu", enable_gqa=True, **kw)
        leaf.grad = None
        out = sdpa(cq, ck, cv, enable_gqa=True, **kw)
        assert out.requires_grad
        out.sum().backward()
        ref = sdpa(cq, ck, cv, enable_gqa=True, implementation="reference", **kw)
        want = torch.autograd.grad(ref.sum(), leaf)[0]
        torch.testing.assert_close(leaf.grad, want, rtol=1e-10, atol=1e-12)


# --- JAX ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


def _jax_inputs(jax, dtype, rule):
    import jax.numpy as jnp

    (q, k, v), rules = _inputs()
    kw = rules[rule]

    def to(a):
        return jnp.asarray(a) if a.dtype.kind in "biu" else jnp.asarray(a, dtype=dtype)

    return (q, k, v), kw, tuple(to(x) for x in (q, k, v)), _convert(kw, to)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rule", RULES)
def test_jax_cpu_arrays_eager_jit_and_grad(jax, rule, dtype, counted):
    (q, k, v), kw, (jq, jk, jv), jkw = _jax_inputs(jax, dtype, rule)
    g = np.random.default_rng(2).standard_normal((2, 4, 9, 6))
    want_out, want_lse, want_grads = _oracle(q, k, v, kw, g)

    def f(q, k, v):
        return sdpa(q, k, v, implementation="numba_cpu", return_lse=True, enable_gqa=True,
                    **jkw)

    for run in (f, jax.jit(f)):
        out, lse = run(jq, jk, jv)
        assert str(out.dtype) == dtype
        assert_close(out, want_out, dtype)
        assert_lse_close(lse, want_lse, dtype)
    assert counted["forward"] == 2

    def loss(q, k, v):
        return (f(q, k, v)[0] * g.astype(dtype)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
    assert counted["backward"] == 1
    for name, got, want in zip("qkv", grads, want_grads[:3], strict=True):
        assert_close(got, np.asarray(want), dtype, what=f"d{name}")


def _bf16_error(got, want):
    got = np.asarray(got, dtype=np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("library", ["torch", "jax"])
def test_bfloat16_through_the_kernel(library, counted):
    """bfloat16 tensors and arrays run the kernel in float32 and come back bfloat16 (the
    lse float32), within the bfloat16 contract (4e-3, docs/semantics.rst) of the float64
    oracle on the values they hold, forward and gradients."""
    rng = np.random.default_rng(5)
    shape = (1, 2, 96, 32)
    g = rng.standard_normal(shape)
    if library == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(rng.standard_normal(shape)).to(torch.bfloat16)
                   .requires_grad_() for _ in range(3))
        held = [x.detach().double().numpy() for x in (q, k, v)]
        out, lse = sdpa(q, k, v, is_causal=True, implementation="numba_cpu", return_lse=True)
        out.backward(torch.from_numpy(g).to(torch.bfloat16))
        dtypes = (out.dtype, lse.dtype, q.grad.dtype)
        assert dtypes == (torch.bfloat16, torch.float32, torch.bfloat16)
        got = [out.detach().double().numpy(), lse.detach().double().numpy()] + [
            x.grad.double().numpy() for x in (q, k, v)]
    else:
        jax = pytest.importorskip("jax")
        import jax.numpy as jnp

        q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype=jnp.bfloat16)
                   for _ in range(3))
        held = [np.asarray(x.astype(jnp.float32), dtype=np.float64) for x in (q, k, v)]

        def f(q, k, v):
            return sdpa(q, k, v, is_causal=True, implementation="numba_cpu",
                        return_lse=True)

        out, lse = jax.jit(f)(q, k, v)
        grads = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v)[0].astype(jnp.float32)
                                                  * g).sum(), argnums=(0, 1, 2)))(q, k, v)
        assert (str(out.dtype), str(lse.dtype), str(grads[0].dtype)) == (
            "bfloat16", "float32", "bfloat16")
        got = [np.asarray(x.astype(jnp.float32), dtype=np.float64) for x in (out, lse, *grads)]
    assert counted["forward"] >= 1 and counted["backward"] == 1
    want_out, want_lse, want_grads = _oracle(*held, {"is_causal": True}, g)
    assert _bf16_error(got[0], want_out) <= 4e-3
    assert _bf16_error(got[1], want_lse) <= 1e-5
    for name, x, want in zip("qkv", got[2:], want_grads[:3], strict=True):
        # rounded to bfloat16 as the output is (torch's cotangent too)
        assert _bf16_error(x, np.asarray(want)) <= 4e-3, f"d{name}"


@pytest.mark.parametrize("rule", ["causal", "key_lengths", "score_mod", "dropout", "mask",
                                  "segment_ids"])
def test_jax_vmap_jvp_and_second_derivatives(jax, rule, counted):
    import jax.numpy as jnp

    (q, k, v), kw, (jq, jk, jv), jkw = _jax_inputs(jax, "float64", rule)

    def f(q, k, v, implementation="numba_cpu"):
        return sdpa(q, k, v, implementation=implementation, enable_gqa=True, **jkw)

    # vmap over the batch axis: each mapped call sees batch rows of its own (a user rule's
    # b, dropout's counters count from 0 again)
    # (sliced here: under jax.jit a slice of a closed-over array is traced)
    sub = {n: (x[:1] if n in ("key_lengths", "attn_mask") else
               tuple(i[:1] for i in x) if n == "segment_ids" else x)   # rows alike
           for n, x in jkw.items()}

    def one(q, k, v, implementation="numba_cpu"):
        return sdpa(q[None], k[None], v[None], implementation=implementation,
                    enable_gqa=True, **sub)[0]

    got = jax.jit(jax.vmap(one))(jq, jk, jv)
    want = jax.vmap(lambda *a: one(*a, implementation="reference"))(jq, jk, jv)
    assert counted["forward"] >= 1
    assert_close(got, np.asarray(want), "float64")
    # forward mode: the tangent of out
    rng = np.random.default_rng(3)
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in (jq, jk, jv))
    _, got = jax.jvp(f, (jq, jk, jv), tangents)
    _, want = jax.jvp(lambda *a: f(*a, implementation="reference"), (jq, jk, jv), tangents)
    assert_close(got, np.asarray(want), "float64", what="tangent")
    # a second derivative: the gradient of a function of the gradient
    def curvature(q, implementation):
        inner = jax.grad(lambda q: (f(q, jk, jv, implementation) ** 2).sum())
        return (inner(q) ** 2).sum()

    got = jax.grad(curvature)(jq, "numba_cpu")
    want = jax.grad(curvature)(jq, "reference")
    assert_close(got, np.asarray(want), "float64", what="d2")
    # a rule's array differentiated (the slopes): the Array-API path gives it
    slopes = jnp.asarray(np.linspace(0.2, 0.8, 4))
    d = jax.grad(lambda s: sdpa(jq, jk, jv, implementation="numba_cpu", enable_gqa=True,
                                alibi_slopes=s).sum())(slopes)
    dr = jax.grad(lambda s: sdpa(jq, jk, jv, implementation="reference", enable_gqa=True,
                                 alibi_slopes=s).sum())(slopes)
    assert_close(d, np.asarray(dr), "float64", what="d slopes")
    _ = q, k, v, kw


def test_jax_attention_vjp_runs_the_kernels_backward(jax, counted):
    (q, k, v), kw, (jq, jk, jv), _ = _jax_inputs(jax, "float64", "causal")
    g = np.random.default_rng(4).standard_normal((2, 4, 9, 6))
    _, _, want = _oracle(q, k, v, kw, g)
    _out, pullback = polyattn.attention_vjp(jq, jk, jv, is_causal=True, enable_gqa=True,
                                           implementation="numba_cpu")
    grads = pullback(jax.numpy.asarray(g))
    assert counted == {"forward": 1, "backward": 1}
    for name, got, w in zip("qkv", grads, want, strict=True):
        assert_close(got, np.asarray(w), "float64", what=f"d{name}")


def test_jax_mod_args_traced_by_jit_grad_and_vmap(jax, counted):
    """mod_args that are the transformed function's own arguments (traced: no values at
    hand while the call is planned) reach the kernel as operands; their gradient comes
    from the differentiable path and equals the reference's, under "auto" too."""
    import jax.numpy as jnp

    (q, k, v), _, (jq, jk, jv), _ = _jax_inputs(jax, "float64", "causal")
    table = jnp.asarray(np.random.default_rng(5).standard_normal(4))
    g = jnp.asarray(np.random.default_rng(6).standard_normal((2, 4, 9, 6)))

    def relative(s, b, h, q_idx, kv_idx, bias):  # type: ignore[no-untyped-def]
        return 5.0 * ops.tanh(s / 5.0) + bias[ops.minimum(ops.abs(q_idx - kv_idx), 3)]

    def loss(t, implementation):
        out = sdpa(jq, jk, jv, enable_gqa=True, score_mod=relative, mod_args=(t,),
                   implementation=implementation)
        return (out * g).sum()

    want = jax.grad(loss)(table, "reference")
    assert np.abs(np.asarray(want)).min() > 1e-3
    for implementation in ("numba_cpu", "auto"):
        got = jax.jit(jax.grad(loss), static_argnums=1)(table, implementation)
        assert_close(got, np.asarray(want), "float64", what=f"d table ({implementation})")
    out = jax.jit(lambda t: sdpa(jq, jk, jv, enable_gqa=True, score_mod=relative,
                                 mod_args=(t,), implementation="numba_cpu"))(table)
    assert counted["forward"] >= 1                       # the kernel, in a host callback
    assert_close(out, np.asarray(sdpa(jq, jk, jv, enable_gqa=True, score_mod=relative,
                                      mod_args=(table,), implementation="reference")),
                 "float64")
    tables = jnp.stack([table, 2 * table])
    mapped = jax.vmap(lambda t: sdpa(jq, jk, jv, enable_gqa=True, score_mod=_capped,
                                     mod_args=(t,), implementation="numba_cpu"))(tables)
    for i in range(2):
        one = sdpa(jq, jk, jv, enable_gqa=True, score_mod=_capped, mod_args=(tables[i],),
                   implementation="reference")
        assert_close(mapped[i], np.asarray(one), "float64")
    text = str(jax.jit(lambda t: jnp.zeros(()) if polyattn.explain(
        jq, jk, jv, enable_gqa=True, score_mod=_capped, mod_args=(t,)) is None else
        jnp.ones(()))(table))
    assert text in ("0.0", "1.0")
    _ = q, k, v


# --- what "auto" takes ----------------------------------------------------------------------

def test_auto_on_torch_takes_the_kernel_where_it_measured_faster(monkeypatch):
    torch = pytest.importorskip("torch")
    from polyattn import _preferences

    monkeypatch.delenv("POLYATTN_NUMBA_CPU", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")   # torch's threads do not spin
    t = 512                                     # 8 · 512² = TORCH_NUMBA_CPU_MIN_SCORES
    assert 8 * t * t == _preferences.TORCH_NUMBA_CPU_MIN_SCORES
    x = torch.zeros((1, 8, t, 64))
    small = torch.zeros((1, 8, t // 2, 64))
    assert polyattn.explain(x, x, x, is_causal=True).implementation == "numba_cpu"
    e = polyattn.explain(small, small, small, is_causal=True)
    assert e.implementation == "native"
    assert "TORCH_NUMBA_CPU_MIN_SCORES" in e.candidates["numba_cpu"]
    assert polyattn.explain(x, x, x).implementation == "numba_cpu"
    # rules torch takes only as a dense mask, or not at all: the kernel
    assert polyattn.explain(x, x, x, window=(64, 0)).implementation == "numba_cpu"
    assert polyattn.explain(x, x, x, softcap=20.0).implementation == "numba_cpu"
    # with autograd: the kernel where the call is causal; without a causal mask torch's
    # own backward pass measured as fast in float32 below its own crossover, on calls it
    # expresses
    leaf = x.clone().requires_grad_()
    assert polyattn.explain(leaf, x, x, is_causal=True).implementation == "numba_cpu"
    e = polyattn.explain(leaf, x, x)
    assert e.implementation == "native" and "backward" in e.candidates["numba_cpu"]
    assert "TORCH_NUMBA_CPU_GRAD_MIN_SCORES" in e.candidates["numba_cpu"]
    wide = torch.zeros((4, 8, t, 64))               # 4 · 8 · 512² = the grad crossover
    assert wide.numel() // 64 * t == _preferences.TORCH_NUMBA_CPU_GRAD_MIN_SCORES
    wide_leaf = wide.clone().requires_grad_()
    assert polyattn.explain(wide_leaf, wide, wide).implementation == "numba_cpu"
    assert polyattn.explain(wide_leaf[:3], wide[:3], wide[:3]).implementation == "native"
    # in float64 the kernel's backward pass measured faster from the forward's crossover
    double = x.double()
    e = polyattn.explain(double.clone().requires_grad_(), double, double)
    assert e.implementation == "numba_cpu", e
    assert polyattn.explain(leaf, x, x, softcap=20.0).implementation == "numba_cpu"
    # ... but not where torch's own attention cannot run the call (lse, sinks)
    assert polyattn.explain(leaf, x, x, return_lse=True).implementation == "numba_cpu"
    sinks = torch.zeros(8, requires_grad=True)
    assert polyattn.explain(leaf, x, x, sinks=sinks).implementation == "numba_cpu"
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "0")
    assert polyattn.explain(x, x, x, is_causal=True).implementation == "native"


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np, polyattn
from jax.sharding import Mesh, NamedSharding, PartitionSpec
mesh = Mesh(np.array(jax.devices()), ("b",))
spec = NamedSharding(mesh, PartitionSpec("b"))
x = jax.device_put(jnp.ones((2, 4, 1024, 64), jnp.float32), spec)
e = polyattn.explain(x, x, x, is_causal=True)
print(e.implementation)
print(e.candidates["numba_cpu"])
f = lambda x: polyattn.scaled_dot_product_attention(x, x, x, is_causal=True)
o = jax.jit(f)(x)
print(o.sharding == spec, abs(float((o + x).sum()) / 2**20 - 1) < 1e-5)
print(jax.jit(jax.grad(lambda x: f(x).sum()))(x).sharding == spec)
y = jnp.ones((1, 2, 64, 16), jnp.float32) * jnp.arange(16.0) / 16
g = jax.jit(lambda y: polyattn.scaled_dot_product_attention(y, y, y, is_causal=True,
                                                            implementation="numba_cpu"))
text = g.lower(y).as_text()
print("xla_ffi_python_cpu_callback" in text, "polyattn_numba_cpu_host" in text,
      bool(jnp.allclose(g(y), f(y), atol=1e-6)))
"""


def test_auto_on_torch_leaves_short_calls_to_torch_beside_its_spinning_threads(
        monkeypatch):
    """Without a causal mask in float32 and below TORCH_NUMBA_CPU_SPIN_MIN_SCORES, where
    the kernel's threads would share the cores with torch's spinning OpenMP threads, "auto"
    takes torch's own attention and says how to lift it; not with OMP_WAIT_POLICY=PASSIVE,
    on Numba's OpenMP layer, with a causal mask, in float64, or from the crossover."""
    torch = pytest.importorskip("torch")
    from polyattn import _preferences
    from polyattn.backends.numba_cpu import threads

    monkeypatch.delenv("POLYATTN_NUMBA_CPU", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    x = torch.zeros((1, 8, 512, 64))
    big = torch.zeros((2, 8, 1024, 64))          # 2 · 8 · 1024² = the crossover
    assert 2 * 8 * 1024 * 1024 == _preferences.TORCH_NUMBA_CPU_SPIN_MIN_SCORES
    monkeypatch.setattr(threads, "_torch_on_openmp", lambda: True)
    for layer, spins in (("tbb", True), ("workqueue", True), ("omp", False)):
        monkeypatch.setattr(threads, "_layer_and_how", lambda layer=layer: (layer, "asked"))
        assert threads.beside_spinning_torch() is spins
        e = polyattn.explain(x, x, x)
        assert e.implementation == ("native" if spins else "numba_cpu"), e
        if spins:
            why = e.candidates["numba_cpu"]
            assert "TORCH_NUMBA_CPU_SPIN_MIN_SCORES" in why and "OMP_WAIT_POLICY" in why
        assert polyattn.explain(x, x, x, is_causal=True).implementation == "numba_cpu"
        assert polyattn.explain(big, big, big).implementation == "numba_cpu"
        double = x.double()                 # float64: the kernel's margin is wider
        assert polyattn.explain(double, double, double).implementation == "numba_cpu"
    monkeypatch.setattr(threads, "_layer_and_how", lambda: ("tbb", "asked"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert not threads.beside_spinning_torch()
    assert polyattn.explain(x, x, x).implementation == "numba_cpu"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(threads, "_torch_on_openmp", lambda: False)
    assert not threads.beside_spinning_torch()


def test_torch_tensors_the_kernel_cannot_view_are_named_for_what_they_are():
    """Meta tensors are said to be on the meta device (not CPU tensors, not traced)."""
    torch = pytest.importorskip("torch")
    m = torch.zeros((1, 2, 8, 4), device="meta")
    with pytest.raises(ValueError, match="torch arrays on the meta device"):
        sdpa(m, m, m, implementation="numba_cpu")
    e = polyattn.explain(m, m, m)
    assert e.candidates["numba_cuda"] == ("inputs are torch arrays on the meta device, not "
                                          "CUDA arrays")


def test_auto_on_jax_keeps_arrays_sharded_over_several_cpu_devices(jax):
    """With several JAX CPU devices "auto" leaves the kernel (a host callback on one
    device) to JAX's own attention, which keeps a sharded input's sharding, forward and
    under jax.grad, and says why."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0] == "native"
    assert "2 JAX CPU devices" in lines[1]
    assert lines[2] == "True True"                  # and it adds to a sharded array
    assert lines[3] == "True"
    # numba_cpu asked for by name stays a host callback (one device) among several devices
    assert lines[4] == "True False True"


def test_auto_on_jax_takes_the_kernel_from_its_crossover_under_jit_too(jax, monkeypatch):
    import jax.numpy as jnp

    from polyattn import _preferences

    monkeypatch.delenv("POLYATTN_NUMBA_CPU", raising=False)
    t = 256
    assert 4 * t * t == _preferences.JAX_NUMBA_CPU_MIN_SCORES
    x = jnp.zeros((1, 4, t, 32), dtype=jnp.float32)
    small = x[:, :, : t // 2]
    e = polyattn.explain(x, x, x)
    assert e.implementation == "numba_cpu", e
    assert "JAX_NUMBA_CPU_MIN_SCORES" in e.reason
    e = polyattn.explain(small, small, small)
    assert e.implementation == "native"
    assert "JAX_NUMBA_CPU_MIN_SCORES" in e.candidates["numba_cpu"]
    seen = []

    @jax.jit
    def f(q):
        seen.append(polyattn.explain(q, x, x, is_causal=True).implementation)
        return polyattn.scaled_dot_product_attention(q, x, x, is_causal=True)

    f(x + 1.0)
    assert seen == ["numba_cpu"]


def test_the_routes_benchmark_runs_and_reports(jax, tmp_path):
    """benchmarks/routes.py on its smallest case, one round: a results file with every
    contender's ratio."""
    pytest.importorskip("torch")
    import importlib
    import json
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parents[3] / "benchmarks"
    sys.path.insert(0, str(here))
    try:
        routes = importlib.import_module("routes")
        assert routes.main(["--reps", "1", "--max-t", "64", "--dtypes", "float32",
                            "--out", str(tmp_path)]) == 0
    finally:
        sys.path.remove(str(here))
    (report,) = tmp_path.glob("routes-cpu-*.json")
    rows = json.loads(report.read_text())["results"]
    assert {r["library"] for r in rows} == {"torch", "jax"} and len(rows) == 4
    for row in rows:
        assert set(row["ratio_to_own"]) == {"auto", "numba_cpu", "auto fb", "numba_cpu fb"}
        assert all(x > 0 for x in row["ratio_to_own"].values())
        assert row["max_abs_diff_auto_vs_own"] < 1e-4
    assert "| torch | (1, 4, 64, 64) |" in report.with_suffix(".md").read_text()


def test_jit_runs_the_kernel_on_xlas_buffers(jax, counted):
    """Under ``jax.jit`` on the CPU the primitives lower to polyattn's XLA FFI handler, not
    to ``jax.pure_callback``: forward and ``jax.grad`` are bitwise those of the eager
    calls (the same kernel on the same values), and the operands are left as they were."""
    import jax.numpy as jnp

    (q, k, v), _ = _inputs()
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))

    def f(q, k, v):
        return sdpa(q, k, v, implementation="numba_cpu", is_causal=True, enable_gqa=True)

    def loss(q, k, v):
        return (f(q, k, v) ** 2).sum()

    for fn in (f, jax.grad(loss, argnums=(0, 1, 2))):
        text = jax.jit(fn).lower(jq, jk, jv).as_text()
        assert "polyattn_numba_cpu_host" in text
        assert "python_cpu_callback" not in text
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(jq, jk, jv)),
                                  np.asarray(f(jq, jk, jv)))
    eager = jax.grad(loss, argnums=(0, 1, 2))(jq, jk, jv)
    for got, want in zip(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv), eager,
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for before, after in zip((q, k, v), (jq, jk, jv), strict=True):
        np.testing.assert_array_equal(before, np.asarray(after))
    assert counted["forward"] == 4 and counted["backward"] == 2


def _ffi_primitive(jax, host, result_shape, result_dtype):
    """A one-result primitive whose CPU lowering is polyattn's FFI handler running
    ``host(None, *operands)``."""
    from jax.core import ShapedArray
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    from polyattn import _jax_ffi

    p = Primitive(f"polyattn_test_{host.__name__}")
    p.multiple_results = True
    p.def_abstract_eval(lambda *avals: [ShapedArray(result_shape, result_dtype)])

    def rule(ctx, *args):
        key = _jax_ffi.register(host, None, ctx.avals_in, ctx.avals_out)
        return jax.ffi.ffi_lowering(_jax_ffi.ensure_registered())(ctx, *args,
                                                                  call=np.int64(key))

    mlir.register_lowering(p, rule, platform="cpu")
    return p


def test_ffi_handler_reads_operands_in_place_and_reports_failures(jax):
    """The handler hands the host function read-only NumPy views of the operands (empty
    ones included) and copies its results into XLA's buffers; an exception, or a result
    of another dtype or shape than the primitive's, reaches the caller as an error naming
    it, not a crash."""
    import jax.numpy as jnp

    seen = {}

    def total(_, x, empty, into):
        seen["writeable"] = (x.flags.writeable, empty.shape, into[0].flags.writeable)
        return [np.asarray(x.sum(axis=0) + empty.size)]

    def in_place(_, x, empty, into):
        np.sum(x, axis=0, out=into[0])
        seen["into"] = into[0].ctypes.data
        return [into[0]]

    add = _ffi_primitive(jax, total, (3,), np.float64)
    x = jnp.arange(12.0).reshape(4, 3)
    got = jax.jit(lambda x, e: add.bind(x, e)[0])(x, jnp.zeros((0, 2)))
    np.testing.assert_array_equal(np.asarray(got), [18.0, 22.0, 26.0])
    assert seen["writeable"] == (False, (0, 2), True)
    add = _ffi_primitive(jax, in_place, (3,), np.float64)
    got = jax.jit(lambda x, e: add.bind(x, e)[0])(x, jnp.zeros((0, 2)))
    np.testing.assert_array_equal(np.asarray(got), [18.0, 22.0, 26.0])
    assert seen["into"] == got.unsafe_buffer_pointer()       # XLA's own result buffer

    def fails(_, x, into):
        raise ValueError("no such rule")

    def narrow(_, x, into):
        return [np.zeros(3, np.float32)]

    for host, message in ((fails, "polyattn: ValueError: no such rule"),
                          (narrow, r"result 0 is float32\[3\], its buffer float64\[3\]")):
        bad = _ffi_primitive(jax, host, (3,), np.float64)
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(jax.jit(lambda x, bad=bad: bad.bind(x)[0])(x))


@pytest.mark.parametrize("case", ["one part", "parts", "broadcast batch", "mismatched"])
def test_kernel_writes_its_results_into_given_arrays(case):
    """``into``: the forward and backward passes write their results into the arrays
    given where those can take them (the results are views of them), bitwise as when they
    allocate; where they cannot (an input's broadcast batch axis summed, another dtype),
    the results are new arrays and the given ones are left alone."""
    from polyattn.backends.numba_cpu import gradients
    from polyattn.rules.visibility import Rules

    rng = np.random.default_rng(3)
    tk = 600 if case == "parts" else 40                  # 600 keys: three blocks, parts
    q = rng.standard_normal((2, 2, 24, 8))
    k, v = rng.standard_normal((2, 1, tk, 8)), rng.standard_normal((2, 1, tk, 8))
    if case == "broadcast batch":
        k, v = k[:1], v[:1]
    kw = dict(mask=None, rules=Rules(24, tk, causal=False), scale=0.3, xp=np)
    out, lse = launch.attention(q, k, v, **kw)
    g = rng.standard_normal(out.shape)
    want = launch.backward(q, k, v, out, lse, g, **kw)
    if case == "parts":
        assert gradients.part_count(2, 3, q.nbytes) > 1
    dtype = np.float32 if case == "mismatched" else np.float64
    into = [np.full(out.shape, np.nan, dtype), np.full(lse.shape, np.nan, dtype)]
    got = launch.attention(q, k, v, into=into, **kw)
    grads_into = [np.full(x.shape, np.nan, dtype) for x in (q, k, v)]
    grads = launch.backward(q, k, v, out, lse, g, into=grads_into, **kw)
    summed = ("dk", "dv") if case == "broadcast batch" else ()
    for name, result, expected, given in zip(("out", "lse", "dq", "dk", "dv"),
                                             (*got, *grads), (out, lse, *want),
                                             (*into, *grads_into), strict=True):
        np.testing.assert_array_equal(result, expected)
        written = np.shares_memory(result, given)
        assert written == (case != "mismatched" and name not in summed), name
        if not written:
            assert np.isnan(given).all()


def test_jit_without_jax_ffi_keeps_the_host_callback(jax, monkeypatch):
    """With a JAX that has no ``jax.ffi`` the primitives lower to ``jax.pure_callback``,
    with the same results."""
    import jax.numpy as jnp

    from polyattn import _jax_ffi

    (q, k, v), _ = _inputs()
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))

    def f(q, k, v):
        return sdpa(q, k, v, implementation="numba_cpu", enable_gqa=True)

    want = np.asarray(jax.jit(f)(jq, jk, jv))
    monkeypatch.setattr(_jax_ffi, "available", lambda: False)
    again = jax.jit(lambda q, k, v: f(q, k, v))
    text = again.lower(jq, jk, jv).as_text()
    assert "python_cpu_callback" in text and "polyattn_numba_cpu_host" not in text
    np.testing.assert_array_equal(np.asarray(again(jq, jk, jv)), want)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_rows_without_keys_keep_non_finite_cotangents_to_themselves(jax, bad):
    """Rows that see no key (lse -inf) have zero gradients whatever cotangent reaches their
    lse: a z-loss whose derivative there is NaN (JAX under jax.jit), or a NaN or inf
    ``grad_lse`` there (NumPy, attention_vjp), leaves dK and dV as the reference gives
    them (finite) and those rows' dQ zero."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 24, 8))
    k, v = rng.standard_normal((1, 2, 16, 8)), rng.standard_normal((1, 2, 16, 8))
    kw = dict(is_causal=True, causal_alignment="bottom_right")  # rows 0-7 see no key

    def loss(q, k, v, impl):
        out, lse = sdpa(q, k, v, return_lse=True, implementation=impl, **kw)
        # a z-loss: its derivative at the rows' lse of -inf is NaN (2·lse·0)
        return jnp.sum(out**2) + 1e-4 * jnp.sum(jnp.where(jnp.isfinite(lse), lse**2, 0.0))

    grads = {impl: jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(
        *(jnp.asarray(x) for x in (q, k, v)), impl) for impl in ("reference", "numba_cpu")}
    (rq, rk, rv), (nq, nk, nv) = grads["reference"], grads["numba_cpu"]
    for got, want in ((nk, rk), (nv, rv), (nq[:, :, 8:], rq[:, :, 8:])):
        assert np.isfinite(np.asarray(want)).all()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)
    assert (np.asarray(nq[:, :, :8]) == 0).all()
    out, pullback = polyattn.attention_vjp(q, k, v, implementation="numba_cpu", **kw)
    g_out = np.ones_like(out)
    g_lse = np.zeros(out.shape[:-1])
    g_lse[:, :, :8] = bad
    dq, dk, dv = pullback(g_out, g_lse)
    _, ref = polyattn.attention_vjp(q, k, v, implementation="reference", **kw)
    _, rk, rv = ref(g_out)
    np.testing.assert_allclose(dk, rk, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dv, rv, rtol=1e-10, atol=1e-12)
    assert (dq[:, :, :8] == 0).all()


def test_traced_segment_ids_are_refused_for_what_they_are(jax):
    """Segment ids traced by jax.jit cannot be lowered to key ranges: numba_cpu says they
    are traced (not that they are unsorted) and how to pass them."""
    import jax.numpy as jnp

    x = jnp.zeros((1, 2, 16, 8), jnp.float32)
    ids = jnp.asarray([[0] * 8 + [1] * 8])

    def f(x, ids):
        return sdpa(x, x, x, segment_ids=ids, implementation="numba_cpu")

    with pytest.raises(ValueError, match=r"not at hand \(traced\)"):
        jax.jit(f)(x, ids)
    assert f(x, ids).shape == x.shape                           # eagerly: sorted, at hand
    assert jax.jit(lambda x: f(x, ids))(x).shape == x.shape     # closed over: concrete
