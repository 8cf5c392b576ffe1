"""Command line: ``python -m polyattn info | demo | bench``.

``info``
    versions, the array libraries found, whether the CUDA kernel can run.
``demo``
    the worked example of self-attention on the sentence "这 部 电影 很 好看"
    ("this movie is good-looking"), with hand-built embeddings and projections.
``bench``
    a quick side-by-side timing of polyattn against the naive formula.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
import time
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import __version__

#: Array libraries polyattn supports: (import name, distributions to look for).
LIBRARIES = [
    ("numpy", ("numpy",)),
    ("array_api_compat", ("array-api-compat",)),
    ("array_api_strict", ("array-api-strict",)),
    ("torch", ("torch",)),
    ("jax", ("jax",)),
    ("dask", ("dask",)),
    ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
    ("numba", ("numba",)),
    ("numba_cuda", ("numba-cuda",)),
]
BACKENDS = ("numpy", "torch", "jax", "cupy", "dask", "array_api_strict")


def _version(distributions: Sequence[str]) -> str | None:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cuda_status() -> tuple[bool, str]:
    """Whether a CUDA GPU and numba-cuda are usable, and why not."""
    if _version(("numba-cuda",)) is None:
        return False, "numba-cuda is not installed (pip install 'polyattn[cuda]')"
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False, "NUMBA_ENABLE_CUDASIM=1: kernels run on the CPU simulator"
    try:
        from numba import cuda

        if cuda.is_available():
            return True, f"GPU: {cuda.get_current_device().name.decode()}"
        return False, "no CUDA GPU or driver found"
    except Exception as exc:  # pragma: no cover - driver errors
        return False, f"CUDA unavailable: {exc}"


def cmd_info(args: argparse.Namespace) -> int:
    print(f"polyattn {__version__}")
    print(f"python {sys.version.split()[0]} on {sys.platform}")
    print("array libraries:")
    for name, dists in LIBRARIES:
        version = _version(dists)
        print(f"  {name:<18} {version if version else 'not installed'}")
    cuda_ok, why = _cuda_status()
    print(f"CUDA kernel: {'usable' if cuda_ok else 'not usable'} ({why})")
    impls = ["reference", "chunked"] + (["numba_cuda"] if cuda_ok else [])
    print(f"implementations available: {', '.join(impls)}")
    return 0


# --- the demo ------------------------------------------------------------------------------

TOKENS = ["这", "部", "电影", "很", "好看"]
GLOSSES = ["this", "measure word", "movie", "very", "good-looking"]
D_MODEL, D_K = 8, 4


def demo_matrices() -> dict[str, np.ndarray]:
    """Hand-built embeddings and projections for the demo sentence.

    Feature axes of the token embedding: 0 noun, 1 adjective, 2 determiner,
    3 measure word, 4 adverb (5–7 unused, left to the positional encoding).
    The projections are chosen so that each query looks for what grammar says
    the word should attach to: the adjective 好看 looks for a noun (电影), the
    adverb 很 for an adjective (好看), the determiner 这 for a measure word (部),
    the measure word 部 for a noun (电影).
    """
    strength = 3.0
    emb = np.zeros((5, D_MODEL))
    for row, feature in enumerate([2, 3, 0, 4, 1]):     # 这 部 电影 很 好看
        emb[row, feature] = strength
    w_q = np.zeros((D_MODEL, D_K))
    w_k = np.zeros((D_MODEL, D_K))
    w_q[1, 0] = 1.0   # adjective asks "which thing do I describe?"
    w_k[0, 0] = 1.0   # ... a noun answers
    w_q[4, 1] = 1.0   # adverb asks "which quality do I intensify?"
    w_k[1, 1] = 1.0   # ... an adjective answers
    w_q[2, 2] = 1.0   # determiner asks for its measure word
    w_k[3, 2] = 1.0
    w_q[3, 3] = 1.0   # measure word asks for the noun it counts
    w_k[0, 3] = 1.0
    w_q[0, 3] = 0.3   # the noun looks weakly for other nouns (itself)
    w_v = np.eye(D_MODEL)[:, :D_K] + np.eye(D_MODEL)[:, 4:4 + D_K] * 0.5
    return {"embeddings": emb, "w_q": w_q, "w_k": w_k, "w_v": w_v}


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _pad(text: str, width: int, right: bool = False) -> str:
    fill = " " * max(0, width - _width(text))
    return fill + text if right else text + fill


def format_weights(weights: np.ndarray, rows: Sequence[str], cols: Sequence[str]) -> str:
    """A table of attention weights; ``*`` marks each row's strongest weight."""
    label_w = max(_width(r) for r in rows) + 2
    cell_w = max(8, *(_width(c) + 2 for c in cols))
    lines = [_pad("", label_w) + "".join(_pad(c, cell_w, right=True) for c in cols)]
    for label, row in zip(rows, weights, strict=True):
        best = int(np.argmax(row))
        cells = [f"{w:.3f}{'*' if j == best else ' '}" for j, w in enumerate(row)]
        lines.append(_pad(label, label_w) + "".join(_pad(c, cell_w, right=True) for c in cells))
    return "\n".join(lines)


