"""Train a small character-level Transformer with hand-written gradients.

A decoder-only Transformer (2 layers, 128 features, 4 heads of 32, rotary
positions, pre-RMSNorm, a GELU or SiLU feed-forward of 512, tied or separate
input/output embeddings) learns to predict the next character of a short
Chinese article about attention. There is no autodiff anywhere: each layer's
backward pass is written out below in Array API calls, and the attention's
comes from :func:`polyattn.attention_vjp` (causal, with the FlashAttention-2
backward). AdamW is written out too. The same code trains on NumPy
(the default), torch or CuPy arrays::

    python examples/train_char_transformer.py --out loss.png
    python examples/train_char_transformer.py --library torch --dtype float64
    python examples/train_char_transformer.py --attn-dropout 0.1 --activation silu --untied
    python examples/train_char_transformer.py --library cupy --steps 3000 --batch 32

The training text, ``examples/data/seed_article.txt``, is "Transformer 01", a
Chinese-language introduction to self-attention (Q, K, V, the scaled
dot-product formula, multi-head attention, sinusoidal position encodings);
it is about 4,900 characters long, so the model soon learns it by heart.
The last tenth is held out and its loss reported beside the training loss.

Shapes: B batch rows, T characters per row, D = 128 features, H heads of
E = D/H features, F = 4·D feed-forward features, V characters in the
vocabulary, N = B·T tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device

import polyattn

Array = Any
DATA = pathlib.Path(__file__).with_name("data") / "seed_article.txt"
LIBRARIES = ("numpy", "torch", "cupy")
EPS = 1e-6  # RMSNorm's epsilon


# ---------------------------------------------------------------------------
# Data: characters <-> token ids, batches of windows
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Vocabulary:
    """The characters of a text, each with a token id (sorted by code point)."""

    chars: tuple[str, ...]

    @classmethod
    def of(cls, text: str) -> Vocabulary:
        return cls(tuple(sorted(set(text))))

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        return np.array([index[c] for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_text(path: pathlib.Path = DATA) -> str:
    return path.read_text(encoding="utf-8")


def split(ids: np.ndarray, held_out: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """The ids cut into a training part and the last ``held_out`` fraction."""
    cut = round(len(ids) * (1.0 - held_out))
    return ids[:cut], ids[cut:]


def batch_windows(ids: np.ndarray, batch: int, seq_len: int,
                  rng: np.random.Generator) -> np.ndarray:
    """``batch`` random windows of ``seq_len + 1`` consecutive ids: (B, T+1), NumPy int64."""
    starts = rng.integers(0, len(ids) - seq_len, size=batch)
    return np.stack([ids[s:s + seq_len + 1] for s in starts])


def held_out_windows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Consecutive non-overlapping windows covering the held-out ids: (W, T+1)."""
    count = (len(ids) - 1) // seq_len
    return np.stack([ids[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)])


# ---------------------------------------------------------------------------
# The only library-specific code: putting NumPy data on the chosen library
# ---------------------------------------------------------------------------

def array_factory(library: str) -> Callable[[np.ndarray], Array]:
    """A function that copies a NumPy array to ``library`` (its GPU where it has one)."""
    if library == "numpy":
        return np.asarray
    if library == "torch":
        import torch

        target = "cuda" if torch.cuda.is_available() else "cpu"
        return lambda a: torch.asarray(a, device=target)
    if library == "cupy":
        import cupy

        return cupy.asarray
    raise ValueError(f"`library` must be one of {LIBRARIES}; got {library!r}")


