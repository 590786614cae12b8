"""Sphinx configuration: `make docs` builds the site into docs/_build/html.

The API reference is generated from the docstrings, but Debian's Sphinx runs
on Debian's Python, which cannot import the torchshm built for the pip stack:
`scripts/api_dump.py` (run by `make docs` in .venv) writes every public
name's signature and docstring to a JSON file, and `_ext/torchshm_docs.py`
renders it (Note [API from JSON] there).
"""

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "torchshm"
author = "the torchshm authors"
copyright = "2026, the torchshm authors"
extensions = ["myst_parser", "sphinx.ext.napoleon", "torchshm_docs"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# figures/reference-run.md is not a page of its own: the site shows it in
# benchmarks.md, where that page links to it (INCLUDED_LINKS, _ext/torchshm_docs.py).
exclude_patterns = ["_build", "figures/reference-run.md"]
# Markdown headings get anchors that pages can link to (`page.md#anchor`).
myst_heading_anchors = 3
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
default_role = "code"
html_theme = "sphinx_rtd_theme"
html_title = "torchshm"
html_static_path = ["_static"]
html_theme_options = {"navigation_depth": 3}

# Where scripts/api_dump.py wrote the public names (the Makefile passes it).
torchshm_api_json = os.environ.get(
    "TORCHSHM_API_JSON", str(DOCS / "_build" / "api.json")
)
# The tree the Notes index is read from.
torchshm_source_root = str(DOCS.parent)
html_css_files = ["torchshm.css"]
