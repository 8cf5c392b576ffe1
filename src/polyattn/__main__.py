"""``python -m polyattn``: see :mod:`polyattn.cli`."""

from .cli import main

raise SystemExit(main(prog="python -m polyattn"))
