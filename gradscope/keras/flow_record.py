"""What ``GradientFlow`` has observed during training, series by series: one value per
observation for every weight's ‖∂L/∂w‖ and every recurrent call's ‖∂L/∂h0‖, profile, ratio
and flag (None where an observation gave nothing), and the report made of them."""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.dynamics import FLOW_FACTOR
from gradscope.keras.engine import KerasPass, call_label
from gradscope.keras.flow import per_step_norms, recurrence_flag
from gradscope.keras.probed_flow import LoopFlow, loop_flows
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
          "initial states; the total ‖∂L/∂h_t‖ per step from the same backward pass, where "
          "Keras' own loop of each recurrent layer adds a zero to every state after every "
          "step and the tape's gradient on it is the total; norms are Frobenius over the "
          "batch")
NOT_PROBED = ("its loop is not Keras' own over a cell (a fused kernel, or a loop the layer "
              "writes itself): no zero could be added to its states")


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
        #: Each weight's name by its Keras path, as explain names it (``lstm/kernel``); a path
        #: not here is named by itself.
        self.names: dict[str, str] = {}

    def next_step(self) -> int:
        """One more than the last recorded step (1 at first)."""
        return self.observations[-1].step + 1 if self.observations else 1

    def add(self, engine: Any, inputs: dict[str, np.ndarray], result: KerasPass, step: int,
            epoch: int | None) -> list[KerasNotAnalysed]:
        """Record one observation: ``result`` is its pass, its loops probed. Returns the
        calls it could not analyse, with why."""
        index = len(self.observations)
        size = int(next(iter(inputs.values())).shape[0])
        self.observations.append(TrainingObservation(
            step=step, epoch=epoch, loss=result.loss if np.isfinite(result.loss) else None,
            batch_size=size))
        for variable in engine.model.trainable_variables:
            shape, norms = self._weights.setdefault(
                self.names.get(variable.path, variable.path),
                ([int(d) for d in variable.shape], [None] * index))
            norms.append(_norm(result.gradients.get(variable.path)))
        skipped: list[KerasNotAnalysed] = []
        for call in result.calls:
            label = call_label(call.layer, call.index)
            found = result.state_totals.get(label)
            if found is None:
                skipped.append(KerasNotAnalysed(layer=label, reason=NOT_PROBED))
                continue
            state_grads = list(result.state_gradients.get(label, []))
            for loop in loop_flows(engine.operation(call.layer), label, found, call.mask):
                names = _initial_names(loop)
                mine, state_grads = state_grads[:len(names)], state_grads[len(names):]
                reason = self._series(loop, names, mine, index)
                if reason is not None:
                    skipped.append(KerasNotAnalysed(layer=loop.label, reason=reason))
        for entry in skipped:
            self._skipped.setdefault((entry.layer, entry.reason), []).append(step)
        self._pad(index + 1)
        return skipped

    def _series(self, loop: LoopFlow, names: list[str], gradients: list[Any],
                index: int) -> str | None:
        """Add one direction's values to its series; why its profile is missing, if it is."""
        totals = loop.totals
        output = totals.output_state if totals.output_state is not None else 0
        profile = per_step_norms(totals.totals[output])
        ratio, reason = None, None
        if not np.all(np.isfinite(profile)):
            reason = "NaN or Inf in ∂L/∂h_t: no profile, ratio or flag"
            profile = []
        else:
            ratio = loop.carried()
        flag = recurrence_flag(loop.label, ratio, len(profile), loop.ran)
        series = self._recurrent.setdefault(loop.label, {
            "class_name": loop.class_name, "units": int(totals.totals[output].shape[-1]),
            "backwards": totals.backwards, "states": {name: [None] * index for name in names},
            "profiles": [None] * index, "ratios": [None] * index, "flags": [None] * index})
        for name, gradient in zip(names, gradients + [None] * len(names), strict=False):
            series["states"].setdefault(name, [None] * index).append(_norm(gradient))
        series["profiles"].append(profile or None)
        series["ratios"].append(ratio)
        series["flags"].append(flag.kind if flag is not None else None)
        return reason

    def _pad(self, count: int) -> None:
        """Every series one value per observation: None where this one gave nothing."""
        for _, norms in self._weights.values():
            norms.extend([None] * (count - len(norms)))
        for series in self._recurrent.values():
            for key in ("profiles", "ratios", "flags"):
                series[key].extend([None] * (count - len(series[key])))
            for norms in series["states"].values():
                norms.extend([None] * (count - len(norms)))

    def report(self, source: str, loss: str, every: int | None) -> FlowHistoryReport:
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


def with_sections(report: FlowHistoryReport, field: str, label: str, sections: dict[int, Any],
                  refused_at: dict[int, str]) -> FlowHistoryReport:
    """``report`` with a section recorded beside the flow (explain's mixed_precision or
    per_example) under ``field``, one per observation (None where none was taken; ``sections``
    and ``refused_at`` by the observation's index), and the observations that could not take
    it in ``not_analysed`` under ``label``, with why; as it is where nothing was recorded."""
    steps = [o.step for o in report.observations]
    refused: dict[str, list[int]] = {}
    for index, reason in sorted(refused_at.items()):
        refused.setdefault(reason, []).append(steps[index])
    update: dict[str, Any] = {}
    if refused:
        update["not_analysed"] = [*report.not_analysed, *(
            NotAnalysedAt(layer=label, reason=reason, steps=at)
            for reason, at in refused.items())]
    if sections:
        update[field] = [sections.get(index) for index in range(len(steps))]
    return report.model_copy(update=update) if update else report


def _initial_names(loop: LoopFlow) -> list[str]:
    """The names of a loop's initial states (h0, c0, states[k]), as ‖∂L/∂h0‖ is recorded."""
    return [f"{n}0" if n in ("h", "c") else n for n in loop.names]


__all__ = ["METHOD", "FlowRecord", "with_sections"]
