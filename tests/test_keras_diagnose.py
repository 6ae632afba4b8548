"""gradscope/keras/diagnose/ (with trajectory.py, gates.py, horizon.py): the dynamics of every
recurrent call, each figure held to a computation written here.

The truths never come from gradscope: the exponents from a float64 QR of the step Jacobians
of Keras' own cell, stepped in an eager Python loop, each Jacobian's rows from one tape's
backward pass over copies of every example (a copy per row: conftest's ``rows_by_copies``),
and from the eigenvalues of a linear recurrence whose W is chosen; the gate shares from a
NumPy forward pass of Keras' equations; the horizon from Keras' own layer under a tape (its
rows so too); the step-Jacobian norms from an SVD. In
training mode with dropout, the same truths with the masks Keras' own cells draw, held to
Keras' own training-mode call.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import numpy as np
import pytest
from conftest import copied, hold_copied_masks, render_text, rows_by_copies

import gradscope

B, T, F = 4, 24, 3


def _linear_cell_class() -> Any:
    import keras

    class LinearCell(keras.layers.Layer):
        """h_t = W·h_(t−1) + U·x_t, W and U given."""

        def __init__(self, w: Any, u: Any, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.w_value, self.u_value = np.asarray(w), np.asarray(u)
            self.state_size = self.output_size = self.w_value.shape[0]

        def get_config(self) -> dict[str, Any]:
            return {**super().get_config(), "w": self.w_value.tolist(),
                    "u": self.u_value.tolist()}

        def build(self, input_shape: Any) -> None:
            self.w = self.add_weight(shape=self.w_value.shape, name="w",
                                     initializer=keras.initializers.Constant(self.w_value.T))
            self.u = self.add_weight(shape=self.u_value.shape, name="u",
                                     initializer=keras.initializers.Constant(self.u_value))

        def call(self, inputs: Any, states: Any) -> Any:
            h = keras.ops.matmul(states[0], self.w) + keras.ops.matmul(inputs, self.u)
            return h, [h]

    return LinearCell


def _linear_model(w: np.ndarray, steps: int = T) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    u = np.random.default_rng(1).standard_normal((F, w.shape[0])) * 0.3
    inp = keras.Input((steps, F), name="x")
    h = keras.layers.RNN(_linear_cell_class()(w, u), return_sequences=True, name="linear")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    return model


def _token_lstm(steps: int, seed: int) -> Any:
    """Embedding(mask_zero) over tokens, an LSTM 6 returning its last output, a Dense 1."""
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((steps,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 4, mask_zero=True, name="embed")(inp)
    h = keras.layers.LSTM(6, name="lstm")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    return model


def _batch(steps: int = T, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, steps, F)).astype("float32"),
            rng.standard_normal((B, steps, 1)).astype("float32"))


def _orthogonal(n: int, rho: float) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(3).standard_normal((n, n)))
    return rho * q


@pytest.fixture(scope="module")
def lstm_case(tf: Any) -> tuple[Any, np.ndarray, np.ndarray, Any]:
    """An LSTM (forget bias −5) then a GRU, diagnosed once."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F), name="x")
    h = keras.layers.LSTM(5, return_sequences=True, name="lstm")(inp)
    h = keras.layers.GRU(4, return_sequences=True, name="gru")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    bias = model.get_layer("lstm").cell.bias
    bias.assign(np.r_[np.zeros(5), -5 * np.ones(5), np.zeros(10)].astype("float32"))
    model.compile(optimizer=keras.optimizers.SGD(clipnorm=0.05), loss="mse")
    x, y = _batch()
    return model, x, y, gradscope.diagnose(model, x=x, y=y)


def _sequences(tf: Any, model: Any, name: str, x: np.ndarray) -> list[np.ndarray]:
    """The inputs of layer ``name`` and its state after every step, from an eager loop over
    Keras' own cell (float64 copies for the QR)."""
    import keras

    layer = model.get_layer(name)
    inputs = keras.Model(model.inputs, layer.input)(x)
    states = [tf.zeros((x.shape[0], s)) for s in keras.tree.flatten(layer.cell.state_size)]
    pairs = []
    for t in range(x.shape[1]):
        pairs.append((inputs[:, t], [tf.identity(s) for s in states]))
        _, states = layer.cell(inputs[:, t], states)
        states = list(keras.tree.flatten(states))
    return pairs


def _jacobian(tf: Any, cell: Any, x_t: Any, states: list[Any],
              masks: tuple[Any, Any] | None = None) -> np.ndarray:
    """∂(new states)/∂(states) of one step of Keras' own cell, per example; with ``masks``
    (a row per example), in training mode, the cell holding them (each row copied with its
    example)."""
    import keras

    widths = [int(s.shape[1]) for s in states]
    size = sum(widths)
    if masks is not None:
        hold_copied_masks(tf, cell, masks, size)

    def step(joined: Any) -> Any:
        _, new = cell(copied(tf, x_t, size), list(tf.split(joined, widths, 1)),
                      training=masks is not None)
        return tf.concat(list(keras.tree.flatten(new)), 1)

    try:
        return rows_by_copies(tf, tf.concat(states, 1), size, step)
    finally:
        cell.reset_dropout_mask()
        cell.reset_recurrent_dropout_mask()


def _qr_logs(jacobians: list[np.ndarray], start: np.ndarray | None = None) -> np.ndarray:
    """log|R_t[i, i]| (B, T, k) along each example's product of ``jacobians`` (B, S, S
    each): a float64 QR from Q_0 = ``start`` (S, k; default I)."""
    batch, size = jacobians[0].shape[:2]
    q = np.tile(np.eye(size) if start is None else start, (batch, 1, 1))
    logs = []
    for j in jacobians:
        q, r = np.linalg.qr(j @ q)
        logs.append(np.log(np.abs(np.diagonal(r, 0, 1, 2))))
    return np.stack(logs, axis=1)


def _qr_exponents(jacobians: list[np.ndarray], start: np.ndarray | None = None) -> np.ndarray:
    """The Lyapunov spectrum, largest first, of :func:`_qr_logs`: the logs averaged over
    steps, then examples."""
    return np.sort(_qr_logs(jacobians, start).mean(axis=(0, 1)))[::-1]


def test_exponents_against_a_float64_qr_of_keras_own_cell(tf: Any, lstm_case: Any) -> None:
    model, x, _, report = lstm_case
    for name in ("lstm", "gru"):
        cell = model.get_layer(name).cell
        jacobians = [_jacobian(tf, cell, x_t, s) for x_t, s in _sequences(tf, model, name, x)]
        truth = _qr_exponents(jacobians)
        found = next(entry for entry in report.layers if entry.call == name)
        assert found.state_size == jacobians[0].shape[1]
        np.testing.assert_allclose(found.lyapunov, truth, rtol=1e-3, atol=1e-3)


