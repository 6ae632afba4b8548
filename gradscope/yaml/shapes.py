"""``gradscope shapes`` for a YAML config: the shape algebra alone, without TensorFlow."""

from __future__ import annotations

from gradscope.cells.base import TensorInfo
from gradscope.report.models import (
    BlockEntry,
    LayerEntry,
    LossEntry,
    ModelEntry,
    ShapesReport,
    TensorEntry,
)
from gradscope.yaml.algebra import ModelShapes, model_shapes
from gradscope.yaml.config import Spec


def shapes(spec: Spec) -> ShapesReport:
    """The shape algebra alone: no TensorFlow."""
    algebra = model_shapes(spec)
    return ShapesReport(
        model=model_entry(algebra, data="none (shapes only)"),
        loss=LossEntry(name=spec.loss, value=None),
        tensors=[tensor_entry(info) for info in algebra.weights],
        initial_states=[tensor_entry(info) for info in algebra.states],
    )


def model_entry(algebra: ModelShapes, data: str) -> ModelEntry:
    spec = algebra.spec
    return ModelEntry(
        chain=algebra.chain,
        input_size=spec.input_size,
        time_steps=spec.time_steps,
        batch_size=spec.batch_size,
        layout=spec.layout,
        dtype=spec.dtype,
        seed=spec.seed,
        weight_count=algebra.weight_count,
        dense_positions=algebra.positions,
        data=data,
        layers=[LayerEntry(**layer.model_dump()) for layer in spec.layers],
    )


def tensor_entry(info: TensorInfo) -> TensorEntry:
    return TensorEntry(
        name=info.name,
        alias=info.alias,
        alias_source=info.alias_source,
        layer=info.layer,
        shape=list(info.shape),
        formula=info.formula,
        meaning=info.meaning,
        rows=[BlockEntry(start=b.start, stop=b.stop, label=b.label) for b in info.rows],
        columns=[BlockEntry(start=b.start, stop=b.stop, label=b.label) for b in info.columns],
    )
