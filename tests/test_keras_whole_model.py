"""The pass is Keras' own ``model(x)`` + ``compute_loss``, looked on; where it cannot be,
the replay is witnessed by Keras' own call under a tape of its own. On models whose layers are
called more than once and add losses as they go (shared layers and sub-models with activity
regularizers), and on stateful layers.

The truth of every test is Keras' own GradientTape on the user's object; a mutant of the
replay that reads such a model the old way takes no part in Keras' own call, and is caught
as an internal error where the replay runs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from conftest import keras_tape

import gradscope
from gradscope.errors import InternalError

RTOL = 1e-5



@pytest.fixture(scope="module")
def siamese(tf: Any) -> tuple[Any, list[np.ndarray], np.ndarray]:
    """One GRU applied to two inputs, with an activity regularizer: Keras adds one loss term
    per call."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(11)
    a = keras.Input((6, 3), name="a")
    b = keras.Input((6, 3), name="b")
    gru = layers.GRU(4, activity_regularizer=keras.regularizers.L2(0.1), name="shared_gru")
    distance = layers.Subtract(name="distance")([gru(a), gru(b)])
    out = layers.Dense(1, activation="sigmoid", name="out")(distance)
    model = keras.Model([a, b], out)
    model.compile(loss="binary_crossentropy")
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((5, 6, 3)).astype("float32") for _ in range(2)]
    return model, x, rng.integers(0, 2, (5, 1)).astype("float32")


@pytest.fixture(scope="module")
def shared_encoder(tf: Any) -> tuple[Any, list[np.ndarray], np.ndarray]:
    """A sub-model (GRU → Dense, both with activity regularizers) applied to two inputs."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(12)
    inner = keras.Input((6, 3))
    h = layers.GRU(4, activity_regularizer=keras.regularizers.L1(0.05), name="enc_gru")(inner)
    encoded = layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.1),
                           name="enc_dense")(h)
    encoder = keras.Model(inner, encoded, name="encoder")
    a = keras.Input((6, 3), name="a")
    b = keras.Input((6, 3), name="b")
    joined = layers.Concatenate(name="join")([encoder(a), encoder(b)])
    model = keras.Model([a, b], layers.Dense(1, activation="sigmoid", name="head")(joined))
    model.compile(loss="binary_crossentropy")
    rng = np.random.default_rng(1)
    x = [rng.standard_normal((5, 6, 3)).astype("float32") for _ in range(2)]
    return model, x, rng.integers(0, 2, (5, 1)).astype("float32")


@pytest.mark.parametrize("fixture", ["siamese", "shared_encoder"])
@pytest.mark.parametrize("passes", ["eager", "traced"])
def test_shared_layers_that_add_losses_give_keras_own_numbers(fixture, passes, request, tf):
    if passes == "traced":
        request.getfixturevalue("traced")
    model, x, y = request.getfixturevalue(fixture)
    report = gradscope.explain(model, x=x, y=y)
    loss, truth = keras_tape(model, x, y)
    assert report.loss.value == pytest.approx(loss, rel=RTOL)
    ours = {g.path: g.stats.l2 for g in report.gradients if g.stats is not None}
    assert sorted(ours) == sorted(truth)
    for path, gradient in truth.items():
        assert ours[path] == pytest.approx(float(np.linalg.norm(gradient)), rel=RTOL), path


def _replay_loses_added_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: each layer call replayed on its own, as before the fix, so that the second
    call of the shared GRU wipes the loss its first call added."""
    from gradscope.keras import engine

    monkeypatch.setattr(engine, "model_call_context",
                        lambda model, training: contextlib.nullcontext())


