"""What every cell provides, and the small records the shape algebra is made of.

A cell module holds one (cell type, layout) pair as a :class:`Cell` subclass: its weights and
their meaning (pure Python), its TensorFlow step, and its NumPy step and step backward (module
functions its class returns from :meth:`Cell.numpy_steps`; the two LSTM layouts share theirs
in :mod:`~gradscope.cells.lstm`). The loops over time are shared: ``tf.scan`` in
:meth:`Cell.tf_sequence`, BPTT in :mod:`~gradscope.cells.numpy_bptt`. TensorFlow is never
imported here: the TF functions receive the ``tf`` module as an argument, so ``gradscope
shapes`` can use the algebra without importing TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from gradscope.cells import numpy_bptt as bptt

TensorKind = Literal["weight", "state", "input"]

#: Where an alias comes from: the variable name the canonical TF1 program creates (block
#: layout), the Keras 3 variable path (keras layout), or a checkpoint's own variable name.
AliasSource = Literal["tf1", "keras", "checkpoint"]


@dataclass(frozen=True)
class Block:
    """A half-open index range ``[start, stop)`` of one axis and what it holds."""

    start: int
    stop: int
    label: str

    def describe(self) -> str:
        span = f"{self.start}" if self.stop - self.start == 1 else f"{self.start}–{self.stop - 1}"
        return f"{span} {self.label}"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor whose gradient gradscope explains: its name, shape, formula and meaning."""

    name: str  # gradscope's name, e.g. gru_1/w_ru
    layer: str  # gru_1
    short: str  # w_ru
    #: The name in the other naming: the TF1 variable, e.g.
    #: rnn/multi_rnn_cell/cell_0/gru_cell/gates/kernel, or the Keras path gru_1/gru_cell/kernel.
    alias: str
    shape: tuple[int, ...]
    formula: str  # with the user's numbers: "(input 200 + units 64) × 2·units 64"
    role: str  # what the tensor does, one clause
    kind: TensorKind = "weight"
    rows: tuple[Block, ...] = ()
    columns: tuple[Block, ...] = ()
    note: str = ""  # e.g. how the gradient sums over positions
    alias_source: AliasSource = "tf1"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def meaning(self) -> str:
        return meaning(self.role, self.shape, self.rows, self.columns, self.note)


def meaning(role: str, shape: tuple[int, ...], rows: tuple[Block, ...],
            columns: tuple[Block, ...], note: str) -> str:
    """"maps x_t to …; rows 0–199 x_t, …; columns 0–63 reset gate r, …; <note>"."""
    parts = [role]
    if rows:
        parts.append("rows " + ", ".join(block.describe() for block in rows))
    if columns:
        axis = "columns" if len(shape) > 1 else "entries"
        parts.append(f"{axis} " + ", ".join(block.describe() for block in columns))
    if note:
        parts.append(note)
    return "; ".join(parts)


def split_blocks(labels: list[str], width: int) -> tuple[Block, ...]:
    """Consecutive blocks of ``width`` entries, one per label: the gate blocks of a kernel."""
    return tuple(Block(i * width, (i + 1) * width, label) for i, label in enumerate(labels))


def concat_rows(parts: list[tuple[int, str]]) -> tuple[Block, ...]:
    """Row blocks of a kernel applied to a concatenation, e.g. [(200, 'x_t'), (64, 'h_{t−1}')]."""
    blocks, start = [], 0
    for size, label in parts:
        blocks.append(Block(start, start + size, label))
        start += size
    return tuple(blocks)


