"""Sphinx configuration for the polyattn documentation.

Two pieces of the site are written here, before Sphinx reads the sources:

* ``api/generated/``: one page per name in ``polyattn.__all__``, so a new
  public name appears in the reference without editing the docs;
* ``_generated/benchmarks.rst``: the newest tables and plots found in
  ``benchmarks/results/`` (or a note that there are none yet).

Both folders are build products and are not kept in version control.
"""

from __future__ import annotations

import inspect
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

import polyattn  # noqa: E402

project = "polyattn"
author = "The polyattn developers"
copyright = "the polyattn developers"
version = release = polyattn.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
    "matplotlib.sphinxext.plot_directive",
    "myst_parser",
    "runblock",
]

source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/*.md", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []
nitpicky = False

# -- HTML -------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"polyattn {release}"
html_static_path = ["_static"]
html_css_files = ["polyattn.css"]
html_show_sourcelink = False
html_theme_options = {
    "navigation_depth": 2,
    "header_links_before_dropdown": 8,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
# The top-level pages have no sub-pages: no left sidebar there; the API pages keep it.
html_sidebars = {
    name: [] for name in ("index", "getting_started", "tutorial", "backends", "semantics",
                          "minilm", "performance")
}

# -- autodoc / numpydoc -------------------------------------------------------
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autosummary_generate = False
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# -- matplotlib plot directive --------------------------------------------------
plot_include_source = True
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 110)]
plot_pre_code = "import numpy as np\nimport matplotlib.pyplot as plt\nimport polyattn\n"
plot_rcparams = {"figure.figsize": (6.4, 3.6), "figure.autolayout": True, "font.size": 10}
plot_apply_rcparams = True

# -- MyST (used only to include the benchmark tables, which are Markdown) -----
myst_enable_extensions: list[str] = []
suppress_warnings = ["myst.header"]


# -- generated pages -----------------------------------------------------------

def _write_if_changed(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def _public_names() -> list[str]:
    return sorted((n for n in polyattn.__all__ if not n.startswith("_")), key=str.lower)


def write_api_pages() -> None:
    """One reference page per public name, and the table that lists them."""
    out = DOCS / "api" / "generated"
    wanted = {}
    for name in _public_names():
        obj = getattr(polyattn, name)
        title = name
        if inspect.ismodule(obj):
            body = f".. automodule:: polyattn.{name}\n   :members:\n"
        elif inspect.isclass(obj):
            body = (f".. currentmodule:: polyattn\n\n.. autoclass:: {name}\n"
                    "   :members:\n   :special-members: __call__\n")
        else:
            body = f".. currentmodule:: polyattn\n\n.. autofunction:: {name}\n"
        wanted[f"polyattn.{name}.rst"] = f"{title}\n{'=' * len(title)}\n\n{body}"
    for stale in out.glob("*.rst") if out.exists() else []:
        if stale.name not in wanted:
            stale.unlink()
    for filename, text in wanted.items():
        _write_if_changed(out / filename, text)
    table = [".. currentmodule:: polyattn", "", ".. autosummary::", ""]
    table += [f"   {name}" for name in _public_names()]
    toctree = ["", ".. toctree::", "   :hidden:", ""]
    toctree += [f"   generated/polyattn.{name}" for name in _public_names()]
    _write_if_changed(DOCS / "api" / "_names.rst.inc", "\n".join(table + toctree) + "\n")


_MD_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_DATE = re.compile(r"[-_.]?\d{4}-?\d{2}-?\d{2}(?:[T_-]?\d{2}[-:]?\d{2}(?:[-:]?\d{2})?)?")


def _newest(files: list[Path]) -> list[Path]:
    """Of files that differ only by a date stamp in their name, keep the newest."""
    latest: dict[str, Path] = {}
    for f in sorted(files):  # ISO-like stamps sort by time
        latest[_DATE.sub("", f.stem)] = f
    return sorted(latest.values())


def write_benchmark_fragment() -> None:
    """Copy the newest benchmark tables and plots next to the docs and list them."""
    results = ROOT / "benchmarks" / "results"
    out = DOCS / "_generated"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tables = _newest(list(results.glob("*.md"))) if results.is_dir() else []
    plots = _newest(list(results.glob("*.png"))) if results.is_dir() else []
    lines: list[str] = []
    if not tables and not plots:
        lines += [
            "No results yet: ``benchmarks/results/`` holds no tables or plots. Run the",
            "benchmarks (``python -m polyattn bench``) and rebuild the documentation to",
            "see them here.",
            "",
        ]
    for md in tables:
        title, body = md.stem.replace("_", " ").replace("-", " "), []
        seen_title = False
        for line in md.read_text(encoding="utf-8").splitlines():
            m = _MD_HEADING.match(line)
            if m and len(m.group(1)) == 1 and not seen_title:
                title, seen_title = m.group(2), True  # the file's title titles its section
                continue
            body.append(f"**{m.group(2)}**" if m else line)  # other headings: bold lines
        _write_if_changed(out / md.name, "\n".join(body) + "\n")
        lines += [title, "~" * (2 * len(title) + 3), "",
                  f".. include:: _generated/{md.name}", "   :parser: myst_parser.sphinx_", ""]
    if plots:
        lines += ["Plots", "~~~~~", ""]
        for png in plots:
            shutil.copyfile(png, out / png.name)
            caption = png.stem.replace("_", " ").replace("-", " ")
            lines += [f".. figure:: _generated/{png.name}", "   :width: 100%", "",
                      f"   ``{png.name}``: {caption}", ""]
    _write_if_changed(out / "benchmarks.rst.inc", "\n".join(lines) + "\n")


write_api_pages()
write_benchmark_fragment()
