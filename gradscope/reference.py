"""A from-scratch NumPy forward pass and backpropagation through time (BPTT), float64 throughout.

This module never imports TensorFlow. It is the independent witness that TF autodiff is
checked against (the ``numpy_reference`` witness of ``gradscope check``), and it is written to
be read: it is the derivation users ask for when they write their own BPTT.

The model a spec describes::

    x (B, T, F) → recurrent layer 1 → … → recurrent layer n → dense → … → dense → mean loss

Every recurrent layer hands its whole output sequence h_1 … h_T to the next one. The dense
layers (linear, no activation) are applied at every step, or to h_T only when the last
recurrent layer has ``return_sequences: false``.

The one line every hand-written BPTT must get right. h_t feeds two places: the layer above
at step t, and the same layer at step t+1. So its total gradient is the sum

    ∂L/∂h_t = (gradient from above at step t) + (gradient carried back from step t+1)
    d_h     =  d_h_seq[t]                     +  d_h_next

Forgetting ``d_h_next`` gives gradients that are right at the last step only.

Shapes: the public functions take and return batch-major arrays (B, T, ·), like the rest of
gradscope. Inside a layer's backward pass, ``d_h_seq[t]`` is the (B, u) slice of step t.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradscope.cells.base import Cell
from gradscope.cells.numpy_bptt import (  # noqa: F401  (read from here by other modules)
    Backward,
    Cache,
    Forward,
    Params,
    Sketch,
    StepBackward,
    StepCache,
    TanhPrime,
    WeightSums,
    add_into,
    bptt,
    interpolate_backward,
    sigmoid,
    single_state,
    tanh_derivative,
    time_major,
    wants_inputs,
    weight_gradients,
    zeros_like,
)
from gradscope.errors import ConfigError

# -- GRU, block layout (TF1 GRUCell / GRUBlockCell) -----------------------------------------


def gru_block_step(params: Params, x_t: np.ndarray,
                   h_prev: np.ndarray) -> tuple[np.ndarray, StepCache]:
    """One step of the block-layout GRU. w_ru (F+u, 2u) has columns [r | u].

        xh   = [x_t, h_{t−1}]
        r, u = σ(xh·w_ru + b_ru)
        xrh  = [x_t, r∘h_{t−1}]
        c    = tanh(xrh·w_c + b_c)
        h_t  = u∘h_{t−1} + (1−u)∘c
    """
    units = h_prev.shape[1]
    xh = np.concatenate([x_t, h_prev], axis=1)
    ru = sigmoid(xh @ params["w_ru"] + params["b_ru"])
    r, u = ru[:, :units], ru[:, units:]
    xrh = np.concatenate([x_t, r * h_prev], axis=1)
    c = np.tanh(xrh @ params["w_c"] + params["b_c"])
    h = u * h_prev + (1.0 - u) * c
    return h, {"x": x_t, "h_prev": h_prev, "xh": xh, "xrh": xrh, "r": r, "u": u, "c": c}


def gru_block_step_backward(params: Params, cache: StepCache, d_h: np.ndarray, *,
                            tanh_prime: TanhPrime = tanh_derivative,
                            sums: WeightSums | None = None,
                            ) -> tuple[np.ndarray | None, np.ndarray, Params]:
    """Backward through one block GRU step, given d_h, the *total* ∂L/∂h_t.

        d_u, d_c   from h_t = u∘h_{t−1} + (1−u)∘c       (see interpolate_backward)
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
    d_u, d_c, d_h_prev = interpolate_backward(d_h, u, h_prev, c)
    d_c_bar = d_c * tanh_prime(c)
    d_xrh = d_c_bar @ params["w_c"].T
    d_rh = d_xrh[:, F:]
    d_r = d_rh * h_prev
    d_ru_bar = np.concatenate([d_r * r * (1.0 - r), d_u * u * (1.0 - u)], axis=1)
    d_xh = d_ru_bar @ params["w_ru"].T
    d_x_t = d_xrh[:, :F] + d_xh[:, :F]
    d_h_prev = d_h_prev + d_rh * r + d_xh[:, F:]
    d_params = weight_gradients(
        {"w_ru": (cache["xh"], d_ru_bar), "w_c": (cache["xrh"], d_c_bar)},
        {"b_ru": d_ru_bar.sum(axis=0), "b_c": d_c_bar.sum(axis=0)}, sums)
    return d_x_t, d_h_prev, d_params




# -- GRU, Keras layout, reset_after=True (the Keras default) --------------------------------


