"""Reports in a notebook: the terminal renderer, recorded by rich and exported as HTML.

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


DRAWERS["html"] = report_html
