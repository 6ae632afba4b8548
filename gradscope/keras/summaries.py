"""TensorBoard summaries of the GradientFlow callback, so that a stock TensorBoard shows a run's
gradient flow, and ``gradscope watch`` reads all of it back without TensorFlow.

Each observation is one ``Summary`` protocol buffer: scalars (‖∂L/∂w‖, ‖∂L/∂h0‖, the flow
ratio and flag, the loss), one image per recurrent layer (the heatmap of log10 ‖∂L/∂h_t‖
across training), and gradscope's own plugin tensors, which TensorBoard's dashboards ignore,
for the rest. The tags and what they show: docs/training.md, "TensorBoard".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.image import metadata as image_metadata
from tensorboard.plugins.scalar.summary_v2 import scalar_pb
from tensorboard.util.tensor_util import make_tensor_proto

from gradscope.diagnosis_record import CallReading, as_json
from gradscope.report.models import FlowHistoryReport, KerasMixedPrecision, KerasPerExample
from gradscope.training_log import (
    DIAGNOSIS_TAG,
    FLAG_PREFIX,
    IMAGE_PREFIX,
    LOSS_TAG,
    MIXED_PREFIX,
    MIXED_TAG,
    OBSERVATION_TAG,
    PER_EXAMPLE_PREFIX,
    PER_EXAMPLE_TAG,
    PLUGIN,
    PROFILE_PREFIX,
    RATIO_PREFIX,
    RUN_TAG,
    STATE_PREFIX,
    WEIGHT_PREFIX,
    diagnose_scalars,
)

#: viridis at 0, ¼, ½, ¾ and 1: enough anchors for a heatmap without matplotlib.
VIRIDIS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98],
                    [253, 231, 37]], dtype=np.float64)
MISSING = np.array([128, 128, 128], dtype=np.float64)  # a step not analysed: grey
#: The heatmap's size: at least this wide and high (cells are whole pixels), rows kept at most.
IMAGE_WIDTH, IMAGE_HEIGHT, IMAGE_ROWS = 320, 160, 400
FLAG_CODES = {"vanishing": -1.0, None: 0.0, "exploding": 1.0}


def profile_image(profiles: list[list[float] | None]) -> tuple[np.ndarray, str]:
    """(1, H, W, 3) uint8: rows observations, columns time steps, colour log10 ‖∂L/∂h_t‖
    scaled to the image's own range; and the image's description."""
    kept = profiles[-IMAGE_ROWS:]
    steps = max((len(p) for p in kept if p), default=1)
    grid = np.full((len(kept), steps), np.nan)
    for row, profile in enumerate(kept):
        if profile:
            grid[row, :len(profile)] = profile
    positive = np.isfinite(grid) & (grid > 0)
    logs = np.where(positive, np.log10(np.where(positive, grid, 1.0)), np.nan)
    low = float(np.nanmin(logs)) if positive.any() else 0.0
    high = float(np.nanmax(logs)) if positive.any() else 0.0
    scaled = (logs - low) / (high - low) if high > low else np.where(positive, 0.5, np.nan)
    position = np.clip(np.nan_to_num(scaled, nan=0.0), 0, 1) * (len(VIRIDIS) - 1)
    below = np.minimum(np.floor(position).astype(int), len(VIRIDIS) - 2)
    fraction = (position - below)[..., None]
    colours = VIRIDIS[below] * (1 - fraction) + VIRIDIS[below + 1] * fraction
    colours[~positive] = MISSING
    cell_w = max(1, math.ceil(IMAGE_WIDTH / steps))
    cell_h = max(1, math.ceil(IMAGE_HEIGHT / len(kept)))
    image = np.repeat(np.repeat(colours, cell_h, axis=0), cell_w, axis=1)
    # TensorBoard shows the description of a tag's first image only: no per-image numbers.
    description = ("log10 ‖∂L/∂h_t‖ across training: one row per observation (the first at the "
                   "top), one column per time step (t = 0 at the left); dark purple is the "
                   "smallest value in the image, yellow the largest; grey: not analysed. "
                   "`gradscope watch` prints the numbers.")
    return np.round(image).astype(np.uint8)[None], description


#: TensorBoard's own scalar entry (``scalar_pb``), each scalar written a copy of it with its
#: tag and value: the same bytes, without its metadata and tensor built anew for each (a
#: diagnosis's 12 scalars and its write 1.61 -> 0.92 ms).
_SCALAR = scalar_pb("scalar", 0.0).value[0]


def add_scalar(summary: Any, tag: str, value: float) -> None:
    """``value`` added to ``summary`` under ``tag``, as ``scalar_pb(tag, value)`` builds it
    (a float32 tensor of shape (), TensorBoard's scalar metadata; the protocol buffer rounds
    the value to float32 as ``scalar_pb`` does)."""
    entry = summary.value.add()
    entry.CopyFrom(_SCALAR)
    entry.tag = tag
    entry.tensor.float_val[0] = float(value)


class FlowSummaryWriter:
    """One ``tf.summary`` file writer in ``log_dir``; flushed after every observation, so that
    ``gradscope watch`` and TensorBoard see each one as it happens.

    An observation is one ``Summary`` protocol buffer, built in Python with TensorBoard's own
    scalar and image metadata and written with one ``tf.summary.experimental.write_raw_pb``:
    the same events as a ``tf.summary.scalar`` per value would write, without one TensorFlow
    op per value (a model with many weights has many), beside the training it watches."""

    def __init__(self, tf: Any, log_dir: str | Path) -> None:
        self.tf = tf
        self.writer = tf.summary.create_file_writer(str(log_dir))
        metadata = summary_pb2.SummaryMetadata()
        metadata.plugin_data.plugin_name = PLUGIN
        self.metadata = metadata
        #: Whether an observation has written the run's description (whole: written once).
        self.run_written = False
        #: Whether a diagnosis has: before the first observation the description knows no
        #: weight and no recurrent layer, and stays the same until one comes.
        self.run_described = False

    @property
    def wants_run(self) -> bool:
        """Whether a diagnosis written now should carry the run's description: until an
        observation or a diagnosis has written it."""
        return not (self.run_written or self.run_described)

    def _tensor(self, summary: Any, tag: str, value: Any) -> None:
        """gradscope's own plugin tensor: JSON text, or a profile in float64."""
        summary.value.add(tag=tag, metadata=self.metadata, tensor=make_tensor_proto(value))

    def write(self, history: FlowHistoryReport, run: dict[str, Any],
              details: dict[str, Any]) -> None:
        """The last observation of ``history`` (and, the first time, the run's description)."""
        tf = self.tf
        summary = summary_pb2.Summary()

        def scalar(tag: str, value: float) -> None:
            add_scalar(summary, tag, value)

        index = len(history.observations) - 1
        observation = history.observations[index]
        step = observation.step
        if not self.run_written:
            self._tensor(summary, RUN_TAG, json.dumps(run, ensure_ascii=False))
        # What the history says was not analysed at this step, beyond the recurrent calls
        # (a mixed policy's section that could not be taken), goes with the details too.
        listed = {(e["layer"], e["reason"]) for e in details.get("not_analysed", [])}
        more = [{"layer": e.layer, "reason": e.reason} for e in history.not_analysed
                if step in e.steps and (e.layer, e.reason) not in listed]
        if more:
            details = {**details, "not_analysed": [*details.get("not_analysed", []), *more]}
        self._tensor(summary, OBSERVATION_TAG, json.dumps(details, ensure_ascii=False))
        if observation.loss is not None:
            scalar(LOSS_TAG, observation.loss)
        for weight in history.weights:
            value = weight.norms[index]
            if value is not None:
                scalar(WEIGHT_PREFIX + weight.weight, value)
        for series in history.recurrent:
            for state, norms in series.initial_state_norms.items():
                norm = norms[index]
                if norm is not None:
                    scalar(f"{STATE_PREFIX}{series.layer}/{state}", norm)
            profile = series.profiles[index]
            if profile is None:
                continue
            ratio = series.ratios[index]
            if ratio is not None:
                scalar(RATIO_PREFIX + series.layer, ratio)
                scalar(FLAG_PREFIX + series.layer, FLAG_CODES[series.flags[index]])
            self._tensor(summary, PROFILE_PREFIX + series.layer, np.asarray(profile, np.float64))
            image, description = profile_image(series.profiles)
            png = tf.image.encode_png(image[0]).numpy()
            height, width = image.shape[1:3]
            summary.value.add(
                tag=IMAGE_PREFIX + series.layer,
                metadata=image_metadata.create_summary_metadata(display_name=None,
                                                                description=description),
                tensor=make_tensor_proto(np.array(
                    [str(width).encode(), str(height).encode(), png], dtype=object)))
        mixed = (history.mixed_precision or [None] * (index + 1))[index]
        if mixed is not None:
            self._tensor(summary, MIXED_TAG, json.dumps(mixed.to_dict(), ensure_ascii=False))
            for tag, value in mixed_scalars(mixed).items():
                scalar(tag, value)
        examples = (history.per_example or [None] * (index + 1))[index]
        if examples is not None:
            self._tensor(summary, PER_EXAMPLE_TAG,
                         json.dumps(examples.to_dict(), ensure_ascii=False))
            for tag, value in per_example_scalars(examples).items():
                scalar(tag, value)
        self._written(summary, step)
        self.run_written = True

    def write_run(self, step: int, run: dict[str, Any]) -> None:
        """The run's description alone, at ``step``: at the end of every fit, with the
        batches trained (watch reads a run that observed nothing, and says why)."""
        summary = summary_pb2.Summary()
        self._tensor(summary, RUN_TAG, json.dumps(run, ensure_ascii=False))
        self._written(summary, step)

    def write_diagnosis(self, step: int, readings: list[CallReading],
                        skipped: list[tuple[str, str]], run: dict[str, Any] | None) -> None:
        """One diagnosis (``GradientFlow(diagnose_every=N)``) at ``step``: the scalars of
        :func:`~gradscope.training_log.diagnose_scalars` and the readings as JSON; with
        ``run``, the run's description too (a diagnosis may come before any observation)."""
        summary = summary_pb2.Summary()
        if run is not None:
            self._tensor(summary, RUN_TAG, json.dumps(run, ensure_ascii=False))
            self.run_described = True
        self._tensor(summary, DIAGNOSIS_TAG,
                     json.dumps(as_json(readings, skipped), ensure_ascii=False))
        for tag, value in diagnose_scalars(readings).items():
            add_scalar(summary, tag, value)
        self._written(summary, step)

    def _written(self, summary: Any, step: int) -> None:
        """``summary`` written at ``step`` as one event, and flushed (watch reads it live)."""
        with self.writer.as_default():
            self.tf.summary.experimental.write_raw_pb(
                self.tf.constant([summary.SerializeToString()]), step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def mixed_scalars(section: KerasMixedPrecision) -> dict[str, float]:
    """One observation's mixed-precision scalars by tag (see ``training_log.MIXED_PREFIX``)."""
    values = {f"{MIXED_PREFIX}loss_scale": section.loss_scale,
              f"{MIXED_PREFIX}warnings": float(len(section.warnings))}
    if section.scale_range is not None:
        values[f"{MIXED_PREFIX}scale_range_low"] = section.scale_range[0]
        values[f"{MIXED_PREFIX}scale_range_high"] = section.scale_range[1]
        values[f"{MIXED_PREFIX}in_range"] = float(bool(section.in_range))
    for tensor in section.tensors:
        for kind in ("underflow", "subnormal", "overflow"):
            values[f"{MIXED_PREFIX}{kind}/{tensor.label}"] = getattr(tensor, kind)
    return values


def per_example_scalars(section: KerasPerExample) -> dict[str, float]:
    """One observation's per-example scalars by tag (see ``training_log.PER_EXAMPLE_PREFIX``);
    a quantity that is undefined at this observation (B_simple of one example) has none."""
    values = {f"{PER_EXAMPLE_PREFIX}noise_scale": section.noise_scale,
              f"{PER_EXAMPLE_PREFIX}top_share": section.top_share,
              f"{PER_EXAMPLE_PREFIX}max_over_median": section.max_over_median()}
    for layer, norms in section.layers.items():
        values[f"{PER_EXAMPLE_PREFIX}median/{layer}"] = float(np.median(norms))
    return {tag: value for tag, value in values.items() if value is not None}
