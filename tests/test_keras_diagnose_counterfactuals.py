"""gradscope/keras/diagnose/counterfactuals.py: each counterfactual against the same
diagnosis run on a copy of the model changed by hand here (the bias set by hand, the polar
factor by an eigendecomposition), and the suggested clipping against Keras' own optimizer's
rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import keras_tape

import gradscope

B, T, F, U = 4, 20, 3, 5


def _model(kind: str) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F), name="x")
    layer = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU}[kind]
    h = layer(U, return_sequences=True, name="rnn")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    if kind == "lstm":  # a forget gate near shut: +1 has something to open
        bias = model.get_layer("rnn").cell.bias
        bias.assign(np.r_[np.zeros(U), -3 * np.ones(U), np.zeros(2 * U)].astype("float32"))
    model.compile(loss="mse")
    return model


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, T, F)).astype("float32"),
            rng.standard_normal((B, T, 1)).astype("float32"))


def _changed_by_hand(model: Any, change: Any) -> Any:
    import keras

    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    change(copy.get_layer("rnn").cell)
    copy.compile(loss="mse")
    return copy


def _polar(block: np.ndarray) -> np.ndarray:
    """W (WᵀW)^(−1/2), by an eigendecomposition of WᵀW: the orthogonal factor of W."""
    values, vectors = np.linalg.eigh(block.T @ block)
    return block @ vectors @ np.diag(values ** -0.5) @ vectors.T


def _same(found: Any, truth: Any) -> None:
    """A counterfactual's numbers equal the diagnosis of the copy changed by hand."""
    assert found.applicable, found.note
    assert found.horizon == truth.horizon.measured
    assert found.lyapunov_1 == pytest.approx(truth.lyapunov[0], rel=1e-4, abs=1e-6)
    assert truth.flow is not None and found.flow is not None
    assert found.flow.first == pytest.approx(truth.flow.first, rel=1e-4)
    assert found.flow.last == pytest.approx(truth.flow.last, rel=1e-4)
    assert found.flow.ratio == pytest.approx(truth.flow.ratio, rel=1e-3)


def _diagnosed(kind: str) -> tuple[Any, np.ndarray, np.ndarray, list[np.ndarray], Any]:
    """:func:`_model` of ``kind`` diagnosed on :func:`_batch` with its counterfactuals, and
    its weights before the diagnosis. For the module's tests to read, never to change: a
    test that changes the model changes a copy (:func:`_changed_by_hand`) or builds its own."""
    model = _model(kind)
    x, y = _batch()
    weights = [w.copy() for w in model.get_weights()]
    return model, x, y, weights, gradscope.diagnose(model, x=x, y=y)


@pytest.fixture(scope="module")
def lstm_diagnosed(tf: Any) -> tuple[Any, np.ndarray, np.ndarray, list[np.ndarray], Any]:
    return _diagnosed("lstm")


@pytest.fixture(scope="module")
def gru_diagnosed(tf: Any) -> tuple[Any, np.ndarray, np.ndarray, list[np.ndarray], Any]:
    return _diagnosed("gru")


def test_forget_bias_plus_1_against_a_copy_changed_by_hand(lstm_diagnosed: Any) -> None:
    model, x, y, weights, report = lstm_diagnosed
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights(), strict=True))
    entry = report.layers[0]
    found = {c.kind: c for c in entry.counterfactuals}
    assert found["keep_bias"].change == "forget-gate bias +1"
    # An LSTM's list has no update-gate bias raised to 1 (a GRU's is below).
    assert "update_bias_1" not in found

    def plus_one(cell: Any) -> None:
        bias = cell.bias.numpy()
        bias[U:2 * U] += 1  # Keras' LSTM bias: [i | f | c | o]
        cell.bias.assign(bias)

    truth = gradscope.diagnose(_changed_by_hand(model, plus_one), x=x, y=y,
                               counterfactuals=False).layers[0]
    assert truth.counterfactuals == []
    _same(found["keep_bias"], truth)
    assert found["keep_bias"].lyapunov_1 > entry.lyapunov[0]  # the gate opened
    # Found tried as a new user would: +1 on a bias of −3 leaves the gate near shut (4 steps
    # to 5, as the orthogonal kernel does), and the verdict named that as the remedy. The
    # forget biases raised to 1 (Keras' own initial value) open it: that is named.
    assert entry.horizon.measured == 4
    assert [found[k].horizon for k in ("keep_bias", "orthogonal")] == [5, 5]
    raised = found["forget_bias_1"]
    assert raised.horizon is None and raised.horizon_window == 19
    assert entry.verdict.endswith("; with every forget-gate bias below 1 raised to 1, the "
                                  "horizon would be more than 19 steps (measured)")

    def to_1(cell: Any) -> None:
        bias = cell.bias.numpy()
        bias[U:2 * U] = 1.0  # every forget bias here is −3
        cell.bias.assign(bias)

    _same(raised, gradscope.diagnose(_changed_by_hand(model, to_1), x=x, y=y,
                                     counterfactuals=False).layers[0])
    # Without it, the two that take 4 steps to 5 are no remedy, and the verdict says so.
    from gradscope.keras.diagnose import _most_effective

    modest = [c for c in entry.counterfactuals if c.kind != "forget_bias_1"]
    assert _most_effective(entry, modest) == (
        "no change tried lengthens the horizon by half or more (each one is below)")


