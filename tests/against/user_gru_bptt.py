"""A hand-written NumPy BPTT, as a user writes it for `gradscope check --against`, and a zoo
of mutants, each with one classic bug. Stacked block-layout GRUs (TF1 GRUCell weights),
dense layers at every step, and the mean loss (softmax cross-entropy or mse). The seed model
is such a model, so from the clone:

    .venv/bin/gradscope check --against tests/against/user_gru_bptt.py:correct    # exit 0
    .venv/bin/gradscope check --against tests/against/user_gru_bptt.py:no_carry   # exit 1
"""

import numpy as np

LOSS = "softmax_cross_entropy"  # the tests set "mse" for the mse model


def sigmoid(a):
    return 1 / (1 + np.exp(-a))


def _layers(params):
    grus = sorted({k.split("/")[0] for k in params if k.endswith("/w_ru")})
    dense = sorted({k.split("/")[0] for k in params if k.endswith("/kernel")})
    return grus, dense


def backward(params, x, y, h0, bug=None):
    grus, dense = _layers(params)
    B, T, _ = x.shape
    seq, caches = x, []
    for name in grus:
        w_ru, b_ru, w_c, b_c = (params[f"{name}/{k}"] for k in ("w_ru", "b_ru", "w_c", "b_c"))
        u_units = b_c.shape[0]
        h = h0[f"{name}/h0"]
        steps = []
        for t in range(T):
            xh = np.concatenate([seq[:, t], h], axis=1)
            ru = sigmoid(xh @ w_ru + b_ru)
            r, u = ru[:, :u_units], ru[:, u_units:]
            if bug == "swap_ru":
                r, u = u, r
            xrh = np.concatenate([seq[:, t], r * h], axis=1)
            c = np.tanh(xrh @ w_c + b_c)
            h_new = u * h + (1 - u) * c
            steps.append((xh, xrh, h, r, u, c))
            h = h_new
        outputs = np.stack([s[2] for s in steps[1:]] + [h], axis=1)
        caches.append((name, seq, steps))
        seq = outputs
    activations = [seq]
    for name in dense:
        activations.append(activations[-1] @ params[f"{name}/kernel"] + params[f"{name}/bias"])
    out = activations[-1]
    positions = B * T
    if LOSS == "mse":
        d_out = 2 * (out - y) / out.size
    else:
        e = np.exp(out - out.max(axis=-1, keepdims=True))
        d_out = (e / e.sum(axis=-1, keepdims=True) - y) / positions
    if bug == "sum_loss":
        d_out = d_out * (positions if LOSS != "mse" else out.size)
    grads = {}
    d = d_out
    for k, name in reversed(list(enumerate(dense))):
        a = activations[k]
        if bug == "dense_last_step_only" and k == len(dense) - 1:
            grads[f"{name}/kernel"] = a[:, -1].T @ d[:, -1]
        else:
            grads[f"{name}/kernel"] = a.reshape(-1, a.shape[-1]).T @ d.reshape(-1, d.shape[-1])
        grads[f"{name}/bias"] = d.reshape(-1, d.shape[-1]).sum(axis=0)
        if bug == "bias_averaged":
            grads[f"{name}/bias"] = d.reshape(-1, d.shape[-1]).mean(axis=0)
        d = d @ params[f"{name}/kernel"].T
    d_seq = d
    for name, inputs, steps in reversed(caches):
        w_ru, w_c = params[f"{name}/w_ru"], params[f"{name}/w_c"]
        F = inputs.shape[2]
        u_units = w_c.shape[1]
        g = {k: np.zeros_like(params[f"{name}/{k}"]) for k in ("w_ru", "b_ru", "w_c", "b_c")}
        d_x = np.zeros_like(inputs)
        d_h_next = np.zeros((B, u_units))
        for t in reversed(range(T)):
            xh, xrh, h_prev, r, u, c = steps[t]
            d_h = d_seq[:, t] if bug == "no_carry" else d_seq[:, t] + d_h_next
            d_c = d_h * (1 - u) if bug != "drop_one_minus_u" else d_h
            d_u = d_h * (h_prev - c)
            d_c_bar = d_c * (1 - c**2)
            d_xrh = d_c_bar @ w_c.T
            d_r = d_xrh[:, F:] * h_prev
            d_ru_bar = np.concatenate([d_r * r * (1 - r), d_u * u * (1 - u)], axis=1)
            d_xh = d_ru_bar @ w_ru.T
            d_x[:, t] = d_xrh[:, :F] + d_xh[:, :F]
            carry = (1.0 + 0 * d_h) * u if bug == "doc_plus_u" else d_h * u
            d_h_next = d_xh[:, F:] + d_xrh[:, F:] * r + carry
            g["w_ru"] += xh.T @ d_ru_bar
            g["b_ru"] += d_ru_bar.sum(axis=0)
            g["w_c"] += xrh.T @ d_c_bar
            g["b_c"] += d_c_bar.sum(axis=0)
        for k, v in g.items():
            grads[f"{name}/{k}"] = v
        if bug == "swap_w_ru_w_c":
            w_ru_grad, w_c_grad = grads[f"{name}/w_ru"], grads[f"{name}/w_c"]
            grads[f"{name}/w_ru"], grads[f"{name}/w_c"] = w_c_grad, w_ru_grad
        grads[f"{name}/h0"] = d_h_next
        d_seq = d_x
    grads["x"] = d_seq
    if bug == "one_element_off":
        grads["dense_1/kernel"] = grads["dense_1/kernel"].copy()
        grads["dense_1/kernel"][0, 0] *= 1.05
    return grads


def correct(params, x, y, h0):
    return backward(params, x, y, h0)


def _mutant(bug):
    def function(params, x, y, h0):
        return backward(params, x, y, h0, bug)

    function.__name__ = bug
    return function


no_carry = _mutant("no_carry")
swap_ru = _mutant("swap_ru")
drop_one_minus_u = _mutant("drop_one_minus_u")
dense_last_step_only = _mutant("dense_last_step_only")
sum_loss = _mutant("sum_loss")
bias_averaged = _mutant("bias_averaged")
doc_plus_u = _mutant("doc_plus_u")
swap_w_ru_w_c = _mutant("swap_w_ru_w_c")
one_element_off = _mutant("one_element_off")
