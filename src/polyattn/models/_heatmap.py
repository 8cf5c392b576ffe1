"""Attention weights drawn: a text heatmap, and a PNG with matplotlib."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from polyattn.models._bert_config import _printable
from polyattn.models._bert_files import INSTALL_HINT

_SHADES = " ░▒▓█"


def _shade(w: float) -> str:
    return _SHADES[min(len(_SHADES) - 1, int(w * len(_SHADES)))]


def format_heatmap(tokens: Sequence[str], weights: Any, *, width: int = 6) -> str:
    """A text heatmap of a (T, T) weight matrix: rows attend, columns are attended to.

    Each cell shows the weight to two decimals behind a shading character
    (blank below 0.2, ``█`` from 0.8).

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn.models.minilm import format_heatmap
    >>> print(format_heatmap(["a", "b"], np.array([[1.0, 0.0], [0.25, 0.75]])))
    query \\ key      a      b
    a            █1.00   0.00
    b            ░0.25  ▓0.75
    """
    labels = [tok[: width + 2] for tok in tokens]
    left = max(len("query \\ key"), *(len(s) for s in labels))
    header = "query \\ key".ljust(left) + "".join(s.rjust(width + 1) for s in labels)
    lines = [header]
    for label, row in zip(labels, weights, strict=True):
        cells = "".join(f"{_shade(float(w))}{float(w):.2f}".rjust(width + 1) for w in row)
        lines.append(label.ljust(left) + cells)
    return "\n".join(lines)


def _save_png(tokens: Sequence[str], weights: Any, title: str, filename: str) -> bool:
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"matplotlib is not installed; {_printable(filename)} was not written "
              f"(`{INSTALL_HINT}` installs it)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = len(tokens)
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * t, 0.8 + 0.55 * t), layout="constrained")
    im = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(t), tokens, rotation=45, ha="right")
    ax.set_yticks(range(t), tokens)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title)
    for i in range(t):
        for j in range(t):
            w = float(weights[i][j])
            ax.text(j, i, f"{w:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if w > 0.6 else "white")
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    fig.savefig(filename, dpi=120)
    plt.close(fig)
    return True
