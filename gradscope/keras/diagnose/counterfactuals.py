"""What one change would do to a recurrent call, measured on a copy of the user's model: the
keep gate's bias +1 (an LSTM's forget gate, a Keras GRU's update gate z), an LSTM's shut
forget biases or a GRU's shut update biases raised to 1, the recurrent kernel made
orthogonal at its spectral norm, and a SimpleRNN's kernel of norm other than 1 made
orthogonal at norm 1, each run again on the same batch (λ₁, the horizon, ∂L/∂s_t through
the recurrence); and the global_clipnorm the batch suggests, which changes the gradient, not
the dynamics, so nothing is rerun for it.

The copy is gradscope's own load of a saved file (the one the diagnosis ran on, each change
undone after its run), or, for a model object, Keras' rebuild of it from its config with the
same weights; where Keras cannot rebuild it, the model object itself, each change undone
after its run, its weights given back bit for bit: the user's model is left as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from gradscope import dynamics
from gradscope.errors import first_line
from gradscope.keras.engine import class_label
from gradscope.report.models import Counterfactual, StateFlow

#: A change of one cell's weights: each variable changed with its new value, or why the
#: change has no meaning for this cell.
Change = Callable[[Any], "list[tuple[Any, np.ndarray]] | str"]
NOT_APPLICABLE = "not applicable to this cell"
Kind = Literal["keep_bias", "forget_bias_1", "update_bias_1", "orthogonal", "orthogonal_1",
               "clipping"]


#: Why a change is not run on a stack of cells in one RNN (found tried as a new user would:
#: "StackedRNNCells has no keep gate gradscope knows" of a stack of Keras' GRU and LSTM cells).
STACKED = (f"{NOT_APPLICABLE} (a stack of cells in one RNN: each cell in an RNN layer of its "
           "own gets this change)")


def keep_bias(cell: Any) -> list[tuple[Any, np.ndarray]] | str:
    """+1 on the keep gate's bias: an LSTM's forget gate (Keras' columns [i | f | c | o]) or a
    Keras GRU's update gate z (columns [z | r | h]; h_t = z·h_(t−1) + (1 − z)·ĥ_t, so a larger
    z keeps more). With reset_after the GRU's bias has two rows that both add to z: the +1
    goes on row 0 alone, so that z's pre-activation moves by 1, as the LSTM's does."""
    kind = class_label(cell)
    if kind == "StackedRNNCells":
        return STACKED
    if kind not in ("LSTMCell", "GRUCell"):
        return f"{NOT_APPLICABLE} ({kind} has no keep gate gradscope knows)"
    if not cell.use_bias:
        return f"{NOT_APPLICABLE} (use_bias=False: it has no bias)"
    units = int(cell.units)
    bias = np.array(cell.bias.numpy())
    if kind == "LSTMCell":
        bias[units:2 * units] += 1
    elif bias.ndim == 2:
        bias[0, :units] += 1
    else:
        bias[:units] += 1
    return [(cell.bias, bias)]


def forget_bias_1(cell: Any) -> list[tuple[Any, np.ndarray]] | str:
    """An LSTM's forget-gate biases below 1 raised to 1: Keras' own initial value
    (``unit_forget_bias``, after Jozefowicz et al. 2015). Where a gate is shut (a bias of
    −4), +1 leaves it shut; this is the fix the literature gives. Run only where some forget
    bias is below 0 (a gate that rests more shut than open): a layer as Keras initialises
    it, or one trained a little away from 1, is not run again for it, and the change is
    then not listed (:data:`LISTED_ONLY_WHERE_APPLICABLE`)."""
    return _raised_to_1(cell, "LSTMCell", "forget", 1)  # Keras' columns [i | f | c | o]


def update_bias_1(cell: Any) -> list[tuple[Any, np.ndarray]] | str:
    """A Keras GRU's update-gate biases below 1 raised to 1: the GRU's keep gate (h_t =
    z·h_(t−1) + (1 − z)·ĥ_t) at rest where an LSTM's forget gate rests as Keras initialises
    it, σ(1) ≈ 0.73 (found tried as a new user would: a GRU whose update gate was shut, a
    bias of −3, was offered nothing that opened it, where an LSTM gets
    :func:`forget_bias_1`). With ``reset_after`` both bias rows add to z: row 0 moves so
    that their sum is raised to 1. Run and listed only where some update bias (that sum) is
    below 0, as :func:`forget_bias_1`."""
    return _raised_to_1(cell, "GRUCell", "update", 0)  # Keras' columns [z | r | h]


def _raised_to_1(cell: Any, kind_of: str, gate: str, block: int
                 ) -> list[tuple[Any, np.ndarray]] | str:
    """The biases of ``gate`` (column block ``block`` of a ``kind_of`` cell; summed over the
    rows of a GRU's reset_after bias, row 0 moved) below 1 raised to 1, where some is below
    0."""
    kind = class_label(cell)
    if kind != kind_of:
        return f"{NOT_APPLICABLE} ({kind} has no {gate} gate)"
    if not cell.use_bias:
        return f"{NOT_APPLICABLE} (use_bias=False: it has no bias)"
    units = int(cell.units)
    columns = slice(block * units, (block + 1) * units)
    bias = np.array(cell.bias.numpy())
    rows = bias.reshape(-1, bias.shape[-1])  # a view: one row, or reset_after's two
    summed = rows[:, columns].sum(axis=0)
    if np.all(summed >= 0):
        return f"{NOT_APPLICABLE}: no {gate}-gate bias is below 0"
    rows[0, columns] = np.maximum(summed, 1) - rows[1:, columns].sum(axis=0)
    return [(cell.bias, bias)]


#: The changes a layer's list leaves out where they do not apply.
LISTED_ONLY_WHERE_APPLICABLE = frozenset({"forget_bias_1", "update_bias_1", "orthogonal_1"})


#: Column blocks of the recurrent kernel, per cell class (one per gate and the candidate).
BLOCKS = {"LSTMCell": 4, "GRUCell": 3, "SimpleRNNCell": 1}


def orthogonal(cell: Any) -> list[tuple[Any, np.ndarray]] | str:
    """The recurrent kernel, each gate's (u, u) block replaced by its polar factor (the
    nearest orthogonal matrix, W·Vᵀ of the SVD W·S·Vᵀ) times its own spectral norm: every
    singular value of the block becomes its largest. Per block, because each gate multiplies
    h_(t−1) by its own block through its own nonlinearity: the orthogonality of the whole
    (u, blocks·u) matrix (Keras' initializer) says nothing of any one block's spectrum."""
    kind = class_label(cell)
    if kind == "StackedRNNCells":
        return STACKED
    if kind not in BLOCKS:
        # Found tried as a new user would: "no recurrent kernel gradscope knows" of a cell of
        # the user's own with an attribute recurrent_kernel.
        return (f"{NOT_APPLICABLE} ({kind}: gradscope does not know how its step reads a "
                "recurrent kernel)")
    if getattr(cell, "recurrent_kernel", None) is None:
        return f"{NOT_APPLICABLE} ({kind}: it has no recurrent kernel)"
    before = np.array(cell.recurrent_kernel.numpy(), np.float64)
    kernel = before.copy()
    units = kernel.shape[0]
    for block in range(BLOCKS[kind]):
        factor, norm = _polar(kernel[:, block * units:(block + 1) * units])
        kernel[:, block * units:(block + 1) * units] = norm * factor
    scale = float(np.max(np.abs(before))) if before.size else 0.0
    if np.max(np.abs(kernel - before), initial=0.0) <= SAME * scale:
        what = ("its recurrent kernel" if BLOCKS[kind] == 1
                else "each gate's block of its recurrent kernel")
        return (f"{NOT_APPLICABLE}: {what} already is orthogonal times its spectral norm "
                "(the change would change nothing)")
    return [(cell.recurrent_kernel, kernel)]


def orthogonal_1(cell: Any) -> list[tuple[Any, np.ndarray]] | str:
    """A SimpleRNN's recurrent kernel made orthogonal at spectral norm 1: its polar factor,
    as Keras' own initializer draws it (``Orthogonal``, gain 1). Where the kernel's norm is
    below 1, every step shrinks what it carries back by at least that much, and the change
    at its own norm (:func:`orthogonal`) keeps the shrinking: this is the fix the literature
    gives for a vanilla RNN (Saxe et al. 2014; Pascanu et al. 2013: ‖W‖ < 1 is sufficient for
    vanishing). Where it is above 1, a linear or relu recurrence may stretch by that much a
    step and explode, and the change at its own norm keeps that too (found tried as a new
    user would: an orthogonal kernel × 1.1 was offered clipping alone). Run and listed only
    where the norm is not 1 (:data:`LISTED_ONLY_WHERE_APPLICABLE`); a gated cell's blocks
    are the gates' business (the keep gate's bias)."""
    kind = class_label(cell)
    if kind != "SimpleRNNCell" or getattr(cell, "recurrent_kernel", None) is None:
        return f"{NOT_APPLICABLE} ({kind}: only a SimpleRNN's kernel is set to norm 1)"
    factor, norm = _polar(np.array(cell.recurrent_kernel.numpy(), np.float64))
    if not factor.size or abs(norm - 1) <= SAME:
        return f"{NOT_APPLICABLE}: its recurrent kernel's spectral norm is already 1"
    return [(cell.recurrent_kernel, factor)]


def _polar(block: np.ndarray) -> tuple[np.ndarray, float]:
    """A square block's polar factor (the nearest orthogonal matrix, W·Vᵀ of its SVD
    W·S·Vᵀ) and its spectral norm (0 for an empty block)."""
    left, values, right = np.linalg.svd(block)
    return left @ right, float(values[0]) if values.size else 0.0


#: A changed kernel within this much of the old one (relative to its largest entry, a few
#: float32 roundings) is no change.
SAME = 1e-5


CHANGES: list[tuple[Kind, str, Change]] = [
    ("keep_bias", "", keep_bias),
    ("forget_bias_1", "every forget-gate bias below 1 raised to 1", forget_bias_1),
    ("update_bias_1", "every update-gate bias below 1 raised to 1", update_bias_1),
    ("orthogonal", "an orthogonal recurrent kernel at its spectral norm", orthogonal),
    ("orthogonal_1", "an orthogonal recurrent kernel at spectral norm 1", orthogonal_1),
]


def change_words(kind: str, cell: Any) -> str:
    if kind == "keep_bias":
        gate = {"LSTMCell": "forget", "GRUCell": "update"}.get(class_label(cell), "keep")
        return f"{gate}-gate bias +1"
    return next(words for name, words, _ in CHANGES if name == kind)


def carry_unread(stepped: Any, index: int) -> bool:
    """Whether what the recurrence carries back cannot be told apart from what arrives from
    above, in direction ``index`` of ``stepped``: a cell whose output is not its state (a
    cell of the user's returning, say, 2·h) in a call that returns its sequence. The
    gradient from above then enters each step through the cell, onto the state step t+1
    reads, where a Keras cell's output is the state itself and the part from above is taken
    off it. Found tried as a new user would: such a cell read "∂L/∂s_t grows going back on
    42.5% of pairs" where every step Jacobian's norm was below 1 (each step's fresh gradient
    counted as growth)."""
    from gradscope.keras.stepped import output_is_state

    layer = stepped.directions[index].layer
    return (not output_is_state(stepped, index)
            and bool(getattr(layer, "return_sequences", False)))


def state_flow(squares: tuple[np.ndarray, np.ndarray] | None,
               ran: np.ndarray, back: np.ndarray | None = None,
               carry: bool = True) -> StateFlow | None:
    """‖∂L/∂s_t‖ at the first and last step of a direction (each example's own that ran),
    from its
    :func:`~gradscope.keras.stepped.step_squares` and where each example's steps ran (B, T),
    processing order: the ratio the flow flags (:func:`~gradscope.keras.flow.carried_ratio`,
    from the same per-step norms, or, where the call returns its sequence, from ``back``:
    :func:`~gradscope.keras.stepped.carried_back`) and the flag it gives it
    (:func:`gradscope.dynamics.flow_kind`); None: no gradient reached the call. ``carry``
    False: the carried part is not read (:func:`carry_unread`), no ratio nor flag."""
    from gradscope.keras.probed_flow import back_ratio_of, carried_ratio_of, ran_ends

    if squares is None:
        return None
    whole, carried = squares
    ratio = (None if not carry else carried_ratio_of(carried, whole, ran) if back is None
             else back_ratio_of(back, ran))
    # Each example's own first and last step that ran (on a padded batch, a step of the call
    # no example ran holds no gradient): what the ratio is read between.
    rows, first, last = ran_ends(ran)
    return StateFlow(first=float(np.sqrt(np.sum(whole[rows, first]))),
                     last=float(np.sqrt(np.sum(whole[rows, last]))), ratio=ratio,
                     flag=dynamics.flow_kind(ratio))


def copy_engine(job: Any, engine: Any) -> tuple[Any, str | None]:
    """The engine the changes run on, and, where that is the user's model itself, why (else
    None): ``engine`` itself where its model is gradscope's own load of a file (each change
    is undone after its run, and the traces of the layer's diagnosis serve its changes too);
    for the user's model object, a second engine on a copy Keras rebuilds from its config,
    with the same weights. Where Keras cannot copy it so (a subclassed model whose
    ``__init__`` takes what Keras cannot serialise, a layer it cannot rebuild, a mixed dtype
    policy the copy would not keep), the model itself, as a diagnosis during ``fit`` runs
    on it then: each change is undone after its run, its weights given back bit for bit
    (:func:`measure_change`). Found tried as a new user would: the TensorFlow tutorial's
    subclassed text model got no counterfactual at all."""
    from gradscope.keras.engine import CopyFails, KerasEngine

    if not engine.live:
        return engine, None

    policy = str(getattr(getattr(engine.model, "dtype_policy", None), "name", "float32"))
    if engine.live and policy != engine.dtype_name:
        return engine, f"a copy would not keep its dtype policy {policy}"
    try:
        return KerasEngine(job.source, job.outputs, job.plan, training=job.training,
                           seed=job.seed, dtype=engine.dtype_name if engine.live else None), None
    except CopyFails as exc:  # said for check, where the copy is what it compares against
        return engine, exc.reason
    except Exception as exc:  # noqa: BLE001  (the user's classes, rebuilt: anything)
        return engine, f"Keras could not copy it: {first_line(exc)}"


def first_column_only(count: int, size: int) -> bool:
    """Whether a change's λ₁ carries only the first of the layer's ``count`` tangent
    columns: where they are fewer than the state's ``size`` numbers. Their start is then
    drawn at random, so the first column is a generic direction, whose growth rate is
    Benettin's λ₁; Gram–Schmidt makes Q_t's first column and R_t[0, 0] from it alone, so it
    costs 1/``count`` of the scan. With every exponent (Q_0 = I) the first column is e_1,
    which a step may keep to itself: every column is carried then, as the layer's are."""
    return count < size


