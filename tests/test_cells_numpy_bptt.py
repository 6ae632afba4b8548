"""The NumPy reference (gradscope/cells/, gradscope/yaml/reference.py): against TF
autodiff, against finite differences, and against a mutant that forgets the gradient carried
back from t+1."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from gradscope.cells import CELLS
from gradscope.cells.gru_block import gru_block_step_backward
from gradscope.cells.lstm import lstm_step_backward
from gradscope.cells.numpy_bptt import Sketch, WeightSums
from gradscope.yaml.algebra import ModelShapes, model_shapes
from gradscope.yaml.config import load_spec
from gradscope.yaml.data import Batch, initial_params, synthetic_batch
from gradscope.yaml.reference import (
    reference_gradients,
    reference_loss,
    softmax_cross_entropy_loss,
)

RTOL, ATOL = 1e-10, 1e-12

#: A cell of every NumPy reference, by key: each entry of CELLS, and the Keras GRU with
#: reset_after=False.
NUMPY_CELLS = {cell.key: cell for cell in (
    *(cls(name="any", units=1, input_size=1, input_label="input") for cls in CELLS.values()),
    CELLS["gru_keras"](name="any", units=1, input_size=1, input_label="input",
                       options={"reset_after": False}),
)}


def _keras(units: int, **options: object) -> dict[str, object]:
    return {"type": "gru", "units": units, "layout": "keras", **options}


def _block(units: int, **options: object) -> dict[str, object]:
    return {"type": "gru", "units": units, "layout": "block", **options}


SPECS: dict[str, dict[str, object]] = {
    "block_ce": {"layers": [_block(4), {"dense": 3}]},
    "keras_mse": {"layers": [_keras(4), {"dense": 2}], "loss": "mse"},
    "keras_reset_before_last_step": {
        "layers": [_keras(3, reset_after=False), _keras(4, reset_after=False,
                                                        return_sequences=False), {"dense": 3}],
    },
    "mixed_three_two_dense_mse": {
        "layers": [_block(3), _keras(4, reset_after=False), _keras(3), {"dense": 4},
                   {"dense": 2}],
        "loss": "mse",
    },
    "mixed_last_step_two_dense_ce": {
        "layers": [_keras(4), _block(3, return_sequences=False), {"dense": 5}, {"dense": 3}],
    },
    "block_two_last_step_mse": {
        "layers": [_block(3), _block(4, return_sequences=False), {"dense": 2}], "loss": "mse",
    },
    "keras_no_dense_mse": {"layers": [_keras(3)], "loss": "mse"},
}


def _setup(name: str, seed: int = 0) -> tuple[ModelShapes, dict[str, np.ndarray], Batch]:
    """A float64 model, B=3, T=5, F=4, with perturbed weights (so no bias is zero) and random
    nonzero initial states (so h0 matters)."""
    spec = load_spec({"input_size": 4, "time_steps": 5, "batch_size": 3, "dtype": "float64",
                      "seed": seed, **SPECS[name]})
    shapes = model_shapes(spec)
    rng = np.random.default_rng([seed, 99])
    params = {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in initial_params(shapes).items()}
    batch = synthetic_batch(shapes)
    states = {k: rng.standard_normal(v.shape) for k, v in batch.initial_states.items()}
    return shapes, params, Batch(x=batch.x, y=batch.y, initial_states=states)


def _tf_gradients(shapes: ModelShapes, params: dict[str, np.ndarray],
                  batch: Batch) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    from gradscope.yaml.engine import Engine

    result = Engine(shapes).run(params, batch)
    gradients = {**result.weight_gradients, **result.state_gradients}
    assert all(value is not None for value in gradients.values())
    gradients["x"] = result.input_gradient
    finals = {k: v for k, v in result.final_states.items() if v is not None}
    return result.loss, gradients, finals  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_matches_tensorflow(name, tf):
    shapes, params, batch = _setup(name)
    tf_loss, tf_grads, tf_finals = _tf_gradients(shapes, params, batch)
    ours = reference_gradients(shapes, params, batch)

    expected_names = {*params, *(info.name for info in shapes.states), "x"}
    assert set(ours.gradients) == expected_names == set(tf_grads)
    np.testing.assert_allclose(ours.loss, tf_loss, rtol=RTOL, atol=ATOL)
    for tensor, expected in tf_grads.items():
        assert ours.gradients[tensor].shape == expected.shape, tensor
        assert ours.gradients[tensor].dtype == np.float64, tensor
        np.testing.assert_allclose(ours.gradients[tensor], expected, rtol=RTOL, atol=ATOL,
                                   err_msg=tensor)
        # Relative to the tensor's largest element, the two agree to float64 rounding (about
        # 1e-15 here), far inside the witness's 1e-9.
        scale = np.max(np.abs(expected))
        worst = np.max(np.abs(ours.gradients[tensor] - expected))
        assert worst <= 1e-12 * scale, (tensor, worst / scale)
    assert set(ours.final_states) == set(tf_finals)
    for state, expected in tf_finals.items():
        np.testing.assert_allclose(ours.final_states[state], expected, rtol=RTOL, atol=ATOL)


# -- finite differences, no TensorFlow --------------------------------------------------------


def _with(shapes: ModelShapes, params: dict[str, np.ndarray], batch: Batch, tensor: str,
          index: tuple[int, ...], delta: float) -> float:
    """The loss with one element of one tensor (a weight, an initial state, or x) moved."""
    params = dict(params)
    states = dict(batch.initial_states)
    x = batch.x
    if tensor == "x":
        x = x.copy()
        x[index] += delta
    elif tensor in states:
        states[tensor] = states[tensor].copy()
        states[tensor][index] += delta
    else:
        params[tensor] = params[tensor].copy()
        params[tensor][index] += delta
    return reference_loss(shapes, params, Batch(x=x, y=batch.y, initial_states=states))


@pytest.mark.parametrize("name", ["block_two_last_step_mse", "keras_mse",
                                  "keras_reset_before_last_step"])
def test_reference_matches_central_differences(name):
    shapes, params, batch = _setup(name, seed=3)
    ours = reference_gradients(shapes, params, batch)
    rng = np.random.default_rng(5)
    eps = 1e-6
    for tensor, gradient in ours.gradients.items():
        for flat in rng.choice(gradient.size, size=min(4, gradient.size), replace=False):
            index = np.unravel_index(flat, gradient.shape)
            numeric = (_with(shapes, params, batch, tensor, index, eps)
                       - _with(shapes, params, batch, tensor, index, -eps)) / (2 * eps)
            np.testing.assert_allclose(gradient[index], numeric, rtol=1e-6, atol=1e-9,
                                       err_msg=f"{tensor}{list(index)}")


def test_softmax_cross_entropy_gradient_holds_for_unnormalised_targets():
    """The reference differentiates the loss as written, −Σ_l y_l·log softmax_l, so its
    gradient is softmax·Σy − y; it reduces to softmax − y only when Σy = 1."""
    rng = np.random.default_rng(2)
    logits, target = rng.standard_normal((3, 5, 4)), rng.uniform(0, 1, (3, 5, 4))
    _, gradient = softmax_cross_entropy_loss(logits, target)
    eps = 1e-6
    for index in [(0, 0, 0), (1, 2, 3), (2, 4, 1)]:
        moved = [logits.copy(), logits.copy()]
        moved[0][index] += eps
        moved[1][index] -= eps
        plus, minus = (softmax_cross_entropy_loss(m, target)[0] for m in moved)
        np.testing.assert_allclose(gradient[index], (plus - minus) / (2 * eps), rtol=1e-6,
                                   atol=1e-9)
    softmax = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    assert not np.allclose(gradient, (softmax - target) / 15, rtol=1e-3)  # not softmax − y


# -- a mutant: the classic BPTT bug -----------------------------------------------------------


def _backward_gru_block_without_carry(params, cache, d_h_seq, d_h_final=None):
    """The block GRU's BPTT with the classic bug: d_h = d_h_seq[t], no + d_h_next."""
    d_h_seq = np.swapaxes(d_h_seq, 0, 1)
    d_x_seq = np.zeros((len(cache), *cache[0]["x"].shape))
    d_params = {name: np.zeros_like(value) for name, value in params.items()}
    d_h_next = np.zeros_like(d_h_seq[0])
    for t in reversed(range(len(cache))):
        d_h = d_h_seq[t]  # BUG: forgets the gradient carried back from t+1
        d_x_seq[t], d_h_next, d_params_t = gru_block_step_backward(params, cache[t], d_h)
        for key, value in d_params_t.items():
            d_params[key] += value
    return np.swapaxes(d_x_seq, 0, 1), d_h_next, d_params