def test_a_batch_of_more_examples_than_the_horizon_reads_changes_on_those_alone(
        tf: Any) -> None:
    """Each change steps the call on the examples the horizon reads (8 of 12 here), before
    and after read on the same: λ₁, the horizon and the flow equal a diagnosis of those
    examples alone, of the copy changed by hand and of the model as it is. The copy's pass
    is the whole batch's (the loss a mean over 12 examples, not 8): ∂L/∂s is 8/12 of the
    8-example batch's, its ratio the same."""
    model = _model("lstm")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((12, T, F)).astype("float32")
    y = rng.standard_normal((12, T, 1)).astype("float32")
    report = gradscope.diagnose(model, x=x, y=y)
    entry = report.layers[0]
    rows = entry.horizon.examples
    assert len(rows) == 8
    changed = {c.kind: c for c in entry.counterfactuals}["keep_bias"]
    assert changed.examples == rows

    def plus_one(cell: Any) -> None:
        bias = cell.bias.numpy()
        bias[U:2 * U] += 1
        cell.bias.assign(bias)

    for found, lyapunov, flow, copy in (
            (changed.horizon, changed.lyapunov_1, changed.flow,
             _changed_by_hand(model, plus_one)),
            (entry.horizon.measured, changed.lyapunov_1_before, changed.flow_before, model)):
        truth = gradscope.diagnose(copy, x=x[rows], y=y[rows],
                                   counterfactuals=False).layers[0]
        assert found == truth.horizon.measured
        assert lyapunov == pytest.approx(truth.lyapunov[0], rel=1e-4, abs=1e-6)
        assert flow is not None and truth.flow is not None
        assert flow.ratio == pytest.approx(truth.flow.ratio, rel=1e-3)
        assert flow.last == pytest.approx(truth.flow.last * 8 / 12, rel=1e-4)
    # The layer's own λ₁ is the whole batch's: the change is compared with its 8 examples'.
    assert changed.lyapunov_1_before != pytest.approx(entry.lyapunov[0], rel=1e-6)
    from conftest import render_text

    text = render_text(report, 80)
    assert ("stepped on the 8 examples the horizon reads, 0, 2, 3, 5, 6, 8, 9 and 11, and "
            "before read on them too" in " ".join(text.split()))
    # The flow's ratio named as the verdict names it ("carried ×…" alone was undefined).
    flat = " ".join(text.split())
    from gradscope.formats import number

    assert (f"∂L/∂s carried back ×{number(changed.flow_before.ratio)} → "
            f"×{number(changed.flow.ratio)}") in flat
    # Beside it, the whole batch's, as explain --flow reads it (found tried as a new user
    # would: only the examples' before was shown, beside explain's other number).
    assert entry.flow is not None and entry.flow.ratio != pytest.approx(
        changed.flow_before.ratio, rel=1e-3, abs=0)
    assert (f"∂L/∂s carried back, last step to first: ×{number(entry.flow.ratio)} over the "
            "batch, as explain --flow reads it") in flat
    assert "and before read on them too, not on the whole batch as above" in flat


