"""Text reports at every console width from 60 to 160 columns: no line is wider than the
console or ends in a space, and no number, name or word is split across lines or cut off.

The reports are real (computed once from TensorFlow runs: the seed model, and small models that
bring every witness, a failing check, truncated BPTT, LSTM and SimpleRNN layers). The truth a
rendering is held to comes from the report's own data: every number the report holds is
formatted as the renderer formats it, and each such token must occur as often at width W as on
a console too wide to wrap anything.
"""

from __future__ import annotations

import re

import pytest
from conftest import REPO, render_text
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rich.cells import cell_len

from gradscope.formats import number, percent, shape_text
from gradscope.report.models import (
    CheckReport,
    ExplainReport,
    KerasExplainReport,
    KerasShapesReport,
    ShapesReport,
)
from gradscope.yaml.check.block_kernel import CORRECTED_EQUATIONS

#: Wide enough that nothing wraps: the reference rendering.
UNWRAPPED = 1000

#: What a number cut after its exponent sign looks like: 4.8e- or 4.8e-0.
CUT_NUMBER = re.compile(r"\d\.\d+e(?:[-+]\d?)?$")


def _words(text: str) -> list[str]:
    return [word for word in text.split() if len(word) >= 3]


def protected(report: ExplainReport | CheckReport | ShapesReport) -> tuple[set[str], set[str]]:
    """(tokens, shapes): the numbers and names ``report`` holds, as the text renders them.
    Tokens hold no spaces and may never be split; shapes may wrap only inside free text, so
    each must appear whole at least once."""
    tokens: set[str] = set()
    shapes: set[str] = set()
    if isinstance(report, ShapesReport):
        for entry in [*report.tensors, *report.initial_states]:
            tokens.update(_words(f"{entry.name} {entry.alias}"))
            shapes.add(shape_text(entry.shape))
    elif isinstance(report, ExplainReport):
        for gradient in report.gradients:
            tokens.update(_words(f"{gradient.name} {gradient.alias}"))
            stats = gradient.stats
            tokens.update(number(v) for v in (stats.l2, stats.mean_abs, stats.max_abs))
            shapes.add(shape_text(gradient.shape))
        for state in report.initial_state_gradients:
            tokens.update(_words(f"{state.name} {state.alias}"))
            norms = state.per_example_norm
            tokens.update(number(v) for v in (state.stats.l2, norms.min, norms.median, norms.max))
            shapes.add(shape_text(state.shape))
        for pair in report.carry.pairs:
            tokens.update([pair.y, f"∂L/∂{pair.grad_y}"])
        for weight in report.carry.weights or []:
            tokens.update([weight.name, percent(weight.carried_share)])
            tokens.update(number(v) for v in (weight.l2_full, weight.l2_truncated,
                                               weight.l2_carried))
        for product in report.carry.products or []:
            tokens.update([product.x, product.y, number(product.l2_grad_y),
                           number(product.l2_product)])
        for jacobian in report.state_jacobians or []:
            tokens.update(_words(f"{jacobian.target} {jacobian.source}"))
            tokens.update(number(v) for v in (
                jacobian.frobenius_median, jacobian.frobenius_min, jacobian.frobenius_max,
                jacobian.largest_singular_median, jacobian.smallest_singular_median))
        flow = report.gradient_flow
        if flow is not None:
            for norms in [*flow.state_gradient_norms.values(), flow.input_gradient_norms,
                          flow.influence]:
                tokens.update([number(norms[0]), number(norms[-1])])
    elif isinstance(report, KerasExplainReport | KerasShapesReport):
        weights = report.gradients if isinstance(report, KerasExplainReport) else report.weights
        for gradient in weights:
            tokens.update(_words(gradient.name))
            shapes.add(shape_text(gradient.shape))
            if gradient.stats is not None:
                stats = gradient.stats
                tokens.update(number(v) for v in (stats.l2, stats.mean_abs, stats.max_abs))
        for layer in report.layers:
            tokens.add(layer.name)
        if isinstance(report, KerasExplainReport):
            for state in report.initial_state_gradients:
                tokens.add(state.name)
                shapes.add(shape_text(state.shape))
                if state.stats is not None:
                    tokens.add(number(state.stats.l2))
    else:
        for tensor in report.tensors:
            tokens.update(_words(tensor.name))
            if tensor.shape:
                shapes.add(shape_text(tensor.shape))
            for entry in tensor.witnesses:
                if entry.error is not None:
                    tokens.add(f"{entry.error:.1e}")  # the table's verdicts
                    if not entry.passed:
                        tokens.add(f"{entry.error:.2e}")  # the failure lines
        carry = getattr(report, "carry", None)
        for boundary in (carry.boundaries if carry else []):
            for named in [*boundary.ys, *boundary.grad_ys]:
                tokens.add(named.name)
                if named.norm is not None:
                    tokens.add(number(named.norm))
    tokens.discard("n/a")
    return {t for t in tokens if len(t) >= 3}, shapes