def test_step_jacobian_norms_against_an_svd(tf: Any, lstm_case: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact route (SVD) and Lanczos both give the largest singular value, in one fold
    of pairs or in folds of one size, the last padded (:func:`even_folds`)."""
    from gradscope.keras.diagnose import trajectory
    from gradscope.keras.diagnose.trajectory import step_norms

    model, x, _, report = lstm_case
    cell = model.get_layer("lstm").cell
    pairs = _sequences(tf, model, "lstm", x)
    truth = np.stack([np.linalg.svd(_jacobian(tf, cell, x_t, s), compute_uv=False)[:, 0]
                      for x_t, s in pairs], axis=1)
    entry = next(e for e in report.layers if e.call == "lstm")
    np.testing.assert_allclose(entry.jacobian_norm.steps_max, truth.max(axis=0), rtol=1e-4)
    assert entry.jacobian_norm.max == pytest.approx(truth.max(), rel=1e-4)

    engine = _real_engine(model, x)
    pairs = truth.size
    for compiled in (False, True):  # a small layer's graph, and a wide layer's XLA
        power, method, _ = step_norms(engine, _trajectory(engine, "lstm"), exact=False,
                                      compiled=compiled)
        assert method.startswith("Lanczos")
        np.testing.assert_allclose(power, truth, rtol=1e-4)
    fold = 20  # 96 pairs: five folds of 20, the last of 16 padded
    folds = trajectory.even_folds(pairs, fold)
    assert pairs == 96 and [len(t) for _, t in folds] == [fold] * 5
    assert [p.stop - p.start for p, _ in folds] == [20, 20, 20, 20, 16]
    monkeypatch.setattr(trajectory, "FOLD_ROWS", fold)
    for exact in (False, True):
        fresh = _real_engine(model, x)
        # A step linearised by hand's function is the process's (trajectory.shared_function).
        monkeypatch.setattr(trajectory, "_shared", collections.OrderedDict())
        folded, _, _ = step_norms(fresh, _trajectory(engine, "lstm"), exact=exact)
        np.testing.assert_allclose(folded, truth, rtol=1e-4)
        (traced,) = [f for key, f in [*fresh._traces.items(), *trajectory._shared.items()]
                     if key[0] in ("step norms", "step norms by hand")]
        assert traced.experimental_get_tracing_count() == 1  # the five folds, one trace


def test_layers_of_one_algebra_share_their_traced_scans(tf: Any, monkeypatch: Any) -> None:
    """An LSTM 5 (input 3) below an LSTM 5 of the same settings (input 5), both stepped by
    hand: one traced Lyapunov scan, step-norm function and horizon serve both, each given
    its own projected inputs and weights; each layer's exponents and norms equal those of a
    fresh engine that traced them for that layer alone (a shared function that read the
    first layer's weights would not). A GRU of the same size has an algebra of its own. The
    functions are the process's: another model's engine takes them as they are (a notebook's
    next diagnosis compiles nothing again), and they keep no model alive."""
    import collections
    import gc
    import weakref

    import keras

    from gradscope.keras.diagnose import trajectory
    from gradscope.keras.diagnose.horizon import measure
    from gradscope.keras.diagnose.trajectory import lyapunov_logs, step_norms

    def model_of(seed: int) -> Any:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([
            keras.Input((9, 3)), keras.layers.LSTM(5, return_sequences=True, name="low"),
            keras.layers.LSTM(5, return_sequences=True, name="high"),
            keras.layers.GRU(5, name="gru"), keras.layers.Dense(1)])

    def read(engine: Any, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        path = _trajectory(engine, name)
        return (lyapunov_logs(engine, path, 3), step_norms(engine, path, exact=False)[0],
                measure(engine, path, None).medians)

    def traced(found: Any) -> list[int]:
        # batch_free's wrapper holds the tf.function as __wrapped__.
        return [(f if hasattr(f, "experimental_get_tracing_count") else f.__wrapped__)
                .experimental_get_tracing_count() for f in found]

    monkeypatch.setattr(trajectory, "_shared", collections.OrderedDict())
    model = model_of(12)
    x = np.random.default_rng(12).standard_normal((4, 9, 3)).astype("float32")
    engine = _real_engine(model, x)
    found = {name: read(engine, name) for name in ("low", "high", "gru")}
    kept = dict(trajectory._shared)
    scans = [f for key, f in kept.items() if key[0] == "lyapunov scan"]
    norms = [f for key, f in kept.items() if key[0] in ("step norms by hand",
                                                         "horizon by hand")]
    assert len(scans) == 2 and len(norms) == 4  # the LSTMs' and the GRU's
    # Once each; the LSTMs' horizon twice, for their inputs of two widths (the second trace
    # takes any width).
    counts = [1, 1, 1, 2, 1, 1]
    assert [key[0] for key in kept] == ["lyapunov scan", "step norms by hand",
                                        "horizon by hand"] * 2
    assert traced(scans + norms) == counts
    for name in ("low", "high", "gru"):
        monkeypatch.setattr(trajectory, "_shared", collections.OrderedDict())
        alone = read(_real_engine(model, x), name)
        np.testing.assert_allclose(found[name][0], alone[0], rtol=1e-6, atol=1e-9,
                                   err_msg=name)
        np.testing.assert_allclose(found[name][1], alone[1], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(found[name][2], alone[2], rtol=1e-6, err_msg=name)
    # Another model of the same layers, other weights: the same functions, its own numbers.
    monkeypatch.setattr(trajectory, "_shared", collections.OrderedDict(kept))
    other = model_of(13)
    again = {name: read(_real_engine(other, x), name) for name in ("low", "high", "gru")}
    assert dict(trajectory._shared) == kept and traced(scans + norms) == counts
    for name in ("low", "high", "gru"):
        monkeypatch.setattr(trajectory, "_shared", collections.OrderedDict())
        alone = read(_real_engine(other, x), name)
        assert not np.allclose(again[name][0], found[name][0])
        np.testing.assert_allclose(again[name][0], alone[0], rtol=1e-6, atol=1e-9,
                                   err_msg=name)
        np.testing.assert_allclose(again[name][1], alone[1], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(again[name][2], alone[2], rtol=1e-6, err_msg=name)
    # The functions, still kept, hold no layer, nor weight, of the model they were built from.
    gone = [weakref.ref(model), *(weakref.ref(v) for v in model.weights)]
    del model, engine, other
    gc.collect()
    assert all(ref() is None for ref in gone) and traced(scans + norms) == counts


def test_step_jacobian_norms_of_a_cell_of_the_users_by_lanczos(tf: Any) -> None:
    """A cell gradscope does not model takes Lanczos through forward mode and the tape: its
    every J_t is W, so every norm is W's largest singular value."""
    from gradscope.keras.diagnose.trajectory import step_norms

    w = np.random.default_rng(4).standard_normal((6, 6)) * 0.4
    x, _ = _batch()
    model = _linear_model(w)
    engine = _real_engine(model, x)
    norms, method, _ = step_norms(engine, _trajectory(engine, "linear"), exact=False)
    assert method.startswith("Lanczos") and "by hand" not in method
    np.testing.assert_allclose(norms, np.linalg.svd(w, compute_uv=False)[0], rtol=1e-5)


def _trajectory(engine: Any, name: str, upstream: Any = None, training: bool = False,
                **options: Any) -> Any:
    """Layer ``name``'s call on ``engine``'s last run, stepped and read as a trajectory."""
    from gradscope.keras.diagnose.trajectory import trajectory
    from gradscope.keras.stepped import step_call

    call = next(c for c in engine.last.calls if c.layer == name)
    stepped = step_call(engine, call, upstream, training, **options)
    assert not isinstance(stepped, str)
    path = trajectory(stepped, 0)
    assert not isinstance(path, str)
    return path


def _real_engine(model: Any, x: np.ndarray, training: bool = False, seed: int = 0) -> Any:
    return _engine_and_batch(model, x, training, seed)[0]


def _engine_and_batch(model: Any, x: np.ndarray, training: bool = False,
                      seed: int = 0) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """An engine on ``model`` that has run on ``x`` (``engine.last``), with its inputs and
    targets."""
    from gradscope.keras.data import batch_targets
    from gradscope.keras.engine import KerasEngine
    from gradscope.keras.explain import prepare

    job = prepare(model, x=x, training=training, seed=seed)
    engine = KerasEngine(job.source, job.outputs, job.plan, training=training, seed=seed)
    targets = batch_targets(job.plan, job.batch.targets,
                            engine.output_shapes(job.batch.inputs), 0)
    engine.last = engine.run(job.batch.inputs, targets)
    return engine, job.batch.inputs, targets


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-z))


def test_gate_shares_against_a_numpy_forward_pass(tf: Any, lstm_case: Any) -> None:
    """Keras' LSTM and GRU (reset_after) equations written out in NumPy, from zero states."""
    model, x, _, report = lstm_case
    lstm = model.get_layer("lstm").cell
    kernel, recurrent, bias = (np.asarray(v, np.float64) for v in
                               (lstm.kernel, lstm.recurrent_kernel, lstm.bias))
    u = 5
    h, c = np.zeros((B, u)), np.zeros((B, u))
    gates: dict[str, list[np.ndarray]] = {"input": [], "forget": [], "output": []}
    outputs = []
    for t in range(T):
        z = x[:, t].astype(np.float64) @ kernel + h @ recurrent + bias
        i, f, g, o = (z[:, k * u:(k + 1) * u] for k in range(4))
        i, f, o = _sigmoid(i), _sigmoid(f), _sigmoid(o)
        c = f * c + i * np.tanh(g)
        h = o * np.tanh(c)
        outputs.append(h)
        for name, value in (("input", i), ("forget", f), ("output", o)):
            gates[name].append(value)
    entry = next(e for e in report.layers if e.call == "lstm")
    assert entry.gates is not None
    for name, values in gates.items():
        stacked = np.stack(values)
        assert entry.gates[name].below_0_1 == pytest.approx(np.mean(stacked < 0.1), abs=1e-9)
        assert entry.gates[name].above_0_9 == pytest.approx(np.mean(stacked > 0.9), abs=1e-9)
    taus = -1 / np.log(np.stack(gates["forget"]).mean(axis=(0, 1)))
    assert entry.timescales is not None
    assert entry.timescales.median == pytest.approx(np.median(taus), rel=1e-4)
    # the GRU: update z and reset r, from the LSTM's outputs
    gru = model.get_layer("gru").cell
    assert gru.reset_after
    kernel, recurrent, bias = (np.asarray(v, np.float64) for v in
                               (gru.kernel, gru.recurrent_kernel, gru.bias))
    v = 4
    h = np.zeros((B, v))
    zs, rs = [], []
    for t in range(T):
        xs = outputs[t] @ kernel + bias[0]
        hs = h @ recurrent + bias[1]
        z = _sigmoid(xs[:, :v] + hs[:, :v])
        r = _sigmoid(xs[:, v:2 * v] + hs[:, v:2 * v])
        candidate = np.tanh(xs[:, 2 * v:] + r * hs[:, 2 * v:])
        h = z * h + (1 - z) * candidate
        zs.append(z)
        rs.append(r)
    entry = next(e for e in report.layers if e.call == "gru")
    assert entry.gates is not None and entry.timescales is not None
    for name, values in (("update", zs), ("reset", rs)):
        stacked = np.stack(values)
        assert entry.gates[name].below_0_1 == pytest.approx(np.mean(stacked < 0.1), abs=1e-9)
        assert entry.gates[name].above_0_9 == pytest.approx(np.mean(stacked > 0.9), abs=1e-9)
    assert entry.timescales.keep_gate == "update"


def test_measured_horizon_against_a_tape(tf: Any, lstm_case: Any) -> None:
    """‖∂h_t/∂x_s‖ per example from Keras' own GRU layer under a tape, whole sequence."""
    import keras

    model, x, _, report = lstm_case
    entry = next(e for e in report.layers if e.call == "gru")
    layer = model.get_layer("gru")
    inputs = tf.convert_to_tensor(keras.Model(model.inputs, layer.input)(x))
    _assert_horizon_by_tape(tf, entry, layer, inputs)


def _assert_horizon_by_tape(tf: Any, entry: Any, layer: Any, inputs: Any,
                            drawn: tuple[Any, Any, Any] | None = None) -> None:
    """``entry``'s measured horizon and ratios against ‖∂h_t/∂x_s‖ per example from Keras'
    own ``layer`` called on ``inputs`` under a tape, the whole sequence (its rows by
    :func:`conftest.rows_by_copies`). With ``drawn``, in training mode: the masks the layer's call
    draws, held with each example's copies, and the outputs of that call, drawing them
    itself, which the copies' outputs must equal."""
    steps = entry.horizon.steps
    size = len(steps) * int(layer.cell.units)
    whole = []

    def call(copies: Any) -> Any:
        if drawn is not None:
            hold_copied_masks(tf, layer.cell, drawn[:2], size)
        out = layer(copies, training=drawn is not None)
        whole.append(out)
        return tf.reshape(tf.gather(out, steps, axis=1), [-1, size])

    jac = rows_by_copies(tf, inputs, size, call)  # (B, t·u, T, F)
    if drawn is not None:
        np.testing.assert_allclose(whole[0][::size], drawn[2], rtol=1e-5, atol=1e-6)
    jac = jac.reshape(B, len(steps), -1, *jac.shape[2:])
    rows = []
    for k, t in enumerate(steps):
        norms = np.sqrt((jac[:, k] ** 2).sum(axis=(1, 3)))[entry.horizon.examples]
        row = np.full((len(norms), entry.horizon.window + 1), np.nan)
        for lag in range(min(t, entry.horizon.window) + 1):
            row[:, lag] = norms[:, t - lag] / norms[:, t]
        rows.append(row)
    truth = np.nanmedian(np.concatenate(rows), axis=0)
    found = np.array([np.nan if r is None else r for r in entry.horizon.ratios])
    np.testing.assert_allclose(found, truth, rtol=2e-3, atol=1e-7)
    below = np.nonzero(truth < 1e-3)[0]
    assert entry.horizon.measured == (int(below[0]) if below.size else None)


