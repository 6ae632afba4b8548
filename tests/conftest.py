"""Shared helpers: the repository root and a way to run the real CLI in a subprocess."""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Several pytest-xdist workers share the machine's cores: each TensorFlow runs its ops on one
# thread, not on every core at once (on 2 cores and 2 workers, four modules of the suite took
# 119 s instead of 133 s). Set before any test imports TensorFlow; the CLI's subprocesses
# inherit it.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_configs"


def run_gradscope(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
                  process: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the CLI on ARGS as a user would, without a TTY: in this process (:func:`run_cli`),
    or with ``process`` as ``python -m gradscope ARGS`` in a new one, for what only a process
    shows (TensorFlow's C++ log lines, output that must not depend on what ran before)."""
    if not process:
        return run_cli(*args, cwd=REPO, env=env)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    full_env.pop("COLUMNS", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gradscope", *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """Run the CLI's ``main(ARGS)`` in this process, as :func:`run_gradscope` runs it in a
    new one (stdin empty, no TTY, COLUMNS unset unless ``env`` sets it, in ``cwd``), without
    paying a new process its TensorFlow import (about 3 s of CPU). Its exit code, stdout and
    stderr. What the run imported from outside the environment (the user's modules, by
    ``--import``), and the classes it registered with Keras, are forgotten after it, as a
    process would forget them. Not for what only a process shows: TensorFlow's C++ log lines
    (written to the file descriptor, not ``sys.stderr``), what a fresh process imports, or
    output that must not depend on what ran before in the process."""
    import warnings

    from keras.src.saving import object_registration

    from gradscope.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_path, saved_modules = dict(os.environ), list(sys.path), set(sys.modules)
    registries = [(table, dict(table)) for table in (
        object_registration.GLOBAL_CUSTOM_OBJECTS, object_registration.GLOBAL_CUSTOM_NAMES)]
    saved = sys.stdin, sys.stdout, sys.stderr
    here = Path.cwd()
    code: Any = 0
    try:
        os.environ.pop("COLUMNS", None)
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(""), out, err
        with warnings.catch_warnings():
            main(list(args))
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        kept = (sys.prefix, sys.base_prefix, str(REPO / "gradscope"))
        for name in set(sys.modules) - saved_modules:
            where = getattr(sys.modules[name], "__file__", None)
            if where and not str(where).startswith(kept):  # the user's, by --import
                del sys.modules[name]
        for table, before in registries:
            table.clear()
            table.update(before)
    return subprocess.CompletedProcess(["gradscope", *args], int(code or 0),
                                       out.getvalue(), err.getvalue())


#: Runs the CLI exactly as ``python -m gradscope`` does, then fails (exit 99) if TensorFlow,
#: Keras or matplotlib got imported.
TF_GUARD_DRIVER = """
import sys
from gradscope.cli import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "matplotlib"))
if heavy:
    sys.stderr.write("imported: " + ", ".join(heavy[:3]) + "\\n")
    sys.exit(99)
sys.exit(code)
"""


def run_without_tensorflow(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI as ``python -m gradscope ARGS`` does; exit 99 if TF/Keras got imported."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    full_env.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-c", TF_GUARD_DRIVER, *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


#: Python's collector, tuned for a process that builds thousands of TensorFlow graphs: a young
#: collection after 50,000 new objects, not 700, and the old generation, which holds every
#: graph and module of the session, collected in full only where a test module ends (below).
#: With the default thresholds a worker scanned its whole heap every few seconds, 7% of its
#: time on three Keras test modules; what a test asserts does not depend on when its garbage
#: goes.
GC_THRESHOLDS = (50_000, 20, 1_000)


def pytest_configure(config: pytest.Config) -> None:
    gc.set_threshold(*GC_THRESHOLDS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Where a test module ends (its fixtures torn down, its last test's values let go), its
    garbage is collected, and what is left, alive for the session (modules, TensorFlow's
    caches, session fixtures), is moved out of the collector's sight, so that the next
    module's collections scan only what that module makes."""
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def tf():
    from gradscope._tf import import_tensorflow

    return import_tensorflow()


def render_text(report: Any, width: int, equations: str | None = None) -> str:
    """The text the CLI prints for ``report`` on a console ``width`` columns wide, without
    colour (as with NO_COLOR=1 and stdout not a terminal); ``equations``: as ``check
    --equations`` draws them (on a copy: the report stays as it is)."""
    from rich.console import Console

    from gradscope.report.render import print_report

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, no_color=True,
                      highlight=False, force_terminal=False)
    if equations is not None:
        report = report.model_copy()
        report.show_equations(equations)
    print_report(console, report)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def seed_reports(tf):
    """The seed model's reports, computed once in this process: explain with the flow, the
    Jacobians and the carry in 2 chunks (strip them with model_copy for plain explain), and
    check."""
    from gradscope.yaml.check import check
    from gradscope.yaml.config import load_spec
    from gradscope.yaml.explain import explain

    spec = load_spec(None)
    return {"explain": explain(spec, flow=True, jacobians=True, chunks=2),
            "check": check(spec)}


