"""Report objects: what the library returns and both renderers (text, JSON) draw.

They are pydantic models so that ``to_dict()`` and the published JSON Schema
(``gradscope schema``) come from one definition.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator


class _Report(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """In IPython and notebooks, a part of a report (``report.summary``, ``report.carry``)
        shows its fields as the JSON has them, one to a line, under its class's name."""
        printer.text(type(self).__name__ + " ")
        if cycle:
            printer.text("{...}")
        else:
            printer.pretty(self.to_dict())

    def __str__(self) -> str:
        """``print(report.summary)`` in a script: the same view, its fields one to a line (a
        whole report prints as the terminal shows it)."""
        import pprint

        return type(self).__name__ + " " + pprint.pformat(self.to_dict(), sort_dicts=False)


#: How a report draws itself: ``"html"`` (a notebook's rendering) and ``"figure"`` (a
#: matplotlib Figure), each registered by its renderer module when it is imported
#: (``gradscope.report.display``, ``gradscope.report.plot``): the renderers stand above these
#: models, which know nothing of them. The public API imports both before it returns a report.
DRAWERS: dict[str, Callable[[Any], Any]] = {}


def json_text(data: Any) -> str:
    """One JSON document, as ``--json`` prints it (NaN and Inf are never written)."""
    return json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


class _Displayed(_Report):
    """A report the user holds in Python: it draws itself in a notebook with the terminal's
    own renderer (same tables, formulas and flags), and as JSON."""

    def _repr_html_(self) -> str | None:
        draw = DRAWERS.get("html")
        return None if draw is None else str(draw(self))

    def __str__(self) -> str:
        """The report as the terminal shows it (``print(report)`` in a script); the fields
        are in ``repr(report)`` and ``to_dict()``."""
        draw = DRAWERS.get("text")
        return super().__str__() if draw is None else str(draw(self))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """In IPython's terminal: the report as gradscope's terminal shows it."""
        printer.text(str(self))

    def plot(self) -> Any:
        """A matplotlib Figure of the report's numbers (shown inline in a notebook); needs
        matplotlib."""
        draw = DRAWERS.get("figure")
        if draw is None:
            raise RuntimeError("report.plot() needs gradscope.report.plot: import it first "
                               "(gradscope's API does)")
        return draw(self)

    def to_json(self) -> str:
        """The document ``--json`` prints."""
        return json_text(self.to_dict())


class _CommandReport(_Displayed):
    """What a command returns: the JSON document starts with the schema's version and the
    command (each report narrows ``command`` to its own)."""

    schema_version: Literal["1"] = "1"
    command: str


class BlockEntry(_Report):
    start: int = Field(description="first index of the block")
    stop: int = Field(description="one past the last index")
    label: str


class LayerEntry(_Report):
    name: str
    type: str
    units: int
    layout: str | None = None
    reset_after: bool | None = None
    return_sequences: bool | None = None


class ModelEntry(_Report):
    chain: str = Field(description="e.g. 'input 200 → gru_1(64) → gru_2(32) → dense_1(3)'")
    input_size: int
    time_steps: int
    batch_size: int
    layout: str
    dtype: str
    seed: int
    weight_count: int
    dense_positions: int = Field(
        description="positions the dense layers sum over: batch × time, or batch only"
    )
    data: str = Field(description="where the batch came from, e.g. 'synthetic (seed 0)'")
    layers: list[LayerEntry]


class LossEntry(_Report):
    name: str
    value: float | None = Field(description="the mean loss; null if it is not finite")


class Stats(_Report):
    """Statistics of one gradient tensor, over its finite entries (null where none is: a
    gradient every value of which is NaN or Inf has no norm, not a norm of 0)."""

    l2: float | None = Field(description="L2 (Frobenius) norm of the finite entries; null "
                                         "where none is finite")
    mean_abs: float | None = Field(description="mean of |g| over the finite entries; null "
                                               "where none is finite")
    max_abs: float | None = Field(description="largest finite |g|; null where none is "
                                              "finite")
    nonfinite: int = Field(description="count of NaN and ±Inf entries")

    @model_validator(mode="after")
    def _null_only_without_finite(self) -> Stats:
        if self.nonfinite == 0 and None in (self.l2, self.mean_abs, self.max_abs):
            raise ValueError("a statistic is null, yet no entry is NaN or Inf")
        return self


class PerExampleNorms(_Report):
    """Each example's norm over its finite entries: min, median and max over the batch."""

    min: float
    median: float
    max: float


class TensorEntry(_Report):
    """What the shape algebra says about one tensor (no numbers from a run)."""

    name: str = Field(description="gradscope name, e.g. gru_1/w_ru")
    alias: str = Field(description="the name in the other naming: the TF1 variable "
                                   "(rnn/multi_rnn_cell/cell_0/gru_cell/gates/kernel), the "
                                   "Keras path (gru_1/gru_cell/kernel) or the checkpoint's own")
    alias_source: Literal["tf1", "keras", "checkpoint"] = Field(
        default="tf1",
        description="tf1: the name the canonical TF1 program (MultiRNNCell, dynamic_rnn, "
                    "tf.layers.dense) creates; keras: the Keras 3 variable path; checkpoint: "
                    "the name the weights were read under (a checkpoint's variable or an "
                    ".npz's array; the text says 'stored as')")
    layer: str
    shape: list[int]
    formula: str = Field(description="the shape's arithmetic with the model's numbers")
    meaning: str = Field(description="what the tensor does and what its rows/columns hold")
    rows: list[BlockEntry] = Field(default_factory=list)
    columns: list[BlockEntry] = Field(default_factory=list)


class GradientEntry(TensorEntry):
    stats: Stats


class StateGradientEntry(_Report):
    name: str = Field(description="e.g. gru_1/h0")
    alias: str
    layer: str
    shape: list[int]
    formula: str
    stats: Stats
    per_example_norm: PerExampleNorms = Field(
        description="min/median/max over the batch of each example's L2 norm"
    )


class CarryPair(_Report):
    y: str = Field(description="final state of the previous batch, e.g. gru_1/h_T")
    y_shape: list[int]
    grad_y: str = Field(description="this batch's initial-state gradient, e.g. gru_1/h0")
    grad_y_shape: list[int]


class CarryWeightEntry(_Report):
    """One weight's gradient with and without the carry across chunk boundaries."""

    name: str = Field(description="gradscope name, e.g. gru_1/w_ru")
    l2_full: float = Field(description="‖g_full‖: full BPTT over the whole batch")
    l2_truncated: float = Field(
        description="‖g_truncated‖: the same chunks, each backpropagated from zero at its end "
                    "(no carried gradients)")
    l2_carried: float = Field(description="‖g_full − g_truncated‖: what the carry adds")
    carried_share: float = Field(description="l2_carried / l2_full (0 when l2_full is 0)")


