"""Which renderer draws which report: one table, and ``print_report``, which draws any report
on a rich console at its width."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console, RenderableType

from gradscope.report.diagnose_text import render_diagnose
from gradscope.report.diff_text import render_diff
from gradscope.report.history_text import render_history
from gradscope.report.keras_text import (
    render_keras_check,
    render_keras_explain,
    render_keras_shapes,
)
from gradscope.report.layout import Trimmed
from gradscope.report.models import (
    CheckReport,
    DiagnoseReport,
    DiffReport,
    ExplainReport,
    FlowHistoryReport,
    KerasCheckReport,
    KerasExplainReport,
    KerasShapesReport,
    LayerCheckReport,
    Report,
    ShapesReport,
)
from gradscope.report.yaml_text import (
    render_check,
    render_explain,
    render_layer_check,
    render_shapes,
)

#: Report type → its text renderer ``(report, width) → renderables``.
RENDERERS: dict[type, Callable[[Any, int], list[RenderableType]]] = {
    ShapesReport: render_shapes,
    ExplainReport: render_explain,
    CheckReport: render_check,
    LayerCheckReport: render_layer_check,
    KerasShapesReport: render_keras_shapes,
    KerasExplainReport: render_keras_explain,
    KerasCheckReport: render_keras_check,
    FlowHistoryReport: render_history,
    DiffReport: render_diff,
    DiagnoseReport: render_diagnose,
}


def print_report(console: Console, report: Report) -> None:
    """``report`` drawn on ``console`` at its width, no line ending in a space."""
    parts = RENDERERS[type(report)](report, console.width)
    for part in parts:
        console.print(Trimmed(part))