def test_a_loss_that_mixes_the_examples_changes_on_the_whole_batchs_pass(tf: Any) -> None:
    """Where a pass of the horizon's rows alone does not give the whole batch's ∂L/∂(the
    call's outputs) at those rows times one number (a loss that mixes the examples: each
    output times the batch's sum), the changes' pass is the whole batch's: ∂L/∂s at the
    last step of a change equals a tape of the whole batch's loss on the changed copy."""
    import keras
    from keras import ops

    def spread(y_true: Any, y_pred: Any) -> Any:
        return ops.mean(y_pred * ops.sum(y_pred, axis=0) - y_true * y_pred)

    model = _model("lstm")
    model.compile(loss=spread)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((12, T, F)).astype("float32")
    y = rng.standard_normal((12, T, 1)).astype("float32")
    entry = gradscope.diagnose(model, x=x, y=y).layers[0]
    rows = entry.horizon.examples
    changed = {c.kind: c for c in entry.counterfactuals}["keep_bias"]
    assert changed.examples == rows and changed.flow is not None

    copy = _model("lstm")
    copy.set_weights(model.get_weights())
    bias = copy.get_layer("rnn").cell.bias
    bias.assign(bias.numpy() + np.r_[np.zeros(U), np.ones(U), np.zeros(2 * U)])
    copy.compile(loss=spread)
    both = keras.Model(copy.inputs, [copy.outputs[0], copy.get_layer("rnn").output])
    with tf.GradientTape() as tape:
        prediction, sequence = both(tf.constant(x))
        loss = copy.compute_loss(x=x, y=y, y_pred=prediction)
    upstream = np.asarray(tape.gradient(loss, sequence), np.float64)
    assert changed.flow.last == pytest.approx(
        float(np.sqrt(np.sum(upstream[rows, -1] ** 2))), rel=1e-4)


