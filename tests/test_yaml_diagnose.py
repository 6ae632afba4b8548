"""``gradscope diagnose CONFIG``: a YAML spec's model, built from Keras' own layers with the
spec's weights, diagnosed as a saved model is.

The truth is computed here, without Keras: the TF1 GRUCell written out in NumPy (float64), its
step Jacobians by central differences along the batch's own trajectory, and Benettin's QR on
them give the Lyapunov exponents; the loss is the YAML wing's own explain. A layout rearranged
wrongly is a planted mutant that the build must refuse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SAMPLES, run_gradscope, run_without_tensorflow

import gradscope

CONFIG = {"input_size": 3, "time_steps": 24, "batch_size": 4, "layout": "block",
          "layers": [{"gru": 5}, {"lstm": 4}, {"simple_rnn": 3}, {"dense": 2}],
          "loss": "softmax_cross_entropy", "seed": 2, "dtype": "float64"}


def _tf1_gru_step(w_ru: np.ndarray, b_ru: np.ndarray, w_c: np.ndarray, b_c: np.ndarray,
                  x: np.ndarray, h: np.ndarray) -> np.ndarray:
    """TF1's GRUCell: [r | u] = σ([x, h]·w_ru + b_ru), c = tanh([x, r∘h]·w_c + b_c),
    h' = u∘h + (1 − u)∘c."""
    units = h.shape[-1]
    gates = 1 / (1 + np.exp(-(np.concatenate([x, h], -1) @ w_ru + b_ru)))
    r, u = gates[..., :units], gates[..., units:]
    c = np.tanh(np.concatenate([x, r * h], -1) @ w_c + b_c)
    return u * h + (1 - u) * c


def _benettin(step: Any, xs: np.ndarray, units: int) -> np.ndarray:
    """Every exponent of one example's trajectory: J_t by central differences, QR each step."""
    h, q, logs = np.zeros(units), np.eye(units), []
    for x in xs:
        jacobian = np.stack([(step(x, h + 1e-6 * e) - step(x, h - 1e-6 * e)) / 2e-6
                             for e in np.eye(units)], axis=1)
        q, r = np.linalg.qr(jacobian @ q)
        logs.append(np.log(np.abs(np.diag(r))))
        h = step(x, h)
    return np.mean(logs, axis=0)


def test_a_block_gru_s_exponents_are_tf1_s_own(tf: Any) -> None:
    """The spec's first layer, a TF1 GRUCell, is diagnosed through Keras' GRU
    (reset_after=False) with the weights rearranged: its exponents are those of TF1's own
    equations, and the loss is the YAML wing's."""
    from gradscope.yaml.algebra import model_shapes
    from gradscope.yaml.config import load_spec
    from gradscope.yaml.data import initial_params, synthetic_batch

    report = gradscope.diagnose(CONFIG, counterfactuals=False)
    assert report.loss.value == pytest.approx(gradscope.explain(CONFIG).loss.value, rel=1e-12)
    assert report.loss.name == ("softmax_cross_entropy, the config's loss (Keras' "
                                "categorical_crossentropy from logits)")
    assert [layer.call for layer in report.layers] == ["gru_1", "lstm_1", "simple_rnn_1"]
    shapes = model_shapes(load_spec(CONFIG))
    params, x = initial_params(shapes), synthetic_batch(shapes).x
    weights = [params[f"gru_1/{name}"] for name in ("w_ru", "b_ru", "w_c", "b_c")]
    truth = np.mean([_benettin(lambda x, h: _tf1_gru_step(*weights, x, h), example, 5)
                     for example in x], axis=0)
    assert report.layers[0].lyapunov == pytest.approx(sorted(truth, reverse=True), abs=1e-6)
    assert report.model.data == "synthetic (seed 2)"
    assert report.method[0].startswith("the YAML spec's model is built from Keras' own layers")


def test_a_layout_rearranged_wrongly_is_refused(tf: Any, monkeypatch: Any) -> None:
    """A planted mutant: the GRU's r and z columns swapped on the way to Keras. The model
    would not be the spec's; its predictions differ from the spec's NumPy pass, and the
    build says so (an internal error) rather than diagnose another model."""
    from gradscope.errors import InternalError
    from gradscope.yaml import keras_layers

    right = keras_layers.gru_block_to_keras

    def swapped(arrays: dict[str, np.ndarray], F: int, u: int) -> Any:
        found = right(arrays, F, u)
        kernel, how = found["kernel"]
        found["kernel"] = (np.concatenate([kernel[:, u:2 * u], kernel[:, :u],
                                           kernel[:, 2 * u:]], axis=1), how)
        return found

    monkeypatch.setattr(keras_layers, "gru_block_to_keras", swapped)
    with pytest.raises(InternalError, match="do not predict what the spec's own NumPy pass"):
        gradscope.diagnose(CONFIG, counterfactuals=False)


