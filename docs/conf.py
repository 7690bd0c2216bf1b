"""Sphinx configuration for the celery-redlock documentation.

Build with ``.ci/docs`` (warnings are errors). Nothing here talks to the network:
intersphinx is deliberately off.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.directives.code import LiteralInclude

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# autodoc imports the package from this checkout, installed or not.
sys.path.insert(0, str(ROOT))

from celery_redlock import __version__  # noqa: E402 - needs the sys.path entry above

project = "celery-redlock"
author = "celery-redlock contributors"
copyright = "celery-redlock contributors"  # noqa: A001 - the name Sphinx reads
release = __version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]

# docs/benchmarks/*.txt are data for literalinclude, not pages.
exclude_patterns = ["_build", "benchmarks"]
nitpicky = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"

try:
    import furo  # noqa: F401 - only probing whether the theme is installed
except ImportError:
    html_theme = "alabaster"
else:
    html_theme = "furo"
html_title = f"celery-redlock {release}"


class OptionalLiteralInclude(LiteralInclude):
    """``literalinclude``, or a sentence saying how to produce the file when it is missing.

    The benchmark tables in ``docs/benchmarks/`` are written by
    ``python -m benchmarks <name> --save``; a checkout without them still builds
    without warnings.
    """

    def run(self) -> list[nodes.Node]:
        _, path = self.env.relfn2path(self.arguments[0], self.env.docname)
        if Path(path).exists():
            return list(super().run())
        self.env.note_dependency(path)
        name = Path(path).stem
        text = (
            f"Not saved in this checkout yet: ``python -m benchmarks {name} --save`` "
            f"prints this table and writes it to ``docs/benchmarks/{name}.txt``."
        )
        container = nodes.container()
        self.state.nested_parse(StringList([text], source=path), self.content_offset, container)
        return list(container.children)


def _no_exception_rtype(app: Any, objtype: str, name: str, *_: Any) -> None:
    """Drop the "Return type: None" that autodoc derives from an exception's ``__init__``.

    autodoc suppresses it for classes but not for exceptions; runs after autodoc
    recorded the annotations (priority 600 > its 500).
    """
    if objtype != "exception":
        return
    document = getattr(app.env, "current_document", None)
    recorded = getattr(document, "autodoc_annotations", None)
    if recorded is None:  # Sphinx before 8.2 kept them in temp_data
        recorded = app.env.temp_data.get("annotations", {})
    recorded.get(name, {}).pop("return", None)


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("optional-literalinclude", OptionalLiteralInclude)
    app.connect("autodoc-process-signature", _no_exception_rtype, priority=600)
    return {"parallel_read_safe": True}