def test_beyond_the_window_both_ways_the_verdict_names_the_change_by_its_rate(
        tf: Any) -> None:
    """A large layer's horizon window stops at 16 lags: where the layer's horizon and every
    change's lie beyond it, the verdict named no change at all (on the LSTM 256 × 2 of the
    bench, forget bias +1 takes λ₁ from −0.18 to −0.02). It names the change whose λ₁
    predicts the longest horizon, with both λ₁ and both predicted horizons."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((60, 3))
    h = keras.layers.LSTM(256, name="rnn")(inp)
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 60, 3)).astype("float32")
    y = rng.standard_normal((2, 1)).astype("float32")
    report = gradscope.diagnose(model, x=x, y=y)
    entry = report.layers[0]
    found = {c.kind: c for c in entry.counterfactuals}
    assert entry.mechanism == "vanishing"
    assert entry.horizon.measured is None and entry.horizon.window == 16
    # Keras' LSTM starts its forget biases at 1: none below 0, nothing raised, not listed.
    assert [c.kind for c in entry.counterfactuals] == ["keep_bias", "orthogonal", "clipping"]
    # The window stopped at the memory budget, short of the 59 lags the steps measured
    # have: the text says so, not only "more than 16".
    assert entry.horizon.longest_lag == max(entry.horizon.steps) == 59
    from conftest import render_text

    assert ("measured more than 16 (measured to 16 lags only: a layer this wide reaches the "
            "memory budget there)") in " ".join(render_text(report, 80).split())
    assert all(found[k].horizon is None for k in ("keep_bias", "orthogonal"))

    def predicted(rate: float) -> float:  # ln 10³ / |λ₁|, here by hand
        return 3 * np.log(10) / -rate

    factors = {k: predicted(found[k].lyapunov_1) / predicted(found[k].lyapunov_1_before)
               for k in ("keep_bias", "orthogonal")}
    best = max(factors, key=factors.__getitem__)
    assert best == "keep_bias" and factors["keep_bias"] > 1.25
    change = found["keep_bias"]
    assert change.first_column  # its line says "λ₁ (first column)" too
    assert "λ₁ (first column)" in render_text(report, 80)
    assert (f"with forget-gate bias +1, λ₁ of the first tangent column would be "
            f"{change.lyapunov_1:+.3g} per step, against {change.lyapunov_1_before:+.3g} now "
            f"(measured), so gradients would fade by 10³ within about "
            f"{predicted(change.lyapunov_1):.0f} steps, not "
            f"{predicted(change.lyapunov_1_before):.0f} steps as "
            f"{change.lyapunov_1_before:+.3g} gives (predicted; the measured "
            "horizon is beyond 16 steps both ways)") in entry.verdict


def test_a_change_that_makes_the_layer_explode_is_no_remedy(tf: Any) -> None:
    """Found tried as a new user would: a tanh SimpleRNN whose recurrent kernel has spectral
    radius 1.3 vanishes (its units saturate); the orthogonal kernel at its spectral norm
    lengthens the horizon past the sequence, and explodes. The verdict named it as the
    remedy; it now says both."""
    import keras

    rng = np.random.default_rng(1)
    keras.utils.set_random_seed(1)
    x = rng.standard_normal((8, 60, 4)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    model = keras.Sequential([keras.Input((60, 4)), keras.layers.SimpleRNN(16, name="rnn"),
                              keras.layers.Dense(1)])
    w = rng.standard_normal((16, 16)) / 4
    w *= 1.3 / np.max(np.abs(np.linalg.eigvals(w)))
    model.get_layer("rnn").cell.recurrent_kernel.assign(w.astype("float32"))
    model.compile(loss="mse")
    entry = gradscope.diagnose(model, x=x, y=y).layers[0]
    change = {c.kind: c for c in entry.counterfactuals}["orthogonal"]
    assert entry.mechanism == "vanishing" and change.horizon is None
    assert change.lyapunov_1 > 0.01 and change.flow.flag == "exploding"
    assert entry.verdict.endswith(
        f"; with an orthogonal recurrent kernel at its spectral norm, the horizon would be "
        f"more than {change.horizon_window} steps (measured), but the layer would explode "
        f"(λ₁ {change.lyapunov_1:+.3g} per step, ∂L/∂s carried back "
        f"×{change.flow.ratio:.3g})")


def test_a_simple_rnn_of_norm_below_1_made_orthogonal_at_1_against_a_copy_by_hand(
        tf: Any) -> None:
    """Found tried as a new user would: a SimpleRNN whose recurrent kernel is orthogonal
    times 0.1 vanishes within 3 steps, and no change applied (it has no keep gate, and its
    kernel already is orthogonal at its own norm): the verdict named no fix. The kernel made
    orthogonal at norm 1 is run where its norm is below 1, and named; a kernel of norm 1 or
    more, or a gated cell, does not list it."""
    import keras

    def model_at(gain: float) -> Any:
        keras.utils.set_random_seed(0)
        inp = keras.Input((T, F), name="x")
        h = keras.layers.SimpleRNN(
            U, name="rnn", recurrent_initializer=keras.initializers.Orthogonal(gain=gain))(inp)
        model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
        model.compile(loss="mse")
        return model

    x, _ = _batch()
    y = np.random.default_rng(1).standard_normal((B, 1)).astype("float32")
    model = model_at(0.1)
    entry = gradscope.diagnose(model, x=x, y=y).layers[0]
    found = {c.kind: c for c in entry.counterfactuals}
    assert not found["orthogonal"].applicable
    change = found["orthogonal_1"]
    assert entry.mechanism == "vanishing" and entry.horizon.measured == 3
    assert change.horizon is not None and change.horizon >= 3 * 1.5
    assert entry.verdict.endswith("; with an orthogonal recurrent kernel at spectral norm 1, "
                                  f"the horizon would be {change.horizon} steps (measured)")

    def polar(cell: Any) -> None:
        kernel = cell.recurrent_kernel.numpy().astype(np.float64)
        cell.recurrent_kernel.assign(_polar(kernel).astype("float32"))

    _same(change, gradscope.diagnose(_changed_by_hand(model, polar), x=x, y=y,
                                     counterfactuals=False).layers[0])
    at_1 = gradscope.diagnose(model_at(1.0), x=x, y=y).layers[0]
    assert "orthogonal_1" not in [c.kind for c in at_1.counterfactuals]


def test_a_stateful_layers_changes_start_from_the_state_it_carries(tf: Any) -> None:
    """Found tried as a new user would: a stateful GRU diagnosed in memory after fit was
    stepped from the state it carried, but each changed copy from zeros (a carried state is
    no weight): the orthogonal kernel's λ₁ was −0.407 against −0.426 from the same state.
    The copy now holds the model's carried state; both say where they start."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((T, F), batch_size=B),
                              keras.layers.GRU(U, stateful=True, name="rnn"),
                              keras.layers.Dense(1, name="out")])
    model.compile(loss="mse")
    x, _ = _batch()
    y = np.random.default_rng(1).standard_normal((B, 1)).astype("float32")
    model(x + 1.0)  # the state it carries: the last call's final state
    carried = model.get_layer("rnn").states[0].numpy()
    assert np.linalg.norm(carried) > 0.5
    report = gradscope.diagnose(model, x=x, y=y)
    entry = report.layers[0]
    assert np.array_equal(model.get_layer("rnn").states[0].numpy(), carried)
    assert any(w.startswith("rnn is stateful: stepped from the state it carries")
               for w in report.warnings)
    found = {c.kind: c for c in entry.counterfactuals}

    def plus_one(cell: Any) -> None:
        bias = cell.bias.numpy()
        bias[0, :U] += 1
        cell.bias.assign(bias)

    copy = _changed_by_hand(model, plus_one)
    copy.get_layer("rnn").states[0].assign(carried)
    alone = gradscope.diagnose(copy, x=x, y=y, counterfactuals=False)
    _same(found["keep_bias"], alone.layers[0])
    # Without counterfactuals, neither the warning nor "How" speaks of changes (found tried
    # as a new user would: both described changes that never ran).
    said = [w for w in report.warnings if w.startswith("rnn is stateful")]
    assert said and all(w.endswith("; each change starts there too") for w in said)
    assert any(m.startswith("counterfactuals:") for m in report.method)
    assert not any("change" in w for w in alone.warnings if w.startswith("rnn is stateful"))
    assert not any(m.startswith("counterfactuals:") for m in alone.method)


