"""The interface every layer module implements, and the records it returns."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Any, ClassVar, TypeVar

from gradscope.cells.base import Block, TensorInfo, meaning

Shape = tuple[int | None, ...]


@dataclass(frozen=True)
class LayerFacts:
    """What the algebra of one layer call may use: its saved config and its tensors' shapes."""

    name: str
    class_name: str
    config: dict[str, Any]
    #: Shapes of the tensors the call received (positional first), batch axis included as None.
    input_shapes: tuple[Shape, ...] = ()
    #: Where each input comes from, for formulas: "input" (a model input) or "<layer> output".
    input_labels: tuple[str, ...] = ()
    output_shapes: tuple[Shape, ...] = ()

    @property
    def input_shape(self) -> Shape:
        return self.input_shapes[0] if self.input_shapes else ()

    @property
    def features(self) -> int:
        """The last axis of the first input: what a kernel's rows see."""
        last = self.input_shape[-1] if self.input_shape else None
        if last is None:
            raise ValueError(f"layer {self.name}: the last axis of its input is unknown")
        return int(last)

    @property
    def input_label(self) -> str:
        return self.input_labels[0] if self.input_labels else "input"

    def label(self, k: int, unnamed: str = "input") -> str:
        """Where input ``k`` comes from, for formulas; "input 1" (``unnamed`` 1) if not known."""
        return self.input_labels[k] if k < len(self.input_labels) else f"{unnamed} {k}"

    def option(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def inner(self) -> LayerFacts:
        """The layer a wrapper (TimeDistributed, Bidirectional) holds, seeing this call's input
        (TimeDistributed strips the time axis for its inner layer)."""
        wrapped = self.config["layer"]
        shapes = self.input_shapes
        if self.class_name == "TimeDistributed":
            shapes = tuple((shape[0], *shape[2:]) for shape in shapes)
        return LayerFacts(name=str(wrapped["config"].get("name", wrapped["class_name"])),
                          class_name=str(wrapped["class_name"]), config=wrapped["config"],
                          input_shapes=shapes, input_labels=self.input_labels)


@dataclass(frozen=True)
class WeightNote:
    """One weight of a layer: its shape and the arithmetic behind it."""

    #: The variable's path inside the layer, cell scopes left out: "kernel" for a GRU's
    #: gru/gru_cell/kernel, "forward_gru/kernel" inside a Bidirectional, "query/kernel" in MHA.
    key: str
    shape: tuple[int, ...]
    formula: str
    role: str
    rows: tuple[Block, ...] = ()
    columns: tuple[Block, ...] = ()
    note: str = ""
    trainable: bool = True  # False: Keras keeps it out of the gradient (moving statistics)

    @property
    def meaning(self) -> str:
        return meaning(self.role, self.shape, self.rows, self.columns, self.note)

    @classmethod
    def from_tensor(cls, info: TensorInfo, key: str | None = None, note: str = "") -> WeightNote:
        return cls(key=key or info.short, shape=info.shape, formula=info.formula,
                   role=info.role, rows=info.rows, columns=info.columns,
                   note="; ".join(part for part in (info.note, note) if part))

    def prefixed(self, prefix: str) -> WeightNote:
        return WeightNote(key=f"{prefix}/{self.key}", shape=self.shape, formula=self.formula,
                          role=self.role, rows=self.rows, columns=self.columns, note=self.note,
                          trainable=self.trainable)


@dataclass(frozen=True)
class StateNote:
    """One initial state of a recurrent layer: ``h0`` (or ``forward/h0`` in a Bidirectional)."""

    key: str
    units: int
    role: str


class LayerExplainer:
    """Subclass, set ``class_names``, and decorate with ``@register`` (a layer without weights
    may be one function instead: see :func:`explains`)."""

    class_names: ClassVar[tuple[str, ...]] = ()

    def derives(self, facts: LayerFacts) -> bool:
        """Whether this layer's weights are derived here. A wrapper whose wrapped layer or
        cell has no derivation (``TimeDistributed(Conv2D)``, ``RNN(StackedRNNCells)``) is
        listed like an unknown layer: real gradients, "no derivation for this layer type"."""
        return True

    def summary(self, facts: LayerFacts) -> str:
        """One line: what the layer computes, in the user's numbers."""
        return facts.class_name

    def weights(self, facts: LayerFacts) -> list[WeightNote]:
        """Every weight, trainable or not, in any order; [] for a layer without weights."""
        return []

    def gradient_note(self, facts: LayerFacts) -> str:
        """What the layer does to the gradient that flows back through it."""
        return ""

    def states(self, facts: LayerFacts) -> list[StateNote]:
        """The initial states of a recurrent layer, in the order Keras takes them."""
        return []


@dataclass(frozen=True)
class Sentences:
    """What the report says of a layer without weights, both from the same numbers: what it
    computes, in the user's numbers, and what it does to the gradient that flows back."""

    summary: str
    gradient_note: str


class SentencesExplainer(LayerExplainer):
    """A layer without weights explained by one function of its facts (see :func:`explains`)."""

    def __init__(self, explain: Callable[[LayerFacts], Sentences]) -> None:
        self.explain = explain

    def summary(self, facts: LayerFacts) -> str:
        return self.explain(facts).summary

    def gradient_note(self, facts: LayerFacts) -> str:
        return self.explain(facts).gradient_note


REGISTRY: dict[str, LayerExplainer] = {}

E = TypeVar("E", bound=type[LayerExplainer])
F = TypeVar("F", bound=Callable[[LayerFacts], Sentences])


def _add(class_names: tuple[str, ...], explainer: LayerExplainer) -> None:
    for name in class_names:
        if name in REGISTRY:
            raise RuntimeError(f"two explainers for Keras layer {name}")
        REGISTRY[name] = explainer


def register(cls: E) -> E:
    _add(cls.class_names, cls())
    return cls


def explains(*class_names: str) -> Callable[[F], F]:
    """Registers a function of a weightless layer's facts that returns its :class:`Sentences`,
    for the Keras layers ``class_names`` (as TensorFlow registers one gradient function per
    op): the layer's numbers are read once, for both sentences.

    A layer with weights, states or a wrapped layer subclasses :class:`LayerExplainer`."""

    def decorate(function: F) -> F:
        _add(class_names, SentencesExplainer(function))
        return function

    return decorate


def activation_note(activation: str | None) -> str:
    """What an activation does to the gradient that flows back through it."""
    return ACTIVATION_NOTES.get(activation or "linear", f"multiplies it by {activation}'(z)")


ACTIVATION_NOTES: dict[str, str] = {
    "linear": "passes it unchanged (linear)",
    "relu": "passes it where z > 0 and zeroes it elsewhere (relu'(z) is 0 or 1)",
    "sigmoid": "multiplies it by σ(z)(1−σ(z)) ≤ 0.25",
    "tanh": "multiplies it by 1−tanh²(z) ≤ 1",
    "softmax": "multiplies it by the softmax Jacobian diag(p)−p pᵀ (with cross-entropy the "
               "logits' gradient is p − target)",
    "elu": "multiplies it by 1 where z > 0 and by elu(z)+1 elsewhere",
    "gelu": "multiplies it by gelu'(z)",
    "swish": "multiplies it by σ(z)(1 + z(1−σ(z)))",
    "silu": "multiplies it by σ(z)(1 + z(1−σ(z)))",
    "softplus": "multiplies it by σ(z)",
    "leaky_relu": "passes it where z > 0 and scales it by the negative slope elsewhere",
    "selu": "multiplies it by selu'(z)",
    "hard_sigmoid": "passes it scaled where the hard sigmoid is not saturated, zero elsewhere",
    "exponential": "multiplies it by exp(z)",
}


def batch_positions(facts: LayerFacts, excluded: set[int]) -> str:
    """"the batch × 12 positions": the batch and every axis of the input not in ``excluded``
    (the feature axes a per-feature weight keeps), over which such a weight's gradient sums."""
    rank = len(facts.input_shape)
    others = [facts.input_shape[i] for i in range(1, rank) if i not in excluded]
    if not others:
        return "the batch"
    sizes = [size for size in others if size is not None]
    if len(sizes) != len(others):
        return "the batch and every position"
    if len(sizes) == 1:
        return f"the batch × {sizes[0]} positions"
    return (f"the batch × {' × '.join(str(s) for s in sizes)} = batch × {prod(sizes)} "
            "positions")


#: A cell's scope in a variable path: ``gru_cell``, ``minimal_rnn_cell_1``.
CELL_SCOPE = re.compile(r".*_cell(_\d+)?")


def variable_key(path: str, layer_name: str, layer_path: str | None = None) -> str:
    """A Keras variable path as a :class:`WeightNote` key: the owning layer's name and the cell
    scopes left out ("gru/gru_cell/kernel" → "kernel", "bidirectional/forward_gru/gru_cell/
    kernel" → "forward_gru/kernel", "multi_head_attention/query/kernel" → "query/kernel").

    ``layer_path`` is the layer's own scope (``layer.path``): a model built in memory creates
    its weights inside the model's scope ("sequential/gru/gru_cell/kernel"), a loaded one
    does not."""
    if layer_path and path.startswith(layer_path + "/"):
        path = layer_name + path[len(layer_path):]
    parts = path.split("/")
    if parts and parts[0] == layer_name:
        parts = parts[1:]
    # A cell's scope, numbered or not (Keras numbers a cell of the user's as it makes it:
    # minimal_rnn_cell_1 in one run, minimal_rnn_cell_2 when the model is built again).
    return "/".join(part for part in parts if not CELL_SCOPE.fullmatch(part))
