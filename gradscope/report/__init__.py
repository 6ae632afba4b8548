"""Report objects and their renderers."""

from gradscope.report.models import ExplainReport, ShapesReport, json_schema

__all__ = ["ExplainReport", "ShapesReport", "json_schema"]
