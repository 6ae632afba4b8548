"""The memory a Keras model's ``explain`` or ``check`` will need, by term, and the guard that
refuses it before TensorFlow is imported (see :mod:`gradscope.guard`).

Read from the model's config and the batch's sizes alone. The constants were measured
(``bench/memory_estimate.py``: peak RSS of whole processes, Keras LSTM, GRU and SimpleRNN
models of 64 and 256 units, 2 to 1000 steps, batch 8 to 128; check remeasured once its tape
was no longer a persistent one); the estimate lands within 1.5× of the measured peak there."""

from __future__ import annotations

from math import prod
from typing import Any

from gradscope.guard import BASELINE_TERM, MIB, PROCESS_BASELINE, refuse_over
from gradscope.keras.data import time_steps
from gradscope.keras.engine import RECURRENT
from gradscope.keras.facts import layer_facts
from gradscope.keras.layers import deriving_explainer, sized_weights

#: Keras, the model and its traced pass, beyond TensorFlow itself: 60 MiB for explain, 100 MiB
#: for check (the float64 copy, and the finite differences' traced forward).
KERAS_OVERHEAD = {"explain": 60 * MIB, "check": 100 * MIB}
#: Per step and unit of a recurrent layer, how many numbers ``explain`` holds at its peak
#: (float32): the slope of peak RSS from 100 to 1000 steps, two layers of 256 units, batch 32:
#: LSTM and GRU 14.4, SimpleRNN about 5.
KEPT_PER_UNIT = {"LSTM": 15, "GRU": 15, "SimpleRNN": 5}
#: The same for ``check`` (float64: its autodiff pass, then the finite differences' forward
#: passes beside the NumPy reference of one recurrent call at a time): about 10 numbers per
#: step and unit (the slope of peak RSS from 100 to 1000 steps, two LSTM layers of 256 units,
#: batch 32: 952 MiB to 2077 MiB).
CHECK_KEPT_PER_UNIT = 10
#: ``--jacobians``, per step, example and unit of the recurrent call being read (float64):
#: gradscope's NumPy cells rerun it and keep about 10 numbers (an LSTM's gates, c and h), and
#: its input projection is taken for every step at once (4 for an LSTM), then read one step
#: at a time by the loop over time (4 again).
JACOBIAN_KEPT_PER_UNIT = 18


def recurrent_units(node: Any) -> list[tuple[str, int]]:
    """(class, units) of the recurrent loops a layer runs: both directions of a Bidirectional,
    the cell of ``RNN(cell)``."""
    if node.class_name in RECURRENT:
        return [(node.class_name, int(node.config.get("units", 0)))]
    inner = node.inner
    if node.class_name == "Bidirectional" and inner is not None:
        return 2 * recurrent_units(inner)
    cell = node.config.get("cell")
    if node.class_name == "RNN" and isinstance(cell, dict):
        units = (cell.get("config") or {}).get("units")
        return [("LSTM", int(units))] if isinstance(units, int) else []
    return []


def estimate(job: Any, command: str, examples: int | None = None,
             chunks: int | None = None, per_example: bool = False,
             jacobians: bool = False, flow: bool = False) -> dict[str, int]:
    """Bytes by term for ``command`` ("explain" or "check") on ``job``, a Keras model read and
    given its batch; the sum is the estimated peak resident memory of the whole process.
    ``examples``: how many of the batch's examples check runs on (default: every one);
    ``chunks``: ``--chunks``, whose cut run keeps its own tape; ``per_example``:
    ``--per-example``, whose Jacobian holds one gradient per example; ``jacobians``:
    explain's ``--jacobians``, which reads one recurrent call at a time; ``flow``:
    ``--flow``, whose probes add per state and step a zero, its gradient and the total read
    from it."""
    batch = job.batch_size if examples is None else examples
    steps = max(time_steps(job.batch.inputs), 1)
    weights, activations, loops, calls = 0, 0, [], []
    for node in job.graph.computing_layers:
        facts = layer_facts(job.graph, node)
        # A layer the algebra cannot size: its weights are not counted.
        notes = sized_weights(deriving_explainer(node.class_name, node.module, facts), facts)
        weights += sum(prod(note.shape) for note in notes or [])
        for shape in facts.input_shapes:  # every layer's input, and its gradient
            sizes = [steps if d is None else d for d in shape[1:]]
            activations += 2 * batch * prod(sizes)
        loops += recurrent_units(node)
        calls.append(recurrent_units(node))
    if command == "check":
        itemsize = 8
        kept = batch * steps * sum(CHECK_KEPT_PER_UNIT * units for _, units in loops)
    else:
        itemsize = 4
        kept = batch * steps * sum(KEPT_PER_UNIT.get(kind, 15) * units for kind, units in loops)
    terms = {}
    if chunks is not None:
        # The cut run's persistent tape: what the loops keep, and per state and step its
        # sequence, its edge and the edge's gradient.
        states = sum(units * (2 if kind == "LSTM" else 1) for kind, units in loops)
        terms["the cut run of --chunks (its tape, states and edges)"] = itemsize * (
            kept + 3 * batch * steps * states)
    if per_example:
        # The Jacobian (one row of every weight per example), its squares, and pfor's
        # batched copies of the recurrent loops' activations.
        terms["the examples' gradients of --per-example (a Jacobian)"] = itemsize * (
            2 * batch * weights + kept)
    terms = {
        **terms,
        BASELINE_TERM: PROCESS_BASELINE,
        "Keras and the model's traced passes": KERAS_OVERHEAD[command],
        "weights and their gradients": 4 * weights * itemsize,
        "the layers' inputs and their gradients": activations * itemsize,
        "activations the recurrent layers keep for the backward pass": kept * itemsize,
    }
    if flow and loops:
        states = sum(units * (2 if kind == "LSTM" else 1) for kind, units in loops)
        terms["the per-step state gradients of --flow (its probes)"] = (
            3 * batch * steps * states * itemsize)
    if jacobians and any(calls):
        terms["the state Jacobians of one recurrent call (--jacobians)"] = max(
            jacobian_bytes(call, batch, steps) for call in calls if call)
    return terms


def jacobian_bytes(loops: list[tuple[str, int]], batch: int, steps: int) -> int:
    """What ``--jacobians`` holds while it reads one recurrent call of these loops (both
    directions of a Bidirectional): the call rerun in float64, and the tangents and
    Jacobians of its largest state (:func:`~gradscope.keras.state_tangents.tangent_bytes`)."""
    from gradscope.keras.state_tangents import tangent_bytes

    rerun = 8 * batch * steps * sum(JACOBIAN_KEPT_PER_UNIT * units for _, units in loops)
    widths = [units * (2 if kind == "LSTM" else 1) for kind, units in loops]
    return rerun + tangent_bytes(batch, max(widths), 8)


def guard(job: Any, command: str, limit: int | None = None,
          examples: int | None = None, jacobians: bool = False) -> None:
    """Raise ConfigError (exit 2) when the estimate is over ``limit`` (default: RAM / 4)."""
    refuse_over(estimate(job, command, examples, jacobians=jacobians), limit, command)