class CarryProductEntry(_Report):
    """The seed's tf.gradients(ys=chunk's final states, xs=its initial states, grad_ys=next
    chunk's ∂L/∂(initial states)), for one initial state of one chunk."""

    chunk: int = Field(description="the chunk the product goes through, from 0")
    start: int = Field(description="its first step")
    stop: int = Field(description="one past its last step")
    layer: str
    x: str = Field(description="the initial state the product lands on: gru_1/h0 for chunk 0, "
                               "gru_1/h[t=49] (the state step 49 produced) for a later one")
    y: str = Field(description="the chunk's final state, e.g. gru_1/h[t=99]")
    l2_grad_y: float = Field(description="‖grad_y‖: the next chunk's ∂L/∂(this initial state)")
    l2_product: float = Field(description="‖Σ_y (∂y/∂x)ᵀ grad_y‖ over all the chunk's final "
                                          "states y: what the carry adds to ∂L/∂x")


class CarryEntry(_Report):
    """How to carry gradients into the previous truncated batch; with ``explain --chunks K``,
    also how much the carry changes the gradients (``weights``, ``products``)."""

    pairs: list[CarryPair]
    ys_count: int
    weight_gradient_count: int
    wrong_call_error: str = Field(description="what passing the weight gradients raises")
    explanation: list[str]
    chunks: int | None = Field(default=None, description="K of --chunks (null without it)")
    chunk_lengths: list[int] | None = Field(default=None, description="steps per chunk")
    weights: list[CarryWeightEntry] | None = Field(
        default=None, description="per weight: full, truncated and carried gradient norms")
    products: list[CarryProductEntry] | None = Field(
        default=None, description="per chunk before a boundary and per initial state: the "
                                  "vector–Jacobian product the carry computes")
    threshold: float | None = Field(
        default=None, description="carried share from which carrying is said to matter")
    matters: bool | None = Field(
        default=None, description="some weight's carried_share is at least threshold")
    verdict: str | None = Field(default=None, description="the one line the text shows")


class _YamlRun(_CommandReport):
    """A report on a YAML config's model: the model the config builds, and its loss."""

    model: ModelEntry
    loss: LossEntry


class ShapesReport(_YamlRun):
    command: Literal["shapes"] = "shapes"
    tensors: list[TensorEntry]
    initial_states: list[TensorEntry]


class JacobianEntry(_Report):
    """∂(final state of one layer)/∂(initial state of a layer at or below it), per example."""

    target: str = Field(description="e.g. gru_2/h_T (an LSTM's state is [h_T, c_T])")
    source: str = Field(description="e.g. gru_1/h0 (an LSTM's is [h0, c0])")
    shape: list[int] = Field(description="(rows, columns) of each example's block")
    frobenius_median: float
    frobenius_min: float
    frobenius_max: float
    largest_singular_median: float
    smallest_singular_median: float
    smallest_singular_below: bool = Field(
        default=False, description="σ_min is below what the arithmetic resolves for most "
        "examples (max(rows, columns)·eps·σ_max): smallest_singular_median is then that "
        "floor's median, an upper bound")


class FlowFlag(_Report):
    what: str = Field(description="the sequence flagged, e.g. ∂L/∂gru_1/h_t")
    kind: Literal["vanishing", "exploding"]
    ratio: float = Field(description="a recurrent layer's: how much of ∂L/∂h its recurrence "
                                     "carries back from the last step it runs to the first; "
                                     "otherwise: the norm at the first step over the norm at "
                                     "the last")
    message: str


class InfluenceMap(_Report):
    steps: list[int] = Field(description="the state steps t of the rows")
    values: list[list[float]] = Field(description="rows t, columns s: median ‖∂h_t/∂x_s‖_F")


class FlowSection(_Report):
    steps: int
    state_gradient_norms: dict[str, list[float]] = Field(
        description="‖∂L/∂h_t‖ per step (Frobenius over the batch), per state sequence")
    input_gradient_norms: list[float] = Field(description="‖∂L/∂x_t‖ per step")
    influence_layer: str
    influence_step: int = Field(description="t of ‖∂h_t/∂x_s‖")
    influence: list[float] = Field(
        description="per input step s: the median over the batch of ‖∂h_t/∂x_s‖_F")
    flags: list[FlowFlag]
    influence_map: InfluenceMap | None = Field(default=None, description="with --plot")


class WeightMapEntry(_Report):
    """Where one of the spec's weights came from in a --weights file."""

    name: str = Field(description="gradscope name, e.g. gru_1/w_ru")
    variables: list[str] = Field(
        description="the file's own variable names it was read from (one, unless the "
                    "layouts differ), e.g. GRU_Layer1/rnn/gru_cell/gates/kernel")
    shape: list[int]
    conversion: str = Field(description="how the file's layout was rearranged; empty when "
                                        "the variable was taken as it is")


class IgnoredVariable(_Report):
    variable: str
    reason: str = Field(description="e.g. 'optimizer slot'")


class WeightsEntry(_Report):
    """The --weights file and the mapping of its variables onto the spec's weights."""

    source: str
    format: str = Field(description="'.npz archive', 'arrays', 'TF1 name-based checkpoint' "
                                    "or 'TF2 object-based checkpoint'")
    matched_by: str = Field(description="how the file's scopes were matched to the layers")
    mapping: list[WeightMapEntry]
    ignored: list[IgnoredVariable] = Field(
        description="variables that are no model weight (optimizer state, counters)")


#: A report's ``weights``: null unless the weights were read from a file (``--weights``).
WeightsFrom = Annotated[WeightsEntry | None, Field(
    description="with --weights: the file and where each weight came from")]

#: A check report's ``tolerances``.
Tolerances = Annotated[dict[str, float], Field(description="relative tolerance of each witness")]


class Inference(_Report):
    """Why one value of an inferred spec is what it is."""

    key: str = Field(description="the spec key or layer, e.g. input_size, layers[0] (gru_1)")
    value: Any
    variables: list[str] = Field(description="the file's variables it was read from (empty "
                                             "for a value the file cannot hold)")
    reason: str
    known: bool = Field(description="false for a default: the file cannot tell it")


class SpecInference(_Report):
    schema_version: Literal["1"] = "1"
    command: Literal["spec"] = "spec"
    source: str
    format: str
    yaml: str = Field(description="the config, with comments; gradscope loads it as it is")
    config: dict[str, Any] = Field(description="the same config as data")
    inferences: list[Inference]
    ignored: list[IgnoredVariable]


class ExplainReport(_YamlRun):
    command: Literal["explain"] = "explain"
    gradients: list[GradientEntry]
    initial_state_gradients: list[StateGradientEntry]
    carry: CarryEntry
    state_jacobians: list[JacobianEntry] | None = Field(
        default=None, description="with --jacobians: ∂h_T^(j)/∂h_0^(i) for i ≤ j")
    gradient_flow: FlowSection | None = Field(default=None, description="with --flow")
    weights: WeightsFrom = None
    not_finite: str | None = Field(
        default=None, description="where the loss or a gradient is not finite: what, in "
        "words, with what a float64 pass of the same model computes (exit 1); null otherwise")
    timings: dict[str, float] | None = Field(
        default=None, description="seconds per phase; only with --timings"
    )


