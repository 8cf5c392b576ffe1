"""Command line: ``polyattn info | demo | bench | generate`` (or ``python -m polyattn ...``).

``info``
    versions, the array libraries found, whether the CUDA kernel can run, the
    CPUs, and the BLAS libraries NumPy uses with their thread counts.
``demo``
    the worked example of self-attention on the sentence "这 部 电影 很 好看"
    ("this movie is good-looking"), with hand-built embeddings and projections;
    ``--model minilm`` shows a head of a real sentence encoder instead.
``bench``
    a quick side-by-side timing of polyattn against the naive formula.
``generate``
    continue a prompt with SmolLM2-135M-Instruct, a real language model whose
    attention is polyattn's; the text is printed as the tokens come, the speed
    at the end (on stderr).

A mistake in the arguments, a ``POLYATTN_*`` environment variable the library
would refuse, or a missing optional package gives one line on stderr that names
the argument (or variable) and the fix, and exit status 2, before any work
starts; no traceback. Ctrl-C stops with exit status 130, also without one.

The package: ``text`` (the user error, integers, bytes), ``system`` (installed
packages, free memory), ``environment`` (the ``POLYATTN_*`` variables), a module
per command (``info``, which has ``warmup`` too, ``demo``, ``bench``,
``generate``), ``parser`` (the argument parser) and :func:`main` here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from polyattn.cli.bench import (
    MAX_REPEAT,
    check_bench_args,
    cmd_bench,
    naive_bytes,
    parse_shape,
    ratio_note,
)
from polyattn.cli.demo import (
    BACKENDS,
    D_K,
    D_MODEL,
    GLOSSES,
    MINILM_HEADS,
    MINILM_LAYERS,
    TOKENS,
    check_demo_args,
    check_png_path,
    cmd_demo,
    demo_matrices,
    format_weights,
    save_heatmap,
)
from polyattn.cli.environment import SETTINGS, VARIABLES, check_environment, environment_line
from polyattn.cli.generate import (
    GENERATE_BACKENDS,
    MIN_TEMPERATURE,
    cache_bytes,
    check_context,
    check_generate_args,
    check_memory,
    cmd_generate,
    timing_line,
)
from polyattn.cli.info import (
    LIBRARIES,
    THREAD_VARIABLES,
    _version,
    blas_lines,
    cmd_info,
    cmd_warmup,
    cpu_summary,
    cuda_status,
    simulator_enabled,
)
from polyattn.cli.parser import (
    COMMANDS,
    NUMBER_OPTIONS,
    ArgumentParser,
    UsageError,
    _attach_negative_values,
    build_parser,
    parse_args,
)
from polyattn.cli.system import INSTALL, available_memory, check_backend, cupy_status
from polyattn.cli.text import (
    MAX_INTEGER,
    CLIError,
    check_utf8,
    format_bytes,
    integer,
    shown,
)

__all__ = [
    "BACKENDS", "COMMANDS", "D_K", "D_MODEL", "GENERATE_BACKENDS", "GLOSSES", "INSTALL",
    "LIBRARIES", "MAX_INTEGER", "MAX_REPEAT", "MINILM_HEADS", "MINILM_LAYERS",
    "MIN_TEMPERATURE", "NUMBER_OPTIONS", "SETTINGS", "THREAD_VARIABLES", "TOKENS", "VARIABLES",
    "ArgumentParser", "CLIError", "UsageError", "_attach_negative_values", "_version",
    "available_memory", "blas_lines", "build_parser", "cache_bytes", "check_backend",
    "check_bench_args", "check_context", "check_demo_args", "check_environment",
    "check_generate_args", "check_memory", "check_png_path", "check_utf8", "cmd_bench",
    "cmd_demo", "cmd_generate", "cmd_info", "cmd_warmup", "cpu_summary", "cuda_status",
    "cupy_status", "demo_matrices", "environment_line", "format_bytes", "format_weights",
    "integer", "main", "naive_bytes", "parse_args", "parse_shape", "ratio_note",
    "save_heatmap", "shown", "simulator_enabled", "timing_line",
]


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the command line; returns the exit status.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments; default ``sys.argv[1:]``.
    prog : str, optional
        The command's name in messages (default ``"polyattn"``).

    Returns
    -------
    int
        0 when done; 2 for a mistake in the arguments, a refused environment
        variable or a missing package, told in one line on stderr before any
        work; 130 when interrupted (Ctrl-C). ``--help`` and ``--version``
        raise :class:`SystemExit` (0).
    """
    parser = build_parser(prog)
    try:
        args = parse_args(parser, argv)
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc.message}", file=sys.stderr)
        return 2
    handlers = {"info": cmd_info, "demo": cmd_demo, "bench": cmd_bench,
                "generate": cmd_generate, "warmup": cmd_warmup}
    try:
        check_environment()
        status = handlers[args.command](args)
        sys.stdout.flush()
    except CLIError as exc:
        print(f"{parser.prog} {args.command}: error: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (``| head``) went away: send what is left to devnull, so the
        # flush at exit does not fail again, and stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0  # as when the output ended before the reader did: not a failure
    return status
