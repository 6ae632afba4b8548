"""What ``GradientFlow(diagnose_every=N)`` has diagnosed during training, series by series: one
value per diagnosis for every recurrent call's top Lyapunov exponents, gate shares and horizons
(None where a diagnosis gave nothing for the call).

Without TensorFlow: the callback records with it, and ``gradscope watch`` rebuilds the same
series from the event files with it (each diagnosis is written as JSON, :func:`as_json`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from gradscope.report.models import DiagnosisSeries, GateShares, NotAnalysedAt


@dataclass
class CallReading:
    """One direction of one recurrent call, read on one batch: the top exponents (nats per
    step), the gate shares (None: ``gates_note`` says why), the predicted horizon and the
    measured one with its window (None: not measured)."""

    call: str
    class_name: str
    cell: str
    lyapunov: list[float]
    gates: dict[str, GateShares] | None
    gates_note: str | None
    predicted: float | None
    measured: int | None
    window: int | None
    #: Why λ₁ (and the horizon predicted from it) is no firmer than this call's steps make
    #: it, as diagnose warns (too few steps, or not settled over them); None where it settled
    #: (and in event files written before it was recorded).
    lyapunov_note: str | None = None


def as_json(readings: list[CallReading], skipped: list[tuple[str, str]]) -> dict[str, Any]:
    """One diagnosis as the JSON the event files hold (exact: not TensorBoard's float32)."""
    calls = []
    for reading in readings:
        # Field by field: asdict deep-copies the gates' models first (a fifth of a write).
        entry = {field.name: getattr(reading, field.name) for field in fields(reading)}
        entry["lyapunov"] = list(reading.lyapunov)
        entry["gates"] = (None if reading.gates is None else
                          {name: shares.to_dict() for name, shares in reading.gates.items()})
        calls.append(entry)
    return {"calls": calls, "not_diagnosed": [{"layer": c, "reason": r} for c, r in skipped]}


def from_json(document: dict[str, Any]) -> tuple[list[CallReading], list[tuple[str, str]]]:
    """The readings :func:`as_json` wrote."""
    readings = []
    for entry in document.get("calls", []):
        gates = entry.get("gates")
        readings.append(CallReading(**{
            **entry, "gates": None if gates is None else
            {name: GateShares.model_validate(shares) for name, shares in gates.items()}}))
    return readings, [(e["layer"], e["reason"]) for e in document.get("not_diagnosed", [])]


class DiagnosisRecord:
    """The series of every diagnosis so far."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self._series: dict[str, dict[str, Any]] = {}
        self._skipped: dict[tuple[str, str], list[int]] = {}

    def add(self, readings: list[CallReading], skipped: list[tuple[str, str]],
            step: int) -> None:
        """Record one diagnosis, taken at ``step``."""
        index = len(self.steps)
        self.steps.append(step)
        for reading in readings:
            series = self._series.setdefault(reading.call, {
                "class_name": reading.class_name, "cell": reading.cell,
                "gates_note": reading.gates_note,
                **{key: [None] * index for key in _KEYS}})
            series["lyapunov"].append(reading.lyapunov)
            series["gates"].append(reading.gates)
            series["horizon_predicted"].append(reading.predicted)
            series["horizon_measured"].append(reading.measured)
            series["horizon_window"].append(reading.window)
            series["lyapunov_note"].append(reading.lyapunov_note)
        for series in self._series.values():
            for key in _KEYS:
                series[key].extend([None] * (index + 1 - len(series[key])))
        for call, reason in skipped:
            self._skipped.setdefault((call, reason), []).append(step)

    def series(self) -> list[DiagnosisSeries]:
        return [DiagnosisSeries(call=call, class_name=s["class_name"], cell=s["cell"],
                                gates_note=s["gates_note"],
                                **{key: list(s[key]) for key in _KEYS})
                for call, s in self._series.items()]

    def not_diagnosed(self) -> list[NotAnalysedAt]:
        return [NotAnalysedAt(layer=call, reason=reason, steps=list(steps))
                for (call, reason), steps in self._skipped.items()]


_KEYS = ("lyapunov", "gates", "horizon_predicted", "horizon_measured", "horizon_window",
         "lyapunov_note")


__all__ = ["CallReading", "DiagnosisRecord", "as_json", "from_json"]
