"""The dtypes and kinds of what the public functions take (DESIGN §4).

Inputs are float16, float32, float64, or bfloat16 where the library has it;
anything else, ``np.longdouble`` (float128) and torch's float8 types among them
(no path computes them at their own precision: they used to be computed in
float32 and labelled float128), is a ``TypeError`` that names the argument,
the dtype received, the library, the shape, and lists the accepted dtypes,
bfloat16 included. So are the ``dtype=`` arguments.

Then the arguments that are not the inputs: a pullback's ``grad_out`` and
``grad_lse`` (an array like the result they are the gradient of: its library,
device, shape, and a dtype that the result's dtype holds exactly), and
``MultiHeadAttention.from_torch``'s module.
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import CPU_IMPLEMENTATIONS, NUMPY_CASES, use_implementation
from helpers import Backend, available_backends, to_numpy, to_xp

import polyattn

LONGDOUBLE_IS_WIDER = np.dtype(np.longdouble) != np.dtype(np.float64)
needs_longdouble = pytest.mark.skipif(not LONGDOUBLE_IS_WIDER,
                                      reason="np.longdouble is float64 on this platform")
HAS_TORCH = Backend.TORCH in available_backends()
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
ACCEPTED = ("float16", "bfloat16", "float32", "float64")


def assert_dtype_message(exc: pytest.ExceptionInfo, name: str, got: str, *pieces: str) -> None:
    """The message names the argument, what it got, and every accepted dtype."""
    message = str(exc.value)
    for piece in (f"`{name}`", got, *ACCEPTED, *pieces):
        assert piece in message, f"{piece!r} not in {message!r}"


def _qkv(dtype=np.float64, shape=(1, 2, 4, 8)):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


# --------------------------------------------------------------------------- #
# np.longdouble, everywhere
# --------------------------------------------------------------------------- #

@needs_longdouble
@pytest.mark.parametrize("position", ["query", "key", "value"])
@pytest.mark.parametrize("case", NUMPY_CASES)
def test_longdouble_attention_is_a_type_error(case, position, monkeypatch):
    implementation = use_implementation(case, Backend.NUMPY, monkeypatch)
    arrays = dict(zip(("query", "key", "value"), _qkv(), strict=True))
    arrays[position] = arrays[position].astype(np.longdouble)
    for call in (polyattn.scaled_dot_product_attention, polyattn.attention_vjp):
        with pytest.raises(TypeError) as exc:
            call(*arrays.values(), implementation=implementation)
        assert_dtype_message(exc, position, "float128", "numpy", "(1, 2, 4, 8)")


@needs_longdouble
@pytest.mark.parametrize("function", ["attention_weights", "explain", "layout_bthe",
                                      "alibi_slopes_array"])
def test_longdouble_in_other_attention_calls(function):
    q, k, v = _qkv()
    ld = q.astype(np.longdouble)
    calls = {
        "attention_weights": (lambda: polyattn.attention_weights(ld, k), "query"),
        "explain": (lambda: polyattn.explain(q, ld, v), "key"),
        "layout_bthe": (lambda: polyattn.scaled_dot_product_attention(
            q, k, v.astype(np.longdouble), layout="BTHE"), "value"),
        "alibi_slopes_array": (lambda: polyattn.scaled_dot_product_attention(
            q, k, v, alibi_slopes=np.ones(2, dtype=np.longdouble)), "alibi_slopes"),
    }
    call, name = calls[function]
    with pytest.raises(TypeError) as exc:
        call()
    assert_dtype_message(exc, name, "float128")


@needs_longdouble
def test_longdouble_softmax_logsumexp_rotary_merge():
    x = np.linspace(-1.0, 1.0, 8, dtype=np.longdouble).reshape(2, 4)
    for call, name in ((polyattn.softmax, "x"), (polyattn.logsumexp, "x"),
                       (lambda a: polyattn.apply_rotary_embedding(a, np.arange(2)), "x"),
                       (lambda a: polyattn.merge_attention([a], [a[..., 0]]), "outs[0]"),
                       (lambda a: polyattn.merge_attention(
                           [a.astype(np.float64)], [a[..., 0]]), "lses[0]")):
        with pytest.raises(TypeError) as exc:
            call(x)
        assert_dtype_message(exc, name, "float128", "(2, 4)" if name != "lses[0]" else "(2,)")


@needs_longdouble
def test_longdouble_kv_cache():
    with pytest.raises(TypeError) as exc:
        polyattn.KVCache((1,), 2, 8, 8, dtype=np.longdouble)
    assert_dtype_message(exc, "dtype", "longdouble")
    cache = polyattn.KVCache((1,), 2, 8, 8, dtype=np.float64)
    _, k, v = _qkv()
    with pytest.raises(TypeError) as exc:
        cache.update(k.astype(np.longdouble), v)
    assert_dtype_message(exc, "key", "float128")
    assert int(cache.lengths[0]) == 0                 # nothing written


@needs_longdouble
@pytest.mark.parametrize("function", ["sinusoidal_positional_encoding", "alibi_slopes",
                                      "MultiHeadAttention"])
def test_longdouble_dtype_arguments(function):
    calls = {"sinusoidal_positional_encoding":
             lambda dt: polyattn.sinusoidal_positional_encoding(4, 8, dtype=dt),
             "alibi_slopes": lambda dt: polyattn.alibi_slopes(4, dtype=dt),
             "MultiHeadAttention": lambda dt: polyattn.MultiHeadAttention(8, 2, dtype=dt)}
    for dtype in (np.longdouble, np.dtype(np.longdouble)):
        with pytest.raises(TypeError) as exc:
            calls[function](dtype)
        assert_dtype_message(exc, "dtype", "float128" if isinstance(dtype, np.dtype)
                             else "longdouble", "numpy")


@needs_longdouble
def test_longdouble_multi_head_attention():
    mha = polyattn.MultiHeadAttention(8, 2, dtype=np.float64, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 5, 8))
    with pytest.raises(TypeError) as exc:
        mha(x.astype(np.longdouble))
    assert_dtype_message(exc, "query", "float128")
    params = {**mha.params, "w_o": mha.params["w_o"].astype(np.longdouble)}
    with pytest.raises(TypeError) as exc:
        polyattn.multi_head_attention(x, x, x, params, num_heads=2)
    assert_dtype_message(exc, "params['w_o']", "float128")


@needs_longdouble
def test_longdouble_masks():
    """A float mask is added to the scores: float128 would be cast down, so it is refused
    too (a float64 mask, added to float32 scores, is the float mask the result dtype takes)."""
    q, k, v = _qkv()
    mask = np.zeros((4, 4), dtype=np.longdouble)
    with pytest.raises(TypeError, match=r"`attn_mask` must be boolean .*got dtype float128.*"
                                        r"float16, float32 or float64"):
        polyattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    mha = polyattn.MultiHeadAttention(8, 2, dtype=np.float64, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 4, 8))
    with pytest.raises(TypeError, match=r"`key_padding_mask` must be boolean .*float64.*"
                                        r"got dtype float128"):
        mha(x, key_padding_mask=np.zeros((2, 4), dtype=np.longdouble))
    assert polyattn.scaled_dot_product_attention(
        q, k, v, attn_mask=np.zeros((4, 4), dtype=np.float16)).dtype == np.float64


@pytest.mark.parametrize(("seed", "error"), [("a", TypeError), (1.5, TypeError),
                                             (True, TypeError), (-1, ValueError)])
def test_multihead_seed_is_checked(seed, error):
    with pytest.raises(error, match="`seed` must be"):
        polyattn.MultiHeadAttention(8, 2, seed=seed)


@needs_longdouble
def test_longdouble_grad_out():
    (out, lse), pullback = polyattn.attention_vjp(*_qkv(), return_lse=True)
    with pytest.raises(TypeError) as exc:
        pullback(out.astype(np.longdouble))
    assert_dtype_message(exc, "grad_out", "float128")
    with pytest.raises(TypeError) as exc:
        pullback(out, lse.astype(np.longdouble))
    assert_dtype_message(exc, "grad_lse", "float128")


def test_the_message_lists_what_the_library_has(xp, device, backend):
    """An integer query on each library: the dtypes listed are the library's own, and
    bfloat16 is named either as accepted or as missing from the library."""
    q = to_xp(np.zeros((2, 3), dtype=np.int32), xp, device=device)
    with pytest.raises(TypeError) as exc:
        polyattn.softmax(q)
    message = str(exc.value)
    assert "`x`" in message and "int32" in message and "bfloat16" in message
    for name in ACCEPTED:
        if getattr(xp, name, None) is not None:
            assert name in message
    if getattr(xp, "bfloat16", None) is None:
        assert "has no " in message and "bfloat16" in message.split("has no ")[-1]


# --------------------------------------------------------------------------- #
# torch: bfloat16 is accepted, float8 is not
# --------------------------------------------------------------------------- #

@needs_torch
@pytest.mark.parametrize("implementation", CPU_IMPLEMENTATIONS)
def test_torch_bfloat16_is_computed_and_returned(implementation, monkeypatch):
    import torch

    use_implementation(implementation, Backend.TORCH, monkeypatch)
    q, k, v = (torch.tensor(a, dtype=torch.bfloat16) for a in _qkv())
    out = polyattn.scaled_dot_product_attention(q, k, v, implementation=implementation)
    assert out.dtype == torch.bfloat16
    want = polyattn.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert float((out.double() - want).abs().max()) < 0.05


@needs_torch
def test_torch_float8_is_a_type_error():
    import torch

    kinds = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
    if not kinds:
        pytest.skip("this torch has no float8 dtypes")
    q, k, v = (torch.tensor(a) for a in _qkv(np.float32))
    for kind in kinds:
        with pytest.raises(TypeError) as exc:
            polyattn.scaled_dot_product_attention(q, k.to(kind), v)
        assert_dtype_message(exc, "key", str(kind).removeprefix("torch."), "torch")
        with pytest.raises(TypeError) as exc:
            polyattn.KVCache((1,), 2, 4, 8, xp=torch, dtype=kind)
        assert_dtype_message(exc, "dtype", "float8")


# --------------------------------------------------------------------------- #
# grad_out and grad_lse of a pullback
# --------------------------------------------------------------------------- #

@pytest.fixture
def pullback_of(xp, device):
    """(out, lse, pullback) of a float32 call in ``xp``."""
    q, k, v = (to_xp(a, xp, dtype="float32", device=device) for a in _qkv())
    (out, lse), pullback = polyattn.attention_vjp(q, k, v, return_lse=True, is_causal=True)
    return out, lse, pullback


@pytest.mark.parametrize("given", [None, 1.0, [[0.0]]], ids=["None", "float", "list"])
def test_grad_out_that_is_not_an_array(pullback_of, given):
    _, _, pullback = pullback_of
    with pytest.raises(TypeError) as exc:
        pullback(given)
    message = str(exc.value)
    assert "`grad_out`" in message and type(given).__name__ in message
    assert "(1, 2, 4, 8)" in message or "array" in message


def test_grad_lse_that_is_not_an_array(pullback_of):
    out, _, pullback = pullback_of
    with pytest.raises(TypeError, match=r"`grad_lse`.*got list"):
        pullback(out, [0.0])


def test_grad_out_of_another_shape(pullback_of, xp, device):
    _, _, pullback = pullback_of
    with pytest.raises(ValueError) as exc:
        pullback(to_xp(np.zeros((1, 2, 4, 7)), xp, dtype="float32", device=device))
    message = str(exc.value)
    assert "`grad_out`" in message and "(1, 2, 4, 8)" in message and "(1, 2, 4, 7)" in message


def test_grad_out_wider_than_out_is_a_type_error(pullback_of, xp, device):
    """A float64 cotangent for a float32 result would be computed in float32: refused,
    with the dtype to pass; narrower ones (float16) are exact in float32 and taken."""
    out, _, pullback = pullback_of
    wide = to_xp(np.ones((1, 2, 4, 8)), xp, dtype="float64", device=device)
    with pytest.raises(TypeError) as exc:
        pullback(wide)
    message = str(exc.value)
    assert "`grad_out`" in message and "float64" in message and "float32" in message
    with pytest.raises(TypeError, match=r"`grad_lse`.*float64"):
        pullback(out, to_xp(np.ones((1, 2, 4)), xp, dtype="float64", device=device))
    if getattr(xp, "float16", None) is None:
        return
    narrow = to_xp(np.ones((1, 2, 4, 8)), xp, dtype="float16", device=device)
    same = to_xp(np.ones((1, 2, 4, 8)), xp, dtype="float32", device=device)
    for got, want in zip(pullback(narrow), pullback(same), strict=True):
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def test_grad_out_of_another_library():
    (out, _), pullback = polyattn.attention_vjp(*_qkv(), return_lse=True)
    if HAS_TORCH:
        import torch

        other, library = torch.zeros(tuple(out.shape), dtype=torch.float64), "torch"
    else:
        import array_api_strict

        other, library = array_api_strict.zeros(tuple(out.shape)), "array_api_strict"
    with pytest.raises(TypeError) as exc:
        pullback(other)
    message = str(exc.value)
    assert "`grad_out`" in message and "`out`" in message
    assert "numpy" in message and library in message


def test_grad_out_on_another_device():
    pytest.importorskip("array_api_strict")
    import array_api_strict as xp

    q, k, v = (xp.asarray(a, device=xp.Device("device1")) for a in _qkv())
    out, pullback = polyattn.attention_vjp(q, k, v)
    with pytest.raises(ValueError) as exc:
        pullback(xp.ones(out.shape, dtype=out.dtype))         # the default device
    message = str(exc.value)
    assert "`grad_out`" in message and "device" in message


# --------------------------------------------------------------------------- #
# MultiHeadAttention.from_torch
# --------------------------------------------------------------------------- #

@needs_torch
@pytest.mark.parametrize("given", ["linear", "none", "dict", "module_class"])
def test_from_torch_needs_a_multihead_attention_module(given):
    import torch

    module = {"linear": torch.nn.Linear(3, 3), "none": None,
              "dict": {"embed_dim": 8}, "module_class": torch.nn.MultiheadAttention}[given]
    with pytest.raises(TypeError) as exc:
        polyattn.MultiHeadAttention.from_torch(module)
    message = str(exc.value)
    assert "`module`" in message and "torch.nn.MultiheadAttention" in message
    received = {"linear": "torch.nn.modules.linear.Linear", "none": "NoneType",
                "dict": "dict", "module_class": "type"}[given]
    assert f"got {received}" in message


@needs_torch
def test_from_torch_takes_subclasses_and_bfloat16_modules():
    import torch

    class Tagged(torch.nn.MultiheadAttention):
        pass

    torch.manual_seed(0)
    module = Tagged(8, 2, batch_first=True)
    mha = polyattn.MultiHeadAttention.from_torch(module)
    x = torch.randn(2, 5, 8)
    want = module(x, x, x, need_weights=False)[0].detach().numpy()
    np.testing.assert_allclose(mha(x.numpy()), want, rtol=1e-5, atol=1e-6)
    half = polyattn.MultiHeadAttention.from_torch(module.to(torch.bfloat16))
    assert half.params["w_q"].dtype == np.float32
    np.testing.assert_array_equal(half.params["w_q"],
                                  module.in_proj_weight[:8].float().detach().numpy().T)
    with pytest.raises(TypeError) as exc:
        polyattn.MultiHeadAttention.from_torch(module, dtype=np.int32)
    assert_dtype_message(exc, "dtype", "int32")