def gru_keras_step(params: Params, x_t: np.ndarray,
                   h_prev: np.ndarray) -> tuple[np.ndarray, StepCache]:
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
    zr = sigmoid(x_proj[:, : 2 * units] + inner[:, : 2 * units])
    z, r = zr[:, :units], zr[:, units:]
    inner_h = inner[:, 2 * units :]
    candidate = np.tanh(x_proj[:, 2 * units :] + r * inner_h)
    h = z * h_prev + (1.0 - z) * candidate
    return h, {"x": x_t, "h_prev": h_prev, "z": z, "r": r, "inner_h": inner_h,
               "candidate": candidate}


def gru_keras_step_backward(params: Params, cache: StepCache, d_h: np.ndarray, *,
                            tanh_prime: TanhPrime = tanh_derivative,
                            sums: WeightSums | None = None,
                            ) -> tuple[np.ndarray | None, np.ndarray, Params]:
    """Backward through one Keras GRU step (reset_after=True), given the total ∂L/∂h_t.

        d_z, d_ĥ     from h_t = z∘h_{t−1} + (1−z)∘ĥ       (see interpolate_backward)
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
    d_z, d_candidate, d_h_prev = interpolate_backward(d_h, z, h_prev, candidate)
    d_candidate_bar = d_candidate * tanh_prime(candidate)
    d_z_bar = d_z * z * (1.0 - z)
    d_r_bar = d_candidate_bar * cache["inner_h"] * r * (1.0 - r)
    d_x_proj = np.concatenate([d_z_bar, d_r_bar, d_candidate_bar], axis=1)
    d_inner = np.concatenate([d_z_bar, d_r_bar, d_candidate_bar * r], axis=1)
    d_x_t = d_x_proj @ params["kernel"].T if wants_inputs(sums) else None
    d_h_prev = d_h_prev + d_inner @ params["recurrent_kernel"].T
    d_params = weight_gradients(
        {"kernel": (cache["x"], d_x_proj), "recurrent_kernel": (h_prev, d_inner)},
        {"bias": np.stack([d_x_proj.sum(axis=0), d_inner.sum(axis=0)])}, sums)
    return d_x_t, d_h_prev, d_params


# -- GRU, Keras layout, reset_after=False ---------------------------------------------------


def gru_keras_reset_before_step(params: Params, x_t: np.ndarray,
                                h_prev: np.ndarray) -> tuple[np.ndarray, StepCache]:
    """One step of the Keras GRU with reset_after=False. Columns [z | r | h]; bias (3u,).

        x_proj = x_t·kernel + bias
        z, r   = σ(x_proj_zr + h_{t−1}·U_zr)        U_zr = recurrent_kernel[:, :2u]
        ĥ      = tanh(x_proj_h + (r∘h_{t−1})·U_h)   U_h  = recurrent_kernel[:, 2u:]
        h_t    = z∘h_{t−1} + (1−z)∘ĥ
    """
    units = h_prev.shape[1]
    recurrent = params["recurrent_kernel"]
    x_proj = x_t @ params["kernel"] + params["bias"]
    zr = sigmoid(x_proj[:, : 2 * units] + h_prev @ recurrent[:, : 2 * units])
    z, r = zr[:, :units], zr[:, units:]
    rh = r * h_prev
    candidate = np.tanh(x_proj[:, 2 * units :] + rh @ recurrent[:, 2 * units :])
    h = z * h_prev + (1.0 - z) * candidate
    return h, {"x": x_t, "h_prev": h_prev, "z": z, "r": r, "rh": rh, "candidate": candidate}


def gru_keras_reset_before_step_backward(
    params: Params, cache: StepCache, d_h: np.ndarray, *,
    tanh_prime: TanhPrime = tanh_derivative, sums: WeightSums | None = None,
) -> tuple[np.ndarray | None, np.ndarray, Params]:
    """Backward through one Keras GRU step (reset_after=False), given the total ∂L/∂h_t.

        d_z, d_ĥ     from h_t = z∘h_{t−1} + (1−z)∘ĥ       (see interpolate_backward)
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
    d_z, d_candidate, d_h_prev = interpolate_backward(d_h, z, h_prev, candidate)
    d_candidate_bar = d_candidate * tanh_prime(candidate)
    d_rh = d_candidate_bar @ recurrent[:, 2 * units :].T
    d_zr_bar = np.concatenate([d_z * z * (1.0 - z), d_rh * h_prev * r * (1.0 - r)], axis=1)
    d_x_proj = np.concatenate([d_zr_bar, d_candidate_bar], axis=1)
    d_x_t = d_x_proj @ params["kernel"].T if wants_inputs(sums) else None
    d_h_prev = d_h_prev + d_rh * r + d_zr_bar @ recurrent[:, : 2 * units].T
    # The recurrent kernel's two column blocks have different left factors: summed per step.
    d_params = weight_gradients({"kernel": (cache["x"], d_x_proj)}, {
        "recurrent_kernel": np.concatenate(
            [h_prev.T @ d_zr_bar, cache["rh"].T @ d_candidate_bar], axis=1
        ),
        "bias": d_x_proj.sum(axis=0),
    }, sums)
    return d_x_t, d_h_prev, d_params