def build_sample_keras_model():
    """The README's sample encoder–decoder, built by sample_configs/keras_encoder_decoder.py."""
    import importlib.util

    path = REPO / "sample_configs" / "keras_encoder_decoder.py"
    spec = importlib.util.spec_from_file_location("keras_encoder_decoder", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()


@pytest.fixture(scope="module")
def small_reports(tf, tmp_path_factory):
    from gradscope.keras.check import check as keras_check
    from gradscope.keras.explain import explain as keras_explain
    from gradscope.keras.explain import prepare as keras_prepare
    from gradscope.keras.shapes import keras_shapes
    from gradscope.yaml.check import check
    from gradscope.yaml.config import load_spec
    from gradscope.yaml.explain import explain
    from gradscope.yaml.shapes import shapes

    grus = load_spec({"input_size": 5, "time_steps": 6, "batch_size": 4,
                      "layers": [{"gru": 4}, {"gru": 3}, {"dense": 3}]})
    mixed = load_spec({"input_size": 5, "time_steps": 7, "batch_size": 3,
                       "layers": [{"lstm": 4, "layout": "keras"}, {"simple_rnn": 3},
                                  {"gru": 3, "layout": "keras"}, {"dense": 2}]})
    # A hand-written backward that forgets the carry: five witnesses, and failures to list.
    against = f"{REPO / 'tests' / 'against' / 'user_gru_bptt.py'}:no_carry"
    keras_model = tmp_path_factory.mktemp("keras") / "encoder_decoder.keras"
    build_sample_keras_model().save(keras_model)
    job = keras_prepare(str(keras_model), batch_size=3)
    return {
        "explain_keras": (keras_explain(job), None),
        "check_keras": (keras_check(job, directions=1), None),
        "shapes_keras": (keras_shapes(str(keras_model)), None),
        "check_failing_five_witnesses": (check(grus, against=against, chunks=2), None),
        "explain_mixed": (explain(mixed, flow=True, jacobians=True, chunks=3), None),
        "check_mixed_chunks": (check(mixed, chunks=3), None),
        "shapes_mixed": (shapes(mixed), None),
    }


CASES = ["explain_seed", "check_seed_equations", "shapes_seed", "check_failing_five_witnesses",
         "explain_mixed", "check_mixed_chunks", "shapes_mixed", "explain_keras", "check_keras",
         "shapes_keras"]


@pytest.fixture(scope="module")
def cases(small_reports, seed_reports):
    from gradscope.yaml.config import load_spec
    from gradscope.yaml.shapes import shapes

    every = {
        "explain_seed": (seed_reports["explain"], None),
        "check_seed_equations": (seed_reports["check"], CORRECTED_EQUATIONS),
        "shapes_seed": (shapes(load_spec(None)), None),
        **small_reports,
    }
    return Cases({name: (report, equations, render_text(report, UNWRAPPED, equations))
                  for name, (report, equations) in every.items()})


class Cases(dict):
    """The reports by name; a short repr, since hypothesis prints its arguments."""

    def __repr__(self) -> str:
        return f"<{len(self)} reports>"


def assert_fits(report, equations: str | None, reference: str, width: int) -> None:
    text = render_text(report, width, equations)
    lines = text.split("\n")
    too_wide = [line for line in lines if cell_len(line) > width]
    assert not too_wide, f"{len(too_wide)} lines wider than {width}: {too_wide[0]!r}"
    padded = [line for line in lines if line.endswith((" ", "\u00a0"))]
    assert not padded, f"{len(padded)} lines end in a space at {width}: {padded[0]!r}"
    cut = [word for line in lines for word in line.split() if CUT_NUMBER.search(word)]
    assert not cut, f"numbers cut at {width} columns: {cut[:5]}"
    tokens, shapes = protected(report)
    for token in sorted(tokens):
        assert reference.count(token) >= 1, f"{token!r} is not in the report at all"
        assert text.count(token) == reference.count(token), (
            f"{token!r} is split or cut at {width} columns: {text.count(token)} whole "
            f"occurrences, {reference.count(token)} unwrapped")
    for shape in sorted(shapes):
        assert any(shape in line for line in lines), f"shape {shape} never whole at {width}"


@pytest.mark.parametrize("case", CASES)
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(min_value=60, max_value=160))
@example(width=60)
@example(width=80)
@example(width=109)
@example(width=110)
@example(width=120)
def test_every_table_fits_and_nothing_is_split(cases, case, width):
    report, equations, reference = cases[case]
    assert_fits(report, equations, reference, width)