def changed_on(engine: Any, layer: Any, call: Any, examples: list[int]) -> list[int] | None:
    """The examples a change is run on: those the layer's horizon is measured on (up to
    :data:`~gradscope.keras.diagnose.horizon.EXAMPLES`, evenly spaced), where the batch has
    more; None: the whole batch. The stepping, λ₁ and the horizon take the rows, and what a
    change's numbers are compared with is read on the same rows of the layer's own
    (:class:`Before`); the copy's pass takes them too where it holds the whole batch's
    there (:func:`rows_rerun`), the loss always the whole batch's. Each example steps on
    its own (the stepped rows must give Keras' own outputs for them, or the change says
    why not). Not in training mode, whose dropout masks are drawn for the whole batch, nor
    for a stateful layer, whose carried state is the whole batch's, nor where the call's
    tensors are not the batch's rows (:func:`at_rows`). On the LSTM 256 × 2 at 1000 steps,
    batch 32: 8.9 s of changes become about 4 s (with :func:`rows_rerun`)."""
    if (not examples or len(examples) >= int(np.shape(call.args[0])[0]) or engine.training
            or getattr(layer, "stateful", False) or at_rows(call, None, examples) is None):
        return None
    return sorted(examples)


class _NotRows(Exception):
    pass


def at_rows(call: Any, upstream: list[Any] | None, examples: list[int],
            ) -> tuple[Any, list[Any] | None] | None:
    """``call`` and ∂L/∂(its outputs) at the batch rows ``examples`` alone: its input, mask,
    initial states and outputs, each an array whose first axis is the batch; None where one
    is not (the whole batch is run then)."""
    batch = int(np.shape(call.args[0])[0])
    rows = np.asarray(examples)

    def take(value: Any) -> Any:
        if value is None:
            return None
        array = np.asarray(value)
        if array.ndim == 0 or array.shape[0] != batch:
            raise _NotRows
        return array[rows]

    try:
        return (replace(call, args=[take(call.args[0]), *call.args[1:]],
                        outputs=[take(o) for o in call.outputs],
                        states=[take(s) for s in call.states], mask=take(call.mask)),
                None if upstream is None else [take(g) for g in upstream])
    except _NotRows:
        return None


