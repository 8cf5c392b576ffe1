"""``python -m polyattn``: see :mod:`polyattn.cli`."""

from polyattn.cli import main

raise SystemExit(main(prog="python -m polyattn"))
