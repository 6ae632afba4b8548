"""LSTM in the block layout: TF1 ``LSTMCell`` weights, gate columns [i | j | f | o].

    i, j, f, o = split([x_t, h_{t−1}]·kernel + bias)       kernel (F+u, 4u), bias (4u,)
    c_t = σ(f + forget_bias)∘c_{t−1} + σ(i)∘tanh(j)         forget_bias = 1.0, as in TF1
    h_t = σ(o)∘tanh(c_t)
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from gradscope.cells import numpy_bptt as bptt
from gradscope.cells.base import (
    ConcatKernelCell,
    TensorInfo,
    concat_rows,
    glorot_uniform,
    split_blocks,
)
from gradscope.cells.lstm import FORGET_BIASES, lstm_functions, tf_lstm_update

GATES = ["input gate i", "new input j", "forget gate f", "output gate o"]
FORGET_BIAS = FORGET_BIASES["block"]


class LSTMBlock(ConcatKernelCell):
    kind: ClassVar[str] = "lstm"
    layout: ClassVar[str] = "block"
    cell_scope: ClassVar[str] = "lstm_cell"
    state_names: ClassVar[tuple[str, ...]] = ("h0", "c0")

    def weights(self) -> list[TensorInfo]:
        F, u = self.input_size, self.units
        columns = split_blocks(GATES, u)
        return [
            self.weight(
                "kernel", (F + u, 4 * u), f"({self.input_term} + units {u}) × 4·units {u}",
                "maps [x_t, h_{t−1}] to the gates i, j, f and o",
                "kernel", rows=concat_rows([(F, self.x_label), (u, "h_{t−1}")]), columns=columns,
            ),
            self.weight(
                "bias", (4 * u,), f"4·units {u}",
                f"bias of i, j, f and o (TF1 adds forget_bias {FORGET_BIAS} to f)", "bias",
                columns=columns,
            ),
        ]

    def init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        F, u = self.input_size, self.units
        return {"kernel": glorot_uniform(rng, (F + u, 4 * u)), "bias": np.zeros(4 * u)}

    def tf_step(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                step_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return self.tf_step_probed(tf, params, states, step_inputs, ())

    def tf_step_probed(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                       step_inputs: tuple[Any, ...], probes: tuple[Any, ...]) -> tuple[Any, ...]:
        u = self.units
        (h, c), (x_t,) = states, step_inputs
        z = x_t + h @ params["kernel_h"]
        i, j, f, o = z[:, :u], z[:, u : 2 * u], z[:, 2 * u : 3 * u], z[:, 3 * u :]
        return tf_lstm_update(tf, i, f + FORGET_BIAS, j, o, c, probes)

    def numpy_functions(self) -> tuple[bptt.Forward, bptt.Backward]:
        return lstm_functions(self.layout)
