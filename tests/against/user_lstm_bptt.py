"""A hand-written NumPy BPTT for stacked block-layout LSTMs (TF1 LSTMCell: kernel (F+u, 4u),
gates [i | j | f | o], forget_bias 1.0) → dense → mean softmax cross-entropy, written to the
`gradscope check --against` contract, and mutants with one classic bug each. Its model is
tests/against/lstm_model.yaml; from the clone:

    .venv/bin/gradscope check tests/against/lstm_model.yaml \
        --against tests/against/user_lstm_bptt.py:correct
"""

import numpy as np


def sigmoid(a):
    return 1 / (1 + np.exp(-a))


def backward(params, x, y, h0, bug=None):
    lstms = sorted({k.split("/")[0] for k in params if k.startswith("lstm_")})
    dense = sorted({k.split("/")[0] for k in params if k.startswith("dense_")})
    B, T, _ = x.shape
    forget_bias = 0.0 if bug == "no_forget_bias" else 1.0
    seq, caches = x, []
    for name in lstms:
        kernel, bias = params[f"{name}/kernel"], params[f"{name}/bias"]
        u_units = bias.shape[0] // 4
        h, c = h0[f"{name}/h0"], h0[f"{name}/c0"]
        steps, outputs = [], []
        for t in range(T):
            xh = np.concatenate([seq[:, t], h], axis=1)
            z = xh @ kernel + bias
            i, j, f, o = (z[:, k * u_units:(k + 1) * u_units] for k in range(4))
            si, tj, sf, so = sigmoid(i), np.tanh(j), sigmoid(f + forget_bias), sigmoid(o)
            c_new = sf * c + si * tj
            h = so * np.tanh(c_new)
            steps.append((xh, c, si, tj, sf, so, c_new))
            c = c_new
            outputs.append(h)
        caches.append((name, seq, steps))
        seq = np.stack(outputs, axis=1)
    activations = [seq]
    for name in dense:
        activations.append(activations[-1] @ params[f"{name}/kernel"] + params[f"{name}/bias"])
    out = activations[-1]
    e = np.exp(out - out.max(axis=-1, keepdims=True))
    d = (e / e.sum(axis=-1, keepdims=True) - y) / (B * T)
    if bug == "sum_loss":
        d = d * B * T
    grads = {}
    for k, name in reversed(list(enumerate(dense))):
        a = activations[k]
        grads[f"{name}/kernel"] = a.reshape(-1, a.shape[-1]).T @ d.reshape(-1, d.shape[-1])
        grads[f"{name}/bias"] = d.reshape(-1, d.shape[-1]).sum(axis=0)
        d = d @ params[f"{name}/kernel"].T
    for name, inputs, steps in reversed(caches):
        kernel = params[f"{name}/kernel"]
        F = inputs.shape[2]
        d_kernel, d_bias = np.zeros_like(kernel), np.zeros_like(params[f"{name}/bias"])
        d_x = np.zeros_like(inputs)
        u_units = kernel.shape[1] // 4
        d_h_next, d_c_next = np.zeros((B, u_units)), np.zeros((B, u_units))
        for t in reversed(range(T)):
            xh, c_prev, si, tj, sf, so, c = steps[t]
            d_h = d[:, t] if bug == "no_h_carry" else d[:, t] + d_h_next
            tc = np.tanh(c)
            through_tanh = (1 - tc**2) if bug != "no_tanh_derivative" else 1.0
            d_c = d_h * so * through_tanh + (0 if bug == "no_c_carry" else d_c_next)
            d_i = d_c * tj * si * (1 - si)
            d_j = d_c * si * (1 - tj**2)
            d_f = d_c * c_prev * sf * (1 - sf)
            d_o = d_h * tc * so * (1 - so)
            blocks = [d_f, d_j, d_i, d_o] if bug == "swap_i_f" else [d_i, d_j, d_f, d_o]
            d_z = np.concatenate(blocks, axis=1)
            d_xh = d_z @ kernel.T
            d_x[:, t] = d_xh[:, :F]
            d_h_next, d_c_next = d_xh[:, F:], d_c * sf
            d_kernel += xh.T @ d_z
            d_bias += d_z.sum(axis=0)
        grads[f"{name}/kernel"], grads[f"{name}/bias"] = d_kernel, d_bias
        grads[f"{name}/h0"], grads[f"{name}/c0"] = d_h_next, d_c_next
        d = d_x
    grads["x"] = d
    if bug == "one_element_off":
        grads["lstm_1/kernel"] = grads["lstm_1/kernel"].copy()
        grads["lstm_1/kernel"][3, 2] *= 1.05
    return grads


def correct(params, x, y, h0):
    return backward(params, x, y, h0)


def _mutant(bug):
    def function(params, x, y, h0):
        return backward(params, x, y, h0, bug)

    function.__name__ = bug
    return function


no_h_carry = _mutant("no_h_carry")
no_c_carry = _mutant("no_c_carry")
no_tanh_derivative = _mutant("no_tanh_derivative")
swap_i_f = _mutant("swap_i_f")
no_forget_bias = _mutant("no_forget_bias")
sum_loss = _mutant("sum_loss")
one_element_off = _mutant("one_element_off")
