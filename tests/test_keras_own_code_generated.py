"""Hypothesis draws models written the way users write their own code, and gradscope explains
each with Keras' own numbers.

Each example combines, at random:

- the recurrent part: a GRU, an LSTM, a SimpleRNN or ``RNN`` over a cell of the user's own
  (one state, or a tuple ``[h, c]``), optionally Bidirectional;
- a layer of the user's own that makes sub-layers in ``__init__`` (a Dense and a pooling),
  or none;
- the model: functional, or subclassed (layers made in ``__init__``, a ``call`` that computes
  between them);
- the loss: compiled (mse), the ``add_loss`` terms alone (``compile(optimizer=…)``), or a
  ``compute_loss`` the class writes itself (subclassed only).

The truth is Keras' tape over ``model(x)`` and ``model.compute_loss``, as ``fit`` computes
it; the loss and every weight gradient's L2 norm must equal it (rel 1e-5). The run draws 20
examples, derandomized so that CI sees the same models every time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import gradscope

RTOL = 1e-5


def _parts(keras: Any, tuple_state: bool) -> dict[str, Any]:
    from keras import layers, ops

    class Block(layers.Layer):
        """A layer of the user's own, with sub-layers made in ``__init__``."""

        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.project = layers.Dense(units, activation="tanh")
            self.pool = layers.GlobalAveragePooling1D()

        def call(self, x: Any) -> Any:
            return self.pool(self.project(x))

    class Penalty(layers.Layer):
        """Adds the mean squared distance of its two inputs as the loss."""

        def call(self, prediction: Any, target: Any) -> Any:
            self.add_loss(ops.mean(ops.square(prediction - target)))
            return prediction

    class Cell(layers.Layer):
        """A cell of the user's own: one state, or two (``[h, c]``)."""

        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = units
            self.state_size = [units, units] if tuple_state else units

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], self.units), name="kernel")
            self.recurrent = self.add_weight(shape=(self.units, self.units), name="recurrent")

        def call(self, x: Any, states: Any) -> Any:
            h = ops.tanh(ops.matmul(x, self.kernel) + ops.matmul(states[0], self.recurrent))
            if tuple_state:
                c = 0.5 * states[1] + 0.5 * h
                return h + c, [h, c]
            return h, [h]

        def get_config(self) -> dict[str, Any]:
            return {**super().get_config(), "units": self.units}

    # Bidirectional rebuilds its backward layer from the config: the cell is registered.
    name = f"gradscope_generated>Cell{'2' if tuple_state else '1'}"
    registered = keras.saving.get_registered_object(name)
    if registered is None:
        registered = keras.saving.register_keras_serializable(
            "gradscope_generated", f"Cell{'2' if tuple_state else '1'}")(Cell)
    return {"Block": Block, "Penalty": Penalty, "Cell": registered}


@st.composite
def own_code_models(draw: Any) -> dict[str, Any]:
    """What one example is made of (see the module); :func:`build` makes it."""
    style = draw(st.sampled_from(["functional", "subclassed"]))
    return {"kind": draw(st.sampled_from(["GRU", "LSTM", "SimpleRNN", "RNN(your cell)"])),
            "tuple_state": draw(st.booleans()), "bidirectional": draw(st.booleans()),
            "block": draw(st.booleans()), "style": style,
            "loss": draw(st.sampled_from(["compiled", "add_loss alone"]
                                         + (["own compute_loss"] if style == "subclassed"
                                            else []))),
            "units": draw(st.integers(2, 5)), "steps": draw(st.integers(3, 6)),
            "batch": draw(st.integers(2, 4)), "seed": draw(st.integers(0, 2**16))}


def build(drawn: dict[str, Any]) -> tuple[Any, Any, Any, str]:
    """``(model, x, y, description)``: y None where the loss reads no target."""
    import keras
    from keras import layers, ops

    kind, bidirectional, block = drawn["kind"], drawn["bidirectional"], drawn["block"]
    style, loss, units = drawn["style"], drawn["loss"], drawn["units"]
    steps, batch, seed = drawn["steps"], drawn["batch"], drawn["seed"]
    parts = _parts(keras, drawn["tuple_state"])
    description = (f"{'Bidirectional ' if bidirectional else ''}{kind}, "
                   f"{'a block of your own, ' if block else ''}{style}, loss {loss}")
    keras.utils.set_random_seed(seed)

    def recurrent() -> Any:
        layer = (layers.RNN(parts["Cell"](units), return_sequences=True) if kind.startswith("RNN")
                 else getattr(layers, kind)(units, return_sequences=True))
        return layers.Bidirectional(layer) if bidirectional else layer

    def tail() -> Any:
        return parts["Block"](3) if block else layers.GlobalAveragePooling1D()

    if style == "functional":
        inputs = keras.Input((steps, 3), name="x")
        target = keras.Input((2,), name="target")
        out = layers.Dense(2)(tail()(recurrent()(inputs)))
        if loss == "add_loss alone":
            model = keras.Model([inputs, target], parts["Penalty"]()(out, target))
        else:
            model = keras.Model(inputs, out)
    else:
        class Model(keras.Model):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(**kwargs)
                self.sequence = recurrent()
                self.summary_layer = tail()
                self.head = layers.Dense(2)

            def call(self, x: Any) -> Any:
                out = self.head(2.0 * self.summary_layer(self.sequence(x)))
                if loss == "add_loss alone":  # the model's loss is what its call adds
                    self.add_loss(ops.mean(ops.square(out)))
                return out

            if loss == "own compute_loss":
                def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None,
                                 sample_weight: Any = None, training: bool = True) -> Any:
                    total = super().compute_loss(x, y, y_pred, sample_weight,
                                                 training=training)
                    return total + 0.05 * ops.sum(ops.square(self.head.kernel))

        model = Model()
        model(np.zeros((1, steps, 3), "float32"))
    rng = np.random.default_rng(seed)
    x = {"x": rng.standard_normal((batch, steps, 3)).astype("float32")}
    y: Any = rng.standard_normal((batch, 2)).astype("float32")
    if loss == "add_loss alone":
        model.compile(optimizer="sgd")
        if style == "functional":
            x["target"] = rng.standard_normal((batch, 2)).astype("float32")
        y = None
    else:
        model.compile(loss="mse")
    return model, (x if style == "functional" else x["x"]), y, description


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_model_of_your_own_code_is_explained_exactly(tf: Any, data: Any) -> None:
    drawn = data.draw(own_code_models(), label="model")
    model, x, y, description = build(drawn)
    note(description)
    event(drawn["style"])
    event(f"loss {drawn['loss']}")
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=False), training=False)
    grads = tape.gradient(loss, model.trainable_variables)
    truth = {v.path: float(np.linalg.norm(g))
             for v, g in zip(model.trainable_variables, grads, strict=True) if g is not None}
    report = gradscope.explain(model, x=x, y=y)
    assert report.loss.value == pytest.approx(float(loss), rel=RTOL), description
    ours = {g.path: g.stats.l2 for g in report.gradients if g.stats is not None}
    assert sorted(ours) == sorted(truth), description
    for path, norm in truth.items():
        assert ours[path] == pytest.approx(norm, rel=RTOL), (description, path)