class WitnessEntry(_Report):
    witness: str = Field(description="finite_differences, numpy_reference, gru_block_kernel, "
                                     "tbptt_carry, against, cell_steps or "
                                     "own_backward")
    error: float | None = Field(description="relative error; null when there is no number "
                                            "(e.g. a wrong shape)")
    tolerance: float
    passed: bool
    detail: str = ""
    first_bad_step: int | None = Field(
        default=None,
        description="for time-indexed tensors: the first step, counting back from the end, "
                    "where the values diverge")
    at_kink: bool = Field(
        default=False,
        description="every probe straddles a point where the loss has no derivative (relu "
                    "or a clip at its corner, a tie in a max): this witness says nothing here")
    unresolved: bool = Field(
        default=False,
        description="every probe left out, some because their central differences do not "
                    "settle as the step shrinks (a trajectory that amplifies every "
                    "perturbation): this witness says nothing here")
    left_out: str = Field(
        default="",
        description="the probes left out, in words: at a kink, or not resolved (empty where "
                    "none was); where every probe was, the detail says it too")


class CheckedTensor(_Report):
    name: str
    shape: list[int] | None
    passed: bool
    witnesses: list[WitnessEntry]
    path: str | None = Field(default=None, description="a Keras weight's own path "
                             "(variable.path), where the name is the layer and the key "
                             "explain names it by")


class NamedShape(_Report):
    name: str
    shape: list[int]
    norm: float | None = None


class CarryBoundaryEntry(_Report):
    step: int = Field(description="the time index where the later chunk starts")
    ys: list[NamedShape] = Field(description="the earlier chunk's final states")
    grad_ys: list[NamedShape] = Field(description="the later chunk's initial-state gradients")


class CarryCheck(_Report):
    chunks: int
    chunk_lengths: list[int]
    boundaries: list[CarryBoundaryEntry]


class ErratumEntry(_Report):
    number: int
    documented: str
    actual: str
    evidence: str
    confirmed: bool


class CheckSummary(_Report):
    passed: bool
    checked_tensors: int
    failed_tensors: list[str]
    witnesses: list[str]
    comparisons: int
    failures: int
    unwitnessed_tensors: list[str] = Field(
        default_factory=list,
        description="tensors no witness could compare (every probe at a kink, or finite "
                    "differences that do not settle as the step shrinks, and no other "
                    "witness): nothing contradicts them, and nothing confirms them; they are "
                    "not counted among the tensors that agree")


class CheckReport(_YamlRun):
    command: Literal["check"] = "check"
    tolerances: Tolerances
    tensors: list[CheckedTensor]
    carry: CarryCheck | None = None
    errata: list[ErratumEntry] | None = None
    against: str | None = Field(default=None, description="FILE.py:FUNC that was compared")
    against_not_returned: list[str] | None = Field(
        default=None,
        description="gradient names the --against function did not return: optional, so not "
                    "failures, but not checked by it (null without --against)")
    not_finite: str | None = Field(
        default=None, description="where the config's own dtype (float32) cannot hold the "
        "model's numbers, which check computes in float64: its loss or a gradient is not "
        "finite there, in words (the check fails); null otherwise")
    summary: CheckSummary
    weights: WeightsFrom = None
    timings: dict[str, float] | None = None
    _equations: str | None = PrivateAttr(default=None)

    @property
    def equations(self) -> str | None:
        """GRUBlockCellGrad's corrected backward equations, drawn with the report when asked
        for (``check(..., equations=True)``, ``check --equations``); not in the JSON report."""
        return self._equations

    def show_equations(self, text: str) -> None:
        self._equations = text


class LayerArgument(_Report):
    name: str = Field(description="x, h0 (c0), dh, or a key of params")
    shape: list[int] = Field(description="as passed to the function (--time-last: "
                                         "features first)")
    meaning: str


class LayerCheckReport(_CommandReport):
    """``check --against FILE.py:FUNC --layer NAME``: one recurrent layer's backward, given
    ∂L/∂h_t from above (dh), against TF autodiff of that layer in the real model."""

    command: Literal["check"] = "check"
    mode: Literal["layer"] = "layer"
    model: ModelEntry
    loss: LossEntry
    layer: str = Field(description="the recurrent layer checked, e.g. gru_1")
    cell: str = Field(description="its cell and weight layout, e.g. 'gru, block layout'")
    time_last: bool = Field(description="arrays laid out (features, batch, time), as in the "
                                        "classic course code")
    arguments: list[LayerArgument] = Field(description="what FUNC(x, h0, params, dh) received")
    tolerances: Tolerances
    tensors: list[CheckedTensor] = Field(description="named <layer>/<key>, the key as FUNC "
                                                     "returns it: x, h0, c0, a weight")
    against: str = Field(description="FILE.py:FUNC that was compared")
    against_not_returned: list[str] = Field(
        description="keys the function did not return: optional, so not failures, but not "
                    "checked")
    summary: CheckSummary
    weights: WeightsFrom = None
    timings: dict[str, float] | None = None


# -- the user's own Keras model ----------------------------------------------------------------


class KerasTensorSpec(_Report):
    name: str
    shape: list[int | None] = Field(description="null for an axis of any size; axis 0 is the "
                                                "batch")
    dtype: str | None = None


#: What inference mode changes in Keras' own layers (``KerasModelEntry.mode_effects``).
DROPOUT, NOISE, BATCH_NORM = ("dropout off", "noise off",
                              "batch norm uses its moving statistics")


class KerasModelEntry(_Report):
    name: str
    file: str
    kind: str = Field(description="Sequential, Functional, or Subclassed (its graph read "
                                  "from one symbolic call)")
    inputs: list[KerasTensorSpec]
    outputs: list[KerasTensorSpec]
    batch_size: int
    mode: Literal["inference", "training"] = Field(
        description="inference: dropout off, batch norm with its moving statistics; training: "
                    "as in fit, with a fixed seed")
    seed: int
    mode_effects: list[str] | None = Field(
        default=None, description="what inference mode changes in this model's layers "
        "(\"dropout off\", \"batch norm uses its moving statistics\"; empty: nothing); null "
        "where a layer of the user's own code may change too")
    weight_count: int = Field(description="trainable parameters (numbers, as Keras counts them)")
    non_trainable_count: int
    data: str
    data_digest: str | None = Field(
        default=None, description="sha256 of the batch's arrays (names, dtypes, shapes and "
        "bytes): the same data under any file name; gradscope diff compares it")
    dtype_policy: str | None = Field(
        default=None, description="the model's dtype policy where it computes in another "
        "dtype than its variables' (mixed_float16: float16 steps, float32 weights); null "
        "otherwise")
    compute_dtype: str | None = Field(default=None, description="with dtype_policy: the "
                                      "dtype its layers compute in")


class KerasOutputLoss(_Report):
    output: str
    loss: str
    from_logits: bool
    weight: float
    rule: str


class KerasLossTerm(_Report):
    """One term of the loss Keras minimises; the terms add up to the loss's value."""

    kind: Literal["output", "regularizer", "added"] = Field(
        description="an output's compiled loss (times its loss weight), a weight's "
                    "regularization penalty, or what a layer added during the call (activity "
                    "regularizer, add_loss)")
    name: str = Field(description="the output, the variable's path, or the layer")
    detail: str
    value: float | None
    settings: dict[str, Any] | None = Field(
        default=None, description="an output loss's settings: reduction, from_logits, "
                                  "label_smoothing, delta…")
    weight: float | None = Field(default=None, description="an output's loss weight")
    counted: str | None = Field(default=None, description="how much of the batch a mask or "
                                                          "sample weights count")


