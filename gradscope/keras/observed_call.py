"""Keras' own call of the model, ``model(x, training=…)``, with gradscope looking on, so that
the pass whose numbers gradscope prints is the very call ``fit`` makes.

For the duration of the call, and only on the thread that makes it (training may trace its
own step on another thread meanwhile), hooks record what each layer call received and
returned, and make each recurrent layer's ``get_initial_state`` hand back watched copies of
Keras' own zeros. They change no computation (check's :func:`zero_states_shifted` aside). A
recurrent call that does not ask for its zeros (a fused path, such as Keras' bidirectional
kernel on a GPU) raises :class:`NotObserved`, and the caller runs gradscope's replay instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class NotObserved(Exception):  # noqa: N818  (a signal to the caller, not an error for users)
    """Keras' own call ran a path the hooks could not see (see the module)."""


@contextlib.contextmanager
def runner_wrapped(runner: Any, wrap: Callable[[Any, Callable[..., Any]], Callable[..., Any]]
                   ) -> Iterator[None]:
    """While inside, the graph runner's ``_run_through_graph`` (called by this thread) calls
    ``wrap(operation, call)`` for each layer, where ``call`` is Keras' own call of it (with
    the call-context arguments ``Functional.call`` passes), and runs what it returns."""
    original = runner._run_through_graph
    owner = threading.get_ident()

    def run_through_graph(inputs: Any, operation_fn: Any = lambda op: op,
                          call_fn: Any = None) -> Any:
        if threading.get_ident() != owner:
            return original(inputs, operation_fn=operation_fn, call_fn=call_fn)
        return original(inputs, operation_fn=lambda op: wrap(op, operation_fn(op)),
                        call_fn=call_fn)

    # object.__setattr__: a Keras layer tracks what is set on it; a hook is not its state.
    object.__setattr__(runner, "_run_through_graph", run_through_graph)
    try:
        yield
    finally:
        object.__delattr__(runner, "_run_through_graph")


@contextlib.contextmanager
def layers_wrapped(layers: list[Any], wrap: Callable[[Any, Callable[..., Any]], Callable[..., Any]]
                   ) -> Iterator[None]:
    """The same for a subclassed model, whose graph is its own ``call``: while inside, each
    call this thread makes of one of ``layers`` (the model's own layers), outside any other of
    them, runs ``wrap(layer, call)``, where ``call`` is Keras' own ``Layer.__call__`` of it.
    The hook sits on ``Layer.__call__`` for the duration (Python looks ``__call__`` up on the
    class), and passes every other call through untouched."""
    import keras

    owner = threading.get_ident()
    targets = {id(layer) for layer in layers}
    original = keras.layers.Layer.__call__
    inside = [0]

    def keras_call(layer: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            inside[0] += 1
            try:
                return original(layer, *args, **kwargs)
            finally:
                inside[0] -= 1

        return call

    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if id(self) not in targets or inside[0] or threading.get_ident() != owner:
            return original(self, *args, **kwargs)
        return wrap(self, keras_call(self))(*args, **kwargs)

    keras.layers.Layer.__call__ = hooked
    try:
        yield
    finally:
        keras.layers.Layer.__call__ = original


@contextlib.contextmanager
def _zeros_replaced(replacements: list[tuple[Any, Callable[[Any], Any]]]) -> Iterator[None]:
    """While inside, each layer's ``get_initial_state``, asked by this thread, returns
    ``replace(Keras' own zeros)`` (``(layer, replace)`` in ``replacements``); other threads
    get the zeros as they are."""
    owner = threading.get_ident()
    for layer, replace in replacements:
        original = layer.get_initial_state

        def get_initial_state(*args: Any, _original: Any = original,
                              _replace: Callable[[Any], Any] = replace, **kwargs: Any) -> Any:
            zeros = _original(*args, **kwargs)
            return zeros if threading.get_ident() != owner else _replace(zeros)

        object.__setattr__(layer, "get_initial_state", get_initial_state)
    try:
        yield
    finally:
        for layer, _ in replacements:
            object.__delattr__(layer, "get_initial_state")


@contextlib.contextmanager
def inner_loops_replaced(replacements: list[tuple[Any, Callable[..., Any]]]) -> Iterator[None]:
    """While inside, each recurrent layer's loop (``(layer, loop)`` in ``replacements``), run
    by this thread, is ``loop(own, sequences, initial_state, mask, training)``, ``own`` being
    Keras' own ``inner_loop`` of the layer; other threads run Keras' own. ``--flow``'s probes
    and ``--chunks``' cuts run the loops this way."""
    owner = threading.get_ident()
    for layer, loop in replacements:
        def inner_loop(sequences: Any, initial_state: Any, mask: Any, training: Any = False,
                       _own: Any = layer.inner_loop, _loop: Any = loop) -> Any:
            if threading.get_ident() != owner:
                return _own(sequences, initial_state, mask, training=training)
            return _loop(_own, sequences, initial_state, mask, training)

        # object.__setattr__: a Keras layer tracks what is set on it; a hook is not its state.
        object.__setattr__(layer, "inner_loop", inner_loop)
    try:
        yield
    finally:
        for layer, _ in replacements:
            object.__delattr__(layer, "inner_loop")


def zero_states_watched(layers: list[Any], states: list[Any],
                        watch: Callable[[Any], None]) -> contextlib.AbstractContextManager[None]:
    """While inside, each of ``layers``' ``get_initial_state`` (called by this thread) returns
    copies of Keras' own zeros, watched, and appends them to ``states`` in the order asked."""
    import keras
    import tensorflow as tf

    def fresh(tensor: Any) -> Any:
        copy = tf.identity(tensor)
        watch(copy)
        states.append(copy)
        return copy

    return _zeros_replaced([(layer, lambda zeros: keras.tree.map_structure(fresh, zeros))
                            for layer in layers])


def zero_states_shifted(shifts: list[tuple[Any, list[list[Any]]]]
                        ) -> contextlib.AbstractContextManager[None]:
    """While inside, the k-th time this thread asks ``layer.get_initial_state`` for its zeros
    (``(layer, per_request)`` in ``shifts``), Keras' own zeros come back with
    ``per_request[k]`` added, one tensor per state in Keras' order; a request beyond the list
    gets the zeros as they are. Finite differences move the initial states of Keras' own call
    of the whole model this way: its layers are counted here, not by the engine's recorder."""
    import keras

    def shifted(per_request: list[list[Any]]) -> Callable[[Any], Any]:
        asked = [0]

        def add(zeros: Any) -> Any:
            if asked[0] >= len(per_request):
                return zeros
            shift = per_request[asked[0]]
            asked[0] += 1
            flat = keras.tree.flatten(zeros)
            return keras.tree.pack_sequence_as(
                zeros, [zero + delta for zero, delta in zip(flat, shift, strict=True)])

        return add

    return _zeros_replaced([(layer, shifted(per_request)) for layer, per_request in shifts])


__all__ = ["NotObserved", "inner_loops_replaced", "runner_wrapped", "zero_states_shifted",
           "zero_states_watched"]