def test_gru_update_bias_and_orthogonal_kernel_against_copies_changed_by_hand(
        gru_diagnosed: Any) -> None:
    model, x, y, weights, report = gru_diagnosed
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights(), strict=True))
    entry = report.layers[0]
    found = {c.kind: c for c in entry.counterfactuals}
    # The update gate's +1 takes the horizon past every lag the batch has (19), not half
    # again the layer's 14: named by the horizon its λ₁ predicts, beside the layer's.
    change = found["keep_bias"]
    assert (entry.horizon.measured, change.horizon, change.horizon_window) == (14, None, 19)
    assert (f"with update-gate bias +1, λ₁ would be {change.lyapunov_1:+.3g} per step, "
            f"against {entry.lyapunov[0]:+.3g} now (measured), so gradients would fade by "
            f"10³ within about {3 * np.log(10) / -change.lyapunov_1:.0f} steps, not "
            f"{3 * np.log(10) / -entry.lyapunov[0]:.0f} steps (predicted; measured, 14 steps "
            "now and more than 19 with the change)") in entry.verdict
    from conftest import render_text

    assert "update-gate bias +1: horizon 14 → > 19 (every lag there is)" in " ".join(
        render_text(report, 80).split())

    def update_plus_one(cell: Any) -> None:
        bias = cell.bias.numpy()  # reset_after: (2, 3u), columns [z | r | h]
        bias[0, :U] += 1
        cell.bias.assign(bias)

    def orthogonal(cell: Any) -> None:
        kernel = cell.recurrent_kernel.numpy().astype(np.float64)
        for k in range(3):
            block = kernel[:, k * U:(k + 1) * U]
            kernel[:, k * U:(k + 1) * U] = np.linalg.norm(block, 2) * _polar(block)
        cell.recurrent_kernel.assign(kernel.astype("float32"))

    for kind, change in (("keep_bias", update_plus_one), ("orthogonal", orthogonal)):
        truth = gradscope.diagnose(_changed_by_hand(model, change), x=x, y=y,
                                   counterfactuals=False).layers[0]
        _same(found[kind], truth)


def test_suggested_clipping_by_keras_own_rule(tf: Any, gru_diagnosed: Any) -> None:
    import keras

    model, x, y, _, report = gru_diagnosed  # diagnosed with its counterfactuals
    entry = report.layers[0]
    clip = next(c for c in entry.counterfactuals if c.kind == "clipping")
    _, gradients = keras_tape(model, x, y)
    norms = [np.linalg.norm(g) for g in gradients.values()]
    assert clip.clip_norm == pytest.approx(np.sqrt(len(norms)) * np.median(norms), rel=1e-4)
    clipped = keras.optimizers.SGD(global_clipnorm=clip.clip_norm)._clip_gradients(
        [tf.constant(g) for g in gradients.values()])
    after = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in clipped)))
    assert clip.gradient_norm == pytest.approx(after, rel=1e-4)
    assert clip.clip_scale == pytest.approx(after / report.gradient_norm, rel=1e-4)
    # the dynamics are not rerun: the layer's own numbers
    assert clip.lyapunov_1 == entry.lyapunov[0] and clip.horizon == entry.horizon.measured


