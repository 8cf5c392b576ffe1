"""``.. runblock::`` — run a Python snippet while the docs build and show its output.

The code and whatever it prints are rendered one after the other, so every
number on a page comes from running the code on it. Blocks on one page share
a namespace, in order. An exception is reported as a Sphinx warning (an error
under ``-W``), with the traceback.

Options: ``:hide-output:`` runs the code but shows only the code.
"""

from __future__ import annotations

import contextlib
import io
import traceback
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

_NAMESPACES: dict[str, dict[str, Any]] = {}


class RunBlock(SphinxDirective):
    has_content = True
    option_spec: ClassVar[dict[str, Any]] = {"hide-output": directives.flag}

    def run(self) -> list[nodes.Node]:
        code = "\n".join(self.content)
        namespace = _NAMESPACES.setdefault(self.env.docname, {"__name__": "__main__"})
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                exec(compile(code, f"<{self.env.docname} runblock>", "exec"), namespace)
        except Exception:
            message = f"runblock failed:\n{code}\n\n{traceback.format_exc()}"
            return [self.state.document.reporter.warning(message, line=self.lineno)]
        source = nodes.literal_block(code, code, language="python")
        source["classes"].append("runblock-source")
        result: list[nodes.Node] = [source]
        output = buffer.getvalue().rstrip("\n")
        if output and "hide-output" not in self.options:
            out = nodes.literal_block(output, output, language="none")
            out["classes"].append("runblock-output")
            result.append(out)
        return result


def _reset(app: Any, env: Any, docname: str) -> None:
    """Start every page with a fresh namespace (also when a page is re-read)."""
    _NAMESPACES.pop(docname, None)


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("runblock", RunBlock)
    app.connect("env-purge-doc", _reset)
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": True}
