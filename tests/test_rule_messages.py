"""What a rule users write is told, and the Python operators it may use (docs/rules.rst).

An array indexed by a rule's argument without passing through ``mod_args`` is named, with
the fix, when ``numba_cpu`` traces the rule and in :func:`polyattn.explain`; a ``math``
function on a rule's argument points to its :mod:`polyattn.ops` form; a table indexed by
the score says what indexes a table. ``%`` and ``//`` on the score run as Python's, with
their derivatives, on the Array-API paths and in the compiled kernel alike. The page's
statements are checked as written: how an index outside a table's axis is read, which
calls give a table's gradient, and the output its examples print (the comments under
them). :class:`polyattn.MultiHeadAttention` takes the rules too.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _support import NUMPY_SESSION_ONLY, use_implementation
from helpers import Backend, numba_installed, rel_error

import polyattn
from polyattn import ops
from polyattn.ops import Dual
from polyattn.rules import tracing
from polyattn.rules.user import Table

pytestmark = NUMPY_SESSION_ONLY
sdpa = polyattn.scaled_dot_product_attention
RULES_PAGE = Path(__file__).resolve().parents[1] / "docs" / "rules.rst"

BIAS = np.zeros(2)              # a global array that a rule should receive by mod_args
GRID = np.zeros((2, 9))
STEPS = [0.0, 1.0]


@pytest.fixture
def numba_cpu(monkeypatch):
    return use_implementation("numba_cpu", Backend.NUMPY, monkeypatch)


def _qkv(rng, t=24, h=2):
    return tuple(rng.standard_normal((1, h, t, 8)) for _ in range(3))


def _trace_error(fn) -> str:
    with pytest.raises(TypeError) as info:
        tracing.trace(fn, "score_mod", ())
    return str(info.value)


# --------------------------------------------------------------------------- #
# An array that does not come through mod_args
# --------------------------------------------------------------------------- #

def test_a_global_array_indexed_by_an_argument_is_named_with_the_fix(numba_cpu):
    q, k, v = _qkv(np.random.default_rng(0), t=64)

    def rule(s, b, h, q_idx, kv_idx):
        return s + BIAS[h]

    with pytest.raises(ValueError) as info:
        sdpa(q, k, v, score_mod=rule, implementation=numba_cpu)
    text = str(info.value)
    assert "a ndarray in a rule (the global BIAS, of shape (2,)" in text
    assert "arrays reach a rule only through mod_args" in text
    assert "mod_args=(BIAS,)" in text
    assert "NumPy function" not in text
    explained = str(polyattn.explain(q, k, v, score_mod=rule))
    assert "numba_cpu: not chosen" in explained and "the global BIAS" in explained
    # the fix it gives runs in the kernel
    fixed = sdpa(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx, bias: s + bias[h],
                 mod_args=(BIAS,), implementation=numba_cpu)
    assert rel_error(fixed, sdpa(q, k, v, implementation="reference")) <= 1e-12


def _closure_rule():
    local = np.ones(3)
    return lambda s, b, h, q_idx, kv_idx: s * local[kv_idx % 3]


class _Holder:
    bias = np.zeros(2)


@pytest.mark.parametrize("rule, words", [
    (lambda s, b, h, q_idx, kv_idx: s + GRID[h, q_idx - kv_idx + 4],
     "the global GRID, of shape (2, 9)"),
    (lambda s, b, h, q_idx, kv_idx: s + GRID[h, ops.minimum(q_idx, 8)] * 2.0,
     "the global GRID"),
    (_closure_rule(), "the closure variable local, of shape (3,)"),
    (lambda s, b, h, q_idx, kv_idx, bias=BIAS: s + bias[h], "the variable bias"),
    (lambda s, b, h, q_idx, kv_idx: s + STEPS[h], "a list in a rule (the global STEPS"),
    (lambda s, b, h, q_idx, kv_idx: s + _Holder.bias[h], "the attribute bias"),
    (lambda s, b, h, q_idx, kv_idx: s + GRID[0][h], "an array in a rule"),
])
def test_an_array_indexed_by_an_argument_is_named_when_traced(rule, words):
    text = _trace_error(rule)
    assert words in text, text
    assert "arrays reach a rule only through mod_args" in text
    assert "NumPy function" not in text


def test_numpy_and_math_functions_point_to_their_ops_forms_when_traced():
    text = _trace_error(lambda s, b, h, q_idx, kv_idx: np.where(s > 0, s, 0.0))
    assert "NumPy function" in text and "np.where -> ops.where" in text
    text = _trace_error(lambda s, b, h, q_idx, kv_idx: np.exp(s))
    assert "np.exp -> ops.exp" in text
    text = _trace_error(lambda s, b, h, q_idx, kv_idx: s - math.exp(-abs(q_idx - kv_idx)))
    assert "Python float" in text and "math.exp -> ops.exp" in text
    # a 0-d array keeps its own message; indexing an argument keeps its own
    assert "a ndarray in a rule: arrays reach a rule only through mod_args" in _trace_error(
        lambda s, b, h, q_idx, kv_idx: s + np.zeros(()))
    assert "indexing a rule's index argument" in _trace_error(
        lambda s, b, h, q_idx, kv_idx: s + h[0])


def test_the_hint_names_only_what_the_rule_calls():
    assert tracing.ops_hint(lambda s: s + abs(s)) == ""
    assert tracing.ops_hint(lambda s: math.tanh(s) + np.sqrt(s)) in (
        ": math.tanh -> ops.tanh, np.sqrt -> ops.sqrt",
        ": np.sqrt -> ops.sqrt, math.tanh -> ops.tanh")
    from math import log

    assert tracing.ops_hint(lambda s: log(s)) == ": log -> ops.log"
    assert tracing.ops_hint(len) == ""                       # no code: no hint, no error


# --------------------------------------------------------------------------- #
# math functions and tables indexed by the score, on the Array-API paths
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_a_math_function_on_an_argument_points_to_ops(implementation):
    q, k, v = _qkv(np.random.default_rng(1))
    with pytest.raises(TypeError) as info:
        sdpa(q, k, v, score_mod=lambda s, b, h, i, j: s - math.exp(-abs(i - j)),
             implementation=implementation)
    text = str(info.value)
    assert "math.exp -> ops.exp" in text and "polyattn.ops" in text
    with pytest.raises(TypeError, match=r"math.tanh -> ops.tanh"):
        sdpa(q, k, v, score_mod=lambda s, b, h, i, j: math.tanh(s),
             implementation=implementation)


def test_a_table_indexed_by_the_score_says_what_indexes_a_table():
    q, k, v = _qkv(np.random.default_rng(2))
    table = np.zeros(4)
    with pytest.raises(TypeError) as info:
        sdpa(q, k, v, score_mod=lambda s, b, h, i, j, t: s + t[s], mod_args=(table,),
             implementation="reference")
    text = str(info.value)
    assert "indexed by the score" in text
    assert "b, h, q_idx, kv_idx" in text and "not by the score" in text
    assert "object" not in text
    # a floating index array, as a plain forward pass's score is
    with pytest.raises(TypeError, match=r"indexed by float64 values: indices are integers: "
                                        r"a table is indexed by b, h, q_idx, kv_idx"):
        Table(table, np).lookup(np.array([0.5, 1.5]))
    with pytest.raises(TypeError, match="indexed by the score"):
        Table(table, np)[Dual(np.array([0.5]), np.array([1.0]))]


def test_an_operator_that_does_not_apply_to_the_score_says_so():
    q, k, v = _qkv(np.random.default_rng(3))
    with pytest.raises(TypeError, match=r"unsupported operand.*this operator does not apply "
                                        r"to the score"):
        sdpa(q, k, v, score_mod=lambda s, b, h, i, j: s & 1, implementation="reference")


# --------------------------------------------------------------------------- #
# % and // on the score
# --------------------------------------------------------------------------- #

def test_dual_remainder_and_floor_division_are_pythons_with_their_derivatives():
    x = np.linspace(-3.0, 3.0, 25) + 0.013
    forms = {
        "s % c": lambda s: s % 0.7,
        "s % -c": lambda s: s % -0.7,
        "c % s": lambda s: 1.3 % (s * s + 0.5),
        "s % f(s)": lambda s: s % (0.3 * s * s + 1.0),
        "s // c": lambda s: s // 0.5 + s,
        "c // s": lambda s: 2.0 // (s * s + 0.5) + s,
        "array % s": lambda s: np.full_like(x, 5.0) % (s * s + 1.5),
        "array // s": lambda s: np.full_like(x, 5.0) // (s * s + 1.5) - s,
    }
    for name, f in forms.items():
        out = f(Dual(x, np.ones_like(x)))
        assert isinstance(out, Dual), name
        np.testing.assert_array_equal(out.x, f(x), err_msg=name)
        h = 1e-7
        finite = (f(x + h) - f(x - h)) / (2 * h)
        np.testing.assert_allclose(out.d, finite, atol=1e-6, err_msg=name)
    # Python's signs: the remainder takes the divisor's
    assert (Dual(np.array([-1.0]), np.array([1.0])) % 0.7).x[0] == pytest.approx(-1.0 % 0.7)
    assert (Dual(np.array([1.0]), np.array([1.0])) % -0.7).x[0] == pytest.approx(1.0 % -0.7)
    assert (Dual(np.array([-1.0]), np.array([1.0])) // 0.7).x[0] == -2.0
    # the derivative of c % s with respect to s is -(c // s)
    s = Dual(np.array([1.5, 2.0]), np.ones(2))
    np.testing.assert_array_equal((np.array([5.0, 3.0]) % s).d, [-3.0, -1.0])


def _by_hand(q, k, v, rule):
    """Attention with ``rule`` applied to the scaled scores, written out in NumPy."""
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    s = rule(s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def test_remainder_on_the_score_in_a_plain_forward_call():
    q, k, v = _qkv(np.random.default_rng(4))
    for implementation in ("reference", "chunked"):
        out = sdpa(q, k, v, score_mod=lambda s, b, h, i, j: s % 1.0,
                   implementation=implementation)
        assert rel_error(out, _by_hand(q, k, v, lambda s: s % 1.0)) <= 1e-12
        out = sdpa(q, k, v, score_mod=lambda s, b, h, i, j: 2.0 * (s // 0.5),
                   implementation=implementation)
        assert rel_error(out, _by_hand(q, k, v, lambda s: 2.0 * (s // 0.5))) <= 1e-12


#: score_mods with % and // whose value and derivative the kernel gives as the Array-API
#: paths do: the score on the left of %, under //, and in the divisor.
KERNEL_RULES = {
    "s % c": lambda s, b, h, i, j: s % 0.7,
    "s % -c": lambda s, b, h, i, j: (-s) % -0.7 + s,
    "s - s // c": lambda s, b, h, i, j: s - s // 0.5,
    "index remainder": lambda s, b, h, i, j: s * (1.0 + (i - j) % 3) + (s * 3.0) % 1.0,
    "c % s": lambda s, b, h, i, j: s + 0.2 * (1.3 % (ops.abs(s) + 0.5)),
    "c // s": lambda s, b, h, i, j: s + 0.1 * (2.0 // (ops.abs(s) + 0.5)),
    "s % f(s)": lambda s, b, h, i, j: s % (0.3 * s * s + 1.0),
    "scaled floor": lambda s, b, h, i, j: s + 0.1 * (s // 0.5),
}
#: those with the score in the divisor, also against finite differences
DIVISOR_RULES = {
    "c % s": lambda s, b, h, i, j: s + 0.2 * (1.3 % (ops.abs(s) + 0.5)),
    "c // s": lambda s, b, h, i, j: s + 0.1 * (2.0 // (ops.abs(s) + 0.5)),
    "s % f(s)": lambda s, b, h, i, j: s % (0.3 * s * s + 1.0),
}


def _gradients(q, k, v, rule, implementation):
    out, pullback = polyattn.attention_vjp(q, k, v, score_mod=rule,
                                           implementation=implementation)
    return (out, *pullback(np.ones_like(out) + q[..., :1]))


@pytest.mark.parametrize("name", sorted(KERNEL_RULES))
def test_remainder_and_floor_division_give_the_same_gradients_everywhere(name, monkeypatch):
    rule = KERNEL_RULES[name]
    q, k, v = _qkv(np.random.default_rng(5), t=40)
    ref = _gradients(q, k, v, rule, "reference")
    names = ["chunked"] + (["numba_cpu"] if numba_installed() else [])
    for implementation in names:
        got = _gradients(q, k, v, rule, use_implementation(implementation, Backend.NUMPY,
                                                           monkeypatch))
        for a, b in zip(ref, got, strict=True):
            assert rel_error(b, a) <= 1e-12, implementation
    if numba_installed():
        out = sdpa(q, k, v, score_mod=rule, implementation="numba_cpu")
        assert rel_error(out, ref[0]) <= 1e-12


@pytest.mark.parametrize("name", sorted(DIVISOR_RULES))
def test_the_score_as_divisor_gives_its_derivative_on_the_array_api_paths(name, monkeypatch):
    rule = DIVISOR_RULES[name]
    q, k, v = _qkv(np.random.default_rng(6), t=16)
    ref = _gradients(q, k, v, rule, "reference")
    got = _gradients(q, k, v, rule, use_implementation("chunked", Backend.NUMPY, monkeypatch))
    for a, b in zip(ref, got, strict=True):
        assert rel_error(b, a) <= 1e-12
    # the query's gradient against a finite difference of the loss the cotangent weighs
    cot = np.ones_like(ref[0]) + q[..., :1]

    def loss(q):
        return float((sdpa(q, k, v, score_mod=rule, implementation="reference") * cot).sum())

    eps, e = 1e-6, np.zeros_like(q)
    e[0, 1, 5, 2] = eps
    assert (loss(q + e) - loss(q - e)) / (2 * eps) == pytest.approx(ref[1][0, 1, 5, 2],
                                                                    abs=1e-6)


# --------------------------------------------------------------------------- #
# What docs/rules.rst says
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("implementation", ["reference", "chunked", "numba_cpu"])
def test_an_index_outside_a_table_wraps_then_clamps_as_the_page_says(implementation,
                                                                     monkeypatch):
    implementation = use_implementation(implementation, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, t=24, h=1)
    table = rng.standard_normal((1, 9))
    distance = np.arange(24)[:, None] - np.arange(24)[None, :]
    # the page: from 4 up element 8; -13 to -5 counted from the end; below -13 element 0
    element = np.where(distance >= 4, 8, np.where(distance >= -4, distance + 4,
                                                  np.where(distance >= -13, distance + 13, 0)))
    expected = sdpa(q, k, v, attn_mask=table[0][element], implementation="reference")
    out = sdpa(q, k, v, score_mod=lambda s, b, h, i, j, t: s + t[h, i - j + 4],
               mod_args=(table,), implementation=implementation)
    assert rel_error(out, expected) <= 1e-12


def _t5(s, b, h, i, j, t):
    return s + t[h, ops.minimum(ops.maximum(i - j, -4), 4) + 4]


def test_a_table_gradient_from_torch_autograd_and_from_attention_vjp_as_the_page_says():
    torch = pytest.importorskip("torch")
    if not numba_installed():
        pytest.skip("numba_cpu needs Numba")
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, t=32)
    table = rng.standard_normal((2, 9))
    # attention_vjp on numba_cpu: the table's gradient comes last, as on the reference
    grads = {}
    for implementation in ("reference", "numba_cpu"):
        out, pullback = polyattn.attention_vjp(q, k, v, score_mod=_t5, mod_args=(table,),
                                               implementation=implementation)
        grads[implementation] = pullback(np.ones_like(out))
    assert len(grads["numba_cpu"]) == 4 and grads["numba_cpu"][3].shape == table.shape
    for a, b in zip(grads["reference"], grads["numba_cpu"], strict=True):
        assert rel_error(b, a) <= 1e-12
    # torch autograd: numba_cpu refuses a table that requires grad, "auto" gives it
    tq, tk, tv = (torch.tensor(x) for x in (q, k, v))
    tq.requires_grad_()
    tt = torch.tensor(table, requires_grad=True)
    with pytest.raises(ValueError, match=r"requires a gradient.*query, key and value only"):
        sdpa(tq, tk, tv, score_mod=_t5, mod_args=(tt,), implementation="numba_cpu")
    sdpa(tq, tk, tv, score_mod=_t5, mod_args=(tt,)).sum().backward()
    np.testing.assert_allclose(tt.grad.numpy(), grads["reference"][3], rtol=1e-10,
                               atol=1e-12)
    # and a table that does not require grad is taken
    out = sdpa(tq, tk, tv, score_mod=_t5, mod_args=(tt.detach(),), implementation="numba_cpu")
    assert rel_error(out.detach().numpy(), sdpa(q, k, v, score_mod=_t5, mod_args=(table,))
                     ) <= 1e-12


def test_the_automatic_block_mask_has_the_tiles_the_page_gives():
    q = np.ones((1, 2, 512, 8))
    explained = str(polyattn.explain(q, q, q, mask_mod=lambda b, h, i, j: i >= j))
    assert "BlockMask(tiles (1, 2, 4, 4) of (128, 128), 12 empty, 8 partial, 12 full" in (
        explained)
    text = RULES_PAGE.read_text(encoding="utf-8") if RULES_PAGE.is_file() else None
    if text is not None:
        assert "(1, 2, 4, 4) of (128, 128), 12 empty, 8 partial, 12 full" in text


def _runblocks(text: str) -> list[str]:
    """The code of each ``.. runblock::`` of a page, in order."""
    blocks, lines, n = [], text.splitlines(), 0
    while n < len(lines):
        if lines[n].strip() != ".. runblock::":
            n += 1
            continue
        n += 1
        body = []
        while n < len(lines) and (not lines[n].strip() or lines[n].startswith("   ")):
            body.append(lines[n])
            n += 1
        blocks.append(textwrap.dedent("\n".join(body)).strip("\n"))
    return blocks


def test_the_rules_page_prints_what_its_comments_say():
    if not RULES_PAGE.is_file():
        pytest.skip("docs/rules.rst is not beside tests/ (installed package)")
    blocks = _runblocks(RULES_PAGE.read_text(encoding="utf-8"))
    assert len(blocks) >= 8
    namespace = {"__name__": "__main__"}
    checked = 0
    for code in blocks:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "<docs/rules.rst>", "exec"), namespace)
        # the output, in comments of their own under the code that prints it (an
        # explanation after two spaces, in parentheses, is no part of it)
        said = [re.sub(r"\s{2,}\(.*\)$", "", line[2:]) for line in code.splitlines()
                if line.startswith("# ")]
        if "print(" in code:
            assert said, f"a block prints but does not say what:\n{code}"
        if said:
            assert printed.getvalue().splitlines() == said, code
            checked += 1
    assert checked >= 7


# --------------------------------------------------------------------------- #
# MultiHeadAttention
# --------------------------------------------------------------------------- #

def test_multi_head_attention_module_takes_the_rules():
    mha = polyattn.MultiHeadAttention(8, 2, seed=0, dtype=np.float64)
    x = np.random.default_rng(9).standard_normal((2, 6, 8))

    def causal(b, h, q_idx, kv_idx, *mod_args):
        return q_idx >= kv_idx

    def alibi(s, b, h, q_idx, kv_idx, slopes):
        return s - slopes[h] * ops.abs(q_idx - kv_idx)

    slopes = np.array([0.5, 0.25])
    expected = mha(x, is_causal=True, alibi_slopes=slopes)
    assert rel_error(mha(x, score_mod=alibi, mask_mod=causal, mod_args=(slopes,)),
                     expected) <= 1e-12
    blocks = polyattn.block_mask(causal, None, None, 6, 6, block=(2, 2))
    assert rel_error(mha(x, mask_mod=causal, block_mask=blocks), mha(x, is_causal=True)
                     ) <= 1e-12
