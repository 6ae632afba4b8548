"""Where the first NaN or Inf of a pass was born, when the loss or a gradient is not finite.

Nothing runs when every number is finite. Otherwise, on the failing batch only: the data and
the weights first; then, forward, the first layer call (in call order) whose outputs are not
finite while its inputs are, a recurrent call stepped through its own cell to the first step
whose state is not; then the loss; and, where the loss is finite, backward from the output
side, the first call whose backward turns a finite ∂L/∂output into a non-finite gradient. The
one call, step or loss found is rerun eagerly with its ops looked at
(:mod:`~gradscope.keras.nonfinite.births`), which names the op and its inputs' magnitudes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.keras.engine import CapturedCall, KerasPass, call_label
from gradscope.keras.nonfinite.births import Birth, finite, first_birth
from gradscope.keras.nonfinite.causes import (
    entry,
    fully_masked,
    kind_of,
    op_cause,
    where,
)
from gradscope.keras.nonfinite.reruns import layer_call, loss_rerun, positions
from gradscope.report.models import NonFiniteEntry


def all_finite(result: KerasPass) -> bool:
    """Whether the loss and every gradient of a pass are finite."""
    grads = [*result.gradients.values(), *(g for gs in result.state_gradients.values()
                                           for g in gs)]
    return finite(result.loss) and all(g is None or finite(g) for g in grads)


def diagnose(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
             sample_weight: Any, result: KerasPass) -> NonFiniteEntry | None:
    """Where the first non-finite value of ``result`` (a pass of ``engine`` on this batch)
    was born; None when the loss and every gradient are finite.

    Args:
        engine: The :class:`~gradscope.keras.engine.KerasEngine` that ran the pass.
        inputs: The batch's inputs, by name.
        targets: The targets the pass used, by output name.
        sample_weight: As the pass took them.
        result: The pass.

    Returns:
        The diagnosis, or None.
    """
    if all_finite(result):
        return None
    found = (_in_data(inputs, "input") or _in_data(targets, "target") or _in_weights(engine)
             or _forward(engine, result)
             or _in_loss(engine, inputs, targets, sample_weight, result))
    if found is None and finite(result.loss):
        from gradscope.keras.nonfinite.backward import backward

        found = backward(engine, inputs, targets, sample_weight)
    return found or entry(
        "forward" if not finite(result.loss) else "backward", "unknown", None, None, [],
        "gradscope could not find where: every layer call and the loss stay finite when "
        "rerun one by one")


def _in_data(arrays: dict[str, np.ndarray], what: str) -> NonFiniteEntry | None:
    """The first input (or target) array holding NaN or Inf: the data's fault."""
    for name, value in arrays.items():
        if value.dtype.kind != "f" or finite(value):
            continue
        step, examples = positions(value)
        bad = np.argwhere(~np.isfinite(value))
        first = next(b for b in bad if (step is None or int(b[1]) == step)
                     and int(b[0]) == examples[0])
        feature = f", feature {int(first[-1])}" if value.ndim >= 2 + (step is not None) else ""
        spot = f"example {examples[0]}" + ("" if step is None else f", step {step}") + feature
        total = int(bad.shape[0])
        more = (f"; {total} non-finite numbers in "
                f"{len({int(b[0]) for b in bad})} example(s)" if total > 1 else "")
        return entry("forward", what, name, step, examples,
                     f"{kind_of(value)} in the {what} {name}: {spot}{more}; the data's "
                     "fault, not the model's")
    return None


def _in_weights(engine: Any) -> NonFiniteEntry | None:
    for variable in engine.model.weights:
        value = np.asarray(variable.numpy())
        if finite(value):
            continue
        count = int(np.sum(~np.isfinite(value)))
        return entry("forward", "weight", variable.path.split("/")[0], None, [],
                     f"the weight {variable.path} already holds {count} {kind_of(value)} "
                     f"{'number' if value.size == 1 else 'numbers'} "
                     f"{'(every one)' if count == value.size else f'of {value.size}'}: an "
                     "earlier update wrote them (the batch is not the cause)")
    return None


def _forward(engine: Any, result: KerasPass) -> NonFiniteEntry | None:
    for call in result.calls:
        if all(finite(o) for o in call.outputs if _is_float(o)):
            continue
        label = call_label(call.layer, call.index)
        given = [a for a in [*call.args, *call.states] if _is_float(a)]
        if not all(finite(a) for a in given):
            step, examples = positions(next(a for a in given if not finite(a)))
            return entry("forward", "layer", label, step, examples,
                         f"its input is already not finite{where(step, examples)}, from "
                         "outside the layer calls gradscope saw")
        from gradscope.keras.nonfinite.steps import recurrent_birth

        stepped = recurrent_birth(engine, call)
        if stepped is not None:
            return stepped
        return _layer_birth(engine, call, label)
    return None