@pytest.fixture
def not_looked_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keras' own call as on a path the hooks cannot see (a recurrent call that does not ask
    its get_initial_state for zeros, as Keras' fused bidirectional kernel on a GPU): the
    engine falls back to its replay."""
    from gradscope.keras import engine

    monkeypatch.setattr(engine, "zero_states_watched",
                        lambda layers, states, watch: contextlib.nullcontext())


@pytest.mark.parametrize("passes", ["eager", "traced"])
def test_the_pass_is_keras_own_call_so_a_broken_replay_is_never_shown(siamese, tf, monkeypatch,
                                                                      passes, request):
    """explain runs Keras' own call, looked on: the replay's mutant takes no part, and the
    numbers are Keras' own."""
    if passes == "traced":
        request.getfixturevalue("traced")
    _replay_loses_added_losses(monkeypatch)
    model, x, y = siamese
    report = gradscope.explain(model, x=x, y=y)
    loss, _ = keras_tape(model, x, y)
    assert report.loss.value == pytest.approx(loss, rel=RTOL)


@pytest.mark.parametrize("passes", ["eager", "traced"])
def test_where_the_call_cannot_be_looked_on_the_replay_is_witnessed(siamese, tf, monkeypatch,
                                                                     passes, request,
                                                                     not_looked_on):
    """The fallback: the replay, held against Keras' own call. Its mutant must be refused as
    an internal error naming the loss and both values; the real replay gives Keras' numbers.
    """
    if passes == "traced":
        request.getfixturevalue("traced")
    model, x, y = siamese
    loss, _ = keras_tape(model, x, y)
    assert gradscope.explain(model, x=x, y=y).loss.value == pytest.approx(loss, rel=RTOL)
    _replay_loses_added_losses(monkeypatch)
    with pytest.raises(InternalError, match="layer-by-layer run gives the loss .* Keras' own"):
        gradscope.explain(model, x=x, y=y)


def test_check_finite_differences_do_not_share_the_replay(siamese, tf, monkeypatch):
    """With the replay broken as above, check's pass and its finite differences are Keras' own
    call: the mutant takes no part, and the loss checked is Keras' own."""
    _replay_loses_added_losses(monkeypatch)
    model, x, y = siamese
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed
    loss, _ = keras_tape(model, x, y)
    assert report.loss.value == pytest.approx(loss, rel=RTOL)


def test_check_refuses_a_broken_replay_where_the_call_cannot_be_looked_on(siamese, tf,
                                                                         monkeypatch,
                                                                         not_looked_on):
    """Where check's pass must be the replay, the broken replay never passes."""
    _replay_loses_added_losses(monkeypatch)
    model, x, y = siamese
    with pytest.raises(InternalError):
        gradscope.check(model, x=x, y=y)


def test_check_passes_on_the_shared_layers(shared_encoder, tf):
    model, x, y = shared_encoder
    report = gradscope.check(model, x=x, y=y)
    fd = [e for t in report.tensors for e in t.witnesses if e.witness == "finite_differences"]
    assert fd and all(e.passed for e in fd)