# ---------------------------------------------------------------------------
# The model: a dictionary of parameter arrays
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """The sizes and choices of the network (the defaults are the documented model)."""

    vocab_size: int
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 512
    activation: str = "gelu"  # or "silu"
    tied: bool = True         # logits from the transposed token embeddings
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass
class Model:
    """The configuration and the parameters, by name.

    ``embed`` (V, D); per layer ``l``: ``l.attn_norm`` (D,), ``l.wq``, ``l.wk``,
    ``l.wv``, ``l.wo`` (D, D), ``l.mlp_norm`` (D,), ``l.w_in`` (D, F),
    ``l.w_out`` (F, D); ``final_norm`` (D,); ``unembed`` (D, V) when not tied.
    Linear layers compute ``x @ W`` and have no bias.
    """

    config: Config
    params: dict[str, Array] = field(default_factory=dict)

    @classmethod
    def init(cls, config: Config, *, seed: int = 0,
             asarray: Callable[[np.ndarray], Array] = np.asarray,
             dtype: str = "float32") -> Model:
        """Random parameters drawn with NumPy, then copied by ``asarray``."""
        if config.d_model % config.num_heads or config.head_dim % 2:
            raise ValueError(f"`d_model` {config.d_model} must split into {config.num_heads} "
                             "heads of an even number of features")
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"`activation` must be one of {tuple(ACTIVATIONS)}; "
                             f"got {config.activation!r}")
        rng = np.random.default_rng(seed)
        d, f, v = config.d_model, config.d_ff, config.vocab_size
        residual = 1.0 / math.sqrt(2 * config.num_layers)  # output projections of each block

        def normal(shape, std):
            return rng.standard_normal(shape) * std

        p = {"embed": normal((v, d), 1.0 / math.sqrt(d))}
        for layer in range(config.num_layers):
            p[f"{layer}.attn_norm"] = np.ones(d)
            for name in ("wq", "wk", "wv"):
                p[f"{layer}.{name}"] = normal((d, d), 1.0 / math.sqrt(d))
            p[f"{layer}.wo"] = normal((d, d), residual / math.sqrt(d))
            p[f"{layer}.mlp_norm"] = np.ones(d)
            p[f"{layer}.w_in"] = normal((d, f), 1.0 / math.sqrt(d))
            p[f"{layer}.w_out"] = normal((f, d), residual / math.sqrt(f))
        p["final_norm"] = np.ones(d)
        if not config.tied:
            p["unembed"] = normal((d, v), 1.0 / math.sqrt(d))
        return cls(config, {name: asarray(a.astype(dtype)) for name, a in p.items()})


# ---------------------------------------------------------------------------
# Layers: each forward returns what its backward needs
# ---------------------------------------------------------------------------

def rms_norm(x: Array, gain: Array, xp) -> tuple[Array, tuple]:
    """``x / rms(x) · gain`` over the last axis."""
    r = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + EPS)  # (…, 1)
    return x * r * gain, (x, r, gain)


def rms_norm_backward(dy: Array, saved: tuple, xp) -> tuple[Array, Array]:
    """(dx, dgain). With x̂ = x·r and g = dy·gain: dx = r·(g − x̂·mean(g·x̂))."""
    x, r, gain = saved
    xhat = x * r
    g = dy * gain
    dx = r * (g - xhat * xp.mean(g * xhat, axis=-1, keepdims=True))
    dgain = xp.sum(dy * xhat, axis=0)  # (D,)
    return dx, dgain


def linear_backward(dy: Array, x: Array, w: Array, xp) -> tuple[Array, Array]:
    """(dx, dw) of ``y = x @ w`` for x (N, Din), w (Din, Dout)."""
    return xp.matmul(dy, xp.matrix_transpose(w)), xp.matmul(xp.matrix_transpose(x), dy)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu(u: Array, xp) -> Array:
    """GELU, tanh form: ``u/2 · (1 + tanh(√(2/π)·(u + 0.044715·u³)))``."""
    return 0.5 * u * (1.0 + xp.tanh(_GELU_C * (u + 0.044715 * u * u * u)))


def gelu_grad(u: Array, xp) -> Array:
    t = xp.tanh(_GELU_C * (u + 0.044715 * u * u * u))
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * u * u)


def silu(u: Array, xp) -> Array:
    """SiLU (swish): ``u · σ(u)``."""
    return u / (1.0 + xp.exp(-u))


