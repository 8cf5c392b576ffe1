"""``demo``: self-attention on a sentence step by step, or a head of all-MiniLM-L6-v2."""

from __future__ import annotations

import argparse
import importlib
import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyattn.cli.system import INSTALL, _installed, check_backend
from polyattn.cli.text import CLIError, _first_line, check_utf8, shown

#: Array libraries ``demo`` runs on.
BACKENDS = ("numpy", "torch", "jax", "cupy", "dask", "array_api_strict")


#: all-MiniLM-L6-v2's layers and heads (``--model minilm``).
MINILM_LAYERS, MINILM_HEADS = 6, 12


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
    from polyattn._interop import resolve_xp

    check_backend(name)
    module = {"jax": "jax.numpy", "dask": "dask.array"}.get(name, name)
    try:
        lib = importlib.import_module(module)
    except ImportError as exc:
        raise CLIError(f"--backend {name}: {module} could not be imported ({_first_line(exc)}); "
                       f"reinstall it with {INSTALL[name]}") from exc
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


def check_demo_args(args: argparse.Namespace) -> None:
    """Every check on ``demo``'s arguments that can fail before any work starts.

    Raises
    ------
    CLIError
        With one line naming the argument and the fix.
    """
    if args.model != "minilm":
        for option in ("sentence", "layer", "head"):
            if getattr(args, option) is not None:
                raise CLIError(f"--{option} applies only with --model minilm "
                               f"(the toy demo has one fixed sentence, layer and head)")
    else:
        if args.layer is not None and not 0 <= args.layer < MINILM_LAYERS:
            raise CLIError(f"--layer must be 0 to {MINILM_LAYERS - 1} (all-MiniLM-L6-v2 has "
                           f"{MINILM_LAYERS} layers); got {args.layer}")
        if args.head is not None and not 0 <= args.head < MINILM_HEADS:
            raise CLIError(f"--head must be 0 to {MINILM_HEADS - 1} (all-MiniLM-L6-v2 has "
                           f"{MINILM_HEADS} heads); got {args.head}")
        if args.backend == "dask":
            raise CLIError("--backend dask is not available with --model minilm; use numpy, "
                           "torch, jax, cupy or array_api_strict")
        if args.sentence is not None:
            check_utf8(args.sentence, "--sentence")
            if not args.sentence.strip():
                raise CLIError("--sentence is empty; give a sentence, e.g. --sentence "
                               "'this movie is really good'")
    check_backend(args.backend)
    if args.save_png is not None:
        check_png_path(args.save_png)
        if not _installed("matplotlib"):
            raise CLIError(f"--save-png needs matplotlib, which is not installed; install it "
                           f"with {INSTALL['matplotlib']}")
    if args.model == "minilm":
        from polyattn.models import minilm

        try:
            minilm.check_requirements()
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise CLIError(f"--model minilm: {exc}") from exc


def check_png_path(path: str) -> None:
    """Raise :class:`CLIError` unless a file can be written at ``--save-png path``."""
    if not path.strip():
        raise CLIError("--save-png is empty; give a file name, e.g. --save-png weights.png")
    try:
        target = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as exc:   # a loop of links, a NUL, ...
        raise CLIError(f"--save-png {shown(path)}: not a usable path ({_first_line(exc)})"
                       ) from None
    parent = target.parent
    if target.is_dir():
        raise CLIError(f"--save-png {shown(path)} is a folder; give a file name in it, e.g. "
                       f"{shown(str(target / 'weights.png'))}")
    suffix = Path(path).suffix
    if suffix.lower() != ".png":
        example = (path[:-len(suffix)] if suffix else path.rstrip(".") or path) + ".png"
        raise CLIError(f"--save-png {shown(path)}: the file name must end in .png (the heatmap "
                       f"is written as a PNG image); e.g. {shown(example)}")
    if not parent.is_dir():
        blocker = _existing_ancestor(target)
        if blocker is not None and not blocker.is_dir():
            raise CLIError(f"--save-png {shown(path)}: {shown(str(blocker))} is not a folder "
                           "(it is a file); choose a file name in a folder")
        raise CLIError(f"--save-png {shown(path)}: the folder {shown(str(parent))} does not "
                       "exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CLIError(f"--save-png {shown(path)}: cannot write there (permission denied); "
                       "choose another place")


def _existing_ancestor(path: Path) -> Path | None:
    """The nearest of ``path``'s parents that exists (``None`` where none can be seen)."""
    for ancestor in path.parents:
        try:
            if ancestor.exists():
                return ancestor
        except OSError:         # a folder that cannot be searched
            return None
    return None


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: the toy sentence step by step, or a head of all-MiniLM-L6-v2."""
    check_demo_args(args)
    if args.model == "minilm":
        from polyattn.models import minilm

        layer = 3 if args.layer is None else args.layer
        head = 1 if args.head is None else args.head
        try:
            minilm.run_demo(args.sentence, layer, head, args.backend, args.save_png)
        except BrokenPipeError:
            raise                   # the reader went away (main() stops quietly)
        except (ValueError, OSError) as exc:   # a malformed model file, an unwritable PNG
            raise CLIError(f"--model minilm (the model in {shown(str(minilm.model_dir()))}): "
                           f"{_first_line(exc)}") from exc
        return 0
    from polyattn import (
        attention_weights,
        scaled_dot_product_attention,
        sinusoidal_positional_encoding,
    )

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
        print(f"heatmap written to {shown(args.save_png)}")
    return 0


def save_heatmap(alpha: np.ndarray, labels: Sequence[str], path: str) -> None:
    """Write the weights as a PNG heatmap (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise CLIError(f"--save-png needs matplotlib: {INSTALL['matplotlib']}") from exc
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
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise CLIError(f"--save-png {shown(path)}: cannot write it ({_first_line(exc)})"
                       ) from None
    finally:
        plt.close(fig)
