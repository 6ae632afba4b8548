"""A recurrent call whose outputs are not finite, stepped through its own cell
(:mod:`~gradscope.keras.stepped`) to the first step whose state is not; that one step is then
rerun eagerly with its ops looked at, and the state's growth up to it measured.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.gradcheck import tolerance
from gradscope.keras.engine import CapturedCall, call_label
from gradscope.keras.nonfinite.births import first_birth
from gradscope.keras.nonfinite.causes import entry, growth_cause, op_cause
from gradscope.keras.stepped import directions_of, masks_drawn, stepped_runner
from gradscope.report.models import NonFiniteEntry


def recurrent_birth(engine: Any, call: CapturedCall) -> NonFiniteEntry | None:
    """The step and examples where a recurrent call's state first is not finite, the op of
    that cell step and the cause; None where the call is not stepped (then the call is
    diagnosed as any layer is)."""
    layer = engine.operation(call.layer)
    label = call_label(call.layer, call.index)
    directions = directions_of(layer, label)
    if isinstance(directions, str) or not call.states:
        return None
    try:
        run = stepped_runner(engine, layer, directions, engine.training)
        outputs, states, *_ = run(call, None)
    except Exception:  # noqa: BLE001  (the user's cell, run step by step)
        return None
    if not _rebuilt(outputs, call.outputs, engine.dtype_name):
        return None
    found = None
    for index, sequences in enumerate(states):
        joined = np.concatenate([s.reshape(s.shape[0], s.shape[1], -1) for s in sequences],
                                axis=2)
        bad = ~np.isfinite(joined).all(axis=2)
        if not bad.any():
            continue
        step = int(np.flatnonzero(bad.any(axis=0))[0])
        if found is None or step < found[1]:
            found = (index, step, [int(e) for e in np.flatnonzero(bad[:, step])], joined)
    if found is None:
        return None
    index, step, examples, joined = found
    direction = directions[index]
    steps = joined.shape[1]
    shown = steps - 1 - step if direction.backwards else step
    birth = _step_birth(engine, call, directions, index, states[index], step, shown)
    cause = (growth_cause(joined, examples[0], step, direction.backwards, direction.layer.cell,
                          engine.training)
             or op_cause(birth, shown, examples))
    return entry("forward", "layer", direction.label, shown, examples, cause, birth)


def _step_birth(engine: Any, call: CapturedCall, directions: list[Any], index: int,
                sequences: list[np.ndarray], step: int, shown: int) -> Any:
    """The one cell step ``step`` (processing order; ``shown`` in input order) of direction
    ``index``, rerun eagerly from the states before it, with its ops looked at."""
    tf = engine.tf
    cell = directions[index].layer.cell
    x = tf.convert_to_tensor(call.args[0])
    counts = [len(d.names) for d in directions]
    start = int(np.sum(counts[:index]))
    initial = [tf.convert_to_tensor(s) for s in call.states]
    own = initial[start:start + counts[index]]
    previous = ([tf.cast(s[:, step - 1], cell.compute_dtype) for s in sequences] if step
                else [tf.cast(s, cell.compute_dtype) for s in own])
    kwargs = {"training": engine.training} if getattr(cell, "_call_has_training_arg",
                                                      False) else {}
    with masks_drawn(engine, directions, call, x, initial):
        _, birth = first_birth(lambda: cell(x[:, shown], previous, **kwargs))
    return birth


def _rebuilt(ours: list[np.ndarray], theirs: list[Any], dtype: str) -> bool:
    """The stepped outputs equal Keras' own where both are finite, and turn non-finite at the
    same first place."""
    rtol, atol = tolerance("replay", dtype)
    if len(ours) != len(theirs):
        return False
    for mine, keras_output in zip(ours, theirs, strict=True):
        other = np.asarray(keras_output, np.float64)
        if mine.shape != other.shape:
            return False
        a, b = np.isfinite(mine), np.isfinite(other)
        first_a = np.argmax(~a.reshape(-1)) if not a.all() else -1
        first_b = np.argmax(~b.reshape(-1)) if not b.all() else -1
        if first_a != first_b:
            return False
        both = a & b
        if both.any() and not np.allclose(mine[both], other[both], rtol=10 * rtol,
                                          atol=10 * atol + 10 * rtol * np.max(
                                              np.abs(other[both]))):
            return False
    return True