def test_a_backward_without_the_carry_fails_the_comparison(tf):
    shapes, params, batch = _setup("block_ce")
    _, tf_grads, _ = _tf_gradients(shapes, params, batch)
    np.testing.assert_allclose(reference_gradients(shapes, params, batch).gradients["x"],
                               tf_grads["x"], rtol=RTOL, atol=ATOL)  # the real one passes

    mutant = reference_gradients(shapes, params, batch,
                                 backward_for=lambda cell: _backward_gru_block_without_carry
                                 ).gradients
    for tensor in ["x", "gru_1/h0", "gru_1/w_ru", "gru_1/w_c"]:
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(mutant[tensor], tf_grads[tensor], rtol=RTOL, atol=ATOL)
    # The head does not go through the recurrence, so its gradients stay right; and at the
    # last step nothing is carried yet, so d_x_T is still right: the bug hides in earlier steps.
    for tensor in ["dense_1/kernel", "dense_1/bias"]:
        np.testing.assert_allclose(mutant[tensor], tf_grads[tensor], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(mutant["x"][:, -1], tf_grads["x"][:, -1], rtol=RTOL, atol=ATOL)


# -- no TensorFlow in the reference -----------------------------------------------------------


def test_importing_the_reference_does_not_import_tensorflow():
    code = ("import gradscope.cells, gradscope.yaml.reference, sys; "
            "assert 'tensorflow' not in sys.modules")
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                               text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr


def test_the_reference_source_never_mentions_tensorflow():
    package = REPO / "gradscope"
    for path in (*sorted((package / "cells").glob("*.py")), package / "yaml/reference.py"):
        source = path.read_text(encoding="utf-8")
        assert "import tensorflow" not in source and "gradscope.yaml.engine" not in source
        assert "gradscope._tf" not in source


@pytest.mark.parametrize("key", sorted(NUMPY_CELLS))
@pytest.mark.parametrize("steps", [1, WeightSums.BLOCK - 1, WeightSums.BLOCK,
                                   2 * WeightSums.BLOCK + 5])
def test_weights_summed_a_block_of_steps_at_a_time_are_the_step_by_step_sums(key, steps):
    """The BPTT loops sum the weight products a block of steps at a time
    (:class:`WeightSums`); each step's own backward, called without it, gives the
    products one by one. The sums agree to float64 rounding, at block edges and between them,
    and ``inputs=False`` leaves out ∂L/∂x_t and nothing else."""
    rng = np.random.default_rng(steps)
    kind = "simple_rnn" if key.startswith("simple_rnn") else key.split("_")[0]
    layout = "block" if "_block" in key else "keras"
    batch, features, units = 3, 4, 5
    blocks = {"gru": 3, "lstm": 4, "simple_rnn": 1}[kind]  # column blocks of a kernel
    if key == "gru_block":
        params = {"w_ru": rng.normal(size=(features + units, 2 * units)),
                  "b_ru": rng.normal(size=2 * units),
                  "w_c": rng.normal(size=(features + units, units)), "b_c": rng.normal(size=units)}
    elif layout == "block":
        params = {"kernel": rng.normal(size=(features + units, blocks * units)),
                  "bias": rng.normal(size=blocks * units)}
    else:
        params = {"kernel": rng.normal(size=(features, blocks * units)),
                  "recurrent_kernel": rng.normal(size=(units, blocks * units)),
                  "bias": rng.normal(size=(2, blocks * units) if key == "gru_keras"
                                     else blocks * units)}
    params = {name: 0.3 * value for name, value in params.items()}
    forward, backward = NUMPY_CELLS[key].numpy_functions()
    states = [rng.normal(size=(batch, units)) for _ in range(2 if kind == "lstm" else 1)]
    x = rng.normal(size=(batch, steps, features))
    _, cache = forward(params, x, *states)
    d_h_seq = rng.normal(size=(batch, steps, units))
    d_x, d_initial, d_params = backward(params, cache, d_h_seq)
    none, d_initial_again, d_params_again = backward(params, cache, d_h_seq, inputs=False)

    by_step = {name: np.zeros_like(value) for name, value in params.items()}
    d_h_next = np.zeros((batch, units))
    d_c_next = np.zeros((batch, units))
    d_x_steps = np.zeros((steps, batch, features))
    for t in reversed(range(steps)):
        d_h = d_h_seq[:, t] + d_h_next
        if kind == "lstm":
            d_x_steps[t], d_h_next, d_c_next, part = lstm_step_backward(
                params, cache[t], d_h, d_c_next, layout)
        else:
            d_x_steps[t], d_h_next, part = NUMPY_CELLS[key].numpy_steps()[1](params, cache[t], d_h)
        for name, value in part.items():
            by_step[name] += value
    assert none is None
    np.testing.assert_allclose(d_x, np.swapaxes(d_x_steps, 0, 1), rtol=1e-12, atol=1e-12)
    for name in params:
        np.testing.assert_allclose(d_params[name], by_step[name], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(d_params_again[name], d_params[name])
    initial = d_initial if isinstance(d_initial, tuple) else (d_initial,)
    again = d_initial_again if isinstance(d_initial_again, tuple) else (d_initial_again,)
    for mine, other in zip(initial, again, strict=True):
        np.testing.assert_array_equal(mine, other)
    np.testing.assert_allclose(initial[0], d_h_next, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("key", ["lstm_keras", "gru_keras", "simple_rnn_keras"])
def test_a_sketched_backward_gives_the_wide_gradients_times_the_signs(key):
    """With ``sketch=``, a weight gradient summed as products with at least
    :attr:`Sketch.FROM_COLUMNS` columns comes back as G·S (S: the sketch's random signs for
    that width), the bias whole, and the initial-state gradients are untouched."""
    rng = np.random.default_rng(7)
    blocks = {"lstm_keras": 4, "gru_keras": 3, "simple_rnn_keras": 1}[key]
    units = -(-Sketch.FROM_COLUMNS // blocks)  # the narrowest wide layer
    batch, features, steps = 3, 5, WeightSums.BLOCK + 3
    params = {"kernel": 0.2 * rng.normal(size=(features, blocks * units)),
              "recurrent_kernel": 0.2 * rng.normal(size=(units, blocks * units)),
              "bias": 0.2 * rng.normal(size=(2, blocks * units) if key == "gru_keras"
                                       else blocks * units)}
    forward, backward = NUMPY_CELLS[key].numpy_functions()
    states = [rng.normal(size=(batch, units)) for _ in range(2 if key == "lstm_keras" else 1)]
    _, cache = forward(params, rng.normal(size=(batch, steps, features)), *states)
    d_h_seq = rng.normal(size=(batch, steps, units))
    sketch = Sketch(seed=3)
    _, d_initial, whole = backward(params, cache, d_h_seq, inputs=False)
    _, d_initial_sketched, sketched = backward(params, cache, d_h_seq, inputs=False,
                                               sketch=sketch)
    for name, gradient in whole.items():
        if name != "bias":  # the bias's gradient is a sum over the batch, not a product
            signs = sketch.signs(gradient.shape[1])
            assert set(np.unique(signs)) == {-1.0, 1.0}
            assert sketched[name].shape == (gradient.shape[0], Sketch.COLUMNS)
            expected = gradient @ signs  # sums of 128 and more terms: rounding at their scale
            np.testing.assert_allclose(sketched[name], expected, rtol=1e-12,
                                       atol=1e-12 * np.max(np.abs(expected)))
        else:
            np.testing.assert_allclose(sketched[name], gradient, rtol=1e-12, atol=1e-12)
    assert {n for n, g in whole.items() if g.shape != sketched[n].shape} == {
        "kernel", "recurrent_kernel"}
    for mine, other in zip(np.atleast_1d(d_initial), np.atleast_1d(d_initial_sketched),
                           strict=True):
        np.testing.assert_array_equal(mine, other)


@pytest.mark.parametrize("seed", range(40))
def test_a_projected_difference_is_never_below_the_largest_element_of_it(seed):
    """The guarantee :class:`Sketch` rests on: max |E·S| ≥ max |E| but for a chance
    of 2⁻¹⁶ per matrix, for any difference E: one wrong element alone (always: it is ±e in
    every column), a wrong row, or rounding-sized noise everywhere with one larger error."""
    rng = np.random.default_rng(seed)
    sketch = Sketch(seed=seed)
    rows, columns = 24, Sketch.FROM_COLUMNS + seed
    one = np.zeros((rows, columns))
    one[rng.integers(rows), rng.integers(columns)] = rng.normal()
    row = np.zeros((rows, columns))
    row[rng.integers(rows)] = rng.normal(size=columns)
    noisy = 1e-3 * rng.normal(size=(rows, columns))
    noisy[rng.integers(rows), rng.integers(columns)] += 1.0
    for difference in (one, row, noisy, rng.normal(size=(rows, columns))):
        projected = sketch.project(difference)
        assert np.max(np.abs(projected)) >= np.max(np.abs(difference))
        assert np.max(np.abs(projected)) <= columns * np.max(np.abs(difference))
    np.testing.assert_array_equal(np.max(np.abs(sketch.project(one))), np.max(np.abs(one)))
