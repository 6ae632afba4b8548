"""gradscope/report/keras_text.py: how the Keras wing's text report names what it shows."""

from __future__ import annotations

import io

from rich.console import Console

from gradscope.report.keras_text import flow_lines
from gradscope.report.models import KerasFlowSection, KerasFlowSequence


def test_a_qualified_state_is_named_with_its_qualifier_outside_the_norm_bars():
    flow = KerasFlowSection(method="m", flags=[], not_analysed=[], sequences=[
        KerasFlowSequence(what="∂L/∂rnn/states[1]_t (as step t+1 reads it)", kind="state",
                          source="rnn", norms=[1.0, 2.0, 3.0])])
    console = Console(width=120, record=True, color_system=None, file=io.StringIO())
    for part in flow_lines(flow, 120):
        console.print(part)
    text = console.export_text()
    assert "‖∂L/∂rnn/states[1]_t‖ (as step t+1 reads it)" in text