class KerasLossEntry(_Report):
    name: str = Field(description="what the header says: the losses and the rule that chose "
                                  "them")
    value: float | None
    source: Literal["option", "compiled", "inferred"]
    outputs: list[KerasOutputLoss]
    terms: list[KerasLossTerm] = Field(
        default_factory=list, description="the loss term by term, as Keras adds it up")


class KerasLayerEntry(_Report):
    name: str
    class_name: str
    calls: int
    input_shapes: list[list[int | None]] = Field(description="of the first call, batch axis "
                                                             "included")
    output_shapes: list[list[int | None]]
    summary: str
    gradient_note: str
    derivation: bool = Field(description="false: no derivation for this layer type (its "
                                         "gradients are still real and listed)")


class SparseRows(_Report):
    rows_with_gradient: int = Field(description="the rows the batch's token ids index: each "
                                    "gets a slice of the gradient (zeros for a masked token)")
    rows: int
    rows_nonzero: int | None = Field(default=None, description="the rows whose gradient is "
                                     "not 0")


class KerasGradientEntry(_Report):
    name: str = Field(description="<layer>/<weight>, e.g. encoder/kernel")
    path: str = Field(description="the Keras variable path, e.g. encoder/gru_cell/kernel")
    layer: str
    class_name: str
    shape: list[int]
    formula: str | None = Field(description="null when there is no derivation for the layer")
    meaning: str
    rows: list[BlockEntry] = Field(default_factory=list)
    columns: list[BlockEntry] = Field(default_factory=list)
    trainable: bool
    stats: Stats | None = Field(description="null for a weight that gets no gradient")
    sparse: SparseRows | None = Field(default=None, description="an Embedding's IndexedSlices")


class KerasStateEntry(_Report):
    name: str = Field(description="e.g. decoder/h0, bidirectional/forward/h0")
    layer: str
    shape: list[int]
    source: str = Field(description="zeros (Keras' default, made explicit by gradscope) or "
                                    "where the wired state comes from")
    flows_to: str = Field(description="where this gradient goes")
    stats: Stats | None
    per_example_norm: PerExampleNorms | None


class CrossCheckEntry(_Report):
    layer: str
    witness: str = Field(description="e.g. the NumPy reference cell gru_keras")
    max_abs_error: float | None
    tolerance: float = Field(description="relative: the limit applied is `allowed`")
    passed: bool | None = Field(description="null: not witnessed (see detail)")
    detail: str
    allowed: float | None = Field(
        default=None, description="the largest max_abs_error that passes: an absolute "
        "tolerance plus `tolerance` times the largest |value| of Keras' output; null where "
        "not witnessed")


class KerasFlowSequence(_Report):
    """‖∂L/∂h_t‖ of one recurrent call, or ‖∂L/∂x_t‖ of one sequence input, per step."""

    what: str = Field(description="e.g. ∂L/∂decoder[1]/h_t or ∂L/∂tokens_t")
    kind: Literal["state", "input"]
    source: str = Field(description="the layer call or the model input")
    norms: list[float] = Field(description="per step t: the Frobenius norm over the batch")
    backwards: bool = Field(default=False, description="a layer that reads the input backwards: "
                            "its steps are in processing order, t = 0 is the last input step")
    carried: float | None = Field(
        default=None, description="for the state the flag reads: how much of ∂L/∂s (every "
        "state joined) the recurrence carries back from each example's last step that ran to "
        "its first, the flag's ratio, flagged or not (null: not read here)")
    carried_examples: list[int] | None = Field(
        default=None, description="[how many examples, of how many that ran] the carried ratio "
        "is read on, where some get no gradient at their last step that ran (null: all)")
    examples_ran: list[int] | None = Field(
        default=None, description="per step t (the norms' order): how many examples ran it, "
        "where a mask skips some (a masked step's gradient is not read: it adds 0 to the "
        "norm); null where every example ran every step")


class KerasNotAnalysed(_Report):
    layer: str = Field(description="the layer call, e.g. decoder or gru[1]")
    reason: str


class KerasInfluence(_Report):
    """How each input step reaches one recurrent layer's output after step t."""

    source: str = Field(description="the recurrent call (and direction), e.g. lstm or "
                                    "both/backward")
    step: int = Field(description="t of ‖∂h_t/∂x_s‖, in the order the layer runs")
    influence: list[float] = Field(
        description="per input step s (input order): the median over the batch of "
                    "‖∂h_t/∂x_s‖_F, x the call's input")
    influence_map: InfluenceMap | None = Field(default=None, description="with --plot")


class KerasFlowSection(_Report):
    """With --flow: the total ∂L/∂h_t (from above at t plus what flows back from t+1) of every
    recurrent call, and ∂L/∂x_t of every float sequence input."""

    method: str
    sequences: list[KerasFlowSequence]
    not_analysed: list[KerasNotAnalysed]
    flags: list[FlowFlag]
    influence: list[KerasInfluence] = Field(
        default_factory=list, description="with --at or --plot: ‖∂h_t/∂x_s‖ of every "
                                          "recurrent call")


class KerasStateJacobians(_Report):
    """With --jacobians: ∂(final state)/∂(initial state) of every recurrent call, per example."""

    method: str
    entries: list[JacobianEntry]
    not_analysed: list[KerasNotAnalysed]


class KerasChunkedCall(_Report):
    """One direction of one recurrent call, cut into chunks of its own time axis."""

    layer: str = Field(description="the call (and direction): lstm, both/backward, gru[1]")
    steps: int
    chunk_lengths: list[int] = Field(description="steps per chunk, in time order")
    backwards: bool = Field(default=False, description="it runs from the last step back")


class KerasCarry(_Report):
    """With --chunks K: truncated BPTT on the Keras model, with and without the carry."""

    chunks: int
    dtype: str = Field(description="the dtype the cut runs computed in (the model's)")
    method: str
    calls: list[KerasChunkedCall]
    weights: list[CarryWeightEntry] = Field(
        description="per trainable weight: full (Keras' own tape), truncated and carried "
                    "gradient norms")
    products: list[CarryProductEntry] = Field(
        description="per chunk before a boundary and per state: the vector–Jacobian product "
                    "the carry computes")
    carried_error: float = Field(
        description="the largest relative error, over the weights, of the chunks' gradients "
                    "with the carry against Keras' own full gradients")
    threshold: float = Field(description="carried share from which carrying is said to matter")
    matters: bool
    verdict: str


class _KerasReport(_CommandReport):
    """A report on the user's own Keras model."""

    source: Literal["keras"] = "keras"


class _KerasRun(_KerasReport):
    """A report of a run of the user's Keras model: the model and the batch, and the loss."""

    model: KerasModelEntry
    loss: KerasLossEntry