def silu_grad(u: Array, xp) -> Array:
    s = 1.0 / (1.0 + xp.exp(-u))
    return s * (1.0 + u * (1.0 - s))


ACTIVATIONS = {"gelu": (gelu, gelu_grad), "silu": (silu, silu_grad)}


def one_hot(ids: Array, n: int, dtype, xp) -> Array:
    """(…,) integer ids -> (…, n) rows of zeros with a one at each id."""
    classes = xp.arange(n, device=device(ids))
    return xp.astype(xp.expand_dims(ids, axis=-1) == classes, dtype)


def split_heads(x: Array, b: int, h: int, xp) -> Array:
    n, d = x.shape
    x = xp.reshape(x, (b, n // b, h, d // h))   # (B, T, H, E)
    return xp.permute_dims(x, (0, 2, 1, 3))     # (B, H, T, E)


def merge_heads(x: Array, xp) -> Array:
    b, h, t, e = x.shape
    x = xp.permute_dims(x, (0, 2, 1, 3))        # (B, T, H, E)
    return xp.reshape(x, (b * t, h * e))        # (N, D)


def attention_layer(x: Array, p: dict, layer: int, cfg: Config, positions: Array, xp, *,
                    dropout_p: float = 0.0, dropout_seed: int = 0) -> tuple[Array, tuple]:
    """Causal self-attention with rotary positions over rows of ``positions.shape[0]``
    tokens; x (N, D). Returns (output (N, D), saved).

    With ``dropout_p > 0`` the attention weights are dropped by polyattn's
    counter-based generator: the pullback applies the same mask (it is
    recomputed from ``dropout_seed``, never stored).
    """
    w = {n: p[f"{layer}.{n}"] for n in ("wq", "wk", "wv", "wo")}
    b, h = x.shape[0] // positions.shape[0], cfg.num_heads
    q = split_heads(xp.matmul(x, w["wq"]), b, h, xp)   # (B, H, T, E)
    k = split_heads(xp.matmul(x, w["wk"]), b, h, xp)
    v = split_heads(xp.matmul(x, w["wv"]), b, h, xp)
    q = polyattn.apply_rotary_embedding(q, positions, base=cfg.rope_base)
    k = polyattn.apply_rotary_embedding(k, positions, base=cfg.rope_base)
    a, pullback = polyattn.attention_vjp(
        q, k, v, is_causal=True, dropout_p=dropout_p,
        dropout_seed=dropout_seed if dropout_p else None)           # (B, H, T, E)
    a = merge_heads(a, xp)                                          # (N, D)
    return xp.matmul(a, w["wo"]), (x, a, pullback, w)


def attention_layer_backward(dy: Array, saved: tuple, cfg: Config, positions: Array,
                             xp) -> tuple[Array, dict[str, Array]]:
    """(dx, grads of wq, wk, wv, wo). RoPE is a rotation: its transpose rotates by −θ."""
    x, a, pullback, w = saved
    da, dwo = linear_backward(dy, a, w["wo"], xp)
    b = x.shape[0] // positions.shape[0]
    dq, dk, dv = pullback(split_heads(da, b, cfg.num_heads, xp))  # (B, H, T, E) each
    dq = polyattn.apply_rotary_embedding(dq, -positions, base=cfg.rope_base)
    dk = polyattn.apply_rotary_embedding(dk, -positions, base=cfg.rope_base)
    grads = {"wo": dwo}
    dxs = []
    for name, d in (("wq", dq), ("wk", dk), ("wv", dv)):
        dx, grads[name] = linear_backward(merge_heads(d, xp), x, w[name], xp)
        dxs.append(dx)
    return dxs[0] + dxs[1] + dxs[2], grads


def mlp(x: Array, p: dict, layer: int, cfg: Config, xp) -> tuple[Array, tuple]:
    act, _ = ACTIVATIONS[cfg.activation]
    w_in, w_out = p[f"{layer}.w_in"], p[f"{layer}.w_out"]
    u = xp.matmul(x, w_in)                       # (N, F)
    g = act(u, xp)
    return xp.matmul(g, w_out), (x, u, g, w_in, w_out)


def mlp_backward(dy: Array, saved: tuple, cfg: Config, xp) -> tuple[Array, dict[str, Array]]:
    _, act_grad = ACTIVATIONS[cfg.activation]
    x, u, g, w_in, w_out = saved
    dg, dw_out = linear_backward(dy, g, w_out, xp)
    du = dg * act_grad(u, xp)
    dx, dw_in = linear_backward(du, x, w_in, xp)
    return dx, {"w_in": dw_in, "w_out": dw_out}


# ---------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------

@dataclass
class Cache:
    """What :func:`backward` needs from :func:`forward`."""

    model: Model
    inputs: Array                 # (B, T) token ids
    positions: Array              # (T,)
    layers: list = field(default_factory=list)
    final: tuple = ()
    hidden: Array | None = None   # (N, D), after the final norm
    probs: Array | None = None    # (N, V), softmax of the logits
    targets_1h: Array | None = None  # (N, V)


def _trunk(model: Model, inputs: Array, xp, dropout_p: float = 0.0,
           dropout_seed: int = 0) -> tuple[Array, Cache]:
    """Logits (N, V) of the next character after each input (B, T), and the cache.

    Activations are kept as (N, D) matrices, so that every linear layer is one
    matrix product; only attention sees the (B, H, T, E) layout.
    """
    cfg, p = model.config, model.params
    t = inputs.shape[1]
    positions = xp.arange(t, device=device(inputs))
    cache = Cache(model, inputs, positions)
    x = xp.take(p["embed"], xp.reshape(inputs, (-1,)), axis=0)   # (N, D)
    for layer in range(cfg.num_layers):
        h, norm1 = rms_norm(x, p[f"{layer}.attn_norm"], xp)
        y, attn = attention_layer(h, p, layer, cfg, positions, xp, dropout_p=dropout_p,
                                  dropout_seed=dropout_seed + layer)
        x = x + y
        h, norm2 = rms_norm(x, p[f"{layer}.mlp_norm"], xp)
        y, ff = mlp(h, p, layer, cfg, xp)
        x = x + y
        cache.layers.append((norm1, attn, norm2, ff))
    h, cache.final = rms_norm(x, p["final_norm"], xp)
    cache.hidden = h
    unembed = xp.matrix_transpose(p["embed"]) if cfg.tied else p["unembed"]  # (D, V)
    return xp.matmul(h, unembed), cache


def logits(model: Model, inputs: Array) -> Array:
    """The next-character logits (B, T, V) for token ids (B, T)."""
    xp = array_namespace(inputs, model.params["embed"])
    b, t = inputs.shape
    return xp.reshape(_trunk(model, inputs, xp)[0], (b, t, -1))   # (B, T, V)


def forward(model: Model, tokens: Array, *, dropout_p: float = 0.0,
            dropout_seed: int = 0) -> tuple[Array, Cache]:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    ``tokens`` (B, T+1) integer. Returns the loss (a 0-d array) and the cache
    for :func:`backward`. ``dropout_p`` drops attention weights (layer ``l``
    uses the seed ``dropout_seed + l``).
    """
    xp = array_namespace(tokens, model.params["embed"])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    z, cache = _trunk(model, inputs, xp, dropout_p, dropout_seed)  # (N, V)
    m = xp.max(z, axis=-1, keepdims=True)
    e = xp.exp(z - m)
    total = xp.sum(e, axis=-1, keepdims=True)
    lse = m + xp.log(total)                                        # (N, 1)
    cache.targets_1h = one_hot(xp.reshape(targets, (-1,)), model.config.vocab_size,
                               z.dtype, xp)                        # (N, V)
    picked = xp.sum(z * cache.targets_1h, axis=-1, keepdims=True)  # target logits
    loss = xp.mean(lse - picked)
    cache.probs = e / total
    return loss, cache


def backward(cache: Cache) -> dict[str, Array]:
    """The gradient of the loss with respect to every parameter, by name."""
    cfg, p = cache.model.config, cache.model.params
    xp = array_namespace(cache.probs)
    n, v = cache.probs.shape
    grads: dict[str, Array] = {}

    # cross-entropy of a softmax: (probabilities − one-hot) / N
    dz = (cache.probs - cache.targets_1h) / n                       # (N, V)
    if cfg.tied:
        dh = xp.matmul(dz, p["embed"])                              # (N, D)
        d_embed = xp.matmul(xp.matrix_transpose(dz), cache.hidden)  # (V, D)
    else:
        dh, grads["unembed"] = linear_backward(dz, cache.hidden, p["unembed"], xp)
        d_embed = None
    dx, grads["final_norm"] = rms_norm_backward(dh, cache.final, xp)

    for layer in reversed(range(cfg.num_layers)):
        norm1, attn, norm2, ff = cache.layers[layer]
        dh, g = mlp_backward(dx, ff, cfg, xp)
        grads |= {f"{layer}.{n}": a for n, a in g.items()}
        dh, grads[f"{layer}.mlp_norm"] = rms_norm_backward(dh, norm2, xp)
        dx = dx + dh
        dh, g = attention_layer_backward(dx, attn, cfg, cache.positions, xp)
        grads |= {f"{layer}.{n}": a for n, a in g.items()}
        dh, grads[f"{layer}.attn_norm"] = rms_norm_backward(dh, norm1, xp)
        dx = dx + dh

    # embedding lookup: each row's gradient is the sum over the tokens that used it
    rows = one_hot(xp.reshape(cache.inputs, (-1,)), v, dx.dtype, xp)       # (N, V)
    looked_up = xp.matmul(xp.matrix_transpose(rows), dx)                  # (V, D)
    grads["embed"] = looked_up if d_embed is None else looked_up + d_embed  # (V, D)
    return {name: grads[name] for name in p}


# ---------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------

@dataclass
class AdamW:
    """AdamW's settings and state: the step count and both moments of each parameter."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.1
    step: int = 0
    m: dict[str, Array] = field(default_factory=dict)
    v: dict[str, Array] = field(default_factory=dict)


def adamw_step(params: dict[str, Array], grads: dict[str, Array], state: AdamW,
               lr: float | None = None) -> dict[str, Array]:
    """One AdamW update (decoupled weight decay on matrices, not on norm gains)."""
    xp = array_namespace(*params.values())
    lr = state.lr if lr is None else lr
    b1, b2 = state.betas
    state.step += 1
    fix1, fix2 = 1.0 - b1 ** state.step, 1.0 - b2 ** state.step
    new = {}
    for name, w in params.items():
        g = grads[name]
        m = state.m[name] = b1 * state.m.get(name, xp.zeros_like(g)) + (1.0 - b1) * g
        v = state.v[name] = b2 * state.v.get(name, xp.zeros_like(g)) + (1.0 - b2) * g * g
        decay = state.weight_decay if w.ndim == 2 else 0.0
        new[name] = w * (1.0 - lr * decay) - lr * (m / fix1) / (xp.sqrt(v / fix2) + state.eps)
    return new


def learning_rate(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    """Linear warm-up, then a cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, frac))))


def clip(grads: dict[str, Array], max_norm: float) -> tuple[dict[str, Array], float]:
    """Gradients scaled so that their global norm is at most ``max_norm``; and the norm."""
    xp = array_namespace(*grads.values())
    norm = math.sqrt(sum(float(xp.sum(g * g)) for g in grads.values()))
    scale = min(1.0, max_norm / (norm + 1e-12))
    return {n: g * scale for n, g in grads.items()}, norm


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------

def generate(model: Model, vocab: Vocabulary, prompt: str, length: int, *,
             context: int, temperature: float = 0.0, seed: int = 0,
             asarray: Callable[[np.ndarray], Array] = np.asarray) -> str:
    """``prompt`` followed by ``length`` sampled characters.

    ``temperature=0`` picks the most likely character; otherwise characters
    are drawn from ``softmax(logits / temperature)`` (the Gumbel-max trick,
    so sampling is an argmax on the model's own library).
    """
    rng = np.random.default_rng(seed)
    ids = list(vocab.encode(prompt))
    for _ in range(length):
        window = asarray(np.array([ids[-context:]], dtype=np.int64))   # (1, T)
        z = logits(model, window)[0, -1, :]                             # (V,)
        xp = array_namespace(z)
        if temperature > 0:
            gumbel = -np.log(-np.log(rng.uniform(1e-12, 1.0, size=z.shape[0])))  # (V,)
            z = z / temperature + xp.asarray(gumbel, dtype=z.dtype, device=device(z))
        ids.append(int(xp.argmax(z)))
    return vocab.decode(ids)


# ---------------------------------------------------------------------------
# Training loop and command line
# ---------------------------------------------------------------------------

@dataclass
class History:
    """The loss of each training step and of each held-out evaluation."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    held_out_steps: list[int] = field(default_factory=list)
    held_out: list[float] = field(default_factory=list)
    seconds: float = 0.0


def held_out_loss(model: Model, windows: Array) -> float:
    return float(forward(model, windows)[0])


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, total: int, stream=None, width: int = 24):
        self.total, self.width = total, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.every = 1 if self.tty else max(1, total // 10)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        done = step + 1
        if done % self.every and done != self.total:
            return
        fill = self.width * done // self.total
        bar = "#" * fill + "." * (self.width - fill)
        line = (f"step {done:>{len(str(self.total))}}/{self.total} [{bar}] "
                f"loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def train(model: Model, train_ids: np.ndarray, *, steps: int, batch: int, seq_len: int,
          lr: float = 3e-3, seed: int = 0, held_out_ids: np.ndarray | None = None,
          eval_every: int = 100, asarray: Callable[[np.ndarray], Array] = np.asarray,
          progress: bool = True, max_grad_norm: float = 1.0,
          dropout_p: float = 0.0) -> History:
    """Train ``model`` in place on random windows of ``train_ids``; the loss history."""
    rng = np.random.default_rng(seed + 1)
    state = AdamW(lr=lr)
    history = History()
    bar = Progress(steps) if progress else None
    windows = None
    if held_out_ids is not None and len(held_out_ids) > seq_len:
        windows = asarray(held_out_windows(held_out_ids, seq_len))   # (W, T+1)
        history.held_out_steps.append(0)
        history.held_out.append(held_out_loss(model, windows))
    start = time.perf_counter()
    for step in range(steps):
        tokens = asarray(batch_windows(train_ids, batch, seq_len, rng))   # (B, T+1)
        # a fresh dropout mask every step and layer: the seed in the high 32 bits
        loss, cache = forward(model, tokens, dropout_p=dropout_p,
                              dropout_seed=(seed << 32) + step * model.config.num_layers)
        grads, _ = clip(backward(cache), max_grad_norm)
        model.params = adamw_step(model.params, grads, state,
                                  learning_rate(step, steps, lr, warmup=min(50, steps // 10)))
        history.steps.append(step + 1)
        history.losses.append(float(loss))
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.update(step, history.losses[-1], (step + 1) * batch * seq_len / elapsed)
        if windows is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            history.held_out_steps.append(step + 1)
            history.held_out.append(held_out_loss(model, windows))
    history.seconds = time.perf_counter() - start
    return history


def smooth(values: list[float], span: int) -> np.ndarray:
    """Running mean over the last ``span`` values (shorter at the start)."""
    c = np.cumsum(np.r_[0.0, values])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - span)
    return (c[idx] - c[lo]) / (idx - lo)


def save_loss_plot(history: History, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(history.steps, history.losses, color="#9ecae1", lw=0.8, label="training batch")
    span = max(1, len(history.losses) // 50)
    ax.plot(history.steps, smooth(history.losses, span), color="#08519c", lw=1.6,
            label=f"training, mean of {span} steps")
    if history.held_out:
        ax.plot(history.held_out_steps, history.held_out, "o-", color="#d94801", ms=3,
                lw=1.2, label="held-out text (last 10 %)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character, log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> History:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", default="numpy", choices=LIBRARIES,
                        help="array library to train on (default: numpy)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seq-len", type=int, default=128, help="characters per row")
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--activation", default="gelu", choices=tuple(ACTIVATIONS))
    parser.add_argument("--attn-dropout", type=float, default=0.0,
                        help="probability of dropping an attention weight while training")
    parser.add_argument("--untied", action="store_true",
                        help="a separate output matrix instead of the transposed embeddings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50,
                        help="steps between held-out evaluations")
    parser.add_argument("--out", default=None, help="save the loss curve to this PNG")
    parser.add_argument("--prompt", default="注意力", help="start of the generated sample")
    parser.add_argument("--sample-length", type=int, default=120)
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 picks the most likely character")
    args = parser.parse_args(argv)
    for name in ("steps", "seq_len", "batch", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; "
                         f"got {getattr(args, name)}")

    if args.seed < 0:
        parser.error(f"--seed must be at least 0; got {args.seed}")
    if not 0.0 <= args.attn_dropout < 1.0:
        parser.error(f"--attn-dropout must be in [0, 1); got {args.attn_dropout}")

    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder):
            parser.error(f"--out {args.out}: the folder {folder} does not exist")
    try:
        asarray = array_factory(args.library)
    except ImportError as exc:
        parser.error(f"--library {args.library} needs {exc.name or args.library}, which is not "
                     f"installed ({exc})")

    text = load_text()
    vocab = Vocabulary.of(text)
    train_ids, held_ids = split(vocab.encode(text))
    if len(train_ids) <= args.seq_len:
        parser.error(f"--seq-len {args.seq_len} must be below the {len(train_ids)} "
                     "training characters")
    missing = set(args.prompt) - set(vocab.chars)
    if missing:
        parser.error(f"--prompt uses characters the text does not contain: {sorted(missing)}")
    config = Config(vocab_size=len(vocab.chars), activation=args.activation,
                    tied=not args.untied)
    model = Model.init(config, seed=args.seed, asarray=asarray, dtype=args.dtype)
    count = sum(math.prod(a.shape) for a in model.params.values())
    print(f"{len(text)} characters ({len(vocab.chars)} distinct), {len(train_ids)} for training; "
          f"{count:,} parameters; {args.library} {args.dtype}")

    history = train(model, train_ids, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                    lr=args.lr, seed=args.seed, held_out_ids=held_ids,
                    eval_every=args.eval_every, asarray=asarray, dropout_p=args.attn_dropout)
    tail = history.losses[-max(1, len(history.losses) // 20):]
    print(f"{args.steps} steps in {history.seconds:.1f} s "
          f"({args.steps * args.batch * args.seq_len / history.seconds:,.0f} tokens/s): "
          f"loss {history.losses[0]:.3f} -> {sum(tail) / len(tail):.3f} "
          + (f"(mean of the last {len(tail)} steps)" if len(tail) > 1 else "(the last step)")
          + (f", held-out {history.held_out[-1]:.3f}" if history.held_out else ""))
    if args.out:
        save_loss_plot(history, args.out,
                       f"{config.num_layers} layers, d_model {config.d_model}, "
                       f"{args.library} {args.dtype}, batch {args.batch}×{args.seq_len}")
        print(f"loss curve saved to {args.out}")
    sample = generate(model, vocab, args.prompt, args.sample_length, context=args.seq_len,
                      temperature=args.temperature, seed=args.seed, asarray=asarray)
    print("sample:")
    print(sample)
    return history


if __name__ == "__main__":
    main()
