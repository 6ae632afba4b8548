"""explain's cross-check: gradscope's NumPy cells beside Keras' recurrent calls.

For every GRU, LSTM and SimpleRNN call, the layer's captured input and initial state go through
gradscope's NumPy reference cell (float64, no TensorFlow) with the layer's real weights. It must
reproduce what Keras computed; a mismatch means gradscope misread the layer, and is an internal
error naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope._blas import blas_beside_tensorflow
from gradscope.cells.base import Cell
from gradscope.errors import InternalError
from gradscope.gradcheck import AMPLIFIED, TOLERANCES, one_rounding_off, tolerance
from gradscope.keras.engine import CapturedCall, call_label
from gradscope.keras.layers.base import LayerFacts
from gradscope.keras.layers.recurrent import RecurrentExplainer
from gradscope.report.models import CrossCheckEntry


def computed_in(call: CapturedCall, dtype: str) -> str:
    """The dtype a call's cell computed in: its output's (a mixed policy computes in float16
    or bfloat16 while its weights are float32), else ``dtype``."""
    outputs = call.outputs[:1]
    name = str(getattr(getattr(outputs[0], "dtype", None), "name", "")) if outputs else ""
    return name if name in TOLERANCES["cross_check"] else dtype


def not_finite(call: CapturedCall) -> str | None:
    """Why a call whose numbers are not all finite is not cross-checked (NaN equals
    nothing): the report's diagnosis says where they were born."""
    tensors = [call.args[0], *call.states, *call.outputs] if call.args else call.outputs
    for tensor in tensors:
        value = np.asarray(tensor)
        if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            return "its numbers are not all finite on this batch"
    return None


def cross_check_call(call: CapturedCall, facts: LayerFacts, explainer: RecurrentExplainer,
                 weights: dict[str, np.ndarray], dtype: str,
                 training: bool = False) -> CrossCheckEntry:
    cell = explainer.cell(facts)
    key = cell.key
    label = call_label(call.layer, call.index)
    name = f"the NumPy reference cell {key}"
    skip = unwitnessed(call, facts, training) or not_finite(call)
    rtol, atol = tolerance("cross_check", computed_in(call, dtype))
    if skip:
        return CrossCheckEntry(layer=label, witness=name, max_abs_error=None,
                                 tolerance=rtol, passed=None, detail=f"not witnessed: {skip}")
    forward, _ = cell.numpy_functions()
    params = cell_params(cell, weights)
    rows = sampled_examples(*np.shape(call.args[0])[:2])
    x = np.asarray(call.args[0], np.float64)[rows]
    if facts.option("go_backwards"):
        # Keras reads the steps from the last, and returns the sequence in that order.
        x = x[:, ::-1]
    states = [np.asarray(s, np.float64)[rows] for s in call.states]
    with blas_beside_tensorflow():
        sequence, _ = forward(params, x, *states)
    keras_output = np.asarray(call.outputs[0], np.float64)[rows]
    ours = sequence if facts.option("return_sequences") else sequence[:, -1]
    if ours.shape != keras_output.shape:
        raise InternalError(f"internal error: layer {label}: gradscope's {key} cell gives an "
                            f"output of shape {ours.shape}, Keras {keras_output.shape}")
    error = float(np.max(np.abs(ours - keras_output))) if ours.size else 0.0
    allowed = atol + rtol * float(np.max(np.abs(keras_output))) if ours.size else atol
    moved = (rounding_growth(forward, params, x, states, facts, ours,
                             computed_in(call, dtype)) if not error <= allowed else 0.0)
    if not error <= allowed and error <= allowed + AMPLIFIED * moved:
        return CrossCheckEntry(
            layer=label, witness=name, max_abs_error=error, tolerance=rtol, passed=None,
            allowed=allowed,
            detail=f"not witnessed: this trajectory amplifies rounding (its output moves by "
                   f"{moved:.1e} when the inputs move by one rounding of "
                   f"{computed_in(call, dtype)}), so Keras' output, {error:.1e} from the "
                   f"cell's, cannot be held to {allowed:.1e}")
    if not error <= allowed:
        raise InternalError(
            f"internal error: layer {label} ({facts.class_name}): gradscope's {key} cell does "
            f"not reproduce Keras' output (max |error| {error:.2e} > {allowed:.1e}); gradscope "
            "misreads this layer, so its explanation would be wrong; please report it")
    return CrossCheckEntry(layer=label, witness=name, max_abs_error=error, tolerance=rtol,
                             passed=True, allowed=allowed,
                             detail=f"reproduces Keras' output to {error:.1e} "
                                    f"(allowed {allowed:.1e}){_of_batch(rows, call)}")


#: One rounding, relative, in each dtype a call computes in.
ROUNDING = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
            "bfloat16": 2.0 ** -8}


def rounding_growth(forward: Any, params: dict[str, np.ndarray], x: np.ndarray,
                    states: list[np.ndarray], facts: LayerFacts, ours: np.ndarray,
                    dtype: str) -> float:
    """How far the cell's own output moves when every input number moves by one rounding of
    ``dtype`` (relative, signs from a fixed seed), in float64: a stable trajectory keeps it
    near that rounding, one whose λ₁ > 0 grows it step after step, as it grows the rounding
    of Keras' own float32 loop."""
    nudged = one_rounding_off(x, ROUNDING.get(dtype, ROUNDING["float32"]),
                              np.random.default_rng(0))
    with blas_beside_tensorflow():
        sequence, _ = forward(params, nudged, *states)
    moved = sequence if facts.option("return_sequences") else sequence[:, -1]
    return float(np.max(np.abs(moved - ours))) if ours.size else 0.0


