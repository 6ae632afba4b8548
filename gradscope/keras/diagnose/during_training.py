"""What ``GradientFlow(diagnose_every=N)`` reads on a batch during ``fit``: for every recurrent
call, the top Lyapunov exponents, the gate saturation shares (Keras GRU and LSTM) and the
memory horizon predicted from λ₁ (and, on request, measured).

Each number comes from the functions ``gradscope diagnose`` reads it with, on the same
trajectory (the call stepped through the cell the model holds, its outputs held to Keras'
own): :func:`~gradscope.keras.diagnose.trajectory.lyapunov_logs`,
:func:`~gradscope.keras.diagnose.gates.read_gates`,
:func:`~gradscope.keras.diagnose.horizon.measure` and :mod:`gradscope.dynamics`. So a number
recorded during training equals what ``gradscope.diagnose(model, x=batch, y=…,
exponents=k)`` reports for the same weights, on the same examples (in a fit that diagnoses
often, the exponents to the compute dtype's rounding: it reads under XLA, a Keras GRU, LSTM
or SimpleRNN in one loop, :mod:`~gradscope.keras.diagnose.one_loop`, the whole diagnosis in
one function where it can, :mod:`~gradscope.keras.diagnose.one_function`). What
``diagnose`` reads besides (the norm of every step Jacobian, where ∂L/∂s_t grows, the
counterfactuals) costs more than a pass of training and is left to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope import dynamics
from gradscope.diagnosis_record import CallReading
from gradscope.keras.engine import call_label, class_label

#: The top exponents taken by default: λ₁ alone. Forward mode carries one tangent column per
#: exponent, folded into the batch, and the scan costs about that many times as much (29 ms
#: for λ₁, 83 ms for three, on the two GRU calls of bench/callback_overhead.py's model).
EXPONENTS = 1
#: A fit that will diagnose at least this many more times reads under XLA
#: (``read_calls(compiled=True)``): where every recurrent call is a Keras GRU, LSTM or
#: SimpleRNN call read in one loop, the whole diagnosis in one function
#: (:mod:`~gradscope.keras.diagnose.one_function`); else each such call in one loop
#: (:mod:`~gradscope.keras.diagnose.one_loop`), others stepped and scanned so, and the copy's
#: pass too. On a GRU 64 → GRU 32 at 50 steps, 8 examples, a diagnosis took 4.3 ms of CPU
#: instead of 23 as graphs, after a first one of 1.3 s instead of 0.8 s
#: (bench/diagnosis_parts.py).
COMPILED_DIAGNOSES = 50


def read_calls(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
               sample_weight: Any = None, exponents: int = EXPONENTS,
               measure_horizon: bool = False, cache: dict[Any, Any] | None = None,
               compiled: bool = False, put_state_back: bool = True,
               ) -> tuple[list[CallReading], list[tuple[str, str]]]:
    """Every recurrent call of ``engine``'s model on this batch, read with the model's current
    weights; and the (call, reason) of those that cannot be. Keras' own call of the model
    captures each call's input, output, mask and initial state
    (:func:`~gradscope.keras.diagnose.captured.captured_pass`); then
    each call is stepped (without ∂L/∂s_t: nothing read here uses it) and read; with
    ``compiled``, the whole diagnosis in one function where it can be
    (:func:`~gradscope.keras.diagnose.one_function.read_in_one_function`), else a Keras
    GRU, LSTM or SimpleRNN call in one loop where it can be
    (:func:`~gradscope.keras.diagnose.one_loop.read_in_one_loop`).
    ``measure_horizon``: also the measured horizon (about as long again as the rest).
    ``cache``: kept by the caller across calls with one engine: Keras' own call of the model
    is traced once, not at every diagnosis (each function that steps a cell is kept on the
    engine itself: :func:`~gradscope.keras.stepped.engine_cached`). ``compiled``: the
    steppings and the Lyapunov scans of a step linearised by hand run under XLA where they
    compile (``step_call(compiled=True)``, ``lyapunov_logs(compiled=True)``), the exponents
    then diagnose's to the compute dtype's rounding. ``put_state_back``: what Keras' call of
    the model moves (its cells' seed generators, even in inference mode) is given its value
    back after it; False on GradientFlow's copy, whose state nothing reads (about 1 ms of a
    read's 2.9 ms of the worker's CPU on bench/callback_overhead.py's model)."""
    from gradscope.keras.diagnose import exponent_room, is_recurrent
    from gradscope.keras.diagnose.captured import captured_pass
    from gradscope.keras.diagnose.gates import known_gates, read_gates
    from gradscope.keras.diagnose.horizon import measure
    from gradscope.keras.diagnose.one_loop import read_in_one_loop
    from gradscope.keras.diagnose.trajectory import lyapunov_logs, trajectory
    from gradscope.keras.stepped import step_call

    if compiled and not measure_horizon and cache is not None:
        from gradscope.keras.diagnose.one_function import read_in_one_function

        whole = read_in_one_function(engine, inputs, targets, sample_weight, exponents, cache,
                                     put_state_back)
        if whole is not None:
            return [_reading(*read, None) for read in whole], []
    calls, _ = captured_pass(engine, inputs, targets, sample_weight, cache,
                             compiled=compiled, put_state_back=put_state_back)
    readings: list[CallReading] = []
    skipped: list[tuple[str, str]] = []
    for call in calls:
        if not is_recurrent(engine, call):
            continue
        fast = (read_in_one_loop(engine, call, exponents) if compiled and not measure_horizon
                else None)
        if fast is not None:
            label, logs, ran, gates_read = fast
            readings.append(_reading(label, engine.operation(call.layer), logs, ran,
                                     gates_read, None))
            continue
        stepped = step_call(engine, call, None, engine.training, reuse=True,
                            compiled=compiled)
        if isinstance(stepped, str):
            skipped.append((call_label(call.layer, call.index), stepped))
            continue
        for index, direction in enumerate(stepped.directions):
            layer = direction.layer
            path = trajectory(stepped, index)
            if isinstance(path, str):
                skipped.append((direction.label, path))
                continue
            # In training mode, recurrent dropout may leave fewer finite exponents than asked.
            live = exponent_room(path, direction.label)
            if isinstance(live, str):
                skipped.append((direction.label, live))
                continue
            count = min(exponents, live[0])
            logs = lyapunov_logs(engine, path, count, compiled=compiled)
            gates = read_gates(engine, path) if known_gates(layer) is None else None
            measured = (measure(engine, path, stepped.call.mask, compiled or None)
                        if measure_horizon else None)
            readings.append(_reading(direction.label, layer, logs, path.ran, gates, measured))
    if not any(is_recurrent(engine, call) for call in calls):
        skipped.append(("the model", "it has no recurrent layer call: nothing to diagnose"))
    return readings, skipped


def _reading(label: str, layer: Any, logs: np.ndarray, ran: np.ndarray, gates: Any,
             measured: Any) -> CallReading:
    """One call's (direction's) reading: the exponents of its Lyapunov ``logs``, the shares of
    its :class:`~gradscope.keras.diagnose.gates.GateReading` (None: not known, and why), the
    horizon predicted from λ₁, the one measured (None: not measured), and what diagnose would
    warn of λ₁ (:func:`~gradscope.dynamics.settling`)."""
    from gradscope.keras.diagnose import at_floor
    from gradscope.keras.diagnose.gates import known_gates

    spectrum, _ = dynamics.lyapunov_exponents(logs, ran)
    largest = float(spectrum[0]) if len(spectrum) else None

    def floored() -> bool:  # λ₁'s direction at the scan's floor (asked of an unsettled λ₁)
        return bool(at_floor(logs, ran)[..., dynamics.column_order(logs, ran)[0]].any())

    return CallReading(
        call=label, class_name=class_label(layer), cell=class_label(layer.cell),
        lyapunov=[float(v) for v in spectrum],
        gates=None if gates is None else gates.shares(), gates_note=known_gates(layer),
        predicted=dynamics.predicted_horizon(largest),
        measured=None if measured is None else measured.horizon,
        window=None if measured is None else measured.window,
        lyapunov_note=dynamics.settling(logs, ran, largest, floored))