@pytest.mark.parametrize("backwards", [False, True])
def test_a_masked_step_is_left_out_of_the_horizon_not_counted_as_no_influence(
        tf: Any, backwards: bool) -> None:
    """Three of four examples padded over the half of the sequence the layer reads first (the
    start for a forward layer, the end for a go_backwards one): a padded step reads no input,
    so its lag is no evidence of fading. The ratios are held to Keras' own layer under a tape,
    with those lags left out; counting them as an influence of 0 would have put the horizon
    at the first lag that reaches the padding."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F), name="x")
    masked = keras.layers.Masking(name="mask")(inp)
    h = keras.layers.GRU(4, return_sequences=True, go_backwards=backwards, name="gru")(masked)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    x, y = _batch()
    padded = slice(T // 2, T) if backwards else slice(0, T // 2)
    x[:3, padded] = 0.0
    y = y[:, ::-1] if backwards else y
    entry = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
    layer = model.get_layer("gru")
    inputs = tf.convert_to_tensor(x)
    mask = np.any(x != 0, axis=-1)  # (B, T) input order
    steps = entry.horizon.steps  # processing order
    size = len(steps) * 4

    def call(copies: Any) -> Any:
        # go_backwards: Keras' sequence is in processing order, step t read input T−1−t
        out = layer(copies, mask=copied(tf, mask, size))
        return tf.reshape(tf.gather(out, steps, axis=1), [-1, size])

    jac = rows_by_copies(tf, inputs, size, call)  # (B, t·u, T, F)
    jac = jac.reshape(B, len(steps), -1, *jac.shape[2:])
    order = np.arange(T)[::-1] if backwards else np.arange(T)  # processing → input step
    rows, zeros = [], []
    for k, t in enumerate(steps):
        norms = np.sqrt((jac[:, k] ** 2).sum(axis=(1, 3)))[:, order]  # processing order
        ran = mask[:, order]
        row = np.full((B, entry.horizon.window + 1), np.nan)
        for lag in range(min(t, entry.horizon.window) + 1):
            row[:, lag] = norms[:, t - lag] / norms[:, t]
        row[~ran[:, t]] = np.nan
        zeros.append(row.copy())
        for lag in range(min(t, entry.horizon.window) + 1):
            row[~ran[:, t - lag], lag] = np.nan
        rows.append(row)
    picked_rows = np.concatenate(rows)[np.tile(np.isin(np.arange(B), entry.horizon.examples),
                                               len(steps))]
    truth = np.array([np.median(c[np.isfinite(c)]) if np.isfinite(c).any() else np.nan
                      for c in picked_rows.T])
    found = np.array([np.nan if r is None else r for r in entry.horizon.ratios])
    np.testing.assert_allclose(found, truth, rtol=2e-3, atol=1e-7)
    below = np.nonzero(truth < 1e-3)[0]
    assert entry.horizon.measured == (int(below[0]) if below.size else None)
    # with the padded lags counted as 0, the median would fall to 0 where they begin
    counted = np.nanmedian(np.concatenate(zeros), axis=0)
    assert np.nonzero(counted < 1e-3)[0][0] < (below[0] if below.size else T)


def test_lstm_with_forget_bias_minus_5_vanishes_by_its_forget_gate(lstm_case: Any) -> None:
    _, _, _, report = lstm_case
    entry = next(e for e in report.layers if e.call == "lstm")
    assert entry.mechanism == "vanishing"
    assert entry.gates is not None and entry.gates["forget"].below_0_1 > 0.99
    assert "forget-gate values below 0.1" in entry.verdict
    assert entry.horizon.measured is not None and entry.horizon.measured < 8
    assert [c.kind for c in entry.counterfactuals] == ["keep_bias", "forget_bias_1",
                                                       "orthogonal", "clipping"]
    assert report.clipping.setting == "clipnorm=0.05"


def _read_model(u: np.ndarray, read: list[float]) -> Any:
    """The linear recurrence of W = diag(0.9, 0.5) (a slow unit, a fast one) and input weights
    ``u`` (F, 2), its last state read by a Dense of weights ``read``, no bias."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F), name="x")
    h = keras.layers.RNN(_linear_cell_class()(np.diag([0.9, 0.5]), u), name="linear")(inp)
    out = keras.layers.Dense(1, use_bias=False, name="out")
    model = keras.Model(inp, out(h))
    out.kernel.assign(np.asarray(read, "float32")[:, None])
    model.compile(loss="mse")
    return model


def _explain_and_diagnose(model: Any) -> tuple[dict[str, Any], Any]:
    """explain --flow's flags by what they flag, and diagnose's report, on one batch."""
    x, _ = _batch()
    y = np.random.default_rng(4).standard_normal((B, 1)).astype("float32")
    flags = gradscope.explain(model, x=x, y=y, flow=True).gradient_flow.flags
    return ({f.what: f for f in flags},
            gradscope.diagnose(model, x=x, y=y, counterfactuals=False))