def test_the_command_line_diagnoses_a_config_and_refuses_a_keras_option(
        tmp_path: Path) -> None:
    """`gradscope diagnose CONFIG --json`: one document, the config named as the model's file,
    each change measured; a Keras model's option is refused before TensorFlow loads, and
    so are an initial state the data gives."""
    done = run_gradscope("diagnose", str(SAMPLES / "last_step.yaml"), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["model"]["file"] == str(SAMPLES / "last_step.yaml")
    assert report["loss"]["outputs"][0]["rule"] == "the config's loss"
    for layer in report["layers"]:
        assert any(c["applicable"] and c["kind"] != "clipping"
                   for c in layer["counterfactuals"]), layer["call"]
    refused = run_without_tensorflow("diagnose", str(SAMPLES / "seed.yaml"), "--loss", "mse")
    assert refused.returncode == 2 and "--loss is for a Keras model" in refused.stderr
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "batch.npz", x=rng.standard_normal((3, 5, 2)),
             y=rng.standard_normal((3, 5, 1)), **{"gru_1/h0": np.ones((3, 4))})
    (tmp_path / "small.yaml").write_text("input_size: 2\ntime_steps: 5\nbatch_size: 3\n"
                                         "layers: [{gru: 4}, {dense: 1}]\nloss: mse\n")
    given = run_without_tensorflow("diagnose", str(tmp_path / "small.yaml"), "--data",
                                   str(tmp_path / "batch.npz"))
    assert given.returncode == 2 and "gru_1/h0: diagnose starts every" in given.stderr


def test_trained_weights_are_diagnosed_where_they_are(tf: Any, tmp_path: Path) -> None:
    """weights= (--weights): the spec's model at the weights of a file, as explain reads them
    (the loss is explain's at those weights, not the seed's); a Keras model is refused it."""
    import keras

    from gradscope.errors import ConfigError
    from gradscope.yaml.algebra import model_shapes
    from gradscope.yaml.config import load_spec
    from gradscope.yaml.data import initial_params

    config = {**CONFIG, "layers": [{"gru": 5}, {"dense": 2}]}
    trained = {name: 1.7 * value
               for name, value in initial_params(model_shapes(load_spec(config))).items()}
    np.savez(tmp_path / "trained.npz", **trained)
    report = gradscope.diagnose(config, weights=tmp_path / "trained.npz",
                                counterfactuals=False)
    explained = gradscope.explain(config, weights=tmp_path / "trained.npz")
    assert report.loss.value == pytest.approx(explained.loss.value, rel=1e-12)
    assert report.loss.value != pytest.approx(gradscope.explain(config).loss.value, rel=1e-3)
    assert f"read from {tmp_path / 'trained.npz'} (.npz archive; 6 weights" in report.method[0]
    model = keras.Sequential([keras.Input((4, 2)), keras.layers.GRU(3), keras.layers.Dense(1)])
    model.compile(loss="mse")
    with pytest.raises(ConfigError, match="a Keras model carries its own weights"):
        gradscope.diagnose(model, x=np.zeros((2, 4, 2)), y=np.zeros((2, 1)),
                           weights=tmp_path / "trained.npz")


def test_explain_flow_flags_a_config_s_layer_by_what_diagnose_reads(tf: Any) -> None:
    """Found tried as a new user would: on the seed model, explain --flow flagged nothing
    (the total ∂L/∂h_t cannot fade where the loss enters at every step) while diagnose read
    each GRU's recurrence carrying back ×9.5e-12 and ×2.9e-7. A YAML layer is now flagged
    by what its recurrence carries back, as a Keras layer is: the ratio is diagnose's, from
    the other wing's engine (Keras' cells), for every layer, an LSTM's h and c together
    (Keras' state pair: each step's Jᵀ on (h, c), the same ratio)."""
    config = {**CONFIG, "time_steps": 60}
    flags = {flag.what: flag for flag in gradscope.explain(config, flow=True)
             .gradient_flow.flags}
    diagnosed = gradscope.diagnose(config, counterfactuals=False)
    for layer in diagnosed.layers:
        assert layer.flow is not None and layer.flow.ratio is not None
        flag = flags.get(f"∂L/∂{layer.call}/h_t")
        if layer.flow.flag is None:
            assert flag is None, layer.call
            continue
        assert flag is not None and flag.kind == layer.flow.flag, layer.call
        assert flag.ratio == pytest.approx(layer.flow.ratio, rel=1e-6), layer.call
    assert any(layer.flow.flag == "vanishing" for layer in diagnosed.layers)
    assert "on h and c together" in flags["∂L/∂lstm_1/h_t"].message


def test_a_config_s_own_seed_no_optimizer_and_one_step(tf: Any) -> None:
    """Tried as a new user would: a config of seed 1 was reported seed 0; the Keras model's
    default optimizer was read as the config's ("RMSprop clips nothing"); and a call of one
    step was an internal error of the horizon's loop. The seed is the config's, no optimizer
    is named, and a one-step call is not diagnosed, with why."""
    config = {**CONFIG, "seed": 1, "layers": [{"gru": 3}, {"dense": 2}]}
    report = gradscope.diagnose(config, counterfactuals=False)
    assert report.model.seed == 1 and report.model.data == "synthetic (seed 1)"
    assert report.clipping.optimizer is None and report.clipping.setting is None
    assert report.clipping.effect.startswith("a YAML config names no optimizer")
    single = gradscope.diagnose({**config, "time_steps": 1}, counterfactuals=False)
    assert not single.layers
    assert [entry.reason for entry in single.not_diagnosed] == [
        "a call of one step carries nothing from step to step: no recurrence to diagnose"]
