"""``gradscope watch LOG_DIR``: read back what the GradientFlow callback wrote to TensorBoard
event files, as the same report ``callback.history`` is, without importing TensorFlow.

The event files are read with TensorBoard's own record reader and protocol buffers (its
TensorFlow-free ``compat`` layer, which checks every record's CRC). The tags are the ones
``gradscope.keras.summaries`` writes; everything else in the files (Keras' own TensorBoard
callback writing into the same folder, say) is left alone.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

from gradscope.diagnosis_record import CallReading, DiagnosisRecord, from_json
from gradscope.errors import ConfigError
from gradscope.report.models import (
    FlowHistoryReport,
    KerasMixedPrecision,
    KerasPerExample,
    NonFiniteEntry,
    NotAnalysedAt,
    RecurrentFlowSeries,
    TrainingObservation,
    WeightNormSeries,
)

#: gradscope's own plugin name: TensorBoard's dashboards ignore its tensors, which hold what
#: the scalars and images do not (the run's description, each observation's details, and the
#: per-step profiles in float64).
PLUGIN = "gradscope"
RUN_TAG = "gradscope/run"
#: GradientFlow(stop_on_nan=True)'s diagnosis, written in the log_dir as JSON.
NONFINITE_FILE = "nonfinite.json"
OBSERVATION_TAG = "gradscope/observation"
LOSS_TAG = "gradscope/loss"
WEIGHT_PREFIX = "gradient_norm/"
STATE_PREFIX = "initial_state_gradient/"
RATIO_PREFIX = "flow_ratio/"
FLAG_PREFIX = "flow_flag/"
IMAGE_PREFIX = "flow_profile/"
PROFILE_PREFIX = "flow_profile_values/"
FLAG_VALUES = {-1.0: "vanishing", 0.0: None, 1.0: "exploding"}
#: GradientFlow(diagnose_every=N): per diagnosed step, every call's reading as JSON (exact),
#: and scalars for TensorBoard's dashboards under diagnose/<call>/… (see diagnose_scalars).
DIAGNOSIS_TAG = "gradscope/diagnosis"
DIAGNOSE_PREFIX = "diagnose/"
#: Under a mixed policy: each observation's mixed_precision section as JSON (what ``gradscope
#: watch`` reads back, exactly), and scalars for TensorBoard under this prefix: loss_scale,
#: scale_range_low, scale_range_high, in_range (1 or 0), warnings (how many), and
#: underflow/PATH, subnormal/PATH, overflow/PATH (the shares of each tensor's entries).
MIXED_TAG = "gradscope/mixed_precision"
MIXED_PREFIX = "mixed_precision/"
#: With GradientFlow(per_example=True): each observation's per_example section as JSON (what
#: ``gradscope watch`` reads back, exactly), and scalars for TensorBoard under this prefix:
#: noise_scale (B_simple), top_share, max_over_median (the largest ‖g_i‖ over the median) and
#: median/LAYER (the median of the examples' ‖g_i‖ of each layer).
PER_EXAMPLE_TAG = "gradscope/per_example"
PER_EXAMPLE_PREFIX = "per_example/"


def tensorboard_install_line() -> str:
    from gradscope.report.plot import matplotlib_install_line

    return matplotlib_install_line().replace(" matplotlib", " tensorboard")


def require_tensorboard(where: str) -> None:
    """TensorBoard is an extra (``tensorflow-cpu`` does not bring it): looked up, not imported.
    """
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{where} needs tensorboard, which is not installed; install it with: "
                          + tensorboard_install_line(), where=where)


def event_files(log_dir: Path) -> list[Path]:
    """The event files in ``log_dir`` and its sub-folders, in name order (which is time order
    within one folder: the names start with the creation time)."""
    return sorted(p for p in log_dir.rglob("events.out.tfevents.*") if p.is_file())


def _records(path: Path) -> list[Any]:
    """Every event of one file, stopping quietly at a record still being written."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    reader = PyRecordReader_New(str(path))
    events = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            break
        except errors.DataLossError as exc:
            if "truncated" in str(exc):  # the writer is still writing this record
                break
            detail = str(exc.message).replace(str(path), "").strip()
            raise ConfigError(f"{path}: not a readable event file ({detail}); expected the "
                              "TensorBoard event files GradientFlow writes", where=str(path)
                              ) from None
        event = event_pb2.Event()
        event.ParseFromString(reader.record())
        events.append(event)
    return events


def _value(summary_value: Any) -> Any:
    from tensorboard.util import tensor_util

    if summary_value.HasField("tensor"):
        array = tensor_util.make_ndarray(summary_value.tensor)
        if array.dtype.kind in "SO":
            return array.item().decode("utf-8") if array.ndim == 0 else array
        return array
    return summary_value.simple_value