class NonFiniteEntry(_Report):
    """Where the first NaN or Inf of a pass was born (only when the loss or a gradient is not
    finite), found on a rerun of the failing batch."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True,
                              populate_by_name=True)

    pass_: Literal["forward", "backward"] = Field(
        alias="pass", description="forward: a value of the model or its loss; backward: a "
                                  "gradient, the loss and every value being finite")
    origin: Literal["input", "target", "weight", "layer", "loss", "unknown"] = Field(
        description="what holds the first non-finite value: the data (an input or a "
                    "target), a weight, a layer call (or its backward), the loss (or its "
                    "backward)")
    layer: str | None = Field(description="the input's name (or the output's, for a target), "
                                          "the layer call ('gru', 'dense[1]'), 'loss' or the "
                                          "loss term")
    step: int | None = Field(description="the first time step (input order, from 0) that "
                                         "holds it; null where the tensor has no time axis")
    examples: list[int] = Field(description="the examples of the batch that hold it at that "
                                            "step")
    operation: str | None = Field(description="the TensorFlow op that made it from finite "
                                              "inputs (Exp, Log, RealDiv, MatMul, …)")
    operation_inputs: list[float] = Field(
        default_factory=list, description="max |x| of each float input of that op")
    cause: str = Field(description="the likely cause, in words, with the numbers")


class KerasPerExample(_Report):
    """With --per-example: each example's gradient norm ‖∂L_i/∂θ‖, where L_i is its share of
    the batch loss (its sample weight times e_i), so that the examples' gradients add up to
    the batch gradient less that of the added terms (regularizers, add_loss), which belong to
    no example."""

    l2: list[float] = Field(description="per example, the norm of its gradient over every "
                                        "trainable weight")
    layers: dict[str, list[float]] = Field(description="per layer (as gradients name it), one "
                                                       "norm per example")
    top_examples: int = Field(description="how many examples top_share counts: the top 10% "
                                          "by norm, at least 1")
    top_share: float | None = Field(description="the share of Σ_i ‖g_i‖² that the top_examples "
                                                "largest carry; null when every g_i is 0")
    outliers: list[int] = Field(description="the examples whose norm exceeds the median by "
                                            "more than 3.5 × 1.4826 × MAD, largest first")
    noise_scale: float | None = Field(
        description="B_simple = tr(Σ)/|G|² (McCandlish et al. 2018), Σ the unbiased "
                    "covariance of B·g_i, G = Σ_i g_i: a hint from one batch at the batch "
                    "size beyond which a larger one helps little; null for one example or G = "
                    "0")
    added_terms: float | None = Field(description="the loss's added terms (regularizers, "
                                                  "add_loss), which no example's share holds; "
                                                  "null when there are none")
    method: str
    dtype: str = Field(description="the dtype the gradients computed in (the model's)")

    def max_over_median(self) -> float | None:
        """The largest ‖g_i‖ over the median one (how far the batch's largest gradient stands
        out); None where the median is 0."""
        middle = statistics.median(self.l2) if self.l2 else 0.0
        return max(self.l2) / middle if middle > 0 else None


class MixedPrecisionTensor(_Report):
    """One gradient tensor under a mixed policy: the shares of its entries lost at the current
    loss scale, by the float32 shadow, and the same counted on the model's own backward."""

    path: str = Field(description="a weight's path, or a recurrent call's state after every "
                                  "step (layer/h_t): ∂L/∂s_t as the backward carries it")
    name: str | None = Field(default=None, description="what the report calls it: a weight "
                             "as explain and check name it (lstm/kernel), a state as its "
                             "path; null in a report of an earlier gradscope")
    kind: str = Field(description='"weight" or "state"')
    entries: int
    underflow: float = Field(description="the share whose shadow gradient g ≠ 0 becomes 0 as "
                                         "g × scale cast to the compute dtype")
    subnormal: float = Field(description="the share that becomes subnormal (nonzero, below "
                                         "the smallest normal)")
    overflow: float = Field(description="the share that becomes infinite")
    mixed: list[float] = Field(description="[underflow, subnormal, overflow] as the mixed "
                                           "model's own scaled backward gives them (0 where "
                                           "the shadow's is not; not finite)")
    agrees: bool = Field(description="mixed is within 1% of the entries (or one entry) of the "
                                     "shadow's shares")

    @property
    def label(self) -> str:
        """The tensor as the report calls it (its name; its path in an earlier report)."""
        return self.name or self.path


class KerasMixedPrecision(_Report):
    """Under a mixed dtype policy: what the compute dtype loses at the optimizer's loss scale,
    against a float32 shadow of the same step."""

    policy: str
    compute_dtype: str
    optimizer: str = Field(description="the model's optimizer, in words")
    loss_scale: float = Field(description="what fit multiplies the loss by "
                                          "(optimizer.scale_loss)")
    scale_range: list[float] | None = Field(
        description="[low, high]: the scales s with s × max |g| ≤ the largest finite and s × "
                    "min nonzero |g| ≥ the smallest normal, over every tensor listed (the "
                    "whole model); low > high when none does; null when every g is 0")
    in_range: bool | None = Field(description="whether loss_scale is in scale_range")
    smallest: float | None = Field(description="the smallest nonzero |g| of the shadow")
    largest: float | None = Field(description="the largest |g| of the shadow")
    tensors: list[MixedPrecisionTensor]
    warnings: list[str]
    method: str


class KerasExplainReport(_KerasRun):
    command: Literal["explain"] = "explain"
    layers: list[KerasLayerEntry]
    gradients: list[KerasGradientEntry]
    initial_state_gradients: list[KerasStateEntry]
    witnesses: list[CrossCheckEntry]
    warnings: list[str]
    gradient_flow: KerasFlowSection | None = Field(default=None, description="with --flow")
    state_jacobians: KerasStateJacobians | None = Field(default=None,
                                                        description="with --jacobians")
    carry: KerasCarry | None = Field(default=None, description="with --chunks K")
    per_example: KerasPerExample | None = Field(default=None, description="with --per-example")
    mixed_precision: KerasMixedPrecision | None = Field(
        default=None, description="under a mixed_float16 or mixed_bfloat16 policy")
    nonfinite: NonFiniteEntry | None = Field(
        default=None, description="where the first NaN or Inf was born, when the loss or a "
                                  "gradient is not finite (exit 1)")
    timings: dict[str, float] | None = None


class KerasShapesReport(_KerasReport):
    """``gradscope shapes MODEL.keras``: the algebra of every layer, read from config.json."""

    command: Literal["shapes"] = "shapes"
    file: str
    name: str
    kind: str
    inputs: list[KerasTensorSpec]
    outputs: list[str]
    loss: str = Field(description="the loss explain would use, and the rule that chose it")
    layers: list[KerasLayerEntry]
    weights: list[KerasGradientEntry] = Field(
        description="every weight: the ones the algebra derives, then those of the underived "
                    "layers with the shapes the model stores (no formula); stats are null "
                    "(nothing is run)")
    weight_count: int = Field(description="numbers in the weights listed")
    underived: list[str] = Field(description="layers with weights but no derivation: their "
                                             "weights are listed with the stored shapes")


#: ``NotWitnessed.witness`` where no witness can compare the tensor (the loss does not reach
#: it).
EVERY_WITNESS = "every witness"


class NotWitnessed(_Report):
    """A layer call a witness could not stand in for, and why (it is then not compared: the
    tensor keeps the other witnesses); or, with ``witness`` "every witness", a tensor no
    witness compares (``layer`` its name: a weight or initial state the loss does not
    reach)."""

    layer: str
    witness: str
    reason: str


class CheckedExamples(_Report):
    """The examples of the batch that check ran on (see ``--examples``)."""

    checked: int = Field(description="examples checked; the tape, the witnesses and the loss "
                                     "are those of a batch of these")
    of: int = Field(description="examples in the batch")
    indices: list[int] | None = Field(
        default=None, description="which ones (from 0, in the batch's order); null: every one")
    picked: list[str] = Field(
        default_factory=list, description="the examples picked rather than drawn with the "
                                          "seed, and why (a mask's fewest and most kept steps, "
                                          "the smallest and largest sample weight)")
    whole_because: str | None = Field(
        default=None, description="why a batch over the limit was checked whole")


