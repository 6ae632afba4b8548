"""Reports in a notebook, and printed in a script: the terminal renderer, recorded by rich and
exported as HTML, or as plain text for ``print(report)``.

The HTML is the same text the terminal shows (tables, formulas, flags, colours), drawn at
:data:`NOTEBOOK_WIDTH` columns, as a ``<pre>`` block with inline styles: Jupyter shows it as it
is, with no stylesheet and no JavaScript.
"""

from __future__ import annotations

import io
from typing import Any

from gradscope.report.models import DRAWERS
from gradscope.report.render import print_report

#: Columns of the notebook rendering: a Jupyter cell shows about 100 monospace columns.
NOTEBOOK_WIDTH = 100

#: rich's own Jupyter format (rich.jupyter): a preformatted block that scrolls sideways.
HTML_FORMAT = ('<pre style="white-space:pre;overflow-x:auto;line-height:normal;'
               "font-family:Menlo,'DejaVu Sans Mono',consolas,'Courier New',monospace\">"
               "{code}</pre>\n")


def recording_console(width: int = NOTEBOOK_WIDTH) -> Any:
    from rich.console import Console

    return Console(record=True, file=io.StringIO(), width=width, force_terminal=True,
                   color_system="truecolor", highlight=False, force_jupyter=False)


def report_html(report: Any, width: int = NOTEBOOK_WIDTH) -> str:
    """``report`` drawn by the terminal renderer, as an HTML fragment."""
    console = recording_console(width)
    print_report(console, report)
    return str(console.export_html(inline_styles=True, code_format=HTML_FORMAT))


def report_text(report: Any, width: int | None = None) -> str:
    """``report`` as the terminal shows it, plain text (no colour) at ``width`` columns (the
    terminal's, else 80): what ``print(report)`` prints in a script."""
    import shutil

    from rich.console import Console

    columns = width or shutil.get_terminal_size((80, 24)).columns
    console = Console(record=True, file=io.StringIO(), width=columns, force_terminal=False,
                      color_system=None, highlight=False, force_jupyter=False)
    print_report(console, report)
    return console.export_text().rstrip("\n")


DRAWERS["html"] = report_html
DRAWERS["text"] = report_text
