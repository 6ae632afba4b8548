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
    KerasInfluence,
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


Panel = Callable[[Any, Any], None]

#: Heatmaps of ‖∂h_t/∂x_s‖ one figure draws at most (one per recurrent call and direction);
#: the figure names those it leaves out.
PLOT_CALLS = 6


def write_flow_plot(report: ExplainReport | KerasExplainReport, path: Path,
                    force: bool = False) -> None:
    """``--plot FILE``: the norm curves and the heatmap of ‖∂h_t/∂x_s‖ over (t, s); of a
    Keras model, one heatmap per recurrent call (each direction of a Bidirectional)."""
    flow = report.gradient_flow
    if flow is None:
        raise GradscopeError("--plot needs the gradient flow: run explain with --flow",
                             where="--plot")
    if isinstance(flow, FlowSection) and flow.influence_map is None:
        raise GradscopeError("--plot needs the gradient flow: run explain with --flow",
                             where="--plot")
    if isinstance(flow, KerasFlowSection) and not _mapped(flow):
        why = ("no recurrent call of the model could be stepped (" + "; ".join(
            f"{entry.layer}: {entry.reason}" for entry in flow.not_analysed) + ")"
            if flow.not_analysed else "the model has no recurrent call")
        raise GradscopeError(f"--plot: {why}, so there is no ‖∂h_t/∂x_s‖ to draw",
                             where="--plot")
    if path.exists() and not force:
        raise GradscopeError(f"{path}: already exists; gradscope does not overwrite files "
                             "(use --force)", where=str(path))
    plt = require_matplotlib()
    figure = flow_figure(plt, report)
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise GradscopeError(f"{path}: cannot write: {exc.strerror or exc}",
                             where=str(path)) from None
    finally:
        plt.close(figure)


def flow_figure(plt: Any, report: ExplainReport | KerasExplainReport) -> Any:
    """The figure ``--plot`` writes: the norm curves, then the heatmap of each recurrent call
    (at most :data:`PLOT_CALLS`; the figure names the ones it leaves out).

    Args:
        plt: matplotlib's pyplot (:func:`require_matplotlib`).
        report: an explain report made with the gradient flow and its influence map.

    Returns:
        The pyplot Figure, for the caller to save and close.
    """
    flow = report.gradient_flow
    if not isinstance(flow, KerasFlowSection):
        assert isinstance(report, ExplainReport) and flow is not None
        assert flow.influence_map is not None
        figure, (curves, heat) = plt.subplots(1, 2, figsize=(12, 4.5))
        _flow_curves(curves, flow)
        _heatmap(figure, heat, flow.influence_map, flow.steps, flow.influence_layer)
        figure.suptitle(report.model.chain)
        figure.tight_layout()
        return figure
    assert isinstance(report, KerasExplainReport)
    mapped = _mapped(flow)
    shown, left = mapped[:PLOT_CALLS], mapped[PLOT_CALLS:]
    figure = plt.figure(figsize=(6 * min(len(shown) + 1, 3),
                                 4.5 * _grid(len(shown))[0]))
    for draw, axes in zip(_keras_panels(flow, shown), _grid_axes(figure, len(shown)),
                          strict=True):
        draw(figure, axes)
    figure.suptitle(f"{report.model.name}: gradient norms over time, and ‖∂h_t/∂x_s‖ of "
                    "each recurrent call" + (f" (the first {len(shown)} of {len(mapped)})"
                                             if left else ""))
    bottom = 0.0
    if left:
        names = ", ".join(i.source for i in left)
        figure.text(0.5, 0.01, f"{len(left)} more not drawn (at most {PLOT_CALLS}): {names}; "
                    "their ‖∂h_t/∂x_s‖ at t is in the report", ha="center", fontsize=9,
                    wrap=True)
        bottom = 0.04
    figure.tight_layout(rect=(0, bottom, 1, 1))
    return figure


def _mapped(flow: KerasFlowSection) -> list[KerasInfluence]:
    """The influences that hold a map (``--plot``), in the report's order of calls."""
    return [i for i in flow.influence if i.influence_map is not None]


