"""Where in time the gradient of an RNN over your own cell goes wrong: each step of the cell is
its own witness.

gradscope has no NumPy version of a cell you wrote, and needs none. Where check finds a
gradient wrong in a model with ``keras.layers.RNN(your_cell)``, the cell's backward is checked
at every step against central differences of that same step, from the cell's own numbers. The
verdict reads as ``--against`` does: where the gradients still match, counting back from the
last step, and the first wrong step, with the factor by which the tape's numbers differ where
one factor explains them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.gradcheck import (
    WitnessResult,
    factor_text,
    rounding_noise,
    rounding_of,
    step_for,
)
from gradscope.keras.cell_scan import cell_run, not_run
from gradscope.keras.check.probing import Probing, Witnessed
from gradscope.keras.engine import CapturedCall, call_label, class_label, state_names
from gradscope.keras.live import is_builtin
from gradscope.report.models import NotWitnessed

WITNESS = "cell_steps"


@dataclass(frozen=True)
class Part:
    """What one part of the cell's backward does over time: the worst relative error at each
    step (one number for a weight, which every step shares) and, where one factor explains
    the tape's numbers, that factor."""

    name: str  # "x_t", "h_(t−1)", or a weight's name
    errors: np.ndarray
    factor: float | None

    def wrong(self, rtol: float) -> list[int]:
        return [int(t) for t in np.nonzero(self.errors > rtol)[0]]


def your_cells(engine: Any, calls: list[CapturedCall]) -> list[CapturedCall]:
    """The calls of an RNN over a cell of the user's own class, with initial states captured."""
    found = []
    for call in calls:
        if class_label(engine.operation(call.layer)) != "RNN" or not call.states:
            continue
        cell = engine.operation(call.layer).cell
        if not is_builtin(type(cell).__module__):
            found.append(call)
    return found


def witness(probing: Probing, named: set[str]) -> Witnessed:
    """Each RNN over a cell of the user's own, step by step, on the tensors of ``named`` (what
    the other witnesses name): its initial states and the cell's trainable weights. A cell that
    cannot be run step by step is not witnessed, and said why."""
    engine = probing.engine
    found = Witnessed()
    for call in your_cells(engine, probing.autodiff.calls):
        cell = engine.operation(call.layer).cell
        if call.mask is not None and not bool(np.all(np.asarray(call.mask))):
            # Said, as the NumPy reference says it (found tried as a new user would: the
            # witness was left out of a masked custom cell's report without a word).
            found.not_witnessed.append(NotWitnessed(
                layer=call_label(call.layer, call.index), witness=WITNESS,
                reason="the input is masked (Keras skips masked steps; the cell's steps are "
                       "checked one by one only where every step runs)"))
            continue
        paths = [v.path for v in cell.trainable_variables if v.path in named]
        try:
            results = _one_call(probing, call, paths)
        except Exception as exc:  # noqa: BLE001  (the user's cell, on a folded batch)
            found.not_witnessed.append(NotWitnessed(layer=call_label(call.layer, call.index),
                                                    witness=WITNESS, reason=not_run(exc)))
            continue
        found.results.extend(result for result in results if result.tensor in named)
    return found