@pytest.fixture(scope="module")
def stateful(tf: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """A stateful GRU that has already seen one batch: its carried state is not zero."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(13)
    model = keras.Sequential([keras.Input((6, 3), batch_size=4),
                              layers.GRU(4, stateful=True, name="gru"),
                              layers.Dense(2, name="dense")])
    model.compile(loss="mse")
    rng = np.random.default_rng(2)
    model(rng.standard_normal((4, 6, 3)).astype("float32"))
    return model, rng.standard_normal((4, 6, 3)).astype("float32"), \
        rng.standard_normal((4, 2)).astype("float32")


def test_stateful_layer_starts_from_its_carried_state_and_reports_its_gradient(stateful, tf):
    model, x, y = stateful
    carried = np.array(model.layers[0].states[0].numpy())
    assert np.any(carried != 0)
    report = gradscope.explain(model, x=x, y=y)
    np.testing.assert_array_equal(model.layers[0].states[0].numpy(), carried)
    loss, truth = keras_tape(model, x, y)
    model.layers[0].states[0].assign(carried)
    assert report.loss.value == pytest.approx(loss, rel=RTOL)
    (state,) = report.initial_state_gradients
    assert state.name == "gru/h0" and state.source.startswith("carried")
    # ∂L/∂(carried state), by Keras' own tape with the state as a watched tensor.
    cell = model.layers[0]
    with tf.GradientTape() as tape:
        h0 = tf.constant(carried)
        tape.watch(h0)
        out = model.layers[1](cell(x, initial_state=[h0]))
        value = model.compute_loss(x=x, y=y, y_pred=out, training=False)
    cell.states[0].assign(carried)
    assert state.stats.l2 == pytest.approx(float(np.linalg.norm(tape.gradient(value, h0))),
                                           rel=RTOL)
    assert state.source.startswith("carried: the state the previous batch left")


def keras_load(path: Any) -> Any:
    import keras

    return keras.saving.load_model(path)


def test_a_saved_stateful_model_is_said_to_load_with_zeros(stateful, tf, tmp_path):
    """Found tried as a new user would: a saved stateful model's h0 was said to be "the state
    the previous batch left"; Keras saves no state, and the file loads with zeros."""
    model, x, y = stateful
    path = tmp_path / "stateful.keras"
    model.save(path)
    loaded = keras_load(path)
    assert not np.any(loaded.layers[0].states[0].numpy())  # Keras' own load: zeros
    (state,) = gradscope.explain(str(path), x=x, y=y).initial_state_gradients
    assert state.source.startswith("carried (stateful=True), but a saved file holds no "
                                   "state: it loads with zeros")


def test_check_on_a_stateful_layer_restores_the_state_before_every_probe(stateful, tf):
    model, x, y = stateful
    report = gradscope.check(model, x=x, y=y)
    assert report.summary.passed, [(t.name, [e.detail for e in t.witnesses])
                                   for t in report.tensors if not t.passed]
    assert "gru/h0" in {t.name for t in report.tensors}


def test_a_batch_of_another_size_than_a_fixed_input_batch_is_refused(stateful):
    from gradscope.errors import GradscopeError

    model, x, y = stateful
    with pytest.raises(GradscopeError, match="along axis 0 .* expects 4"):
        gradscope.explain(model, x=np.concatenate([x, x]), y=np.concatenate([y, y]))
    with pytest.raises(GradscopeError, match="--batch-size: a batch of 8, but .* fixed batch "
                                             "size of 4"):
        gradscope.explain(model, batch_size=8)
    assert gradscope.explain(model).model.batch_size == 4


def test_gradient_flow_records_keras_own_numbers_whatever_the_replay(siamese, tf, monkeypatch):
    """GradientFlow's traced pass is Keras' own call, looked on: a broken replay takes no part
    in it."""
    from gradscope.keras import GradientFlow

    model, x, y = siamese
    loss, _ = keras_tape(model, x, y)
    _replay_loses_added_losses(monkeypatch)
    flow = GradientFlow(model=model)
    flow.observe(x, y, step=1)
    assert flow._pass.own
    assert flow.history.observations[0].loss == pytest.approx(loss, rel=RTOL)


def test_gradient_flow_confirms_a_replay_with_keras_own_call(siamese, tf, monkeypatch,
                                                             not_looked_on):
    """Where the call cannot be looked on, the pass is the replay: at a model's first
    observation it is held against Keras' own call. A replay that loses the shared GRU's added
    loss (the mutant) is a loud internal error, never a recorded number; the real one
    records."""
    from gradscope.keras import GradientFlow

    model, x, y = siamese
    flow = GradientFlow(model=model)
    flow.observe(x, y, step=1)
    assert not flow._pass.own
    loss, _ = keras_tape(model, x, y)
    assert flow.history.observations[0].loss == pytest.approx(loss, rel=RTOL)
    _replay_loses_added_losses(monkeypatch)
    with pytest.raises(InternalError, match="GradientFlow on model .* layer-by-layer run "
                                            "gives the loss"):
        GradientFlow(model=model).observe(x, y, step=1)


def test_in_fit_a_replay_s_witness_is_traced_beside_training_and_catches_the_mutant(
        siamese, tf, monkeypatch, not_looked_on):
    """In fit, where the pass is the replay, Keras' own call is traced during the warm-up,
    beside training, for fit's batches; the first observation runs that trace, and the mutant
    is caught there. Where the pass is Keras' own call, no witness is traced."""
    import keras

    from gradscope.keras import GradientFlow

    model, x, y = siamese
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    copy.compile(loss="binary_crossentropy", optimizer="sgd")
    xs = [np.concatenate([a] * 8) for a in x]
    ys = np.concatenate([y] * 8)
    flow = GradientFlow(every=4)
    copy.fit(xs, ys, batch_size=5, epochs=1, verbose=0, shuffle=False, callbacks=[flow])
    assert flow._pass.witness_concrete is not None  # traced beside training, and used
    assert len(flow.history.observations) == 2
    _replay_loses_added_losses(monkeypatch)
    with pytest.raises(InternalError, match="layer-by-layer run gives the loss"):
        copy.fit(xs, ys, batch_size=5, epochs=1, verbose=0, shuffle=False,
                 callbacks=[GradientFlow(every=4)])
    monkeypatch.undo()
    own = GradientFlow(every=4)
    copy.fit(xs, ys, batch_size=5, epochs=1, verbose=0, shuffle=False, callbacks=[own])
    assert own._pass.own and own._pass.witness_concrete is None
    assert len(own.history.observations) == 2


def test_gradient_flow_leaves_a_stateful_layer_as_training_left_it(stateful, tf):
    """The extra pass calls the layers: a stateful GRU would carry the observed batch's state
    into training's next step. Its state is what it was before the observation, and the
    observation gives Keras' own loss from that state."""
    from gradscope.keras import GradientFlow

    model, x, y = stateful
    carried = np.array(model.layers[0].states[0].numpy())
    flow = GradientFlow(model=model)
    flow.observe(x, y, step=1)
    np.testing.assert_array_equal(model.layers[0].states[0].numpy(), carried)
    loss, _ = keras_tape(model, x, y)
    model.layers[0].states[0].assign(carried)
    assert flow.history.observations[0].loss == pytest.approx(loss, rel=RTOL)


def _eager_only_model(keras: Any, run_eagerly: bool) -> Any:
    """A user's layer that reads a tensor's value in Python: it runs eagerly only."""

    class Scale(keras.layers.Layer):
        def call(self, x):
            factor = 2.0 if float(keras.ops.max(x)) > 0 else 1.0
            return x * factor

        def compute_output_shape(self, shape):
            return shape

    keras.utils.set_random_seed(14)
    inputs = keras.Input((5, 3))
    h = keras.layers.GRU(4, name="gru")(Scale(name="scale")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(h))
    model.compile(loss="mse", run_eagerly=run_eagerly)
    return model


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model's passes traced, however few its steps (short ones run eagerly)."""
    from gradscope.keras import engine

    monkeypatch.setattr(engine, "TRACE_FROM_STEPS", 1)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_model_that_runs_only_eagerly_is_explained_from_its_eager_call(tf, traced,
                                                                        run_eagerly):
    """Both passes run as one tf.function each, as fit runs its step; a model that cannot be
    traced (or is compiled to run eagerly) runs eagerly, with the same numbers as the tape."""
    import keras

    model = _eager_only_model(keras, run_eagerly)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5, 3)).astype("float32")
    y = rng.standard_normal((4, 2)).astype("float32")
    report = gradscope.explain(model, x=x, y=y)
    loss, truth = keras_tape(model, x, y)
    assert report.loss.value == pytest.approx(loss, rel=RTOL)
    ours = {g.path: g.stats.l2 for g in report.gradients if g.stats is not None}
    for path, gradient in truth.items():
        assert ours[path] == pytest.approx(float(np.linalg.norm(gradient)), rel=RTOL), path


def test_the_losses_a_model_holds_from_its_last_call_are_left_alone(siamese, tf, traced):
    """The traced passes must not leave symbolic tensors in the layers: what the user's own
    last call added is still there, as values, after explain."""
    model, x, y = siamese
    model(x)
    before = [float(loss) for loss in model.losses]
    gradscope.explain(model, x=[a + 1.0 for a in x], y=y)
    assert [float(loss) for loss in model.losses] == before
