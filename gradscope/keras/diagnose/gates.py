"""The gates of a Keras GRU or LSTM along the batch's trajectory, from the cell's own weights
on every pair (x_t, h_{t−1}) a step ran on (time folded into the batch).

Keras' layouts (keras/src/layers/rnn/gru.py, lstm.py): GRU kernel columns [z | r | h], with
``reset_after`` a (2, 3u) bias whose row 1 adds to the recurrent part; LSTM [i | f | c | o].
The keep gate, the share of the old state a step keeps, is f for an LSTM and z for a GRU
(h_t = z·h_{t−1} + (1 − z)·ĥ_t). In training mode with dropout, the gates are those the step
computed: x_t and h_{t−1} multiplied by the masks the call drew, each pair by its example's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.dynamics import HIGH, LOW
from gradscope.keras.diagnose.trajectory import FOLD_ROWS, Trajectory, folded_pairs
from gradscope.keras.engine import class_label
from gradscope.keras.stepped import Masks, engine_cached, masks_for_rows
from gradscope.report.models import GateShares

#: Per cell class: its gates by name, as (column block, name), and its keep gate.
GATES = {"LSTMCell": ([(0, "input"), (1, "forget"), (3, "output")], "forget"),
         "GRUCell": ([(0, "update"), (1, "reset")], "update")}
#: The most gate pre-activations one call computes (32 MB of them in float64).
GATE_NUMBERS = 2**22


@dataclass
class GateReading:
    """Per gate, the share of its values below :data:`LOW` and above :data:`HIGH` (over
    examples, steps and units); per unit, the mean keep gate and the share of its keep-gate
    values that are saturated (either side)."""

    below: dict[str, float]
    above: dict[str, float]
    keep: str
    mean_keep: np.ndarray
    saturated: np.ndarray

    def shares(self) -> dict[str, GateShares]:
        """Each gate's shares, as the reports hold them."""
        return {name: GateShares(below_0_1=self.below[name], above_0_9=self.above[name])
                for name in self.below}


def _blocks(cell: Any) -> int:
    """How many blocks of ``units`` pre-activations a step of ``cell`` computes."""
    return 4 if class_label(cell) == "LSTMCell" else 2


def known_gates(layer: Any) -> str | None:
    """None when gradscope reads this layer's gates; else why not."""
    cell = layer.cell
    kind = class_label(cell)
    if kind == "SimpleRNNCell":  # found tried as a new user would: "not known" of Keras' own
        return "a SimpleRNN cell has no gates"
    if kind == "StackedRNNCells":
        # Found tried as a new user would: "not known for this cell (StackedRNNCells)" of a
        # stack of Keras' own GRU and LSTM cells.
        inner = ", ".join(class_label(c) for c in getattr(cell, "cells", []))
        return (f"not read for a stack of cells in one RNN ({inner}): its state joins every "
                "cell's; each cell in an RNN layer of its own has its gates read")
    if kind not in GATES:
        return f"gates not known for this cell ({kind})"
    return None


