"""The ``POLYATTN_*`` environment variables: checked before any work, shown by ``info``."""

from __future__ import annotations

import os

from polyattn.cli.text import CLIError, _first_line, shown


def _score_budget() -> None:
    from polyattn._dispatch import score_budget

    score_budget()


def _numba_cpu_setting() -> None:
    from polyattn._dispatch import numba_cpu_setting

    numba_cpu_setting()


def _cuda_kernel() -> None:
    from polyattn.backends.cuda import facade as numba_cuda

    numba_cuda.kernel_choice()


def _cuda_float32() -> None:
    from polyattn.backends.cuda import tensor_core as numba_cuda_tc

    numba_cuda_tc.float32_choice()


#: The environment variables polyattn reads that have rules, each with a function that
#: reads it as the library does (raising the library's ValueError for a value it refuses).
#: POLYATTN_SMOLLM2_GGUF and POLYATTN_MINILM_DIR are paths, checked by the command that
#: reads them (``generate``, ``demo --model minilm``).
SETTINGS = {
    "POLYATTN_SCORE_BUDGET": _score_budget,
    "POLYATTN_NUMBA_CPU": _numba_cpu_setting,
    "POLYATTN_CUDA_KERNEL": _cuda_kernel,
    "POLYATTN_CUDA_FLOAT32": _cuda_float32,
}
#: Every environment variable polyattn reads (``info`` shows those set).
VARIABLES = (*SETTINGS, "POLYATTN_SMOLLM2_GGUF", "POLYATTN_MINILM_DIR")


def check_environment() -> None:
    """Raise :class:`CLIError` for an environment variable the library would refuse.

    Each variable of :data:`SETTINGS` is read by the library's own function,
    so the rules live in one place; the first refusal is the message.
    """
    for name, read in SETTINGS.items():
        try:
            read()
        except (ValueError, OverflowError) as exc:
            text = _first_line(exc)
            if name not in text:
                text = f"{name}: {text}"
            raise CLIError(shown(text)) from None


def environment_line() -> str | None:
    """``info``'s line of the polyattn environment variables set, ``None`` when none is."""
    found = [f"{name}={shown(os.environ[name])}" for name in VARIABLES if name in os.environ]
    return f"polyattn variables: {' '.join(found)}" if found else None