@dataclass
class Before:
    """What a change's numbers are compared with: the layer's own, read as a change's are,
    on the examples it runs on (None: the whole batch; :func:`changed_on`)."""

    examples: list[int] | None
    #: λ₁ of the layer's first tangent column alone where a change carries that one only
    #: (:func:`first_column_only`), else of every column; on those examples.
    lyapunov_1: float | None
    flow: StateFlow | None
    #: λ₁ is the first column's (:func:`first_column_only`): the text says so.
    first_column: bool


@dataclass
class Rerun:
    """What a counterfactual needs of the original run: the batch and the call. With
    ``scale``, the batch is the rows of the examples the changes run on alone
    (:func:`rows_rerun`), and ∂L/∂(the call's outputs) of a pass of them, times ``scale``,
    is the whole batch's at those rows."""

    inputs: dict[str, np.ndarray]
    targets: dict[str, np.ndarray]
    sample_weight: Any
    layer: str
    index: int
    label: str
    scale: float | None = None


def rows_rerun(copy: Any, rerun: Rerun, examples: list[int], upstream: list[Any] | None,
               call: Any, cache: dict[Any, Any]) -> Rerun | None:
    """``rerun`` on the rows ``examples`` alone, where a pass of them holds what the whole
    batch's does at those rows (else None: the changes run the whole batch). Witnessed on
    the model as it is: a pass of the rows (Keras' own call, traced for the changes
    after) must give the call the whole batch's inputs at those rows (no layer before it
    mixes the examples), and ∂L/∂(its outputs) the whole batch's ``upstream`` at those rows
    times one number (a loss that is a mean over the examples: B/b), to the replay's
    tolerance; that number then scales the changes' gradients back to the whole batch's
    loss. On the LSTM 256 × 2 at 1000 steps, a change's pass of the copy takes about a
    third of the time."""
    from gradscope.gradcheck import relative_error, tolerance
    from gradscope.keras.checked_examples import take
    from gradscope.keras.diagnose.captured import captured_pass

    if upstream is None:
        return None
    rows = np.asarray(examples)
    batch = int(np.shape(call.args[0])[0])
    try:
        taken = Rerun(inputs=take(rerun.inputs, examples, batch),
                      targets=take(rerun.targets, examples, batch),
                      sample_weight=take(rerun.sample_weight, examples, batch),
                      layer=rerun.layer, index=rerun.index, label=rerun.label)
        calls, found = captured_pass(copy, taken.inputs, taken.targets, taken.sample_weight,
                                     cache, upstream=rerun.label)
    except Exception:  # noqa: BLE001  (the user's model on fewer rows: the whole batch then)
        return None
    mine = next((c for c in calls if c.layer == rerun.layer and c.index == rerun.index), None)
    theirs = found.get(rerun.label)
    if mine is None or theirs is None or len(theirs) != len(upstream):
        return None
    rtol = tolerance("replay", copy.dtype_name).rtol
    if relative_error(mine.args[0], np.asarray(call.args[0])[rows]) > rtol:
        return None
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64)[rows])
             for a, b in zip(theirs, upstream, strict=True) if b is not None]
    if not pairs or any(a.shape != b.shape for a, b in pairs):
        return None
    ours = np.concatenate([a.ravel() for a, _ in pairs])
    whole = np.concatenate([b.ravel() for _, b in pairs])
    if not np.any(ours):
        return None
    scale = float(ours @ whole) / float(ours @ ours)
    if not (scale > 0 and relative_error(scale * ours, whole) <= rtol):
        return None
    return replace(taken, scale=scale)


