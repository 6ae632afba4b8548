"""Pure-Python shape algebra: every weight and initial state of a spec, with its shape, the
formula that gives it (the user's numbers substituted), and what its rows and columns hold.

Never imports TensorFlow: ``gradscope shapes`` answers from here alone, and the TF engine's
real gradient shapes are cross-checked against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

from gradscope.cells import CELLS, Block, Cell, TensorInfo
from gradscope.errors import ConfigError
from gradscope.yaml.config import LayerSpec, Spec


@dataclass(frozen=True)
class DenseLayer:
    """A dense layer applied at every step (or to the last step only).

    ``tf1_scope`` is the scope ``tf.layers.dense`` gives it in the canonical TF1 program:
    ``dense`` for the first, then ``dense_1``, ``dense_2``, …
    """

    name: str
    units: int
    input_size: int
    input_label: str
    layout: str
    tf1_scope: str = "dense"

    def weights(self, positions_note: str, output_label: str) -> list[TensorInfo]:
        u_in, u = self.input_size, self.units
        source = self.input_label.removesuffix(" units")
        rows = (Block(0, u_in, f"{source} output"),)
        columns = (Block(0, u, output_label),)
        return [
            TensorInfo(
                name=f"{self.name}/kernel", layer=self.name, short="kernel",
                alias=self._alias("kernel"), alias_source=self._alias_source, shape=(u_in, u),
                formula=f"{self.input_label} {u_in} × units {u}",
                role=f"maps each {source} output to {u} output{'s' if u != 1 else ''}",
                rows=rows, columns=columns, note=positions_note,
            ),
            TensorInfo(
                name=f"{self.name}/bias", layer=self.name, short="bias",
                alias=self._alias("bias"), alias_source=self._alias_source, shape=(u,),
                formula=f"units {u}",
                role="bias of the outputs", columns=columns, note=positions_note,
            ),
        ]

    def _alias(self, short: str) -> str:
        # TF1 tf.layers.dense scopes its variables as dense/kernel; Keras 3 as <layer>/kernel.
        return f"{self.tf1_scope if self.layout == 'block' else self.name}/{short}"

    @property
    def _alias_source(self) -> Literal["tf1", "keras"]:
        return "tf1" if self.layout == "block" else "keras"


@dataclass(frozen=True)
class ModelShapes:
    """The whole algebra of one spec.

    ``aliases`` replaces the derived alias of a weight, by gradscope name: weights read from a
    checkpoint are shown under the checkpoint's own variable names (``alias_source``
    ``"checkpoint"``).
    """

    spec: Spec
    cells: tuple[Cell, ...]
    dense: tuple[DenseLayer, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def weights(self) -> tuple[TensorInfo, ...]:
        out: list[TensorInfo] = []
        for cell in self.cells:
            out.extend(cell.weights())
        note = self.dense_sum_note
        label = "logits of the classes" if self.spec.loss == "softmax_cross_entropy" else "outputs"
        for layer in self.dense:
            out.extend(layer.weights(note, label))
        return tuple(
            replace(info, alias=self.aliases[info.name], alias_source="checkpoint")
            if info.name in self.aliases else info
            for info in out
        )

    @cached_property
    def states(self) -> tuple[TensorInfo, ...]:
        out: list[TensorInfo] = []
        for cell in self.cells:
            out.extend(cell.states(self.spec.batch_size))
        return tuple(out)

    @property
    def weight_count(self) -> int:
        return sum(info.size for info in self.weights)

    @property
    def positions(self) -> int:
        """How many (example, step) positions the dense layers see."""
        spec = self.spec
        return spec.batch_size * spec.time_steps if spec.sequence_output else spec.batch_size

    @property
    def dense_sum_note(self) -> str:
        spec = self.spec
        if spec.sequence_output:
            return (
                f"its gradient is a sum over batch {spec.batch_size} × time {spec.time_steps} = "
                f"{self.positions} positions"
            )
        return (
            f"its gradient is a sum over batch {spec.batch_size} only: the dense layer sees the "
            "last step (return_sequences false)"
        )

    @property
    def chain(self) -> str:
        parts = [f"input {self.spec.input_size}"]
        parts += [f"{layer.name}({layer.units})" for layer in self.spec.layers]
        return " → ".join(parts)

    @property
    def output_shape(self) -> tuple[int, ...]:
        spec = self.spec
        if spec.sequence_output:
            return (spec.batch_size, spec.time_steps, spec.output_size)
        return (spec.batch_size, spec.output_size)

    def by_name(self) -> dict[str, TensorInfo]:
        return {info.name: info for info in (*self.weights, *self.states)}


def build_cells(spec: Spec) -> tuple[tuple[Cell, ...], tuple[DenseLayer, ...]]:
    """The cells and dense layers of ``spec``, each with the scope of its aliases.

    Block-layout cells are scoped as the canonical TF1 program scopes them: one
    ``MultiRNNCell`` run by ``dynamic_rnn`` gives ``rnn/multi_rnn_cell/cell_<k>/gru_cell/…``
    (k counts the block-layout cells from 0), a single cell ``rnn/gru_cell/…``; then
    ``tf.layers.dense`` gives ``dense/kernel``, ``dense_1/kernel``, …
    """
    block_cells = sum(layer.recurrent and layer.layout == "block" for layer in spec.layers)
    cells: list[Cell] = []
    dense: list[DenseLayer] = []
    size, label = spec.input_size, "input"
    for index, layer in enumerate(spec.layers):
        if layer.recurrent:
            if layer.layout != "block":
                scope = layer.name or ""
            elif block_cells > 1:
                scope = f"rnn/multi_rnn_cell/cell_{sum(c.layout == 'block' for c in cells)}"
            else:
                scope = "rnn"
            cells.append(_make_cell(index, layer, size, label, scope))
        else:
            tf1_scope = "dense" if not dense else f"dense_{len(dense)}"
            dense.append(DenseLayer(layer.name or "", layer.units, size, label,
                                    layout=spec.layout, tf1_scope=tf1_scope))
        size, label = layer.units, f"{layer.name} units"
    return tuple(cells), tuple(dense)


def _make_cell(index: int, layer: LayerSpec, input_size: int, input_label: str,
               scope: str) -> Cell:
    cell_class = CELLS.get(layer.cell_key)
    if cell_class is None:
        supported = ", ".join(sorted(CELLS))
        raise ConfigError(
            f"key 'layers[{index}]': {layer.type} in the {layer.layout} layout is not "
            f"supported yet; expected one of {supported}",
            where=f"layers[{index}]",
        )
    options = {"reset_after": layer.reset_after} if layer.reset_after is not None else {}
    return cell_class(
        name=layer.name or "",
        units=layer.units,
        input_size=input_size,
        input_label=input_label,
        options=options,
        scope=scope,
    )


def model_shapes(spec: Spec, aliases: Mapping[str, str] | None = None) -> ModelShapes:
    """The algebra of ``spec``; ``aliases`` (gradscope name → variable name) overrides the
    derived aliases, e.g. with a checkpoint's names."""
    cells, dense = build_cells(spec)
    return ModelShapes(spec=spec, cells=cells, dense=dense, aliases=dict(aliases or {}))
