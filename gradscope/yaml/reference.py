"""The NumPy reference of a YAML config's whole model, float64, without TensorFlow (the
``numpy_reference`` witness of ``gradscope check``): each cell's NumPy forward pass and BPTT
(:meth:`~gradscope.cells.base.Cell.numpy_functions`), the dense layers and the loss::

    x (B, T, F) → recurrent layer 1 → … → recurrent layer n → dense → … → dense → mean loss

Every recurrent layer hands its whole output sequence h_1 … h_T to the next one. The dense
layers (linear, no activation) are applied at every step, or to h_T only when the last
recurrent layer has ``return_sequences: false``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gradscope.cells.base import Cell
from gradscope.cells.numpy_bptt import Backward, Cache, Params
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.data import Batch


@dataclass(frozen=True)
class ReferenceResult:
    """The mean loss, every gradient by gradscope name, and the final states.

    ``gradients`` holds every weight (``gru_1/w_ru``, ``dense_1/kernel``, …), every initial
    state (``gru_1/h0``) and ``"x"``, the input gradient (B, T, F). ``final_states`` holds
    h_T of every recurrent layer, keyed ``gru_1/h_T``.
    """

    loss: float
    gradients: dict[str, np.ndarray] = field(default_factory=dict)
    final_states: dict[str, np.ndarray] = field(default_factory=dict)


# -- dense layers and losses ----------------------------------------------------------------


def forward_dense(kernel: np.ndarray, bias: np.ndarray, a: np.ndarray) -> np.ndarray:
    """y = a·kernel + bias at every leading position: a is (B, T, n) or (B, n)."""
    return a @ kernel + bias


def backward_dense(kernel: np.ndarray, a: np.ndarray,
                   d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward through y = a·kernel + bias. The same weights serve every position, so

        d_a      = d_y·kernelᵀ
        d_kernel = Σ_positions aᵀ·d_y     (B×T positions, or B with return_sequences false)
        d_bias   = Σ_positions d_y

    Returns (d_a, d_kernel, d_bias).
    """
    flat_a = a.reshape(-1, a.shape[-1])
    flat_d_y = d_y.reshape(-1, d_y.shape[-1])
    return d_y @ kernel.T, flat_a.T @ flat_d_y, flat_d_y.sum(axis=0)


