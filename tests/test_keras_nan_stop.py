"""gradscope/keras/nan_stop.py: GradientFlow(stop_on_nan=True) during model.fit.

fit runs unshuffled on batches of 6, so batch k is rows 6k…6k+5; a NaN planted in one
example of the third batch makes the loss of step 3 NaN, and a zero vector under an L2 norm
in the second batch gives step 2 a finite loss with NaN gradients, so step 3's weights hold
NaN: the diagnosis must name the step and the example where each was born.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from conftest import render_text

import gradscope
from gradscope.keras.nan_stop import JSON_FILE, TEXT_TAG

B, T, F = 6, 5, 3


def _fit(keras: Any, model: Any, x: np.ndarray, flow: Any) -> Any:
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model.fit(x, np.zeros((len(x), 2), "float32"), batch_size=B, epochs=2,
                     shuffle=False, verbose=0, callbacks=[flow])


def test_nan_in_one_example_s_input_stops_fit_with_the_diagnosis(tf, tmp_path, capsys):
    import keras

    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((T, F), name="x"), keras.layers.GRU(3),
                              keras.layers.Dense(2)])
    x = np.random.default_rng(0).normal(size=(4 * B, T, F)).astype("float32")
    x[2 * B + 4, 1, 2] = np.nan  # the third batch's example 4
    flow = GradientFlow(every=2, log_dir=tmp_path, stop_on_nan=True)  # one pass at step 2
    history = _fit(keras, model, x, flow)
    found = flow.nonfinite
    assert found is not None and flow.nonfinite_step == 3
    assert (found.origin, found.layer, found.step, found.examples) == ("input", "x", 1, [4])
    assert found.cause.startswith("NaN in the input x: example 4, step 1, feature 2")
    assert len(history.history["loss"]) == 1  # stopped in the first epoch
    said = capsys.readouterr().err
    assert "the loss of step 3 is not finite; training stops" in said
    # No line ends in spaces (found tried as a new user would: padded to 80 columns).
    assert all(line == line.rstrip() for line in said.splitlines())
    written = json.loads((tmp_path / JSON_FILE).read_text())
    assert written["step"] == 3 and written["nonfinite"]["examples"] == [4]
    texts = [value for path in tmp_path.glob("events.out.tfevents.*")
             for event in tf.compat.v1.train.summary_iterator(str(path))
             for value in event.summary.value if value.tag == TEXT_TAG]
    assert texts and b"NaN in the input x" in texts[0].tensor.string_val[0]
    assert flow.history.nonfinite == found and flow.history.nonfinite_step == 3
    watched = gradscope.watch(tmp_path)  # read back from the log_dir
    assert watched.nonfinite == found and watched.nonfinite_step == 3
    assert "training stopped at step 3: its loss is not finite" in render_text(watched, 80)


def test_watch_reads_a_run_stopped_before_its_first_observation(tf, tmp_path, capsys):
    """every=50: the NaN of step 3 stops fit before any observation wrote the run's events;
    the diagnosis file holds the run's description, and watch reads it back."""
    import keras

    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((T, F), name="x"), keras.layers.GRU(3),
                              keras.layers.Dense(2)])
    x = np.random.default_rng(0).normal(size=(4 * B, T, F)).astype("float32")
    x[2 * B + 4, 1, 2] = np.nan  # the third batch's example 4
    flow = GradientFlow(every=50, log_dir=tmp_path, stop_on_nan=True)
    _fit(keras, model, x, flow)
    capsys.readouterr()
    assert flow.nonfinite is not None and flow.history.observations == []
    watched = gradscope.watch(tmp_path)
    assert watched.nonfinite == flow.nonfinite and watched.nonfinite_step == 3
    assert watched.observations == [] and watched.every == 50
    assert watched.loss == flow.history.loss
    text = render_text(watched, 80)
    assert "no observations" in text and "yet" not in text
    assert "training stopped at step 3: its loss is not finite" in text
    assert "NaN in the input x: example 4, step 1, feature 2" in " ".join(text.split())


def test_a_nan_gradient_is_found_on_the_step_that_wrote_it(tf):
    import keras

    from gradscope.keras import GradientFlow

    @keras.saving.register_keras_serializable("gradscope_tests")
    class WithNorm(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            norm = keras.ops.sqrt(keras.ops.sum(x * x, axis=-1, keepdims=True))
            return keras.ops.concatenate([x, norm], axis=-1)

    keras.utils.set_random_seed(5)
    inputs = keras.Input((T, F), name="x")
    # No bias: a zero input stays a zero vector whatever the updates.
    pre = keras.layers.Dense(3, use_bias=False, name="pre")
    hidden = WithNorm(name="norm")(pre(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GRU(3)(hidden)))
    x = np.random.default_rng(0).normal(size=(4 * B, T, F)).astype("float32")
    x[B + 2, 3] = 0.0  # the second batch's example 2, at step 3
    flow = GradientFlow(every=100, stop_on_nan=True)
    _fit(keras, model, x, flow)
    found = flow.nonfinite
    assert found is not None and flow.nonfinite_step == 2
    assert (found.pass_, found.layer, found.step, found.examples, found.operation) == (
        "backward", "norm", 3, [2], "SqrtGrad")


def test_weights_that_diverge_are_said_beside_the_overflow(tf):
    """Tried as a new user would: SGD at a learning rate of 50 grows the weights about 300×
    a step until the loss overflows; the cause stopped at the overflow. It now names the
    weight the last update grew most, from the weights a plain fit of a copy holds at each
    step (the truth, computed here)."""
    import keras

    from gradscope.keras import GradientFlow

    def model_and_data() -> tuple[Any, np.ndarray, np.ndarray]:
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((T, F), name="x"), keras.layers.GRU(4),
                                  keras.layers.Dense(1, name="out")])
        model.compile(optimizer=keras.optimizers.SGD(50.0), loss="mse")
        x = np.random.default_rng(0).normal(size=(12 * B, T, F)).astype("float32")
        return model, x, 10 * x[:, :, :1].sum(axis=1)

    model, x, y = model_and_data()
    held: list[list[np.ndarray]] = []

    class Held(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            held.append([np.array(v.numpy(), np.float64) for v in model.trainable_weights])

    model.fit(x, y, batch_size=B, shuffle=False, verbose=0,
              callbacks=[Held(), keras.callbacks.TerminateOnNaN()])
    stop = len(held)  # the step whose loss is not finite (1-based)
    growth = [np.linalg.norm(b) / np.linalg.norm(a) for a, b in zip(held[-2], held[-1],
                                                                      strict=True)]
    grown = int(np.argmax(growth))
    model, x, y = model_and_data()
    flow = GradientFlow(every=100, stop_on_nan=True)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[flow])
    found = flow.nonfinite
    assert found is not None and flow.nonfinite_step == stop and growth[grown] > 10
    path = model.trainable_weights[grown].path
    assert (f"; the update at step {stop - 1} grew ‖{path}‖ from "
            f"{np.linalg.norm(held[-2][grown]):.2g} to {np.linalg.norm(held[-1][grown]):.2g} "
            f"(×{growth[grown]:.2g}; learning rate 50): the weights are diverging") \
        in found.cause