def keras_tape(model: Any, x: Any, y: Any, sample_weight: Any = None
               ) -> tuple[float, dict[str, Any]]:
    """The truth of the Keras tests: Keras' own loss and gradients, as ``fit`` computes them
    (``model(x)`` then ``compute_loss``, under a ``GradientTape``), by variable path."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        prediction = model(x, training=False)
        loss = model.compute_loss(x=x, y=y, y_pred=prediction, sample_weight=sample_weight,
                                  training=False)
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), {v.path: tf.convert_to_tensor(g).numpy()
                         for v, g in zip(model.trainable_variables, grads, strict=True)}


def keras_tape_norms(model: Any, x: Any, y: Any, sample_weight: Any = None
                     ) -> tuple[float, dict[str, float]]:
    """:func:`keras_tape`, with each gradient's L2 norm."""
    import numpy as np

    loss, gradients = keras_tape(model, x, y, sample_weight)
    return loss, {path: float(np.linalg.norm(g)) for path, g in gradients.items()}


def assert_keras_numbers(report: Any, loss: float, truth: dict[str, float],
                         rtol: float = 1e-5) -> None:
    """An explain report holds Keras' own numbers: the loss, and each weight gradient's L2
    norm by path (``truth``, from :func:`keras_tape_norms`; weights without one are left
    out of both)."""
    import pytest

    assert report.loss.value == pytest.approx(loss, rel=rtol)
    ours = {g.path: g.stats.l2 for g in report.gradients if g.stats is not None}
    assert sorted(ours) == sorted(truth)
    for path, norm in truth.items():
        assert ours[path] == pytest.approx(norm, rel=rtol), path


def assert_jacobian_summary(entry: Any, truth: np.ndarray, rtol: float,
                            smallest_atol: float) -> None:
    """A report's Jacobian entry summarises ``truth`` (B, S, S): its shape, the median, least
    and largest Frobenius norm and median σ_max to ``rtol``; the median σ_min to ``rtol``
    or ``smallest_atol`` × the median σ_max (rounding swamps a tiny σ_min)."""
    frobenius = np.sqrt(np.sum(truth ** 2, axis=(1, 2)))
    singular = np.linalg.svd(truth, compute_uv=False)
    assert entry.shape == list(truth.shape[1:])
    np.testing.assert_allclose([entry.frobenius_median, entry.frobenius_min,
                                entry.frobenius_max, entry.largest_singular_median],
                               [np.median(frobenius), frobenius.min(), frobenius.max(),
                                np.median(singular[:, 0])], rtol=rtol)
    np.testing.assert_allclose(entry.smallest_singular_median, np.median(singular[:, -1]),
                               rtol=1e-4, atol=smallest_atol * float(np.median(singular[:, 0])))


def rows_by_copies(tf: Any, x: Any, size: int, f: Any) -> np.ndarray:
    """∂f(x)[b, i]/∂x[b] (B, ``size``, *x's rest) for every example b and output i of ``f``,
    by one tape and one backward pass: every example copied ``size`` times in a row, copy i's
    output i summed. The examples of a Keras cell's or layer's call are independent, so copy
    i's gradient is row i of its example's Jacobian, the rows a ``batch_jacobian`` of the
    same call gives (a backward pass each, and a pfor traced each call). ``f`` takes the
    copies (B·size, ...) and returns (B·size, size); what else it reads per example (a mask,
    an initial state, dropout masks) it copies by :func:`copied`."""
    batch = int(x.shape[0])
    copies = copied(tf, x, size)
    with tf.GradientTape() as tape:
        tape.watch(copies)
        out = tf.reshape(f(copies), [batch, size, size])
        picked = tf.reduce_sum(tf.linalg.diag_part(out))
    rows = np.asarray(tape.gradient(picked, copies), np.float64)
    return rows.reshape(batch, size, *rows.shape[1:])


def copied(tf: Any, x: Any, size: int) -> Any:
    """Every example of ``x`` ``size`` times in a row (example b's copies at b·size...), as
    :func:`rows_by_copies` copies them."""
    return tf.repeat(tf.convert_to_tensor(x), size, axis=0)


