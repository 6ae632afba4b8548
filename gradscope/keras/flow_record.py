"""What ``GradientFlow`` has observed during training, series by series: one value per
observation for every weight's ‖∂L/∂w‖ and every recurrent call's ‖∂L/∂h0‖, profile, ratio
and flag (None where an observation gave nothing), and the report made of them."""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.gradient_stats import FLOW_FACTOR
from gradscope.keras.engine import KerasPass
from gradscope.keras.flow import (
    carried_ratio,
    per_step_norms,
    recurrence_flag,
    recurrent_calls,
    total_state_gradients,
)
from gradscope.report.models import (
    FlowHistoryReport,
    KerasNotAnalysed,
    NotAnalysedAt,
    RecurrentFlowSeries,
    TrainingObservation,
    WeightNormSeries,
)

METHOD = ("one extra forward and backward pass on the current batch, with the model's loss, in "
          "inference mode: ‖∂L/∂w‖ from the tape; ‖∂L/∂h0‖ from the tape with explicit zero "
          "initial states; the total ‖∂L/∂h_t‖ per step from gradscope's NumPy reference BPTT "
          "(float64) fed the tape's ∂L/∂(layer outputs); norms are Frobenius over the batch")


class _Batch:
    """What ``gradient_flow``'s helpers need of a job: the batch's inputs by name."""

    def __init__(self, inputs: dict[str, np.ndarray]) -> None:
        self.inputs = inputs


class _Job:
    def __init__(self, inputs: dict[str, np.ndarray]) -> None:
        self.batch = _Batch(inputs)


def _norm(gradient: Any) -> float | None:
    """‖g‖ (Frobenius, float64); None for no gradient or a non-finite norm."""
    if gradient is None:
        return None
    value = float(np.sqrt(np.sum(np.asarray(gradient, np.float64) ** 2)))
    return value if np.isfinite(value) else None


class FlowRecord:
    """The series of every observation so far."""

    def __init__(self) -> None:
        self.observations: list[TrainingObservation] = []
        self._weights: dict[str, tuple[list[int], list[float | None]]] = {}
        self._recurrent: dict[str, dict[str, Any]] = {}
        self._skipped: dict[tuple[str, str], list[int]] = {}

    def next_step(self) -> int:
        """One more than the last recorded step (1 at first)."""
        return self.observations[-1].step + 1 if self.observations else 1

    def add(self, engine: Any, inputs: dict[str, np.ndarray], result: KerasPass,
            weights: dict[str, np.ndarray], step: int,
            epoch: int | None) -> list[KerasNotAnalysed]:
        """Record one observation: ``result`` is its pass, ``weights`` the recurrent layers'
        weights it ran with. Returns the calls it could not analyse, with why."""
        usable, skipped = recurrent_calls(_Job(inputs), engine, result, weights)
        index = len(self.observations)
        size = int(next(iter(inputs.values())).shape[0])
        self.observations.append(TrainingObservation(
            step=step, epoch=epoch, loss=result.loss if np.isfinite(result.loss) else None,
            batch_size=size))
        for variable in engine.model.trainable_variables:
            shape, norms = self._weights.setdefault(
                variable.path, ([int(d) for d in variable.shape], [None] * index))
            norms.append(_norm(result.gradients.get(variable.path)))
        for entry in skipped:
            self._skipped.setdefault((entry.layer, entry.reason), []).append(step)
        for recurrent in usable:
            totals = total_state_gradients(recurrent, result)
            if isinstance(totals, str):
                skipped.append(KerasNotAnalysed(layer=recurrent.label, reason=totals))
                self._skipped.setdefault((recurrent.label, totals), []).append(step)
                continue
            state_grads = result.state_gradients.get(recurrent.label, [])
            for unit, (total, direct) in zip(recurrent.units, totals, strict=True):
                mine, state_grads = (state_grads[:unit.state_count],
                                     state_grads[unit.state_count:])
                profile = per_step_norms(total)
                ratio = None
                if not np.all(np.isfinite(profile)):
                    reason = "NaN or Inf in ∂L/∂h_t: no profile, ratio or flag"
                    skipped.append(KerasNotAnalysed(layer=unit.label, reason=reason))
                    self._skipped.setdefault((unit.label, reason), []).append(step)
                    profile = []
                else:
                    ratio = carried_ratio(total, direct)
                flag = recurrence_flag(unit.label, ratio, len(profile))
                series = self._recurrent.setdefault(unit.label, {
                    "class_name": unit.class_name, "units": int(unit.cell.units),
                    "backwards": unit.backwards,
                    "states": {name: [None] * index for name in unit.cell.state_names},
                    "profiles": [None] * index, "ratios": [None] * index,
                    "flags": [None] * index})
                for name, gradient in zip(unit.cell.state_names, mine, strict=True):
                    series["states"][name].append(_norm(gradient))
                series["profiles"].append(profile or None)
                series["ratios"].append(ratio)
                series["flags"].append(flag.kind if flag is not None else None)
        self._pad(index + 1)
        return skipped

    def _pad(self, count: int) -> None:
        """Every series one value per observation: None where this one gave nothing."""
        for _, norms in self._weights.values():
            norms.extend([None] * (count - len(norms)))
        for series in self._recurrent.values():
            for key in ("profiles", "ratios", "flags"):
                series[key].extend([None] * (count - len(series[key])))
            for norms in series["states"].values():
                norms.extend([None] * (count - len(norms)))

    def report(self, source: str, loss: str, every: int) -> FlowHistoryReport:
        return FlowHistoryReport(
            source=source, loss=loss, mode="inference", every=every,
            flag_factor=FLOW_FACTOR, method=METHOD, observations=list(self.observations),
            weights=[WeightNormSeries(weight=name, shape=shape, norms=list(norms))
                     for name, (shape, norms) in self._weights.items()],
            recurrent=[RecurrentFlowSeries(
                layer=label, class_name=s["class_name"], units=s["units"],
                initial_state_norms={k: list(v) for k, v in s["states"].items()},
                profiles=list(s["profiles"]), ratios=list(s["ratios"]),
                flags=list(s["flags"]), backwards=s["backwards"])
                for label, s in self._recurrent.items()],
            not_analysed=[NotAnalysedAt(layer=layer, reason=reason, steps=list(steps))
                          for (layer, reason), steps in self._skipped.items()])


__all__ = ["METHOD", "FlowRecord"]