def test_an_alias_wider_than_the_console_folds_after_a_slash():
    from gradscope.yaml.config import load_spec
    from gradscope.yaml.shapes import shapes

    long_name = "/".join(["a_rather_long_outer_scope_name"] * 3) + "/gru_cell/gates/kernel"
    report = shapes(load_spec(None))
    tensors = [report.tensors[0].model_copy(update={"alias": long_name,
                                                    "alias_source": "checkpoint"}),
               *report.tensors[1:]]
    report = report.model_copy(update={"tensors": tensors})
    lines = render_text(report, 60).split("\n")
    assert max(cell_len(line) for line in lines) <= 60
    start = next(i for i, line in enumerate(lines) if line.startswith("stored as "))
    folded = [line.rstrip() for line in lines[start:start + 3]]
    assert "".join(folded) == f"stored as {long_name}"
    assert all(line.endswith("/") for line in folded[:-1])


@pytest.mark.parametrize("width", [60, 80])
def test_a_trend_table_folds_a_long_weight_path_and_cuts_no_number(width):
    """``gradscope watch``'s weight table: a Keras weight's path has no space to wrap at; it
    is folded after a "/", and every number is shown whole."""
    from rich.console import Console

    from gradscope.report.tables import spark_table

    long = "bidirectional/backward_lstm/lstm_cell/recurrent_kernel"
    rows = {long: ([1e-3, 2e-3, 5e-4], 4.58e-02, 4.53e-02),
            "dense/bias": ([1.0, 2.0], 0.184, 0.112)}
    console = Console(width=width, record=True, color_system=None)
    console.print(spark_table(rows, width, ("weight", "trend", "first", "last")))
    lines = console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= width
    text = "\n".join(lines)
    for value in (4.58e-02, 4.53e-02, 0.184, 0.112):
        assert number(value) in text
    folded = [line.split()[0] for line in lines if line.split() and line.split()[0] in long]
    assert "".join(folded) == long and all(part.endswith("/") for part in folded[:-1])