def glorot_uniform(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    limit = np.sqrt(6.0 / (shape[0] + shape[1]))
    return rng.uniform(-limit, limit, size=shape)


def tf_block_matmul(tf: Any, block: Any, weight: Any) -> Any:
    """``block`` (k, B, w) times ``weight`` (w, n): (k, B, n), as one matmul of k·B rows."""
    shape = tf.shape(block)
    product = tf.reshape(block, [-1, shape[2]]) @ weight
    return tf.reshape(product, tf.concat([shape[:2], tf.shape(weight)[1:]], 0))


def tf_project(tf: Any, inputs: Any, kernel: Any, bias: Any = None) -> Any:
    """``inputs @ kernel + bias`` over all leading axes at once: one matmul for every step."""
    lead = tf.shape(inputs)[:-1]
    flat = tf.reshape(inputs, [-1, tf.shape(inputs)[-1]]) @ kernel
    if bias is not None:
        flat = flat + bias
    return tf.reshape(flat, tf.concat([lead, tf.shape(kernel)[-1:]], axis=0))


@dataclass
class Cell:
    """A recurrent layer's cell in one layout. Subclasses fill in the class attributes.

    ``input_size`` is the feature size this layer sees; ``input_label`` names where it comes
    from in formulas ("input" for the first layer, "gru_1 units" for a stacked one).
    ``scope`` is the variable scope above the cell's own in its aliases: in the block layout
    what TF1's ``dynamic_rnn`` and ``MultiRNNCell`` create (``rnn/multi_rnn_cell/cell_0``, or
    ``rnn`` for a single layer), in the keras layout the layer's name (Keras 3 paths are
    ``gru_1/gru_cell/kernel``). Without it two layers' aliases would be the same.
    """

    name: str
    units: int
    input_size: int
    input_label: str
    options: dict[str, Any] = field(default_factory=dict)
    scope: str = ""

    kind: ClassVar[str]
    layout: ClassVar[str]
    #: TF1 / Keras cell scope used in aliases, e.g. "gru_cell".
    cell_scope: ClassVar[str]
    #: Names of the initial states, e.g. ("h0",) or ("h0", "c0").
    state_names: ClassVar[tuple[str, ...]] = ("h0",)

    # -- algebra (pure Python) -----------------------------------------------------------

    @property
    def input_term(self) -> str:
        return f"{self.input_label} {self.input_size}"

    @property
    def x_label(self) -> str:
        """What x_t is for this layer: the data, or the previous layer's output."""
        if self.input_label == "input":
            return "x_t"
        if self.input_label.endswith(" units"):
            return f"x_t (= {self.input_label.removesuffix(' units')} h_t)"
        return f"x_t (= {self.input_label})"

    def weights(self) -> list[TensorInfo]:
        raise NotImplementedError

    def states(self, batch_size: int) -> list[TensorInfo]:
        labels = {"h0": "hidden state h", "c0": "cell state c"}
        return [
            TensorInfo(
                name=f"{self.name}/{state}",
                layer=self.name,
                short=state,
                alias="initial_state" + (f"[{index}]" if len(self.state_names) > 1 else ""),
                shape=(batch_size, self.units),
                formula=f"batch {batch_size} × units {self.units}",
                role=f"initial {labels[state]} of {self.name} (zeros unless supplied)",
                kind="state",
                alias_source="tf1" if self.layout == "block" else "keras",
            )
            for index, state in enumerate(self.state_names)
        ]

    def weight(self, short: str, shape: tuple[int, ...], formula: str, role: str,
               alias: str, rows: tuple[Block, ...] = (),
               columns: tuple[Block, ...] = ()) -> TensorInfo:
        return TensorInfo(
            name=f"{self.name}/{short}",
            layer=self.name,
            short=short,
            alias="/".join(part for part in (self.scope, self.cell_scope, alias) if part),
            shape=shape,
            formula=formula,
            role=role,
            rows=rows,
            columns=columns,
            alias_source="tf1" if self.layout == "block" else "keras",
        )

    # -- numerics -----------------------------------------------------------------------------

    def init_params(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Float64 initial weights keyed by short name; deterministic for a given ``rng``."""
        raise NotImplementedError

    def tf_inputs(self, tf: Any, params: dict[str, Any], inputs: Any) -> tuple[Any, ...]:
        """Per-step tensors ``(T, B, ·)`` computed before the scan: the input projections.

        The part of every gate that depends on x_t alone is one matmul for all steps at once.
        """
        raise NotImplementedError

    def tf_step_weights(self, tf: Any, params: dict[str, Any]) -> dict[str, Any]:
        """The weights the step uses, sliced once outside the loop (slicing inside it would
        make every backward step build a full-size gradient of the slice)."""
        return params

    def tf_step(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                step_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """One step: the new states (the first one is the output h_t). ``params`` is what
        :meth:`tf_step_weights` returned."""
        raise NotImplementedError

    #: Whether :meth:`tf_step_linear` is written out for this cell.
    has_tangent: ClassVar[bool] = False

    def tf_step_linear(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                       step_inputs: tuple[Any, ...]
                       ) -> tuple[tuple[Any, ...], Callable[..., tuple[Any, ...]]]:
        """One step and its linearisation: the new states (B, w_i), and ``apply``, which takes
        a block of k tangent columns per state (k, B, w_i) to J_t applied to them; given
        ``inputs`` too, a block of tangents of each step input (k, B, ·), it adds what they
        move (the step's Jacobian in its projected input, which the memory horizon reads
        back to x_s). The step's
        own values (gates, slopes) are computed here once, for every block ``apply`` is then
        given: a loop that applies J_t or Jᵀ_t many times at one step pays one matmul each.
        Forward-mode autodiff of :meth:`tf_step` gives the same numbers
        (``tests/test_cells.py`` holds each cell to it) but recomputes the step each time;
        cells without it (``has_tangent``) are linearised that way."""
        raise NotImplementedError

    def tf_step_tangent(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                        step_inputs: tuple[Any, ...], tangents: tuple[Any, ...]
                        ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """One step and J_t applied to one block of tangent columns (:meth:`tf_step_linear`)."""
        after, apply = self.tf_step_linear(tf, params, states, step_inputs)
        return after, apply(tangents)

    def tf_step_probed(self, tf: Any, params: dict[str, Any], states: tuple[Any, ...],
                       step_inputs: tuple[Any, ...], probes: tuple[Any, ...]) -> tuple[Any, ...]:
        """One step with a zero probe added to each new state as soon as it is computed: the
        gradient with respect to a probe is then the total ∂L/∂ of that state. A cell whose
        output reads another state within the step (an LSTM's h_t reads c_t) adds that
        state's probe before the read."""
        new = self.tf_step(tf, params, states, step_inputs)
        return tuple(s + p for s, p in zip(new, probes, strict=True))

    def tf_sequence(self, tf: Any, params: dict[str, Any], inputs: Any,
                    states: tuple[Any, ...],
                    probes: tuple[Any, ...] | None = None,
                    cuts: Any = None,
                    edges: tuple[Any, ...] | None = None,
                    trajectory: list[Any] | None = None) -> tuple[Any, tuple[Any, ...]]:
        """Run the cell over a time-major sequence ``(T, B, F)`` with ``tf.scan``.

        Returns the outputs ``(T, B, units)`` and the final states. ``probes``, one
        ``(T, B, units)`` tensor of zeros per state, are added to the states each step
        computes (:meth:`tf_step_probed`): they change no value, but the gradient with respect
        to a probe is the *total* ∂L/∂h_t (∂L/∂c_t), including what flows back through the
        recurrence from t+1.

        ``cuts`` (T,), 0 or 1 per step, is truncated BPTT in one pass: where it is 1, the
        state that step t reads from step t−1 passes through ``tf.stop_gradient`` (the value
        is unchanged, exactly). ``edges``, zeros ``(T, B, units)`` per state, are added to the
        state step t reads, after the cut: the gradient with respect to ``edges[t]`` is
        ∂L/∂(the initial state of a chunk that starts at t), what the recurrence carries
        into step t and nothing else (not the paths from h_{t−1} to the layer above).
        ``trajectory``, if given, receives every state's sequence ``(T, B, units)`` in
        ``state_names`` order (an LSTM's c as well as h).
        """
        step_inputs = self.tf_inputs(tf, params, inputs)
        step_weights = self.tf_step_weights(tf, params)
        n_states = len(self.state_names)
        n_inputs = len(step_inputs)
        n_probes = len(probes) if probes is not None else 0
        extras: tuple[Any, ...] = tuple(probes) if probes is not None else ()
        if cuts is not None:
            extras += (cuts,)
        if edges is not None:
            extras += tuple(edges)

        def step(carry: tuple[Any, ...], elems: tuple[Any, ...]) -> tuple[Any, ...]:
            extra = elems[n_inputs:]
            if cuts is not None:
                cut = extra[n_probes]
                # s + cut·(sg(s) − s) is s exactly, with gradient (1 − cut).
                carry = tuple(s + cut * (tf.stop_gradient(s) - s) for s in carry)
            if edges is not None:
                carry = tuple(s + e for s, e in zip(carry, extra[-n_states:], strict=True))
            if probes is not None:
                return self.tf_step_probed(tf, step_weights, carry, elems[:n_inputs],
                                           extra[:n_probes])
            return self.tf_step(tf, step_weights, carry, elems[:n_inputs])

        sequences = tf.scan(step, step_inputs + extras, initializer=tuple(states[:n_states]))
        if trajectory is not None:
            trajectory.extend(sequences)
        return sequences[0], tuple(s[-1] for s in sequences)

    # -- NumPy reference (float64, no TensorFlow) ---------------------------------------------

    @property
    def key(self) -> str:
        """``<kind>_<layout>``, the cell's entry in :data:`gradscope.cells.CELLS`; a cell with
        two NumPy references says which one it runs (``gru_keras_reset_before``)."""
        return f"{self.kind}_{self.layout}"

    def numpy_steps(self) -> tuple[bptt.Step, bptt.StepBackward]:
        """A one-state cell's NumPy step and step backward, functions of the cell's module (an
        LSTM's step carries c as well: its :meth:`numpy_functions` run them)."""
        raise NotImplementedError

    def numpy_functions(self) -> tuple[bptt.Forward, bptt.Backward]:
        """The NumPy forward pass over a sequence (B, T, F) and its BPTT: a one-state cell's
        :meth:`numpy_steps` run over time (:func:`~gradscope.cells.numpy_bptt.single_state`)."""
        return bptt.single_state(*self.numpy_steps())


class ConcatKernelCell(Cell):
    """A block-layout cell whose one ``kernel`` maps the concatenation [x_t, h_{t−1}] (TF1's
    LSTMCell, BasicRNNCell): rows 0..F−1 see x_t, the rows after them h_{t−1}."""

    def tf_inputs(self, tf: Any, params: dict[str, Any], inputs: Any) -> tuple[Any, ...]:
        return (tf_project(tf, inputs, params["kernel"][: self.input_size], params["bias"]),)

    def tf_step_weights(self, tf: Any, params: dict[str, Any]) -> dict[str, Any]:
        return {"kernel_h": params["kernel"][self.input_size:]}