def test_explain_flags_vanishing_where_diagnose_holds_and_the_verdict_says_why(tf: Any) -> None:
    """Inputs drive both units, the loss reads the fast one: ∂L/∂s carried back keeps 0.5^23
    (explain flags it), while an input's influence keeps the slow unit's 0.9^k (the horizon
    holds). diagnose's verdict names explain's flag with explain's own ratio, and the cause:
    the loss reads the state along the direction it forgets faster than λ₁ = ln 0.9."""
    flags, report = _explain_and_diagnose(_read_model(np.ones((F, 2)), [0.0, 1.0]))
    flag = flags["∂L/∂linear/h_t"]
    assert flag.kind == "vanishing" and flag.ratio == pytest.approx(0.5 ** (T - 1), rel=1e-5)
    assert flag.message.endswith("(flagged beyond a factor 1000); gradscope diagnose says why")
    entry = report.layers[0]
    assert entry.mechanism == "holds"
    assert entry.horizon.measured is None and entry.horizon.window == T - 1
    assert entry.flow is not None and entry.flow.flag == "vanishing"
    assert entry.flow.ratio == pytest.approx(flag.ratio, rel=1e-6)
    # ‖∂h_t/∂x_(t−k)‖_F / ‖∂h_t/∂x_t‖_F = ‖U·diag(0.9, 0.5)^k‖_F / ‖U‖_F, U all ones
    reach = np.sqrt((0.81 ** (T - 1) + 0.25 ** (T - 1)) / 2)
    assert entry.horizon.ratios[-1] == pytest.approx(reach, rel=1e-4)
    assert entry.lyapunov[0] == pytest.approx(np.log(0.9), abs=1e-5)
    lam = entry.lyapunov[0]
    assert (f"; explain --flow flags it vanishing: ∂L/∂s carried back from t={T - 1} to t=0 "
            f"keeps ×{flag.ratio:.3g} ({np.log(flag.ratio) / (T - 1):+.3g} per step), while "
            f"an input's influence {T - 1} steps back is still ×{entry.horizon.ratios[-1]:.3g}"
            f" of its own step's: the loss reads the state along directions that fade "
            f"faster than its most lasting one (λ₁ = {lam:+.3g} per step: "
            f"×{np.exp((T - 1) * lam):.3g} over those {T - 1} steps), which carries an "
            f"input's influence") in entry.verdict
    text = render_text(report, 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert f"×{flag.ratio:.3g}" in text.split()


def test_diagnose_vanishing_where_explain_flags_nothing_says_why(tf: Any) -> None:
    """The mirror: inputs drive the fast unit alone, the loss reads the slow one. ∂L/∂s
    carried back keeps 0.9^23 (no flag), while an input's influence falls as 0.5^k, below 10⁻³
    first at k = 10 (the horizon vanishes)."""
    flags, report = _explain_and_diagnose(
        _read_model(np.c_[np.zeros(F), np.ones(F)], [1.0, 0.0]))
    assert "∂L/∂linear/h_t" not in flags
    entry = report.layers[0]
    assert entry.mechanism == "vanishing" and entry.horizon.measured == 10
    assert entry.flow is not None and entry.flow.flag is None
    assert entry.flow.ratio == pytest.approx(0.9 ** (T - 1), rel=1e-5)
    influence = -np.log(1e3) / 10
    assert (f"; explain --flow does not flag it: ∂L/∂s carried back from t={T - 1} to t=0 "
            f"keeps ×{entry.flow.ratio:.3g} ({np.log(0.9):+.3g} per step), within its factor "
            f"10³, while an input's influence fades by 10³ within about 10 steps "
            f"({influence:+.3g} per step): inputs enter the state along directions it "
            f"forgets faster than those the loss reads") in entry.verdict


def test_a_vanishing_lstm_is_vanishing_in_both_and_the_flows_are_one_number(
        tf: Any, lstm_case: Any) -> None:
    """The LSTM whose forget bias is −5: explain --flow flags it, diagnose calls it vanishing,
    and the ratio diagnose reads from its stepped cell is the one explain flags."""
    model, x, y, report = lstm_case
    flags = gradscope.explain(model, x=x, y=y, flow=True).gradient_flow.flags
    flag = next(f for f in flags if f.what == "∂L/∂lstm/h_t")
    entry = next(e for e in report.layers if e.call == "lstm")
    assert flag.kind == entry.mechanism == "vanishing"
    assert entry.flow is not None and entry.flow.flag == "vanishing"
    assert entry.flow.ratio == pytest.approx(flag.ratio, rel=1e-5)
    assert "explain --flow" not in entry.verdict


def test_a_bidirectional_lstm_behind_a_padding_mask_reads_one_flow_in_both(tf: Any) -> None:
    """Embedding(mask_zero) → Bidirectional(LSTM) → Dense, half the rows padded: each
    direction's flag in explain is the flag diagnose gives its own flow, with the same ratio;
    where the horizon holds while that ratio is beyond 10³ (×9.3e-05 and ×5.2e-04 carried
    over 23 steps, an input's influence above 10⁻³ over every lag), the verdict says so."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((T,), dtype="int32", name="x")
    h = keras.layers.Embedding(20, 4, mask_zero=True, name="emb")(inp)
    h = keras.layers.Bidirectional(keras.layers.LSTM(4), name="bi")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    rng = np.random.default_rng(5)
    x = rng.integers(1, 20, (B, T)).astype("int32")
    x[:2, T // 2:] = 0
    y = rng.standard_normal((B, 1)).astype("float32")
    flags = {f.what: f for f in gradscope.explain(model, x=x, y=y, flow=True).gradient_flow.flags}
    report = gradscope.diagnose(model, x=x, y=y, counterfactuals=False)
    assert [e.call for e in report.layers] == ["bi/forward", "bi/backward"]
    for entry in report.layers:
        flag = flags[f"∂L/∂{entry.call}/h_t"]
        assert entry.flow is not None and entry.flow.ratio is not None
        assert entry.flow.flag == flag.kind == "vanishing"
        assert entry.flow.ratio == pytest.approx(flag.ratio, rel=1e-5)
        assert entry.mechanism == "holds", entry.verdict
        assert "explain --flow flags it vanishing" in entry.verdict


def test_a_diagonal_linear_recurrence_has_the_logs_of_its_eigenvalues(tf: Any) -> None:
    diagonal = np.array([0.9, -0.6, 0.3, 1.1])
    x, y = _batch()
    report = gradscope.diagnose(_linear_model(np.diag(diagonal)), x=x, y=y)
    entry = report.layers[0]
    assert entry.gates is None and entry.gates_note is not None
    assert "not known for this cell" in entry.gates_note
    for change in entry.counterfactuals[:2]:  # a cell of the user's: no gate, no kernel known
        assert not change.applicable and change.note is not None
        assert change.note.startswith("not applicable to this cell")
        assert change.horizon is None and change.lyapunov_1 is None
    # Its step is not one gradscope knows, whatever its attributes are named (found tried as
    # a new user would: "no recurrent kernel gradscope knows" of a cell's recurrent_kernel).
    orthogonal = next(c for c in entry.counterfactuals if c.kind == "orthogonal")
    assert orthogonal.note is not None and orthogonal.note.endswith(
        "LinearCell: gradscope does not know how its step reads a recurrent kernel)")
    np.testing.assert_allclose(entry.lyapunov, np.sort(np.log(np.abs(diagonal)))[::-1],
                               atol=1e-5)


def test_a_dead_direction_takes_householder_and_logs_the_floor(tf: Any) -> None:
    """J_t = diag(0.9, 0, 0.5) has a zero column: the Cholesky QR cannot factor J·Q, and the
    step's QR is Householder's, whose zero R[i, i] is logged at the floor."""
    from gradscope.keras.diagnose.trajectory import SMALLEST_STRETCH

    x, y = _batch()
    report = gradscope.diagnose(_linear_model(np.diag([0.9, 0.0, 0.5])), x=x, y=y,
                                counterfactuals=False)
    entry = report.layers[0]
    np.testing.assert_allclose(entry.lyapunov, [np.log(0.9), np.log(0.5),
                                                np.log(SMALLEST_STRETCH)], rtol=1e-5)
    # The floor is said to be no rate: every step cut that direction.
    assert (f"linear: 1 of the directions followed was taken to 0 at some step, at {B * T} "
            f"of the {B * T} (example, step) pairs that ran") in " ".join(report.warnings)
    # Named, in grammar (found tried as a new user would: "so its exponent is not rates",
    # of an exponent the text did not show).
    assert "(−∞ in truth), so its exponent (λ3) is not a rate" in " ".join(report.warnings)
    # Which exponent it is: the last (the JSON's position, the text's mark), not the others.
    assert entry.lyapunov_floored == [2]
    from conftest import render_text

    text = " ".join(render_text(report, 80).split())
    assert (f"{entry.lyapunov[0]:+.3g} · {entry.lyapunov[1]:+.3g} · "
            f"{entry.lyapunov[2]:+.3g}* · * taken to 0 at some step: not a rate") in text
    # One column (λ₁ alone) is its norm; a column J_t takes to 0 takes Householder's too.
    entry = gradscope.diagnose(_linear_model(np.zeros((3, 3))), x=x, y=y, exponents=1,
                               counterfactuals=False).layers[0]
    np.testing.assert_allclose(entry.lyapunov, [np.log(SMALLEST_STRETCH)], rtol=1e-5)


@pytest.mark.parametrize("condition", [1.0, 1e6, "dependent"])
def test_the_scan_qr_is_orthonormal_to_1e_10_once_twice_or_by_householder(
        tf: Any, condition: Any) -> None:
    """Each (S, k) block's Q from the Lyapunov scan's QR, in float64, against QᵀQ = I to
    10⁻¹⁰ and Q·R = M, R upper triangular with a positive diagonal: a well-conditioned
    block (Cholesky QR once), one of condition 10⁶ (once leaves QᵀQ about 10⁻⁴ from I: it
    takes a second pass) and one with a column the others make (Householder's)."""
    from gradscope.keras.diagnose.trajectory import orthonormalised

    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(4):
        left = np.linalg.qr(rng.standard_normal((40, 5)))[0]
        right = np.linalg.qr(rng.standard_normal((5, 5)))[0]
        values = (np.ones(5) if condition == "dependent" else
                  np.geomspace(1.0, 1.0 / float(condition), 5))
        block = left @ np.diag(values) @ right
        if condition == "dependent":
            block[:, 3] = block[:, 0] + block[:, 1]
        blocks.append(block)
    moved = np.stack(blocks)
    q, r = (np.asarray(v) for v in orthonormalised(tf, tf.constant(moved)))
    gram = np.einsum("bsi,bsj->bij", q, q)
    assert np.max(np.abs(gram - np.eye(5))) < 1e-10
    np.testing.assert_allclose(q @ r, moved, atol=1e-12)
    assert np.allclose(np.tril(r, -1), 0) and np.all(np.diagonal(r, axis1=1, axis2=2) >= 0)


@pytest.mark.parametrize(("rho", "mechanism"), [(1.05, "exploding"), (0.5, "vanishing")])
def test_an_orthogonal_linear_recurrence(tf: Any, rho: float, mechanism: str) -> None:
    x, y = _batch(steps=40)
    report = gradscope.diagnose(_linear_model(_orthogonal(6, rho), steps=40), x=x, y=y,
                                exponents=3)
    entry = report.layers[0]
    np.testing.assert_allclose(entry.lyapunov, [np.log(rho)] * 3, atol=1e-4)
    assert entry.mechanism == mechanism
    assert mechanism in entry.verdict
    if rho < 1:
        # ‖W^k U‖ = ρ^k ‖U‖: below 10⁻³ first at k = 10
        assert entry.horizon.measured == 10
        assert entry.horizon.predicted == pytest.approx(np.log(1e3) / np.log(2), rel=1e-3)
    else:
        assert entry.horizon.predicted is None
        assert entry.jacobian_norm.share_above_1 == 1.0
        # Carried back ×1.05³⁹ ≈ 6.7, within explain's 10³: the verdict says how far the 40
        # steps are from a gradient that blows up (about 142 steps at this rate).
        rate = entry.lyapunov[0]
        assert entry.flow is not None and entry.flow.flag is None
        assert entry.flow.ratio == pytest.approx(rho ** 39, rel=1e-4)
        assert (f"within its factor 10³; at λ₁'s rate those 39 steps grow a gradient "
                f"×{np.exp(39 * rate):.3g}, and ×10³ takes about "
                f"{np.log(1e3) / rate:,.0f} steps: a longer sequence would explode"
                in entry.verdict)
        # Beyond every lag the batch has: the window is the whole sequence, and says so.
        assert entry.horizon.measured is None
        assert entry.horizon.window == entry.horizon.longest_lag == max(entry.horizon.steps)
        from conftest import render_text

        assert "measured more than 39 (every lag there is)" in " ".join(
            render_text(report, 80).split())


@pytest.mark.parametrize(("rho", "above"), [(1.0, 0.0), (1.00001, 1.0)])
def test_a_norm_of_1_by_rounding_is_not_above_1(tf: Any, rho: float, above: float) -> None:
    """Found tried as a new user would: a relu SimpleRNN fresh from Keras' orthogonal
    initializer read "‖J_t‖₂ median 1.00 · max 1.00 · > 1 on 100% of steps" (J = D·W, D a
    0/1 diagonal: its norm is at most 1; float32 made it 1 + 1.4e-7). A norm above 1 by
    less than 4 float32 roundoffs does not count; one 1e-5 above does."""
    from gradscope.keras.diagnose import above_1_rounding

    assert above_1_rounding("float32") == 4 * np.finfo(np.float32).eps
    x, y = _batch(steps=12)
    w = _orthogonal(6, rho)
    entry = gradscope.diagnose(_linear_model(w, steps=12), x=x, y=y, exponents=1,
                               counterfactuals=False).layers[0]
    assert entry.jacobian_norm.max == pytest.approx(np.linalg.norm(w, 2), abs=5e-7)
    assert entry.jacobian_norm.share_above_1 == above


def test_a_relu_recurrence_that_explodes_in_most_examples_is_called_exploding(
        tf: Any) -> None:
    """A relu SimpleRNN at 1.05 · I: every example grows about 1.05× per step, but in two of
    four one input switches every unit off at step 100 (J_t = 0 there), which pulls their
    exponents, and so the mean λ₁, far below 0. The batch's gradient still grows by more
    than 10³ carried back: the verdict is exploding, with the examples' own λ₁ held to a
    NumPy QR of J_t = diag(relu′)·Rᵀ."""
    import keras
    from keras import layers as L

    from gradscope.keras.diagnose.trajectory import SMALLEST_STRETCH

    steps, units = 200, 4
    x = np.full((4, steps, 1), 0.01, np.float32)
    x[2:, 100] = -1000.0
    y = np.ones((4, 1), np.float32)
    rnn = L.SimpleRNN(units, activation="relu", name="rnn",
                      kernel_initializer="ones", bias_initializer="zeros",
                      recurrent_initializer=keras.initializers.Identity(gain=1.05))
    model = keras.Sequential([keras.Input((steps, 1), name="x"), rnn,
                              L.Dense(1, kernel_initializer="ones")])
    model.compile(loss="mse")
    entry = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
    assert entry.lyapunov[0] < 0 and entry.flow is not None and entry.flow.flag == "exploding"
    assert entry.mechanism == "exploding"
    # Each example's own exponent, by NumPy: h_t = relu(x_t·W + h_(t−1)·R).
    kernel, recurrent, _ = (np.asarray(w, np.float64) for w in rnn.get_weights())
    h = np.zeros((4, units))
    logs = np.zeros((4, units))
    q = np.tile(np.eye(units), (4, 1, 1))
    for t in range(steps):
        z = x[:, t].astype(np.float64) @ kernel + h @ recurrent
        h = np.maximum(z, 0)
        for e in range(4):
            q[e], r = np.linalg.qr((z[e] > 0)[:, None] * recurrent.T @ q[e])
            logs[e] += np.log(np.maximum(np.abs(np.diag(r)), SMALLEST_STRETCH))
    own = np.max(logs / steps, axis=1)
    np.testing.assert_allclose(own[:2], np.log(1.05), rtol=1e-4)
    assert np.all(own[2:] < -0.2)
    assert (f"in 2 of the 4 examples λ₁ is above +0.01 (median {np.log(1.05):+.3g} per step"
            in entry.verdict), entry.verdict
    assert f"λ₁ = {entry.lyapunov[0]:+.3g}, hides it" in entry.verdict


def test_a_padded_tail_changes_no_number_of_the_diagnosis(tf: Any) -> None:
    """Sequences of 30 to 60 real steps behind Masking, padded with zeros to 200 steps: the
    horizon is measured where the examples ran, and the exponents' change over the last
    quarter of each example's own steps, so every number equals the same batch cropped to 60
    steps. (Measured in the padded second half, the horizon read nothing and the layer was
    said to hold.)"""
    import keras
    from keras import layers as L

    lengths = [30, 40, 50, 60]
    rng = np.random.default_rng(2)
    x = np.zeros((4, 200, F), np.float32)
    for e, n in enumerate(lengths):
        x[e, :n] = rng.standard_normal((n, F))
    y = rng.standard_normal((4, 1)).astype(np.float32)

    def entry(steps: int) -> Any:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((steps, F), name="x"), L.Masking(),
                                  L.LSTM(8, name="lstm"), L.Dense(1)])
        model.compile(loss="mse")
        return gradscope.diagnose(model, x=x[:, :steps], y=y,
                                  counterfactuals=False).layers[0]

    padded, cropped = entry(200), entry(60)
    assert cropped.horizon.measured is not None and cropped.mechanism == "vanishing"
    assert padded.horizon.measured == cropped.horizon.measured
    assert padded.horizon.steps == cropped.horizon.steps
    np.testing.assert_allclose(padded.lyapunov, cropped.lyapunov, rtol=1e-5)
    assert padded.lyapunov_change == pytest.approx(cropped.lyapunov_change, rel=1e-5)
    assert padded.mechanism == "vanishing"
    # The verdict counts the steps the examples ran, and says the rest is padding.
    assert padded.verdict == cropped.verdict.replace(
        "of the 60 steps", "of the 60 steps the longest example ran (200 with padding)")