def _one_call(probing: Probing, call: CapturedCall, weight_paths: list[str]
              ) -> list[WitnessResult]:
    """The cell's steps checked one by one: a result for each of the call's initial states and
    for each of the cell's trainable weights (by the check's tensor names)."""
    engine, rtol = probing.engine, probing.rtol
    layer = engine.operation(call.layer)
    label = call_label(call.layer, call.index)
    mask = call.mask
    if mask is not None and not bool(np.all(np.asarray(mask))):
        return []
    parts, weights = _parts(engine, layer, call, engine.training,
                            np.random.default_rng([probing.seed, 7]))
    steps = len(parts[0].errors)
    names = state_names(layer)
    state_parts = parts[1:]
    # The gradient into the state entering step t is what carries ∂L back to every earlier
    # step: a step whose backward is wrong there spoils the total ∂L/∂h of every step before it,
    # and the weights' gradients with it.
    last_wrong = max((t for part in state_parts for t in part.wrong(rtol)), default=None)
    detail = _sentence(parts, weights, steps, rtol)
    if getattr(layer, "go_backwards", False):
        # Found tried as a new user would: "t=19" read in input order or in the layer's?
        detail += ("; t counts the steps in the order the layer runs them (go_backwards: "
                   f"t=0 is the last input step, t={steps - 1} the first)")
    results = []
    for name, part in zip(names, state_parts, strict=True):
        error = float(np.max(part.errors))
        results.append(WitnessResult(WITNESS, f"{label}/{name}", error, rtol, error <= rtol,
                                     detail, first_bad_step=last_wrong))
    by_path = {v.path: part for v, part in zip(layer.cell.trainable_variables, weights,
                                                strict=True)}
    for path in weight_paths:
        # Each weight's own backward, one number (every step shares it); wrong from a step
        # back only through the state's.
        error = float(np.max(by_path[path].errors))
        results.append(WitnessResult(WITNESS, path, error, rtol, error <= rtol, detail,
                                     first_bad_step=last_wrong))
    return results


def _sentence(parts: list[Part], weights: list[Part], steps: int, rtol: float) -> str:
    said = []
    for part in parts:
        wrong = part.wrong(rtol)
        if not wrong:
            said.append(f"into {part.name}: right at every step")
            continue
        last = max(wrong)
        if len(wrong) == steps:
            where = f"wrong at every step, including the last (t=T−1={steps - 1})"
        elif last < steps - 1:
            where = (f"matches at t={last + 1}…{steps - 1}, wrong from t={last} backwards "
                     f"({len(wrong)} of {last + 1} steps)")
        else:
            where = f"wrong at {len(wrong)} of {steps} steps, the last at t=T−1={steps - 1}"
        said.append(f"into {part.name}: {where}{_factor(part)}")
    right = [part.name for part in weights if not part.wrong(rtol)]
    if len(right) == len(weights):
        said.append("into the weights: right")
    else:
        said += [f"into {part.name}: wrong{_factor(part)}" for part in weights
                 if part.wrong(rtol)]
        if right:
            said.append(f"into {', '.join(right)}: right")
    return ("each step of your cell on its own (its input and state at that step, time folded "
            "into the batch; tape against central differences): " + "; ".join(said))


def _factor(part: Part) -> str:
    return f", off by a factor {factor_text(part.factor)}" if part.factor is not None else ""


