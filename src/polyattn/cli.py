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
"""

from __future__ import annotations

import argparse
import decimal
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import time
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyattn import __version__

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
#: How to install each backend's library.
INSTALL = {
    # a plain `pip install torch` (or polyattn[torch]) fetches a CUDA build of several GB
    "torch": ("pip install torch --index-url https://download.pytorch.org/whl/cpu (the CPU "
              "build; a plain pip install torch, or 'polyattn[torch]', fetches a CUDA build of "
              "several GB)"),
    "jax": "pip install 'polyattn[jax]'",
    "dask": "pip install 'polyattn[dask]'",
    "cupy": "pip install 'polyattn[cuda]'",
    "array_api_strict": "pip install array-api-strict",
    "matplotlib": "pip install 'polyattn[plot]'",
}
#: all-MiniLM-L6-v2's layers and heads (``--model minilm``).
MINILM_LAYERS, MINILM_HEADS = 6, 12


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


def _version(distributions: Sequence[str]) -> str | None:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _installed(module: str) -> bool:
    """Whether a top-level module can be found (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _plural(n: int, noun: str) -> str:
    """``"1 token"``, ``"2 tokens"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class UsageError(Exception):
    """A mistake argparse found: ``prog`` (the command) and the one-line ``message``."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class ArgumentParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are one line, not the usage block.

    :meth:`error` raises :class:`UsageError`, which :func:`main` prints as
    ``"<prog>: error: <message>"`` with exit status 2; ``--help`` still prints
    the whole help. Subcommands' parsers are of this class too.
    """

    #: The subcommands' parsers by name (set by :func:`build_parser`).
    commands: Mapping[str, argparse.ArgumentParser]

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        raise UsageError(self.prog, " ".join(message.split()))


#: The largest magnitude :func:`integer` accepts (a 64-bit seed fits).
MAX_INTEGER = 2 ** 64 - 1


def _clip(text: str, width: int = 40) -> str:
    """``text`` in quotes, cut in the middle when longer than ``width`` characters."""
    if len(text) > width:
        text = f"{text[:width // 2]}…{text[-width // 4:]}"
    return f"'{shown(text)}'"


def integer(text: str) -> int:
    """An option's integer: ``"32"``, or a whole number in exponent notation (``"1e3"``).

    Raises
    ------
    argparse.ArgumentTypeError
        For anything else (``"1.5"``, ``"nan"``, ``"inf"``, ``""``), and beyond
        ±(2^64 - 1); argparse names the option.
    """
    try:
        value = decimal.Decimal(int(text))
    except ValueError:
        try:
            value = decimal.Decimal(text.strip())
        except decimal.InvalidOperation:
            value = decimal.Decimal("nan")
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a whole number such as 32; got "
                                         f"{_clip(text)}")
    if value.adjusted() > 20 or abs(value) > MAX_INTEGER:
        raise argparse.ArgumentTypeError(f"{_clip(text)} is too large (at most 2^64 - 1)")
    return int(value)


def check_utf8(text: str, what: str) -> None:
    """Raise :class:`CLIError` naming ``what`` if ``text`` cannot be encoded as UTF-8.

    Bytes of the command line that are not UTF-8 reach Python as lone
    surrogates (U+DC80 to U+DCFF, "surrogateescape"); they are named as the
    bytes they stand for.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        found = (f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF
                 else f"the lone surrogate U+{code:04X}")
        raise CLIError(f"{what} is not valid UTF-8: character {exc.start} is {found}; give "
                       "the text in UTF-8 (is the terminal set to another encoding?)") from None


def shown(text: str) -> str:
    """``text`` safe to print anywhere: bytes that are not UTF-8 shown as ``\\xff``."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def format_bytes(n: int) -> str:
    """A byte count in decimal units, exact bytes beside it.

    Examples
    --------
    >>> format_bytes(4_608_230_400)
    '4.61 GB (4,608,230,400 bytes)'
    >>> format_bytes(512)
    '512 bytes'
    >>> format_bytes(46_080_000_000 * 10 ** 12)
    '46.1 ZB (46,080,000,000,000,000,000,000 bytes)'
    """
    if n < 1000:
        return _plural(n, "byte")
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"):
        value /= 1000.0
        if value < 999.5:           # 999.5 and up round to "1e+03" in three digits
            return f"{value:.3g} {unit} ({n:,} bytes)"
    return f"{float(n):.3g} bytes"   # beyond a thousand YB: no unit is shorter


def available_memory() -> int | None:
    """Bytes of memory available for new allocations; ``None`` where that cannot be told.

    Linux's ``MemAvailable`` (``/proc/meminfo``), else the free physical pages
    (``SC_AVPHYS_PAGES``), else all physical memory (``SC_PHYS_PAGES``).
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            count, size = os.sysconf(pages), os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            continue
        if count > 0 and size > 0:
            return count * size
    return None


def cupy_status() -> tuple[bool, str]:
    """Whether CuPy can run (installed, and a CUDA GPU found), and why not.

    Returns
    -------
    usable : bool
    reason : str
        What was found, or what is missing and how to get it.
    """
    if not _installed("cupy"):
        return False, ("CuPy is not installed; with an NVIDIA GPU, install it with "
                       f"{INSTALL['cupy']}")
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError, ImportError of the CUDA libraries, ...
        return False, f"CuPy is installed but cannot run: no usable CUDA GPU ({_first_line(exc)})"
    if count < 1:
        return False, "CuPy is installed but cannot run: no CUDA GPU found"
    return True, f"{count} CUDA GPU{'s' if count > 1 else ''}"


def simulator_enabled() -> bool:
    """Whether Numba's CUDA simulator is switched on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def cuda_status() -> tuple[bool, str]:
    """Whether the numba_cuda kernel can run here, and on what.

    On the CUDA simulator the verdict is :func:`polyattn.explain`'s for NumPy
    arrays, so ``info`` and ``explain()`` cannot disagree.

    Returns
    -------
    usable : bool
    reason : str
    """
    if _version(("numba-cuda",)) is None:
        return False, "numba-cuda is not installed (pip install 'polyattn[cuda]')"
    if simulator_enabled():
        from polyattn import explain

        x = np.zeros((1, 1, 1, 1))
        info = explain(x, x, x, implementation="auto")
        if info.kernel_available:
            return True, ("on the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): NumPy arrays, "
                          "on the CPU, slowly, with implementation='numba_cuda'; for testing")
        return False, ("NUMBA_ENABLE_CUDASIM=1, but the simulator cannot run it: "
                       f"{info.kernel_reason}")
    try:
        from numba import cuda

        if cuda.is_available():
            return True, f"GPU: {_device_name(cuda.get_current_device().name)}"
        return False, "no CUDA GPU or driver found"
    except Exception as exc:  # pragma: no cover - driver errors surface as many types
        return False, f"CUDA unavailable: {_first_line(exc)}"


def _device_name(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def _native_libraries() -> list[str]:
    """The installed libraries whose own attention ``implementation="native"`` runs."""
    if not _installed("polyattn.backends.native.fused"):
        return []
    return [label for module, label in (("torch", "torch"), ("jax", "JAX")) if _installed(module)]


def cmd_info(args: argparse.Namespace) -> int:
    """``info``: versions, libraries, the CUDA kernel, implementations."""
    print(f"polyattn {__version__}")
    print(f"python {sys.version.split()[0]} on {sys.platform}")
    print("array libraries:")
    for name, dists in LIBRARIES:
        version = _version(dists)
        note = ""
        if name == "cupy" and version is not None:
            usable, why = cupy_status()
            note = "" if usable else f" ({why})"
        print(f"  {name:<18} {version if version else 'not installed'}{note}")
    cuda_ok, why = cuda_status()
    if cuda_ok and simulator_enabled():
        print(f"CUDA kernel: runs {why}")
    else:
        print(f"CUDA kernel: {'usable' if cuda_ok else 'not usable'} ({why})")
    impls = ["reference", "chunked"]
    native = _native_libraries()
    if native:
        impls.append(f"native ({', '.join(native)})")
    if cuda_ok:
        impls.append("numba_cuda (simulator, NumPy arrays)" if simulator_enabled()
                     else "numba_cuda")
    usable, why = _numba_cpu_availability()
    if usable:
        impls.append("numba_cpu")
    print(f"implementations available: {', '.join(impls)}")
    if usable:
        from polyattn.backends.numba_cpu import launch as numba_cpu

        print(f"numba_cpu kernel: {numba_cpu.cache_state()}")
        print(f"numba_cpu tiles: {numba_cpu.tiles()}")
    else:
        print(f"numba_cpu kernel: not usable ({why})")
    print(f"CPUs: {cpu_summary()}")
    for line in blas_lines():
        print(line)
    variables = environment_line()
    if variables:
        print(variables)
    return 0


def cpu_summary() -> str:
    """The machine's CPUs, and how many of them this process may run on."""
    total = os.cpu_count()
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):        # not on macOS or Windows
        usable = None
    text = "unknown" if total is None else str(total)
    if usable is not None and usable != total:
        text += f" ({usable} usable by this process)"
    return text


