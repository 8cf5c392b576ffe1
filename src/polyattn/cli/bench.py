"""``bench``: polyattn and the naive formula timed side by side."""

from __future__ import annotations

import argparse
import time

import numpy as np

from polyattn.cli import system
from polyattn.cli.text import CLIError, _clip, format_bytes, integer, shown


def _naive(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        t = s.shape[-1]
        s = np.where(np.tri(s.shape[-2], t, dtype=bool), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``--shape B,H,T,E`` as four positive integers; :class:`CLIError` otherwise.

    Each is written as :func:`integer` takes it (``1e3`` too), as for the other
    integer options.
    """
    try:
        dims = tuple(integer(n) for n in text.split(","))
    except argparse.ArgumentTypeError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise CLIError(f"--shape must be four positive integers B,H,T,E such as 1,8,1024,64; "
                       f"got {_clip(text)}")
    b, h, t, e = dims
    return b, h, t, e


def naive_bytes(shape: tuple[int, int, int, int], dtype: str) -> int:
    """Bytes the naive baseline holds at once: q, k, v, the output and the T×T scores.

    Examples
    --------
    >>> naive_bytes((1, 1, 1024, 64), "float32")     # 4·1024·64 + 1024² values
    5242880
    """
    b, h, t, e = shape
    return np.dtype(dtype).itemsize * b * h * t * (4 * e + t)


#: The most timed runs ``bench --repeat`` takes.
MAX_REPEAT = 10_000


def check_bench_args(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """Every check on ``bench``'s arguments; returns the shape.

    Raises
    ------
    CLIError
        With one line naming the argument: a malformed shape, a shape whose
        naive baseline would not fit in the memory available, ``--repeat``
        outside 1 to :data:`MAX_REPEAT`.
    """
    if args.repeat < 1:
        raise CLIError(f"--repeat must be at least 1; got {args.repeat}")
    if args.repeat > MAX_REPEAT:
        raise CLIError(f"--repeat must be at most {MAX_REPEAT:,} (timed runs of each; the "
                       f"median settles long before); got {args.repeat}")
    shape = parse_shape(args.shape)
    need, free = naive_bytes(shape, args.dtype), system.available_memory()
    if free is not None and need > free:
        raise CLIError(f"--shape {shown(args.shape)}: the naive baseline needs "
                       f"{format_bytes(need)} in {args.dtype} (q, k, v, the output and the "
                       f"T×T scores), but {format_bytes(free)} of memory is available; "
                       f"choose a smaller shape")
    return shape


def ratio_note(ratio: float, baseline: str) -> str:
    """``ratio`` (a time over the baseline's time) in words that cannot be read backwards.

    Examples
    --------
    >>> ratio_note(0.4, "naive NumPy")
    '0.40× the time of naive NumPy (2.5× faster)'
    >>> ratio_note(2.0, "naive NumPy")
    '2.00× the time of naive NumPy (2.0× slower)'
    """
    if ratio < 1.0:
        speed = f"{1.0 / ratio:.1f}× faster"
    elif ratio > 1.0:
        speed = f"{ratio:.1f}× slower"
    else:
        speed = "the same"
    return f"{ratio:.2f}× the time of {baseline} ({speed})"


def cmd_bench(args: argparse.Namespace) -> int:
    """``bench``: polyattn and the naive formula timed side by side."""
    from polyattn import explain, scaled_dot_product_attention

    b, h, t, e = check_bench_args(args)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, h, t, e), dtype=args.dtype) for _ in range(3))
    flops = 4 * b * h * t * t * e * (0.5 if args.causal else 1.0)
    baseline = "naive NumPy"
    runs = {
        "polyattn": lambda: scaled_dot_product_attention(q, k, v, is_causal=args.causal),
        baseline: lambda: _naive(q, k, v, args.causal),
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
    print(f"median of {args.repeat} run{'s' if args.repeat > 1 else ''} each, interleaved; "
          f"times compared with {baseline} (the softmax formula in plain NumPy)")
    tiny = 1e-9                     # a clock that did not move: no division by zero
    base = max(float(np.median(times[baseline])), tiny)
    for name, ts in times.items():
        med = max(float(np.median(ts)), tiny)
        note = "(the baseline)" if name == baseline else ratio_note(med / base, baseline)
        print(f"  {name:<12} {med * 1e3:9.2f} ms  {flops / med / 1e9:7.1f} GFLOP/s  {note}")
    return 0
