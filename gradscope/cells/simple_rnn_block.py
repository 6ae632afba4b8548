"""SimpleRNN in the block layout: TF1 ``BasicRNNCell`` weights.

    h_t = tanh([x_t, h_{t−1}]·kernel + bias)       kernel (F+u, u), bias (u,)
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

    def numpy_steps(self) -> tuple[bptt.Step, bptt.StepBackward]:
        return simple_rnn_block_step, simple_rnn_block_step_backward


# -- NumPy step and step backward (float64, no TensorFlow) ---------------------------------


def simple_rnn_block_step(params: bptt.Params, x_t: np.ndarray,
                          h_prev: np.ndarray) -> tuple[np.ndarray, bptt.StepCache]:
    """h_t = tanh([x_t, h_{t−1}]·kernel + bias);  kernel (F+u, u)."""
    xh = np.concatenate([x_t, h_prev], axis=1)
    h = np.tanh(xh @ params["kernel"] + params["bias"])
    return h, {"x": x_t, "xh": xh, "h": h}


def simple_rnn_block_step_backward(params: bptt.Params, cache: bptt.StepCache, d_h: np.ndarray, *,
                                   tanh_prime: bptt.TanhPrime = bptt.tanh_derivative,
                                   sums: bptt.WeightSums | None = None,
                                   ) -> tuple[np.ndarray | None, np.ndarray, bptt.Params]:
    """d_pre = d_h∘(1 − h_t²);  [d_x_t | d_h_{t−1}] = d_pre·kernelᵀ;  d_kernel = xhᵀ·d_pre."""
    F = cache["x"].shape[1]
    d_pre = d_h * tanh_prime(cache["h"])
    d_xh = d_pre @ params["kernel"].T
    return d_xh[:, :F], d_xh[:, F:], bptt.weight_gradients(
        {"kernel": (cache["xh"], d_pre)}, {"bias": d_pre.sum(axis=0)}, sums)