class KerasCheckReport(_KerasRun):
    command: Literal["check"] = "check"
    examples: CheckedExamples | None = Field(
        default=None, description="the examples of the batch that were checked")
    tolerances: Tolerances
    dtype: str = Field(default="float64", description="the dtype check computed in: float64 "
                       "(a copy of the model with the same weights), or the model's own")
    dtype_reason: str | None = Field(
        default=None, description="why not a float64 copy: where the user's code does not run "
                                  "in float64, and what checking in the model's dtype costs")
    held_fixed: list[str] = Field(
        default_factory=list, description="tensors the model stops the gradient of "
                                          "(stop_gradient), held at their values while the "
                                          "finite differences probe")
    tensors: list[CheckedTensor] = Field(description="Keras variable paths, 'input NAME', "
                                                     "initial states 'LAYER/h0', and 'layer "
                                                     "NAME' for a layer call whose own "
                                                     "backward disagrees")
    not_witnessed: list[NotWitnessed] = Field(
        default_factory=list, description="layer calls a witness did not run on, with why")
    carry: CarryCheck | None = Field(default=None, description="with --chunks K: the "
                                     "boundaries the carry crosses")
    nonfinite: NonFiniteEntry | None = Field(
        default=None, description="where the first NaN or Inf was born, when the loss or a "
                                  "gradient is not finite: nothing is compared (exit 1)")
    summary: CheckSummary
    timings: dict[str, float] | None = None


# -- gradscope diagnose: the dynamics of every recurrent call --------------------------------


class JacobianNorm(_Report):
    """The spectral norm of each step Jacobian J_t = ∂s_t/∂s_{t−1} (s: every state joined)."""

    median: float = Field(description="the median over every step that ran (and was taken), "
                                      "of every example")
    max: float = Field(description="the largest, over every step and example")
    share_above_1: float = Field(description="the share of (example, step) pairs with "
                                 "‖J_t‖₂ > 1, by more than 4 roundoffs of the cell's dtype "
                                 "(4.8e-7 in float32)")
    steps_median: list[float | None] = Field(
        description="per step (processing order): the median over the examples; null where "
                    "no example ran the step, or the step was not taken (a call of more than "
                    "128 steps is read at 128 of them, evenly spaced: method says so)")
    steps_max: list[float | None] = Field(description="per step: the largest over the "
                                          "examples")
    steps_read: int | None = Field(None, description="at how many steps, evenly spaced, the "
                                   "norms were taken, where fewer than the call has (the "
                                   "median, the maximum and the share are over those); null: "
                                   "at every step")
    method: str


class GateShares(_Report):
    below_0_1: float = Field(description="share of the gate's values below 0.1 (over "
                             "examples, steps and units)")
    above_0_9: float = Field(description="share of the gate's values above 0.9")


class SaturatedUnit(_Report):
    unit: int
    share: float = Field(description="share of its keep-gate values below 0.1 or above 0.9")
    mean_keep: float = Field(description="its mean keep-gate value")


class Timescales(_Report):
    """τ_j = −1/ln(mean keep gate of unit j), in steps, over the units."""

    median: float | None = Field(description="null: infinite (a keep gate of 1 on average)")
    p10: float | None
    p90: float | None
    keep_gate: str = Field(description="forget (LSTM) or update (Keras GRU)")


class Horizon(_Report):
    """How many steps back an input still reaches the state: ‖∂h_t/∂x_{t−k}‖ against
    ‖∂h_t/∂x_t‖, 10⁻³."""

    measured: int | None = Field(
        description="the smallest lag k whose median ratio (over the steps t and examples "
                    "measured) is below 10⁻³; null: not within the window")
    predicted: float | None = Field(description="ln(10³)/|λ₁| when λ₁ < 0, else null")
    agreement: str | None = Field(description="how far the two agree, e.g. 'within 1.3×'")
    window: int = Field(description="the lags measured: 0 to window")
    longest_lag: int | None = Field(
        default=None,
        description="the longest lag the steps measured have (back to the first step the "
                    "examples ran): a window below it stopped at the memory budget (a wide "
                    "layer's), at 16 lags or more")
    ratios: list[float | None] = Field(description="per lag: the median ratio")
    steps: list[int] = Field(description="the steps t measured (processing order)")
    examples: list[int] = Field(description="the examples measured")


class GrowingExample(_Report):
    example: int
    ratio: float = Field(description="how much of ∂L/∂s the recurrence carries back from the "
                         "last step to the first in this example (> 1: it grows)")


class Exploding(_Report):
    """Where ‖∂L/∂s_t‖ grows as the recurrence carries it back a step."""

    growing_share: float | None = Field(
        description="share of (example, step) pairs where the carried part of ∂L/∂s_t is "
                    "larger than ∂L/∂s_(t+1)")
    growing_steps: list[int] = Field(description="steps (processing order) where the batch's "
                                     "carried gradient grows, largest growth first (at most 20)")
    growing_step_count: int
    examples: list[GrowingExample] = Field(description="examples whose gradient the "
                                           "recurrence carries back grown, largest first "
                                           "(at most 10)")


class StateFlow(_Report):
    """How ∂L/∂s_t (s: every state joined) crosses the recurrence, over the batch."""

    first: float = Field(description="‖∂L/∂s_t‖ at the first step the layer runs (on a padded "
                                     "batch, at each example's own first step that ran)")
    last: float = Field(description="‖∂L/∂s_t‖ at the last step it runs (on a padded batch, "
                                    "at each example's own last step that ran)")
    ratio: float | None = Field(
        description="how much of ∂L/∂s the recurrence carries back from the last step to the "
                    "first: the product of the one-step gains (where the call returns its "
                    "sequence, of what arrives at the last step carried back alone), the "
                    "ratio explain's flow flags (null: nothing carried)")
    flag: Literal["vanishing", "exploding"] | None = Field(
        default=None, description="the flag explain --flow gives this ratio, by the same rule "
        "and factor (10³, the horizon's); null: none")


