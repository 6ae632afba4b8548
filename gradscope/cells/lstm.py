"""The NumPy LSTM of both layouts, float64, no TensorFlow: its step, step backward and BPTT
with two carries, h and c.

The layouts differ in the gate order ([i | j | f | o] in the block layout, [i | f | c̃ | o] in
Keras'), in TF1's forget_bias added to f, and in where h_{t−1}'s weights are: the rows after
x_t's of the block ``kernel``, or a ``recurrent_kernel`` of their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.cells import numpy_bptt as bptt

#: What each layout adds to the forget gate's pre-activation: TF1's LSTMCell its forget_bias
#: 1.0, Keras nothing (its unit_forget_bias starts the bias's f block at 1 instead).
FORGET_BIASES = {"block": 1.0, "keras": 0.0}


def lstm_step(params: bptt.Params, x_t: np.ndarray, h_prev: np.ndarray, c_prev: np.ndarray,
              layout: str, x_part: np.ndarray | None = None,
              ) -> tuple[np.ndarray, np.ndarray, bptt.StepCache]:
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
    si, tj, so = bptt.sigmoid(i), np.tanh(j), bptt.sigmoid(o)
    sf = bptt.sigmoid(f + FORGET_BIASES[layout])
    c = sf * c_prev + si * tj
    tc = np.tanh(c)
    h = so * tc
    cache = {"x": x_t, "xh": xh, "h_prev": h_prev, "c_prev": c_prev, "si": si, "tj": tj,
             "sf": sf, "so": so, "tc": tc, "c": c}
    return h, c, cache


def lstm_input_parts(params: bptt.Params, x_seq: np.ndarray, layout: str) -> np.ndarray:
    """x_t's part of every step's z, with the bias (see :func:`lstm_step`), for x_seq (B, n,
    F): one product for the n steps, (B, n, 4u)."""
    B, n, F = x_seq.shape
    kernel = params["kernel"][:F] if layout == "block" else params["kernel"]
    parts = x_seq.reshape(B * n, F) @ kernel
    parts += params["bias"]
    return parts.reshape(B, n, -1)


def lstm_step_backward(params: bptt.Params, cache: bptt.StepCache, d_h: np.ndarray,
                       d_c_next: np.ndarray, layout: str, *,
                       tanh_prime: bptt.TanhPrime = bptt.tanh_derivative,
                       sums: bptt.WeightSums | None = None,
                       ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, bptt.Params]:
    """bptt.Backward through one LSTM step, given the total ∂L/∂h_t and the c-gradient carried
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
        d_params = bptt.weight_gradients({"kernel": (cache["xh"], d_z)}, {"bias": d_z.sum(axis=0)},
                                    sums)
        return d_xh[:, :F], d_xh[:, F:], d_c_prev, d_params
    d_params = bptt.weight_gradients(
        {"kernel": (cache["x"], d_z), "recurrent_kernel": (cache["h_prev"], d_z)},
        {"bias": d_z.sum(axis=0)}, sums)
    d_x_t = d_z @ params["kernel"].T if bptt.wants_inputs(sums) else None
    return d_x_t, d_z @ params["recurrent_kernel"].T, d_c_prev, d_params


def lstm_functions(layout: str) -> tuple[bptt.Forward, bptt.Backward]:
    """The forward pass over a sequence and BPTT of the LSTM in ``layout``."""

    def forward(params: bptt.Params, x_seq: np.ndarray, h0: np.ndarray,
                c0: np.ndarray | None = None) -> tuple[np.ndarray, bptt.Cache]:
        h, c = h0, (np.zeros_like(h0) if c0 is None else c0)
        outputs, cache = [], []
        for start in range(0, x_seq.shape[1], bptt.WeightSums.BLOCK):
            block = x_seq[:, start:start + bptt.WeightSums.BLOCK]
            parts = lstm_input_parts(params, block, layout)
            for k in range(block.shape[1]):
                h, c, step_cache = lstm_step(params, block[:, k], h, c, layout, parts[:, k])
                outputs.append(h)
                cache.append(step_cache)
        return np.stack(outputs, axis=1), cache

    def backward(params: bptt.Params, cache: bptt.Cache, d_h_seq: np.ndarray,
                 d_h_final: np.ndarray | None = None, *, d_c_final: np.ndarray | None = None,
                 totals: list[np.ndarray] | None = None, inputs: bool = True,
                 sketch: bptt.Sketch | None = None) -> tuple[np.ndarray | None, Any, bptt.Params]:
        """BPTT with two carries: d_h_next and d_c_next both come back from t+1."""
        d_h_seq = bptt.time_major(d_h_seq)
        d_x_seq = np.zeros((len(cache), *cache[0]["x"].shape)) if inputs else None
        d_params = bptt.zeros_like(params)
        sums = bptt.WeightSums(inputs, sketch)
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
            bptt.add_into(d_params, d_params_t)
        sums.add_into(d_params)
        return (None if d_x_seq is None else bptt.time_major(d_x_seq), (d_h_next, d_c_next),
                d_params)

    return forward, backward


def tf_lstm_update(tf: Any, i: Any, f: Any, g: Any, o: Any, c: Any,
                   probes: tuple[Any, ...] = ()) -> tuple[Any, Any]:
    """The new (h, c) from the gates' pre-activations (f with its forget bias), in
    TensorFlow. With ``probes`` (h's, c's), c's probe is added before h reads c_t, so that the
    gradient with respect to it is the total ∂L/∂c_t, through h_t too."""
    c_new = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
    if probes:
        c_new = c_new + probes[1]
    h = tf.sigmoid(o) * tf.tanh(c_new)
    return (h + probes[0], c_new) if probes else (h, c_new)