def test_suggested_clipping_against_the_clipping_compiled(tf: Any) -> None:
    """Keras takes one clipping setting: a global_clipnorm suggested for an exploding layer
    would replace the optimizer's own, and is weighed against what that one does to the batch
    (Keras' own ``_clip_gradients``). Found tried as a new user would: with clipnorm=1e-3
    compiled, the verdict still offered a global_clipnorm that would clip far less."""
    import keras
    from conftest import render_text

    from gradscope.formats import number

    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F), name="x")
    h = keras.layers.SimpleRNN(U, activation="linear", return_sequences=True, name="rnn")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    kernel = np.linalg.qr(np.random.default_rng(3).standard_normal((U, U)))[0]
    model.get_layer("rnn").cell.recurrent_kernel.assign((1.05 * kernel).astype("float32"))
    x, y = _batch()
    model.compile(loss="mse")
    _, gradients = keras_tape(model, x, y)
    said, reports = {}, {}
    for optimizer in (keras.optimizers.SGD(), keras.optimizers.SGD(clipnorm=1e-3)):
        model.compile(optimizer=optimizer, loss="mse")
        reports[optimizer.clipnorm] = gradscope.diagnose(model, x=x, y=y)
        entry = reports[optimizer.clipnorm].layers[0]
        assert entry.mechanism == "exploding"
        clip = next(c for c in entry.counterfactuals if c.kind == "clipping")
        said[optimizer.clipnorm] = (clip, entry.verdict)
    clip, verdict = said[None]
    # A SimpleRNN's kernel above norm 1 is made orthogonal at 1 too: that lowers λ₁, and the
    # verdict names it before any clipping (tried as a new user would: it offered clipping).
    assert clip.compiled is None and clip.clip_scale < 1 and clip.change not in verdict
    assert "with an orthogonal recurrent kernel at spectral norm 1, λ₁ would be" in verdict
    clip, verdict = said[1e-3]
    kept = keras.optimizers.SGD(clipnorm=1e-3)._clip_gradients(
        [tf.constant(g) for g in gradients.values()])
    left = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in kept)))
    assert clip.compiled == "clipnorm=0.001"
    assert clip.compiled_norm == pytest.approx(left, rel=1e-4)
    assert clip.gradient_norm > clip.compiled_norm and clip.change not in verdict
    # And the change's own line and note say it is looser (found tried as a new user would:
    # a global_clipnorm of 1.24e+08 beside a compiled clipnorm=1 read as the fix).
    assert clip.note is not None and clip.note.endswith(
        f"which holds this batch's gradient tighter (norm {clip.compiled_norm:.3g} against "
        f"{clip.gradient_norm:.3g}): not a fix")
    text = " ".join(render_text(reports[1e-3], 80).split())
    assert ("in place of the compiled clipnorm=0.001, which leaves norm "
            f"{number(clip.compiled_norm)} · the dynamics unchanged (not rerun) · looser than "
            "the compiled one on this batch: for comparison, not a fix") in text
    said_none = " ".join(render_text(reports[None], 80).split())
    assert "looser than the compiled" not in said_none and "tighter" not in (
        said[None][0].note or "")


def test_an_exploding_cell_no_change_applies_to_is_offered_the_clipping(tf: Any) -> None:
    """A linear cell of the user's own, its recurrent matrix orthogonal × 1.05: no change to
    its dynamics is known for it, so the verdict offers the global_clipnorm the batch
    suggests, with the scale Keras' rule gives this batch."""
    import keras

    class Linear(keras.layers.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = self.state_size = self.output_size = units

        def build(self, input_shape: Any) -> None:
            self.w = self.add_weight(shape=(input_shape[-1], self.units), name="w")
            self.u = self.add_weight(shape=(self.units, self.units), name="u")

        def call(self, x: Any, states: Any) -> Any:
            new = x @ self.w + states[0] @ self.u
            return new, [new]

    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F), name="x")
    rnn = keras.layers.RNN(Linear(U), return_sequences=True, name="rnn")
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(rnn(inp)))
    kernel = np.linalg.qr(np.random.default_rng(3).standard_normal((U, U)))[0]
    rnn.cell.u.assign((1.05 * kernel).astype("float32"))
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    x, y = _batch()
    entry = gradscope.diagnose(model, x=x, y=y).layers[0]
    assert entry.mechanism == "exploding"
    clip = next(c for c in entry.counterfactuals if c.kind == "clipping")
    assert not any(c.applicable for c in entry.counterfactuals if c.kind != "clipping")
    assert clip.clip_scale is not None and clip.clip_scale < 1
    assert entry.verdict.endswith(f"with {clip.change}, this batch's gradient would be scaled "
                                  f"by ×{clip.clip_scale:.3g} (the dynamics unchanged)")


