"""gradscope/report/plot.py: ``--plot`` on a Keras model draws every recurrent call.

The report is a real one, of a Keras model with a Bidirectional and a GRU call; the figure
is matplotlib's own, read back by the titles of its panels.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradscope


@pytest.fixture(scope="module")
def report(tf):
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(5)
    x_in = keras.Input((5, 2), name="x")
    both = L.Bidirectional(L.GRU(2, return_sequences=True), name="both")(x_in)
    model = keras.Model(x_in, L.Dense(1)(L.GRU(2, name="last")(both)))
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    return gradscope.explain(model, x=rng.normal(size=(3, 5, 2)).astype(np.float32),
                             y=rng.normal(size=(3, 1)).astype(np.float32), heatmap=True)


def _titles(figure):
    return [axes.get_title() for axes in figure.axes]


def test_every_recurrent_call_and_direction_has_its_own_heatmap(report, tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    from gradscope.report.plot import flow_figure, write_flow_plot

    figure = flow_figure(plt, report)
    heatmaps = [t.split(":")[0] for t in _titles(figure) if "‖∂h_t/∂x_s‖" in t]
    assert heatmaps == ["both/forward", "both/backward", "last"]
    labels = [axes.get_ylabel() for axes in figure.axes if "‖∂h_t/∂x_s‖" in axes.get_title()]
    assert labels == ["state step t", "state step t (processing order)", "state step t"]
    plt.close(figure)
    # Whole steps only on the s axis (found tried as a new user would: 0.0, 2.5, 5.0, … over
    # 20 steps).
    from types import SimpleNamespace

    from gradscope.report.plot import _heatmap

    figure, axes = plt.subplots()
    found = SimpleNamespace(values=np.ones((4, 20)), steps=[0, 5, 10, 19])
    _heatmap(figure, axes, found, 20, "gru")
    figure.canvas.draw()
    low, high = axes.get_xlim()
    ticks = [t for t in axes.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close(figure)
    write_flow_plot(report, tmp_path / "flow.png")
    assert (tmp_path / "flow.png").read_bytes()[:4] == b"\x89PNG"
    # report.plot() (a notebook's figure) draws them all too.
    assert sum("‖∂h_t/∂x_s‖" in t for t in _titles(report.plot())) == 3


def test_calls_beyond_the_figure_are_named_in_it(report, tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    from gradscope.report.plot import PLOT_CALLS, flow_figure

    (first, *_) = report.gradient_flow.influence
    many = [first.model_copy(update={"source": f"call_{k}"}) for k in range(PLOT_CALLS + 2)]
    flow = report.gradient_flow.model_copy(update={"influence": many})
    figure = flow_figure(plt, report.model_copy(update={"gradient_flow": flow}))
    assert sum("‖∂h_t/∂x_s‖" in t for t in _titles(figure)) == PLOT_CALLS
    (note,) = [t.get_text() for t in figure.texts if "not drawn" in t.get_text()]
    assert note.startswith("2 more not drawn") and "call_6, call_7" in note
    figure.savefig(tmp_path / "many.png", dpi=60)
    plt.close(figure)


def test_a_model_without_a_recurrent_call_is_refused_with_why(tf, tmp_path):
    import keras

    from gradscope.errors import GradscopeError
    from gradscope.report.plot import write_flow_plot

    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Conv1D(2, 2),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(loss="mse")
    rng = np.random.default_rng(1)
    found = gradscope.explain(model, x=rng.normal(size=(2, 4, 3)), y=rng.normal(size=(2, 1)),
                              heatmap=True)
    with pytest.raises(GradscopeError, match="the model has no recurrent call, so there is "
                                             "no ‖∂h_t/∂x_s‖ to draw"):
        write_flow_plot(found, tmp_path / "flow.png")
