"""The adapter of docs/check.md: the course's ``rnn_backward(da, caches)`` under
``gradscope check --against course_adapter.py:backward --layer NAME --time-last``.
The lines from ``import numpy`` to the end of ``backward`` are in docs/check.md, verbatim (a
test holds them equal). Below them, for the tests only: the same adapter over each classic
bug of ``rnn_course.py``, returning everything or the weights only.
"""

import numpy as np
from rnn_course import rnn_backward, rnn_forward


def backward(x, h0, params, dh):
    params = {**params, "Wya": np.zeros((1, len(h0))), "by": np.zeros((1, 1))}
    _, _, caches = rnn_forward(x, h0, params)
    g = rnn_backward(dh, caches)
    return {"x": g["dx"], "h0": g["da0"], "Wax": g["dWax"], "Waa": g["dWaa"], "ba": g["dba"]}


# -- for the tests ------------------------------------------------------------------------------

import functools  # noqa: E402
import types  # noqa: E402

import rnn_course  # noqa: E402

BUGS = ("no_carry", "tanh_one_minus_a", "a_next_for_a_prev", "assign_not_add", "divide_by_m")


def _over(bug):
    """The adapter above, unchanged, calling the course code with one bug."""
    course = functools.partial(rnn_course.rnn_backward, bug=bug)
    return types.FunctionType(backward.__code__, {**globals(), "rnn_backward": course}, bug)


def _weights_only(function):
    def weights_only(x, h0, params, dh):
        gradients = function(x, h0, params, dh)
        return {name: gradients[name] for name in ("Wax", "Waa", "ba")}

    return weights_only


for _bug in BUGS:
    globals()[_bug] = _over(_bug)
    globals()[f"{_bug}_weights_only"] = _weights_only(_over(_bug))
correct_weights_only = _weights_only(backward)