def _tags(events: list[Any]) -> dict[str, dict[int, Any]]:
    """tag → step → value, for gradscope's tags (a later event of a step wins)."""
    by_tag: dict[str, dict[int, Any]] = {}
    prefixes = (LOSS_TAG, RUN_TAG, OBSERVATION_TAG, WEIGHT_PREFIX, STATE_PREFIX, RATIO_PREFIX,
                FLAG_PREFIX, PROFILE_PREFIX, DIAGNOSIS_TAG, MIXED_TAG, PER_EXAMPLE_TAG)
    for event in events:
        if not event.HasField("summary"):
            continue
        for value in event.summary.value:
            if value.tag.startswith(prefixes):
                by_tag.setdefault(value.tag, {})[int(event.step)] = _value(value)
    return by_tag


def _number(value: Any) -> float | None:
    number = float(value)
    return number if math.isfinite(number) else None


def watch(log_dir: str | os.PathLike[str]) -> FlowHistoryReport:
    """The history the GradientFlow callback wrote to ``log_dir``: exit 2 (ConfigError) when
    the folder does not exist or holds no gradscope events."""
    folder = Path(log_dir)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "no such folder"
        raise ConfigError(f"{folder}: {what}; expected the log_dir given to "
                          "gradscope.keras.GradientFlow", where=str(folder))
    require_tensorboard("gradscope watch")
    files = event_files(folder)
    if not files:
        raise ConfigError(f"{folder}: holds no TensorBoard event files (events.out.tfevents.*)"
                          "; expected the log_dir given to gradscope.keras.GradientFlow",
                          where=str(folder))
    by_folder: dict[Path, list[list[Any]]] = {}
    for path in files:  # name order is time order within a folder
        by_folder.setdefault(path.parent, []).append(_records(path))
    earlier: dict[Path, int] = {}  # runs written before the newest to the same folder
    runs: dict[Path, dict[str, dict[int, Any]]] = {}
    for parent, per_file in by_folder.items():
        # Each writer starts its own file. One whose steps start again at or below those
        # already written is another run (a notebook cell run again writes beside the
        # first, and their steps would mix); one whose steps go on is the same callback's
        # next fit.
        newest, last = 0, -1
        for k, events in enumerate(per_file):
            steps = [int(event.step) for event in events if event.HasField("summary")
                     and any(v.tag == RUN_TAG for v in event.summary.value)]
            if steps and min(steps) <= last:
                newest = k
                earlier[parent] = earlier.get(parent, 0) + 1
            last = max([last, *steps])
        tags = _tags([event for events in per_file[newest:] for event in events])
        if RUN_TAG in tags:
            runs[parent] = tags
    written = folder / NONFINITE_FILE  # GradientFlow(stop_on_nan=True) stopped the run
    document = _diagnosis(written) if written.is_file() else None
    if not runs and document is not None and "run" in document:
        # Stopped before its first observation: the run's description is in the diagnosis.
        runs = {folder: {RUN_TAG: {0: json.dumps(document["run"])}}}
    if not runs:
        raise ConfigError(f"{folder}: its {len(files)} event file(s) hold no gradscope events; "
                          "expected the log_dir given to gradscope.keras.GradientFlow",
                          where=str(folder))
    if len(runs) > 1:
        names = ", ".join(str(r.relative_to(folder)) for r in sorted(runs))
        raise ConfigError(f"{folder}: holds {len(runs)} gradscope runs ({names}); expected one: "
                          "give its folder", where=str(folder))
    parent = next(iter(runs))
    source = str(folder)
    if earlier.get(parent):
        count = earlier[parent]
        source += (f" (its newest run: {count} earlier run{'s' if count > 1 else ''} written "
                   "to the same folder left out; give each run its own log_dir)")
    history = history_from_tags(runs[parent], source)
    if document is not None:
        try:
            found = NonFiniteEntry.model_validate(document["nonfinite"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{written}: is not the diagnosis GradientFlow writes ({exc})",
                              where=str(written)) from None
        history = history.model_copy(update={"nonfinite": found,
                                             "nonfinite_step": document.get("step")})
    return history


def diagnose_scalars(readings: list[CallReading]) -> dict[str, float]:
    """The TensorBoard scalars of one diagnosis, by tag: per call, λ_i (nats per step), each
    gate's shares below 0.1 and above 0.9 (fractions of 1) and the horizons (steps)."""
    scalars: dict[str, float] = {}
    for reading in readings:
        tag = f"{DIAGNOSE_PREFIX}{reading.call}/"
        for rank, value in enumerate(reading.lyapunov, start=1):
            scalars[f"{tag}lyapunov_{rank}"] = value
        for gate, shares in (reading.gates or {}).items():
            scalars[f"{tag}gate_{gate}_below_0_1"] = shares.below_0_1
            scalars[f"{tag}gate_{gate}_above_0_9"] = shares.above_0_9
        if reading.predicted is not None:
            scalars[f"{tag}horizon_predicted"] = reading.predicted
        if reading.measured is not None:
            scalars[f"{tag}horizon_measured"] = float(reading.measured)
    return scalars


def _diagnosis(written: Path) -> dict[str, Any]:
    """``nonfinite.json`` as GradientFlow(stop_on_nan=True) writes it (a JSON object), or exit
    2 saying what it is not."""
    try:
        document = json.loads(written.read_text())
    except ValueError as exc:
        raise ConfigError(f"{written}: is not the diagnosis GradientFlow writes ({exc})",
                          where=str(written)) from None
    if not isinstance(document, dict) or not isinstance(document.get("run", {}), dict):
        raise ConfigError(f"{written}: is not the diagnosis GradientFlow writes (expected a "
                          "JSON object)", where=str(written))
    return document


def history_from_tags(tags: dict[str, dict[int, Any]], source: str) -> FlowHistoryReport:
    runs = tags.get(RUN_TAG, {})
    run = json.loads(runs[max(runs)])
    observed = tags.get(OBSERVATION_TAG, {})
    steps = sorted(observed)
    details = {step: json.loads(observed[step]) for step in steps}

    def series(tag: str) -> list[float | None]:
        values = tags.get(tag, {})
        return [_number(values[s]) if s in values else None for s in steps]

    losses = series(LOSS_TAG)
    observations = [TrainingObservation(step=s, epoch=details[s].get("epoch"), loss=loss,
                                        batch_size=details[s].get("batch_size"))
                    for s, loss in zip(steps, losses, strict=True)]
    weights = [WeightNormSeries(weight=w["weight"], shape=w["shape"],
                                norms=series(WEIGHT_PREFIX + w["weight"]))
               for w in run["weights"]]
    recurrent = []
    for layer in run["recurrent"]:
        name = layer["layer"]
        profiles_by_step = tags.get(PROFILE_PREFIX + name, {})
        flags = [FLAG_VALUES.get(v) if v is not None else None
                 for v in series(FLAG_PREFIX + name)]
        recurrent.append(RecurrentFlowSeries(
            layer=name, class_name=layer["class_name"], units=layer["units"],
            initial_state_norms={state: series(f"{STATE_PREFIX}{name}/{state}")
                                 for state in layer["states"]},
            profiles=[[float(v) for v in profiles_by_step[s]] if s in profiles_by_step
                      else None for s in steps],
            ratios=series(RATIO_PREFIX + name), flags=flags,  # type: ignore[arg-type]
            backwards=layer.get("backwards", False)))
    mixed = tags.get(MIXED_TAG, {})
    examples = tags.get(PER_EXAMPLE_TAG, {})
    skipped: dict[tuple[str, str], list[int]] = {}
    for step in steps:
        for entry in details[step].get("not_analysed", []):
            skipped.setdefault((entry["layer"], entry["reason"]), []).append(step)
    diagnosed = tags.get(DIAGNOSIS_TAG, {})
    record = DiagnosisRecord()
    for step in sorted(diagnosed):
        record.add(*from_json(json.loads(diagnosed[step])), step)
    return FlowHistoryReport(
        diagnose_every=run.get("diagnose_every"),
        diagnose_exponents=run.get("diagnose_exponents"),
        diagnose_examples=run.get("diagnose_examples"), diagnosis_steps=record.steps,
        diagnoses=record.series(), not_diagnosed=record.not_diagnosed(),
        source=source, loss=run["loss"], mode=run["mode"], every=run.get("every"),
        batches=run.get("batches"),
        flag_factor=run["flag_factor"], method=run["method"] + "; read back from the event "
        "files (TensorBoard stores scalars in float32)", observations=observations,
        weights=weights, recurrent=recurrent,
        not_analysed=[NotAnalysedAt(layer=layer, reason=reason, steps=at)
                      for (layer, reason), at in skipped.items()],
        mixed_precision=[KerasMixedPrecision.model_validate_json(mixed[s]) if s in mixed
                         else None for s in steps] if mixed else None,
        per_example=[KerasPerExample.model_validate_json(examples[s]) if s in examples
                     else None for s in steps] if examples else None)
