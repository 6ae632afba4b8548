"""Tensors the user's code stops the gradient of (``tf.stop_gradient``, ``ops.stop_gradient``):
held at their values while check's finite differences probe the model.

The tape treats a stopped tensor as a constant; finite differences see every path. So check
records every stopped tensor on the unperturbed call (a traced call, in the order the stops
are met) and, while it probes, each stop returns its recorded value: the differences then
measure the function whose gradient the tape gives. A stop inside a recurrent loop has a
value per step, which a trace does not hold: check refuses to probe it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Stops:
    """What the unperturbed call stopped: one value per stop, in the order they are met, and
    where each one is (its layer, or the loss)."""

    values: list[np.ndarray] = field(default_factory=list)
    places: list[str] = field(default_factory=list)
    in_loops: list[str] = field(default_factory=list)

    def described(self) -> list[str]:
        """One line per stop, for the report."""
        return [f"stop_gradient in {place}, output {tuple(value.shape)}: held at its value "
                "while the finite differences probe (the tape treats it as a constant)"
                for place, value in zip(self.places, self.values, strict=True)]


#: The index of the next stop a call meets.
_NEXT = [0]


def start_of_call() -> None:
    """A call of the whole model (or its replay) begins: stops are met from the first again."""
    _NEXT[0] = 0


def record(tf: Any, loss: Callable[[], Any]) -> Stops:
    """Every stop of one traced call of ``loss()``, with its value. Ops of a recurrent loop's
    body are named in ``in_loops``."""
    stops = Stops()
    symbolic: list[Any] = []
    outer: list[Any] = []  # the traced function's own graph (a loop's body has another)

    def recorder(original: Callable[..., Any]) -> Callable[..., Any]:
        def stop(value: Any, name: Any = None) -> Any:
            result = original(value, name=name)
            place = _place()
            if tf.compat.v1.get_default_graph() is outer[0]:
                symbolic.append(result)
                stops.places.append(place)
            else:
                stops.in_loops.append(place)
            return result

        return stop

    @tf.function(autograph=False)
    def traced() -> Any:
        outer.append(tf.compat.v1.get_default_graph())
        start_of_call()
        value = loss()
        return value, list(symbolic)

    with _patched(tf, recorder):
        _, values = traced()
    stops.values = [np.asarray(v) for v in values]
    return stops


@contextlib.contextmanager
def counted(tf: Any) -> Iterator[list[int]]:
    """Within: every stop met is counted (in the list yielded), and behaves as TensorFlow's.
    A run that meets none needs no recording."""
    count = [0]

    def counter(original: Callable[..., Any]) -> Callable[..., Any]:
        def stop(value: Any, name: Any = None) -> Any:
            count[0] += 1
            return original(value, name=name)

        return stop

    with _patched(tf, counter):
        yield count


@contextlib.contextmanager
def held(tf: Any, stops: Stops) -> Iterator[None]:
    """Within: the k-th stop of a call returns the recorded value of the k-th stop (as a
    constant, in a trace too)."""
    if not stops.values:
        yield
        return

    def holder(original: Callable[..., Any]) -> Callable[..., Any]:
        def stop(value: Any, name: Any = None) -> Any:
            k = _NEXT[0]
            _NEXT[0] = k + 1
            if k >= len(stops.values):
                return original(value, name=name)
            return tf.constant(stops.values[k], dtype=value.dtype)

        return stop

    with _patched(tf, holder):
        yield


@contextlib.contextmanager
def _patched(tf: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    original = tf.stop_gradient
    tf.stop_gradient = make(original)
    try:
        yield
    finally:
        tf.stop_gradient = original


def _place() -> str:
    """The layer whose code called the stop (the nearest ``self`` that is a Keras layer), or
    the loss."""
    import keras

    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.layers.Layer) and not isinstance(owner, keras.Model):
            return f"layer '{owner.name}'"
        frame = frame.f_back
    return "the loss"
