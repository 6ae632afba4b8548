"""``explain --plot FILE.png``: gradient-norm curves and the heatmap of ‖∂h_t/∂x_s‖; and
``report.plot()``: a matplotlib Figure of whatever a report holds (norm curves over time, the
influence heatmap, the Jacobian spectrum, the weights' ‖g‖, check's errors against their
tolerances), which a notebook shows inline.

matplotlib is optional: the ``plot`` extra of the gradscope-rnn distribution (``make install``
in the clone installs it), or ``pip install matplotlib`` into gradscope's environment."""

from __future__ import annotations

import io
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gradscope.errors import GradscopeError
from gradscope.report.models import (
    DRAWERS,
    ExplainReport,
    FlowSection,
    InfluenceMap,
    JacobianEntry,
    KerasExplainReport,
    KerasFlowSection,
)


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


def require_matplotlib(what: str = "--plot") -> Any:
    """matplotlib's pyplot on the Agg backend, or the one-line exit-2 error naming the fix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _missing(what) from None
    return plt


def _missing(what: str) -> GradscopeError:
    return GradscopeError(f"{what} needs matplotlib, which is not installed; install it with: "
                          + matplotlib_install_line(), where=what)


def write_flow_plot(report: ExplainReport | KerasExplainReport, path: Path,
                    force: bool = False) -> None:
    """``--plot FILE``: the norm curves and the heatmap of ‖∂h_t/∂x_s‖ over (t, s) (of a
    Keras model: of its first recurrent call)."""
    flow = report.gradient_flow
    mapped = (next((i for i in flow.influence if i.influence_map is not None), None)
              if isinstance(flow, KerasFlowSection) else None)
    if flow is None or (flow.influence_map is None if isinstance(flow, FlowSection)
                        else mapped is None):
        raise GradscopeError("--plot needs the gradient flow: run explain with --flow",
                             where="--plot")
    if path.exists() and not force:
        raise GradscopeError(f"{path}: already exists; gradscope does not overwrite files "
                             "(use --force)", where=str(path))
    plt = require_matplotlib()
    figure, (curves, heat) = plt.subplots(1, 2, figsize=(12, 4.5))
    if isinstance(flow, KerasFlowSection):
        assert mapped is not None and mapped.influence_map is not None
        _keras_flow_curves(curves, flow)
        _heatmap(figure, heat, mapped.influence_map, len(mapped.influence), mapped.source)
    else:
        assert flow.influence_map is not None
        _flow_curves(curves, flow)
        _heatmap(figure, heat, flow.influence_map, flow.steps, flow.influence_layer)
    title = (report.model.chain if isinstance(report, ExplainReport)
             else f"{report.model.name}: {mapped.source if mapped else ''}")
    figure.suptitle(title)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise GradscopeError(f"{path}: cannot write: {exc.strerror or exc}",
                             where=str(path)) from None
    finally:
        plt.close(figure)


def _positive(values: Any) -> np.ndarray:
    """Norms for a log axis: an exact zero (an influence past its step t, a gradient that
    never arrives) is left out of the curve rather than drawn at 1e-300, which would
    stretch the axis over 300 decades and flatten every real curve."""
    array = np.asarray(values, dtype=float)
    return np.where(array > 0, array, np.nan)


def _flow_curves(axes: Any, flow: FlowSection) -> None:
    steps = np.arange(flow.steps)
    for name, norms in flow.state_gradient_norms.items():
        axes.semilogy(steps, _positive(norms), label=f"‖∂L/∂{name}_t‖")
    axes.semilogy(steps, _positive(flow.input_gradient_norms), label="‖∂L/∂x_t‖",
                  linestyle="--")
    axes.semilogy(steps, _positive(flow.influence), linestyle=":",
                  label=f"‖∂{flow.influence_layer}/h_{flow.influence_step}/∂x_s‖ (s)")
    axes.set_xlabel("time step")
    axes.set_title("gradient norms over time")
    axes.legend(fontsize=8)


def _heatmap(figure: Any, axes: Any, found: InfluenceMap, steps: int, layer: str) -> None:
    values = np.asarray(found.values)
    # s > t cannot influence h_t: those cells are exactly zero and left blank.
    logs = np.where(values > 0, np.log10(np.where(values > 0, values, 1.0)), np.nan)
    image = axes.imshow(logs, aspect="auto", origin="lower",
                        extent=(-0.5, steps - 0.5, 0, len(found.steps)), cmap="viridis")
    axes.set_yticks(np.arange(len(found.steps)) + 0.5, [str(t) for t in found.steps],
                    fontsize=7)
    axes.set_xlabel("input step s")
    axes.set_ylabel(f"state step t ({layer})")
    axes.set_title("log10 ‖∂h_t/∂x_s‖ (median over the batch)")
    figure.colorbar(image, ax=axes)


# -- report.plot(): a Figure for a notebook ------------------------------------------------------

Panel = Callable[[Any, Any], None]


def report_figure(report: Any) -> Any:
    """A matplotlib Figure of what ``report`` holds, one panel per kind of number.

    The Figure is built without pyplot (no backend is switched, no global figure is left
    open): a notebook shows it inline through its ``_repr_png_``, ``figure.savefig`` writes it.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise _missing("report.plot()") from None

    class ReportFigure(Figure):
        """A Figure that draws itself as PNG in IPython/Jupyter."""

        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
            return buffer.getvalue()

    panels = _panels(report)
    if not panels:
        raise GradscopeError(f"report.plot(): a {report.command} report holds no numbers to "
                             "plot (explain and check reports do)", where="plot")
    figure = ReportFigure(figsize=(6 * len(panels), 4.5))
    for index, draw in enumerate(panels, start=1):
        draw(figure, figure.add_subplot(1, len(panels), index))
    figure.suptitle(_title(report))
    figure.tight_layout()
    return figure


