"""The memory a YAML-described model's run will need, by term, and the guard that refuses it
before TensorFlow is imported (see :mod:`gradscope.guard`).

The terms: weights and their gradients, the activations a backward pass keeps (every step of
every layer, gates included), and the extra work of ``check`` (float64, finite-difference
perturbations, the NumPy reference) and of ``explain --jacobians/--flow`` (every Jacobian row
carried through one backward scan)."""

from __future__ import annotations

from gradscope.guard import BASELINE_TERM, PROCESS_BASELINE, refuse_over
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.config import Spec

#: Per step and unit, how many numbers a cell's forward and backward pass hold at the peak:
#: the gates and candidates kept for the backward pass, the input projections, the outputs
#: and their gradients. Measured as the slope of peak RSS from 100 to 1000 steps (two layers
#: of 256 units, batch 32, float32, both layouts): GRU 16.7–17.0, LSTM 20.3–20.5,
#: SimpleRNN 5.1–5.6 numbers per step and unit.
KEPT_PER_UNIT = {"gru": 17, "lstm": 21, "simple_rnn": 6}
#: Forward passes of finite-difference probes at once: two ``tf.map_fn`` calls (one per thread
#: of the witness's queue) of ``PARALLEL_ITERATIONS`` = 5 iterations each
#: (gradscope/yaml/check/finite_differences.py).
FORWARD_PASSES_AT_ONCE = 10

def estimate(spec: Spec, command: str, across_time: bool = False,
             chunks: int | None = None) -> dict[str, int]:
    """Bytes by term for ``command`` ("explain" or "check") on ``spec``; the sum is the
    estimated peak resident memory of the whole process. ``chunks``: ``explain --chunks``."""
    algebra = model_shapes(spec)
    B, T, F = spec.batch_size, spec.time_steps, spec.input_size
    itemsize = 8 if command == "check" or spec.dtype == "float64" else 4
    weights = algebra.weight_count
    kept = sum(KEPT_PER_UNIT[cell.kind] * cell.units for cell in algebra.cells)
    dense = sum(layer.units for layer in algebra.dense) * (T if spec.sequence_output else 1)
    #: One forward pass's per-step numbers: the input and every layer's input projections.
    projections = F + 3 * sum(cell.units for cell in algebra.cells)
    activations = B * T * kept * itemsize + B * dense * itemsize
    terms = {
        BASELINE_TERM: PROCESS_BASELINE,
        "weights and their gradients": 3 * weights * itemsize,
        "input batch and its gradient": 2 * B * T * F * itemsize,
        "activations kept for the backward pass": activations,
    }
    if command == "check":
        # The autodiff pass also returns every state sequence and its total gradient.
        terms["per-step sequences and gradients"] = 2 * B * T * sum(
            cell.units for cell in algebra.cells) * 8
        # Finite differences: the perturbed weight rows (NumPy, TF and the loop's copy), the
        # forward passes the loop runs at once, and input copies in groups of four.
        probes = 2 * 6 * len(algebra.weights)
        terms["finite differences"] = (
            3 * probes * weights * 8
            + FORWARD_PASSES_AT_ONCE * B * T * projections * 8
            + 4 * B * T * (F + kept) * 8
        )
        terms["NumPy reference caches"] = B * T * (kept + 2 * F) * 8
    if chunks is not None and command == "explain":
        # Two float64 passes in one graph (full and truncated BPTT), each with its kept
        # activations, and the edge tensors and their gradients (T, B, units) per state. On
        # the seed model: 96 MiB estimated, 111 MiB measured (peak 676 → 787 MiB).
        state = sum(cell.units * len(cell.state_names) for cell in algebra.cells)
        terms["truncated BPTT (float64)"] = (
            2 * B * T * kept * 8 + 4 * B * T * state * 8 + 4 * weights * 8)
    if across_time:
        state = sum(cell.units * len(cell.state_names) for cell in algebra.cells)
        # Every Jacobian row (one per state unit, plus the influence rows) is carried through
        # the backward scan at once, stacked in the batch axis: each step's states and
        # projections, repeated once per row (measured: about 4 copies of them at the peak);
        # and the forward trajectory and the Jacobian blocks.
        rows = state + algebra.cells[-1].units if algebra.cells else 0
        terms["state Jacobians"] = (
            4 * rows * B * 3 * sum(cell.units for cell in algebra.cells) * itemsize
            + 2 * B * T * state * itemsize
            + 2 * B * state * state * 8
        )
    return terms


def guard(spec: Spec, command: str, limit: int | None = None, across_time: bool = False,
          chunks: int | None = None) -> None:
    """Raise ConfigError (exit 2) when the estimate is over ``limit`` (default: RAM / 4)."""
    refuse_over(estimate(spec, command, across_time, chunks), limit, command)
