"""GRU in the Keras 3 layout: ``kernel``, ``recurrent_kernel``, ``bias``; gate columns [z | r | h].

    z = σ(x_t·W_z + b_z + h_{t−1}·U_z + b'_z)      (update gate; Keras calls it z)
    r = σ(x_t·W_r + b_r + h_{t−1}·U_r + b'_r)      (reset gate)
    reset_after=True:  ĥ = tanh(x_t·W_h + b_h + r∘(h_{t−1}·U_h + b'_h))
    reset_after=False: ĥ = tanh(x_t·W_h + b_h + (r∘h_{t−1})·U_h)
    h_t = z∘h_{t−1} + (1−z)∘ĥ

With reset_after=True the bias is (2, 3u): row 0 is the input bias b, row 1 the recurrent b'.
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

    has_tangent: ClassVar[bool] = True

    def tf_step_linear(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                       step_inputs: tuple[Any, ...]
                       ) -> tuple[tuple[Any, ...], Callable[..., tuple[Any, ...]]]:
        """dz = z(1−z)∘(v·U_z + v_x,z), dr = r(1−r)∘(v·U_r + v_x,r); reset_after:
        dĥ = (1−ĥ²)∘(v_x,h + dr∘inner_h + r∘(v·U_h)), else dĥ = (1−ĥ²)∘(v_x,h + (dr∘h + r∘v)·U_h);
        dh_t = dz∘(h − ĥ) + z∘v + (1−z)∘dĥ (v_x: the projected input's tangent, if given)."""
        u = self.units
        (h,), (x_t,) = states, step_inputs
        x_z, x_r, x_h = x_t[:, :u], x_t[:, u : 2 * u], x_t[:, 2 * u :]
        if self.reset_after:
            kernel = params["recurrent"]
            inner = h @ kernel + params["recurrent_bias"]
            z = tf.sigmoid(x_z + inner[:, :u])
            r = tf.sigmoid(x_r + inner[:, u : 2 * u])
            candidate = tf.tanh(x_h + r * inner[:, 2 * u :])
        else:
            kernel = params["recurrent_zr"]
            inner = h @ kernel
            z = tf.sigmoid(x_z + inner[:, :u])
            r = tf.sigmoid(x_r + inner[:, u:])
            candidate = tf.tanh(x_h + (r * h) @ params["recurrent_h"])
        by_z, by_r, slope = z * (1.0 - z) * (h - candidate), r * (1.0 - r), 1.0 - candidate ** 2

        def apply(tangents: tuple[Any, ...], inputs: tuple[Any, ...] | None = None
                  ) -> tuple[Any, ...]:
            (v,) = tangents
            moved = tf_block_matmul(tf, v, kernel)
            d_z, d_r = moved[..., :u], moved[..., u : 2 * u]
            if inputs is not None:
                d_z, d_r = d_z + inputs[0][..., :u], d_r + inputs[0][..., u : 2 * u]
            if self.reset_after:
                d_pre = by_r * d_r * inner[:, 2 * u :] + r * moved[..., 2 * u :]
            else:
                d_pre = tf_block_matmul(tf, by_r * d_r * h + r * v, params["recurrent_h"])
            if inputs is not None:
                d_pre = d_pre + inputs[0][..., 2 * u :]
            d_candidate = slope * d_pre
            return (by_z * d_z + z * v + (1.0 - z) * d_candidate,)

        return (z * h + (1.0 - z) * candidate,), apply

    @property
    def key(self) -> str:
        return super().key + ("" if self.reset_after else "_reset_before")

    def numpy_steps(self) -> tuple[bptt.Step, bptt.StepBackward]:
        if self.reset_after:
            return gru_keras_step, gru_keras_step_backward
        return gru_keras_reset_before_step, gru_keras_reset_before_step_backward


# -- NumPy, reset_after=True (the Keras default): float64, no TensorFlow -------------------


def gru_keras_step(params: bptt.Params, x_t: np.ndarray,
                   h_prev: np.ndarray) -> tuple[np.ndarray, bptt.StepCache]:
    """One step of the Keras GRU with reset_after=True. Columns [z | r | h]; bias (2, 3u).

        x_proj = x_t·kernel + bias[0]                   (the input part of z, r, ĥ)
        inner  = h_{t−1}·recurrent_kernel + bias[1]     (the recurrent part)
        z   = σ(x_proj_z + inner_z)                      (update gate)
        r   = σ(x_proj_r + inner_r)                      (reset gate)
        ĥ   = tanh(x_proj_h + r∘inner_h)                 (reset applied after the matmul)
        h_t = z∘h_{t−1} + (1−z)∘ĥ
    """
    units = h_prev.shape[1]
    x_proj = x_t @ params["kernel"] + params["bias"][0]
    inner = h_prev @ params["recurrent_kernel"] + params["bias"][1]
    zr = bptt.sigmoid(x_proj[:, : 2 * units] + inner[:, : 2 * units])
    z, r = zr[:, :units], zr[:, units:]
    inner_h = inner[:, 2 * units :]
    candidate = np.tanh(x_proj[:, 2 * units :] + r * inner_h)
    h = z * h_prev + (1.0 - z) * candidate
    return h, {"x": x_t, "h_prev": h_prev, "z": z, "r": r, "inner_h": inner_h,
               "candidate": candidate}


def gru_keras_step_backward(params: bptt.Params, cache: bptt.StepCache, d_h: np.ndarray, *,
                            tanh_prime: bptt.TanhPrime = bptt.tanh_derivative,
                            sums: bptt.WeightSums | None = None,
                            ) -> tuple[np.ndarray | None, np.ndarray, bptt.Params]:
    """Backward through one Keras GRU step (reset_after=True), given the total ∂L/∂h_t.

        d_z, d_ĥ     from h_t = z∘h_{t−1} + (1−z)∘ĥ       (see bptt.interpolate_backward)
        d_ĥ_bar      = d_ĥ∘(1 − ĥ²)                        (through tanh)
        d_z_bar      = d_z∘z∘(1−z)
        d_r_bar      = (d_ĥ_bar∘inner_h)∘r∘(1−r)
        d_x_proj     = [d_z_bar | d_r_bar | d_ĥ_bar]
        d_inner      = [d_z_bar | d_r_bar | d_ĥ_bar∘r]
        d_x_t        = d_x_proj·kernelᵀ
        d_h_{t−1}    = d_h∘z + d_inner·recurrent_kernelᵀ
        d_kernel = x_tᵀ·d_x_proj,  d_recurrent_kernel = h_{t−1}ᵀ·d_inner
        d_bias   = [Σ_batch d_x_proj ; Σ_batch d_inner]        (2, 3u)
    """
    h_prev, z, r, candidate = cache["h_prev"], cache["z"], cache["r"], cache["candidate"]
    d_z, d_candidate, d_h_prev = bptt.interpolate_backward(d_h, z, h_prev, candidate)
    d_candidate_bar = d_candidate * tanh_prime(candidate)
    d_z_bar = d_z * z * (1.0 - z)
    d_r_bar = d_candidate_bar * cache["inner_h"] * r * (1.0 - r)
    d_x_proj = np.concatenate([d_z_bar, d_r_bar, d_candidate_bar], axis=1)
    d_inner = np.concatenate([d_z_bar, d_r_bar, d_candidate_bar * r], axis=1)
    d_x_t = d_x_proj @ params["kernel"].T if bptt.wants_inputs(sums) else None
    d_h_prev = d_h_prev + d_inner @ params["recurrent_kernel"].T
    d_params = bptt.weight_gradients(
        {"kernel": (cache["x"], d_x_proj), "recurrent_kernel": (h_prev, d_inner)},
        {"bias": np.stack([d_x_proj.sum(axis=0), d_inner.sum(axis=0)])}, sums)
    return d_x_t, d_h_prev, d_params


# -- NumPy, reset_after=False --------------------------------------------------------------


def gru_keras_reset_before_step(params: bptt.Params, x_t: np.ndarray,
                                h_prev: np.ndarray) -> tuple[np.ndarray, bptt.StepCache]:
    """One step of the Keras GRU with reset_after=False. Columns [z | r | h]; bias (3u,).

        x_proj = x_t·kernel + bias
        z, r   = σ(x_proj_zr + h_{t−1}·U_zr)        U_zr = recurrent_kernel[:, :2u]
        ĥ      = tanh(x_proj_h + (r∘h_{t−1})·U_h)   U_h  = recurrent_kernel[:, 2u:]
        h_t    = z∘h_{t−1} + (1−z)∘ĥ
    """
    units = h_prev.shape[1]
    recurrent = params["recurrent_kernel"]
    x_proj = x_t @ params["kernel"] + params["bias"]
    zr = bptt.sigmoid(x_proj[:, : 2 * units] + h_prev @ recurrent[:, : 2 * units])
    z, r = zr[:, :units], zr[:, units:]
    rh = r * h_prev
    candidate = np.tanh(x_proj[:, 2 * units :] + rh @ recurrent[:, 2 * units :])
    h = z * h_prev + (1.0 - z) * candidate
    return h, {"x": x_t, "h_prev": h_prev, "z": z, "r": r, "rh": rh, "candidate": candidate}


def gru_keras_reset_before_step_backward(
    params: bptt.Params, cache: bptt.StepCache, d_h: np.ndarray, *,
    tanh_prime: bptt.TanhPrime = bptt.tanh_derivative, sums: bptt.WeightSums | None = None,
) -> tuple[np.ndarray | None, np.ndarray, bptt.Params]:
    """Backward through one Keras GRU step (reset_after=False), given the total ∂L/∂h_t.

        d_z, d_ĥ     from h_t = z∘h_{t−1} + (1−z)∘ĥ       (see bptt.interpolate_backward)
        d_ĥ_bar      = d_ĥ∘(1 − ĥ²)
        d_rh         = d_ĥ_bar·U_hᵀ
        d_zr_bar     = [d_z∘z∘(1−z) | (d_rh∘h_{t−1})∘r∘(1−r)]
        d_x_proj     = [d_zr_bar | d_ĥ_bar]
        d_x_t        = d_x_proj·kernelᵀ
        d_h_{t−1}    = d_h∘z + d_rh∘r + d_zr_bar·U_zrᵀ
        d_kernel = x_tᵀ·d_x_proj,  d_bias = Σ_batch d_x_proj
        d_recurrent_kernel = [h_{t−1}ᵀ·d_zr_bar | (r∘h_{t−1})ᵀ·d_ĥ_bar]
    """
    units = cache["h_prev"].shape[1]
    recurrent = params["recurrent_kernel"]
    h_prev, z, r, candidate = cache["h_prev"], cache["z"], cache["r"], cache["candidate"]
    d_z, d_candidate, d_h_prev = bptt.interpolate_backward(d_h, z, h_prev, candidate)
    d_candidate_bar = d_candidate * tanh_prime(candidate)
    d_rh = d_candidate_bar @ recurrent[:, 2 * units :].T
    d_zr_bar = np.concatenate([d_z * z * (1.0 - z), d_rh * h_prev * r * (1.0 - r)], axis=1)
    d_x_proj = np.concatenate([d_zr_bar, d_candidate_bar], axis=1)
    d_x_t = d_x_proj @ params["kernel"].T if bptt.wants_inputs(sums) else None
    d_h_prev = d_h_prev + d_rh * r + d_zr_bar @ recurrent[:, : 2 * units].T
    # The recurrent kernel's two column blocks have different left factors: summed per step.
    d_params = bptt.weight_gradients({"kernel": (cache["x"], d_x_proj)}, {
        "recurrent_kernel": np.concatenate(
            [h_prev.T @ d_zr_bar, cache["rh"].T @ d_candidate_bar], axis=1
        ),
        "bias": d_x_proj.sum(axis=0),
    }, sums)
    return d_x_t, d_h_prev, d_params