def test_the_copys_pass_back_to_one_call_is_engine_runs_and_reads_changed_weights(
        tf: Any) -> None:
    """captured_pass with ``upstream`` (what each change reruns: a tape that watches that
    call's outputs alone, its trace kept across the changes) gives the call's ∂L/∂outputs
    as engine.run's tape over everything does, with sample weights, for each recurrent call of
    a stack, and again after a weight changed under the kept trace."""
    import keras

    from gradscope.keras.diagnose.captured import captured_pass
    from gradscope.keras.engine import KerasEngine
    from gradscope.keras.explain import prepare

    keras.utils.set_random_seed(1)
    inp = keras.Input((T, F), name="x")
    h = keras.layers.GRU(U, return_sequences=True, name="first")(inp)
    h = keras.layers.LSTM(U, name="second")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    x, y = _batch()
    y = y[:, -1]
    weights = np.linspace(0.5, 2.0, B).astype("float32")
    job = prepare(model, x=x, y=y, sample_weight=weights)
    engine = KerasEngine(job.source, job.outputs, job.plan)
    targets = {engine.output_names[0]: y}
    cache: dict[Any, Any] = {}
    kernel = engine.model.get_layer("first").cell.recurrent_kernel
    for scale in (1.0, 1.5):
        kernel.assign(kernel.numpy() * scale)
        truth = engine.run(job.batch.inputs, targets, watch_outputs=True,
                           sample_weight=weights).output_gradients
        for label in ("first", "second"):
            _, found = captured_pass(engine, job.batch.inputs, targets, weights, cache,
                                     upstream=label)
            assert list(found) == [label]
            np.testing.assert_allclose(found[label][0], truth[label][0], rtol=1e-5,
                                       atol=1e-7)


def test_a_saved_file_changes_on_its_own_load_and_reports_as_the_object(
        tf: Any, tmp_path: Any) -> None:
    """A saved file's changes run on the load the diagnosis ran on (each undone after its
    run), a model object's on Keras' rebuild of it: the same report, the second layer's
    diagnosis (after the first's changes) included, and the file unchanged."""
    import keras

    keras.utils.set_random_seed(2)
    inp = keras.Input((T, F), name="x")
    h = keras.layers.LSTM(U, return_sequences=True, name="first")(inp)
    h = keras.layers.GRU(U, return_sequences=True, name="second")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    path = str(tmp_path / "stack.keras")
    model.save(path)
    x, y = _batch()
    live = gradscope.diagnose(model, x=x, y=y)
    saved = gradscope.diagnose(path, x=x, y=y)
    for ours, theirs in zip(saved.layers, live.layers, strict=True):
        assert ours.call == theirs.call
        np.testing.assert_allclose(ours.lyapunov, theirs.lyapunov, rtol=1e-5, atol=1e-7)
        assert ours.horizon.measured == theirs.horizon.measured
        assert len(ours.counterfactuals) == len(theirs.counterfactuals) == 3
        for found, truth in zip(ours.counterfactuals, theirs.counterfactuals, strict=True):
            assert found.change == truth.change and found.horizon == truth.horizon
            assert found.lyapunov_1 == pytest.approx(truth.lyapunov_1, rel=1e-5, abs=1e-7)
    again = keras.saving.load_model(path)
    assert all(np.array_equal(a, b) for a, b in zip(again.get_weights(), model.get_weights(),
                                                    strict=True))
    # The second layer's change, after the first's were undone: a copy changed by hand.
    changed = keras.models.clone_model(model)
    changed.set_weights(model.get_weights())
    bias = changed.get_layer("second").cell.bias
    value = bias.numpy()
    value[0, :U] += 1  # Keras' GRU (reset_after): z's pre-activation, row 0
    bias.assign(value)
    changed.compile(loss="mse")
    truth = gradscope.diagnose(changed, x=x, y=y, counterfactuals=False).layers[1]
    _same(saved.layers[1].counterfactuals[0], truth)