# -- SimpleRNN, block layout (TF1 BasicRNNCell) and Keras layout ---------------------------


def simple_rnn_block_step(params: Params, x_t: np.ndarray,
                          h_prev: np.ndarray) -> tuple[np.ndarray, StepCache]:
    """h_t = tanh([x_t, h_{t−1}]·kernel + bias);  kernel (F+u, u)."""
    xh = np.concatenate([x_t, h_prev], axis=1)
    h = np.tanh(xh @ params["kernel"] + params["bias"])
    return h, {"x": x_t, "xh": xh, "h": h}


def simple_rnn_block_step_backward(params: Params, cache: StepCache, d_h: np.ndarray, *,
                                   tanh_prime: TanhPrime = tanh_derivative,
                                   sums: WeightSums | None = None,
                                   ) -> tuple[np.ndarray | None, np.ndarray, Params]:
    """d_pre = d_h∘(1 − h_t²);  [d_x_t | d_h_{t−1}] = d_pre·kernelᵀ;  d_kernel = xhᵀ·d_pre."""
    F = cache["x"].shape[1]
    d_pre = d_h * tanh_prime(cache["h"])
    d_xh = d_pre @ params["kernel"].T
    return d_xh[:, :F], d_xh[:, F:], weight_gradients(
        {"kernel": (cache["xh"], d_pre)}, {"bias": d_pre.sum(axis=0)}, sums)


def simple_rnn_keras_step(params: Params, x_t: np.ndarray,
                          h_prev: np.ndarray) -> tuple[np.ndarray, StepCache]:
    """h_t = tanh(x_t·kernel + h_{t−1}·recurrent_kernel + bias)."""
    h = np.tanh(x_t @ params["kernel"] + h_prev @ params["recurrent_kernel"] + params["bias"])
    return h, {"x": x_t, "h_prev": h_prev, "h": h}


def simple_rnn_keras_step_backward(params: Params, cache: StepCache, d_h: np.ndarray, *,
                                   tanh_prime: TanhPrime = tanh_derivative,
                                   sums: WeightSums | None = None,
                                   ) -> tuple[np.ndarray | None, np.ndarray, Params]:
    """d_pre = d_h∘(1 − h_t²);  d_x_t = d_pre·kernelᵀ;  d_h_{t−1} = d_pre·recurrent_kernelᵀ."""
    d_pre = d_h * tanh_prime(cache["h"])
    d_x_t = d_pre @ params["kernel"].T if wants_inputs(sums) else None
    return d_x_t, d_pre @ params["recurrent_kernel"].T, weight_gradients(
        {"kernel": (cache["x"], d_pre), "recurrent_kernel": (cache["h_prev"], d_pre)},
        {"bias": d_pre.sum(axis=0)}, sums)


# -- LSTM: two states, h and c ----------------------------------------------------------------

#: Column blocks of the fused gate pre-activations: TF1 LSTMCell [i | j | f | o] with
#: forget_bias 1.0 added to f; Keras [i | f | c̃ | o] with no forget bias.
LSTM_LAYOUTS = {"block": ("i", "j", "f", "o", 1.0), "keras": ("i", "j", "f", "o", 0.0)}