@pytest.mark.parametrize("width", [60, 64, 70])
def test_the_carried_table_folds_long_weight_paths_and_cuts_no_number(width):
    """``explain --chunks`` on a Bidirectional LSTM at 60 columns (found tried as a new user
    would): "8.61e-" lost its exponent, "recurrent_ke" its end, and the headers split
    mid-word. The paths fold after a "/"; every number and header is whole."""
    from rich.console import Console

    from gradscope.report.models import CarryProductEntry, CarryWeightEntry
    from gradscope.report.tables import carried_tables

    paths = ["embedding/embeddings", "bidirectional/forward_lstm/recurrent_kernel",
             "bidirectional/backward_lstm/recurrent_kernel", "cls/bias"]
    weights = [CarryWeightEntry(name=path, l2_full=4.70e-02 * (k + 1),
                                l2_truncated=4.38e-02 * (k + 1), l2_carried=8.61e-03 * (k + 1),
                                carried_share=0.183) for k, path in enumerate(paths)]
    products = [CarryProductEntry(chunk=0, start=0, stop=10, layer="bidirectional",
                                  x="bidirectional/backward/h0", y="bidirectional/backward/h_T",
                                  l2_grad_y=3.47e-03, l2_product=1.40e-04)]
    console = Console(width=width, record=True, color_system=None)
    for part in carried_tables("intro", weights, products, 0.1, True, "verdict", width):
        console.print(part)
    lines = console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= width
    words = " ".join(lines).split()
    for entry in weights:
        for value in (entry.l2_full, entry.l2_truncated, entry.l2_carried):
            assert words.count(number(value)) == 1
    for title in ("‖g_full‖", "‖g_truncated‖", "‖g_carried‖", "share"):
        assert title in words
    folded = "".join(line.split()[0] for line in lines
                     if line.split() and line.split()[0] in paths[2])
    assert paths[2] in folded


def test_a_trend_tables_last_column_is_the_last_observation():
    """Found tried as a new user would: a kernel whose gradient norm was NaN at the last
    observation (stored as None) read "last 0", the value of the observation before."""
    from rich.console import Console

    from gradscope.report.history_text import series_table

    console = Console(width=80, record=True, color_system=None)
    console.print(series_table({"gru/kernel": [1.62e3, 0.0, None]}, 80, "weight"))
    row = [line for line in console.export_text().splitlines() if "gru/kernel" in line][0]
    assert row.split()[-2:] == [number(1.62e3), "n/a"]


@pytest.mark.parametrize("width", [30, 40, 48])
def test_a_norm_table_below_60_columns_cuts_no_number_and_no_word(width):
    """Found at stop 47: ``gradscope watch`` at 40 columns drew ‖∂L/∂h_t‖'s table as
    "sequenc|e" and "4.46e-0": the sparkline was sized for the labels' longest word, not the
    title's ("sequence"), and nothing narrower was tried. Below where the four columns fit,
    each sparkline goes under its label, beside the two numbers."""
    from rich.console import Console

    from gradscope.report.tables import norm_table

    rows = {"gru (step 20)": [1.68e-03 * 1.2 ** k for k in range(20)],
            "lstm (step 20)": [4.48e-04 * 1.3 ** k for k in range(20)]}
    console = Console(width=width, record=True, color_system=None)
    console.print(norm_table(rows, width))
    lines = console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= width, lines
    words = " ".join(lines).split()
    for values in rows.values():
        assert number(values[0]) in words and number(values[-1]) in words, lines
    assert "sequence" in words, lines
    assert sum(any(mark in line for mark in "▁▂▃▄▅▆▇█") for line in lines) == 2, lines


def test_a_long_layer_name_folds_after_an_underscore():
    """Found tried as a new user would: a 50-character layer name, with no "/" to fold at,
    was cut at the column's edge ("…_number_t" and "wo_long (step 8)")."""
    from rich.console import Console

    from gradscope.report.tables import norm_table

    long = "decoder_gated_recurrent_unit_layer_number_two_long"
    rows = {f"{long} (step 8)": [2.25e-04 * 1.4 ** k for k in range(12)]}
    console = Console(width=80, record=True, color_system=None)
    console.print(norm_table(rows, 80))
    lines = console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    assert lines[2].startswith("decoder_gated_recurrent_unit_layer_number_ "), lines
    assert lines[3].startswith("two_long (step 8)"), lines
    assert number(rows[f"{long} (step 8)"][-1]) in lines[2], lines