def mse_loss(prediction: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """L = mean over every element of (p − y)²;  ∂L/∂p = 2(p − y) / (number of elements)."""
    error = prediction - target
    return float(np.mean(error**2)), 2.0 * error / error.size


def softmax_cross_entropy_loss(logits: np.ndarray,
                               target: np.ndarray) -> tuple[float, np.ndarray]:
    """L = mean over the positions (B×T, or B) of −Σ_l y_l·log softmax(logits)_l.

        ∂L/∂logits = (softmax(logits)·Σ_l y_l − y) / N      (N positions)

    which is the familiar (softmax − y)/N when each target row sums to 1 (one-hot or
    probabilities).
    """
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    positions = logits.size // logits.shape[-1]
    loss = -float(np.sum(target * log_softmax)) / positions
    d_logits = np.exp(log_softmax) * target.sum(axis=-1, keepdims=True) - target
    return loss, d_logits / positions


LOSSES: dict[str, Callable[[np.ndarray, np.ndarray], tuple[float, np.ndarray]]] = {
    "mse": mse_loss,
    "softmax_cross_entropy": softmax_cross_entropy_loss,
}


# -- the whole model ------------------------------------------------------------------------


@dataclass
class _ForwardPass:
    """What the forward pass keeps for the backward pass."""

    loss: float
    d_prediction: np.ndarray  # ∂L/∂(the last layer's output)
    cell_params: list[Params]  # per recurrent layer, by short name
    caches: list[Cache]  # per recurrent layer
    dense_inputs: list[np.ndarray]  # the input of every dense layer
    final_states: dict[str, np.ndarray]
    prediction: np.ndarray  # the last layer's output


def _cell_params(cell: Cell, params: dict[str, np.ndarray]) -> Params:
    return {info.short: np.asarray(params[info.name], dtype=np.float64)
            for info in cell.weights()}


def _initial_states(cell: Cell, batch: Batch) -> list[np.ndarray]:
    """h0 (and c0) from the batch, or zeros when the batch does not supply them."""
    states = []
    for state in cell.state_names:
        value = batch.initial_states.get(f"{cell.name}/{state}")
        states.append(np.zeros((batch.x.shape[0], cell.units)) if value is None
                      else np.asarray(value, dtype=np.float64))
    return states


def predictions(shapes: ModelShapes, params: dict[str, np.ndarray], x: np.ndarray
                ) -> np.ndarray:
    """What the model predicts for ``x`` (B, T, F), from zero initial states: (B, T, L), or
    (B, L) where the last recurrent layer hands on its last step only."""
    return _forward(shapes, params, Batch(x=x, y=np.zeros(0)), with_loss=False).prediction


def _forward(shapes: ModelShapes, params: dict[str, np.ndarray], batch: Batch,
             with_loss: bool = True) -> _ForwardPass:
    """Recurrent layers, then the dense head, then the loss."""
    sequence = np.asarray(batch.x, dtype=np.float64)
    cell_params: list[Params] = []
    caches: list[Cache] = []
    final_states: dict[str, np.ndarray] = {}
    for cell in shapes.cells:
        forward, _ = cell.numpy_functions()
        cell_params.append(_cell_params(cell, params))
        sequence, cache = forward(cell_params[-1], sequence, *_initial_states(cell, batch))
        caches.append(cache)
        final_states[f"{cell.name}/h_T"] = sequence[:, -1]
        if "c0" in cell.state_names:
            final_states[f"{cell.name}/c_T"] = cache[-1]["c"]
    output = sequence if shapes.spec.sequence_output else sequence[:, -1]
    dense_inputs: list[np.ndarray] = []
    for layer in shapes.dense:
        dense_inputs.append(output)
        output = forward_dense(np.asarray(params[f"{layer.name}/kernel"], dtype=np.float64),
                               np.asarray(params[f"{layer.name}/bias"], dtype=np.float64),
                               output)
    loss, d_prediction = (LOSSES[shapes.spec.loss](output, np.asarray(batch.y, dtype=np.float64))
                          if with_loss else (float("nan"), np.zeros_like(output)))
    return _ForwardPass(loss, d_prediction, cell_params, caches, dense_inputs, final_states,
                        output)


def _backward(shapes: ModelShapes, params: dict[str, np.ndarray], forward: _ForwardPass,
              backward_for: Callable[[Cell], Backward] | None = None) -> dict[str, np.ndarray]:
    """The dense head backwards, then every recurrent layer's BPTT, top layer first."""
    gradients: dict[str, np.ndarray] = {}
    d_output = forward.d_prediction
    for layer, a in reversed(list(zip(shapes.dense, forward.dense_inputs, strict=True))):
        kernel = np.asarray(params[f"{layer.name}/kernel"], dtype=np.float64)
        d_output, d_kernel, d_bias = backward_dense(kernel, a, d_output)
        gradients[f"{layer.name}/kernel"], gradients[f"{layer.name}/bias"] = d_kernel, d_bias
    if shapes.spec.sequence_output:
        d_h_seq = d_output
    else:  # the head saw h_T only: every other step gets nothing from above
        d_h_seq = np.zeros((*d_output.shape[:1], shapes.spec.time_steps, d_output.shape[-1]))
        d_h_seq[:, -1] = d_output
    layers = zip(shapes.cells, forward.cell_params, forward.caches, strict=True)
    for cell, cell_params, cache in reversed(list(layers)):
        backward = cell.numpy_functions()[1] if backward_for is None else backward_for(cell)
        d_x_seq, d_initial, d_cell = backward(cell_params, cache, d_h_seq, None)
        assert d_x_seq is not None  # asked for (inputs=True): the layer below's from above
        d_h_seq = d_x_seq
        d_states = d_initial if isinstance(d_initial, tuple) else (d_initial,)
        for state, d_state in zip(cell.state_names, d_states, strict=True):
            gradients[f"{cell.name}/{state}"] = d_state
        gradients.update({f"{cell.name}/{short}": value for short, value in d_cell.items()})
    gradients["x"] = d_h_seq  # the first layer's d_x_seq
    return gradients


def reference_gradients(shapes: ModelShapes, params: dict[str, np.ndarray], batch: Batch,
                        backward_for: Callable[[Cell], Backward] | None = None,
                        ) -> ReferenceResult:
    """The mean loss and every gradient of the model ``shapes`` describes, in float64.

    ``params`` are keyed by gradscope name (``gru_1/w_ru``, ``dense_1/kernel``); ``batch``
    supplies x (B, T, F), the targets and the initial states (zeros where missing).
    ``backward_for``, if given, supplies each recurrent layer's BPTT in place of the right one:
    :mod:`gradscope.yaml.check.variants` computes known wrong gradients with it.
    """
    forward = _forward(shapes, params, batch)
    gradients = _backward(shapes, params, forward, backward_for)
    order = [info.name for info in (*shapes.weights, *shapes.states)] + ["x"]
    return ReferenceResult(
        loss=forward.loss,
        gradients={name: gradients[name] for name in order},
        final_states=forward.final_states,
    )


def reference_loss(shapes: ModelShapes, params: dict[str, np.ndarray], batch: Batch) -> float:
    """The mean loss alone (the forward pass), e.g. for finite differences."""
    return _forward(shapes, params, batch).loss
