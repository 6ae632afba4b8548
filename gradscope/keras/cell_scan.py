"""An RNN's cell, one step at a time, as Keras' RNN calls it: what check's cell-steps
witness (:mod:`~gradscope.keras.check.cell_steps`) holds each step of the user's own cell on.
Across time, explain steps whole calls through :mod:`~gradscope.keras.stepped`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradscope.errors import first_line
from gradscope.keras.engine import CapturedCall
from gradscope.keras.stepped import cell_states


def not_run(exc: BaseException) -> str:
    """Why a cell was left out: the user's cell, run step by step, raised ``exc``."""
    return f"the cell could not be run step by step: {first_line(exc)}"


def cell_run(engine: Any, layer: Any, call: CapturedCall, training: bool
             ) -> tuple[Callable[[Any, list[Any]], tuple[Any, list[Any]]], Any, list[Any]]:
    """One step of the layer's cell as Keras' RNN calls it (``step(x_t, states)`` → output and
    the new states, flat), the call's input time-major in processing order, and its initial
    states."""
    tf, keras = engine.tf, engine.keras
    cell = layer.cell
    kwargs = {"training": training} if getattr(cell, "_call_has_training_arg", False) else {}

    def step(x_t: Any, states: list[Any]) -> tuple[Any, list[Any]]:
        out, new = cell(x_t, cell_states(cell, list(states)), **kwargs)
        return out, list(keras.tree.flatten(new))

    x = tf.convert_to_tensor(call.args[0])
    if getattr(layer, "go_backwards", False):
        x = tf.reverse(x, [1])
    return (step, tf.transpose(x, [1, 0, *range(2, len(x.shape))]),
            [tf.convert_to_tensor(s) for s in call.states])