#: Environment variables that set the thread count of the BLAS and OpenMP libraries.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "BLIS_NUM_THREADS")


def blas_lines() -> list[str]:
    """``info``'s lines on the BLAS (and OpenMP) libraries loaded, and their threads.

    Read with threadpoolctl when it is installed; never raises.
    """
    lines = []
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        lines.append("BLAS: threadpoolctl is not installed, so the BLAS library NumPy uses and "
                     "its threads cannot be shown; install it with pip install 'polyattn[fast]'")
    else:
        try:
            pools = threadpool_info()
        except Exception as exc:  # it inspects the process's shared libraries: be safe
            pools = None
            lines.append(f"BLAS: threadpoolctl could not inspect the libraries "
                         f"({_first_line(exc)})")
        if pools is not None:
            lines.append(f"BLAS and OpenMP libraries (threadpoolctl "
                         f"{_version(('threadpoolctl',))}):" if pools
                         else "BLAS and OpenMP libraries: none loaded (threadpoolctl found none)")
            lines.extend(f"  {_pool_line(pool)}" for pool in pools)
    variables = [f"{name}={os.environ[name]}" for name in THREAD_VARIABLES if name in os.environ]
    if variables:
        lines.append(f"thread variables: {' '.join(variables)}")
    return lines


def _pool_line(pool: dict[str, Any]) -> str:
    """One library of ``threadpoolctl.threadpool_info()``."""
    threads = pool.get("num_threads")
    parts = [f"{pool.get('user_api', '?')}: {pool.get('internal_api', '?')} "
             f"{pool.get('version') or '(version unknown)'}",
             _plural(threads, "thread") if isinstance(threads, int) else "threads unknown"]
    for key in ("threading_layer", "architecture"):
        if pool.get(key):
            parts.append(f"{key.replace('_', ' ')} {pool[key]}")
    if pool.get("filepath"):
        parts.append(str(pool["filepath"]))
    return ", ".join(parts)