def measure_change(copy: Any, rerun: Rerun, direction: int, kind: Kind, count: int,
                   cache: dict[Any, Any] | None = None,
                   examples: list[int] | None = None) -> Counterfactual:
    """One change on ``copy`` (its weights restored after), the call run and stepped again:
    λ₁ (from the layer's own start of ``count`` tangent columns; where they are fewer than
    the state's numbers, so drawn at random, only the first is carried
    (:func:`first_column_only`)), the horizon and ∂L/∂s_t. The copy's pass is Keras' own
    call, back to each call's outputs only
    (:func:`~gradscope.keras.diagnose.captured.captured_pass`; ``cache`` keeps its trace
    across the changes); the call is stepped at the rows ``examples`` alone (None: the
    whole batch; :func:`changed_on`)."""
    from gradscope._heap import give_back_freed_memory
    from gradscope.keras.diagnose.captured import captured_pass
    from gradscope.keras.diagnose.horizon import measure
    from gradscope.keras.diagnose.trajectory import lyapunov_logs, trajectory
    from gradscope.keras.stepped import carried_back, directions_of, step_call, step_squares

    directions = directions_of(copy.operation(rerun.layer), rerun.label)
    if isinstance(directions, str):
        return _not(kind, "", directions)
    cell = directions[direction].layer.cell
    words = change_words(kind, cell)
    change = next(c for name, _, c in CHANGES if name == kind)(cell)
    if isinstance(change, str):
        return _not(kind, words, change)
    kept = [(variable, np.array(variable.numpy())) for variable, _ in change]
    try:
        for (variable, value), (_, old) in zip(change, kept, strict=True):
            variable.assign(value.astype(old.dtype))
        # The pass and the stepping each start on what the phases before freed, given
        # back: the stepping is the peak of a diagnosis (gradscope/_heap.py).
        give_back_freed_memory()
        calls, upstream = captured_pass(copy, rerun.inputs, rerun.targets,
                                        rerun.sample_weight, cache, upstream=rerun.label)
        call = next((c for c in calls if c.layer == rerun.layer and c.index == rerun.index),
                    None)
        if call is None:
            return _not(kind, words, "the copy does not call the layer as the model does")
        given = upstream.get(rerun.label)
        if rerun.scale is not None:  # a pass of the rows alone: the whole batch's loss
            given = None if given is None else [None if g is None else rerun.scale * g
                                                for g in given]
        elif examples is not None:
            # The copy calls the layer with tensors of the model's own call's shapes, whose
            # rows changed_on has taken already.
            taken = at_rows(call, given, examples)
            assert taken is not None
            call, given = taken
        give_back_freed_memory()
        stepped = step_call(copy, call, given, copy.training, cell_dtype=True, reuse=True,
                            read_inputs=False, squares=True)
        if isinstance(stepped, str):
            return _not(kind, words, f"the changed copy could not be stepped: {stepped}")
        path = trajectory(stepped, direction)
        if isinstance(path, str):
            return _not(kind, words, path)
        carried = 1 if first_column_only(count, path.size) else None
        spectrum, _ = dynamics.lyapunov_exponents(
            lyapunov_logs(copy, path, count, carried=carried), path.ran)
        measured = measure(copy, path, stepped.call.mask)
    finally:
        for variable, value in kept:
            variable.assign(value)
    largest = float(spectrum[0]) if len(spectrum) else None
    return Counterfactual(kind=kind, change=words, applicable=True, horizon=measured.horizon,
                          horizon_window=measured.window,
                          predicted=dynamics.predicted_horizon(largest), lyapunov_1=largest,
                          flow=state_flow(step_squares(stepped, direction), path.ran,
                                          carried_back(stepped, direction),
                                          not carry_unread(stepped, direction)))


