"""Keras' own whole-model call, ``model(x, training=…)`` then ``compute_loss``, under a tape
of its own: the witness that holds gradscope's replay to what ``fit`` computes.

Where the engine's pass cannot be Keras' own call looked on, the engine replays the graph one
layer call at a time, and a replay can misread a model in ways no per-layer check sees (a loss
Keras collects across calls, a layer that behaves differently outside its model's call). So
the replay's loss and every weight gradient must agree with this pass's, and the numbers
gradscope prints are this pass's. check's finite differences evaluate their losses here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gradscope.errors import InternalError
from gradscope.gradcheck import tolerance
from gradscope.keras.loss_terms import LossTerm
from gradscope.keras.stopped import start_of_call

#: ``compute_loss(feed, targets, flat_outputs)``, as the engine computes the loss.
LossFunction = Callable[[list[Any], list[Any], list[Any]], Any]


@dataclass(frozen=True)
class WholeModelPass:
    """The loss and the weight gradients of one ``model(x)`` + ``compute_loss`` under a tape.
    """

    loss: float
    gradients: dict[str, np.ndarray | None]  # by variable path
    #: path → (rows the batch indexes, rows, rows whose gradient is not 0)
    sparse_rows: dict[str, tuple[int, int, int]]
    terms: list[LossTerm] = field(default_factory=list)


def model_outputs(model: Any, feed: list[Any], training: bool) -> list[Any]:
    """The model's outputs, flat, from one call of the model as ``fit`` makes it."""
    import keras

    # The feed is flat, in the order of the model's inputs: packed as the model was built
    # (a dict of inputs stays a dict), as fit hands it over.
    structure = getattr(getattr(model, "_functional", None) or model, "_inputs_struct", None)
    x = (keras.tree.pack_sequence_as(structure, feed) if structure is not None
         else feed if len(feed) > 1 else feed[0])
    outputs = model(x, training=training)
    return list(keras.tree.flatten(outputs))


def whole_model_loss(model: Any, compute_loss: LossFunction, feed: list[Any],
                     targets: list[Any], training: bool) -> Any:
    """The loss ``fit`` minimises on this batch, from Keras' own call of the whole model."""
    start_of_call()
    return compute_loss(feed, targets, model_outputs(model, feed, training))


def whole_model_pass(model: Any, compute_loss: LossFunction, feed: list[Any],
                     targets: list[Any], training: bool,
                     terms: Callable[[list[Any], dict[int, list[Any]]], list[LossTerm]]
                     | None = None, eager: bool = False) -> WholeModelPass:
    """``terms(outputs, added)``: the loss term by term, from the call's outputs and what each
    layer added during it (by ``id(layer)``).

    The pass runs as one ``tf.function``, as ``fit`` runs its step (tracing and running it
    costs half of an eager run on a long recurrent model), unless ``eager`` or the model
    cannot be traced (see :func:`traced_or_eager`). The losses the layers hold from the user's
    own last call are left as they were."""
    import tensorflow as tf
    from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

    from gradscope._tf import native_stderr_silenced

    variables = model.trainable_variables
    layers = list(model._flatten_layers(include_self=True, recursive=True))

    def step(feed: list[Any], targets: list[Any]) -> Any:
        with tf.GradientTape() as tape:
            outputs = model_outputs(model, feed, training)
            loss = compute_loss(feed, targets, outputs)
        added = [layer._get_own_losses() for layer in layers]
        return (loss, tape.gradient(loss, variables), outputs,
                [get_keras_mask(output) for output in outputs], added)

    with native_stderr_silenced(), losses_kept(model):
        loss, grads, outputs, masks, added = traced_or_eager(step, feed, targets, eager=eager)
        for output, mask in zip(outputs, masks, strict=True):
            if mask is not None:
                set_keras_mask(output, mask)
        parts = (terms(outputs, {id(layer): list(values) for layer, values
                                 in zip(layers, added, strict=True)})
                 if terms is not None else [])
    return replace(pass_of(model, loss, grads), terms=parts)