# --- environment variables ---------------------------------------------------------------

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


def _numba_cpu_availability() -> tuple[bool, str]:
    from polyattn.backends.numba_cpu import launch as numba_cpu

    return numba_cpu.availability()


def cmd_warmup(args: argparse.Namespace) -> int:
    """``warmup``: compile the numba_cpu kernel now (or load it from Numba's cache)."""
    usable, why = _numba_cpu_availability()
    if not usable:
        raise CLIError(f"the numba_cpu kernel cannot be compiled: {why}")
    from polyattn.backends.numba_cpu import launch as numba_cpu

    try:
        what, seconds = numba_cpu.warmup()
    except numba_cpu.KernelUnavailable as exc:
        raise CLIError(str(exc)) from None
    done = ("loaded from Numba's cache" if what == "loaded" else "compiled")
    print(f"numba_cpu kernel {done} in {seconds:.1f} s (float32 and float64)")
    print(f"numba_cpu kernel: {numba_cpu.cache_state_on_disk()}")
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


def check_backend(name: str) -> None:
    """Raise :class:`CLIError` naming the fix if array library ``name`` cannot run here."""
    if name == "numpy":
        return
    if name == "cupy":
        usable, why = cupy_status()
        if not usable:
            raise CLIError(f"--backend cupy: {why}")
        return
    if not _installed(name):
        raise CLIError(f"--backend {name}: {name} is not installed; install it with "
                       f"{INSTALL[name]}")


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


# --- bench ---------------------------------------------------------------------------------

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
    need, free = naive_bytes(shape, args.dtype), available_memory()
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


#: Array libraries ``generate`` runs on.
GENERATE_BACKENDS = ("numpy", "torch", "jax", "cupy")
#: The lowest ``--temperature`` above 0 that ``generate`` takes.
MIN_TEMPERATURE = 1e-3


def cache_bytes(config: Any, tokens: int, dtype: str) -> int:
    """Bytes of the keys and values of ``tokens`` tokens of one sequence, every layer.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    >>> cache_bytes(smollm2, 100_005, "float32")      # 2 · 30 · 3 · 64 · 4 bytes a token
    4608230400
    """
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * tokens * np.dtype(dtype).itemsize


