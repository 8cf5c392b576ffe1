"""The character-level training example: gradients against torch autograd, training, CLI.

The torch model below is written independently of the example, with torch's
own operations (``F.gelu``, ``F.silu``, ``F.cross_entropy``, an explicit
softmax attention, RoPE as transformers' ``rotate_half``); autograd gives its
gradients. The example's hand-written backward pass must agree to 1e-9
relative error in float64, parameter by parameter.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import train_char_transformer as tct

try:
    import torch
except ImportError:  # pragma: no cover - torch comes with examples/requirements.txt
    torch = None

GRAD_RTOL = 1e-9
needs_torch = pytest.mark.skipif(torch is None, reason="torch is the reference (not installed)")


@pytest.fixture(autouse=True)
def one_thread():
    """One BLAS thread and one torch thread: the matrices are small (512 × 128), and
    threads waiting on each other slow every product down many times on a busy machine."""
    threads = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with polyattn[test]
        yield
    else:
        with threadpool_limits(limits=1, user_api="blas"):
            yield
    finally:
        if torch is not None:
            torch.set_num_threads(threads)


TEXT = tct.load_text()
VOCAB = tct.Vocabulary.of(TEXT)
IDS = VOCAB.encode(TEXT)


def torch_loss(params: dict, tokens, cfg: tct.Config):
    """The same model in torch operations (float64)."""
    F = torch.nn.functional
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    h, e = cfg.num_heads, cfg.head_dim

    def norm(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + tct.EPS) * g

    inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, e, 2, dtype=torch.float64) / e)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq   # (T, E/2)
    cos = torch.cat([angles.cos(), angles.cos()], -1)                     # (T, E)
    sin = torch.cat([angles.sin(), angles.sin()], -1)

    def rope(x):
        rotate_half = torch.cat([-x[..., e // 2:], x[..., :e // 2]], -1)
        return x * cos + rotate_half * sin

    def heads(x):
        return x.view(b, t, h, e).transpose(1, 2)                        # (B, H, T, E)

    causal = torch.ones(t, t, dtype=torch.bool).tril()
    act = {"gelu": lambda u: F.gelu(u, approximate="tanh"), "silu": F.silu}[cfg.activation]
    x = params["embed"][inputs]                                           # (B, T, D)
    for layer in range(cfg.num_layers):
        p = {n: params[f"{layer}.{n}"] for n in
             ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_in", "w_out")}
        y = norm(x, p["attn_norm"])
        q, k, v = rope(heads(y @ p["wq"])), rope(heads(y @ p["wk"])), heads(y @ p["wv"])
        s = (q @ k.transpose(-1, -2)) / math.sqrt(e)
        w = s.masked_fill(~causal, -math.inf).softmax(-1)
        a = (w @ v).transpose(1, 2).reshape(b, t, cfg.d_model)
        x = x + a @ p["wo"]
        x = x + act(norm(x, p["mlp_norm"]) @ p["w_in"]) @ p["w_out"]
    x = norm(x, params["final_norm"])
    out = params["embed"].T if cfg.tied else params["unembed"]
    z = x @ out
    return F.cross_entropy(z.reshape(-1, cfg.vocab_size), targets.reshape(-1))


def small_model(activation="gelu", tied=True, seed=0, dtype="float64"):
    cfg = tct.Config(vocab_size=len(VOCAB.chars), activation=activation, tied=tied)
    return tct.Model.init(cfg, seed=seed, dtype=dtype)


def torch_gradients(model: tct.Model, tokens: np.ndarray):
    params = {n: torch.tensor(a, requires_grad=True) for n, a in model.params.items()}
    loss = torch_loss(params, torch.tensor(tokens), model.config)
    loss.backward()
    return loss.item(), {n: p.grad.numpy() for n, p in params.items()}


def relative_error(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@needs_torch
@pytest.mark.parametrize(("activation", "tied"), [("gelu", True), ("silu", False)])
def test_gradients_match_torch_autograd(activation, tied):
    model = small_model(activation, tied, seed=3)
    tokens = tct.batch_windows(IDS, 4, 48, np.random.default_rng(7))    # (B, T+1)
    loss, cache = tct.forward(model, tokens)
    grads = tct.backward(cache)
    ref_loss, ref = torch_gradients(model, tokens)
    assert abs(float(loss) - ref_loss) <= 1e-12 * ref_loss
    assert set(grads) == set(ref) == set(model.params)
    errors = {n: relative_error(grads[n], ref[n]) for n in ref}
    assert max(errors.values()) <= GRAD_RTOL, errors
    for n, g in grads.items():
        assert g.shape == model.params[n].shape and g.dtype == np.float64, n


@needs_torch
def test_gradients_after_training_steps_match_torch_autograd():
    """Away from the initial point (norm gains no longer one), the gradients still agree."""
    model = small_model(seed=1)
    tct.train(model, IDS, steps=5, batch=4, seq_len=32, lr=1e-2, progress=False)
    assert any(not np.allclose(model.params[f"{i}.attn_norm"], 1.0) for i in range(2))
    tokens = tct.batch_windows(IDS, 2, 64, np.random.default_rng(11))
    grads = tct.backward(tct.forward(model, tokens)[1])
    _, ref = torch_gradients(model, tokens)
    errors = {n: relative_error(grads[n], ref[n]) for n in ref}
    assert max(errors.values()) <= GRAD_RTOL, errors


def test_gradients_with_attention_dropout_match_finite_differences():
    """With dropout the loss is still a smooth function of the parameters for a fixed
    seed; the pullback must drop the same weights as the forward pass."""
    model = small_model(seed=4)
    tokens = tct.batch_windows(IDS, 2, 24, np.random.default_rng(2))
    kwargs = {"dropout_p": 0.3, "dropout_seed": 12345}
    loss, cache = tct.forward(model, tokens, **kwargs)
    assert float(loss) != float(tct.forward(model, tokens)[0])          # weights were dropped
    assert float(loss) == float(tct.forward(model, tokens, **kwargs)[0])  # the same ones
    grads = tct.backward(cache)
    rng = np.random.default_rng(0)
    h = 1e-5
    for name in ("0.wq", "0.wk", "1.wv", "1.attn_norm"):
        p = model.params[name]
        for flat in rng.choice(p.size, size=3, replace=False):
            idx = np.unravel_index(flat, p.shape)
            values = []
            for step in (h, -h):
                shifted = p.copy()
                shifted[idx] += step
                other = tct.Model(model.config, {**model.params, name: shifted})
                values.append(float(tct.forward(other, tokens, **kwargs)[0]))
            numeric = (values[0] - values[1]) / (2 * h)
            assert abs(grads[name][idx] - numeric) <= 1e-9 + 1e-6 * abs(numeric), (name, idx)


def test_training_lowers_the_loss():
    train_ids, held_ids = tct.split(IDS)
    model = small_model(seed=0)
    before = {n: a.copy() for n, a in model.params.items()}
    history = tct.train(model, train_ids, steps=50, batch=8, seq_len=64, seed=0,
                        held_out_ids=held_ids, eval_every=25, progress=False)
    losses = history.losses
    assert len(losses) == 50 and all(math.isfinite(v) for v in losses)
    initial, final = np.mean(losses[:3]), np.mean(losses[-10:])
    assert final < 0.8 * initial, (initial, final)
    assert history.held_out_steps == [0, 25, 50]
    assert all(model.params[n].dtype == np.float64 for n in model.params)
    assert all(not np.array_equal(model.params[n], before[n]) for n in before)


def test_adamw_step_moves_against_the_gradient_and_decays_matrices():
    params = {"w": np.full((2, 2), 2.0), "g": np.ones(3)}
    grads = {"w": np.array([[1.0, -1.0], [0.0, 2.0]]), "g": np.array([-3.0, 0.0, 3.0])}
    state = tct.AdamW(lr=0.1, weight_decay=0.5)
    new = tct.adamw_step(params, grads, state)
    # first step: m̂/√v̂ = sign(g), so the update is lr·sign(g) plus lr·wd·w on matrices
    np.testing.assert_allclose(new["w"], 2.0 * (1 - 0.05) - 0.1 * np.sign(grads["w"]),
                               rtol=1e-6)
    np.testing.assert_allclose(new["g"], 1.0 - 0.1 * np.sign(grads["g"]), rtol=1e-6)
    assert params["w"][0, 0] == 2.0 and state.step == 1


def test_rope_backward_is_the_inverse_rotation():
    import polyattn

    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 2, 2, 5, 8))                  # (B, H, T, E) each
    pos = np.arange(5)
    # <R x, dy> = <x, Rᵀ dy>: the transpose of the rotation is the rotation by −θ
    lhs = np.sum(polyattn.apply_rotary_embedding(x, pos) * dy)
    rhs = np.sum(x * polyattn.apply_rotary_embedding(dy, -pos))
    assert abs(lhs - rhs) <= 1e-12 * abs(lhs)


@needs_torch
def test_torch_library_gives_the_numpy_losses():
    """The same code on torch tensors (float64): the same losses step by step."""
    train_ids, _ = tct.split(IDS)
    runs = []
    for asarray in (np.asarray, tct.array_factory("torch")):
        model = small_model(seed=2)
        model = tct.Model(model.config, {n: asarray(a) for n, a in model.params.items()})
        runs.append(tct.train(model, train_ids, steps=3, batch=2, seq_len=32, seed=5,
                              asarray=asarray, progress=False).losses)
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-10)


def test_command_line_trains_and_writes_the_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "loss.png"
    history = tct.main(["--steps", "4", "--seq-len", "32", "--batch", "2", "--eval-every", "2",
                        "--dtype", "float64", "--out", str(out), "--prompt", "注意",
                        "--sample-length", "10", "--temperature", "0.8",
                        "--attn-dropout", "0.1"])
    captured = capsys.readouterr()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(history.losses) == 4 and history.held_out_steps == [0, 2, 4]
    assert "step 4/4" in captured.err and "tokens/s" in captured.err
    sample = captured.out.split("sample:\n", 1)[1][:-1]  # without print's newline
    assert sample.startswith("注意") and len(sample) == 12
    assert str(out) in captured.out


def test_command_line_names_a_prompt_character_missing_from_the_text(capsys):
    with pytest.raises(SystemExit):
        tct.main(["--steps", "1", "--prompt", "ž"])
    assert "--prompt" in capsys.readouterr().err