def traced_or_eager(step: Callable[..., Any], *args: Any, eager: bool = False,
                    optimised: bool = False) -> Any:
    """``step(*args)`` as one ``tf.function`` (without Grappler unless ``optimised``: it
    would cost more than it saves on a pass that runs once, but for a second gradient
    through a loop, :func:`~gradscope._tf.grappler_if`), or eagerly where Keras or the model
    cannot be traced: then any error is the one Keras gives when it runs the model as it is.
    ``eager``: run it eagerly (a short model, where a trace costs more than it saves, or one
    the user compiled with ``run_eagerly=True``, which ``fit`` runs eagerly too)."""
    import tensorflow as tf

    from gradscope._tf import grappler_if
    from gradscope.errors import GradscopeError
    from gradscope.keras.observed_call import NotObserved

    if eager:
        return step(*args)
    try:
        with grappler_if(optimised):
            return tf.function(step, autograph=False)(*args)
    except (GradscopeError, NotObserved):  # NotObserved: the caller runs the replay
        raise
    except Exception:  # noqa: BLE001  (tracing fails in many ways; eager is the truth)
        return step(*args)


@contextlib.contextmanager
def losses_kept(model: Any) -> Iterator[None]:
    """The losses each layer holds from the user's own last call, put back afterwards: a
    traced call leaves symbolic tensors there, which the user's ``model.losses`` could not
    read."""
    held = [(layer, list(layer._losses))
            for layer in model._flatten_layers(include_self=True, recursive=True)]
    try:
        yield
    finally:
        for layer, values in held:
            layer._losses[:] = values


def runs_eagerly(model: Any) -> bool:
    """Whether the user compiled the model with ``run_eagerly=True``."""
    return bool(getattr(model, "_run_eagerly", False))


def all_variables(model: Any) -> list[Any]:
    """Every variable of the model, with the states of its stateful layers."""
    variables = list(model.variables)
    known = {id(v) for v in variables}
    return variables + [v for v in moved_variables(model) if id(v) not in known]


def snapshot(variables: list[Any]) -> list[Any]:
    """A copy of each variable's value now, as a tensor (training moves on meanwhile)."""
    import tensorflow as tf

    return [tf.constant(np.array(v.numpy())) for v in variables]


def whole_model_function(model: Any, compute_loss: Callable[..., Any], training: bool,
                         variables: list[Any]) -> Any:
    """A traced function ``(values, feed, targets, sample_weight) → (loss, gradients)``: Keras'
    own call of the whole model and its loss from ``values`` (one per ``variables``, as a
    :func:`snapshot` gives them), under Keras' StatelessScope, which neither reads nor moves
    the variables themselves: training may go on beside it (GradientFlow traces and runs it
    on its worker). ``compute_loss(feed, targets, outputs, sample_weight)``."""
    import tensorflow as tf
    from keras.src.backend.common.stateless_scope import StatelessScope

    positions = {id(v): k for k, v in enumerate(variables)}
    trainable = [positions[id(v)] for v in model.trainable_variables]

    @tf.function(autograph=False, reduce_retracing=True)
    def run(values: list[Any], feed: list[Any], targets: list[Any],
            sample_weight: Any = None) -> Any:
        watched = [values[k] for k in trainable]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            # collect_losses: in a StatelessScope, Keras keeps what layers add (activity
            # regularizers, add_loss) in the scope, where model.losses reads it.
            with StatelessScope(state_mapping=list(zip(variables, values, strict=True)),
                                collect_losses=True):
                outputs = model_outputs(model, feed, training)
                loss = compute_loss(feed, targets, outputs, sample_weight)
        return loss, tape.gradient(loss, watched)

    return run