def _cache_bytes(model: Any, tokens: int, args: argparse.Namespace) -> int:
    """The model's own ``cache_nbytes(1, tokens)`` where it has one, else :func:`cache_bytes`."""
    nbytes = getattr(model, "cache_nbytes", None)
    if callable(nbytes):
        try:
            return int(nbytes(1, tokens))
        except (TypeError, ValueError):
            pass
    return cache_bytes(model.config, tokens, args.dtype)


def check_context(model: Any, prompt_tokens: int, args: argparse.Namespace) -> None:
    """Raise :class:`CLIError` if the prompt and ``--max-new-tokens`` overflow the context.

    The limit is the model's ``config.context_length`` (a model without one
    is not checked); the message says what the cache would take.
    """
    config = getattr(model, "config", None)
    limit = getattr(config, "context_length", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        return
    new = args.max_new_tokens
    total = prompt_tokens + new
    if total <= limit:
        return
    try:
        memory = f"; their cache would take {format_bytes(_cache_bytes(model, total, args))}"
    except (AttributeError, TypeError, ValueError):
        memory = ""
    if prompt_tokens >= limit:
        raise CLIError(f"the prompt is {_plural(prompt_tokens, 'token')}, which leaves no room "
                       f"in the model's context of {limit:,} tokens for --max-new-tokens {new}"
                       f" ({total:,} tokens{memory}); shorten the prompt to fewer than "
                       f"{limit:,} tokens")
    raise CLIError(f"--max-new-tokens {new} and the prompt's "
                   f"{_plural(prompt_tokens, 'token')} make {total:,} tokens, more than the "
                   f"model's context of {limit:,} tokens{memory}; give --max-new-tokens "
                   f"{limit - prompt_tokens} or less")


def check_memory(model: Any, prompt_tokens: int, args: argparse.Namespace) -> None:
    """Raise :class:`CLIError` if the cache of the prompt and ``--max-new-tokens`` would not
    fit in the memory available (:func:`available_memory`; not checked where that cannot
    be told, or for ``--backend cupy``, whose cache is on the GPU).

    The cache grows by the same bytes each token, so the message says how many
    new tokens do fit.
    """
    if args.backend == "cupy":
        return
    free = available_memory()
    if free is None:
        return
    total = prompt_tokens + args.max_new_tokens
    try:
        need, per_token = _cache_bytes(model, total, args), _cache_bytes(model, 1, args)
    except (AttributeError, TypeError, ValueError):
        return                      # a model that cannot say: MemoryError is the fallback
    if need <= free:
        return
    what = (f"--max-new-tokens {args.max_new_tokens} and the prompt's "
            f"{_plural(prompt_tokens, 'token')} make {total:,} tokens, whose cache would take "
            f"{format_bytes(need)} in {args.dtype}, but {format_bytes(free)} of memory is "
            f"available")
    fits = free // max(per_token, 1) - prompt_tokens
    if fits < 1:
        raise CLIError(f"{what}; not even one new token fits: free some memory or shorten the "
                       f"prompt")
    raise CLIError(f"{what}; give --max-new-tokens {fits} or less")


def check_generate_args(args: argparse.Namespace) -> None:
    """Every check on ``generate``'s arguments that can fail before the model is read.

    Raises
    ------
    CLIError
        With one line naming the argument and the fix.
    """
    check_utf8(args.prompt, "the prompt")
    if not args.prompt.strip():
        raise CLIError("the prompt is empty; give some text, e.g. "
                       "polyattn generate \"The capital of France is\"")
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
    if not 0.0 <= args.temperature < float("inf"):
        raise CLIError(f"--temperature must be a finite number >= 0 (0: greedy); got "
                       f"{args.temperature}")
    if 0.0 < args.temperature < MIN_TEMPERATURE:
        raise CLIError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}; "
                       f"got {args.temperature} (sampling that cold is greedy decoding in all "
                       "but name, and its scaled logits can overflow: give 0)")
    if args.seed is not None and args.seed < 0:
        raise CLIError(f"--seed must be a non-negative integer; got {args.seed}")
    check_backend(args.backend)
    from polyattn.models import smollm2

    try:
        smollm2.check_requirements()
    except (ImportError, FileNotFoundError) as exc:
        raise CLIError(_first_line(exc)) from exc


