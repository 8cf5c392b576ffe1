"""Eager calls on JAX arrays run each Array-API pass as one compiled computation
(:mod:`polyattn._jax_eager`): the same results as the operations run one by one, one
compile per call template, and eager operations wherever a cached computation could go
stale or would be compiled anew at every call."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import pytest
from helpers import Backend, assert_close, assert_lse_close, ref_attention, selected_backends

import polyattn

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytestmark = pytest.mark.skipif(Backend.JAX not in selected_backends(),
                                reason="JAX's eager calls: the JAX session")

from polyattn import _autograd, _jax_eager  # noqa: E402
from polyattn._problem import prepare  # noqa: E402
from polyattn.backends import array_api  # noqa: E402

IMPLEMENTATIONS = ["reference", "chunked"]


@pytest.fixture(autouse=True)
def x64():
    was = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", was)


@pytest.fixture
def compiled(monkeypatch):
    """The keys compiled during the test (the process-wide store, emptied for it)."""
    store: OrderedDict = OrderedDict()
    monkeypatch.setattr(_jax_eager, "_COMPILED", store)
    return store


def arrays(seed=0, shape=(2, 3, 10, 8), tk=12):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape)
    k = rng.standard_normal((*shape[:-2], tk, shape[-1]))
    v = rng.standard_normal((*shape[:-2], tk, shape[-1]))
    return q, k, v


def call(q, k, v, implementation, **options):
    return polyattn.scaled_dot_product_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), implementation=implementation,
        return_lse=True, **options)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_one_compile_per_template_and_the_formulas_results(implementation, compiled):
    for seed in range(3):                      # new arrays, same shapes: no new compile
        q, k, v = arrays(seed)
        out, lse = call(q, k, v, implementation, is_causal=True, softcap=5.0)
        ref, ref_lse, _ = ref_attention(q, k, v, is_causal=True, softcap=5.0)
        assert isinstance(out, jax.Array)
        assert_close(out, ref, "float64")
        assert_lse_close(lse, ref_lse, "float64")
    assert len(compiled) == 1
    call(*arrays(), implementation, is_causal=True, softcap=6.0)   # a new rule value
    call(*arrays(shape=(2, 3, 9, 8)), implementation, is_causal=True, softcap=5.0)
    assert len(compiled) == 3


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_same_results_as_the_operations_one_by_one(implementation, monkeypatch):
    q, k, v = arrays(1)
    lengths = np.array([7, 12])
    options = {"window": (3, 1), "alibi_slopes": jnp.asarray([0.5, 0.25, 0.125]),
               "key_lengths": jnp.asarray(lengths)}
    fused = call(q, k, v, implementation, **options)
    monkeypatch.setattr(_jax_eager, "passes", lambda backend, problem: None)
    one_by_one = call(q, k, v, implementation, **options)
    for a, b in zip(fused, one_by_one, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def test_key_lengths_are_operands_so_a_decoding_loop_compiles_once(compiled):
    q, k, v = arrays(2, shape=(2, 3, 1, 8), tk=16)
    for n in range(3, 9):
        lengths = np.array([n, 16 - n])
        out, _ = call(q, k, v, "chunked", key_lengths=jnp.asarray(lengths),
                      causal_alignment="bottom_right", is_causal=True)
        ref, _, _ = ref_attention(q, k, v, key_lengths=lengths)
        assert_close(out, ref, "float64")
    assert len(compiled) == 1


def test_a_rule_closing_over_a_number_is_keyed_by_it(compiled):
    q, k, v = arrays(3)

    def shifted(c):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + c * (q_idx - kv_idx)
        return score_mod

    outs = [call(q, k, v, "reference", score_mod=shifted(c))[0] for c in (0.0, 0.5, 0.5)]
    assert_close(outs[0], ref_attention(q, k, v)[0], "float64")
    assert not np.allclose(np.asarray(outs[0]), np.asarray(outs[1]))
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(outs[2]))
    assert len(compiled) == 2                  # 0.0 and 0.5: the second 0.5 reuses its pass


def test_a_rule_reading_an_array_stays_eager_and_sees_its_new_value(compiled):
    q, k, v = arrays(4)
    table = {"bias": jnp.zeros(3)}

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table["bias"][h] * (q_idx - kv_idx)     # a slope per head

    first = call(q, k, v, "chunked", score_mod=score_mod)[0]
    table["bias"] = jnp.asarray([1.0, -2.0, 3.0])
    second = call(q, k, v, "chunked", score_mod=score_mod)[0]
    assert_close(first, ref_attention(q, k, v)[0], "float64")
    assert not np.allclose(np.asarray(first), np.asarray(second))
    assert len(compiled) == 0


def test_block_sizes_are_part_of_the_key(compiled, monkeypatch):
    q, k, v = arrays(5, shape=(1, 2, 20, 8), tk=20)
    ref = ref_attention(q, k, v, is_causal=True)[0]
    assert_close(call(q, k, v, "chunked", is_causal=True)[0], ref, "float64")
    from polyattn.backends.array_api import blocked

    monkeypatch.setattr(blocked, "BLOCK_Q", 6)
    monkeypatch.setattr(blocked, "BLOCK_K", 4)
    assert array_api.CHUNKED.settings() == (6, 4)
    assert_close(call(q, k, v, "chunked", is_causal=True)[0], ref, "float64")
    assert len(compiled) == 2


def test_dropout_seeds_are_operands(compiled, monkeypatch):
    q, k, v = arrays(6)
    a = call(q, k, v, "reference", dropout_p=0.5, dropout_seed=1)[0]
    b = call(q, k, v, "reference", dropout_p=0.5, dropout_seed=2**40 + 2)[0]
    c = call(q, k, v, "reference", dropout_p=0.5, dropout_seed=jnp.asarray(1))[0]
    assert len(compiled) == 1                 # one computation for every seed
    assert not np.allclose(np.asarray(a), np.asarray(b))
    monkeypatch.setattr(_jax_eager, "passes", lambda backend, problem: None)
    for seed, got in ((1, a), (2**40 + 2, b), (1, c)):    # the weights the ints drop
        want = call(q, k, v, "reference", dropout_p=0.5, dropout_seed=seed)[0]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


def test_a_seed_no_jax_array_holds_stays_eager(compiled):
    q, k, v = arrays(6)
    jax.config.update("jax_enable_x64", False)
    try:
        x = [jnp.asarray(a, dtype=jnp.float32) for a in (q, k, v)]
        for seed in (5, 2**40 + 5):
            polyattn.scaled_dot_product_attention(*x, dropout_p=0.5, dropout_seed=seed,
                                                  implementation="chunked")
        why = polyattn.explain(*x, dropout_p=0.5, dropout_seed=2**40 + 5,
                               implementation="chunked").details["jax eager"]
    finally:
        jax.config.update("jax_enable_x64", True)
    assert len(compiled) == 1                 # 5 compiled; 2**40 + 5 does not fit uint32
    assert why.startswith("operation by operation: a dropout seed of 2**32 or more"), why


def test_rules_reading_signed_zeros_and_ops_functions(compiled):
    """A rule's global read by its bits (0.0 and -0.0 are different rules), and polyattn.ops
    functions by name, however the rule names them."""
    import math

    from polyattn import ops

    q, k, v = arrays(12)
    namespace = {"math": math, "ops": ops, "tanh": ops.tanh, "Z": 0.0}
    exec("def signed(s, b, h, q_idx, kv_idx):\n"
         "    return s + math.copysign(1.0, Z) * (q_idx - kv_idx)\n"
         "def capped(s, b, h, q_idx, kv_idx):\n"
         "    return ops.tanh(s) + tanh(s)\n", namespace)
    outs = []                                 # (a dict would take 0.0 and -0.0 as one key)
    for z in (0.0, -0.0):
        namespace["Z"] = z
        outs.append(np.asarray(call(q, k, v, "chunked", score_mod=namespace["signed"])[0]))
        want = polyattn.scaled_dot_product_attention(q, k, v, implementation="reference",
                                                     score_mod=namespace["signed"])
        np.testing.assert_allclose(outs[-1], want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(outs[0], outs[1])
    x = jnp.zeros((1, 2, 8, 4))
    why = polyattn.explain(x, x, x, score_mod=namespace["capped"], implementation="chunked")
    assert why.details["jax eager"].startswith("one jax.jit computation"), why


def test_under_jax_transforms_the_computation_is_differentiated_and_mapped(compiled,
                                                                          monkeypatch):
    q, k, v = (jnp.asarray(a) for a in arrays(7))
    lengths = jnp.asarray([5, 12])

    def loss(q, k):
        return polyattn.scaled_dot_product_attention(
            q, k, v, is_causal=True, key_lengths=lengths, implementation="chunked").sum()

    eager = jax.grad(loss, argnums=(0, 1))(q, k)
    assert len(compiled) == 1                 # eager jax.grad: one computation, differentiated
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)
    with monkeypatch.context() as m:
        m.setattr(_jax_eager, "passes", lambda backend, problem: None)
        one_by_one = jax.grad(loss, argnums=(0, 1))(q, k)
    for a, b, c in zip(eager, jitted, one_by_one, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(np.asarray(b), np.asarray(c), rtol=1e-10, atol=1e-12)
    mapped = jax.vmap(lambda q: polyattn.scaled_dot_product_attention(
        q[None], k[:1], v[:1], implementation="reference")[0])(q)
    for row in range(2):
        want = polyattn.scaled_dot_product_attention(q[row:row + 1], k[:1], v[:1],
                                                     implementation="reference")[0]
        np.testing.assert_allclose(np.asarray(mapped[row]), np.asarray(want), rtol=1e-12,
                                   atol=1e-12)


def test_the_backward_pass_of_attention_vjp_runs_compiled(compiled):
    q, k, v = arrays(8)
    g = np.random.default_rng(9).standard_normal(q.shape)
    out, vjp = polyattn.attention_vjp(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      implementation="chunked", is_causal=True)
    dq, dk, dv = vjp(jnp.asarray(g))
    ref_out, ref_vjp = polyattn.attention_vjp(q, k, v, implementation="reference",
                                              is_causal=True)
    for a, b in zip((out, dq, dk, dv), (ref_out, *ref_vjp(g)), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-9, atol=1e-11)
    assert any(key[-1] == "backward" for key in compiled)


def test_the_store_keeps_the_most_recent_passes(compiled, monkeypatch):
    monkeypatch.setattr(_jax_eager, "CAPACITY", 2)
    q, k, v = arrays(10)
    for c in (1.0, 2.0, 1.0, 3.0):             # 1.0 used again: 2.0 is the oldest
        call(q, k, v, "reference", softcap=c)
    kept = repr(list(compiled))
    assert len(compiled) == 2
    assert (1.0).hex() in kept and (3.0).hex() in kept and (2.0).hex() not in kept


def test_passes_with_no_key_run_the_operations_one_by_one():
    q, k, v = (jnp.asarray(a) for a in arrays(11))
    problem = prepare(q, k, v, attn_mask=None, is_causal=True, causal_alignment="top_left",
                      scale=None, enable_gqa=False)
    assert _jax_eager.passes(array_api.CHUNKED, problem) is not None
    odd = dataclasses.replace(problem, layout=object())    # no key: run as it is
    assert _jax_eager.passes(array_api.CHUNKED, odd) is None
    forward, _ = _autograd.passes(array_api.CHUNKED, odd)
    out, _ = forward(q, k, v)
    assert_close(out, ref_attention(np.asarray(q), np.asarray(k), np.asarray(v),
                                     is_causal=True)[0], "float64")


def test_explain_says_how_the_call_runs():
    x = jnp.zeros((1, 2, 8, 4))
    compiled = polyattn.explain(x, x, x, is_causal=True, implementation="chunked")
    assert compiled.details["jax eager"].startswith("one jax.jit computation per pass")
    segments = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]])
    packed = polyattn.explain(x, x, x, segment_ids=segments, implementation="chunked")
    assert packed.details["jax eager"].startswith("operation by operation: sorted segment")
    assert "jax eager" in str(packed)

    def reads_an_array(score, b, h, q_idx, kv_idx):
        return score + x[0, h, 0, 0]

    ruled = polyattn.explain(x, x, x, score_mod=reads_an_array, implementation="reference")
    assert "reads an array" in ruled.details["jax eager"]
    traced = []
    jax.jit(lambda x: traced.append(polyattn.explain(x, x, x, implementation="chunked"))
            or x)(x)
    assert traced[0].details["jax eager"].startswith("one jax.jit computation per pass")
    assert "jax eager" not in polyattn.explain(np.zeros((1, 2, 8, 4)),
                                               np.zeros((1, 2, 8, 4)),
                                               np.zeros((1, 2, 8, 4))).details


def test_the_benchmark_case_runs():
    """benchmarks/jax_eager.py's contenders run on a tiny shape and agree (no timing is
    asserted: the benchmark measures)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import jax_eager

    # (caches kept: clearing them would make the worker's later tests compile again)
    row = jax_eager.run_case(1, 2, 16, 8, "float64", 1, np.random.default_rng(0), cold=False)
    assert set(row["compiled_over_op_by_op"]) == {"reference compiled", "chunked compiled"}
    diff = row["max_abs_diff_vs_reference_op_by_op"]
    assert max(d for name, d in diff.items() if not name.startswith("jax")) < 1e-12, row
    assert diff["jax.nn.dot_product_attention"] < 1e-5, row     # its softmax: float32
    assert all(t > 0 for t in row["first_call_s"].values())
    assert any(line.startswith("| (1, 2, 16, 8)") for line in jax_eager.table([row]))