def test_a_trend_table_folds_a_path_only_where_its_sparkline_needs_the_room():
    """Found tried as a new user would: at 80 columns a 41-cell weight path was folded beside
    seven observations, for a sparkline of 16 marks the table kept room for. A sparkline
    needs a mark per value, up to that; a path is folded only where that room is missing."""
    from rich.console import Console

    from gradscope.report.tables import spark_table

    path = "seqclf/encoder/lstm_cell/recurrent_kernel"
    for count, kept in ((7, True), (60, False)):
        rows = {path: ([1e-3 * (k + 1) for k in range(count)], 5.83e-02, 1.03e-01)}
        console = Console(width=80, record=True, color_system=None)
        console.print(spark_table(rows, 80, ("weight", "trend", "first", "last")))
        lines = console.export_text().splitlines()
        assert max(cell_len(line) for line in lines) <= 80
        assert any(line.startswith(path + " ") for line in lines) is kept, lines


@pytest.mark.parametrize("width", [60, 64])
def test_a_long_keras_weight_path_in_the_check_table_folds_and_cuts_no_number(
        seed_reports, width):
    """A Keras weight path has no space to wrap at: with every witness's verdict packed
    beside it (the narrowest layout), it folds after a "/" where the widest verdict would not
    fit, and no verdict's number is cut (found tried as a new user would: at 60 columns
    "srnn/simple_rnn_cell/recurrent_kerne" and "9.3e-0")."""
    report = seed_reports["check"]
    long_name = "srnn/simple_rnn_cell/recurrent_kernel"
    tensors = [report.tensors[0].model_copy(update={"name": long_name}), *report.tensors[1:]]
    report = report.model_copy(update={"tensors": tensors})
    lines = render_text(report, width).split("\n")
    assert max(cell_len(line) for line in lines) <= width
    cut = [word for line in lines for word in line.split() if CUT_NUMBER.search(word)]
    assert not cut, cut
    start = next(i for i, line in enumerate(lines) if line.startswith("srnn/"))
    pieces = [lines[start + k].split()[0] for k in range(3)]
    assert "".join(pieces).startswith(long_name)


def test_a_failures_wrapped_detail_stays_indented_under_it(seed_reports):
    """Under "What failed", a detail longer than the console wraps under its own first word
    (found tried as a new user would: its wrapped lines began at column 0)."""
    report = seed_reports["check"]
    tensor = report.tensors[0]
    detail = " ".join(["6 probes; worst: element (1, 11) (largest |g|), finite difference "
                       "-4.162574e+00 vs autodiff -7.291402e+04"] * 3)
    wrong = [tensor.witnesses[0].model_copy(update={"passed": False, "error": 0.96,
                                                     "detail": detail}),
             *tensor.witnesses[1:]]
    tensors = [tensor.model_copy(update={"passed": False, "witnesses": wrong}),
               *report.tensors[1:]]
    report = report.model_copy(update={"tensors": tensors})
    lines = render_text(report, 80).split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("What failed"))
    said = lines[start + 2:start + 2 + 4]
    assert said[0].startswith("    6 probes; worst:")
    assert all(line.startswith("    ") and line.strip() for line in said[1:]), said
    assert max(cell_len(line) for line in lines) <= 80


def test_a_keras_headers_inputs_line_wraps_under_its_first_name(tf):
    """Found tried as a new user would: a character model's header wrapped its output's
    shape to the first column ("outputs time_distributed (batch," then "100, 40)"): the
    line's wrapped lines hang under the first input's name."""
    import keras
    import numpy as np

    import gradscope

    model = keras.Sequential([keras.Input((100, 40)),
                              keras.layers.LSTM(4, return_sequences=True),
                              keras.layers.TimeDistributed(keras.layers.Dense(40),
                                                           name="next_character_logits")])
    model.compile(loss="mse")
    x = np.zeros((2, 100, 40), "float32")
    report = gradscope.explain(model, x=x, y=np.zeros((2, 100, 40), "float32"))
    lines = render_text(report, 80).split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("inputs "))
    assert "next_character_logits" in lines[at] and lines[at + 1].startswith(" " * 7)
    assert lines[at + 1].strip() and max(cell_len(line) for line in lines) <= 80
    # No shape is parted, at any width (found tried as a new user would: "outputs
    # time_distributed (batch, 30," then "1)").
    for width in range(60, 101):
        lines = render_text(report, width).split("\n")
        at = next(i for i, line in enumerate(lines) if line.startswith("inputs "))
        for line in lines[at:at + 3]:
            assert line.count("(") == line.count(")"), (width, line)


