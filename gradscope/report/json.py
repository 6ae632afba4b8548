"""Render reports (and errors) as exactly one JSON document."""

from __future__ import annotations

from gradscope.report.models import Report, SpecInference, json_text


def render_report(report: Report | SpecInference) -> str:
    return json_text(report.to_dict())


def render_error(message: str, where: str | None) -> str:
    return json_text({"error": {"message": message, "where": where}})
