"""The Python API the README documents: load_spec, shapes, explain, check."""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

import gradscope


def test_load_explain_and_check_from_python(tf):
    # Importing every submodule first must not shadow the API functions (a module named
    # gradscope.shapes or gradscope.check once did).
    for module in ("gradscope.yaml.algebra", "gradscope.yaml.check", "gradscope.yaml.explain"):
        importlib.import_module(module)

    assert callable(gradscope.shapes) and callable(gradscope.check)
    spec = gradscope.load_spec({"input_size": 4, "time_steps": 5, "batch_size": 3,
                                "layers": [{"gru": 3}, {"lstm": 2}, {"dense": 2}]})
    assert [t["shape"] for t in gradscope.shapes(spec).to_dict()["tensors"]][0] == [7, 6]
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((6, 8, 4)), "y": np.eye(2)[rng.integers(0, 2, (6, 8))]}
    report = gradscope.explain(spec, data=data).to_dict()
    assert report["model"]["batch_size"] == 6 and report["model"]["time_steps"] == 8
    assert [s["name"] for s in report["initial_state_gradients"]] == [
        "gru_1/h0", "lstm_1/h0", "lstm_1/c0"]
    checked = gradscope.check(spec, chunks=2)
    assert checked.summary.passed and "tbptt_carry" in checked.summary.witnesses
    assert checked.to_dict()["summary"]["passed"] is True


