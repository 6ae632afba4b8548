"""``GradientFlow(stop_on_nan=True)``: at the first step of ``fit`` whose loss is not finite,
where the NaN was born, on that step's batch with the weights it started from.

Keras' running loss turns non-finite at the first batch whose loss is (a mean of finite losses
stays finite). By then the optimizer has applied that step; so the callback keeps the last
two batches with the weights each started from (a copy of the weights per step: the cost of
the option), and reruns the failing one on its own weights. Where those already hold NaN, the
step before wrote them: a finite loss with a non-finite gradient, diagnosed on its batch.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gradscope.report.models import FlowHistoryReport, NonFiniteEntry
from gradscope.training_log import NONFINITE_FILE

#: The TensorBoard text summary's tag.
TEXT_TAG = "gradscope/nonfinite"
#: The file, in ``log_dir``, that holds the diagnosis as JSON (``gradscope watch`` reads it).
JSON_FILE = NONFINITE_FILE


def snapshot(model: Any) -> list[np.ndarray]:
    """Every weight of the model, copied."""
    return [np.array(v.numpy()) for v in model.weights]


@contextlib.contextmanager
def weights_held(model: Any, values: list[np.ndarray]) -> Iterator[None]:
    """The model's weights set to ``values`` within the block, and given back after it."""
    now = snapshot(model)
    for variable, value in zip(model.weights, values, strict=True):
        variable.assign(value)
    try:
        yield
    finally:
        for variable, value in zip(model.weights, now, strict=True):
            variable.assign(value)


#: An update that grows a weight's norm at least this many times is said beside the cause of
#: the NaN that follows it.
DIVERGING = 10.0


def diverging(model: Any, before: list[np.ndarray], after: list[np.ndarray],
              step: int) -> str | None:
    """'the update at step 8 grew ‖out/kernel‖ from 3.1e+02 to 4.5e+07 (×1.5e+05; learning
    rate 50)': the trainable weight whose norm the update at ``step`` grew most (``before``
    and ``after``: :func:`snapshot` at the start of that step and of the next), where it grew
    at least :data:`DIVERGING` times; None otherwise. Found tried as a new user would: with
    a learning rate of 50, the cause stopped at the loss's overflow."""
    trainable = {id(v) for v in model.trainable_weights}
    grown = None
    for variable, old, new in zip(model.weights, before, after, strict=True):
        if id(variable) not in trainable:
            continue
        # In float64: a float32 weight near 1e20 has a square past float32's range.
        a, b = (float(np.linalg.norm(np.asarray(w, np.float64))) for w in (old, new))
        if np.isfinite(a) and np.isfinite(b) and a > 0 and b >= DIVERGING * a and (
                grown is None or b / a > grown[0]):
            grown = (b / a, variable.path, a, b)
    if grown is None:
        return None
    ratio, path, a, b = grown
    rate = ""
    with contextlib.suppress(AttributeError, TypeError, ValueError):  # no optimizer, a schedule
        rate = f"; learning rate {float(np.asarray(model.optimizer.learning_rate)):.3g}"
    return (f"the update at step {step} grew ‖{path}‖ from {a:.2g} to {b:.2g} "
            f"(×{ratio:.2g}{rate}): the weights are diverging")


def as_arrays(value: Any) -> Any:
    """Tensors of a batch's part (sample weights) as NumPy arrays, in the same structure."""
    import keras

    return None if value is None else keras.tree.map_structure(np.asarray, value)


def text(found: NonFiniteEntry, step: int) -> str:
    """The diagnosis as the text report draws it, 80 columns wide, without colour."""
    import io

    from rich.console import Console

    from gradscope.report.keras_text import nonfinite_lines
    from gradscope.report.layout import Trimmed

    buffer = io.StringIO()
    console = Console(file=buffer, width=80, color_system=None, no_color=True,
                      highlight=False, force_terminal=False)
    console.print(f"GradientFlow: the loss of step {step} is not finite; training stops")
    for line in nonfinite_lines(found):
        # Without the spaces rich pads a table's lines with (found tried as a new user
        # would: the last lines on stderr ran on to 80 columns).
        console.print(Trimmed(line))
    return buffer.getvalue()


def write(log_dir: Path, writer: Any, tf: Any, found: NonFiniteEntry, step: int,
          history: FlowHistoryReport | None = None) -> None:
    """``nonfinite.json`` in ``log_dir`` (the diagnosis with its step) and a TensorBoard text
    summary of it at that step. With ``history`` (the callback's so far), the file holds the
    run's description too (its loss, mode, every, flag factor and method), so that ``gradscope
    watch`` reads a run stopped before its first observation, which wrote no other events."""
    log_dir.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {"step": step, "nonfinite": found.to_dict()}
    if history is not None:
        document["run"] = {"loss": history.loss, "mode": history.mode, "every": history.every,
                           "flag_factor": history.flag_factor, "method": history.method,
                           "weights": [], "recurrent": []}
    (log_dir / JSON_FILE).write_text(json.dumps(document, indent=2, ensure_ascii=False,
                                                allow_nan=False) + "\n")
    with writer.as_default():
        tf.summary.text(TEXT_TAG, text(found, step), step=step)
    writer.flush()