#: The NumPy cell reruns at most this many example-steps of a call (and at least
#: :data:`FEWEST_EXAMPLES` examples, the first and the last): the cell's algebra, the one
#: thing it witnesses, is the same for every example, and a long call's whole batch would cost
#: seconds in NumPy (8 examples of a 3000-step LSTM-256 pair: 3.1 s; 2 examples: 1.3 s).
MOST_EXAMPLE_STEPS = 3200
FEWEST_EXAMPLES = 2


def sampled_examples(batch: int, steps: int) -> slice | np.ndarray:
    """The examples the cell reruns: all of them where the call is short, else evenly spread
    ones, the first and the last among them."""
    keep = max(FEWEST_EXAMPLES, MOST_EXAMPLE_STEPS // max(steps, 1))
    if batch <= keep:
        return slice(None)
    return np.unique(np.linspace(0, batch - 1, keep).round().astype(int))


def _of_batch(rows: slice | np.ndarray, call: CapturedCall) -> str:
    if isinstance(rows, slice):
        return ""
    return f", on {len(rows)} of its {np.shape(call.args[0])[0]} examples"


def cell_params(cell: Cell, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A layer's weights in float64 by short name, as the cell takes them. Without a bias
    (use_bias=False) it is the same cell with a zero bias, of the shape the cell's algebra
    gives."""
    params = {short: np.asarray(value, np.float64) for short, value in weights.items()}
    if "bias" not in params:
        params["bias"] = np.zeros(next(info.shape for info in cell.weights()
                                       if info.short == "bias"))
    return params


def unmodelled(facts: LayerFacts, training: bool) -> list[str]:
    """What in a recurrent layer's settings gradscope's cells do not model: other
    activations, dropout in training mode. (A stateful layer's carried state is captured like
    any initial state.)"""
    reasons = []
    if facts.option("activation", "tanh") != "tanh":
        reasons.append(f"activation {facts.option('activation')}")
    if facts.class_name != "SimpleRNN" and facts.option("recurrent_activation",
                                                        "sigmoid") != "sigmoid":
        reasons.append(f"recurrent_activation {facts.option('recurrent_activation')}")
    if training:
        reasons += [f"{key} {facts.option(key)} in training mode"
                    for key in ("dropout", "recurrent_dropout")
                    if float(facts.option(key, 0.0) or 0.0) > 0]
    return reasons


def unwitnessed(call: CapturedCall, facts: LayerFacts, training: bool = False) -> str | None:
    """Why the cell cannot stand in for this call (it models the plain recurrence only)."""
    if call.mask is not None:
        return "the input is masked (Keras skips masked steps; the cell does not model masks)"
    reasons = unmodelled(facts, training)
    said = [not_modelled(reasons)] if reasons else []
    if not call.states:
        said.append("no initial state captured")
    return "; ".join(said) or None


def not_modelled(reasons: list[str]) -> str:
    """What :func:`unmodelled` found, said (found tried as a new user would: "the cells model
    the plain recurrence only (activation linear)" read as if the cells were linear)."""
    return ("gradscope's NumPy cells model tanh, sigmoid gates and no dropout; this layer has "
            + ", ".join(reasons))


def weights_by_key(layer: Any, facts: LayerFacts) -> dict[str, np.ndarray]:
    from gradscope.keras.layers.base import variable_key

    return {variable_key(v.path, facts.name, layer.path): np.asarray(v.numpy())
            for v in layer.weights}


def compared_outputs(ours: list[np.ndarray], outputs: list[Any], rtol: float, atol: float,
                     who: str) -> tuple[float, float] | str:
    """Outputs rebuilt by ``who`` ("gradscope's cells", "the stepped cell") against Keras'
    own: the largest |error| and what ``atol + rtol·max|output|`` allows there, or why they
    do not rebuild them. Compared in the wider of the two dtypes, float32 at least: a
    difference of two float32 numbers this close is exact in float32, and a float64 copy of a
    long call's sequences cost about 0.15 s a call."""
    keras = [np.asarray(o) for o in outputs]
    if len(ours) != len(keras):
        return f"{len(ours)} outputs rebuilt by {who}, {len(keras)} from Keras"
    worst, slack = 0.0, atol
    for k, (mine, theirs) in enumerate(zip(ours, keras, strict=True)):
        if mine.shape != theirs.shape:
            return (f"output {k} rebuilt by {who} has the shape {mine.shape}, Keras' "
                    f"{theirs.shape}")
        if not mine.size:
            continue
        if not np.all(np.isfinite(theirs)):
            # Found tried as a new user would: weights a NaN had reached read as "the stepped
            # cell does not reproduce Keras' output (max |error| nan > nan)", as if
            # gradscope's cell were at fault.
            bad = int(np.size(theirs) - np.count_nonzero(np.isfinite(theirs)))
            return (f"Keras' own output {k} is not finite on this batch ({bad} of "
                    f"{np.size(theirs)} values NaN or Inf: the weights or the inputs hold "
                    "them), so there is nothing finite to read")
        if not np.all(np.isfinite(mine)):
            return (f"the outputs of {who} are not finite where Keras' output {k} is (a "
                    "step's NaN or Inf that Keras' own call does not reach)")
        wide = np.result_type(mine.dtype, theirs.dtype, np.float32)
        error = float(np.max(np.abs(np.subtract(mine, theirs, dtype=wide))))
        allowed = atol + rtol * float(np.max(np.abs(theirs)))
        if not error <= allowed:
            return (f"the outputs of {who} do not reproduce Keras' output {k} (max |error| "
                    f"{error:.1e} > {allowed:.1e})")
        if error > worst:
            worst, slack = error, allowed
    return worst, slack