def _weights(tf: Any, cell: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """The cell's kernel, recurrent kernel and bias (None without one) in the step's dtype,
    as Keras casts them under a mixed policy (float32 variables, float16 or bfloat16
    compute)."""
    def cast(variable: Any) -> Any:
        return tf.cast(tf.convert_to_tensor(variable), dtype)

    return (cast(cell.kernel), cast(cell.recurrent_kernel),
            cast(cell.bias) if cell.use_bias else None)


def _preactivations(tf: Any, cell: Any, x: Any, h: Any, masks: Masks | None = None,
                    blocks: list[int] | None = None) -> Any:
    """The gate pre-activations (N, blocks·u), Keras' column order (a GRU's first two
    blocks, z and r), block by block; ``blocks``: only these, in this order. With ``masks``
    (dropout in training mode), as Keras' LSTMCell and GRUCell ``call`` apply them (a row of
    masks per row of x and h): gate g's block takes x·m_g and h_(t−1)·r_g, one mask for
    every gate or one per gate (``implementation=1``, a list); a rate outside (0, 1) applies
    none, and the recurrent mask only ``implementation=1`` applies."""
    kind = class_label(cell)
    units = int(cell.units)
    inputs, recurrent = masks if masks is not None else (None, None)
    if not 0.0 < float(cell.dropout) < 1.0:
        inputs = None
    if not 0.0 < float(cell.recurrent_dropout) < 1.0 or getattr(cell, "implementation",
                                                                  1) != 1:
        recurrent = None

    def times(value: Any, mask: Any, block: int) -> Any:
        if mask is None:
            return value
        mask = mask[block] if isinstance(mask, (list, tuple)) else mask
        return value * tf.cast(mask, value.dtype)

    kernel, recurrent_kernel, bias = _weights(tf, cell, x.dtype)
    parts = []
    for block in range(_blocks(cell)) if blocks is None else blocks:
        columns = slice(block * units, (block + 1) * units)
        x_part = tf.matmul(times(x, inputs, block), kernel[:, columns])
        h_part = tf.matmul(times(h, recurrent, block), recurrent_kernel[:, columns])
        if bias is not None:
            if kind == "GRUCell" and cell.reset_after:
                x_part += bias[0, columns]
                h_part += bias[1, columns]
            else:
                x_part += bias[columns]
        parts.append(x_part + h_part)
    return tf.concat(parts, axis=1)


def gate_counts(tf: Any, cell: Any, x: Any, h: Any, masks: Masks | None) -> Any:
    """Per gate, how many of its values on the pairs (x, h) (N rows each) are below
    :data:`LOW` and above :data:`HIGH`; per unit, the sum of the keep gate and how many of its
    values are saturated: summed in the graph, so that only these few numbers leave it (in
    float64, as NumPy compared them)."""
    gates, keep = GATES[class_label(cell)]
    units = int(cell.units)
    where = [name for _, name in gates].index(keep)
    dtype = cell.compute_dtype
    found = cell.recurrent_activation(_preactivations(
        tf, cell, tf.cast(x, dtype), tf.cast(h, dtype), masks, [block for block, _ in gates]))
    # Compared in float32 (float64 for a float64 cell) with the bounds a value of that dtype
    # is below or above exactly when it is below LOW or above HIGH in float64: the counts
    # NumPy's float64 comparison gives, without a float64 copy of every gate value (3.9 ->
    # 3.3 ms of CPU in a fit's diagnosis of bench/callback_overhead.py's GRUs).
    work = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    low_bound, high_bound = _bounds(work)
    found = tf.stack([found[:, j * units:(j + 1) * units] for j in range(len(gates))], 0)
    found = tf.cast(found, work)
    low, high = found < low_bound, found > high_bound
    return (tf.reduce_sum(tf.cast(low, tf.float64), axis=[1, 2]),
            tf.reduce_sum(tf.cast(high, tf.float64), axis=[1, 2]),
            tf.reduce_sum(tf.cast(found[where], tf.float64), axis=0),
            tf.reduce_sum(tf.cast(low[where] | high[where], tf.float64), axis=0))


def _bounds(dtype: Any, below: float = LOW, above: float = HIGH) -> tuple[Any, Any]:
    """The values ``lo``, ``hi`` of ``dtype`` for which ``v < lo`` exactly when ``v < below``
    and ``v > hi`` exactly when ``v > above`` compared in float64, for every ``v`` of
    ``dtype``: the least value of it not below ``below``, the greatest not above ``above``."""
    low, high = dtype(below), dtype(above)
    if float(low) < below:
        low = np.nextafter(low, dtype(np.inf))
    if float(high) > above:
        high = np.nextafter(high, dtype(-np.inf))
    return low, high


def gate_reading(cell: Any, counts: list[Any], rows: int) -> GateReading:
    """The :class:`GateReading` of :func:`gate_counts`' four sums over ``rows`` pairs."""
    gates, keep = GATES[class_label(cell)]
    units = int(cell.units)
    below, above, keep_sum, saturated = (np.asarray(c, np.float64) for c in counts)
    total = max(rows * units, 1)
    names = [name for _, name in gates]
    return GateReading(below={n: float(b / total) for n, b in zip(names, below, strict=True)},
                       above={n: float(a / total) for n, a in zip(names, above, strict=True)},
                       keep=keep, mean_keep=keep_sum / max(rows, 1),
                       saturated=saturated / max(rows, 1))


def count_gates(engine: Any, cell: Any, x: np.ndarray, h: np.ndarray,
                masks: Masks | None = None, examples: np.ndarray | None = None
                ) -> GateReading:
    """The :class:`GateReading` of ``cell`` (a Keras GRU or LSTM's) on the pairs (x, h),
    N rows each, with the step's dropout ``masks`` (a row per example; ``examples``: each
    pair's example) or None; counted by one traced function kept on ``engine``
    (:func:`~gradscope.keras.stepped.engine_cached`), as many rows at a time as
    :data:`GATE_NUMBERS` pre-activations (every pair of a fit's small layer in one call: each
    call costs about a millisecond, whatever its size)."""
    from gradscope._tf import native_stderr_silenced, without_grappler

    tf = engine.tf
    units = int(cell.units)

    def traced() -> Any:
        @tf.function(autograph=False, reduce_retracing=True)
        def counted(x: Any, h: Any, masks: Masks | None) -> Any:
            return gate_counts(tf, cell, x, h, masks)

        return counted

    counted = engine_cached(engine, ("gate counts", id(cell)), traced)
    sums = [np.zeros(n) for n in (len(GATES[class_label(cell)][0]),) * 2 + (units, units)]
    rows_at_once = max(FOLD_ROWS, GATE_NUMBERS // (_blocks(cell) * units))
    with native_stderr_silenced(), without_grappler():
        for first in range(0, len(x), rows_at_once):
            part = slice(first, first + rows_at_once)
            found = counted(tf.convert_to_tensor(x[part]), tf.convert_to_tensor(h[part]),
                            masks_for_rows(tf, masks,
                                           None if examples is None else examples[part]))
            sums = [total + np.asarray(value) for total, value in zip(sums, found, strict=True)]
    return gate_reading(cell, sums, len(x))


def read_gates(engine: Any, path: Trajectory) -> GateReading:
    """The gates of ``path``'s cell (a Keras GRU or LSTM: :func:`known_gates` is None) on
    every pair (x_t, h_(t−1)) a step ran on."""
    x, previous, rows = folded_pairs(path)
    return count_gates(engine, path.layer.cell, x, previous[0], path.masks, rows[:, 0])