def test_one_tangent_column_is_the_first_of_k_against_a_float64_power_iteration(
        tf: Any) -> None:
    """A counterfactual's λ₁ carries only the first of the layer's k random start columns
    (a state above 32 numbers): its logs are the first column's of the k-column scan, and
    both are a float64 power iteration of Keras' own step Jacobians from that column."""
    import keras

    from gradscope.keras.diagnose.trajectory import lyapunov_logs, trajectory
    from gradscope.keras.stepped import joined_totals, step_call, step_squares

    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F), name="x")
    h = keras.layers.LSTM(17, return_sequences=True, name="lstm")(inp)  # s: 34 numbers
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    x, _ = _batch()
    engine = _real_engine(model, x)
    call = next(c for c in engine.last.calls if c.layer == "lstm")
    stepped = step_call(engine, call, [np.ones(call.outputs[0].shape, "float32")], False,
                        cell_dtype=True)
    assert not isinstance(stepped, str)
    path = trajectory(stepped, 0)
    assert not isinstance(path, str)
    full = lyapunov_logs(engine, path, 8)
    one = lyapunov_logs(engine, path, 8, carried=1)
    assert one.shape == (B, T, 1)
    np.testing.assert_allclose(one[..., 0], full[..., 0], rtol=1e-4, atol=1e-5)

    # Column i of the start is the same whatever the count: column 0's logs with one column.
    np.testing.assert_allclose(lyapunov_logs(engine, path, 1)[..., 0], full[..., 0],
                               rtol=1e-4, atol=1e-5)
    column = np.random.default_rng(0).standard_normal(34)
    column /= np.linalg.norm(column)
    v = np.tile(column, (B, 1))
    truth = np.zeros((B, T))
    for t, (x_t, s) in enumerate(_sequences(tf, model, "lstm", x)):
        v = np.einsum("bij,bj->bi", _jacobian(tf, model.get_layer("lstm").cell, x_t, s), v)
        norms = np.linalg.norm(v, axis=1)
        truth[:, t], v = np.log(norms), v / norms[:, None]
    np.testing.assert_allclose(one[..., 0], truth, rtol=1e-4, atol=1e-4)

    # The per-step squared norms of ∂L/∂s_t and its carried part, as joined_totals has them.
    whole, above = joined_totals(stepped, 0)
    squares, carried = step_squares(stepped, 0)
    np.testing.assert_allclose(squares, np.sum(whole ** 2, axis=2), rtol=1e-12)
    np.testing.assert_allclose(carried, np.sum((whole - above) ** 2, axis=2), rtol=1e-12)