def _not(kind: Kind, words: str, why: str) -> Counterfactual:
    return Counterfactual(kind=kind, change=words or kind, applicable=False, note=why,
                          horizon=None, lyapunov_1=None)


def suggested_clipping(gradients: dict[str, Any], lyapunov_1: float | None,
                       horizon: int | None, window: int,
                       compiled: tuple[str, float | None] | None = None
                       ) -> Counterfactual | None:
    """global_clipnorm at the norm the batch suggests: √n times the median of the n tensors'
    gradient norms, the global norm the batch would have were every tensor's gradient a
    typical one of its own, so that a tensor out of line (an exploding layer's) no longer sets
    the step. Keras' rule (``_clip_gradients``): scale min(1, c/‖g‖). It changes the update,
    not the dynamics: λ₁ and the horizon stay as measured (None: no gradient). ``compiled``:
    the clipping the optimizer is compiled with and the global norm it leaves this batch's
    gradient at; Keras takes one setting, so the one suggested would replace it."""
    norms = [float(np.linalg.norm(np.asarray(g, np.float64))) for g in gradients.values()
             if g is not None]
    if not norms or not all(np.isfinite(norms)):
        return None
    total = float(np.sqrt(sum(n * n for n in norms)))
    suggested = float(np.sqrt(len(norms)) * np.median(norms))
    if not suggested > 0:
        return None
    scale = min(1.0, suggested / total) if total > 0 else 1.0
    instead = ("" if compiled is None else
               f"; Keras takes one clipping setting: it would replace the compiled "
               f"{compiled[0]}" + (
                   f", which holds this batch's gradient tighter (norm {compiled[1]:.3g} "
                   f"against {total * scale:.3g}): not a fix"
                   if compiled[1] is not None and total * scale >= compiled[1] else ""))
    return Counterfactual(
        kind="clipping", change=f"global_clipnorm={suggested:.3g}", applicable=True,
        note="the norm the batch suggests, √n × the median tensor norm; it changes the "
        "gradient, not the dynamics: λ₁ and the horizon are the layer's own, not rerun"
        + instead,
        horizon=horizon, horizon_window=window,
        predicted=dynamics.predicted_horizon(lyapunov_1), lyapunov_1=lyapunov_1,
        clip_norm=suggested, clip_scale=scale, gradient_norm=total * scale,
        compiled=None if compiled is None else compiled[0],
        compiled_norm=None if compiled is None else compiled[1])
