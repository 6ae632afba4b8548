"""gradscope in the user's own test suite (pytest, unittest): gradient checks that raise
``AssertionError`` with ``check``'s diagnosis, as ``torch.autograd.gradcheck`` does for PyTorch.

    from gradscope.testing import assert_gradients, check_layer

    assert_gradients(model, x, y)       # the whole model, its compiled loss (or loss="mse")
    check_layer(MyLayer(8), x)          # one layer (or cell) on its own

Both run on float64 copies and leave the user's objects as they were. Their witnesses never
use the tape, so a wrong ``tf.custom_gradient`` fails like any other bug (docs/ci.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.report.models import KerasCheckReport
from gradscope.report.tables import disagreements, failure_lines


def assert_gradients(model: Any, x: Any, y: Any = None, *, loss: str | None = None,
                     sample_weight: Any = None, rtol: float | None = None,
                     directions: int | None = None, seed: int = 0,
                     examples: int | str | None = None) -> KerasCheckReport:
    """Check every gradient of a Keras model, as ``gradscope check`` does, in a test.

    Args:
        model: A built Keras model object, or a ``.keras`` path.
        x: The batch's inputs, as :func:`gradscope.explain` takes them.
        y: Its targets; None: synthetic ones drawn from ``seed``.
        loss: A Keras loss name; default the compiled loss.
        sample_weight: As ``fit`` takes it.
        rtol: Replaces every witness's float64 tolerance.
        directions: Random directions of the finite differences.
        seed: Seeds the synthetic targets and the model's random draws.
        examples: At most this many examples of the batch (default 16; ``"all"``).

    Returns:
        The report, when every witness agrees.

    Raises:
        AssertionError: carrying ``check``'s diagnosis, when a witness disagrees.

    Example:
        >>> assert_gradients(model, x, y)  # doctest: +SKIP
    """
    import gradscope

    options: dict[str, Any] = {"seed": seed}
    if loss is not None:
        options["loss"] = loss
    report = gradscope.check(model, x=x, y=y, sample_weight=sample_weight, rtol=rtol,
                             directions=directions, examples=examples, **options)
    assert isinstance(report, KerasCheckReport)
    if not report.summary.passed:
        raise AssertionError(diagnosis(report))
    return report


def check_layer(layer: Any, inputs: Any, *, rtol: float | None = None,
                directions: int | None = None, seed: int = 0) -> KerasCheckReport:
    """Check one layer, or one recurrent cell, on its own.

    A copy of it (same config, same weights; your object is not called) is the whole of a
    model whose output meets a random cotangent, and :func:`assert_gradients` checks it.

    Args:
        layer: A Keras layer, or a recurrent cell (wrapped in
            ``keras.layers.RNN(cell, return_sequences=True)``).
        inputs: One array, batch axis first; (batch, time, features) for a cell.
        rtol: Replaces every witness's float64 tolerance.
        directions: Random directions of the finite differences.
        seed: Seeds the random cotangent.

    Returns:
        The report, when every witness agrees.

    Raises:
        AssertionError: carrying the diagnosis, when a witness disagrees.

    Example:
        >>> check_layer(MyLayer(8), x)  # doctest: +SKIP
    """
    from gradscope._tf import import_tensorflow

    import_tensorflow()
    import keras

    x = np.asarray(inputs)
    copy = type(layer).from_config(layer.get_config())  # same class, config and name
    if _is_cell(layer):
        copy = keras.layers.RNN(copy, return_sequences=True, name=f"rnn_{layer.name}")
    model_input = keras.Input(x.shape[1:], dtype=str(x.dtype), name="inputs")
    outputs = copy(model_input)
    if isinstance(outputs, list | tuple):
        outputs = outputs[0]
    model = keras.Model(model_input, outputs, name=f"check_layer_{layer.name}")
    _same_weights(copy, layer)
    shape = (x.shape[0], *(int(d) for d in outputs.shape[1:]))
    targets = np.random.default_rng([seed, 7]).standard_normal(shape).astype("float32")
    return assert_gradients(model, x, targets, loss="mse", rtol=rtol, directions=directions,
                            seed=seed)


def diagnosis(report: KerasCheckReport) -> str:
    """The paragraph ``check`` prints for what failed.

    Args:
        report: A check report.

    Returns:
        A line saying how many tensors disagree (and which layer calls' own backward), then
        each failing tensor with the witness, its error against its tolerance, the step, and
        the witness's detail.
    """
    lines = [f"gradscope: model '{report.model.name}': "
             f"{disagreements(report, named=False)}:"]
    for tensor in report.tensors:
        for disagreement, detail in failure_lines(tensor):
            lines.append(f"  ✗ {disagreement}")
            if detail:
                lines.append(f"      {detail}")
    return "\n".join(lines)


def _is_cell(layer: Any) -> bool:
    return hasattr(layer, "state_size") and not hasattr(layer, "cell")


def _same_weights(copy: Any, layer: Any) -> None:
    weights = layer.get_weights()
    if not weights:
        return
    target = copy.cell if hasattr(copy, "cell") and not hasattr(layer, "cell") else copy
    target.set_weights(weights)


__all__ = ["assert_gradients", "check_layer", "diagnosis"]