def _title(report: Any) -> str:
    model = report.model
    chain = getattr(model, "chain", None)
    return chain if chain else f"{model.kind} '{model.name}'"


def _panels(report: Any) -> list[Panel]:
    from gradscope.report.models import (
        CheckReport,
        ExplainReport,
        KerasCheckReport,
        KerasExplainReport,
    )

    panels: list[Panel] = []
    if isinstance(report, ExplainReport):
        flow = report.gradient_flow
        if flow is not None:
            panels.append(lambda figure, axes: _flow_curves(axes, flow))
            found = flow.influence_map
            if found is not None:
                panels.append(lambda figure, axes: _heatmap(
                    figure, axes, found, flow.steps, flow.influence_layer))
        if report.state_jacobians:
            entries = report.state_jacobians
            panels.append(lambda figure, axes: _spectrum(axes, entries))
        if not panels:
            norms = {g.name: g.stats.l2 for g in report.gradients}
            panels.append(lambda figure, axes: _weight_norms(axes, norms))
    elif isinstance(report, KerasExplainReport):
        norms = {g.name: g.stats.l2 for g in report.gradients if g.stats is not None}
        panels.append(lambda figure, axes: _weight_norms(axes, norms))
        keras_flow = report.gradient_flow
        if keras_flow is not None and keras_flow.sequences:
            panels.append(lambda figure, axes: _keras_flow_curves(axes, keras_flow))
            mapped = [(i, i.influence_map) for i in keras_flow.influence
                      if i.influence_map is not None]
            if mapped:
                first, heat = mapped[0]
                panels.append(lambda figure, axes: _heatmap(
                    figure, axes, heat, len(first.influence), first.source))
        if report.state_jacobians is not None and report.state_jacobians.entries:
            jacobians = report.state_jacobians.entries
            panels.append(lambda figure, axes: _spectrum(axes, jacobians))
    elif isinstance(report, CheckReport | KerasCheckReport):
        panels.append(lambda figure, axes: _check_errors(axes, report))
    return panels


def _weight_norms(axes: Any, norms: dict[str, float]) -> None:
    names = list(norms)
    values = np.maximum(np.asarray([norms[n] for n in names], dtype=float), 1e-300)
    axes.barh(np.arange(len(names)), values, color="tab:blue")
    axes.set_yticks(np.arange(len(names)), names, fontsize=7)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("‖∂L/∂W‖ (Frobenius)")
    axes.set_title("gradient norm of every weight")


def _keras_flow_curves(axes: Any, flow: KerasFlowSection) -> None:
    for sequence in flow.sequences:
        norms = _positive(sequence.norms)
        style = "--" if sequence.kind == "input" else "-"
        label = f"‖{sequence.what}‖" + (" (processing order)" if sequence.backwards else "")
        axes.semilogy(np.arange(len(norms)), norms, linestyle=style, label=label)
    for k, flag in enumerate(flow.flags):
        axes.annotate(f"{flag.kind}: {flag.what} (ratio {flag.ratio:.1e})",
                      xy=(0.02, 0.03 + 0.06 * k), xycoords="axes fraction",
                      fontsize=7, color="tab:red")
    axes.set_xlabel("time step t")
    axes.set_title("gradient norms over time (‖∂L/∂h_t‖ with the recurrence)")
    axes.legend(fontsize=7)


def _spectrum(axes: Any, entries: list[JacobianEntry]) -> None:
    labels = [f"∂{e.target}/∂{e.source}" for e in entries]
    positions = np.arange(len(entries))
    largest = [max(e.largest_singular_median, 1e-300) for e in entries]
    smallest = [max(e.smallest_singular_median, 1e-300) for e in entries]
    axes.scatter(largest, positions, marker=">", color="tab:red", label="largest σ")
    axes.scatter(smallest, positions, marker="<", color="tab:blue", label="smallest σ")
    axes.hlines(positions, smallest, largest, color="grey", linewidth=1)
    axes.axvline(1.0, color="black", linewidth=0.5, linestyle=":")
    axes.set_yticks(positions, labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("singular value (median over the batch)")
    axes.set_title("Jacobian spectrum ∂h_T/∂h_0")
    axes.legend(fontsize=7)


def _check_errors(axes: Any, report: Any) -> None:
    rows = [(t.name, w) for t in report.tensors for w in t.witnesses if w.error is not None]
    positions = np.arange(len(rows))
    colours = ["tab:green" if w.passed else "tab:red" for _, w in rows]
    axes.scatter([max(w.error, 1e-18) for _, w in rows], positions, c=colours, s=12)
    axes.scatter([w.tolerance for _, w in rows], positions, marker="|", color="black", s=60,
                 label="tolerance")
    axes.set_yticks(positions, [f"{name} ({w.witness})" for name, w in rows], fontsize=6)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("relative error against TF autodiff")
    axes.set_title("check: every witness's error and its tolerance")
    axes.legend(fontsize=7)


DRAWERS["figure"] = report_figure