def lstm_step(params: Params, x_t: np.ndarray, h_prev: np.ndarray, c_prev: np.ndarray,
              layout: str, x_part: np.ndarray | None = None,
              ) -> tuple[np.ndarray, np.ndarray, StepCache]:
    """One LSTM step (j is the new input, c̃ in Keras' words).

        z          = [x_t, h_{t−1}]·kernel + bias              (block)
                   = x_t·kernel + h_{t−1}·recurrent_kernel + bias   (keras)
        c_t        = σ(f + forget_bias)∘c_{t−1} + σ(i)∘tanh(j)
        h_t        = σ(o)∘tanh(c_t)

    ``x_part``: x_t's part of z with the bias, x_t·kernel[:F] + bias (block) or x_t·kernel +
    bias (keras), where the caller took it for many steps in one product
    (:func:`lstm_input_parts`); z is then x_part + h_{t−1}·(the rest of the weights).
    """
    u = h_prev.shape[1]
    if x_part is None:
        x_part = lstm_input_parts(params, x_t[:, None], layout)[:, 0]
    if layout == "block":
        xh = np.concatenate([x_t, h_prev], axis=1)
        z = h_prev @ params["kernel"][x_t.shape[1]:]
        z += x_part
        i, j, f, o = (z[:, k * u:(k + 1) * u] for k in range(4))
    else:
        xh = x_t
        z = h_prev @ params["recurrent_kernel"]
        z += x_part
        i, f, j, o = (z[:, k * u:(k + 1) * u] for k in range(4))
    si, tj, so = sigmoid(i), np.tanh(j), sigmoid(o)
    sf = sigmoid(f + LSTM_LAYOUTS[layout][4])
    c = sf * c_prev + si * tj
    tc = np.tanh(c)
    h = so * tc
    cache = {"x": x_t, "xh": xh, "h_prev": h_prev, "c_prev": c_prev, "si": si, "tj": tj,
             "sf": sf, "so": so, "tc": tc, "c": c}
    return h, c, cache


def lstm_input_parts(params: Params, x_seq: np.ndarray, layout: str) -> np.ndarray:
    """x_t's part of every step's z, with the bias (see :func:`lstm_step`), for x_seq (B, n,
    F): one product for the n steps, (B, n, 4u)."""
    B, n, F = x_seq.shape
    kernel = params["kernel"][:F] if layout == "block" else params["kernel"]
    parts = x_seq.reshape(B * n, F) @ kernel
    parts += params["bias"]
    return parts.reshape(B, n, -1)


def lstm_step_backward(params: Params, cache: StepCache, d_h: np.ndarray, d_c_next: np.ndarray,
                       layout: str, *, tanh_prime: TanhPrime = tanh_derivative,
                       sums: WeightSums | None = None,
                       ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, Params]:
    """Backward through one LSTM step, given the total ∂L/∂h_t and the c-gradient carried
    back from t+1.

        d_c        = d_c_next + d_h∘σ(o)∘(1 − tanh²c_t)     (c_t also went on to t+1)
        d_o_pre    = d_h∘tanh(c_t)∘σ'(o)
        d_f_pre    = d_c∘c_{t−1}∘σ'(f)
        d_i_pre    = d_c∘tanh(j)∘σ'(i)
        d_j_pre    = d_c∘σ(i)∘(1 − tanh²j)
        d_c_{t−1}  = d_c∘σ(f)
        d_z        = the four blocks in the layout's order
    Returns (d_x_t, d_h_{t−1}, d_c_{t−1}, this step's weight gradients).
    """
    si, tj, sf, so, tc = (cache[k] for k in ("si", "tj", "sf", "so", "tc"))
    d_c = d_c_next + d_h * so * tanh_prime(tc)
    d_o = d_h * tc * so * (1.0 - so)
    d_f = d_c * cache["c_prev"] * sf * (1.0 - sf)
    d_i = d_c * tj * si * (1.0 - si)
    d_j = d_c * si * tanh_prime(tj)
    blocks = [d_i, d_j, d_f, d_o] if layout == "block" else [d_i, d_f, d_j, d_o]
    d_z = np.concatenate(blocks, axis=1)
    d_c_prev = d_c * sf
    if layout == "block":
        F = cache["x"].shape[1]
        d_xh = d_z @ params["kernel"].T
        d_params = weight_gradients({"kernel": (cache["xh"], d_z)}, {"bias": d_z.sum(axis=0)},
                                     sums)
        return d_xh[:, :F], d_xh[:, F:], d_c_prev, d_params
    d_params = weight_gradients(
        {"kernel": (cache["x"], d_z), "recurrent_kernel": (cache["h_prev"], d_z)},
        {"bias": d_z.sum(axis=0)}, sums)
    d_x_t = d_z @ params["kernel"].T if wants_inputs(sums) else None
    return d_x_t, d_z @ params["recurrent_kernel"].T, d_c_prev, d_params


