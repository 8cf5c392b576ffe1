"""The argument parser: one-line usage errors, negative numbers, the subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from polyattn import __version__
from polyattn.cli.bench import MAX_REPEAT
from polyattn.cli.demo import BACKENDS, MINILM_HEADS, MINILM_LAYERS
from polyattn.cli.generate import GENERATE_BACKENDS, MIN_TEMPERATURE
from polyattn.cli.text import integer


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
    warmup = sub.add_parser("warmup", help="compile the numba_cpu kernel now, so that the "
                                           "first call does not wait for it (needs "
                                           "polyattn[numba])")
    warmup.add_argument("--dtype", choices=("float32", "float64"),
                        help="the kernels of this dtype only (each dtype's take as long "
                             "to compile; default: both)")
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
    gen = sub.add_parser("generate", help="continue a prompt with SmolLM2-135M-Instruct, or "
                                          "with a transformers checkpoint (--model)")
    gen.add_argument("prompt", help='the text to continue, e.g. "The capital of France is"')
    gen.add_argument("--max-new-tokens", type=integer, default=32,
                     help="tokens to produce, at most (default 32); the prompt and "
                          "these must fit in the model's context (8192 tokens for SmolLM2; "
                          "with --model, the checkpoint's max_position_embeddings)")
    gen.add_argument("--backend", choices=GENERATE_BACKENDS, default="numpy")
    gen.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                     help="the dtype the weights are cast to and computed in (default "
                          "float32); bfloat16 and float16 are not offered here (from Python, "
                          "from_pretrained(dtype=...) takes them on torch and JAX)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help=f"0 (default): greedy; from {MIN_TEMPERATURE:g} up: sampled at "
                          "this temperature")
    gen.add_argument("--seed", type=integer,
                     help="seed of the sampling, a non-negative integer; only with "
                          "--temperature above 0 (greedy decoding ignores it)")
    gen.add_argument("--chat", action="store_true",
                     help="put the prompt in the chat template: the model answers it "
                          "(SmolLM2 only)")
    gen.add_argument("--model", metavar="PATH",
                     help="a transformers checkpoint folder (config.json, *.safetensors, "
                          "tokenizer.json) of a Llama, Qwen3, Gemma 2, Gemma 3 or gpt-oss "
                          "model; default: SmolLM2-135M-Instruct from its GGUF file")
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
