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
def _methods_replaced(name: str, replacements: list[tuple[Any, Callable[..., Any]]]
                      ) -> Iterator[None]:
    """While inside, each layer's method ``name`` (``(layer, method)`` in ``replacements``),
    called by this thread, is ``method(own, *args, **kwargs)``, ``own`` being the layer's
    own; other threads call its own."""
    owner = threading.get_ident()

    def hooked(own: Any, method: Callable[..., Any]) -> Callable[..., Any]:
        def replaced(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return own(*args, **kwargs)
            return method(own, *args, **kwargs)

        return replaced

    for layer, method in replacements:
        # object.__setattr__: a Keras layer tracks what is set on it; a hook is not its state.
        object.__setattr__(layer, name, hooked(getattr(layer, name), method))
    try:
        yield
    finally:
        for layer, _ in replacements:
            object.__delattr__(layer, name)


def _zeros_replaced(replacements: list[tuple[Any, Callable[[Any], Any]]]
                    ) -> contextlib.AbstractContextManager[None]:
    """While inside, each layer's ``get_initial_state``, asked by this thread, returns
    ``replace(Keras' own zeros)`` (``(layer, replace)`` in ``replacements``); other threads
    get the zeros as they are."""
    def replacing(replace: Callable[[Any], Any]) -> Callable[..., Any]:
        return lambda own, *args, **kwargs: replace(own(*args, **kwargs))

    return _methods_replaced("get_initial_state",
                             [(layer, replacing(replace)) for layer, replace in replacements])


def inner_loops_replaced(replacements: list[tuple[Any, Callable[..., Any]]]
                         ) -> contextlib.AbstractContextManager[None]:
    """While inside, each recurrent layer's loop (``(layer, loop)`` in ``replacements``), run
    by this thread, is ``loop(own, sequences, initial_state, mask, training)``, ``own`` being
    Keras' own ``inner_loop`` of the layer; other threads run Keras' own. ``--flow``'s probes
    and ``--chunks``' cuts run the loops this way."""
    def looping(loop: Callable[..., Any]) -> Callable[..., Any]:
        def run(own: Any, sequences: Any, initial_state: Any, mask: Any,
                training: Any = False) -> Any:
            return loop(own, sequences, initial_state, mask, training)

        return run

    return _methods_replaced("inner_loop",
                             [(layer, looping(loop)) for layer, loop in replacements])


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
