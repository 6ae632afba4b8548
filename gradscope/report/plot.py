"""``explain --plot FILE.png``: gradient-norm curves and the heatmap of ‖∂h_t/∂x_s‖.

matplotlib is optional: the ``plot`` extra of the gradscope-rnn distribution (``make install``
in the clone installs it), or ``pip install matplotlib`` into gradscope's environment."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from gradscope.errors import GradscopeError
from gradscope.report.models import ExplainReport


def matplotlib_install_line() -> str:
    """The command that installs matplotlib where this gradscope runs.

    It names the running interpreter, so it works whether or not the user's ``pip`` on the
    PATH belongs to the same environment (``.venv/bin/gradscope`` run without activating
    ``.venv``, say). Inside the current directory the path is relative: ``.venv/bin/python``.
    """
    python = Path(sys.executable)
    try:
        shown = os.path.relpath(python) if python.is_relative_to(Path.cwd()) else str(python)
    except (OSError, ValueError):
        shown = str(python)
    return f"{shlex.quote(shown)} -m pip install matplotlib"


def require_matplotlib() -> Any:
    """matplotlib's pyplot on the Agg backend, or the one-line exit-2 error naming the fix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GradscopeError("--plot needs matplotlib, which is not installed; install it with: "
                             + matplotlib_install_line(), where="--plot") from None
    return plt


def write_flow_plot(report: ExplainReport, path: Path, force: bool = False) -> None:
    flow = report.gradient_flow
    if flow is None or flow.influence_map is None:
        raise GradscopeError("--plot needs the gradient flow: run explain with --flow",
                             where="--plot")
    if path.exists() and not force:
        raise GradscopeError(f"{path}: already exists; gradscope does not overwrite files "
                             "(use --force)", where=str(path))
    plt = require_matplotlib()
    figure, (curves, heat) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = np.arange(flow.steps)
    for name, norms in flow.state_gradient_norms.items():
        curves.semilogy(steps, norms, label=f"‖∂L/∂{name}_t‖")
    curves.semilogy(steps, flow.input_gradient_norms, label="‖∂L/∂x_t‖", linestyle="--")
    curves.semilogy(steps, np.maximum(flow.influence, 1e-300), linestyle=":",
                    label=f"‖∂{flow.influence_layer}/h_{flow.influence_step}/∂x_s‖ (s)")
    curves.set_xlabel("time step")
    curves.set_title("gradient norms over time")
    curves.legend(fontsize=8)
    values = np.asarray(flow.influence_map.values)
    # s > t cannot influence h_t: those cells are exactly zero and left blank.
    logs = np.where(values > 0, np.log10(np.where(values > 0, values, 1.0)), np.nan)
    image = heat.imshow(logs, aspect="auto", origin="lower",
                        extent=(-0.5, flow.steps - 0.5, 0, len(flow.influence_map.steps)),
                        cmap="viridis")
    heat.set_yticks(np.arange(len(flow.influence_map.steps)) + 0.5,
                    [str(t) for t in flow.influence_map.steps], fontsize=7)
    heat.set_xlabel("input step s")
    heat.set_ylabel(f"state step t ({flow.influence_layer})")
    heat.set_title("log10 ‖∂h_t/∂x_s‖ (median over the batch)")
    figure.colorbar(image, ax=heat)
    figure.suptitle(report.model.chain)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise GradscopeError(f"{path}: cannot write: {exc.strerror or exc}",
                             where=str(path)) from None
    finally:
        plt.close(figure)
