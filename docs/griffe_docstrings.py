"""A griffe extension for the site's API reference (mkdocs.yml): reads this project's docstrings as written.

The docstrings follow the house style (STYLE.md): Google sections, an ``Example::`` block that runs as a doctest,
Sphinx roles (``:class:`X```) and a ``.. warning::`` directive where torch would put one. Griffe's Google parser
knows none of the last three, so before parsing this turns ``Example::`` into an ``Examples:`` section, a
``.. warning::`` block into a ``Warning:`` admonition and a role into a code span. The source stays as it is.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_RULES = (
    (re.compile(r"^(\s*)Examples?::\s*$", re.M), r"\1Examples:"),
    (re.compile(r"^(\s*)\.\. (warning|note)::\s*$", re.M), lambda m: f"{m[1]}{m[2].capitalize()}:"),
    (re.compile(r":(?:class|attr|meth|func|mod|data|exc|obj):`~?([^`]+)`"), r"``\1``"),
)


class HouseDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        value = obj.docstring.value
        for pattern, replacement in _RULES:
            value = pattern.sub(replacement, value)
        obj.docstring.value = value