def _layer_birth(engine: Any, call: CapturedCall, label: str) -> NonFiniteEntry:
    """A layer call whose outputs are not finite, its inputs being finite: rerun eagerly."""
    layer = engine.operation(call.layer)
    bad = next(np.asarray(o) for o in call.outputs if _is_float(o) and not finite(o))
    step, examples = positions(bad)
    _, birth = first_birth(lambda: layer_call(engine, layer, call))
    cause = fully_masked(call.mask, examples, birth, step) or op_cause(birth, step, examples)
    return entry("forward", "layer", label, step, examples, cause, birth)


def _in_loss(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
             sample_weight: Any, result: KerasPass) -> NonFiniteEntry | None:
    """Every layer output finite, the loss not: the loss, rerun eagerly on Keras' own call."""
    if finite(result.loss):
        return None
    outputs, _, birth = loss_rerun(engine, inputs, targets, sample_weight)
    terms = [t for t in result.loss_terms if not finite(t.value)]
    label = "loss" if not terms else f"loss: {terms[0].name} ({terms[0].detail})"
    if birth is None:
        return entry("forward", "loss", label, None, [], op_cause(None, None, []))
    step, examples = positions(birth.output) if birth.output.ndim else (None, [])
    cause = op_cause(birth, step, examples, what="its argument")
    if birth.op_type == "Log" and birth.inputs:
        cause = _log_cause(engine, birth, outputs, result) or cause
    elif "overflows" in cause:
        grown = _grown_state(engine, result)
        cause = f"{cause}, because {grown}" if grown else cause
    return entry("forward", "loss", label, step, examples, cause, birth)


#: A recurrent output this large, every number finite, is searched for a growing state when
#: the loss overflows.
LARGE = 1e10


def _grown_state(engine: Any, result: KerasPass) -> str | None:
    """Where the size an overflowing loss took comes from: the first recurrent call, in call
    order, whose outputs reach :data:`LARGE` and whose state grows geometrically, in words
    ('simple_rnn's state grows 1.6× a step with relu, reaching 9.4e+24 at step 119 (example
    3)'); None where none does."""
    from gradscope.keras.nonfinite.causes import growing
    from gradscope.keras.stepped import step_call

    for call in result.calls:
        if not call.states or not all(
                np.all(np.isfinite(np.asarray(o, np.float64))) for o in call.outputs):
            continue
        if max(float(np.max(np.abs(np.asarray(o, np.float64)), initial=0))
               for o in call.outputs) < LARGE:
            continue
        stepped = step_call(engine, call, None, engine.training)
        if isinstance(stepped, str):
            continue
        for direction, states in zip(stepped.directions, stepped.states, strict=True):
            said = growing(states[0], direction.backwards, direction.layer.cell,
                           engine.training)
            if said:
                return f"{direction.label}'s {said}"
    return None


def _log_cause(engine: Any, birth: Birth, outputs: list[Any],
               result: KerasPass) -> str | None:
    """'log of 0: the softmax output for example 5 is exactly 0 at class 2' where the log's
    argument is one of the model's outputs."""
    argument = birth.inputs[0]
    bad = np.argwhere(~np.isfinite(birth.output) & (argument <= 0)) \
        if argument.shape == birth.output.shape else np.zeros((0, 0))
    if not len(bad):
        return None
    spot = [int(i) for i in bad[0]]
    named = None
    for name, output in zip(engine.output_names, outputs, strict=False):
        if np.asarray(output).shape == argument.shape and np.array_equal(
                np.asarray(output), argument):
            named = _output_words(engine, name)
    value = float(argument[tuple(spot)])
    what = named or "the log's argument"
    # A last axis of one number is no class (found tried as a new user would: "at class 0"
    # of a regression's single output).
    place = (f"example {spot[0]}" + (f" at step {spot[1]}" if len(spot) > 2 else "")
             + (f" at class {spot[-1]}" if len(spot) >= 2 and argument.shape[-1] > 1
                else ""))
    size = "exactly 0" if value == 0 else f"{value:.3g}"
    logits = [t.settings.get("from_logits") for t in result.loss_terms
              if t.settings and "from_logits" in t.settings]
    said = f" (from_logits={logits[0]})" if logits else ""
    return f"log of {'0' if value == 0 else 'a negative number'}: {what} for {place} is " \
           f"{size}{said}"


def _output_words(engine: Any, name: str) -> str:
    """'the softmax output' (the output layer's activation), else 'the output NAME'."""
    try:
        layer = engine.operation(name)
    except KeyError:
        return f"the output {name}"
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    return (f"the {activation} output" if activation in {"softmax", "sigmoid"}
            else f"the output {name}")



def _is_float(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and (getattr(dtype, "is_floating", False)
                                  or getattr(dtype, "kind", "") == "f")
