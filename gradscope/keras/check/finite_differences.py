"""Finite differences of the loss of Keras' own call of the whole model, against the tape.

They share nothing with gradscope's reading of the model, so they witness every weight, float
input and initial state of any model. A long recurrent model's forward pass is what they
cost: every tensor is first moved at once along a few joint directions
(:mod:`~gradscope.keras.check.joint_differences`), and only where one disagrees is each
tensor probed on its own, which names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradscope._tf import xla_or_graph
from gradscope.errors import InternalError
from gradscope.gradcheck import (
    PER_TENSOR_DIRECTIONS,
    Probe,
    WitnessResult,
    directional_error,
    probes_for,
    settle_kinks,
    step_for,
)
from gradscope.keras.check.joint_differences import JOINT_DIRECTIONS, Part, joint_check
from gradscope.keras.check.probing import Probing, Witnessed
from gradscope.keras.engine import (
    CapturedCall,
    KerasEngine,
    KerasPass,
    call_label,
    state_layers,
    state_names,
)
from gradscope.keras.explain import KerasJob
from gradscope.keras.observed_call import zero_states_shifted
from gradscope.keras.subclassed import is_subclassed
from gradscope.report.models import NotWitnessed

WITNESS = "finite_differences"


def witness(probing: Probing, directions: int | None,
                       held: dict[str, np.ndarray]) -> Witnessed:
    """Every tensor jointly first: the weights, the float inputs and the zero initial states
    of Keras' own call, moved together. Where a joint direction disagrees, every tensor is
    probed on its own instead. Initial states Keras' own call does not ask for (wired in,
    carried by a stateful layer) are probed on their own, through the replay. ``directions``:
    random directions, joint and then per tensor (None: :data:`JOINT_DIRECTIONS` and
    :data:`PER_TENSOR_DIRECTIONS`); ``held``: per input, where it may move
    (:func:`masked_inputs`). Not witnessed: the initial states it could not probe on their own
    (a subclassed model's)."""
    engine, autodiff, inputs = probing.engine, probing.autodiff, probing.inputs
    tf = engine.tf
    feed, y = probing.tensors()
    rng = np.random.default_rng([probing.seed, 2])
    variables = {v.path: v for v in engine.model.trainable_variables}
    hooked = _hooked_states(engine, autodiff)
    parts = [Part(path, gradient, probing.weights[path])
             for path, gradient in autodiff.gradients.items() if gradient is not None]
    parts += [Part(f"input {name}", gradient, value, held.get(name))
              for name, value in inputs.items()
              if (gradient := autodiff.input_gradients.get(name)) is not None]
    parts += [Part(f"{label}/{state}", gradient, np.zeros_like(gradient))
              for label, names in hooked.names.items()
              for state, gradient in zip(names, autodiff.state_gradients.get(label, []),
                                         strict=False) if gradient is not None]
    parts_by_name = {part.name: part for part in parts}

    def joint_loss(feed: list[Any], shifts: list[list[list[Any]]]) -> Any:
        # The layers' zero states are shifted as Keras asks for them, counted here (apart
        # from the engine's recorder).
        with zero_states_shifted(list(zip(hooked.layers, shifts, strict=True))):
            return probing.keras_loss(feed, y)

    # XLA runs a long recurrent forward pass in float64 in about 0.7 of the time of
    # TensorFlow's graph (and compiles faster than that traces). Either way the same Keras
    # call: a joint direction that disagrees sends every tensor to its own probes, as a graph.
    evaluate = xla_or_graph(tf, joint_loss, reduce_retracing=True)

    def loss_at(values: dict[str, np.ndarray]) -> float:
        probing.restore()
        moved = [(variables[name], value) for name, value in values.items()
                 if name in variables]
        try:
            for variable, value in moved:
                variable.assign(value)
            changed = [tf.constant(values[f"input {name}"]) if f"input {name}" in values
                       else tensor for name, tensor in zip(inputs, feed, strict=True)]
            return float(evaluate(changed, hooked.shifts(values, tf)).numpy())
        finally:
            for variable, _ in moved:
                variable.assign(parts_by_name[variable.path].value)

    rtol = probing.rtol
    joint = (joint_check(parts, JOINT_DIRECTIONS if directions is None else directions, rng,
                         autodiff.loss, rtol, probing.atol, step_for(probing.dtype), loss_at,
                         probing.rounding) if parts else None)
    found = Witnessed()
    if joint is not None and joint.passed:
        for part in parts:
            found.shapes[part.name] = list(part.gradient.shape)
            found.results.append(WitnessResult(WITNESS, part.name, joint.error, rtol, True,
                                               joint.detail))
        alone = set()
    else:
        alone = set(parts_by_name)
    alone |= {f"{call_label(c.layer, c.index)}/{name}" for c in autodiff.calls if c.states
              and call_label(c.layer, c.index) not in hooked.names
              for name in state_names(engine.operation(c.layer))}
    if is_subclassed(engine.model):
        # Its graph is its call: a state is shifted only where Keras asks for zeros (jointly),
        # never through gradscope's replay of the layers.
        for call in autodiff.calls:
            label = call_label(call.layer, call.index)
            names = {f"{label}/{name}" for name in state_names(engine.operation(call.layer))}
            if call.states and names & alone:
                alone -= names
                found.not_witnessed.append(NotWitnessed(
                    layer=label, witness=WITNESS,
                    reason="a subclassed model's initial state is shifted only with every "
                           "other tensor at once, where Keras asks for zeros; on its own it "
                           "would need gradscope's replay of the layers, which a model whose "
                           "graph is its own call does not have (the NumPy reference still "
                           "witnesses GRU, LSTM and SimpleRNN states)"))
    if alone:
        probed = _one_by_one(probing, alone,
                             PER_TENSOR_DIRECTIONS if directions is None else directions, rng,
                             held)
        found.results.extend(probed.results)
        found.shapes.update(probed.shapes)
    return found


def masked_inputs(job: KerasJob, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """For inputs a Masking layer reads: 1 where an element may be perturbed, 0 on the masked
    steps (all features equal to mask_value): moving one of those would unmask the step, a
    jump that no derivative describes."""
    keep = {}
    for spec in job.inputs:
        reader = job.graph.layer(spec.pad_reader) if spec.pad_reader else None
        if reader is None or reader.class_name != "Masking" or spec.name not in inputs:
            continue
        value = inputs[spec.name]
        masked = np.all(value == spec.pad_value, axis=-1, keepdims=True)
        keep[spec.name] = np.broadcast_to(~masked, value.shape).astype(np.float64)
    return keep


@dataclass
class _HookedStates:
    """The zero initial states finite differences shift in Keras' own call: per call label,
    the state names; per layer whose ``get_initial_state`` is asked, the calls in the order
    Keras makes them, and which of each call's states are that layer's."""

    names: dict[str, list[str]] = field(default_factory=dict)
    layers: list[Any] = field(default_factory=list)
    requests: list[list[tuple[str, list[int], list[tuple[int, ...]]]]] = field(
        default_factory=list)  # per layer: per request (call label, state indices, shapes)

    def shifts(self, values: dict[str, np.ndarray], tf: Any) -> list[list[list[Any]]]:
        """Per layer, per request, one tensor per state: the value in ``values`` (zero where
        a state does not move)."""
        return [[[tf.constant(values.get(f"{label}/{self.names[label][k]}", np.zeros(shape)))
                  for k, shape in zip(indices, shapes, strict=True)]
                 for label, indices, shapes in per_request]
                for per_request in self.requests]


def _hooked_states(engine: KerasEngine, autodiff: KerasPass) -> _HookedStates:
    """The layers every call of which starts from Keras' own zeros (asked of
    ``get_initial_state`` once per call and per direction)."""
    hooked = _HookedStates()
    by_layer: dict[str, list[CapturedCall]] = {}
    for call in autodiff.calls:
        by_layer.setdefault(call.layer, []).append(call)
    for name, calls in by_layer.items():
        if not any(call.states for call in calls):
            continue
        if not all(call.states and call.state_source == "zeros" for call in calls):
            continue
        directions = state_layers(engine.operation(name))
        per = len(calls[0].states) // len(directions)
        if any(len(call.states) != per * len(directions) for call in calls):
            continue
        for call in calls:
            hooked.names[call_label(call.layer, call.index)] = state_names(
                engine.operation(call.layer))
        for d, layer in enumerate(directions):
            hooked.layers.append(layer)
            hooked.requests.append([
                (call_label(call.layer, call.index), list(range(d * per, (d + 1) * per)),
                 [tuple(int(n) for n in call.states[k].shape)
                  for k in range(d * per, (d + 1) * per)])
                for call in sorted(calls, key=lambda c: c.index)])
    return hooked


def _one_by_one(probing: Probing, names: set[str], directions: int, rng: np.random.Generator,
                held: dict[str, np.ndarray]) -> Witnessed:
    """Each tensor in ``names`` on its own: central differences along random unit directions
    and at single elements (the largest |g| and random ones)."""
    engine, autodiff, inputs = probing.engine, probing.autodiff, probing.inputs
    tf = engine.tf
    feed, y = probing.tensors()
    state_calls = [call for call in autodiff.calls if call.states]
    zero_deltas = {call_label(c.layer, c.index): [tf.zeros_like(s) for s in c.states]
                   for c in state_calls}

    @tf.function(reduce_retracing=True)
    def evaluate(feed: list[Any]) -> Any:
        return probing.keras_loss(feed, y)

    @tf.function(reduce_retracing=True)
    def evaluate_shifted(feed: list[Any], deltas: dict[str, list[Any]]) -> Any:
        # An initial state exists only in the replay, which makes it explicit: shifting it
        # needs the replay. Its unshifted loss is checked against Keras' own call (below).
        loss, _, _ = engine.forward(feed, y, lambda tensor: None, deltas=deltas,
                                    sample_weight=probing.sample_weight)
        return loss

    def loss_with(new_feed: list[Any] | None = None,
                  deltas: dict[str, list[Any]] | None = None) -> float:
        probing.restore()
        if deltas is None:
            return float(evaluate(new_feed or feed).numpy())
        return float(evaluate_shifted(feed, deltas).numpy())

    states = {f"{call_label(c.layer, c.index)}/{n}" for c in state_calls
              for n in state_names(engine.operation(c.layer))}
    if names & states:
        _same_unshifted(probing, loss_with(), loss_with(deltas=zero_deltas))

    def probed(name: str, gradient: np.ndarray, evaluate_at: Callable[[np.ndarray], float],
               base: np.ndarray, keep: np.ndarray | None = None) -> WitnessResult:
        return _probed(probing, name, gradient, evaluate_at, base,
                       probes_for(name, gradient, directions, rng), keep)

    found = Witnessed()
    variables = {v.path: v for v in engine.model.trainable_variables}
    for path, gradient in autodiff.gradients.items():
        if gradient is None or path not in names:
            continue
        variable = variables[path]
        base = np.array(variable.numpy())

        def at_weight(value: np.ndarray, variable: Any = variable,
                      base: np.ndarray = base) -> float:
            variable.assign(value)
            try:
                return loss_with()
            finally:
                variable.assign(base)

        found.shapes[path] = list(gradient.shape)
        found.results.append(probed(path, gradient, at_weight, base))
    for index, (name, value) in enumerate(inputs.items()):
        gradient = autodiff.input_gradients.get(name)
        if gradient is None or f"input {name}" not in names:
            continue

        def at_input(perturbed: np.ndarray, index: int = index) -> float:
            changed = list(feed)
            changed[index] = tf.constant(perturbed)
            return loss_with(new_feed=changed)

        found.shapes[f"input {name}"] = list(gradient.shape)
        found.results.append(probed(f"input {name}", gradient, at_input, value,
                                    held.get(name)))
    for call in state_calls:
        label = call_label(call.layer, call.index)
        state_names_here = state_names(engine.operation(call.layer))
        for k, gradient in enumerate(autodiff.state_gradients.get(label, [])):
            if gradient is None or f"{label}/{state_names_here[k]}" not in names:
                continue

            def at_state(delta: np.ndarray, label: str = label, k: int = k) -> float:
                deltas = {key: list(value) for key, value in zero_deltas.items()}
                deltas[label][k] = tf.constant(delta)
                return loss_with(deltas=deltas)

            found.shapes[f"{label}/{state_names_here[k]}"] = list(gradient.shape)
            found.results.append(probed(f"{label}/{state_names_here[k]}", gradient, at_state,
                                        np.zeros_like(gradient)))
    return found


def _same_unshifted(probing: Probing, own: float, replayed: float) -> None:
    """The initial-state probes run the replay: unshifted, its loss must be Keras' own."""
    same = 1e-9 if probing.dtype == "float64" else 1e-5  # the replay's ops, rounded in dtype
    agree = own == replayed or abs(own - replayed) <= same * max(1.0, abs(own)) or (
        np.isnan(own) and np.isnan(replayed))  # no number either way: the probes fail
    if not agree:
        raise InternalError(
            f"internal error: {probing.engine.path}: with its initial states unshifted, "
            f"gradscope's layer-by-layer run gives the loss {replayed:.12g}, Keras' own "
            f"call {own:.12g}: the initial-state probes would measure another model; "
            "please report it")


def _probed(probing: Probing, name: str, gradient: np.ndarray,
            evaluate_at: Callable[[np.ndarray], float], base: np.ndarray, probes: list[Probe],
            keep: np.ndarray | None) -> WitnessResult:
    """One tensor's central differences along ``probes`` (restricted to where ``keep`` lets
    it move). A probe that straddles a kink (relu or a clip at its corner) is taken again at a
    smaller step and, where the one-sided slopes stay apart, left out and said to be at a kink
    (:func:`~gradscope.gradcheck.settle_kinks`), never a failure."""
    if keep is not None:
        probes = _restricted(probes, keep)
    loss, rtol, atol, rounding = (probing.autodiff.loss, probing.rtol, probing.atol,
                                  probing.rounding)
    step = step_for(probing.dtype)
    plus = np.array([evaluate_at((base + step * p.direction).astype(base.dtype))
                     for p in probes])
    minus = np.array([evaluate_at((base - step * p.direction).astype(base.dtype))
                      for p in probes])
    settled = settle_kinks(gradient, probes, plus, minus, evaluate_at, base, loss, rtol, atol,
                           probing.dtype, rounding)
    left_out = settled.left_out_detail(len(probes))
    if not settled.groups:
        return WitnessResult(WITNESS, name, None, rtol, True, left_out,
                             at_kink=not settled.not_resolved,
                             unresolved=settled.not_resolved, left_out=left_out)
    error, passed, detail = max(
        (directional_error(gradient, group, p, m, loss, rtol, atol, taken, rounding)
         for group, p, m, taken in settled.groups), key=lambda found: found[0])
    if keep is not None:
        detail += "; masked steps held fixed (their mask depends on their values)"
    return WitnessResult(WITNESS, name, error, rtol, passed, detail, left_out=left_out)


def _restricted(probes: list[Probe], keep: np.ndarray) -> list[Probe]:
    """The probes with their masked parts removed (and renormalised); empty ones dropped."""
    kept = []
    for probe in probes:
        direction = probe.direction * keep
        norm = float(np.linalg.norm(direction))
        if norm > 0:
            kept.append(Probe(probe.tensor, probe.label, direction / norm))
    return kept
