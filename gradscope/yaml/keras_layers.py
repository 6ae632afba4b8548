"""A YAML spec's model as Keras' own layers would hold it: each layer's Keras class, config
and weights in Keras' layout, in plain Python and NumPy (no TensorFlow here).

What ``gradscope diagnose CONFIG`` runs on: the dynamics are read from Keras' own cells, so
the spec's model is built from Keras' layers with the same weights (the front door hands these
to :mod:`gradscope.keras.from_layers`). Every layer of the spec has an exact Keras twin: a
TF1 GRUCell (block layout) is Keras' GRU with ``reset_after=False`` (its u is Keras' z, its
candidate sees r∘h_(t−1)); a TF1 LSTMCell is Keras' LSTM with the forget bias 1 moved into the
bias; a BasicRNNCell is a tanh SimpleRNN; the dense layers are linear. The rearrangements are
:mod:`gradscope.yaml.weights`' own (``--weights`` reads a file of the other layout with them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.weights import gru_block_to_keras, lstm_block_to_keras

#: The Keras class of each recurrent type.
KERAS_CLASSES = {"gru": "GRU", "lstm": "LSTM", "simple_rnn": "SimpleRNN"}

#: The spec's losses as Keras computes them: softmax cross entropy of logits, the mean over
#: every (example, step) position, is CategoricalCrossentropy(from_logits=True) with its
#: default reduction; the mean squared error over every element, Keras' MSE.
KERAS_LOSSES = {"softmax_cross_entropy": ("CategoricalCrossentropy", {"from_logits": True}),
                "mse": ("MeanSquaredError", {})}

#: What the diagnosis of a spec's model says of how it was built (with where its weights came
#: from).
BUILT = ("the YAML spec's model is built from Keras' own layers with the spec's weights, "
         "{weights} (a TF1 GRUCell as GRU(reset_after=False), a TF1 LSTMCell as LSTM with its "
         "forget bias 1 in the bias, a BasicRNNCell as a tanh SimpleRNN, the dense layers "
         "linear, the loss as Keras computes it), its predictions held to the spec's own "
         "NumPy pass")


@dataclass(frozen=True)
class KerasLayer:
    """One layer as Keras builds it: its class name in ``keras.layers``, its constructor's
    arguments, and its weights in the order ``layer.set_weights`` takes them."""

    class_name: str
    config: dict[str, Any]
    weights: list[np.ndarray]


def keras_layers(shapes: ModelShapes, params: dict[str, np.ndarray]) -> list[KerasLayer]:
    """The spec's layers (``shapes``: its algebra) as Keras' own, with ``params`` (by
    gradscope name) in Keras' layout and the spec's dtype."""
    spec = shapes.spec
    dtype = spec.dtype
    recurrent = list(shapes.cells)
    layers = []
    for index, cell in enumerate(recurrent):
        own = {short: np.asarray(params[f"{cell.name}/{short}"])
               for short in (info.short for info in cell.weights())}
        F, u = cell.input_size, cell.units
        options: dict[str, Any] = {}
        if cell.layout == "keras":
            arrays = own
            if cell.kind == "gru":
                options["reset_after"] = bool(getattr(cell, "reset_after", True))
        elif cell.kind == "gru":
            arrays = {k: v for k, (v, _) in gru_block_to_keras(own, F, u).items()}
            options["reset_after"] = False
        elif cell.kind == "lstm":
            arrays = {k: v for k, (v, _) in lstm_block_to_keras(own, F, u).items()}
        else:  # BasicRNNCell: one kernel over [x_t, h_(t−1)]
            arrays = {"kernel": own["kernel"][:F], "recurrent_kernel": own["kernel"][F:],
                      "bias": own["bias"]}
        last = index == len(recurrent) - 1
        layers.append(KerasLayer(
            class_name=KERAS_CLASSES[cell.kind],
            config={"units": u, "name": cell.name, "dtype": dtype,
                    "return_sequences": spec.sequence_output or not last, **options},
            weights=[np.asarray(arrays[k], dtype) for k in ("kernel", "recurrent_kernel",
                                                             "bias")]))
    for dense in shapes.dense:
        layers.append(KerasLayer(
            class_name="Dense", config={"units": dense.units, "name": dense.name,
                                        "dtype": dtype},
            weights=[np.asarray(params[f"{dense.name}/kernel"], dtype),
                     np.asarray(params[f"{dense.name}/bias"], dtype)]))
    return layers
