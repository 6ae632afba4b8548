"""Every report type is held to its renderer and its JSON schema (as pip-audit tests that every
output format has a renderer): a new report that forgets one fails here, not in a user's
terminal."""

from __future__ import annotations

import io
import json

import jsonschema
import pytest
from rich.console import Console

import gradscope
from gradscope.report import models
from gradscope.report.render import RENDERERS, print_report

SPEC = {"input_size": 3, "time_steps": 6, "batch_size": 2,
        "layers": [{"gru": 4}, {"lstm": 3}, {"dense": 2}]}


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found | {sub for child in found for sub in _subclasses(child)}


#: The reports a user holds in Python (they draw themselves in a notebook); the private
#: classes are the fields several reports share.
DISPLAYED = sorted((cls for cls in _subclasses(models._Displayed)
                    if not cls.__name__.startswith("_")), key=lambda cls: cls.__name__)


@pytest.mark.parametrize("report_type", DISPLAYED, ids=lambda cls: cls.__name__)
def test_every_report_a_user_holds_has_a_text_renderer_and_a_schema(report_type):
    assert report_type in RENDERERS, f"{report_type.__name__} has no text renderer"
    commands = [name for name, cls in models.REPORTS.items() if cls is report_type]
    assert commands, f"{report_type.__name__} has no `gradscope schema` entry"
    schema = models.json_schema(commands[0])
    assert "command" in schema["properties"]


def test_every_renderer_and_schema_belongs_to_a_report():
    assert set(RENDERERS) <= set(models.REPORTS.values())
    for name, cls in models.REPORTS.items():
        # `gradscope schema check-keras` is the schema of a document whose command is check.
        assert cls.model_fields["command"].default == name.split("-")[0]


@pytest.fixture(scope="module")
def reports(tf):
    explained = gradscope.explain(SPEC, flow=True, chunks=2)
    return {
        "shapes": gradscope.shapes(SPEC),
        "explain": explained,
        "check": gradscope.check(SPEC, chunks=2),
        "diff": gradscope.diff(explained, explained),
    }


@pytest.mark.parametrize("command", ["shapes", "explain", "check", "diff"])
def test_a_real_report_renders_in_80_columns_and_follows_its_schema(reports, command):
    report = reports[command]
    console = Console(width=80, record=True, file=io.StringIO())
    print_report(console, report)
    text = console.export_text()
    assert text.strip() and max(len(line) for line in text.splitlines()) <= 80
    document = json.loads(report.to_json())
    jsonschema.validate(document, models.json_schema(command))
    assert type(report).model_validate(document) == report
    assert "<pre" in report._repr_html_()