def hold_copied_masks(tf: Any, cell: Any, masks: Any, size: int) -> None:
    """``cell`` holds ``masks`` (its dropout and recurrent dropout masks, as Keras' cell
    draws them: a tensor, or a list of one per gate), each example's rows copied ``size``
    times, as :func:`copied` copies the examples they go with."""
    cell._dropout_mask, cell._recurrent_dropout_mask = (
        [copied(tf, m, size) for m in held] if isinstance(held, (list, tuple))
        else copied(tf, held, size) for held in masks)


def mixed_lstm(scale: float, steps: int, features: int, units: int,
               learning_rate: float = 0.01) -> Any:
    """A mixed_float16 LSTM → Dense(2), compiled with mse and a LossScaleOptimizer(SGD) at
    ``scale`` (the mixed-precision tests' model)."""
    import keras

    keras.utils.set_random_seed(7)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((steps, features)),
                                  keras.layers.LSTM(units, return_sequences=True),
                                  keras.layers.Dense(2)])
    finally:
        keras.config.set_dtype_policy(previous)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate), initial_scale=scale), loss="mse")
    return model


def mixed_lstm_batch(batch: int, steps: int, features: int, seed: int = 0,
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Small inputs and targets near 0 for :func:`mixed_lstm`: gradients from 1e-12 up, some
    lost in float16."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(batch, steps, features)).astype("float32") * 1e-2,
            rng.normal(size=(batch, steps, 2)).astype("float32") * 1e-3)


def lstm_float32_shadow(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The float32 step of a :func:`mixed_lstm` by hand: the same weights in float32 layers,
    the LSTM cell unrolled in Python, and the tape's gradients on the weights and on each h_t
    and c_t (by the paths and labels gradscope's mixed_precision section uses)."""
    import keras
    import tensorflow as tf

    lstm, dense = model.layers
    batch, steps, features = x.shape
    units = lstm.units
    cell = keras.layers.LSTMCell(units, dtype="float32")
    head = keras.layers.Dense(2, dtype="float32")
    cell.build((None, features))
    head.build((None, units))
    cell.set_weights(lstm.cell.get_weights())
    head.set_weights(dense.get_weights())
    h = c = tf.zeros((batch, units))
    with tf.GradientTape() as tape:
        hs, cs = [], []
        for t in range(steps):
            h, (h, c) = cell(tf.constant(x[:, t]), [h, c])
            # The c that step t+1 receives: its gradient is what the backward carries back
            # through time (the path c_t → h_t inside step t is not in it).
            c = tf.identity(c)
            hs.append(h)
            cs.append(c)
        loss = keras.losses.MeanSquaredError()(y, head(tf.stack(hs, axis=1)))
    variables = [*cell.trainable_variables, *head.trainable_variables]
    gradients = tape.gradient(loss, [variables, hs, cs])
    paths = [v.path for v in [*lstm.cell.trainable_variables, *dense.trainable_variables]]
    found = {path: g.numpy() for path, g in zip(paths, gradients[0], strict=True)}
    found[f"{lstm.name}/h_t"] = np.stack([g.numpy() for g in gradients[1]], axis=1)
    # The last c goes nowhere: no gradient (0).
    found[f"{lstm.name}/c_t"] = np.stack([np.zeros((batch, units), np.float32) if g is None
                                          else g.numpy() for g in gradients[2]], axis=1)
    return found


def tuple_state_cell(units: int = 3, structure: type = tuple) -> Any:
    """A cell of the user's with two states (h, c), whose output is its first state;
    ``structure`` (tuple or list) holds its state sizes and the states it returns."""
    import keras
    from keras import layers as L

    class TwoStateCell(L.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.units = units
            self.state_size = structure((units, units))

        def build(self, shape: Any) -> None:
            self.kernel = self.add_weight(shape=(shape[-1], self.units), name="kernel")
            self.recurrent = self.add_weight(shape=(self.units, self.units), name="recurrent")

        def call(self, inputs: Any, states: Any) -> Any:
            h, c = states
            c_new = 0.5 * c + keras.ops.tanh(inputs @ self.kernel + h @ self.recurrent)
            h_new = keras.ops.tanh(c_new)
            return h_new, structure((h_new, c_new))

    return TwoStateCell(units)


def tensorboard_events(tf: Any, log_dir: Path) -> tuple[dict[str, dict[int, Any]], dict[str, str]]:
    """tag → step → value from tf.compat.v1.train.summary_iterator, and tag → plugin name."""
    values: dict[str, dict[int, Any]] = {}
    plugins: dict[str, str] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                plugins.setdefault(value.tag, value.metadata.plugin_data.plugin_name)
                array = tf.make_ndarray(value.tensor) if value.HasField("tensor") else \
                    np.asarray(value.simple_value)
                if array.dtype.kind == "f" and array.ndim == 0:
                    values.setdefault(value.tag, {})[event.step] = float(array)
                else:
                    values.setdefault(value.tag, {})[event.step] = array
    return values, plugins