def test_a_conv_lstm_is_diagnosed_with_its_feature_maps_read_flat(tf: Any) -> None:
    """A ConvLSTM1D's states are feature maps (width × filters): the exponents, read flat,
    against a float64 QR of its own cell's step Jacobians (the maps flattened), from an
    eager loop over Keras' own cell from zero states."""
    import keras

    keras.utils.set_random_seed(1)
    steps, width, channels, filters = 9, 4, 2, 2
    inp = keras.Input((steps, width, channels), name="x")
    conv = keras.layers.ConvLSTM1D(filters, 3, padding="same", name="conv")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(conv(inp))))
    model.compile(loss="mse")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, steps, width, channels)).astype(np.float32)
    report = gradscope.diagnose(model, x=x, y=rng.normal(size=(3, 1)).astype(np.float32),
                                counterfactuals=False)
    (found,) = report.layers
    size = 2 * width * filters
    assert found.call == "conv" and found.state_size == size and not report.not_diagnosed
    shape = (width, filters)
    states = [tf.zeros((3, *shape)), tf.zeros((3, *shape))]
    logs = np.zeros((3, size))
    q = np.tile(np.eye(size), (3, 1, 1))
    for t in range(steps):
        joined = tf.concat([tf.reshape(s, (3, -1)) for s in states], 1)

        def step(copies: Any, t: int = t) -> Any:
            h, c = tf.split(copies, 2, axis=1)
            _, new = conv.cell(copied(tf, x[:, t], size),
                               [tf.reshape(h, (-1, *shape)), tf.reshape(c, (-1, *shape))])
            return tf.concat([tf.reshape(n, (-1, size // 2)) for n in keras.tree.flatten(new)],
                             1)

        jacobian = rows_by_copies(tf, joined, size, step)
        _, new = conv.cell(x[:, t], states)
        for example in range(3):
            q[example], r = np.linalg.qr(jacobian[example] @ q[example])
            logs[example] += np.log(np.abs(np.diag(r)))
        states = list(keras.tree.flatten(new))
    truth = np.sort((logs / steps).mean(axis=0))[::-1]
    np.testing.assert_allclose(found.lyapunov, truth, rtol=1e-3, atol=1e-3)


# -- training mode with dropout ---------------------------------------------------------------

DROP_STEPS, DROP_SEED = 20, 5


@pytest.fixture(scope="module")
def dropout_case(tf: Any) -> tuple[Any, np.ndarray, np.ndarray, Any]:
    """An LSTM then a GRU, each with dropout and recurrent_dropout 0.3 (Keras'
    implementation 1: a mask per gate), diagnosed once in training mode."""
    import keras

    keras.utils.set_random_seed(2)
    inp = keras.Input((DROP_STEPS, F), name="x")
    h = keras.layers.LSTM(5, dropout=0.3, recurrent_dropout=0.3, return_sequences=True,
                          name="lstm")(inp)
    h = keras.layers.GRU(4, dropout=0.3, recurrent_dropout=0.3, return_sequences=True,
                         name="gru")(h)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    x, y = _batch(steps=DROP_STEPS)
    return model, x, y, gradscope.diagnose(model, x=x, y=y, training=True, seed=DROP_SEED,
                                           counterfactuals=False)


@pytest.fixture(scope="module")
def dropped(tf: Any, dropout_case: Any) -> dict[str, Any]:
    """Per layer, the masks its cell draws in a training-mode call seeded as the diagnosis
    was (Keras' own draw: get_dropout_mask from the generator's start), and the pairs
    (x_t, states) of an eager loop over Keras' own cell holding them; the loop's outputs are
    held to Keras' own training-mode call of the model, which draws its masks itself, so
    these are the masks the call drew."""
    import keras

    from gradscope.keras.whole_model import seed_random_draws

    model, x, _, _ = dropout_case
    names = ("lstm", "gru")
    seed_random_draws(model, DROP_SEED)
    own = keras.Model(model.inputs, [model.get_layer(n).output for n in names])(
        x, training=True)
    seed_random_draws(model, DROP_SEED)
    found: dict[str, Any] = {}
    inputs = tf.constant(x)
    for name, keras_outputs in zip(names, own, strict=True):
        cell = model.get_layer(name).cell
        masks = (cell.get_dropout_mask(inputs[:, 0]),
                 cell.get_recurrent_dropout_mask(tf.zeros((B, cell.units))))
        assert len(masks[0]) == len(masks[1]) == (4 if name == "lstm" else 3)
        states = [tf.zeros((B, s)) for s in keras.tree.flatten(cell.state_size)]
        pairs, outputs = [], []
        for t in range(DROP_STEPS):
            pairs.append((inputs[:, t], [tf.identity(s) for s in states]))
            out, states = cell(inputs[:, t], states, training=True)
            states = list(keras.tree.flatten(states))
            outputs.append(out)
        cell.reset_dropout_mask()
        cell.reset_recurrent_dropout_mask()
        inputs = tf.stack(outputs, axis=1)
        np.testing.assert_allclose(inputs, keras_outputs, rtol=1e-5, atol=1e-6)
        found[name] = masks, pairs, np.asarray(inputs, np.float64)
    return found


def test_dropout_exponents_and_step_norms_against_keras_own_cell_with_its_masks(
        tf: Any, dropout_case: Any, dropped: dict[str, Any]) -> None:
    """Training mode, dropout and recurrent_dropout 0.3: the exponents against a float64 QR
    of the step Jacobians of Keras' own cell holding the masks the call drew, the norm of every
    step Jacobian against their SVD (per step, and per pair by Lanczos and exactly). The
    LSTM's J_t is singular at every step (its output gate's recurrent mask drops units):
    as many exponents as the SVD finds singular values at rounding level are −∞, and only
    the top ones are given, from a random start (as for fewer columns than states)."""
    from gradscope.keras.diagnose.trajectory import lyapunov_logs, step_norms

    model, x, _, report = dropout_case
    assert not report.not_diagnosed
    engine = _real_engine(model, x, training=True, seed=DROP_SEED)
    for name, cut in (("lstm", 2), ("gru", 0)):
        masks, pairs, _ = dropped[name]
        cell = model.get_layer(name).cell
        jacobians = [_jacobian(tf, cell, x_t, s, masks) for x_t, s in pairs]
        values = np.stack([np.linalg.svd(j, compute_uv=False) for j in jacobians], axis=1)
        singular = np.sum(values < 1e-6 * values[..., :1], axis=2)  # (B, T)
        assert (singular == singular[:, :1]).all() and singular.max() == cut
        size = values.shape[2]
        start = (None if not cut else
                 np.linalg.qr(np.random.default_rng(0).standard_normal((size - cut, size)).T)[0])
        entry = next(e for e in report.layers if e.call == name)
        assert len(entry.lyapunov) == size - cut
        np.testing.assert_allclose(entry.lyapunov, _qr_exponents(jacobians, start),
                                   rtol=1e-3, atol=1e-3)
        truth = values[..., 0]
        np.testing.assert_allclose(entry.jacobian_norm.steps_max, truth.max(axis=0),
                                   rtol=1e-4)
        np.testing.assert_allclose(entry.jacobian_norm.steps_median, np.median(truth, axis=0),
                                   rtol=1e-4)
        path = _trajectory(engine, name, training=True)
        for exact in (True, False):
            np.testing.assert_allclose(step_norms(engine, path, exact=exact)[0], truth,
                                       rtol=1e-4)
        # Per example and step: log|R_t[i, i]| of the same float64 QR, column by column.
        np.testing.assert_allclose(lyapunov_logs(engine, path, size - cut),
                                   _qr_logs(jacobians, start), rtol=1e-3, atol=1e-4)
    assert report.method[-1].startswith("training mode with dropout: each step holds")
    (said,) = report.warnings
    assert said.startswith("lstm: recurrent_dropout in training mode cuts up to 2 of the "
                           "state's 10 directions") and "only the top 8 are finite" in said


def _in_float64(model: Any, name: str, dropped: dict[str, Any]) -> tuple[Any, ...]:
    """Layer ``name``'s kernel, recurrent kernel and bias, its input and recurrent masks (one
    per gate) in float64, and Keras' own outputs of the call that drew them."""
    cell = model.get_layer(name).cell
    kernel, recurrent, bias = (np.asarray(v, np.float64) for v in
                               (cell.kernel, cell.recurrent_kernel, cell.bias))
    (m, r_m), _, keras_outputs = dropped[name]
    return (kernel, recurrent, bias, [np.asarray(v, np.float64) for v in m],
            [np.asarray(v, np.float64) for v in r_m], keras_outputs)


def test_dropout_gate_shares_against_a_numpy_pass_with_the_masks(
        tf: Any, dropout_case: Any, dropped: dict[str, Any]) -> None:
    """Keras' LSTM and GRU (reset_after) equations of implementation 1 written out in NumPy,
    x_t and h_(t−1) multiplied by each gate's own mask; their outputs held to Keras'."""
    model, x, _, report = dropout_case
    kernel, recurrent, bias, m, r_m, keras_outputs = _in_float64(model, "lstm", dropped)
    u = 5
    h, c = np.zeros((B, u)), np.zeros((B, u))
    gates: dict[str, list[np.ndarray]] = {"input": [], "forget": [], "output": []}
    outputs = []
    for t in range(DROP_STEPS):
        x_t = x[:, t].astype(np.float64)
        i, f, g, o = ((x_t * m[k]) @ kernel[:, k * u:(k + 1) * u]
                      + (h * r_m[k]) @ recurrent[:, k * u:(k + 1) * u]
                      + bias[k * u:(k + 1) * u] for k in range(4))
        i, f, o = _sigmoid(i), _sigmoid(f), _sigmoid(o)
        c = f * c + i * np.tanh(g)
        h = o * np.tanh(c)
        outputs.append(h)
        for name, value in (("input", i), ("forget", f), ("output", o)):
            gates[name].append(value)
    np.testing.assert_allclose(np.stack(outputs, 1), keras_outputs, rtol=1e-4, atol=1e-6)
    entry = next(e for e in report.layers if e.call == "lstm")
    assert entry.gates is not None and entry.timescales is not None
    for name, values in gates.items():
        stacked = np.stack(values)
        assert entry.gates[name].below_0_1 == pytest.approx(np.mean(stacked < 0.1), abs=1e-9)
        assert entry.gates[name].above_0_9 == pytest.approx(np.mean(stacked > 0.9), abs=1e-9)
    taus = -1 / np.log(np.stack(gates["forget"]).mean(axis=(0, 1)))
    assert entry.timescales.median == pytest.approx(np.median(taus), rel=1e-4)
    assert model.get_layer("gru").cell.reset_after
    kernel, recurrent, bias, m, r_m, keras_outputs = _in_float64(model, "gru", dropped)
    v = 4
    h = np.zeros((B, v))
    zs, rs, hs = [], [], []
    for t in range(DROP_STEPS):
        xs = [(outputs[t] * m[k]) @ kernel[:, k * v:(k + 1) * v] + bias[0, k * v:(k + 1) * v]
              for k in range(3)]
        rec = [(h * r_m[k]) @ recurrent[:, k * v:(k + 1) * v] + bias[1, k * v:(k + 1) * v]
               for k in range(3)]
        z, r = _sigmoid(xs[0] + rec[0]), _sigmoid(xs[1] + rec[1])
        h = z * h + (1 - z) * np.tanh(xs[2] + r * rec[2])
        zs.append(z)
        rs.append(r)
        hs.append(h)
    np.testing.assert_allclose(np.stack(hs, 1), keras_outputs, rtol=1e-4, atol=1e-6)
    entry = next(e for e in report.layers if e.call == "gru")
    assert entry.gates is not None and entry.timescales is not None
    for name, values in (("update", zs), ("reset", rs)):
        stacked = np.stack(values)
        assert entry.gates[name].below_0_1 == pytest.approx(np.mean(stacked < 0.1), abs=1e-9)
        assert entry.gates[name].above_0_9 == pytest.approx(np.mean(stacked > 0.9), abs=1e-9)
    taus = -1 / np.log(np.stack(zs).mean(axis=(0, 1)))
    assert entry.timescales.median == pytest.approx(np.median(taus), rel=1e-4)


def test_dropout_measured_horizon_against_a_tape_through_keras_own_training_call(
        tf: Any, dropout_case: Any) -> None:
    """‖∂h_t/∂x_s‖ per example from Keras' own layer called in training mode under a tape,
    seeded as the diagnosis was: the masks the layer draws itself, as the call did (its
    outputs drawing them held to the copies' holding them)."""
    import keras

    from gradscope.keras.whole_model import seed_random_draws

    model, x, _, report = dropout_case
    for name in ("lstm", "gru"):
        entry = next(e for e in report.layers if e.call == name)
        layer = model.get_layer(name)
        upstream = keras.Model(model.inputs, layer.input)
        seed_random_draws(model, DROP_SEED)
        inputs = tf.convert_to_tensor(upstream(x, training=True))
        own = np.asarray(layer(inputs, training=True))  # drawing its masks itself
        # The same draws again, as the layer's call makes them (Keras' RNN.call: the input
        # mask from the first step's input, the recurrent one from the zero state).
        seed_random_draws(model, DROP_SEED)
        np.testing.assert_array_equal(upstream(x, training=True), inputs)
        cell = layer.cell
        masks = (cell.get_dropout_mask(inputs[:, 0]),
                 cell.get_recurrent_dropout_mask(tf.zeros((B, cell.units))))
        cell.reset_dropout_mask()
        cell.reset_recurrent_dropout_mask()
        _assert_horizon_by_tape(tf, entry, layer, inputs, (*masks, own))


def test_during_training_reads_a_training_mode_call_with_dropout_as_diagnose_does(
        tf: Any, dropout_case: Any) -> None:
    """What GradientFlow's diagnosis reads (read_calls), on an engine in training mode:
    the exponents (as many as the diagnosis took: the LSTM's 8 finite ones of 10), gate
    shares and measured horizon equal to the diagnosis held above."""
    from gradscope.keras.diagnose.during_training import read_calls

    model, x, _, report = dropout_case
    engine, inputs, targets = _engine_and_batch(model, x, training=True, seed=DROP_SEED)
    readings, skipped = read_calls(engine, inputs, targets, exponents=8,
                                   measure_horizon=True)
    assert not skipped and [r.call for r in readings] == ["lstm", "gru"]
    for reading in readings:
        entry = next(e for e in report.layers if e.call == reading.call)
        np.testing.assert_allclose(reading.lyapunov, entry.lyapunov, rtol=1e-6)
        assert reading.gates == entry.gates
        assert reading.measured == entry.horizon.measured


#: The float32 model's diagnosis both mixed policies are held to, by its weights.
_FLOAT32_TRUTH: dict[tuple[float, ...], Any] = {}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_mixed_precision_model_is_diagnosed_in_its_compute_dtype(tf: Any,
                                                                    policy: str) -> None:
    """Under a mixed policy (float32 variables, float16 or bfloat16 steps) every number is
    read in the steps' dtype, as Keras runs them, and lies near the same model's in float32
    (the low precision's own rounding apart)."""
    import keras

    def build(dtype: str) -> Any:
        keras.utils.set_random_seed(0)
        inp = keras.Input((T, F), name="x")
        h = keras.layers.LSTM(20, return_sequences=True, name="lstm", dtype=dtype)(inp)
        h = keras.layers.GRU(4, return_sequences=True, name="gru", dtype=dtype)(h)
        model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
        model.compile(loss="mse")
        return model

    x, y = _batch()
    mixed = build(policy)
    key = tuple(float(np.sum(w)) for w in mixed.get_weights())
    if key not in _FLOAT32_TRUTH:  # both policies draw the same float32 variables
        plain = build("float32")
        plain.set_weights(mixed.get_weights())
        _FLOAT32_TRUTH[key] = gradscope.diagnose(plain, x=x, y=y, counterfactuals=False)
    found = gradscope.diagnose(mixed, x=x, y=y, counterfactuals=False)
    truth = _FLOAT32_TRUTH[key]
    assert [e.call for e in found.layers] == ["lstm", "gru"] and not found.not_diagnosed
    for ours, theirs in zip(found.layers, truth.layers, strict=True):
        np.testing.assert_allclose(ours.lyapunov, theirs.lyapunov, atol=0.05)
        assert ours.jacobian_norm.median == pytest.approx(theirs.jacobian_norm.median,
                                                          rel=0.02)
        assert ours.gates is not None and theirs.gates is not None
        for name, shares in ours.gates.items():
            assert shares.below_0_1 == pytest.approx(theirs.gates[name].below_0_1, abs=0.05)


@pytest.mark.parametrize("width", [60, 80])
def test_every_wrapped_line_of_a_layer_is_indented_under_its_label(tf: Any, width: int) -> None:
    """A line longer than the terminal (the changes that do not apply to a cell of the user's,
    the steps where ∂L/∂s_t grows) wraps at its own spaces, indented: no line passes the width,
    none starts at the first column but a label's, and no example is parted from its ratio."""
    x, y = _batch(steps=40)
    report = gradscope.diagnose(_linear_model(_orthogonal(6, 1.05), steps=40), x=x, y=y,
                                exponents=3)
    text = render_text(report, width)
    lines = text.split("linear (", 1)[1].split("The batch's gradient", 1)[0].splitlines()[1:]
    labels = ("▲ ", "Lyapunov exponents", "step Jacobian", "gates", "memory horizon",
              "with one change", "∂L/∂s_t grows", "∂L/∂s carried back")
    assert any("kernel)" in line for line in lines)  # a change not applicable
    assert any(re.search(r"(^|· )steps \d", line.lstrip()) for line in lines)
    for line in filter(None, lines):
        assert len(line) <= width, line
        assert line.startswith("  ") or line.startswith(labels), line
        assert not line.lstrip().startswith("(×"), line


def test_a_padded_batch_of_uneven_lengths_carries_only_through_steps_that_ran(
        tf: Any) -> None:
    """Behind Embedding(mask_zero), examples of 9 to 30 steps: what reaches an example's last
    step from its later, masked, outputs is not carried through the recurrence. So no step
    grows ∂L/∂s going back, and the ratio carried back is at most the product of each step's
    largest ‖J_t‖₂ (the carried part at t is J_(t+1)ᵀ·∂L/∂s_(t+1)); explain --flow flags the
    same ratio."""
    steps, lengths = 30, [30, 24, 18, 12, 30, 9]
    model = _token_lstm(steps, seed=3)
    rng = np.random.default_rng(0)
    x = np.zeros((len(lengths), steps), "int32")
    for row, length in enumerate(lengths):
        x[row, :length] = rng.integers(1, 20, size=length)
    y = rng.standard_normal((len(lengths), 1)).astype("float32")
    entry = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
    assert entry.exploding is not None and entry.exploding.growing_steps == []
    assert entry.flow is not None and entry.flow.ratio is not None
    bound = float(np.prod(entry.jacobian_norm.steps_max[1:]))
    assert entry.flow.ratio <= bound * (1 + 1e-6)
    flow = gradscope.explain(model, x=x, y=y, flow=True).gradient_flow
    assert flow is not None
    flags = flow.flags
    recurrent = [f for f in flags if f.what.startswith("∂L/∂lstm/h_t")]
    if entry.flow.flag is None:
        assert recurrent == []
    else:
        (flag,) = recurrent
        assert flag.ratio == pytest.approx(entry.flow.ratio, rel=1e-5)
    # Beside examples of one step, every gain back is the longest example's own: the ratio
    # is that example's, diagnosed alone (its gains do not depend on the batch's mean).
    alone = gradscope.diagnose(model, x=x[:1], y=y[:1], counterfactuals=False).layers[0]
    x[1:] = 0
    x[1:, 0] = 5
    beside = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
    assert alone.flow is not None and beside.flow is not None
    assert beside.flow.ratio == pytest.approx(alone.flow.ratio, rel=1e-5)


def test_a_change_that_changes_nothing_says_so(tf: Any) -> None:
    """A SimpleRNN whose recurrent kernel already is orthogonal × 3: the orthogonal change
    would change nothing, and says so instead of a rerun whose numbers move by chaos alone;
    a clipping that would scale the gradient by 1 says it clips nothing."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((T, F)),
        keras.layers.SimpleRNN(6, recurrent_initializer=keras.initializers.Orthogonal(3.0),
                               name="rnn"),
        keras.layers.Dense(1)])
    model.compile(loss="mse")
    x, y = _batch()
    entry = gradscope.diagnose(model, x=x, y=y[:, -1]).layers[0]
    found = {c.kind: c for c in entry.counterfactuals}
    assert not found["orthogonal"].applicable
    assert "already is orthogonal" in (found["orthogonal"].note or "")
    report = gradscope.diagnose(model, x=x, y=y[:, -1], counterfactuals=False)
    clip = found["clipping"].model_copy(update={"clip_scale": 1.0})
    text = render_text(report.model_copy(update={
        "layers": [entry.model_copy(update={"counterfactuals": [clip]})]}), 80)
    assert "clips nothing on this batch" in text


def test_a_batch_whose_sample_weights_are_all_0_says_what_is_not_read(tf: Any) -> None:
    """Every sample weight 0: the loss and every gradient are exactly 0. The flow reads
    nothing (n/a), and the report says why, and that the dynamics stand (found tried as a new
    user would: "carried ×n/a → ×n/a", with no word)."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((T, F), name="x")
    h = keras.layers.GRU(4, return_sequences=True, name="gru")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="out")(h))
    model.compile(loss="mse")
    x, y = _batch()
    report = gradscope.diagnose(model, x=x, y=y, sample_weight=np.zeros((B, T), np.float32),
                                counterfactuals=False)
    assert report.loss.value == 0 and report.gradient_norm == 0
    flow = report.layers[0].flow
    assert flow is not None and flow.ratio is None and report.layers[0].lyapunov
    said = " ".join(report.warnings)
    assert "the loss is exactly 0 on this batch (every sample weight 0?)" in said
    assert "the dynamics (λ, the step Jacobians, the gates, the horizon)" in said


def test_a_batch_padded_after_its_sequences_carries_as_one_padded_before_them(tf: Any) -> None:
    """The same sequences of 8 to 30 tokens behind Embedding(mask_zero), padded after them
    (each example's gradient enters at its own last step) and before them (all at the
    call's last step): every example takes the same steps, so explain --flow's ratio and
    diagnose's are the same for both. Multiplied step by step as the batch ran them, the
    ratio of the batch padded after took each example's entry for a loss of what was carried
    (found tried as a new user would: ×1.6e-07 flagged vanishing, where each example kept
    ×1.1e-03 to ×7.0e-02)."""
    steps, lengths = 30, [30, 8, 20, 12, 26, 16]
    model = _token_lstm(steps, seed=4)
    rng = np.random.default_rng(1)
    after, before = (np.zeros((len(lengths), steps), "int32") for _ in range(2))
    for row, length in enumerate(lengths):
        tokens = rng.integers(1, 20, size=length)
        after[row, :length] = tokens
        before[row, steps - length:] = tokens
    y = rng.standard_normal((len(lengths), 1)).astype("float32")

    def ratios(x: np.ndarray) -> tuple[Any, list[float]]:
        entry = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
        flow = gradscope.explain(model, x=x, y=y, flow=True).gradient_flow
        assert entry.flow is not None and entry.flow.ratio is not None and flow is not None
        flagged = [f.ratio for f in flow.flags if f.what.startswith("∂L/∂lstm/h_t")]
        assert flagged in ([], [pytest.approx(entry.flow.ratio, rel=1e-5)])
        # explain gives the ratio, flagged or not, on the state it reads.
        carried = [s.carried for s in flow.sequences if s.carried is not None]
        assert carried == [pytest.approx(entry.flow.ratio, rel=1e-5)]
        return entry.flow, flagged

    (diagnosed_after, flagged_after), (diagnosed_before, flagged_before) = (
        ratios(after), ratios(before))
    assert diagnosed_after.ratio == pytest.approx(diagnosed_before.ratio, rel=1e-4)
    assert len(flagged_after) == len(flagged_before)
    # ‖∂L/∂s‖ at the first and the last step is each example's own (padded after, the
    # call's last step held no gradient: "last" read 0).
    assert diagnosed_after.last > 0
    assert diagnosed_after.first == pytest.approx(diagnosed_before.first, rel=1e-4)
    assert diagnosed_after.last == pytest.approx(diagnosed_before.last, rel=1e-4)


def test_a_mixed_float16_model_object_names_its_loss_scale_optimizer(tf: Any) -> None:
    """Compiled under the mixed_float16 policy, a model object's optimizer is Keras'
    LossScaleOptimizer around Adam: the clipping line names both (found tried as a new user
    would: diagnose said "optimizer Adam", explain "LossScaleOptimizer(Adam)")."""
    import keras

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inp = keras.Input((T, F), name="x")
        h = keras.layers.GRU(4, name="gru")(inp)
        model = keras.Model(inp, keras.layers.Dense(1, name="out", dtype="float32")(h))
        model.compile(optimizer=keras.optimizers.Adam(clipnorm=0.5), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    x, _ = _batch()
    y = np.random.default_rng(0).standard_normal((B, 1)).astype("float32")
    report = gradscope.diagnose(model, x=x, y=y, counterfactuals=False)
    assert report.clipping.optimizer == "LossScaleOptimizer(Adam)"
    assert report.clipping.setting == "clipnorm=0.5"


def test_a_batch_padded_before_its_sequences_measures_no_lag_before_its_first_step(
        tf: Any) -> None:
    """Every example runs the last 10 of 30 steps (padded before them): no lag reaches back
    past step 20, so the window stops at 9 lags, and "measured more than" says no more than
    was measured (found tried as a new user would: "measured more than 29", with ratios up to
    lag 9 only)."""
    import keras

    keras.utils.set_random_seed(2)
    steps, ran = 30, 10
    model = keras.Sequential([keras.Input((steps,), dtype="int32"),
                              keras.layers.Embedding(20, 4, mask_zero=True, name="embed"),
                              keras.layers.GRU(4, name="gru",
                                               recurrent_initializer="identity"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    x = np.zeros((4, steps), "int32")
    x[:, steps - ran:] = rng.integers(1, 20, size=(4, ran))
    y = rng.standard_normal((4, 1)).astype("float32")
    entry = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
    horizon = entry.horizon
    assert horizon.window <= ran - 1
    assert all(r is not None for r in horizon.ratios[:horizon.window + 1])
    if horizon.measured is None:
        assert f"measured more than {horizon.window}" in entry.verdict


def test_a_run_too_short_to_settle_says_so(tf: Any) -> None:
    """Found tried as a new user would: over 3 steps the exponents were shown with no
    "moved" (it needs 4 steps) and no word that 3 steps cannot settle them. Found again in
    a fit's diagnoses (GradientFlow(diagnose_every=N)): a decoder's call of 4 steps showed a
    horizon "predicted from λ₁: 242 steps" with no word of either; each diagnosis now notes
    what diagnose warns of λ₁, and the training report shows it beside the horizon."""
    import keras

    from gradscope.keras import GradientFlow

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    for steps, warned in ((3, True), (4, False)):
        model = keras.Sequential([keras.Input((steps, 2)), keras.layers.LSTM(3, name="lstm"),
                                  keras.layers.Dense(1)])
        model.compile(loss="mse")
        x, y = rng.standard_normal((2, steps, 2)), rng.standard_normal((2, 1))
        report = gradscope.diagnose(model, x=x, y=y, counterfactuals=False)
        assert (report.layers[0].lyapunov_change is None) is warned
        assert any(w.startswith(f"lstm: {steps} steps are too few to tell how far the "
                                "exponents have settled") for w in report.warnings) is warned
        flow = GradientFlow(model=model, diagnose_every=1)
        flow.observe(x, y)
        (note,) = flow.history.diagnoses[0].lyapunov_note
        unsettled = any(w.startswith("lstm: λ₁ has not settled") for w in report.warnings)
        if warned:
            assert note == "3 steps are too few to tell whether λ₁ has settled"
            text = " ".join(render_text(flow.history, 80).split())
            assert f"steps ({note})" in text
        else:
            assert (note is not None) == unsettled


def test_a_stack_of_cells_against_a_float64_qr_of_keras_own_stack(tf: Any) -> None:
    """Found tried as a new user would: RNN(StackedRNNCells([LSTMCell, GRUCell])) was not
    diagnosed ("LSTMCell.call(): list index out of range": its states went to the stack flat,
    where it takes one entry per cell). Its exponents against a float64 QR of the
    step Jacobians of Keras' own stack, called here with its states nested: [[h, c], h]."""
    import keras

    keras.utils.set_random_seed(0)
    stack = keras.layers.StackedRNNCells([keras.layers.LSTMCell(3), keras.layers.GRUCell(2)])
    model = keras.Sequential([keras.Input((T, F)), keras.layers.RNN(stack, name="stk"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    x, _ = _batch()
    y = np.random.default_rng(1).standard_normal((x.shape[0], 1)).astype("float32")
    report = gradscope.diagnose(model, x=x, y=y)
    assert not report.not_diagnosed, report.not_diagnosed
    (entry,) = report.layers
    cell = model.get_layer("stk").cell
    # Why its gates and its keep gate's change are not read, in words a reader can act on.
    assert entry.gates_note is not None and "LSTMCell, GRUCell" in entry.gates_note
    assert "RNN layer of its own" in entry.gates_note
    for kind in ("keep_bias", "orthogonal"):
        change = next(c for c in entry.counterfactuals if c.kind == kind)
        assert not change.applicable and "RNN layer of its own" in (change.note or "")

    def nested(flat: list[Any]) -> list[Any]:
        return [[flat[0], flat[1]], flat[2]]

    def step(x_t: Any, joined: Any) -> Any:
        _, new = cell(x_t, nested(list(tf.split(joined, [3, 3, 2], 1))))
        return tf.concat(list(keras.tree.flatten(new)), 1)

    states = [tf.zeros((x.shape[0], n)) for n in (3, 3, 2)]
    jacobians = []
    for t in range(x.shape[1]):
        joined = tf.concat(states, 1)
        jacobians.append(rows_by_copies(
            tf, joined, 8, lambda copies, t=t: step(copied(tf, x[:, t], 8), copies)))
        states = list(tf.split(step(tf.constant(x[:, t]), joined), [3, 3, 2], 1))
    assert entry.state_size == 8 and entry.gates is None
    np.testing.assert_allclose(entry.lyapunov, _qr_exponents(jacobians), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("doubled", [True, False])
def test_a_cell_whose_output_is_not_its_state_reads_no_growth(tf: Any, doubled: bool) -> None:
    """Found tried as a new user would: a cell of the user's returning (2·h, [h]) in an RNN
    that returns its sequence read "∂L/∂s_t grows going back on 42.5% of pairs" where every
    step Jacobian's norm was below 1: the gradient from above enters each step through the
    cell, onto the state the next step reads, and counted as growth. Not read there (with
    why); the same cell returning (h, [h]), its output its state, is read as a Keras
    cell's is, and grows nowhere."""
    import keras

    class Cell(keras.layers.Layer):
        state_size = output_size = 4

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], 4))
            self.recurrent = self.add_weight(shape=(4, 4), initializer="orthogonal")

        def call(self, x: Any, states: Any) -> Any:
            h = keras.ops.tanh(x @ self.kernel + states[0] @ (0.9 * self.recurrent))
            return (2.0 * h if doubled else h), [h]

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((12, 3)),
                              keras.layers.RNN(Cell(), return_sequences=True, name="own"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 12, 3)).astype("float32")
    y = rng.standard_normal((8, 12, 1)).astype("float32")
    report = gradscope.diagnose(model, x=x, y=y, counterfactuals=False)
    (entry,) = report.layers
    assert entry.jacobian_norm.max < 1  # nothing carried back can grow
    said = [w for w in report.warnings if w.startswith("own: its cell's output is not")]
    if doubled:
        assert entry.exploding is None and entry.flow is not None
        assert entry.flow.ratio is None and said
    else:
        assert entry.exploding is not None and entry.exploding.growing_share == 0
        assert entry.flow is not None and entry.flow.ratio is not None and not said


def test_a_floored_lambda_1_is_not_read_as_a_rate_by_the_verdict(tf: Any) -> None:
    """Found tried as a new user would: a relu SimpleRNN's exponents were all marked "not
    rates" (units switched off), yet its verdict read λ₁ as a rate and predicted a horizon
    from it, without a word."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((T, F)),
                              keras.layers.SimpleRNN(6, activation="relu", name="rnn"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    x, _ = _batch()
    y = np.random.default_rng(1).standard_normal((x.shape[0], 1)).astype("float32")
    # Units switched off by the relu at some steps: here every unit at every other step.
    cell = model.get_layer("rnn").cell
    cell.recurrent_kernel.assign(0.9 * np.eye(6, dtype="float32"))
    x = x.copy()
    x[:, 1::2] = -10.0  # every other step drives every unit below 0
    entry = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
    assert 0 in entry.lyapunov_floored
    assert "but λ₁ here counts steps that took its direction to 0" in entry.verdict


def test_a_long_calls_step_norms_are_read_at_128_steps_and_the_text_says_so(tf: Any) -> None:
    """A call of more than 128 steps has ‖J_t‖₂ read at 128 of them, evenly spaced, first and
    last included; the text said "> 1 on …% of steps" as if every step were read. The linear
    recurrence's J_t is W at every step, so each norm read is ‖W‖₂ = ρ."""
    steps = 200
    x, y = _batch(steps=steps)
    report = gradscope.diagnose(_linear_model(_orthogonal(6, 0.9), steps=steps), x=x, y=y,
                                exponents=2, counterfactuals=False)
    norms = report.layers[0].jacobian_norm
    assert norms.steps_read == 128
    read = [t for t, value in enumerate(norms.steps_max) if value is not None]
    assert read == sorted(set(np.linspace(0, steps - 1, 128).round().astype(int).tolist()))
    np.testing.assert_allclose([norms.steps_max[t] for t in read], 0.9, rtol=1e-5)
    assert "(read at 128 of the 200, evenly spaced)" in " ".join(render_text(report, 80).split())
    short = gradscope.diagnose(_linear_model(_orthogonal(6, 0.9), steps=20), x=x[:, :20],
                               y=y[:, :20], exponents=2, counterfactuals=False)
    assert short.layers[0].jacobian_norm.steps_read is None
    assert "read at" not in render_text(short, 80)


def test_the_horizon_of_a_padded_batch_is_measured_back_as_far_as_its_longest_example(
        tf: Any) -> None:
    """Found tried as a new user would: of 16 padded sequences only one ran every step, and
    the evenly spaced examples the horizon is measured on left it out, so "every lag there
    is" was said of one lag fewer than it has. The longest example is measured, in place of
    the nearest, and its longest lag is read (the ratios themselves are held to a tape over
    a padded batch above)."""
    steps, batch = 20, 16
    model = _token_lstm(steps, seed=5)
    rng = np.random.default_rng(1)
    x = np.zeros((batch, steps), "int32")
    for row in range(batch):
        length = steps if row == 14 else 15
        x[row, :length] = rng.integers(1, 20, size=length)
    y = rng.standard_normal((batch, 1)).astype("float32")
    entry = gradscope.diagnose(model, x=x, y=y, counterfactuals=False).layers[0]
    assert 14 in entry.horizon.examples and 13 not in entry.horizon.examples
    assert len(entry.horizon.examples) == 8
    assert entry.horizon.longest_lag == steps - 1 and max(entry.horizon.steps) == steps - 1
    assert entry.horizon.measured is not None or entry.horizon.window == steps - 1
    assert entry.horizon.ratios[-1] is not None


def test_an_orthogonal_recurrence_does_not_grow_by_rounding(tf: Any) -> None:
    """Found tried as a new user would: a linear recurrence with an orthogonal kernel (every
    exponent 0) read "∂L/∂s_t grows going back on 88.4% of pairs", from gains of 1.0000005 to
    1.000001 in float32: rounding of the carried part, a difference. A gain within 32
    roundoffs of 1 is no growth; at ρ = 1.05 every pair still grows."""
    x, y = _batch(steps=40)
    flat = gradscope.diagnose(_linear_model(_orthogonal(6, 1.0), steps=40), x=x, y=y,
                              exponents=3, counterfactuals=False).layers[0]
    assert flat.exploding is not None
    assert flat.exploding.growing_share == 0.0 and flat.exploding.examples == []
    assert flat.exploding.growing_steps == []
    grows = gradscope.diagnose(_linear_model(_orthogonal(6, 1.05), steps=40), x=x, y=y,
                               exponents=3, counterfactuals=False).layers[0]
    assert grows.exploding is not None and grows.exploding.growing_share == 1.0
    assert len(grows.exploding.examples) == B


def test_an_unsettled_largest_exponent_is_said_so_from_its_second_half(tf: Any) -> None:
    """Found tried as a new user would: over 30 steps λ₁ read −0.217, its second half alone
    −0.158, other starts −0.179 to −0.199, while "moved" said 0.021. The second half's λ₁ is
    reported, and a warning says where it differs from λ₁ by more than a tenth. W = diag(0.9,
    0.3, …): one random column's stretch reaches 0.9 only once the 0.3 directions decay, so
    over 8 steps the start weighs; the second half's λ₁ is held to the same Benettin
    recursion on W in float64. A fit's diagnosis notes the same (GradientFlow, read so in a
    custom loop)."""
    from gradscope.keras import GradientFlow
    from gradscope.keras.diagnose.trajectory import drawn_start

    w = np.diag([0.9, 0.3, 0.3, 0.3, 0.3, 0.3])
    for steps, said in ((8, True), (200, False)):
        x, y = _batch(steps=steps)
        report = gradscope.diagnose(_linear_model(w, steps=steps), x=x, y=y, exponents=1,
                                    counterfactuals=False)
        entry = report.layers[0]
        q = drawn_start(6, 1)[:, 0]
        logs = []
        for _ in range(steps):
            moved = w @ q
            logs.append(np.log(np.linalg.norm(moved)))
            q = moved / np.linalg.norm(moved)
        assert entry.lyapunov[0] == pytest.approx(np.mean(logs), rel=1e-5)
        assert entry.lyapunov_1_later_half == pytest.approx(np.mean(logs[steps // 2:]),
                                                            rel=1e-5)
        warned = [line for line in report.warnings if "λ₁ has not settled" in line]
        assert bool(warned) == said, report.warnings
        # A fit's diagnosis of the same call notes it too, with the second half's λ₁.
        flow = GradientFlow(model=_linear_model(w, steps=steps), diagnose_every=1)
        flow.observe(x, y)
        (note,) = flow.history.diagnoses[0].lyapunov_note
        assert note == (f"λ₁ has not settled over these {steps} steps: the second half reads "
                        f"{entry.lyapunov_1_later_half:+.3g}" if said else None)
    assert warned == [] and entry.lyapunov_1_later_half == pytest.approx(np.log(0.9), rel=1e-4)


def test_an_unsettled_second_half_on_the_other_side_of_exploding_is_said_so(tf: Any) -> None:
    """W = diag(1.05, 0.3, …) over 8 steps: λ₁ from all of them is below 0.01 (a random
    start's first steps shrink with the 0.3 directions), its second half near ln 1.05 above
    it. The warning says what the second half alone would read, as the verdict reads all."""
    w = np.diag([1.05, 0.3, 0.3, 0.3, 0.3, 0.3])
    x, y = _batch(steps=8)
    report = gradscope.diagnose(_linear_model(w, steps=8), x=x, y=y, exponents=1,
                                counterfactuals=False)
    entry = report.layers[0]
    assert entry.lyapunov[0] <= 0.01 < entry.lyapunov_1_later_half
    assert entry.verdict.startswith("linear: holds")
    (warned,) = [line for line in report.warnings if "λ₁ has not settled" in line]
    assert warned.endswith("; read alone, the second half would be exploding (λ₁ above "
                           "0.01), where the verdict reads all of them")
