"""``check --against FILE.py:FUNC --layer NAME``: one recurrent layer's hand-written backward.

A course's ``rnn_backward(da, caches)`` covers one layer, given ∂L/∂h_t arriving from above;
checking it against the whole model would mean writing the dense and loss backward by hand
too. So FUNC gets ``(x, h0, params, dh)`` of the layer in the real model (with
``--time-last``, laid out as in the course, and a SimpleRNN's ``Wax``, ``Waa``, ``ba``) and
returns gradients. The truth is TF autodiff of the float64 model read at the layer, witnessed
by the NumPy reference's BPTT of the layer alone; a wrong array is named by the known mistake
it equals (:mod:`gradscope.yaml.check.variants`). The contract in full: docs/check.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope._tf import native_stderr_silenced
from gradscope.cells.base import Cell
from gradscope.errors import ConfigError
from gradscope.gradcheck import (
    WitnessResult,
    checked_tensors,
    relative_error,
    tolerance,
)
from gradscope.report.models import (
    CheckSummary,
    LayerArgument,
    LayerCheckReport,
    LossEntry,
)
from gradscope.timing import Clock, Progress
from gradscope.yaml.algebra import model_shapes
from gradscope.yaml.check import variants
from gradscope.yaml.check.user_backward import (
    WITNESS,
    _call_site,
    _exception_text,
    _hint,
    _label,
    compare,
    load_against,
)
from gradscope.yaml.config import Spec
from gradscope.yaml.data import Batch, initial_params, synthetic_batch
from gradscope.yaml.engine import Engine

#: The course's names of a SimpleRNN's weights (offered with --time-last).
COURSE_NAMES = ("Wax", "Waa", "ba")


@dataclass(frozen=True)
class LayerView:
    """How the user's function sees the layer: the array layout and the weight names.

    gradscope's own layout is batch-major, (B, T, ·) and (B, u); ``time_last`` is the course's
    (·, B, T) and (u, B). Every map is linear, so it applies to values and gradients alike.
    """

    cell: Cell
    time_last: bool

    @property
    def course(self) -> bool:
        return self.time_last and self.cell.kind == "simple_rnn"

    @property
    def states(self) -> tuple[str, ...]:
        return self.cell.state_names

    def sequence(self, value: np.ndarray) -> np.ndarray:
        """(B, T, n) → the user's layout."""
        return np.ascontiguousarray(np.transpose(value, (2, 0, 1))) if self.time_last else value

    def state(self, value: np.ndarray) -> np.ndarray:
        """(B, u) → the user's layout."""
        return np.ascontiguousarray(value.T) if self.time_last else value

    def expand(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """gradscope-layout tensors keyed short/``x``/``h0``/``c0`` → the user's keys and
        layout (with the course's names where they apply). Partial dicts give partial
        results."""
        out: dict[str, np.ndarray] = {}
        for info in self.cell.weights():
            if info.short in tensors:
                out[info.short] = tensors[info.short]
        if self.course:
            F = self.cell.input_size
            if self.cell.layout == "block" and "kernel" in tensors:
                out["Wax"] = tensors["kernel"][:F].T
                out["Waa"] = tensors["kernel"][F:].T
            elif "kernel" in tensors or "recurrent_kernel" in tensors:
                if "kernel" in tensors:
                    out["Wax"] = tensors["kernel"].T
                if "recurrent_kernel" in tensors:
                    out["Waa"] = tensors["recurrent_kernel"].T
            if "bias" in tensors:
                out["ba"] = tensors["bias"][:, None]
        if "x" in tensors:
            out["x"] = self.sequence(tensors["x"])
        for state in self.states:
            if state in tensors:
                out[state] = self.state(tensors[state])
        return out

    def shown(self, returned: dict[Any, Any]) -> list[str]:
        """The keys a report lists: the course's weight names if the user returned any of
        them, else gradscope's; then x and the states."""
        weights = ([*COURSE_NAMES] if self.course and any(n in returned for n in COURSE_NAMES)
                   else [info.short for info in self.cell.weights()])
        return [*weights, "x", *self.states]


@dataclass(frozen=True)
class LayerTruth:
    """What TF says about the layer in the real model, in gradscope's layout."""

    loss: float
    x: np.ndarray  # the layer's input sequence (B, T, F)
    dh: np.ndarray  # ∂L/∂h_t from above (B, T, u)
    gradients: dict[str, np.ndarray]  # short names, x, h0 (c0)


def find_layer(cells: tuple[Cell, ...], layer: str, spec: Spec) -> int:
    """The index of recurrent layer ``layer``; a ``ConfigError`` naming the valid ones."""
    from gradscope.yaml.options import check_layer_name

    check_layer_name(spec, layer)  # a GradscopeError, exit 2, listing the recurrent layers
    return next(i for i, cell in enumerate(cells) if cell.name == layer)


def layer_autodiff(engine: Engine, params: dict[str, np.ndarray], batch: Batch,
                   index: int) -> LayerTruth:
    """One forward/backward pass of the whole model, read at layer ``index``: the gradient
    with respect to its output sequence is dh (the scan's stacked output feeds only the
    layers above; the recurrence runs inside the scan), and with respect to its input
    sequence is the layer's d_x."""
    tf = engine.tf
    cell = engine.shapes.cells[index]
    below = engine.shapes.cells[index - 1].name if index else None

    def graph(weights: dict[str, Any], x: Any, y: Any, states: dict[str, Any]) -> Any:
        sequences: dict[str, Any] = {}
        with tf.GradientTape() as tape:
            tape.watch([weights, states, x])
            predictions, _ = engine.forward(weights, x, states, sequences=sequences)
            loss = engine.loss(predictions, y)
        layer_input = x if below is None else sequences[f"{below}/h"]
        output = sequences[f"{cell.name}/h"]
        own = {info.short: weights[info.name] for info in cell.weights()}
        own_states = {s: states[f"{cell.name}/{s}"] for s in cell.state_names}
        d_input, d_output, d_weights, d_states = tape.gradient(
            loss, [layer_input, output, own, own_states])
        if below is not None:  # time-major inside the model
            layer_input = tf.transpose(layer_input, [1, 0, 2])
            d_input = tf.transpose(d_input, [1, 0, 2])
        return (loss, layer_input, tf.transpose(d_output, [1, 0, 2]),
                {**d_weights, **d_states, "x": d_input})

    function = tf.function(graph, autograph=False)
    dtype = engine.dtype
    states = {f"{c.name}/{s}": batch.initial_states.get(f"{c.name}/{s}",
                                                       np.zeros((batch.x.shape[0], c.units)))
              for c in engine.shapes.cells for s in c.state_names}
    with native_stderr_silenced():
        loss, x, dh, gradients = function(
            {n: tf.constant(v, dtype=dtype) for n, v in params.items()},
            tf.constant(batch.x, dtype=dtype), tf.constant(batch.y, dtype=dtype),
            {n: tf.constant(v, dtype=dtype) for n, v in states.items()})
    return LayerTruth(float(loss.numpy()), x.numpy(), dh.numpy(),
                      {name: value.numpy() for name, value in gradients.items()})


def _arguments(view: LayerView, x: np.ndarray, h0s: list[np.ndarray],
               params: dict[str, np.ndarray], dh: np.ndarray) -> tuple[Any, ...]:
    """(x, h0, params, dh) as the user's function receives them: fresh copies."""
    states = {s: view.state(h).copy() for s, h in zip(view.states, h0s, strict=True)}
    h0: Any = states if len(states) > 1 else states["h0"]
    return (view.sequence(x).copy(), h0, {k: v.copy() for k, v in view.expand(params).items()},
            view.sequence(dh).copy())


def _describe_arguments(view: LayerView, arguments: tuple[Any, ...]) -> list[LayerArgument]:
    x, h0, params, dh = arguments
    axes = "(features, batch, time)" if view.time_last else "(batch, time, features)"
    state_axes = "(units, batch)" if view.time_last else "(batch, units)"
    out = [LayerArgument(name="x", shape=list(x.shape), meaning=f"the layer's input {axes}")]
    states = h0 if isinstance(h0, dict) else {"h0": h0}
    for name, value in states.items():
        out.append(LayerArgument(name=name, shape=list(value.shape),
                                 meaning=f"initial state {state_axes}"))
    for name, value in params.items():
        meaning = "the course's name" if name in COURSE_NAMES else "weight"
        out.append(LayerArgument(name=name, shape=list(value.shape), meaning=meaning))
    out.append(LayerArgument(name="dh", shape=list(dh.shape),
                             meaning="∂L/∂h_t from above at each step, without the carry"))
    return out


def _signatures(view: LayerView, params: dict[str, np.ndarray], x: np.ndarray,
                h0s: list[np.ndarray], dh: np.ndarray,
                truth: dict[str, np.ndarray]) -> list[variants.Signature]:
    """The layer's known wrong gradients, in the user's keys and layout."""
    cell = view.cell
    forward, backward = cell.numpy_functions()
    _, cache = forward(params, x, *h0s)

    def gradients_at(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        d_x, d_initial, d_params = backward(weights, forward(weights, x, *h0s)[1], dh)
        d_states = d_initial if isinstance(d_initial, tuple) else (d_initial,)
        return {**d_params, "x": d_x, **dict(zip(cell.state_names, d_states, strict=True))}

    batch, steps = x.shape[:2]
    out = variants.scalings(truth, [
        (float(batch), "sum_over_batch", "summed over the batch (dh already carries the "
                                         "mean's 1/B)"),
        (1 / batch, "mean_over_batch", "divided by the batch size B (dh already carries the "
                                       "mean's 1/B)"),
        (float(steps), "sum_over_time", "multiplied by the time steps T"),
        (1 / steps, "mean_over_time", "divided by the time steps T"),
    ])
    out += variants.gate_swaps(cell.weights(), truth, lambda info: info.short)
    out += variants.forward_gate_swaps(cell.weights(), params, gradients_at,
                                       lambda info: info.short)
    for variant in variants.applicable([cell]):
        d_x, d_initial, d_params = variants.variant_backward(cell, variant)(params, cache, dh)
        d_states = d_initial if isinstance(d_initial, tuple) else (d_initial,)
        gradients = {**d_params, "x": d_x, **dict(zip(cell.state_names, d_states, strict=True))}
        out.append(variants.Signature(variant.key, variant.text, gradients))
    return [variants.Signature(s.key, s.text, view.expand(s.gradients)) for s in out]


def check_layer(spec: Spec, against: str | Callable[..., Any], layer: str,
                time_last: bool = False, rtol: float | None = None, data: Batch | None = None,
                params: dict[str, np.ndarray] | None = None, progress: Progress | None = None,
                timings: bool = False, weights: Any = None) -> LayerCheckReport:
    """Check the user's backward of recurrent layer ``layer`` (see the module docstring).

    ``against`` is ``"FILE.py:FUNC"`` or a callable ``FUNC(x, h0, params, dh) -> dict``.
    Raises ``ConfigError`` (exit 2) for an unknown or non-recurrent layer, and when the
    function breaks the contract (raises, returns no dict, or no name gradscope knows).
    """
    from gradscope.yaml.shapes import model_entry

    say = progress or (lambda message: None)
    clock = Clock()
    label = against if isinstance(against, str) else getattr(against, "__name__", "function")
    function = load_against(against) if isinstance(against, str) else against
    algebra = model_shapes(spec)
    index = find_layer(algebra.cells, layer, spec)
    cell = algebra.cells[index]
    view = LayerView(cell, time_last)
    batch = (data if data is not None else synthetic_batch(algebra)).astype("float64")
    from gradscope.yaml.weights import chosen_weights

    params, weights_entry = chosen_weights(spec, weights, params, say)
    params = {n: v.astype(np.float64) for n, v in (params or initial_params(algebra)).items()}
    say("importing TensorFlow")
    engine = Engine(algebra, dtype="float64")
    say(f"TF autodiff in float64, read at {layer}")
    truth = layer_autodiff(engine, params, batch, index)
    clock.lap("autodiff")

    short = {info.short: params[info.name] for info in cell.weights()}
    h0s = [np.asarray(batch.initial_states.get(f"{cell.name}/{s}",
                                               np.zeros((batch.x.shape[0], cell.units))),
                      dtype=np.float64) for s in cell.state_names]
    say("NumPy reference of the layer")
    forward, backward = cell.numpy_functions()
    _, cache = forward(short, truth.x, *h0s)
    d_x, d_initial, d_params = backward(short, cache, truth.dh)
    d_states = d_initial if isinstance(d_initial, tuple) else (d_initial,)
    reference = {**d_params, "x": d_x, **dict(zip(cell.state_names, d_states, strict=True))}
    user_truth = view.expand(truth.gradients)
    user_reference = view.expand(reference)

    say("calling your backward")
    arguments = _arguments(view, truth.x, h0s, short, truth.dh)
    allowed = rtol if rtol is not None else tolerance(WITNESS).rtol
    reference_allowed = rtol if rtol is not None else tolerance("numpy_reference").rtol
    returned = _call(function, arguments, user_truth)
    memo: list[list[variants.Signature]] = []

    def diagnose(name: str, value: np.ndarray) -> str:
        if not memo:
            memo.append(_signatures(view, short, truth.x, h0s, truth.dh, user_truth))
        match = variants.identify(name, value, user_truth[name], memo[0], max(allowed, 1e-6))
        return variants.describe(f"{layer}/{name}", match) if match is not None else ""

    shown = view.shown(returned)
    results: list[WitnessResult] = []
    for name in shown:
        error = relative_error(user_reference[name], user_truth[name])
        results.append(WitnessResult("numpy_reference", name, error, reference_allowed,
                                     error <= reference_allowed))
    for key, value in returned.items():
        name = str(key)
        if name not in user_truth:
            results.append(WitnessResult(WITNESS, name, None, allowed, False,
                                         "unknown name" + _hint(name, user_truth)))
            continue
        time_axis = (2 if time_last else 1) if name == "x" else None
        results.append(compare(name, value, user_truth[name], user_truth, allowed,
                               lambda wrong, n=name: diagnose(n, wrong),  # type: ignore[misc]
                               time_axis=time_axis))
    clock.lap("against")

    tensors = checked_tensors(results, shown,
                              {n: list(v.shape) for n, v in user_truth.items()},
                              prefix=f"{layer}/")
    failed = [t.name for t in tensors if not t.passed]
    return LayerCheckReport(
        model=model_entry(algebra, data=batch.source),
        loss=LossEntry(name=spec.loss, value=truth.loss),
        layer=layer,
        cell=f"{cell.kind}, {cell.layout} layout",
        time_last=time_last,
        arguments=_describe_arguments(view, arguments),
        tolerances={"numpy_reference": reference_allowed, WITNESS: allowed},
        tensors=tensors,
        against=label,
        against_not_returned=[f"{layer}/{n}" for n in shown if n not in returned],
        weights=weights_entry,
        summary=CheckSummary(passed=not failed, checked_tensors=len(tensors),
                             failed_tensors=failed, witnesses=["numpy_reference", WITNESS],
                             comparisons=len(results),
                             failures=sum(not r.passed for r in results)),
        timings=clock.laps(timings),
    )


def _call(function: Callable[..., Any], arguments: tuple[Any, ...],
          expected: dict[str, np.ndarray]) -> dict[Any, Any]:
    """The user's function on the arguments; a ``ConfigError`` when it breaks the contract."""
    try:
        returned = function(*arguments)
    except Exception as exc:  # the user's code: reported where it arose, in one line
        raise ConfigError(f"--against: {_call_site(function, exc.__traceback__)}: "
                          f"{_exception_text(exc)}", where="--against") from None
    if not isinstance(returned, dict):
        raise ConfigError(f"--against: {_label(function)} returned {type(returned).__name__}; "
                          "expected a dict of gradients keyed by name, e.g. {'x': array}",
                          where="--against")
    if not any(name in expected for name in returned):
        what = ("an empty dict" if not returned else "only unknown names: " + ", ".join(
            repr(name) + _hint(name, expected) for name in returned))
        raise ConfigError(f"--against: {_label(function)} returned {what}; expected one or "
                          f"more of: {', '.join(expected)}", where="--against")
    return returned