def cmd_generate(args: argparse.Namespace) -> int:
    """``generate``: SmolLM2-135M-Instruct continues a prompt, streamed token by token."""
    import codecs

    check_generate_args(args)
    from polyattn.models import smollm2

    start = time.perf_counter()
    try:
        model = smollm2.load(xp=args.backend, dtype=args.dtype)
    except ImportError as exc:
        raise CLIError(f"--backend {args.backend}: {_first_line(exc)}") from exc
    except ValueError as exc:       # not a GGUF file, or not of a Llama model
        raise CLIError(_first_line(exc)) from exc
    except OSError as exc:          # unreadable: permissions, a device, ...
        raise CLIError(f"cannot read the model file: {_first_line(exc)}") from exc
    loaded = time.perf_counter()
    tok = model.tokenizer
    text = smollm2.chat_prompt(args.prompt) if args.chat else args.prompt
    try:
        ids = tok.encode(text)
    except ValueError as exc:
        raise CLIError(f"the prompt cannot be tokenized: {_first_line(exc)}") from exc
    if not len(ids):
        raise CLIError(f"the prompt {args.prompt!r} gives no tokens (the vocabulary has none of "
                       "its characters); give other text")
    check_context(model, len(ids), args)
    check_memory(model, len(ids), args)
    if args.seed is not None and args.temperature == 0.0:
        print("note: --seed has no effect without --temperature above 0 (greedy decoding "
              "draws nothing)", file=sys.stderr)
    # The prompt is printed with the first token, so that an argument the model
    # refuses (or memory it cannot get) is told before anything is on stdout.
    echo = "" if args.chat else args.prompt
    # A character's UTF-8 bytes may span tokens: the decoder holds back an
    # incomplete one until its last byte comes, and one still incomplete when
    # generation stops (cut by --max-new-tokens) is left out, not shown as U+FFFD.
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    special = set(tok.special)
    count = 0
    first = end = loaded
    try:
        for token in model.stream(ids, args.max_new_tokens, temperature=args.temperature,
                                  seed=args.seed):
            count += 1
            if count == 1:
                first = time.perf_counter()
                print(echo, end="", flush=True)
            if tok.tokens[token] not in special:
                print(utf8.decode(tok.token_bytes(token)), end="", flush=True)
    except KeyboardInterrupt:
        if count:
            print(flush=True)       # end the text's line; the exit status says it was cut
        return 130
    except MemoryError as exc:
        if count:
            print(flush=True)       # end the text's line
        where = f"after {_plural(count, 'token')}" if count else "before the first token"
        raise CLIError(f"out of memory {where} ({_first_line(exc)}); give a smaller "
                       "--max-new-tokens or a shorter prompt, or free some memory") from None
    except ValueError as exc:
        if count:                   # not an argument the model refused: a failure midway
            raise
        raise CLIError(_first_line(exc)) from exc
    end = time.perf_counter()
    if not count:
        print(echo, end="")
    print()
    print(timing_line(count, len(ids), (start, loaded, first, end), args), file=sys.stderr)
    return 0


def timing_line(count: int, prompt_tokens: int, times: tuple[float, float, float, float],
                args: argparse.Namespace) -> str:
    """``generate``'s last line (on stderr): the tokens, the time, the speed.

    ``times`` are the clock's readings when the model began to be read, was
    read, gave its first token and its last. The decoding speed is of the
    tokens after the first (the first one's time is the prompt's), so it is
    left out for a single token.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(backend="numpy", dtype="float32")
    >>> timing_line(11, 3, (0.0, 1.0, 1.25, 2.25), args)  # doctest: +ELLIPSIS
    '11 tokens in 1.25 s: prompt of 3 tokens 250 ms, then 10.0 tokens/s (numpy, float32; ...'
    >>> timing_line(1, 3, (0.0, 1.0, 1.25, 1.25), args)
    '1 token in 0.25 s: prompt of 3 tokens 250 ms (numpy, float32; model read in 1.0 s)'
    """
    start, loaded, first, end = times
    text = f"{_plural(count, 'token')} in {end - loaded:.2f} s"
    if count:
        text += f": prompt of {_plural(prompt_tokens, 'token')} {(first - loaded) * 1e3:.0f} ms"
    if count > 1 and end > first:
        text += f", then {(count - 1) / (end - first):.1f} tokens/s"
    return f"{text} ({args.backend}, {args.dtype}; model read in {loaded - start:.1f} s)"


#: The subcommands, in the order of the help.
COMMANDS = ("info", "warmup", "demo", "bench", "generate")