def pass_of(model: Any, loss: Any, grads: list[Any]) -> WholeModelPass:
    """A :class:`WholeModelPass` from a loss and the gradients of the trainable variables."""
    gradients, sparse = dense_gradients(model.trainable_variables, grads)
    return WholeModelPass(loss=float(loss.numpy()), gradients=gradients, sparse_rows=sparse)


def dense_gradients(variables: list[Any], grads: list[Any]
                    ) -> tuple[dict[str, np.ndarray | None], dict[str, tuple[int, int, int]]]:
    """Gradients by variable path as NumPy arrays. An ``IndexedSlices`` (an Embedding's) is
    summed into a dense array, and its rows counted: those it indexes, all, and those whose
    gradient is not 0 (a masked token's, mask_zero's 0, is indexed and gets zeros)."""
    import tensorflow as tf

    gradients: dict[str, np.ndarray | None] = {}
    sparse: dict[str, tuple[int, int, int]] = {}
    for variable, gradient in zip(variables, grads, strict=True):
        if isinstance(gradient, tf.IndexedSlices):
            rows = int(np.unique(gradient.indices.numpy()).size)
            dense = tf.convert_to_tensor(gradient).numpy()
            by_row = dense.reshape(int(variable.shape[0]), -1)
            sparse[variable.path] = (rows, int(variable.shape[0]),
                                     int(np.count_nonzero(np.any(by_row != 0, axis=1))))
            gradients[variable.path] = dense
            continue
        gradients[variable.path] = None if gradient is None else gradient.numpy()
    return gradients, sparse


def moved_state(model: Any) -> list[tuple[Any, np.ndarray]]:
    """Every variable a call of the model may move, with its value now. Assign the values
    back with :func:`restore` so that the next pass sees the same model."""
    return moved_state_of(moved_variables(model))


def moved_state_of(variables: list[Any]) -> list[tuple[Any, np.ndarray]]:
    """Each of ``variables`` with its value now (for :func:`restore`)."""
    return [(variable, np.array(variable.numpy())) for variable in variables]


@contextlib.contextmanager
def states_at(values: list[tuple[Any, np.ndarray]] | None) -> Iterator[None]:
    """Each variable of ``values`` holding its value there within the block, and given its
    own back after it (None or empty: nothing changes)."""
    if not values:
        yield
        return
    now = moved_state_of([variable for variable, _ in values])
    restore(values)
    try:
        yield
    finally:
        restore(now)


def moved_variables(model: Any) -> list[Any]:
    """Every variable a call of the model may move: the non-trainable variables (batch-norm
    statistics, dropout seeds) and the states of stateful recurrent layers (Keras keeps those
    outside the tracked variables)."""
    variables = list(model.non_trainable_variables)
    tracked = {id(v) for v in variables}
    for state in carried_state_variables(model):
        if id(state) not in tracked:
            tracked.add(id(state))
            variables.append(state)
    return variables


def carried_state_variables(model: Any) -> list[Any]:
    """The state variables of the model's stateful recurrent layers (what their next call
    starts from), in layer order."""
    found: list[Any] = []
    for layer in stateful_layers(model):
        for state in layer_carried_states(layer):
            if all(state is not f for f in found):
                found.append(state)
    return found


def stateful_layers(model: Any) -> list[Any]:
    """The model's stateful recurrent layers, in layer order."""
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if getattr(layer, "stateful", False)]


def layer_carried_states(layer: Any) -> list[Any]:
    """A stateful layer's state variables, flat ([] where it holds none yet)."""
    import keras

    held = getattr(layer, "states", None)
    # StackedRNNCells keeps one list of states per cell: flattened, as Keras assigns them.
    return [state for state in (keras.tree.flatten(held) if held is not None else [])
            if hasattr(state, "assign")]


