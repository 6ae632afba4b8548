"""Truncated BPTT with carried gradients (``check --chunks K``): the witness of the seed
question, how to carry ∂L/∂h0 into the previous truncated batch.

The time axis is cut into chunks, as a user does who trains on truncated batches: each chunk
runs forward from the previous chunk's final states, then the chunks are differentiated from
the last to the first, one ``tape.gradient`` each, whose ``grad_ys`` for the chunk's final
states are the next chunk's ∂L/∂(initial states). Summed over the chunks, the weight gradients
must equal full BPTT exactly: the chain rule is only regrouped, so a disagreement beyond
float64 rounding means the carry is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope._tf import native_stderr_silenced
from gradscope.chunks import chunk_lengths
from gradscope.gradcheck import WitnessResult, relative_error
from gradscope.yaml.check.context import CheckContext

WITNESS = "tbptt_carry"

Shape = tuple[int, ...]


@dataclass(frozen=True)
class CarryBoundary:
    """The boundary where chunk k starts (at time index ``step``) and chunk k−1 ends.

    ``ys`` are chunk k−1's final states, named for the step that produced them
    (``gru_1/h[t=49]``); ``grad_ys`` are the gradients carried into chunk k−1's backward pass,
    one per ``y`` and in the same order (``∂L/∂gru_1/h[t=49]``): chunk k's ∂L/∂(initial
    states). ``grad_ys_norm`` holds their L2 norms.

    A carried gradient is the part of ∂L/∂h_t that flows back through the recurrence into
    later chunks. It is not the total ∂L/∂h_t of ``Pass.sequence_gradients``, which also holds
    the paths that stay inside chunk k−1 (h_t feeding the next layer or the dense layer at
    step t); chunk k−1's own backward pass adds those. It depends on ``step`` only, not on how
    the rest of the sequence is cut.
    """

    step: int
    ys: list[tuple[str, Shape]]
    grad_ys: list[tuple[str, Shape]]
    grad_ys_norm: list[float]


@dataclass(frozen=True)
class CarryResult:
    """One :class:`WitnessResult` per weight and per initial state, and how time was cut."""

    results: list[WitnessResult]
    boundaries: list[CarryBoundary]
    chunk_lengths: list[int]


@dataclass(frozen=True)
class TruncatedGradients:
    """The gradients the chunked backward pass produced, as NumPy arrays.

    ``weights`` are summed over the chunks; ``states`` is ∂L/∂(initial states) out of chunk 0.
    ``carried[k]`` holds, for the boundary where chunk k+1 starts, the gradient carried into
    chunk k, keyed by the initial-state name (``gru_1/h0``).
    """

    weights: dict[str, np.ndarray]
    states: dict[str, np.ndarray]
    carried: list[dict[str, np.ndarray]]
    chunk_lengths: list[int]


def carry_witness(ctx: CheckContext, chunks: int) -> CarryResult:
    """Chunked backward passes with carried ``grad_ys``, compared with full BPTT."""
    lengths = chunk_lengths(int(ctx.batch.x.shape[1]), chunks)
    ctx.progress(f"truncated BPTT carry: {chunks} chunk{'s' if chunks != 1 else ''}")
    truncated = truncated_gradients(ctx, lengths)
    return CarryResult(
        results=compare_with_full_bptt(ctx, truncated),
        boundaries=_boundaries(ctx, truncated),
        chunk_lengths=list(lengths),
    )


def compare_with_full_bptt(ctx: CheckContext,
                           truncated: TruncatedGradients) -> list[WitnessResult]:
    """One verdict per weight (summed over the chunks) and per initial state (out of chunk 0)."""
    rtol = ctx.tolerance(WITNESS)
    count = len(truncated.chunk_lengths)
    chunks = f"{count} chunk{'s' if count != 1 else ''} of {_describe_lengths(truncated)} steps"
    results: list[WitnessResult] = []
    for source, expected_all, what in (
        (truncated.weights, ctx.autodiff.weight_gradients, "summed over"),
        (truncated.states, ctx.autodiff.state_gradients, "carried back through"),
    ):
        for name, value in source.items():
            results.append(
                _compare(name, value, expected_all.get(name), rtol, f"{what} {chunks}")
            )
    return results


def truncated_gradients(ctx: CheckContext, lengths: list[int],
                        carry: bool = True) -> TruncatedGradients:
    """Forward through the chunks, then backward from the last, carrying ∂L/∂(states).

    With ``carry=False`` every chunk's final states get zero ``grad_ys``: plain truncated
    BPTT, what a user gets who does not carry the gradients (it differs from full BPTT).
    """
    time_steps = int(ctx.batch.x.shape[1])
    if not lengths or min(lengths) < 1 or sum(lengths) != time_steps:
        raise ValueError(f"chunk lengths {lengths} do not cut {time_steps} steps into chunks")
    tf = ctx.tf
    step_functions = _ChunkFunctions(ctx)
    params = {name: tf.constant(value, dtype=tf.float64) for name, value in ctx.params.items()}
    x_all = tf.constant(ctx.batch.x, dtype=tf.float64)
    y_all = tf.constant(ctx.batch.y, dtype=tf.float64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    total = int(starts[-1])
    sequence_output = ctx.shapes.spec.sequence_output
    pairs = _state_pairs(ctx)

    with native_stderr_silenced():
        # 1. Forward: every chunk's initial states.
        states = {name: tf.constant(ctx.batch.initial_states[name], dtype=tf.float64)
                  for name, _ in pairs}
        initial_states = [states]
        for k in range(len(lengths) - 1):
            finals = step_functions.forward(params, x_all[:, starts[k]:starts[k + 1]], states)
            states = {name: finals[final] for name, final in pairs}
            initial_states.append(states)

        # 2. Backward, last chunk first.
        weight_sums: dict[str, Any] = {}
        carried = {name: tf.zeros_like(value) for name, value in initial_states[-1].items()}
        carried_out: list[dict[str, np.ndarray]] = []
        for k in reversed(range(len(lengths))):
            x = x_all[:, starts[k]:starts[k + 1]]
            if sequence_output:
                y = y_all[:, starts[k]:starts[k + 1]]
                scale = lengths[k] / total
            else:
                # Only the last step has a prediction: the loss lives in the last chunk.
                y = y_all
                scale = 1.0 if k == len(lengths) - 1 else 0.0
            ctx.progress(f"truncated BPTT carry: chunk {k + 1}/{len(lengths)} backward")
            weights, state_grads = step_functions.backward(
                params, x, y, initial_states[k], carried, tf.constant(scale, dtype=tf.float64)
            )
            for name, value in weights.items():
                weight_sums[name] = value if name not in weight_sums else weight_sums[name] + value
            if k > 0:
                carried_out.append({name: value.numpy() for name, value in state_grads.items()})
            if carry:
                carried = state_grads
            else:
                carried = {name: tf.zeros_like(value) for name, value in state_grads.items()}

    return TruncatedGradients(
        weights={name: value.numpy() for name, value in weight_sums.items()},
        states={name: value.numpy() for name, value in state_grads.items()},
        carried=list(reversed(carried_out)),
        chunk_lengths=list(lengths),
    )


class _ChunkFunctions:
    """The two ``tf.function``s of one model, traced once each: the time axis is left open.

    ``backward`` is one chunk's share of the loss and its final states, differentiated with
    one ``grad_y`` per ``y``; the model's own forward (``tf.scan``) runs inside it.
    """

    def __init__(self, ctx: CheckContext) -> None:
        tf = self.tf = ctx.tf
        self.engine = ctx.engine
        self.pairs = _state_pairs(ctx)
        batch, _, features = ctx.batch.x.shape
        f64 = tf.float64
        params = {name: tf.TensorSpec(value.shape, f64) for name, value in ctx.params.items()}
        states = {name: tf.TensorSpec(ctx.batch.initial_states[name].shape, f64)
                  for name, _ in self.pairs}
        x = tf.TensorSpec((batch, None, features), f64)
        y_shape = ctx.batch.y.shape
        if ctx.shapes.spec.sequence_output:
            y = tf.TensorSpec((y_shape[0], None, *y_shape[2:]), f64)
        else:
            y = tf.TensorSpec(y_shape, f64)
        scale = tf.TensorSpec((), f64)
        self.forward = tf.function(self._forward, input_signature=[params, x, states],
                                   autograph=False)
        self.backward = tf.function(
            self._backward, input_signature=[params, x, y, states, states, scale],
            autograph=False,
        )

    def _forward(self, params: dict[str, Any], x: Any, states: dict[str, Any]) -> dict[str, Any]:
        _, finals = self.engine.forward(params, x, states)
        return {final: finals[final] for _, final in self.pairs}

    def _backward(self, params: dict[str, Any], x: Any, y: Any, states: dict[str, Any],
                  carried: dict[str, Any], scale: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        tf = self.tf
        weight_names = list(params)
        state_names = [name for name, _ in self.pairs]
        with tf.GradientTape() as tape:
            tape.watch([params, states])
            predictions, finals = self.engine.forward(params, x, states)
            chunk_loss = scale * self.engine.loss(predictions, y)
        ys = [chunk_loss] + [finals[final] for _, final in self.pairs]
        grad_ys = [tf.ones_like(chunk_loss)] + [carried[name] for name in state_names]
        gradients = tape.gradient(
            ys,
            [params[name] for name in weight_names] + [states[name] for name in state_names],
            output_gradients=grad_ys,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        count = len(weight_names)
        return (dict(zip(weight_names, gradients[:count], strict=True)),
                dict(zip(state_names, gradients[count:], strict=True)))


def _state_pairs(ctx: CheckContext) -> list[tuple[str, str]]:
    """(initial-state name, final-state name) for every recurrent state: gru_1/h0, gru_1/h_T."""
    return [(f"{cell.name}/{state}", f"{cell.name}/{state[0]}_T")
            for cell in ctx.shapes.cells for state in cell.state_names]


def _boundaries(ctx: CheckContext, truncated: TruncatedGradients) -> list[CarryBoundary]:
    out = []
    starts = np.cumsum(truncated.chunk_lengths)[:-1]
    for start, carried in zip(starts, truncated.carried, strict=True):
        step = int(start)
        ys, grad_ys, norms = [], [], []
        for initial, _ in _state_pairs(ctx):
            layer, state = initial.rsplit("/", 1)
            name = f"{layer}/{state[0]}[t={step - 1}]"
            shape = tuple(int(n) for n in carried[initial].shape)
            ys.append((name, shape))
            grad_ys.append((f"∂L/∂{name}", shape))
            norms.append(float(np.linalg.norm(carried[initial])))
        out.append(CarryBoundary(step=step, ys=ys, grad_ys=grad_ys, grad_ys_norm=norms))
    return out


def _describe_lengths(truncated: TruncatedGradients) -> str:
    lengths = truncated.chunk_lengths
    if len(set(lengths)) == 1:
        return str(lengths[0])
    return "+".join(map(str, lengths))


def _compare(name: str, value: np.ndarray, expected: np.ndarray | None, rtol: float,
             detail: str) -> WitnessResult:
    if expected is None:
        return WitnessResult(WITNESS, name, None, rtol, False,
                             "full BPTT has no gradient for this tensor (disconnected)")
    if value.shape != expected.shape:
        return WitnessResult(WITNESS, name, None, rtol, False,
                             f"shape {value.shape} differs from full BPTT's {expected.shape}")
    error = relative_error(value, expected)
    passed = bool(np.isfinite(error) and error <= rtol)
    return WitnessResult(WITNESS, name, error, rtol, passed, f"{detail}, vs full BPTT")
