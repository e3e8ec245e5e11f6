"""Sphinx configuration of the torch-opaque documentation (Markdown pages, myst-parser).

Built by ``scripts/dev.sh docs`` into build/docs and, with warnings as errors,
by tests/test_docs.py.
"""

project = "torch-opaque"
author = "torch-opaque contributors"
copyright = "2026, torch-opaque contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# `page.md#a-heading` links are checked against the headings of the pages.
myst_heading_anchors = 3

# The API reference documents the installed package (tests and dev.sh install it
# editable); what its docstrings say is checked by their doctests.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False}

html_theme = "furo"
html_title = "torch-opaque"
