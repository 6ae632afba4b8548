"""gradscope/keras/cross_check.py: gradscope's NumPy cells rerun each recurrent call of the user's
Keras model, and must reproduce Keras' output."""

from __future__ import annotations

import numpy as np
import pytest

import gradscope


def _model(keras, steps):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((steps, 3)), keras.layers.LSTM(4),
                             keras.layers.Dense(2)])


def test_a_long_call_is_witnessed_on_spread_examples_and_a_short_one_on_all(tf):
    import keras

    from gradscope.keras.cross_check import sampled_examples

    assert sampled_examples(32, 100) == slice(None)
    rows = sampled_examples(32, 400)
    assert list(rows) == [0, 4, 9, 13, 18, 22, 27, 31]  # the first, the last, evenly between
    assert list(sampled_examples(32, 3000)) == [0, 31]  # never fewer than these two
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((100, 40, 3)), rng.standard_normal((100, 2))
    report = gradscope.explain(_model(keras, 40), x=x, y=y)
    (entry,) = report.witnesses
    assert entry.passed and entry.detail.endswith("on 80 of its 100 examples")
    # The limit applied, as the text gives it, in the JSON too (the tolerance is relative).
    assert entry.allowed is not None and entry.max_abs_error <= entry.allowed
    assert f"(allowed {entry.allowed:.1e})" in entry.detail
    assert report.to_dict()["witnesses"][0]["allowed"] == entry.allowed
    short = gradscope.explain(_model(keras, 40), x=x[:8], y=y[:8])
    assert "examples" not in short.witnesses[0].detail


@pytest.mark.parametrize("examples, steps", [(8, 40), (100, 40), (8, 2000)])
def test_a_misread_cell_is_caught_on_a_sample_as_on_the_whole_batch(tf, monkeypatch, examples,
                                                                   steps):
    """A mutant: the cell reads the LSTM's gates in the wrong order (f and i swapped)."""
    import keras

    from gradscope.errors import InternalError
    from gradscope.keras import cross_check

    honest = cross_check.cell_params

    def swapped(cell, weights):
        params = honest(cell, weights)
        u = cell.units
        for name in ("kernel", "recurrent_kernel", "bias"):
            value = params[name].copy()
            value[..., :u], value[..., u:2 * u] = params[name][..., u:2 * u], \
                params[name][..., :u]
            params[name] = value
        return params

    monkeypatch.setattr(cross_check, "cell_params", swapped)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((examples, steps, 3)), rng.standard_normal((examples, 2))
    with pytest.raises(InternalError, match="does not reproduce Keras' output"):
        gradscope.explain(_model(keras, steps), x=x, y=y)


def test_an_exploding_call_whose_rounding_grows_is_not_witnessed_not_called_misread(tf):
    """A SimpleRNN whose recurrent kernel is orthogonal × 3 (λ₁ > 0) over 40 steps: Keras'
    float32 loop and the float64 cell part by rounding grown along the trajectory (far past
    the tolerance), as the cell's own output does when its inputs move by one float32
    rounding. explain reports the exploding flow, the witness says why it
    cannot hold the call, and no internal error is raised."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((40, 4)),
        keras.layers.SimpleRNN(16, recurrent_initializer=keras.initializers.Orthogonal(3.0)),
        keras.layers.Dense(1)])
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 40, 4)).astype("float32")
    y = rng.standard_normal((16, 1)).astype("float32")
    report = gradscope.explain(model, x=x, y=y, flow=True)
    (entry,) = report.witnesses
    assert entry.passed is None and entry.max_abs_error > 1e-3, entry.detail
    assert entry.detail.startswith("not witnessed: this trajectory amplifies rounding")
    assert [f.kind for f in report.gradient_flow.flags if "simple_rnn" in f.what][0] == \
        "exploding"


def test_a_layer_that_reads_its_steps_backwards_is_witnessed(tf):
    """go_backwards: Keras reads the steps from the last and returns the sequence in that
    order; the cell reruns the steps in that order and must reproduce both a whole sequence
    and a last state (it said "not witnessed (go_backwards)", where a Bidirectional's
    backward direction, the same loop, was witnessed by check)."""
    import keras

    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((12, 3)),
        keras.layers.GRU(5, go_backwards=True, return_sequences=True, name="rev_gru"),
        keras.layers.LSTM(4, go_backwards=True, name="rev_lstm"),
        keras.layers.Dense(2)])
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((6, 12, 3)), rng.standard_normal((6, 2))
    report = gradscope.explain(model, x=x, y=y)
    assert [(w.layer, w.passed) for w in report.witnesses] == [("rev_gru", True),
                                                              ("rev_lstm", True)]
    assert all(w.max_abs_error <= w.allowed for w in report.witnesses)