class Counterfactual(_Report):
    """A copy of the model with one change (the model itself, the change undone after, where
    Keras cannot copy it: ``on_model``), run again on the same batch; every number is
    measured on it (clipping changes the gradient, not the dynamics: not rerun)."""

    kind: Literal["keep_bias", "forget_bias_1", "update_bias_1", "orthogonal",
                  "orthogonal_1", "clipping"] = Field(
        description="keep_bias: +1 on the keep gate's bias; forget_bias_1: an LSTM's forget "
                    "biases below 1 raised to 1 (listed only where some is below 0); "
                    "update_bias_1: a GRU's update-gate biases below 1 raised to 1 (listed "
                    "only where some is below 0); "
                    "orthogonal: each gate's block of the recurrent kernel made orthogonal "
                    "at its spectral norm; orthogonal_1: a SimpleRNN's recurrent kernel made "
                    "orthogonal at spectral norm 1 (listed only where its norm is below 1); "
                    "clipping: global_clipnorm at the norm the batch suggests")
    change: str = Field(description="the change, in words")
    applicable: bool = Field(description="false: the change has no meaning for this cell "
                             "(note says why); no numbers")
    on_model: str | None = Field(
        default=None, description="where not null, why the change ran on the model itself, "
        "not a copy (Keras could not copy it); it was undone after its run, the weights "
        "given back bit for bit")
    note: str | None = None
    horizon: int | None = Field(description="the measured horizon after the change (null: "
                                "beyond horizon_window, or not applicable)")
    horizon_window: int | None = Field(default=None, description="the lags measured")
    predicted: float | None = Field(default=None, description="ln(10³)/|λ₁| after the change")
    lyapunov_1: float | None = Field(description="λ₁ after the change, from the layer's own "
                                     "start: with all its tangent columns where it carries "
                                     "every exponent, else with its first column alone")
    lyapunov_1_before: float | None = Field(
        default=None, description="the layer's λ₁ taken as lyapunov_1 is (on the same "
        "examples; its first tangent column alone, where that is how lyapunov_1 was taken): "
        "before, for after")
    first_column: bool = Field(
        default=False, description="lyapunov_1 and lyapunov_1_before are of the layer's first "
        "tangent column alone (the layer takes fewer columns than its state has numbers; "
        "the λ₁ of all of them may read otherwise): the text says \"λ₁ (first column)\"")
    examples: list[int] | None = Field(
        default=None, description="the examples the changed call was stepped on, and the "
        "before numbers read on (the horizon's: up to 8, evenly spaced); the gradients are of "
        "the whole batch's loss. null: the whole batch")
    flow: StateFlow | None = Field(default=None, description="∂L/∂s_t after the change")
    flow_before: StateFlow | None = Field(
        default=None, description="∂L/∂s_t before the change, on the same examples: before, "
        "for flow")
    clip_norm: float | None = Field(default=None, description="clipping: the global_clipnorm "
                                    "the batch suggests")
    clip_scale: float | None = Field(default=None, description="clipping: the scale Keras' "
                                     "rule would apply to this batch's gradient")
    gradient_norm: float | None = Field(default=None, description="clipping: the global "
                                        "gradient norm after it")
    compiled: str | None = Field(default=None, description="clipping: the clipping the "
                                 "optimizer is compiled with, which this one would replace "
                                 "(Keras takes one setting); None: none")
    compiled_norm: float | None = Field(default=None, description="clipping: the global "
                                        "gradient norm the compiled clipping leaves")

    def looser_than_compiled(self) -> bool:
        """Clipping: the suggestion would leave this batch's gradient no smaller than the
        clipping the optimizer is compiled with does (it is then no fix)."""
        return (self.compiled_norm is not None and self.gradient_norm is not None
                and self.gradient_norm >= self.compiled_norm)


class DiagnosedLayer(_Report):
    layer: str = Field(description="the Keras layer")
    call: str = Field(description="the call, as the reports name it: the layer, its call "
                      "index (decoder[1]), a Bidirectional's direction (both/forward)")
    class_name: str
    cell: str
    steps: int
    state_size: int = Field(description="numbers in the state s (h and c joined)")
    backwards: bool = Field(default=False, description="processing order: t = 0 is the last "
                            "input step")
    lyapunov: list[float] = Field(description="the top exponents, nats per step, largest "
                                  "first")
    lyapunov_change: float | None = Field(
        description="the largest change of an exponent over the last quarter of the steps "
                    "each example ran (how well they converged)")
    lyapunov_1_later_half: float | None = Field(
        default=None, description="λ₁ from the second half of the steps each example ran "
                                  "alone, where the scan's start weighs less (null: fewer "
                                  "than 4 steps); a warning says where it differs from λ₁ "
                                  "by more than a tenth")
    lyapunov_floored: list[int] = Field(
        default_factory=list,
        description="the positions in lyapunov of the exponents whose direction some step "
                    "took to 0 (a unit switched off, J_t singular): each such step counts "
                    "ln 1e-30, so they are not rates (−∞ in truth); see the warnings")
    jacobian_norm: JacobianNorm
    gates: dict[str, GateShares] | None = Field(
        description="per gate (input, forget, output; update, reset); null: see gates_note")
    gates_note: str | None = None
    saturated_units: list[SaturatedUnit] = Field(default_factory=list, description="the "
                                                 "units whose keep gate saturates most")
    timescales: Timescales | None
    horizon: Horizon
    exploding: Exploding | None
    flow: StateFlow | None = Field(default=None, description="∂L/∂s_t across the "
                                   "recurrence (null: no gradient reached the call)")
    counterfactuals: list[Counterfactual] = Field(
        default_factory=list, description="each a copy of the model with one change, run "
        "again on the batch (empty with counterfactuals off)")
    mechanism: Literal["vanishing", "exploding", "holds"]
    verdict: str


class Clipping(_Report):
    """What the compiled optimizer's clipping does to this batch's gradient."""

    optimizer: str | None
    setting: str | None = Field(description="clipnorm=…, global_clipnorm=… or clipvalue=…; "
                                "null: none")
    effect: str


class DiagnoseReport(_KerasRun):
    """``gradscope diagnose MODEL.keras``: why gradients vanish or explode, per recurrent
    call."""

    command: Literal["diagnose"] = "diagnose"
    layers: list[DiagnosedLayer]
    not_diagnosed: list[KerasNotAnalysed]
    gradient_norm: float | None = Field(description="the batch's global gradient norm, over "
                                        "every trainable weight")
    clipping: Clipping
    method: list[str]
    warnings: list[str]
    nonfinite: NonFiniteEntry | None = Field(
        default=None, description="where the first NaN or Inf was born, when the loss or a "
                                  "gradient is not finite: no call is diagnosed (exit 1)")
    timings: dict[str, float] | None = None


# -- during training: the GradientFlow callback and `gradscope watch` ---------------------------


class TrainingObservation(_Report):
    """One extra backward pass taken during training."""

    step: int = Field(description="batches trained so far (TensorBoard's step); with observe(), "
                      "the step given or one more than the previous")
    epoch: int | None = Field(default=None, description="the epoch (from 0) in model.fit")
    loss: float | None = Field(description="the loss of the extra pass; null if not finite")
    batch_size: int | None = None


class WeightNormSeries(_Report):
    """‖∂L/∂w‖ of one trainable weight at every observation."""

    weight: str = Field(description="the variable's path, e.g. gru/gru_cell/kernel")
    shape: list[int]
    norms: list[float | None] = Field(description="per observation: the L2 (Frobenius) norm; "
                                      "null where it was not finite or had no gradient")


class RecurrentFlowSeries(_Report):
    """One recurrent layer (or one direction of a Bidirectional) across training."""

    layer: str = Field(description="the layer call, e.g. gru, or both/forward in a "
                       "Bidirectional")
    class_name: str
    units: int
    initial_state_norms: dict[str, list[float | None]] = Field(
        description="per initial state (h0, and c0 for an LSTM): ‖∂L/∂state‖ (Frobenius over "
                    "the batch) per observation")
    profiles: list[list[float] | None] = Field(
        description="per observation: ‖∂L/∂h_t‖ for t = 0 … T−1, the total gradient at h_t "
                    "(from above at t plus what flows back from t+1); null where not analysed")
    ratios: list[float | None] = Field(
        description="per observation: how much of ∂L/∂h the recurrence carries back from "
                    "the last step it runs to the first, the product of the one-step gains "
                    "‖∂L/∂h_t − its part from above‖ / ‖∂L/∂h_(t+1)‖ (where the call returns "
                    "its sequence, of what arrives at the last step carried back alone; the "
                    "flag's ratio)")
    flags: list[Literal["vanishing", "exploding"] | None] = Field(
        description="per observation: the flag of `explain --flow`'s rule, beyond the factor")
    backwards: bool = Field(default=False, description="processing order: t = 0 is the last "
                            "input step")