def test_an_attention_layers_text_keeps_its_shapes_and_indices_whole(tf):
    """Found tried as a new user would: an Attention layer's text parted "(batch, Tq 1," from
    "dim 8)" and "∂L/∂p[i," from "k])" at 80 columns. A short bracket is one word, at any
    width."""
    import keras
    import numpy as np

    import gradscope

    query, values = keras.Input((1, 8)), keras.Input((12, 8))
    attended = keras.layers.Attention(name="attn")([query, values])
    model = keras.Model([query, values], keras.layers.Flatten()(attended))
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    report = gradscope.explain(model, x=[rng.standard_normal((2, 1, 8)),
                                         rng.standard_normal((2, 12, 8))],
                               y=rng.standard_normal((2, 8)))
    for width in (70, 80, 90, 100):
        lines = render_text(report, width).split("\n")
        start = next(i for i, line in enumerate(lines) if line.startswith("attn "))
        for line in lines[start:start + 14]:
            assert line.count("[") == line.count("]"), (width, line)
            assert ("Tq 1," not in line or "(batch, Tq 1, dim 8)" in line) and \
                not line.lstrip().startswith("dim 8)"), (width, line)


def test_a_backward_directions_heading_wraps_under_itself(tf):
    """Found tried as a new user would: a Bidirectional's backward heading wrapped its
    "(processing order: …)" to the first column at 80 columns. It goes whole under the
    heading, indented, where both do not fit on a line."""
    import keras
    import numpy as np
    from conftest import render_text

    import gradscope

    keras.utils.set_random_seed(0)
    name = "bidirectional_encoder_of_the_sentences"
    model = keras.Sequential([keras.Input((6, 2)), keras.layers.Bidirectional(
        keras.layers.GRU(3), merge_mode="sum", name=name), keras.layers.Dense(1)])
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    report = gradscope.diagnose(model, x=rng.standard_normal((2, 6, 2)),
                                y=rng.standard_normal((2, 1)), counterfactuals=False)
    lines = render_text(report, 80).splitlines()
    at = next(k for k, line in enumerate(lines) if line.startswith(f"{name}/backward (GRU"))
    assert lines[at + 1] == "  (processing order: t = 0 is the last input step)", lines[at:at + 2]
    assert max(cell_len(line) for line in lines) <= 80


@pytest.mark.parametrize("width", [60, 80, 120])
def test_a_long_item_shares_its_lines_with_the_items_beside_it(width):
    """Found tried as a new user would: an item wider than a line (a change's horizon with why
    it stops) went to a line of its own and wrapped there, leaving short lines ("(every lag" /
    "there is) ·") between full ones. Now every line but a block's last is full: what starts
    the line after it (an item that fits on a line, else its first word) would not have
    fitted on it."""
    from gradscope.report.diagnose_text import _line

    items = ["horizon > 16 → > 16 (measured to 16 lags only: a layer this wide reaches the "
             "memory budget there)", "λ₁ -0.179 → -0.0983",
             "carried ×0 (rounds to 0) → ×0 (rounds to 0)", "steps 16, 7, 27, 10, 14, 35, "
             "30, 5, 1, 9, 24, 3, 13, 34, 25, 22, 29, 12, 36, 2 and 19 more"]
    for label in ("  an orthogonal recurrent kernel at its spectral norm",
                  "memory horizon (10⁻³), steps"):
        lines = _line(label, items, width).plain.split("\n")
        assert len(lines) > 1
        for line, after in zip(lines[:-1], lines[1:], strict=True):
            assert cell_len(line) <= width, line
            start = after.strip()
            following = next((item for item in items if start.startswith(item)
                              and cell_len(item) <= width - 4), start.split()[0])
            assert cell_len(line) + 3 + cell_len(following) + 2 > width - 2, (line, after)
        assert cell_len(lines[-1]) <= width
        # nothing lost or doubled
        assert " ".join(" ".join(lines).split()) == " ".join(
            f"{label.strip()}: {' · '.join(items)}".split())


