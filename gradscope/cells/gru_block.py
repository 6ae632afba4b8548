"""GRU in the block layout: TF1 ``GRUCell`` / ``GRUBlockCell`` weights.

    r, u = σ([x_t, h_{t−1}]·w_ru + b_ru)        w_ru (F+u, 2u), columns [r | u]
    c    = tanh([x_t, r∘h_{t−1}]·w_c + b_c)      w_c  (F+u, u)
    h_t  = u∘h_{t−1} + (1−u)∘c
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from gradscope.cells import numpy_bptt as bptt
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

    def numpy_steps(self) -> tuple[bptt.Step, bptt.StepBackward]:
        return gru_block_step, gru_block_step_backward


# -- NumPy step and step backward (float64, no TensorFlow) ---------------------------------


def gru_block_step(params: bptt.Params, x_t: np.ndarray,
                   h_prev: np.ndarray) -> tuple[np.ndarray, bptt.StepCache]:
    """One step of the block-layout GRU. w_ru (F+u, 2u) has columns [r | u].

        xh   = [x_t, h_{t−1}]
        r, u = σ(xh·w_ru + b_ru)
        xrh  = [x_t, r∘h_{t−1}]
        c    = tanh(xrh·w_c + b_c)
        h_t  = u∘h_{t−1} + (1−u)∘c
    """
    units = h_prev.shape[1]
    xh = np.concatenate([x_t, h_prev], axis=1)
    ru = bptt.sigmoid(xh @ params["w_ru"] + params["b_ru"])
    r, u = ru[:, :units], ru[:, units:]
    xrh = np.concatenate([x_t, r * h_prev], axis=1)
    c = np.tanh(xrh @ params["w_c"] + params["b_c"])
    h = u * h_prev + (1.0 - u) * c
    return h, {"x": x_t, "h_prev": h_prev, "xh": xh, "xrh": xrh, "r": r, "u": u, "c": c}


def gru_block_step_backward(params: bptt.Params, cache: bptt.StepCache, d_h: np.ndarray, *,
                            tanh_prime: bptt.TanhPrime = bptt.tanh_derivative,
                            sums: bptt.WeightSums | None = None,
                            ) -> tuple[np.ndarray | None, np.ndarray, bptt.Params]:
    """Backward through one block GRU step, given d_h, the *total* ∂L/∂h_t.

        d_u, d_c   from h_t = u∘h_{t−1} + (1−u)∘c       (see bptt.interpolate_backward)
        d_c_bar    = d_c∘(1 − c²)                          (through tanh)
        d_xrh      = d_c_bar·w_cᵀ      = [d_x part 1 | d_rh]
        d_r        = d_rh∘h_{t−1}
        d_ru_bar   = [d_r∘r∘(1−r) | d_u∘u∘(1−u)]           (through σ)
        d_xh       = d_ru_bar·w_ruᵀ    = [d_x part 2 | d_h_prev part 3]
        d_x_t      = part 1 + part 2
        d_h_{t−1}  = d_h∘u + d_rh∘r + part 3
        d_w_ru = xhᵀ·d_ru_bar,  d_b_ru = Σ_batch d_ru_bar
        d_w_c  = xrhᵀ·d_c_bar,  d_b_c  = Σ_batch d_c_bar

    Returns (d_x_t, d_h_prev, this step's weight gradients).
    """
    F = cache["x"].shape[1]
    h_prev, r, u, c = cache["h_prev"], cache["r"], cache["u"], cache["c"]
    d_u, d_c, d_h_prev = bptt.interpolate_backward(d_h, u, h_prev, c)
    d_c_bar = d_c * tanh_prime(c)
    d_xrh = d_c_bar @ params["w_c"].T
    d_rh = d_xrh[:, F:]
    d_r = d_rh * h_prev
    d_ru_bar = np.concatenate([d_r * r * (1.0 - r), d_u * u * (1.0 - u)], axis=1)
    d_xh = d_ru_bar @ params["w_ru"].T
    d_x_t = d_xrh[:, :F] + d_xh[:, :F]
    d_h_prev = d_h_prev + d_rh * r + d_xh[:, F:]
    d_params = bptt.weight_gradients(
        {"w_ru": (cache["xh"], d_ru_bar), "w_c": (cache["xrh"], d_c_bar)},
        {"b_ru": d_ru_bar.sum(axis=0), "b_c": d_c_bar.sum(axis=0)}, sums)
    return d_x_t, d_h_prev, d_params