def _lstm_functions(layout: str) -> tuple[Forward, Backward]:
    def forward(params: Params, x_seq: np.ndarray, h0: np.ndarray,
                c0: np.ndarray | None = None) -> tuple[np.ndarray, Cache]:
        h, c = h0, (np.zeros_like(h0) if c0 is None else c0)
        outputs, cache = [], []
        for start in range(0, x_seq.shape[1], WeightSums.BLOCK):
            block = x_seq[:, start:start + WeightSums.BLOCK]
            parts = lstm_input_parts(params, block, layout)
            for k in range(block.shape[1]):
                h, c, step_cache = lstm_step(params, block[:, k], h, c, layout, parts[:, k])
                outputs.append(h)
                cache.append(step_cache)
        return np.stack(outputs, axis=1), cache

    def backward(params: Params, cache: Cache, d_h_seq: np.ndarray,
                 d_h_final: np.ndarray | None = None, *, d_c_final: np.ndarray | None = None,
                 totals: list[np.ndarray] | None = None, inputs: bool = True,
                 sketch: Sketch | None = None) -> tuple[np.ndarray | None, Any, Params]:
        """BPTT with two carries: d_h_next and d_c_next both come back from t+1."""
        d_h_seq = time_major(d_h_seq)
        d_x_seq = np.zeros((len(cache), *cache[0]["x"].shape)) if inputs else None
        d_params = zeros_like(params)
        sums = WeightSums(inputs, sketch)
        d_h_next = np.zeros_like(d_h_seq[0]) if d_h_final is None else d_h_final
        d_c_next = np.zeros_like(d_h_seq[0]) if d_c_final is None else d_c_final
        for t in reversed(range(len(cache))):
            d_h = d_h_seq[t] + d_h_next  # the gradient carried back from t+1 is added
            if totals is not None:
                totals.insert(0, d_h)
            d_x_t, d_h_next, d_c_next, d_params_t = lstm_step_backward(
                params, cache[t], d_h, d_c_next, layout, sums=sums)
            if d_x_seq is not None:
                d_x_seq[t] = d_x_t
            add_into(d_params, d_params_t)
        sums.add_into(d_params)
        return (None if d_x_seq is None else time_major(d_x_seq), (d_h_next, d_c_next),
                d_params)

    return forward, backward


forward_gru_block, backward_gru_block = single_state(gru_block_step, gru_block_step_backward)


#: (step, step backward) of every one-state cell, keyed by :func:`cell_key`; the LSTM's are
#: :func:`lstm_step` and :func:`lstm_step_backward`.
STEPS: dict[str, tuple[Callable[[Params, np.ndarray, np.ndarray], tuple[np.ndarray, StepCache]],
                       StepBackward]] = {
    "gru_block": (gru_block_step, gru_block_step_backward),
    "gru_keras": (gru_keras_step, gru_keras_step_backward),
    "gru_keras_reset_before": (gru_keras_reset_before_step,
                               gru_keras_reset_before_step_backward),
    "simple_rnn_block": (simple_rnn_block_step, simple_rnn_block_step_backward),
    "simple_rnn_keras": (simple_rnn_keras_step, simple_rnn_keras_step_backward),
}


#: (forward, backward) for every recurrent cell, keyed by :func:`cell_key`. A new one-state
#: cell is a step, a step backward and one line here.
RECURRENT: dict[str, tuple[Forward, Backward]] = {
    "gru_block": (forward_gru_block, backward_gru_block),
    "gru_keras": single_state(gru_keras_step, gru_keras_step_backward),
    "gru_keras_reset_before": single_state(gru_keras_reset_before_step,
                                           gru_keras_reset_before_step_backward),
    "simple_rnn_block": single_state(simple_rnn_block_step, simple_rnn_block_step_backward),
    "simple_rnn_keras": single_state(simple_rnn_keras_step, simple_rnn_keras_step_backward),
    "lstm_block": _lstm_functions("block"),
    "lstm_keras": _lstm_functions("keras"),
}


def cell_key(cell: Cell) -> str:
    """``<kind>_<layout>`` as in gradscope/cells, plus ``_reset_before`` for reset_after=False."""
    key = f"{cell.kind}_{cell.layout}"
    if key == "gru_keras" and not cell.options.get("reset_after", True):
        key += "_reset_before"
    return key


def cell_functions(cell: Cell) -> tuple[Forward, Backward]:
    functions = RECURRENT.get(cell_key(cell))
    if functions is None:
        raise ConfigError(
            f"{cell.name}: the NumPy reference has no {cell.kind} in the {cell.layout} layout; "
            f"expected one of {', '.join(sorted(RECURRENT))}",
            where=cell.name,
        )
    return functions
