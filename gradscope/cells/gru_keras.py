"""GRU in the Keras 3 layout: ``kernel``, ``recurrent_kernel``, ``bias``; gate columns [z | r | h].

    z = σ(x_t·W_z + b_z + h_{t−1}·U_z + b'_z)      (update gate; Keras calls it z)
    r = σ(x_t·W_r + b_r + h_{t−1}·U_r + b'_r)      (reset gate)
    reset_after=True:  ĥ = tanh(x_t·W_h + b_h + r∘(h_{t−1}·U_h + b'_h))
    reset_after=False: ĥ = tanh(x_t·W_h + b_h + (r∘h_{t−1})·U_h)
    h_t = z∘h_{t−1} + (1−z)∘ĥ

With reset_after=True the bias is (2, 3u): row 0 is the input bias b, row 1 the recurrent b'.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from gradscope.cells.base import Block, Cell, TensorInfo, glorot_uniform, split_blocks, tf_project

GATES = ["update gate z", "reset gate r", "candidate ĥ"]


class GRUKeras(Cell):
    kind: ClassVar[str] = "gru"
    layout: ClassVar[str] = "keras"
    cell_scope: ClassVar[str] = "gru_cell"

    @property
    def reset_after(self) -> bool:
        return bool(self.options.get("reset_after", True))

    def weights(self) -> list[TensorInfo]:
        F, u = self.input_size, self.units
        columns = split_blocks(GATES, u)
        if self.reset_after:
            bias = self.weight(
                "bias", (2, 3 * u), f"2 × 3·units {u}",
                "biases of z, r and ĥ (reset_after: the recurrent bias sits inside r∘(…))",
                "bias", rows=(Block(0, 1, "input bias"), Block(1, 2, "recurrent bias")),
                columns=columns,
            )
        else:
            bias = self.weight(
                "bias", (3 * u,), f"3·units {u}", "biases of z, r and ĥ", "bias",
                columns=columns,
            )
        return [
            self.weight(
                "kernel", (F, 3 * u), f"{self.input_term} × 3·units {u}",
                "maps x_t to the update gate z, the reset gate r and the candidate ĥ",
                "kernel", rows=(Block(0, F, self.x_label),), columns=columns,
            ),
            self.weight(
                "recurrent_kernel", (u, 3 * u), f"units {u} × 3·units {u}",
                "maps h_{t−1} to z, r and ĥ"
                + ("" if self.reset_after else " (the ĥ block sees r∘h_{t−1})"),
                "recurrent_kernel", rows=(Block(0, u, "h_{t−1}"),), columns=columns,
            ),
            bias,
        ]

    def init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        F, u = self.input_size, self.units
        bias_shape = (2, 3 * u) if self.reset_after else (3 * u,)
        return {
            "kernel": glorot_uniform(rng, (F, 3 * u)),
            "recurrent_kernel": glorot_uniform(rng, (u, 3 * u)),
            "bias": np.zeros(bias_shape),
        }

    def tf_inputs(self, tf: Any, params: dict[str, Any], inputs: Any) -> tuple[Any, ...]:
        bias = params["bias"]
        input_bias = bias[0] if self.reset_after else bias
        return (tf_project(tf, inputs, params["kernel"], input_bias),)  # (T, B, 3u)

    def tf_step_weights(self, tf: Any, params: dict[str, Any]) -> dict[str, Any]:
        u, recurrent = self.units, params["recurrent_kernel"]
        if self.reset_after:
            return {"recurrent": recurrent, "recurrent_bias": params["bias"][1]}
        return {"recurrent_zr": recurrent[:, : 2 * u], "recurrent_h": recurrent[:, 2 * u :]}

    def tf_step(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                step_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        u = self.units
        (h,), (x_t,) = states, step_inputs
        x_z, x_r, x_h = x_t[:, :u], x_t[:, u : 2 * u], x_t[:, 2 * u :]
        if self.reset_after:
            inner = h @ params["recurrent"] + params["recurrent_bias"]
            z = tf.sigmoid(x_z + inner[:, :u])
            r = tf.sigmoid(x_r + inner[:, u : 2 * u])
            candidate = tf.tanh(x_h + r * inner[:, 2 * u :])
        else:
            inner = h @ params["recurrent_zr"]
            z = tf.sigmoid(x_z + inner[:, :u])
            r = tf.sigmoid(x_r + inner[:, u:])
            candidate = tf.tanh(x_h + (r * h) @ params["recurrent_h"])
        return (z * h + (1.0 - z) * candidate,)