class NotAnalysedAt(_Report):
    layer: str
    reason: str
    steps: list[int] = Field(description="the observations' steps where this held")


class DiagnosisSeries(_Report):
    """One recurrent call (one direction of a Bidirectional) diagnosed during training
    (``GradientFlow(diagnose_every=N)``): one value per diagnosis, on the batch fit had just
    trained on, as ``gradscope diagnose`` reads it (null where the call was not diagnosed)."""

    call: str = Field(description="the call, as diagnose names it (decoder[1], both/forward)")
    class_name: str
    cell: str
    lyapunov: list[list[float] | None] = Field(
        description="per diagnosis: the top Lyapunov exponents, nats per step, largest first "
                    "(QR along the batch's trajectory, the exponents' count in "
                    "diagnose_exponents)")
    gates: list[dict[str, GateShares] | None] = Field(
        description="per diagnosis: per gate, the shares of its values below 0.1 and above "
                    "0.9 (Keras GRU and LSTM; null: see gates_note)")
    gates_note: str | None = Field(default=None, description="why the gates are not read")
    horizon_predicted: list[float | None] = Field(
        description="per diagnosis: ln(10³)/|λ₁| in steps when λ₁ < 0, else null")
    horizon_measured: list[int | None] = Field(
        description="per diagnosis: the measured horizon in steps (null: not measured, see "
                    "horizon_window, or beyond the window)")
    horizon_window: list[int | None] = Field(
        description="per diagnosis: the lags measured (null: the horizon was not measured)")
    lyapunov_note: list[str | None] = Field(
        default_factory=list,
        description="per diagnosis: why λ₁, and the horizon predicted from it, is no firmer "
                    "than the call's steps make it, as diagnose warns (too few steps to tell, "
                    "or not settled over them); null where it settled")


class FlowHistoryReport(_CommandReport):
    """What the GradientFlow callback recorded (``callback.history``), or what ``gradscope
    watch`` read back from its TensorBoard event files."""

    command: Literal["watch"] = "watch"
    source: str = Field(description="the model observed, or the log directory read")
    loss: str = Field(description="the loss of the extra passes")
    mode: str = Field(description="the mode of the extra passes, e.g. inference")
    every: int | None = Field(description="one extra pass every this many batches (fit)")
    batches: int | None = Field(default=None, description="the batches fit has trained so far "
                                "(the callback's own report; null: read back by watch)")
    flag_factor: float = Field(description="flagged when the carried ratio passes this "
                               "factor either way")
    method: str
    observations: list[TrainingObservation]
    weights: list[WeightNormSeries]
    recurrent: list[RecurrentFlowSeries]
    not_analysed: list[NotAnalysedAt]
    nonfinite: NonFiniteEntry | None = Field(
        default=None, description="GradientFlow(stop_on_nan=True): where the NaN of the first "
                                  "batch whose loss was not finite was born (training stopped)")
    nonfinite_step: int | None = Field(default=None, description="the step it was found at")
    diagnose_every: int | None = Field(
        default=None, description="GradientFlow(diagnose_every=N): a diagnosis every this "
                                  "many batches (null: none)")
    diagnose_exponents: int | None = Field(default=None, description="the Lyapunov exponents "
                                           "each diagnosis takes")
    diagnose_examples: int | None = Field(default=None, description="the examples of its "
                                          "batch each diagnosis reads at most, evenly spaced "
                                          "(null: every one)")
    diagnosis_steps: list[int] = Field(default_factory=list, description="the steps "
                                       "(batches trained) of each diagnosis")
    diagnoses: list[DiagnosisSeries] = Field(default_factory=list, description="per "
                                             "recurrent call, one value per diagnosis")
    not_diagnosed: list[NotAnalysedAt] = Field(default_factory=list, description="calls a "
                                               "diagnosis could not read, why, and when")
    mixed_precision: list[KerasMixedPrecision | None] | None = Field(
        default=None, description="under a mixed_float16 or mixed_bfloat16 policy: per "
                                  "observation, explain's mixed_precision section on that "
                                  "observation's batch and weights, at the optimizer's loss "
                                  "scale then (null where it was not taken); null for a model "
                                  "without a mixed policy")
    per_example: list[KerasPerExample | None] | None = Field(
        default=None, description="with GradientFlow(per_example=True): per observation, "
                                  "explain's per_example section on that observation's batch "
                                  "and weights (null where it was not taken: not_analysed "
                                  "says why); null without per_example=True or where no "
                                  "observation took it")


class DiffChange(_Report):
    """One thing that changed between two explain reports."""

    tensor: str = Field(description="a gradient's name, 'loss', or the sequence a flag is on")
    kind: Literal["loss", "added", "removed", "renamed", "shape", "norm", "nonfinite", "flag"]
    base: float | None = Field(default=None, description="‖g‖ (or the loss) in the base report")
    new: float | None = Field(default=None, description="‖g‖ (or the loss) in the new report")
    relative: float | None = Field(default=None, description="|new − base| / max(|base|, |new|)")
    base_shape: list[int] | None = None
    new_shape: list[int] | None = None
    detail: str


class DiffReport(_CommandReport):
    """``gradscope diff BASE.json NEW.json``: the gradients of two explain reports of the same
    model inputs and data, compared."""

    command: Literal["diff"] = "diff"
    base: str = Field(description="the base report (its file)")
    new: str = Field(description="the new report (its file)")
    source: str = Field(description="yaml or keras")
    rtol: float = Field(description="relative tolerance of ‖g‖ and of the loss")
    loss_base: float | None
    loss_new: float | None
    compared_tensors: int = Field(description="gradients present in both reports (a renamed "
                                  "one counted once)")
    changes: list[DiffChange]
    drifted: bool = Field(description="anything changed but a name (a tensor renamed "
                          "alone, its ‖g‖ within rtol, is no drift): exit 1")


#: Every report a command or the API returns.
Report = (ShapesReport | ExplainReport | CheckReport | LayerCheckReport | KerasShapesReport
          | KerasExplainReport | KerasCheckReport | FlowHistoryReport | DiffReport
          | DiagnoseReport)

REPORTS: dict[str, type[_Report]] = {
    "spec": SpecInference,
    "explain": ExplainReport, "shapes": ShapesReport, "check": CheckReport,
    "explain-keras": KerasExplainReport, "shapes-keras": KerasShapesReport,
    "check-keras": KerasCheckReport, "check-layer": LayerCheckReport,
    "watch": FlowHistoryReport, "diff": DiffReport, "diagnose": DiagnoseReport,
}


def json_schema(command: str = "explain") -> dict[str, Any]:
    schema = REPORTS[command].model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