def build_parser(prog: str | None = None) -> ArgumentParser:
    """The argument parser; ``prog`` is the command name shown in messages."""
    parser = ArgumentParser(prog=prog or "polyattn",
                            description="Transformer attention for any array library.")
    parser.add_argument("--version", action="version", version=f"polyattn {__version__}")
    # not required=True: argparse would then report a missing command before an
    # unknown option; main() checks both, the unknown option first
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    parser.commands = sub.choices
    sub.add_parser("info", help="versions, array libraries found, CUDA availability, CPUs, "
                                "BLAS libraries and their threads")
    sub.add_parser("warmup", help="compile the numba_cpu kernel now, so that the first call "
                                  "does not wait for it (needs polyattn[numba])")
    demo = sub.add_parser("demo", help='self-attention on "这 部 电影 很 好看", step by step')
    demo.add_argument("--backend", choices=BACKENDS, default="numpy")
    demo.add_argument("--save-png", metavar="PATH", help="also write a heatmap (matplotlib)")
    demo.add_argument("--model", choices=("toy", "minilm"), default="toy",
                      help="'minilm': a real sentence encoder's weights (see README)")
    demo.add_argument("--sentence", help="sentence for --model minilm")
    demo.add_argument("--layer", type=integer,
                      help=f"layer for --model minilm (0-{MINILM_LAYERS - 1}, default 3)")
    demo.add_argument("--head", type=integer,
                      help=f"head for --model minilm (0-{MINILM_HEADS - 1}, default 1)")
    bench = sub.add_parser("bench", help="quick timing: polyattn vs the naive formula")
    bench.add_argument("--shape", default="1,8,1024,64",
                       help="B,H,T,E (default 1,8,1024,64); refused when the naive formula's "
                            "q, k, v, output and T×T scores would not fit in the memory "
                            "available")
    bench.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    bench.add_argument("--causal", action="store_true")
    bench.add_argument("--repeat", type=integer, default=5,
                       help=f"timed runs of each (default 5, at most {MAX_REPEAT:,})")
    gen = sub.add_parser("generate", help="continue a prompt with SmolLM2-135M-Instruct "
                                          "(a real language model; see the docs)")
    gen.add_argument("prompt", help='the text to continue, e.g. "The capital of France is"')
    gen.add_argument("--max-new-tokens", type=integer, default=32,
                     help="tokens to produce, at most (default 32); the prompt and "
                          "these must fit in the model's context (8192 tokens for SmolLM2)")
    gen.add_argument("--backend", choices=GENERATE_BACKENDS, default="numpy")
    gen.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help=f"0 (default): greedy; from {MIN_TEMPERATURE:g} up: sampled at "
                          "this temperature")
    gen.add_argument("--seed", type=integer,
                     help="seed of the sampling, a non-negative integer; only with "
                          "--temperature above 0 (greedy decoding ignores it)")
    gen.add_argument("--chat", action="store_true",
                     help="put the prompt in the chat template: the model answers it")
    return parser


#: Options that take a number (or ``--shape``'s numbers).
NUMBER_OPTIONS = frozenset({"--shape", "--repeat", "--max-new-tokens", "--seed",
                            "--temperature", "--layer", "--head"})


def _attach_negative_values(argv: Sequence[str] | None) -> list[str] | None:
    """``argv`` with ``--option -1,2`` written ``--option=-1,2`` for :data:`NUMBER_OPTIONS`.

    argparse takes a value that starts with ``-`` for an option unless it is a
    plain negative number (``-5``), so ``--shape -1,1,16,16`` or ``--seed -1e3``
    would be "expected one argument"; attached, they reach the check that
    says what is wrong with them. Nothing after ``--`` is touched.

    Examples
    --------
    >>> _attach_negative_values(["bench", "--shape", "-1,1,16,16", "--causal"])
    ['bench', '--shape=-1,1,16,16', '--causal']
    """
    if argv is None:
        argv = sys.argv[1:]
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            out.append(word)
            out.extend(words)
            break
        if word in NUMBER_OPTIONS:
            value = next(words, None)
            if value is not None and value[:1] == "-" and value[1:2] in set("0123456789."):
                out.append(f"{word}={value}")
                continue
            out.append(word)
            if value is not None:
                out.append(value)
            continue
        out.append(word)
    return out


def parse_args(parser: ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, an unknown option reported before a missing command.

    Raises
    ------
    UsageError
        Unknown arguments (named by the subcommand's parser when there is
        one), a missing command, or whatever argparse refuses.
    """
    args, extras = parser.parse_known_args(_attach_negative_values(argv))
    if extras:
        culprit = parser.commands.get(args.command, parser) if args.command else parser
        culprit.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command is None:
        parser.error(f"give a command: {', '.join(COMMANDS[:-1])} or {COMMANDS[-1]} "
                     f"({parser.prog} --help says what each does)")
    return args


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
