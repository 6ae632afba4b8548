"""Shared helpers: the repository root and a way to run the real CLI in a subprocess."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_configs"


def run_gradscope(*args: str, env: dict[str, str] | None = None,
                  timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gradscope ARGS`` as a user would, without a TTY."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    full_env.pop("COLUMNS", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gradscope", *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


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