def test_a_sparkline_of_one_level_is_drawn_at_mid_height():
    """Found tried as a new user would: ``explain --at 0``'s influence row, one value and
    zeros, drew that value (the largest) as the lowest mark. A single level (one value, or
    all alike) is drawn at mid height; a zero is a blank, as before."""
    from gradscope.report.layout import sparkline

    assert sparkline([3.15, 0.0, 0.0, 0.0]) == "▄   "
    assert sparkline([2.0, 2.0, 2.0]) == "▄▄▄"
    assert sparkline([1.0, 10.0, 100.0]) == "▁▅█"


@pytest.mark.parametrize("width", [60, 80, 100])
def test_a_backwards_calls_flow_row_keeps_its_qualifier_whole(width):
    """Found tried as a new user would: at 80 columns a --flow row of a layer that reads its
    input backwards wrapped "(read" from "backwards)". The qualifier is one word, Keras' own
    argument: "(go_backwards)"."""
    from rich.console import Console

    from gradscope.report.keras_text import flow_lines
    from gradscope.report.models import KerasFlowSection, KerasFlowSequence

    what = "∂L/∂sentence_encoder_reading_right_to_left/h_t"
    flow = KerasFlowSection(method="the tape", not_analysed=[], flags=[], sequences=[
        KerasFlowSequence(what=what, kind="state", source="sentence_encoder_reading_right_to_"
                          "left", norms=[1e-3 * 1.5 ** t for t in range(30)], backwards=True)])
    console = Console(width=width, record=True, color_system=None)
    for part in flow_lines(flow, width):
        console.print(part)
    text = console.export_text()
    assert "(go_backwards)" in text, text
    assert max(cell_len(line) for line in text.splitlines()) <= width
    # A Bidirectional's backward direction says "backward" in its label: no qualifier.
    flow = KerasFlowSection(method="the tape", not_analysed=[], flags=[], sequences=[
        KerasFlowSequence(what="∂L/∂bidirectional/backward/h_t", kind="state",
                          source="bidirectional", norms=[1.5 ** t for t in range(30)],
                          backwards=True)])
    console = Console(width=width, record=True, color_system=None)
    for part in flow_lines(flow, width):
        console.print(part)
    text = console.export_text()
    assert "backward/h_t‖" in text and "(go_backwards)" not in text


def test_a_jacobian_table_of_names_too_long_for_columns_cuts_no_name_and_no_number():
    """Found tried as a new user would: a stack of cells' state names cut their own "]"
    and the numbers ("1.99e-0") at 80 columns; each entry now goes on lines of its own."""
    from rich.console import Console

    from gradscope.report.models import JacobianEntry
    from gradscope.report.tables import jacobian_table

    entry = JacobianEntry(target="stacked/[states[0]_T, states[1]_T, states[2]_T]",
                          source="stacked/[states[0], states[1], states[2]]", shape=[14, 14],
                          frobenius_median=0.158, frobenius_min=0.102, frobenius_max=0.199,
                          largest_singular_median=0.144, smallest_singular_median=2.4e-7,
                          smallest_singular_below=True)
    console = Console(width=80, record=True, color_system=None)
    console.print(jacobian_table([entry], 80))
    text = console.export_text()
    assert max(cell_len(line) for line in text.splitlines()) <= 80
    for said in (entry.target, entry.source, "(14, 14)", number(0.158), number(0.199),
                 number(0.144), "< " + number(2.4e-7)):
        assert said in text, said