def _backend_namespace(name: str) -> Any:
    from ._compat import resolve_xp

    module = {"jax": "jax.numpy", "dask": "dask.array"}.get(name, name)
    try:
        lib = importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"--backend {name}: {module} is not installed ({exc})") from exc
    if name == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    return resolve_xp(lib)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "compute"):
        x = x.compute()
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.model == "minilm":
        from .models import minilm

        layer = 3 if args.layer is None else args.layer
        head = 1 if args.head is None else args.head
        minilm.run_demo(args.sentence, layer, head, args.backend, args.save_png)
        return 0
    from . import attention_weights, scaled_dot_product_attention, sinusoidal_positional_encoding

    xp = _backend_namespace(args.backend)
    m = demo_matrices()
    print('Self-attention on "这 部 电影 很 好看" ("this movie is good-looking")')
    print("tokens: " + " | ".join(f"{t} ({g})" for t, g in zip(TOKENS, GLOSSES, strict=True)))
    print(f"backend: {args.backend}")
    print()
    pe = sinusoidal_positional_encoding(len(TOKENS), D_MODEL, xp=xp, dtype=xp.float64)
    x = xp.asarray(m["embeddings"], dtype=xp.float64) + pe                # (T, d_model)
    w_q, w_k, w_v = (xp.asarray(m[k], dtype=xp.float64) for k in ("w_q", "w_k", "w_v"))
    q, k, v = x @ w_q, x @ w_k, x @ w_v                                   # (T, d_k)
    scores = (q @ xp.matrix_transpose(k)) / D_K ** 0.5                    # (T, T)
    print(f"X = token embedding + sinusoidal position   shape {tuple(x.shape)}")
    print(f"Q = X W_Q, K = X W_K, V = X W_V              shape {tuple(q.shape)} each")
    print(f"scores = Q Kᵀ / sqrt(d_k), d_k = {D_K}             shape {tuple(scores.shape)}")
    print("weights = softmax of each row of the scores   (each row sums to 1)")
    out: Any = scaled_dot_product_attention(q, k, v)
    print(f"output_i = sum_j weights[i, j] * v_j           shape {tuple(out.shape)}")
    print()
    alpha = _to_numpy(attention_weights(q, k))
    rows = [f"{t} {g}" for t, g in zip(TOKENS, GLOSSES, strict=True)]
    print("Attention weights (row: the query token; column: the key token it attends to)")
    print(format_weights(alpha, rows, TOKENS))
    print("* marks the strongest weight of each row.")
    print()
    movie, good = TOKENS.index("电影"), TOKENS.index("好看")
    print(f"The query of 好看 (good-looking) matches the key of 电影 (movie): weight "
          f"{alpha[good, movie]:.2f}. The new vector of 好看 is mostly the value of 电影,")
    print("so after this layer 'good-looking' carries what it describes: a good-looking movie.")
    if args.save_png:
        save_heatmap(alpha, GLOSSES, args.save_png)
        print(f"heatmap written to {args.save_png}")
    return 0


def save_heatmap(alpha: np.ndarray, labels: Sequence[str], path: str) -> None:
    """Write the weights as a PNG heatmap (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--save-png needs matplotlib: pip install 'polyattn[plot]'") from exc
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    im = ax.imshow(alpha, cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    for i in range(alpha.shape[0]):
        for j in range(alpha.shape[1]):
            ax.text(j, i, f"{alpha[i, j]:.2f}", ha="center", va="center",
                    color="white" if alpha[i, j] < 0.5 else "black", fontsize=8)
    fig.colorbar(im, ax=ax, label="attention weight")
    ax.set_title("Self-attention weights")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- bench ---------------------------------------------------------------------------------

def _naive(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        t = s.shape[-1]
        s = np.where(np.tri(s.shape[-2], t, dtype=bool), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


def cmd_bench(args: argparse.Namespace) -> int:
    from . import explain, scaled_dot_product_attention

    try:
        b, h, t, e = (int(n) for n in args.shape.split(","))
    except ValueError as exc:
        raise SystemExit(f"--shape must be B,H,T,E; got {args.shape!r}") from exc
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, h, t, e)).astype(args.dtype) for _ in range(3))
    flops = 4 * b * h * t * t * e * (0.5 if args.causal else 1.0)
    runs = {
        "polyattn": lambda: scaled_dot_product_attention(q, k, v, is_causal=args.causal),
        "naive numpy": lambda: _naive(q, k, v, args.causal),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeat):  # interleaved, so machine noise hits both alike
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"shape (B, H, T, E) = {(b, h, t, e)}, {args.dtype}, causal={args.causal}")
    print(f"polyattn auto -> {explain(q, k, v, is_causal=args.causal).implementation}")
    base = float(np.median(times["naive numpy"]))
    for name, ts in times.items():
        med = float(np.median(ts))
        print(f"  {name:<12} {med * 1e3:9.2f} ms  {flops / med / 1e9:7.1f} GFLOP/s  "
              f"{med / base:5.2f}x naive")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m polyattn",
                                     description="Transformer attention for any array library.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, array libraries found, CUDA availability")
    demo = sub.add_parser("demo", help='self-attention on "这 部 电影 很 好看", step by step')
    demo.add_argument("--backend", choices=BACKENDS, default="numpy")
    demo.add_argument("--save-png", metavar="PATH", help="also write a heatmap (matplotlib)")
    demo.add_argument("--model", choices=("toy", "minilm"), default="toy",
                      help="'minilm': a real sentence encoder's weights (polyattn[demo])")
    demo.add_argument("--sentence", help="sentence for --model minilm")
    demo.add_argument("--layer", type=int, help="layer for --model minilm (0-5, default 3)")
    demo.add_argument("--head", type=int, help="head for --model minilm (0-11, default 1)")
    bench = sub.add_parser("bench", help="quick timing: polyattn vs the naive formula")
    bench.add_argument("--shape", default="1,8,1024,64", help="B,H,T,E (default 1,8,1024,64)")
    bench.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    bench.add_argument("--causal", action="store_true")
    bench.add_argument("--repeat", type=int, default=5)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"info": cmd_info, "demo": cmd_demo, "bench": cmd_bench}
    return handlers[args.command](args)
