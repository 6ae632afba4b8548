"""Render reports (and errors) as exactly one JSON document."""

from __future__ import annotations

import json
from typing import Any

from gradscope.report.models import (
    CheckReport,
    ExplainReport,
    FlowHistoryReport,
    KerasCheckReport,
    KerasExplainReport,
    KerasShapesReport,
    LayerCheckReport,
    ShapesReport,
    SpecInference,
)


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def render_report(report: ExplainReport | ShapesReport | CheckReport | KerasExplainReport
                  | KerasShapesReport | KerasCheckReport | LayerCheckReport
                  | SpecInference | FlowHistoryReport) -> str:
    return dumps(report.to_dict())


def render_error(message: str, where: str | None) -> str:
    return dumps({"error": {"message": message, "where": where}})