def _grid(maps: int) -> tuple[int, int]:
    """Rows and columns of the Keras figure: curves and up to two maps side by side; else the
    curves across the first row, and the maps three to a row below."""
    if maps <= 2:
        return 1, maps + 1
    return 1 + -(-maps // 3), 3


def _grid_axes(figure: Any, maps: int) -> list[Any]:
    rows, columns = _grid(maps)
    grid = figure.add_gridspec(rows, columns)
    if maps <= 2:
        return [figure.add_subplot(grid[0, k]) for k in range(maps + 1)]
    return [figure.add_subplot(grid[0, :])] + [
        figure.add_subplot(grid[1 + k // 3, k % 3]) for k in range(maps)]


def _keras_panels(flow: KerasFlowSection, shown: list[KerasInfluence]) -> list[Panel]:
    """The curves, then one heatmap per call, its direction's processing order said."""
    backwards = {s.source for s in flow.sequences if s.kind == "state" and s.backwards}
    def heatmap(found: KerasInfluence) -> Panel:
        assert found.influence_map is not None
        heat = found.influence_map
        return lambda figure, axes: _heatmap(figure, axes, heat, len(found.influence),
                                             found.source, backwards=found.source in backwards)

    return [lambda figure, axes: _keras_flow_curves(axes, flow),
            *(heatmap(found) for found in shown)]


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
    axes.xaxis.set_major_locator(_integer_ticks())
    axes.set_title("gradient norms over time")
    axes.legend(fontsize=8)


def _integer_ticks() -> Any:
    """Ticks at whole time steps only."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _heatmap(figure: Any, axes: Any, found: InfluenceMap, steps: int, layer: str,
             backwards: bool = False) -> None:
    values = np.asarray(found.values)
    # s > t cannot influence h_t: those cells are exactly zero and left blank.
    logs = np.where(values > 0, np.log10(np.where(values > 0, values, 1.0)), np.nan)
    image = axes.imshow(logs, aspect="auto", origin="lower",
                        extent=(-0.5, steps - 0.5, 0, len(found.steps)), cmap="viridis")
    axes.set_yticks(np.arange(len(found.steps)) + 0.5, [str(t) for t in found.steps],
                    fontsize=7)
    axes.set_xlabel("input step s")
    axes.xaxis.set_major_locator(_integer_ticks())  # not 2.5 (found tried as a new user would)
    # A row per state step computed, drawn evenly: where they are fewer than the steps, the
    # label says so (found tried as a new user would: rows t = 0, 1, 3, 5, … read as every
    # step, unsaid).
    shown = (f"{len(found.steps)} of {steps} steps" if len(found.steps) < steps else "")
    order = "processing order" if backwards else ""
    notes = "; ".join(part for part in (shown, order) if part)
    axes.set_ylabel("state step t" + (f" ({notes})" if notes else ""))
    axes.set_title(f"{layer}: log10 ‖∂h_t/∂x_s‖ (median over the batch)", fontsize=10)
    figure.colorbar(image, ax=axes)


# -- report.plot(): a Figure for a notebook ------------------------------------------------------


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
    columns = min(len(panels), 3)
    rows = -(-len(panels) // columns)
    figure = ReportFigure(figsize=(6 * columns, 4.5 * rows))
    for index, draw in enumerate(panels, start=1):
        draw(figure, figure.add_subplot(rows, columns, index))
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
            panels += _keras_panels(keras_flow, _mapped(keras_flow)[:PLOT_CALLS])
        if report.state_jacobians is not None and report.state_jacobians.entries:
            jacobians = report.state_jacobians.entries
            panels.append(lambda figure, axes: _spectrum(axes, jacobians))
    elif isinstance(report, CheckReport | KerasCheckReport):
        panels.append(lambda figure, axes: _check_errors(axes, report))
    return panels


def _weight_norms(axes: Any, norms: dict[str, float | None]) -> None:
    names = list(norms)
    # No bar where a gradient has no finite value (its norm None).
    values = np.maximum(np.asarray([np.nan if norms[n] is None else norms[n] for n in names],
                                   dtype=float), 1e-300)
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
    axes.xaxis.set_major_locator(_integer_ticks())
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