def test_a_shut_update_gate_raised_to_1_against_a_copy_changed_by_hand(
        tf: Any, gru_diagnosed: Any) -> None:
    """A GRU whose update gate is shut (z biases −3, 90% of z below 0.1): +1 leaves it near
    shut (horizon 6 → 7), and the update biases raised to 1 (their two rows' sum, with
    reset_after) open it, as the same diagnosis of a copy changed by hand measures; the
    verdict names that change (found tried as a new user would: the GRU was offered
    nothing, where an LSTM is)."""
    model = _model("gru")
    cell = model.get_layer("rnn").cell
    bias = cell.bias.numpy()
    assert bias.shape == (2, 3 * U)  # reset_after: two rows, both adding to z
    bias[0, :U], bias[1, :U] = -3.5, 0.5
    cell.bias.assign(bias)
    x, y = _batch()
    entry = gradscope.diagnose(model, x=x, y=y).layers[0]
    found = {c.kind: c for c in entry.counterfactuals}
    raised = found["update_bias_1"]
    assert raised.applicable and raised.change == "every update-gate bias below 1 raised to 1"

    def to_1(cell: Any) -> None:
        bias = cell.bias.numpy()
        bias[0, :U] = 0.5  # 0.5 + 0.5: the sum z's pre-activation takes is 1
        cell.bias.assign(bias)

    _same(raised, gradscope.diagnose(_changed_by_hand(model, to_1), x=x, y=y,
                                     counterfactuals=False).layers[0])
    before = entry.horizon.measured
    assert before is not None and found["keep_bias"].horizon < 1.5 * before
    assert raised.horizon is None or raised.horizon >= 1.5 * before + 2
    assert "with every update-gate bias below 1 raised to 1" in entry.verdict
    # An LSTM's list does not have it (test_forget_bias_plus_1_against_a_copy_changed_by_hand
    # holds that), nor a GRU whose update biases are not below 0.
    assert "update_bias_1" not in {c.kind for c in gru_diagnosed[4].layers[0].counterfactuals}


def _not_copyable(kind: str) -> Any:
    """A model object Keras cannot copy as diagnose copies one, its forget gate near shut:
    ``subclassed``, the TensorFlow tutorial's text model, which takes arguments Keras cannot
    serialise and has no get_config; ``mixed``, a functional model built under the
    mixed_float16 policy, which a copy rebuilt from its config would not keep."""
    import keras

    class Text(keras.Model):
        def __init__(self, sizes: Any) -> None:  # a dict: not serialisable as Keras asks
            super().__init__()
            self.rnn = keras.layers.LSTM(sizes["units"], return_sequences=True, name="rnn")
            self.out = keras.layers.Dense(1, name="out")

        def call(self, x: Any) -> Any:
            return self.out(self.rnn(x))

    keras.utils.set_random_seed(2)
    if kind == "subclassed":
        model = Text({"units": U})
        model(np.zeros((1, T, F), "float32"))
    else:
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            inp = keras.Input((T, F), name="x")
            h = keras.layers.LSTM(U, return_sequences=True, name="rnn")(inp)
            model = keras.Model(inp, keras.layers.Dense(1, name="out", dtype="float32")(h))
        finally:
            keras.mixed_precision.set_global_policy("float32")
    model.compile(loss="mse")
    model.get_layer("rnn").cell.bias.assign(
        np.r_[np.zeros(U), -3 * np.ones(U), np.zeros(2 * U)].astype("float32"))
    return model


@pytest.mark.parametrize(("kind", "why"), [
    ("subclassed", "Keras cannot rebuild it in float32 from its config (Object Text was "
     "created by passing non-serializable argument values"),
    ("mixed", "a copy would not keep its dtype policy mixed_float16")])
def test_a_model_keras_cannot_copy_runs_its_changes_on_itself_and_gets_it_back(
        tf: Any, kind: str, why: str) -> None:
    """Found tried as a new user would: a model object Keras cannot copy got no
    counterfactual (each said "the model is not copied"). Its changes run on the model
    itself: each equals the diagnosis of the model changed by hand, the text and the JSON
    say where they ran and why, and the model has every weight back, bit for bit."""
    from conftest import render_text

    model = _not_copyable(kind)
    x, y = _batch()
    weights = [w.copy() for w in model.get_weights()]
    report = gradscope.diagnose(model, x=x, y=y)
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights(), strict=True))
    found = {c.kind: c for c in report.layers[0].counterfactuals}
    assert set(found) == {"keep_bias", "forget_bias_1", "orthogonal", "clipping"}
    for change in ("keep_bias", "forget_bias_1", "orthogonal"):
        assert found[change].on_model is not None
        assert found[change].on_model.startswith(why)
    assert found["clipping"].on_model is None  # not rerun

    cell = model.get_layer("rnn").cell
    bias = cell.bias.numpy()
    bias[U:2 * U] += 1  # the change by hand, on the model itself
    cell.bias.assign(bias)
    try:
        truth = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
    finally:
        model.set_weights(weights)
    _same(found["keep_bias"], truth)
    text = " ".join(render_text(report, 80).split())
    assert "with one change (the model itself, run again, each change undone after its run)" \
        in text
    assert ("the changes ran on the model itself, each undone after its run (the weights "
            f"given back bit for bit, so the model is as it was), not on a copy: {why}") in text