def seed_random_draws(model: Any, seed: int) -> dict[int, np.ndarray]:
    """Every random draw of a training-mode call fixed by ``seed``, however the model came to
    be (a file loaded after seeding, the user's own object, a copy, a model whose code was
    imported first): ``keras.utils.set_random_seed(seed)`` (Python, NumPy, TensorFlow and
    Keras' global generator), then each of the model's ``SeedGenerator`` states, in layer
    order, set to a fresh generator's: ``[its own seed, 0]`` where the code gave one, else the
    next draw of Python's generator, as ``SeedGenerator(seed=None)`` draws it. Returns the
    state each generator was given, by ``id``: where its draws start."""
    import random

    import keras

    keras.utils.set_random_seed(seed)
    given: dict[int, np.ndarray] = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator) in given:
                continue
            initial = getattr(generator, "_initial_seed", None)
            first = initial if isinstance(initial, int) else random.randint(1, int(1e9))
            given[id(generator)] = np.asarray([first, 0], generator.state.dtype)
            generator.state.assign(given[id(generator)])
    return given


@contextlib.contextmanager
def as_a_run_starts(model: Any, training: bool, seed: int) -> Iterator[None]:
    """While inside, the model as each of gradscope's runs of it starts: in training mode every
    random draw seeded as the run's were (:func:`seed_random_draws`); afterwards, every
    variable a call moves (:func:`moved_state`) put back."""
    before = moved_state(model)
    try:
        if training:
            seed_random_draws(model, seed)
        yield
    finally:
        restore(before)


def restore(saved: list[tuple[Any, np.ndarray]]) -> None:
    """Each variable given its saved value back (assigned only where it moved: reading one
    costs about a tenth of assigning it, and most calls move none)."""
    for variable, value in saved:
        if not np.array_equal(variable.numpy(), value):
            variable.assign(value)


def confirm(replay_loss: float, replay_gradients: dict[str, np.ndarray | None],
            own: WholeModelPass, dtype: str, where: str) -> None:
    """The engine's replay must give Keras' own loss and gradients; else an internal error
    naming the tensor and both values (gradscope misread the model, and says so)."""
    rtol, atol = tolerance("replay", dtype)
    if not _close(np.asarray(replay_loss), np.asarray(own.loss), atol, rtol):
        raise InternalError(
            f"internal error: {where}: gradscope's layer-by-layer run gives the loss "
            f"{replay_loss:.9g}, Keras' own model(x) + compute_loss gives {own.loss:.9g}; "
            "gradscope misreads this model, so it shows nothing; please report it")
    for path, value in own.gradients.items():
        replay = replay_gradients.get(path)
        if (replay is None) != (value is None):
            found = "no gradient" if replay is None else "a gradient"
            raise InternalError(
                f"internal error: {where}: {path}: gradscope's layer-by-layer run gives "
                f"{found}, Keras' own call {'a gradient' if replay is None else 'none'}; "
                "gradscope misreads this model; please report it")
        if replay is not None and value is not None and not _close(replay, value, atol, rtol):
            raise InternalError(
                f"internal error: {where}: {path} (layer {path.split('/')[0]}): gradscope's "
                f"layer-by-layer run gives ‖g‖ {np.linalg.norm(replay):.6g}, Keras' own "
                f"model(x) + compute_loss gives {np.linalg.norm(value):.6g} (max |difference| "
                f"{np.max(np.abs(replay - value)):.2e}); gradscope misreads this model, so it "
                "shows nothing; please report it")


def _close(replay: np.ndarray, own: np.ndarray, atol: float, rtol: float) -> bool:
    if replay.shape != own.shape:
        return False
    if not np.all(np.isfinite(own)) or not np.all(np.isfinite(replay)):
        return bool(np.array_equal(np.isnan(replay), np.isnan(own))
                    and np.array_equal(np.where(np.isnan(own), 0, own),
                                       np.where(np.isnan(replay), 0, replay)))
    scale = float(np.max(np.abs(own))) if own.size else 0.0
    return own.size == 0 or float(np.max(np.abs(replay - own))) <= atol + rtol * scale
