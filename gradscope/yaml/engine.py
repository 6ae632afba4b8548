"""The TensorFlow engine: one ``tf.function`` that runs the spec's model forward over time with
``tf.scan`` (never a Python loop over steps) and returns the loss, every weight gradient, every
initial-state gradient and the final states, from one backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope._tf import import_tensorflow, native_stderr_silenced
from gradscope.cells.base import tf_project
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.data import Batch


@dataclass(frozen=True)
class Pass:
    """What one forward/backward pass produced, as NumPy arrays keyed by gradscope names."""

    loss: float
    weight_gradients: dict[str, np.ndarray | None]
    state_gradients: dict[str, np.ndarray | None]
    final_states: dict[str, np.ndarray | None]
    input_gradient: np.ndarray | None  # None when run with watch_input=False
    #: With ``per_step=True``: every state sequence ``gru_1/h`` (B, T, u) ...
    sequences: dict[str, np.ndarray] | None = None
    #: ... and the total ∂L/∂h_t for every step, recurrence included, same names and shapes.
    sequence_gradients: dict[str, np.ndarray] | None = None


class Engine:
    """Builds the model of ``shapes`` in TensorFlow, in ``dtype``; traced once per shape."""

    def __init__(self, shapes: ModelShapes, dtype: str | None = None) -> None:
        self.shapes = shapes
        self.dtype = dtype or shapes.spec.dtype
        self.tf = import_tensorflow()
        self._loss_and_gradients = self.tf.function(self._loss_and_gradients_graph, autograph=False)

    # -- graph pieces (run inside tf.function) -------------------------------------------------

    def forward(self, params: dict[str, Any], x: Any, states: dict[str, Any],
                probes: dict[str, Any] | None = None,
                sequences: dict[str, Any] | None = None,
                start: int = 0, cuts: Any = None,
                edges: dict[str, Any] | None = None,
                trajectories: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """x (B, T, F) → predictions (B, T, L) or (B, L), and the final states by name.

        Final states are named like the initial ones with ``_T``: ``gru_1/h_T``. ``probes``
        (time-major zeros named ``gru_1/h``) expose the total ∂L/∂h_t; ``sequences``, if given,
        collects each layer's time-major output. With ``start`` > 0 the pass begins at that
        recurrent layer (index into ``shapes.cells``; their count: the dense layers only), and
        ``x`` (B, T, ·) is the output sequence of the layer before it; only the weights and
        states of the layers run are read. ``cuts`` (T,) and ``edges`` (time-major zeros
        named like the initial states, ``gru_1/h0``) cut the recurrence for truncated BPTT and
        expose what it carries: see :meth:`Cell.tf_sequence`. ``trajectories``, if given,
        collects every state's time-major sequence by state name (``gru_1/h``, ``lstm_1/c``).
        """
        tf = self.tf
        sequence = tf.transpose(x, [1, 0, 2])  # time-major for tf.scan
        finals: dict[str, Any] = {}
        for cell in self.shapes.cells[start:]:
            cell_params = {info.short: params[info.name] for info in cell.weights()}
            initial = tuple(states[f"{cell.name}/{s}"] for s in cell.state_names)
            cell_probes = None
            if probes is not None:
                cell_probes = tuple(probes[f"{cell.name}/{s[0]}"] for s in cell.state_names)
            cell_edges = None
            if edges is not None:
                cell_edges = tuple(edges[f"{cell.name}/{s}"] for s in cell.state_names)
            states_run: list[Any] | None = [] if trajectories is not None else None
            sequence, final = cell.tf_sequence(tf, cell_params, sequence, initial, cell_probes,
                                               cuts=cuts, edges=cell_edges,
                                               trajectory=states_run)
            if trajectories is not None and states_run is not None:
                for state, values in zip(cell.state_names, states_run, strict=True):
                    trajectories[f"{cell.name}/{state[0]}"] = values
            if sequences is not None:
                sequences[f"{cell.name}/h"] = sequence
            for state, value in zip(cell.state_names, final, strict=True):
                finals[f"{cell.name}/{state[0]}_T"] = value
        outputs = sequence if self.shapes.spec.sequence_output else sequence[-1]
        for layer in self.shapes.dense:
            outputs = tf_project(tf, outputs, params[f"{layer.name}/kernel"],
                                 params[f"{layer.name}/bias"])
        if self.shapes.spec.sequence_output:
            outputs = tf.transpose(outputs, [1, 0, 2])
        return outputs, finals

    def loss(self, predictions: Any, targets: Any) -> Any:
        tf = self.tf
        if self.shapes.spec.loss == "softmax_cross_entropy":
            return tf.reduce_mean(
                tf.nn.softmax_cross_entropy_with_logits(labels=targets, logits=predictions)
            )
        return tf.reduce_mean(tf.square(predictions - targets))

    def probe_zeros(self, x: Any) -> dict[str, Any]:
        """Time-major zeros, one per state sequence: see :meth:`forward`."""
        tf = self.tf
        steps, batch = tf.shape(x)[1], tf.shape(x)[0]
        return {
            f"{cell.name}/{state[0]}": tf.zeros([steps, batch, cell.units], dtype=x.dtype)
            for cell in self.shapes.cells for state in cell.state_names
        }

    def _loss_and_gradients_graph(self, params: dict[str, Any], x: Any, y: Any,
                                  states: dict[str, Any], per_step: bool,
                                  watch_input: bool) -> dict[str, Any]:
        tf = self.tf
        probes = self.probe_zeros(x) if per_step else {}
        sequences: dict[str, Any] = {}
        inputs = [x] if watch_input else []
        with tf.GradientTape() as tape:
            tape.watch([params, states, inputs, probes])
            predictions, finals = self.forward(params, x, states, probes or None, sequences)
            loss = self.loss(predictions, y)
        weight_gradients, state_gradients, input_gradients, probe_gradients = tape.gradient(
            loss, [params, states, inputs, probes]
        )
        input_gradient = input_gradients[0] if watch_input else None
        out = {"loss": loss, "weights": weight_gradients, "states": state_gradients,
               "x": input_gradient, "finals": finals}
        if per_step:
            batch_major = {name: tf.transpose(v, [1, 0, 2]) for name, v in sequences.items()}
            out["sequences"] = batch_major
            out["sequence_gradients"] = {
                name: tf.transpose(v, [1, 0, 2]) for name, v in probe_gradients.items()
            }
        return out

    # -- NumPy in, NumPy out --------------------------------------------------------------------

    def run(self, params: dict[str, np.ndarray], batch: Batch, per_step: bool = False,
            watch_input: bool = True) -> Pass:
        """One forward and backward pass, watching every weight, every initial state and x.

        ``per_step`` also returns every state sequence and the total ∂L/∂h_t at every step;
        ``watch_input=False`` skips ∂L/∂x (explain does not report it).
        """
        tf = self.tf
        cast = {name: tf.constant(value, dtype=self.dtype) for name, value in params.items()}
        states = {
            name: tf.constant(value, dtype=self.dtype)
            for name, value in batch.initial_states.items()
        }
        with native_stderr_silenced():
            x = tf.constant(batch.x, dtype=self.dtype)
            y = tf.constant(batch.y, dtype=self.dtype)
            out = self._loss_and_gradients(cast, x, y, states, per_step, watch_input)
        return Pass(
            loss=float(out["loss"].numpy()),
            weight_gradients=_to_numpy(out["weights"]),
            state_gradients=_to_numpy(out["states"]),
            final_states=_to_numpy(out["finals"]),
            input_gradient=None if out["x"] is None else out["x"].numpy(),
            sequences=_to_numpy(out["sequences"]) if per_step else None,  # type: ignore[arg-type]
            sequence_gradients=(
                _to_numpy(out["sequence_gradients"]) if per_step else None  # type: ignore[arg-type]
            ),
        )


def _to_numpy(tensors: dict[str, Any]) -> dict[str, np.ndarray | None]:
    """None stays None: a disconnected gradient is reported by the caller, not hidden here."""
    return {name: (None if t is None else t.numpy()) for name, t in tensors.items()}
