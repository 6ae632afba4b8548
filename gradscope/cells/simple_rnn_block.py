"""SimpleRNN in the block layout: TF1 ``BasicRNNCell`` weights.

    h_t = tanh([x_t, h_{t−1}]·kernel + bias)       kernel (F+u, u), bias (u,)
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from gradscope.cells.base import (
    ConcatKernelCell,
    TensorInfo,
    concat_rows,
    glorot_uniform,
    split_blocks,
)


class SimpleRNNBlock(ConcatKernelCell):
    kind: ClassVar[str] = "simple_rnn"
    layout: ClassVar[str] = "block"
    cell_scope: ClassVar[str] = "basic_rnn_cell"

    def weights(self) -> list[TensorInfo]:
        F, u = self.input_size, self.units
        return [
            self.weight("kernel", (F + u, u), f"({self.input_term} + units {u}) × units {u}",
                        "maps [x_t, h_{t−1}] to the new state h_t", "kernel",
                        rows=concat_rows([(F, self.x_label), (u, "h_{t−1}")]),
                        columns=split_blocks(["h_t"], u)),
            self.weight("bias", (u,), f"units {u}", "bias of h_t", "bias",
                        columns=split_blocks(["h_t"], u)),
        ]

    def init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        F, u = self.input_size, self.units
        return {"kernel": glorot_uniform(rng, (F + u, u)), "bias": np.zeros(u)}

    def tf_step(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                step_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        (h,), (x_t,) = states, step_inputs
        return (tf.tanh(x_t + h @ params["kernel_h"]),)
