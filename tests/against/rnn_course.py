"""A tanh RNN forward and backward in the layout of the classic course exercise, written for
gradscope's tests: arrays are (features, batch, time), a_t = tanh(Wax·x_t + Waa·a_{t−1} + ba),
and ``rnn_backward(da, caches)`` covers the RNN layer alone, given ``da``, the gradient of the
loss with respect to every hidden state from above (not through the recurrence).

``bug`` selects one classic mistake, for the tests (``course_adapter.py`` has them by name):

- ``no_carry``: ``rnn_cell_backward(da[:, :, t], …)``, the carry from t+1 is not added;
- ``tanh_one_minus_a``: the tanh derivative written 1 − a instead of 1 − a²;
- ``a_next_for_a_prev``: dWaa from the cache's a_next instead of a_prev;
- ``assign_not_add``: ``dWax = dWaxt`` where ``dWax += dWaxt`` belongs;
- ``divide_by_m``: the weights' gradients divided by the batch size m.
"""

import numpy as np


def softmax(z):
    e = np.exp(z - z.max(axis=0, keepdims=True))
    return e / e.sum(axis=0, keepdims=True)


def rnn_cell_forward(xt, a_prev, parameters):
    """One step: xt (n_x, m), a_prev (n_a, m) -> a_next (n_a, m), yt_pred (n_y, m), cache."""
    Wax, Waa, Wya = parameters["Wax"], parameters["Waa"], parameters["Wya"]
    ba, by = parameters["ba"], parameters["by"]
    a_next = np.tanh(Wax @ xt + Waa @ a_prev + ba)
    yt_pred = softmax(Wya @ a_next + by)
    cache = (a_next, a_prev, xt, parameters)
    return a_next, yt_pred, cache


def rnn_forward(x, a0, parameters):
    """x (n_x, m, T_x), a0 (n_a, m) -> a (n_a, m, T_x), y_pred (n_y, m, T_x), caches."""
    n_x, m, T_x = x.shape
    n_y, n_a = parameters["Wya"].shape
    a = np.zeros((n_a, m, T_x))
    y_pred = np.zeros((n_y, m, T_x))
    caches = []
    a_next = a0
    for t in range(T_x):
        a_next, yt_pred, cache = rnn_cell_forward(x[:, :, t], a_next, parameters)
        a[:, :, t] = a_next
        y_pred[:, :, t] = yt_pred
        caches.append(cache)
    return a, y_pred, (caches, x)


def rnn_cell_backward(da_next, cache, bug=None):
    """One step back, given the total gradient da_next on a_next."""
    a_next, a_prev, xt, parameters = cache
    Wax, Waa = parameters["Wax"], parameters["Waa"]
    dtanh_da = (1 - a_next) if bug == "tanh_one_minus_a" else (1 - a_next**2)
    dtanh = dtanh_da * da_next
    dxt = Wax.T @ dtanh
    dWax = dtanh @ xt.T
    da_prev = Waa.T @ dtanh
    dWaa = dtanh @ (a_next if bug == "a_next_for_a_prev" else a_prev).T
    dba = np.sum(dtanh, axis=1, keepdims=True)
    return {"dxt": dxt, "da_prev": da_prev, "dWax": dWax, "dWaa": dWaa, "dba": dba}


def rnn_backward(da, caches, bug=None):
    """da (n_a, m, T_x): the upstream gradient of every hidden state -> the gradients."""
    (caches, x) = caches
    (a1, a0, x1, parameters) = caches[0]
    n_a, m, T_x = da.shape
    n_x, m = x1.shape
    dx = np.zeros((n_x, m, T_x))
    dWax = np.zeros((n_a, n_x))
    dWaa = np.zeros((n_a, n_a))
    dba = np.zeros((n_a, 1))
    da_prevt = np.zeros((n_a, m))
    for t in reversed(range(T_x)):
        da_next = da[:, :, t] if bug == "no_carry" else da[:, :, t] + da_prevt
        gradients = rnn_cell_backward(da_next, caches[t], bug)
        dx[:, :, t] = gradients["dxt"]
        if bug == "assign_not_add":
            dWax, dWaa, dba = gradients["dWax"], gradients["dWaa"], gradients["dba"]
        else:
            dWax += gradients["dWax"]
            dWaa += gradients["dWaa"]
            dba += gradients["dba"]
        da_prevt = gradients["da_prev"]
    da0 = da_prevt
    if bug == "divide_by_m":
        dWax, dWaa, dba = dWax / m, dWaa / m, dba / m
    return {"dx": dx, "da0": da0, "dWax": dWax, "dWaa": dWaa, "dba": dba}