def test_importing_gradscope_does_not_import_tensorflow():
    import subprocess
    import sys

    code = ("import sys, gradscope; gradscope.load_spec(None); "
            "assert 'tensorflow' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_the_api_refuses_a_model_that_cannot_fit():
    import pytest

    from gradscope.errors import ConfigError

    spec = gradscope.load_spec({"input_size": 100000, "time_steps": 100000, "batch_size": 64,
                                "layers": [{"gru": 50000}, {"dense": 2}]})
    with pytest.raises(ConfigError, match="the largest term is"):
        gradscope.explain(spec)


def test_the_api_takes_a_saved_keras_model(tmp_path, tf):
    import keras

    import gradscope

    model = keras.Sequential([keras.Input((4, 3)), keras.layers.GRU(2), keras.layers.Dense(1)])
    path = tmp_path / "model.keras"
    model.save(path)
    shapes = gradscope.shapes(str(path))
    assert [w.shape for w in shapes.weights] == [list(v.shape) for v in model.weights]
    report = gradscope.explain(str(path), batch_size=3)
    assert report.loss.outputs[0].loss == "mean_squared_error"
    assert report.model.batch_size == 3
    assert gradscope.check(str(path), batch_size=3, directions=1).summary.passed


def test_x_without_y_warns_that_the_gradients_are_of_drawn_targets(tf):
    """Found tried as a new user would: ``diagnose(model, x=x)`` with y forgotten ran on
    targets drawn at random and said so only in the header's data line. explain and diagnose
    warn; with y, or with no batch given at all (the synthetic batch, said as such), not."""
    import keras

    import gradscope

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(2, name="gru"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    x = np.random.default_rng(0).standard_normal((4, 6, 3)).astype("float32")
    said = ("no targets were given (y): the loss and every gradient are of targets drawn at "
            "random to match the loss, not of your data; give y for the gradients fit takes")
    assert said in gradscope.explain(model, x=x).warnings
    assert said not in gradscope.explain(model, x=x, y=np.zeros((4, 1), "float32")).warnings
    assert said not in gradscope.explain(model, batch_size=4).warnings
    report = gradscope.diagnose(model, x=x, counterfactuals=False)
    assert f"{said}; the dynamics (λ, the step Jacobians, the gates, the horizon) read no " \
        "target: they stand" in report.warnings


def test_yaml_explain_takes_flow_jacobians_at_and_heatmap_and_refuses_keras_options(tf):
    import pytest

    from gradscope.errors import ConfigError

    spec = gradscope.load_spec({"input_size": 3, "time_steps": 6, "batch_size": 2,
                                "layers": [{"gru": 3}, {"dense": 2}]})
    plain = gradscope.explain(spec)
    assert plain.gradient_flow is None and plain.state_jacobians is None
    report = gradscope.explain(spec, jacobians=True, at=3, heatmap=True)
    # at= and heatmap= imply flow=, as --at and --plot imply --flow.
    assert report.gradient_flow is not None and report.state_jacobians is not None
    assert report.gradient_flow.influence_map is not None
    assert report.gradient_flow.influence_step == 3
    # The --at step is a row of the map: 20 steps, rows 0, 1, 2, 3, 5, …, 19 and 4.
    spec = gradscope.load_spec({"input_size": 3, "time_steps": 20, "batch_size": 2,
                                "layers": [{"gru": 3}, {"dense": 2}]})
    long = gradscope.explain(spec, at=4, heatmap=True).gradient_flow
    assert long is not None and long.influence_map is not None
    assert 4 in long.influence_map.steps and len(long.influence_map.steps) == 17
    for option in ({"loss": "mse"}, {"training": True}):
        with pytest.raises(ConfigError, match=f"{next(iter(option))}= is for Keras models; a "
                                              "YAML config sets its loss"):
            gradscope.explain(spec, **option)
    with pytest.raises(ConfigError, match="lose=: not options of explain for a YAML spec"):
        gradscope.explain(spec, lose="mse")


@pytest.mark.parametrize("junk", [3, b"config", [1, 2], object()])
@pytest.mark.parametrize("function", ["explain", "check", "shapes"])
def test_junk_for_the_model_is_a_one_line_config_error(junk, function):
    from gradscope.errors import ConfigError

    with pytest.raises(ConfigError, match=f"got an object of type {type(junk).__name__}; "
                                          "expected a YAML path"):
        getattr(gradscope, function)(junk)


def test_a_dict_spec_is_validated_with_its_key_named():
    from gradscope.errors import ConfigError

    with pytest.raises(ConfigError, match="missing required key 'input_size'"):
        gradscope.shapes({})


@pytest.mark.parametrize(("options", "message"), [
    ({"batch_size": "a"}, "batch_size='a': expected a whole number ≥ 1"),
    ({"batch_size": 0}, "batch_size=0: expected a whole number ≥ 1"),
    ({"time_steps": True}, "time_steps=True: expected a whole number ≥ 1"),
    ({"pad": -2}, "pad=-2: expected a whole number ≥ 0"),
    ({"seed": "s"}, "seed='s': expected a whole number ≥ 0"),
    ({"training": "yes"}, "training='yes': expected True or False"),
    ({"loss": 3}, "loss=3: expected the name of a Keras loss"),
    ({"colour": 1}, "colour=: not an option"),
    ({"directions": 0}, "directions=0: expected a whole number ≥ 1"),
    ({"rtol": -1.0}, "rtol=-1.0: expected a positive number"),
])
def test_junk_options_for_a_keras_model_are_named(options, message, tf):
    import keras

    from gradscope.errors import ConfigError

    model = keras.Sequential([keras.Input((4, 3)), keras.layers.GRU(3),
                              keras.layers.Dense(2)])
    function = gradscope.check if {"directions", "rtol"} & set(options) else gradscope.explain
    with pytest.raises(ConfigError, match=re.escape(message)):
        function(model, **options)


def test_numpy_whole_numbers_are_options_as_python_ints():
    """Found tried as a new user would: diagnose(model, ..., exponents=np.int64(2)) was
    refused as "expected a whole number ≥ 1". A NumPy integer is taken, as a Python int (the
    reports' JSON holds it); a NumPy bool or float is not."""
    import numpy as np

    from gradscope.errors import ConfigError
    from gradscope.keras.checked_examples import examples_option
    from gradscope.keras.job import whole
    from gradscope.preflight import check_witness_options

    options = {"exponents": np.int64(2), "seed": np.uint16(0)}
    whole(options, "exponents", smallest=1)
    whole(options, "seed", smallest=0)
    assert options == {"exponents": 2, "seed": 0}
    assert all(type(value) is int for value in options.values())
    assert examples_option(np.int32(3)) == 3
    check_witness_options(np.int64(2), None, None)
    for junk in (np.bool_(True), np.float64(2.0)):
        with pytest.raises(ConfigError, match=r"exponents=.*: expected a whole number ≥ 1"):
            whole({"exponents": junk}, "exponents", smallest=1)
        with pytest.raises(ConfigError, match=r"directions=.*: expected a whole number ≥ 1"):
            check_witness_options(junk, None, None)


def test_the_report_models_stand_below_their_renderers():
    """The report models import no renderer (no circle in report/): a report from the API
    draws itself because the renderers register with the models when they are imported."""
    import subprocess
    import sys

    code = ("import sys, gradscope.report.models as m; "
            "assert not [n for n in sys.modules if n.startswith('gradscope.report.') "
            "and n != 'gradscope.report.models'], sorted(sys.modules); "
            "assert 'rich' not in sys.modules; assert m.DRAWERS == {}")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=60)
    assert completed.returncode == 0, completed.stderr
    report = gradscope.shapes(None)
    assert "<pre" in report._repr_html_()


def test_watch_is_a_function_of_the_api_whatever_is_imported(tmp_path):
    """``gradscope.watch`` reads GradientFlow's event files; no module of that name shadows it
    once the package's modules are imported."""
    import gradscope.keras.summaries  # noqa: F401
    import gradscope.training_log  # noqa: F401
    from gradscope.errors import ConfigError

    assert callable(gradscope.watch)
    with pytest.raises(ConfigError, match="no such folder"):
        gradscope.watch(tmp_path / "nowhere")


@pytest.mark.parametrize(("options", "message"), [
    ({"against": "bp.py:backward"}, "against= is for YAML configs"),
    ({"layer": "gru"}, "layer='gru' checks your backward of one layer; expected it together "
                       "with against="),
    ({"weights": "w.npz"}, "weights= is for YAML configs; a Keras model carries its own"),
    ({"equations": True}, "equations= is for YAML configs"),
])
def test_options_of_a_yaml_config_are_refused_for_a_keras_model_not_ignored(options, message):
    # Refused before anything is read (the file need not exist) or TensorFlow is imported.
    from gradscope.errors import GradscopeError

    with pytest.raises(GradscopeError, match=re.escape(message)):
        gradscope.check("absent.keras", **options)


def test_the_same_refusal_spells_the_option_as_each_door_takes_it(tmp_path):
    """One refusal serves the API and the CLI: each names the option as its user wrote it."""
    import subprocess
    import sys

    from gradscope.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape("time_steps= is for Keras models")):
        gradscope.explain(None, time_steps=5)
    with pytest.raises(ConfigError, match=re.escape("at=40 is outside the 6 time steps")):
        gradscope.explain({"input_size": 3, "time_steps": 6, "batch_size": 2,
                           "layers": [{"gru": 3}, {"dense": 2}]}, at=40)
    result = subprocess.run([sys.executable, "-m", "gradscope", "explain", "--time-steps", "5"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert "--time-steps is for Keras models" in result.stderr


def test_max_memory_refuses_in_the_api_as_on_the_command_line():
    from gradscope.errors import ConfigError

    with pytest.raises(ConfigError, match=r"more than the limit 1\.0 KiB"):
        gradscope.explain(None, max_memory="1K")
    with pytest.raises(ConfigError, match=r"more than the limit 1\.0 KiB"):
        gradscope.check(None, max_memory=1024)


def test_check_draws_the_corrected_equations_when_asked_and_keeps_them_out_of_json(tf):
    from conftest import render_text

    spec = {"input_size": 3, "time_steps": 4, "batch_size": 2,
            "layers": [{"gru": 3, "layout": "block"}, {"dense": 2}]}
    plain = gradscope.check(spec, directions=1)
    shown = gradscope.check(spec, directions=1, equations=True)
    heading = "GRUBlockCellGrad: the corrected backward equations"
    assert heading not in render_text(plain, 100) and heading in render_text(shown, 100)
    assert shown.to_dict().keys() == plain.to_dict().keys()
    assert "equations" not in shown.to_json()


def test_timings_name_each_phase_in_order_then_what_ran_beside(tf):
    spec = {"input_size": 3, "time_steps": 4, "batch_size": 2,
            "layers": [{"gru": 3, "layout": "block"}, {"dense": 2}]}
    checked = gradscope.check(spec, directions=1, chunks=2, timings=True).timings
    assert checked is not None
    assert list(checked)[:4] == ["import_and_build", "autodiff", "witnesses", "tbptt_carry"]
    assert set(list(checked)[4:]) == {  # in the order they finished
        "numpy_reference (concurrent)", "gru_block_kernel (concurrent)",
        "finite_differences (concurrent)"}
    explained = gradscope.explain(spec, timings=True).timings
    assert explained is not None and list(explained)[:2] == ["import_and_build",
                                                             "forward_backward"]
    assert all(seconds >= 0 for seconds in [*checked.values(), *explained.values()])
    assert gradscope.check(spec, directions=1).timings is None


@pytest.mark.parametrize(("options", "message"), [
    ({"directions": 0}, "directions=0: expected a whole number ≥ 1"),
    ({"rtol": 0.0}, "rtol=0.0: expected a positive number"),
    ({"atol": -1e-9}, "atol=-1e-09: expected a number ≥ 0"),
])
@pytest.mark.parametrize("model", [None, "absent.keras"])
def test_the_witnesses_tuning_is_checked_for_either_wing_before_anything_runs(model, options,
                                                                            message):
    # directions=0 once ran a YAML check whose finite differences compared nothing.
    from gradscope.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        gradscope.check(model, **options)


def test_the_header_says_what_inference_mode_changes_in_this_model(tf):
    """Found tried as a new user would: every header said "dropout off, batch norm uses its
    moving statistics", of models that have neither. It names what the model's layers do;
    both where a layer of the user's own code may do anything."""
    import keras
    from conftest import render_text

    from gradscope.keras.graph import mode_effects
    from gradscope.keras.live import read_live_graph

    def model(*layers):
        built = keras.Sequential([keras.Input((5, 2)), *layers, keras.layers.Dense(1)])
        built.compile(loss="mse")
        return built

    class Mine(keras.layers.Layer):
        def call(self, x):
            return x

    assert mode_effects(read_live_graph(model(keras.layers.GRU(3)))) == []
    assert mode_effects(read_live_graph(model(keras.layers.GRU(3, recurrent_dropout=0.1)))) == [
        "dropout off"]
    assert mode_effects(read_live_graph(model(
        keras.layers.BatchNormalization(),
        keras.layers.Bidirectional(keras.layers.LSTM(2, dropout=0.2))))) == [
        "dropout off", "batch norm uses its moving statistics"]
    assert mode_effects(read_live_graph(model(Mine(), keras.layers.GRU(3)))) is None

    class Own(keras.Model):
        def __init__(self):
            super().__init__()
            self.rnn, self.out = keras.layers.GRU(3), keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.rnn(x) * 2.0)

    subclassed = Own()
    subclassed(np.zeros((1, 5, 2), "float32"))
    assert mode_effects(read_live_graph(subclassed)) is None  # its own call is its code
    x, y = np.ones((2, 5, 2), "float32"), np.zeros((2, 1), "float32")
    texts = [" ".join(render_text(gradscope.explain(m, x=x, y=y), 80).split())
             for m in (model(keras.layers.GaussianNoise(0.1), keras.layers.GRU(3)),
                       model(keras.layers.GRU(3)), model(Mine(), keras.layers.GRU(3)))]
    assert "inference mode (noise off) ·" in texts[0]
    assert "inference mode · " in texts[1]
    assert "inference mode (your layers get training=False) · " in texts[2]


def test_a_part_of_a_report_shows_its_fields_in_ipython_and_the_report_its_text(seed_reports):
    """IPython (and a notebook's plain-text view) shows ``report.summary`` or ``report.carry``
    as its fields, one to a line, not pydantic's one-line repr; a whole report as the
    terminal's text."""
    from IPython.lib.pretty import pretty

    report = seed_reports["check"]
    shown = pretty(report.summary)
    assert shown.startswith("CheckSummary {") and "'passed': True" in shown
    assert shown.count("\n") >= len(report.summary.to_dict()) - 1
    carry = seed_reports["explain"].carry
    assert carry is not None and pretty(carry).startswith(type(carry).__name__ + " {")
    assert pretty(report) == str(report)
    # print(report.summary) in a script: the same fields, one to a line.
    printed = str(report.summary)
    assert printed.startswith("CheckSummary {") and "'passed': True" in printed
    assert printed.count("\n") >= len(report.summary.to_dict()) - 1
