"""LSTM in the Keras 3 layout: ``kernel``, ``recurrent_kernel``, ``bias``; gates [i | f | c | o].

    i, f, c̃, o = split(x_t·kernel + h_{t−1}·recurrent_kernel + bias)
    c_t = σ(f)∘c_{t−1} + σ(i)∘tanh(c̃)
    h_t = σ(o)∘tanh(c_t)

Keras initialises the forget block of the bias to 1 (unit_forget_bias).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from gradscope.cells import numpy_bptt as bptt
from gradscope.cells.base import (
    Block,
    Cell,
    TensorInfo,
    glorot_uniform,
    split_blocks,
    tf_block_matmul,
    tf_project,
)
from gradscope.cells.lstm import lstm_functions, tf_lstm_update

GATES = ["input gate i", "forget gate f", "candidate c̃", "output gate o"]


class LSTMKeras(Cell):
    kind: ClassVar[str] = "lstm"
    layout: ClassVar[str] = "keras"
    cell_scope: ClassVar[str] = "lstm_cell"
    state_names: ClassVar[tuple[str, ...]] = ("h0", "c0")

    def weights(self) -> list[TensorInfo]:
        F, u = self.input_size, self.units
        columns = split_blocks(GATES, u)
        return [
            self.weight("kernel", (F, 4 * u), f"{self.input_term} × 4·units {u}",
                        "maps x_t to the gates i, f, c̃ and o", "kernel",
                        rows=(Block(0, F, self.x_label),), columns=columns),
            self.weight("recurrent_kernel", (u, 4 * u), f"units {u} × 4·units {u}",
                        "maps h_{t−1} to the gates i, f, c̃ and o", "recurrent_kernel",
                        rows=(Block(0, u, "h_{t−1}"),), columns=columns),
            self.weight("bias", (4 * u,), f"4·units {u}",
                        "bias of i, f, c̃ and o (Keras starts the f block at 1)", "bias",
                        columns=columns),
        ]

    def init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        F, u = self.input_size, self.units
        bias = np.zeros(4 * u)
        bias[u : 2 * u] = 1.0
        return {"kernel": glorot_uniform(rng, (F, 4 * u)),
                "recurrent_kernel": glorot_uniform(rng, (u, 4 * u)), "bias": bias}

    def tf_inputs(self, tf: Any, params: dict[str, Any], inputs: Any) -> tuple[Any, ...]:
        return (tf_project(tf, inputs, params["kernel"], params["bias"]),)

    def tf_step_weights(self, tf: Any, params: dict[str, Any]) -> dict[str, Any]:
        """The recurrent kernel alone: the input's kernel and the bias are read by
        :meth:`tf_inputs` (a scan given the step weights then takes the same ones whatever
        the input's width)."""
        return {"recurrent_kernel": params["recurrent_kernel"]}

    def tf_step(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                step_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return self.tf_step_probed(tf, params, states, step_inputs, ())

    def tf_step_probed(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                       step_inputs: tuple[Any, ...], probes: tuple[Any, ...]) -> tuple[Any, ...]:
        u = self.units
        (h, c), (x_t,) = states, step_inputs
        z = x_t + h @ params["recurrent_kernel"]
        i, f, g, o = z[:, :u], z[:, u : 2 * u], z[:, 2 * u : 3 * u], z[:, 3 * u :]
        return tf_lstm_update(tf, i, f, g, o, c, probes)

    has_tangent: ClassVar[bool] = True

    def tf_step_linear(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                       step_inputs: tuple[Any, ...]
                       ) -> tuple[tuple[Any, ...], Callable[..., tuple[Any, ...]]]:
        """dz = v_h·U (+ v_x, the tangent of the projected input); dc_t = σ'(f)∘df∘c + σ(f)∘v_c
        + σ'(i)∘di∘tanh(g) + σ(i)∘tanh'(g)∘dg; dh_t = σ'(o)∘do∘tanh(c_t) + σ(o)∘tanh'(c_t)∘dc_t."""
        u = self.units
        (h, c), (x_t,) = states, step_inputs
        kernel = params["recurrent_kernel"]
        z = x_t + h @ kernel
        i, f, o = (tf.sigmoid(z[:, k * u : (k + 1) * u]) for k in (0, 1, 3))
        g = tf.tanh(z[:, 2 * u : 3 * u])
        c_new = f * c + i * g
        squashed = tf.tanh(c_new)
        by_f, by_i, by_g = f * (1.0 - f) * c, i * (1.0 - i) * g, i * (1.0 - g ** 2)
        by_o, by_c = o * (1.0 - o) * squashed, o * (1.0 - squashed ** 2)

        def apply(tangents: tuple[Any, ...], inputs: tuple[Any, ...] | None = None
                  ) -> tuple[Any, ...]:
            v_h, v_c = tangents
            dz = tf_block_matmul(tf, v_h, kernel)
            if inputs is not None:
                dz = dz + inputs[0]
            d_c = (by_f * dz[..., u : 2 * u] + f * v_c + by_i * dz[..., :u]
                   + by_g * dz[..., 2 * u : 3 * u])
            return by_o * dz[..., 3 * u :] + by_c * d_c, d_c

        return (o * squashed, c_new), apply

    def numpy_functions(self) -> tuple[bptt.Forward, bptt.Backward]:
        return lstm_functions(self.layout)
