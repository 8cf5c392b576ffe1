"""Draw ``decoder_attention.png``: where SmolLM2's heads look, over a sentence it wrote.

The model continues a story opening greedily for 20 tokens; the
attention weights of every layer over the whole sentence then give, per head,
the mean look-back distance: ``Σ_j α_ij · (i − j)`` averaged over the query
tokens ``i`` (0: a token attends to itself; 1: to the previous token; large:
to the start). Left: that distance for the 9 heads of each of the 30 layers.
Right: the weights of the head with the shortest look-back outside the first
layer, over the tokens.

Run from the repository root, with ``polyattn[models]``, matplotlib and the
weights installed::

    python docs/_static/decoder_attention.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from polyattn.models import smollm2

PROMPT = "Once upon a time, in a small village by the sea, there lived"
NEW_TOKENS = 20
OUT = Path(__file__).with_suffix(".png")


def look_back(alpha: np.ndarray) -> np.ndarray:
    """Mean look-back distance per head: (H, T, T) weights -> (H,)."""
    t = alpha.shape[-1]
    i = np.arange(t)
    distance = np.clip(i[:, None] - i[None, :], 0, None)              # (T, T): i − j
    per_query = (alpha * distance).sum(-1)                            # (H, T)
    return per_query[:, 1:].mean(-1)                                 # query 0 can only look at 0


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = smollm2.load()
    tok = model.tokenizer
    ids = tok.encode(PROMPT)
    ids = ids + model.generate(ids, NEW_TOKENS, stop_at_eos=False)
    labels = [tok.decode([i]).replace("\n", "\\n") for i in ids]
    maps = [np.asarray(a, dtype=np.float64) for a in model.attention_weights(ids)]
    distance = np.stack([look_back(a) for a in maps])                 # (L, H)

    layer, head = np.unravel_index(np.argmin(distance[1:]), distance[1:].shape)
    layer += 1
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6.2), layout="constrained",
                                      gridspec_kw={"width_ratios": [1, 2.1]})
    im = left.imshow(distance, aspect="auto", cmap="magma_r")
    left.set_xlabel("head")
    left.set_ylabel("layer")
    left.set_xticks(range(distance.shape[1]))
    left.set_title("mean look-back distance (tokens)")
    left.add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, ec="tab:blue",
                                 lw=2))
    fig.colorbar(im, ax=left, shrink=0.8)

    right.imshow(maps[layer][head], cmap="viridis", vmin=0.0, vmax=1.0)
    right.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    right.set_yticks(range(len(labels)), labels, fontsize=7)
    right.set_xlabel("key (attended to)")
    right.set_ylabel("query (attending)")
    right.set_title(f"layer {layer}, head {head}: look-back {distance[layer, head]:.2f} tokens")
    fig.suptitle(f'SmolLM2-135M-Instruct on polyattn: "{PROMPT}" + {NEW_TOKENS} generated '
                 "tokens")
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}; text: {tok.decode(ids)!r}")
    print("layers: mean look-back per layer (tokens):",
          " ".join(f"{d:.1f}" for d in distance.mean(-1)))


if __name__ == "__main__":
    main()
