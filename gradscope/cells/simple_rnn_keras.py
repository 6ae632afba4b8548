"""SimpleRNN in the Keras 3 layout.

    h_t = tanh(x_t·kernel + h_{t−1}·recurrent_kernel + bias)
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


class SimpleRNNKeras(Cell):
    kind: ClassVar[str] = "simple_rnn"
    layout: ClassVar[str] = "keras"
    cell_scope: ClassVar[str] = "simple_rnn_cell"

    def weights(self) -> list[TensorInfo]:
        F, u = self.input_size, self.units
        columns = split_blocks(["h_t"], u)
        return [
            self.weight("kernel", (F, u), f"{self.input_term} × units {u}", "maps x_t to h_t",
                        "kernel", rows=(Block(0, F, self.x_label),), columns=columns),
            self.weight("recurrent_kernel", (u, u), f"units {u} × units {u}",
                        "maps h_{t−1} to h_t", "recurrent_kernel",
                        rows=(Block(0, u, "h_{t−1}"),), columns=columns),
            self.weight("bias", (u,), f"units {u}", "bias of h_t", "bias", columns=columns),
        ]

    def init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        F, u = self.input_size, self.units
        return {"kernel": glorot_uniform(rng, (F, u)),
                "recurrent_kernel": glorot_uniform(rng, (u, u)), "bias": np.zeros(u)}

    def tf_inputs(self, tf: Any, params: dict[str, Any], inputs: Any) -> tuple[Any, ...]:
        return (tf_project(tf, inputs, params["kernel"], params["bias"]),)

    def tf_step_weights(self, tf: Any, params: dict[str, Any]) -> dict[str, Any]:
        """The recurrent kernel alone: the input's kernel and the bias are read by
        :meth:`tf_inputs` (a scan given the step weights then takes the same ones whatever
        the input's width)."""
        return {"recurrent_kernel": params["recurrent_kernel"]}

    def tf_step(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                step_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        (h,), (x_t,) = states, step_inputs
        return (tf.tanh(x_t + h @ params["recurrent_kernel"]),)

    has_tangent: ClassVar[bool] = True

    def tf_step_linear(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                       step_inputs: tuple[Any, ...]
                       ) -> tuple[tuple[Any, ...], Callable[..., tuple[Any, ...]]]:
        """dh_t = (1 − h_t²)∘(v·recurrent_kernel + v_x), v_x the projected input's tangent."""
        (h,), (x_t,) = states, step_inputs
        kernel = params["recurrent_kernel"]
        new = tf.tanh(x_t + h @ kernel)
        slope = 1.0 - new ** 2

        def apply(tangents: tuple[Any, ...], inputs: tuple[Any, ...] | None = None
                  ) -> tuple[Any, ...]:
            moved = tf_block_matmul(tf, tangents[0], kernel)
            return (slope * (moved if inputs is None else moved + inputs[0]),)

        return (new,), apply

    def numpy_steps(self) -> tuple[bptt.Step, bptt.StepBackward]:
        return simple_rnn_keras_step, simple_rnn_keras_step_backward


# -- NumPy step and step backward (float64, no TensorFlow) ---------------------------------


def simple_rnn_keras_step(params: bptt.Params, x_t: np.ndarray,
                          h_prev: np.ndarray) -> tuple[np.ndarray, bptt.StepCache]:
    """h_t = tanh(x_t·kernel + h_{t−1}·recurrent_kernel + bias)."""
    h = np.tanh(x_t @ params["kernel"] + h_prev @ params["recurrent_kernel"] + params["bias"])
    return h, {"x": x_t, "h_prev": h_prev, "h": h}


def simple_rnn_keras_step_backward(params: bptt.Params, cache: bptt.StepCache, d_h: np.ndarray, *,
                                   tanh_prime: bptt.TanhPrime = bptt.tanh_derivative,
                                   sums: bptt.WeightSums | None = None,
                                   ) -> tuple[np.ndarray | None, np.ndarray, bptt.Params]:
    """d_pre = d_h∘(1 − h_t²);  d_x_t = d_pre·kernelᵀ;  d_h_{t−1} = d_pre·recurrent_kernelᵀ."""
    d_pre = d_h * tanh_prime(cache["h"])
    d_x_t = d_pre @ params["kernel"].T if bptt.wants_inputs(sums) else None
    return d_x_t, d_pre @ params["recurrent_kernel"].T, bptt.weight_gradients(
        {"kernel": (cache["x"], d_pre), "recurrent_kernel": (cache["h_prev"], d_pre)},
        {"bias": d_pre.sum(axis=0)}, sums)