def _parts(engine: Any, layer: Any, call: CapturedCall, training: bool,
           rng: np.random.Generator) -> tuple[list[Part], list[Part]]:
    """The cell run over the call's own input (``tf.scan``) gives the state entering every
    step; with time folded into the batch axis, the cell's backward is checked at every step at
    once: the tape's vector-Jacobian product of one step, for a random cotangent on its outputs
    and new states, against central differences of that same step along random directions of
    its input x_t, of each state it receives, and of each of its weights. Rows are examples at
    steps, so each step gets its own verdict. Returned: the parts of x_t and of each state, and
    one part per trainable weight of the cell (in its order)."""
    tf = engine.tf
    step, x_tm, initial = cell_run(engine, layer, call, training)
    steps, batch = int(x_tm.shape[0]), int(x_tm.shape[1])
    dtype = engine.dtype_name
    delta = step_for(dtype)

    @tf.function(autograph=False)
    def entering(x_tm: Any, initial: list[Any]) -> list[Any]:
        after = tf.scan(lambda carry, x_t: step(x_t, carry)[1], x_tm, initializer=initial)
        return [tf.concat([s[None], a[:-1]], 0) for s, a in zip(initial, after, strict=True)]

    def fold(tensor: Any) -> Any:
        return tf.reshape(tensor, [steps * batch, *tensor.shape[2:]])

    xs = fold(x_tm)
    states = [fold(s) for s in entering(x_tm, initial)]
    out, new = step(xs, states)
    cotangents = [tf.constant(rng.standard_normal(t.shape)) for t in [out, *new]]

    def rows(xs: Any, states: list[Any]) -> Any:
        out, new = step(xs, states)
        return sum(tf.reduce_sum(tf.reshape(t * c, [steps * batch, -1]), -1)
                   for t, c in zip([out, *new], cotangents, strict=True))

    variables = layer.cell.trainable_variables
    rows_of = tf.function(rows, autograph=False)

    @tf.function(autograph=False)
    def backward(xs: Any, states: list[Any]) -> list[Any]:
        with tf.GradientTape() as tape:
            tape.watch([xs, *states])
            total = tf.reduce_sum(rows(xs, states))
        return tape.gradient(total, [xs, *states, *variables])

    grads = backward(xs, states)
    at_rest = np.abs(rows_of(xs, states).numpy())
    moved = [xs, *states]
    parts = []
    for k, base in enumerate(moved):
        direction = tf.constant(rng.standard_normal(base.shape))

        def at(sign: float, k: int = k, base: Any = base, direction: Any = direction) -> Any:
            changed = list(moved)
            changed[k] = base + sign * delta * direction
            return rows_of(changed[0], changed[1:]).numpy()

        numerical = (at(1.0) - at(-1.0)) / (2 * delta)
        gradient = grads[k]
        analytic = (tf.reshape(gradient * direction, [steps * batch, -1]).numpy().sum(-1)
                    if gradient is not None else np.zeros(steps * batch))
        parts.append(_part(_part_name(layer, k), numerical, analytic, at_rest, steps, batch,
                           delta, dtype))
    # Each weight along a direction of its own: every step shares it, so one number each,
    # and a wrong one is named by itself.
    weights = []
    for k, variable in enumerate(variables):
        shift = rng.standard_normal(variable.shape)
        value = np.array(variable.numpy())

        def moved_by(sign: float, variable: Any = variable, value: Any = value,
                     shift: Any = shift) -> float:
            variable.assign(value + sign * delta * shift)
            try:
                return float(np.sum(rows_of(xs, states).numpy()))
            finally:
                variable.assign(value)

        gradient = grads[1 + len(states) + k]
        numerical = np.array([(moved_by(1.0) - moved_by(-1.0)) / (2 * delta)])
        analytic = np.array([float(np.sum(np.asarray(gradient) * shift))
                             if gradient is not None else 0.0])
        weights.append(_part(variable.name, numerical, analytic, np.array([np.sum(at_rest)]),
                             1, 1, delta, dtype))
    return parts, weights


def _part_name(layer: Any, k: int) -> str:
    if k == 0:
        return "x_t"
    name = state_names(layer)[k - 1]
    return f"{name[0]}_(t−1)" if name in ("h0", "c0") else f"{name} of step t−1"


def _part(name: str, numerical: np.ndarray, analytic: np.ndarray, at_rest: np.ndarray,
          steps: int, batch: int, delta: float, dtype: str) -> Part:
    """Per row (step t, example b) the error of the tape's directional derivative, against the
    typical size of one, the tape's or the differences' (the larger: where the tape's is 0,
    an error is measured against what the differences find, not against rounding; found
    tried as a new user would: a relative error of 1.32e+10 where the tape said exactly 0);
    worst over the examples of each step. The factor: least squares of the tape's numbers on
    the differences', where it explains them to 1%."""
    typical = (max(float(np.sqrt(np.mean(analytic ** 2))),
                   float(np.sqrt(np.mean(numerical ** 2)))) if analytic.size else 0.0)
    noise = rounding_noise(at_rest, delta, rounding_of(dtype))
    scale = np.maximum(np.abs(analytic), typical) + noise
    errors = (np.abs(numerical - analytic) / scale).reshape(steps, batch).max(axis=1)
    factor = None
    norm = float(np.sum(numerical ** 2))
    if norm > 0:
        fitted = float(np.sum(analytic * numerical)) / norm
        residual = float(np.linalg.norm(analytic - fitted * numerical))
        if residual <= 0.01 * float(np.linalg.norm(analytic)) and abs(fitted - 1) > 1e-3:
            factor = fitted
    return Part(name=name, errors=errors, factor=factor)
