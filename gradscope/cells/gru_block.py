"""GRU in the block layout: TF1 ``GRUCell`` / ``GRUBlockCell`` weights.

    r, u = σ([x_t, h_{t−1}]·w_ru + b_ru)        w_ru (F+u, 2u), columns [r | u]
    c    = tanh([x_t, r∘h_{t−1}]·w_c + b_c)      w_c  (F+u, u)
    h_t  = u∘h_{t−1} + (1−u)∘c
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from gradscope.cells.base import (
    Cell,
    TensorInfo,
    concat_rows,
    glorot_uniform,
    split_blocks,
    tf_project,
)


class GRUBlock(Cell):
    kind: ClassVar[str] = "gru"
    layout: ClassVar[str] = "block"
    cell_scope: ClassVar[str] = "gru_cell"

    def weights(self) -> list[TensorInfo]:
        F, u = self.input_size, self.units
        rows = concat_rows([(F, self.x_label), (u, "h_{t−1}")])
        rows_c = concat_rows([(F, self.x_label), (u, "r∘h_{t−1}")])
        fan_in = f"({self.input_term} + units {u})"
        return [
            self.weight(
                "w_ru", (F + u, 2 * u), f"{fan_in} × 2·units {u}",
                "maps [x_t, h_{t−1}] to the reset gate r and the update gate u",
                "gates/kernel", rows=rows,
                columns=split_blocks(["reset gate r", "update gate u"], u),
            ),
            self.weight(
                "b_ru", (2 * u,), f"2·units {u}",
                "bias of the reset and update gates (TF1 initialises it to 1.0)",
                "gates/bias", columns=split_blocks(["reset gate r", "update gate u"], u),
            ),
            self.weight(
                "w_c", (F + u, u), f"{fan_in} × units {u}",
                "maps [x_t, r∘h_{t−1}] to the candidate c", "candidate/kernel",
                rows=rows_c, columns=split_blocks(["candidate c"], u),
            ),
            self.weight(
                "b_c", (u,), f"units {u}", "bias of the candidate c", "candidate/bias",
                columns=split_blocks(["candidate c"], u),
            ),
        ]

    def init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        F, u = self.input_size, self.units
        return {
            "w_ru": glorot_uniform(rng, (F + u, 2 * u)),
            "b_ru": np.ones(2 * u),
            "w_c": glorot_uniform(rng, (F + u, u)),
            "b_c": np.zeros(u),
        }

    def tf_inputs(self, tf: Any, params: dict[str, Any], inputs: Any) -> tuple[Any, ...]:
        # Rows 0..F-1 of both kernels see x_t; rows F.. see h_{t-1} (or r∘h_{t-1}).
        F = self.input_size
        return (tf_project(tf, inputs, params["w_ru"][:F], params["b_ru"]),
                tf_project(tf, inputs, params["w_c"][:F], params["b_c"]))

    def tf_step_weights(self, tf: Any, params: dict[str, Any]) -> dict[str, Any]:
        F = self.input_size
        return {"w_ru_h": params["w_ru"][F:], "w_c_h": params["w_c"][F:]}

    def tf_step(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                step_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        u = self.units
        (h,) = states
        x_ru_t, x_c_t = step_inputs
        ru = tf.sigmoid(x_ru_t + h @ params["w_ru_h"])
        r, z = ru[:, :u], ru[:, u:]
        c = tf.tanh(x_c_t + (r * h) @ params["w_c_h"])
        return (z * h + (1.0 - z) * c,)
