"""One direction of a stepped recurrent call, read along the batch's own trajectory: the pairs
(x_t, s_{t−1}) each step ran on, the Lyapunov scan (QR re-orthonormalisation, Benettin's
method) and the spectral norm of each step Jacobian J_t = ∂s_t/∂s_{t−1}.

Both run the layer's own cell, one step at a time: the Lyapunov scan in ``tf.while_loop``
with the k tangent columns folded into the batch (forward mode), the norms with time folded
into the batch (every pair at once). s is every state concatenated ([h, c] for an LSTM).

In training mode with dropout, the cell holds the masks the call drew
(:func:`~gradscope.keras.stepped.dropout_masks`), one row per example; every row folded into
the batch gets the masks of its own example (:func:`~gradscope.keras.stepped.masks_for_rows`),
so that J_t is the Jacobian of the step that example really took.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.keras.engine import class_label
from gradscope.keras.probed_flow import processing_ran
from gradscope.keras.stepped import (
    Masks,
    Stepped,
    cell_holding,
    cell_states,
    engine_cached,
    masks_for_rows,
)

#: Pairs (x_t, s_{t−1}) the step-Jacobian norms take at once (Lanczos keeps its basis for
#: each: rows × steps × state numbers in float64). oneDNN keeps a large matmul's working
#: memory after it: on the LSTM 256 × 2 at 1000 steps, 4096 rows left about 320 MiB held
#: through the rest of ``diagnose``, 1024 rows about 60 MiB, in the same time.
FOLD_ROWS = 1024
#: The step-Jacobian norms are taken at most at this many steps, evenly spaced (every step of
#: a shorter call): their cost then does not grow with the length of the sequence.
NORM_STEPS = 128
#: Exact norms (batch_jacobian and SVD) up to this many state numbers; Lanczos above.
EXACT_STATE = 32
#: The step norms of a step linearised by hand run under XLA where the pairs × the state's
#: numbers² × the products reach this: its compilation (about 0.4 s a layer) then pays (on
#: the LSTM 256 × 2 at 1000 steps, 5 × 10¹⁰: 1.1 s a layer instead of 2.0 s), and on a GRU
#: 64 at 50 steps (1.6 × 10⁸) it did not (0.8 s a layer instead of 0.3 s).
XLA_WORK = 10**9
#: Lanczos takes this many products (JᵀJ·q); a norm that moved by more than POWER_RTOL,
#: relatively, at the last is said to be a lower bound.
POWER_RTOL, POWER_STEPS = 1e-4, 24
#: A |R_t[i, i]| below this is taken as this: a log of 0 is no exponent.
SMALLEST_STRETCH = 1e-30
#: Steps at which a step linearised by hand is held to the layer's own (its pairs (x_t, s_{t−1})
#: of every example that ran there).
CHECKED_STEPS = 16


@dataclass
class Trajectory:
    """One direction's steps in processing order: x (B, T, ·), the states entering each step
    (one (B, T, w) per state, read flat: a ConvLSTM's feature maps are w numbers), and where
    each step ran (B, T) (a masked step keeps its state). ``initial`` keeps the states' own
    shapes; ``shapes`` is each state's shape per example where it has more than one axis.
    ``masks``: the dropout masks the cell stepped with, a row per example (None: none)."""

    layer: Any
    x: np.ndarray
    previous: list[np.ndarray]
    ran: np.ndarray
    initial: list[np.ndarray]
    sequences: list[np.ndarray]
    shapes: list[tuple[int, ...]] | None = None
    masks: Masks | None = None

    @property
    def widths(self) -> list[int]:
        return [int(s.shape[-1]) for s in self.previous]

    @property
    def size(self) -> int:
        return sum(self.widths)


def trajectory(stepped: Stepped, index: int) -> Trajectory | str:
    """Direction ``index`` of ``stepped`` as a :class:`Trajectory`, its states read flat."""
    direction = stepped.directions[index]
    counts = [len(d.names) for d in stepped.directions]
    start = int(np.sum(counts[:index]))
    call = stepped.call
    initial = [np.asarray(s) for s in call.states[start:start + counts[index]]]
    shapes = ([tuple(int(d) for d in s.shape[1:]) for s in initial]
              if any(s.ndim != 2 for s in initial) else None)
    sequences = [np.reshape(seq, (*np.shape(seq)[:2], -1)) for seq in stepped.states[index]]
    previous = [np.concatenate([np.reshape(s0, (len(s0), 1, -1)).astype(seq.dtype),
                                seq[:, :-1]], axis=1)
                for s0, seq in zip(initial, sequences, strict=True)]
    x = np.asarray(call.args[0])
    steps = x.shape[1]
    ran = processing_ran(call.mask, steps, direction.backwards)
    if ran is None:
        ran = np.ones(x.shape[:2], bool)
    if direction.backwards:
        x = x[:, ::-1]
    masks = None if stepped.masks is None else stepped.masks[index]
    odd = _not_per_example(masks, x.shape[0])
    if odd is not None:
        return odd
    return Trajectory(layer=direction.layer, x=np.ascontiguousarray(x), previous=previous,
                      ran=np.ascontiguousarray(ran), initial=initial, sequences=sequences,
                      shapes=shapes, masks=masks)


def _not_per_example(masks: Masks | None, batch: int) -> str | None:
    """Why ``masks`` cannot be given to rows folded into the batch (None: each has one row
    per example, as Keras' cells draw them), e.g. a cell of the user's drawing one mask
    broadcast over the batch."""
    if masks is None:
        return None
    for value in masks:
        for part in value if isinstance(value, (list, tuple)) else [value]:
            if part is not None and (np.ndim(part) < 1 or np.shape(part)[0] != batch):
                return (f"dropout in training mode: a mask of shape {np.shape(part)} is not "
                        f"one row per example of the batch of {batch}, so the rows folded "
                        "into the batch cannot be given their own (not diagnosed)")
    return None


def cut_directions(path: Trajectory) -> np.ndarray | str | None:
    """Per example, how many directions of the state a step maps to 0 because recurrent
    dropout cut them (B,): J_t is singular by that much at every step, so as many of the
    example's exponents are −∞. None without a recurrent mask; a reason where the cell is
    not one whose algebra gradscope knows for this.

    Keras' SimpleRNNCell: J_t = diag(φ′)·Rᵀ·diag(r), so each unit r drops. LSTMCell
    (``implementation=1``): with the c-rows taken out of the h-rows (h_t = o·tanh(c_t)),
    what is left of the h-rows is diag(tanh c_t)·∂o/∂h_(t−1), whose columns are those the
    output gate's mask r_o keeps: each unit r_o drops. GRUCell: J_t = diag(z) + …, with
    z ∈ (0, 1), is not made singular by its masks: none."""
    if path.masks is None or path.masks[1] is None:
        return None
    cell = path.layer.cell
    kind = class_label(cell)
    recurrent = path.masks[1]
    if kind == "GRUCell":
        return np.zeros(len(path.x), int)
    if kind == "SimpleRNNCell" and not isinstance(recurrent, (list, tuple)):
        return np.sum(np.asarray(recurrent) == 0, axis=1)
    if (kind == "LSTMCell" and isinstance(recurrent, (list, tuple)) and len(recurrent) == 4
            and getattr(cell, "implementation", 1) == 1):
        if not 0.0 < float(cell.recurrent_dropout) < 1.0:
            return np.zeros(len(path.x), int)  # drawn, but not applied by the step
        return np.sum(np.asarray(recurrent[3]) == 0, axis=1)
    return (f"recurrent_dropout in training mode in a {kind}: which directions of the state "
            "its masks cut (making J_t singular, those exponents −∞) is known for Keras' "
            "LSTM, GRU and SimpleRNN cells only (not diagnosed)")


def _step(engine: Any, layer: Any, shapes: list[tuple[int, ...]] | None = None) -> Any:
    """One step of the layer's cell: ``step(x_t, states, masks)`` → the new states, flat (a
    list), the cell holding ``masks`` (a row per row of x_t; None: none); with ``shapes``,
    the states come and go read flat (N, w), each given to the cell in its own shape."""
    tf, keras = engine.tf, engine.keras
    cell = layer.cell
    kwargs = ({"training": engine.training} if getattr(cell, "_call_has_training_arg", False)
              else {})

    def step(x_t: Any, states: list[Any], masks: Masks | None = None) -> list[Any]:
        if shapes is not None:
            states = [tf.reshape(s, [-1, *shape]) for s, shape in zip(states, shapes,
                                                                       strict=True)]
        with cell_holding(cell, masks):
            _, new = cell(x_t, cell_states(cell, list(states)), **kwargs)
        new = list(keras.tree.flatten(new))
        if shapes is not None:
            new = [tf.reshape(n, [tf.shape(n)[0], -1]) for n in new]
        return new

    return step


def lyapunov_logs(engine: Any, path: Trajectory, count: int, seed: int = 0,
                  carried: int | None = None, compiled: bool | None = None) -> np.ndarray:
    """log|R_t[i, i]| (B, T, count) along the trajectory: Q_0 = I (with fewer columns than
    states: ``count`` orthonormal columns drawn from ``seed``, so that no column starts inside
    a subspace the steps keep to themselves); J_t·Q_{t−1} = Q_t·R_t, J_t applied by forward
    mode through one step of the cell (the ``count`` columns folded into the batch; a Keras
    GRU, LSTM or SimpleRNN's step linearised by hand, :func:`_by_hand`); a masked step keeps
    Q (J = I there) and adds 0.

    ``carried``: only the first ``carried`` of those columns (B, T, carried). Gram–Schmidt
    makes column i of Q_t and R_t[i, i] from columns 0..i alone, so these logs are the first
    ``carried`` of the ``count`` columns' (to rounding), at ``carried``/``count`` of the
    cost: what a counterfactual's λ₁ (``carried=1``) needs.

    ``compiled``: a step linearised by hand is scanned under XLA, which fuses each step's
    small ops (on a GRU 64 → GRU 32 at 50 steps, batch 32, one column: 4.4 ms of CPU instead
    of 12 ms); its compilation (about a second on an LSTM 256) pays for a scan run again and
    again, as during ``fit``, and for a long scan of a wide layer (default: where the rows ×
    the steps × the columns × the state's numbers² reach :data:`XLA_WORK`; on the LSTM
    256 × 2 at 1000 steps, 6.7 × 10¹⁰, 1.0–1.5 s a layer less). The logs are the graph's to
    the rounding of the cell's dtype."""
    tf = engine.tf
    widths, size = path.widths, path.size
    start = np.eye(size, count) if count >= size else drawn_start(size, count, seed)
    if carried is not None:
        start = start[:, :max(1, min(carried, count))]
    by_hand = by_hand_kept(engine, path)
    if compiled is None:
        rows, steps = path.ran.shape
        compiled = rows * steps * start.shape[1] * size * size >= XLA_WORK
    compiled = compiled and by_hand is not None

    from gradscope._tf import native_stderr_silenced, without_grappler

    if by_hand is not None:
        # One scan for every layer of one algebra (both directions of a Bidirectional, a
        # stack of layers of one size), given each its own projected inputs and weights: on
        # the LSTM 256 × 2 at 1000 steps, the second layer's compilation (1.3 s) is gone;
        # and for the process (shared_function): a notebook's next diagnosis compiles none.
        scan = shared_function(("lyapunov scan", by_hand.key, tuple(widths), start.shape[1],
                                compiled),
                               lambda: _projected_scan(tf, by_hand.step_linear, widths,
                                                       start.shape[1],
                                                       path.layer.cell.compute_dtype, compiled))
        with native_stderr_silenced(), without_grappler():
            weights = by_hand.weights()
            projected = by_hand.projected(tf.cast(path.x, path.layer.cell.compute_dtype),
                                          weights)
            found = scan(projected, tf.convert_to_tensor(path.ran),
                         [tf.convert_to_tensor(p) for p in path.previous],
                         tf.convert_to_tensor(start), weights[1])
        return np.asarray(found, np.float64)
    scan = engine_cached(engine, ("lyapunov", id(path.layer), bool(engine.training),
                                  tuple(widths), start.shape[1]),
                         lambda: _lyapunov_scan(engine, path.layer, widths, start.shape[1],
                                                path.shapes))
    with native_stderr_silenced(), without_grappler():
        found = scan(tf.convert_to_tensor(path.x), tf.convert_to_tensor(path.ran),
                     [tf.convert_to_tensor(p) for p in path.previous],
                     tf.convert_to_tensor(start), path.masks)
    return np.asarray(found, np.float64)


def drawn_start(size: int, count: int, seed: int = 0) -> np.ndarray:
    """``count`` orthonormal columns of ``size`` numbers from ``seed`` (the Lyapunov scan's
    Q_0 where it takes fewer columns than the state has numbers): the QR of Gaussian columns
    drawn one after another, so that column i is the same whatever ``count`` is, and so is
    its exponent (Gram–Schmidt makes column i of Q_t and R_t[i, i] from columns 0..i alone):
    λ₁ read with one column, as a fit's diagnoses and a counterfactual take it, is the first
    column's of the eight ``diagnose`` takes."""
    columns = np.random.default_rng(seed).standard_normal((count, size)).T
    return np.linalg.qr(columns)[0]


def _by_hand(engine: Any, path: Trajectory) -> Any:
    """The layer's step linearised by hand (:func:`~gradscope.keras.stepped.linearised`, in
    the cell's dtype) where gradscope's cells model the layer and, run on pairs
    (x_t, s_{t−1}) of the trajectory at up to :data:`CHECKED_STEPS` evenly spaced steps, it
    gives the states the layer's own cell gave; else None (forward-mode autodiff of the
    layer's own step). Also None with dropout masks: gradscope's cells do not model them,
    and the layer's own cell, holding each row's masks, is differentiated instead."""
    from gradscope.gradcheck import tolerance
    from gradscope.keras.stepped import linearised

    if path.masks is not None:
        return None
    dtype = str(np.dtype(path.layer.cell.compute_dtype))
    tangent = linearised(engine, path.layer, dtype)
    if tangent is None:
        return None
    tf = engine.tf
    steps = path.ran.shape[1]
    checked = np.unique(np.linspace(0, steps - 1, min(CHECKED_STEPS, steps)).astype(int))
    x, previous, rows = folded_pairs(path, checked)
    if not len(rows):
        return None
    after, _ = tangent(None, [tf.constant(p, dtype) for p in previous], (tf.constant(x, dtype),),
                       [tf.zeros((1, len(rows), w), dtype) for w in path.widths])
    rtol, atol = tolerance("cross_check", dtype)
    for mine, sequence in zip(after, path.sequences, strict=True):
        truth = np.asarray(sequence)[rows[:, 0], rows[:, 1]]
        if not np.allclose(np.asarray(mine), truth, rtol=rtol, atol=atol):
            return None
    return tangent


def _lyapunov_scan(engine: Any, layer: Any, widths: list[int], count: int,
                   shapes: list[tuple[int, ...]] | None = None) -> Any:
    """The traced scan of :func:`lyapunov_logs` through forward mode of the layer's own
    step: ``scan(x, ran, previous, start, masks)`` → the logs (B, T, count). ``masks``: the
    dropout masks, a row per example (None: none), tiled as the columns are folded."""
    tf = engine.tf
    step = _step(engine, layer, shapes)
    size = sum(widths)
    dtype = layer.cell.compute_dtype

    def scan(x: Any, ran: Any, previous: list[Any], start: Any, masks: Masks | None) -> Any:
        # A while loop reading step t of the batch-major inputs in place: tf.scan would hold
        # time-major copies of them, and of their TensorArrays, through the whole loop.
        batch, steps = tf.shape(x)[0], tf.shape(x)[1]
        previous = [tf.cast(p, dtype) for p in previous]
        q0 = tf.tile(tf.cast(start, dtype)[None], [batch, 1, 1])
        repeats = [count] + [1] * (len(x.shape) - 2)
        # Row c·B + b of the fold is column c of example b: it takes example b's masks.
        held = masks_for_rows(tf, masks, tf.tile(tf.range(batch), [count]))

        def body(t: Any, q: Any, written: Any) -> tuple[Any, Any, Any]:
            x_t, ran_t, prev_t = x[:, t], ran[:, t], [p[:, t] for p in previous]
            columns = tf.reshape(tf.transpose(q, [2, 0, 1]), [-1, size])
            tangents = tf.split(columns, widths, axis=1)
            primals = [tf.tile(p, [count, 1]) for p in prev_t]
            with tf.autodiff.ForwardAccumulator(primals, tangents) as acc:
                new = step(tf.tile(x_t, repeats), primals, held)
            moved = tf.concat([acc.jvp(n, unconnected_gradients="zero") for n in new], 1)
            moved = tf.transpose(tf.reshape(moved, [count, batch, size]), [1, 2, 0])
            q_new, logs = stretched(tf, moved)
            return t + 1, *_kept_where_ran(tf, ran_t, q_new, q, logs, written, t)

        return _scanned(tf, steps, q0, count, body)

    from gradscope._tf import batch_free

    return batch_free(tf, tf.function(scan, autograph=False, reduce_retracing=True))


def _projected_scan(tf: Any, step_linear: Any, widths: list[int], count: int, dtype: Any,
                    compiled: bool) -> Any:
    """The traced scan of :func:`lyapunov_logs` through a step linearised by hand
    (:func:`_by_hand`; ``step_linear``: its ``step_linear``, which holds no layer), which
    carries the columns with the step's own values computed once:
    ``scan(projected, ran, previous, start, step_weights)`` → the logs (B, T, count), from
    the projected inputs (B, T, ·) and the step weights, its arguments: one trace (and one
    compilation) for every layer of the algebra ``by_hand.key``. ``compiled``: under XLA
    (where it compiles: :func:`~gradscope._tf.xla_or_graph`)."""
    def scan(projected: Any, ran: Any, previous: list[Any], start: Any,
             step_weights: Any) -> Any:
        # The batch read from ``ran``, batch-major (its first axis is the one left free).
        batch, steps = tf.shape(ran)[0], tf.shape(ran)[1]
        previous = [tf.cast(p, dtype) for p in previous]
        q0 = tf.tile(tf.cast(start, dtype)[None], [batch, 1, 1])

        def body(t: Any, q: Any, written: Any) -> tuple[Any, Any, Any]:
            def step(blocks: list[Any]) -> tuple[list[Any], list[Any]]:
                after, apply = step_linear([p[:, t] for p in previous], projected[:, t],
                                           step_weights)
                return after, apply(blocks)

            _, q_new, logs = carried_step(tf, step, q, widths)
            return t + 1, *_kept_where_ran(tf, ran[:, t], q_new, q, logs, written, t)

        return _scanned(tf, steps, q0, count, body)

    if compiled:
        from gradscope._tf import xla_or_graph

        return xla_or_graph(tf, scan, autograph=False, reduce_retracing=True)
    from gradscope._tf import batch_free

    return batch_free(tf, tf.function(scan, autograph=False, reduce_retracing=True))


def _kept_where_ran(tf: Any, ran_t: Any, q_new: Any, q: Any, logs: Any, written: Any,
                    t: Any) -> tuple[Any, Any]:
    """A masked step keeps Q (J = I there) and adds 0."""
    q_new = tf.where(ran_t[:, None, None], q_new, q)
    logs = tf.where(ran_t[:, None], logs, tf.zeros_like(logs))
    return q_new, written.write(t, logs)


def _scanned(tf: Any, steps: Any, q0: Any, count: int, body: Any) -> Any:
    """The logs (B, T, count) of a while loop of ``body`` over the steps from Q_0 ``q0``."""
    _, _, written = tf.while_loop(
        lambda t, q, written: t < steps, body,
        (tf.constant(0), q0, tf.TensorArray(tf.float64, size=steps,
                                             element_shape=[None, count])))
    return tf.transpose(written.stack(), [1, 0, 2])


def carried_step(tf: Any, step: Any, q: Any, widths: list[int]) -> tuple[list[Any], Any, Any]:
    """One step of the Lyapunov scan through a step linearised by hand, ``step(blocks)`` →
    (the new states, J_t applied to the blocks of tangent columns (k, B, w) per state): the
    new states, Q_t and log|R_t[i, i]| of J_t·Q_(t−1) (``q``: (B, S, k), the states'
    ``widths`` making S)."""
    blocks = tf.split(tf.transpose(q, [2, 0, 1]), widths, axis=2)  # (k, B, w)
    after, carried = step(blocks)
    q_new, logs = stretched(tf, tf.transpose(tf.concat(carried, axis=2), [1, 2, 0]))
    return after, q_new, logs


def stretched(tf: Any, moved: Any) -> tuple[Any, Any]:
    """Q of ``moved`` (B, S, k) and the logs of R's diagonal (floored at
    :data:`SMALLEST_STRETCH`)."""
    q, r = orthonormalised(tf, moved)
    return q, tf.math.log(tf.maximum(tf.linalg.diag_part(r),
                                     tf.constant(SMALLEST_STRETCH, tf.float64)))


def orthonormalised(tf: Any, moved: Any) -> tuple[Any, Any]:
    """The QR of each (S, k) block of ``moved`` (B, S, k), R's diagonal positive: Q in
    ``moved``'s dtype, R in float64 (its diagonal is what the exponents are made of: in a
    float16 step its rounding, and a floor of 10⁻³⁰ that rounds to 0, would be theirs). By
    Cholesky QR in float64 (the k × k Gram matrix, its Cholesky factor
    L, Q = M·L⁻ᵀ: a few small matmuls, about a third of the time of TensorFlow's Householder
    QR on the LSTM 256 × 2's (32, 512, 8) blocks), where its Q is orthonormal to 10⁻¹⁰
    (QᵀQ within 10⁻¹⁰ of I, which Q's own Gram matrix shows); else once more from that Q
    (Cholesky QR twice), held to the same; else, for a block of (nearly) dependent columns,
    whose Gram matrix is not positive definite in float64 (a dead unit's zero row of J_t),
    Householder's for that step. One column: its norm (Householder's where a column is 0)."""
    def householder() -> tuple[Any, Any]:
        # In float64: TensorFlow's QR takes no bfloat16 (a mixed_bfloat16 policy's steps).
        q, r = tf.linalg.qr(tf.cast(moved, tf.float64))
        diagonal = tf.linalg.diag_part(r)
        signs = tf.where(diagonal < 0, -tf.ones_like(diagonal), tf.ones_like(diagonal))
        return tf.cast(q * signs[:, None, :], moved.dtype), r * signs[:, :, None]

    wide = tf.cast(moved, tf.float64)
    if moved.shape[-1] == 1:  # one column: its norm, where no column is 0
        norm = tf.norm(wide, axis=1, keepdims=True)  # (B, 1, 1)
        first = tf.one_hot(tf.zeros(tf.shape(wide)[:1], tf.int32), tf.shape(wide)[1],
                           dtype=tf.float64)[:, :, None]
        unit = tf.where(norm > 0, wide / tf.where(norm > 0, norm, 1.0), first)
        return tf.cast(unit, moved.dtype), norm
    eye = tf.eye(tf.shape(wide)[-1], batch_shape=tf.shape(wide)[:1], dtype=tf.float64)

    def cholesky_qr(block: Any, gram: Any) -> tuple[Any, Any, Any]:
        lower = tf.linalg.cholesky(gram)
        inverse = tf.linalg.triangular_solve(lower, eye, lower=True)  # k × k
        q = tf.linalg.matmul(block, inverse, transpose_b=True)
        return q, tf.linalg.matrix_transpose(lower), tf.linalg.matmul(q, q, transpose_a=True)

    def orthonormal(gram: Any) -> Any:
        # A failed Cholesky factor is NaN (on CPU), and NaN < 1e-10 is False.
        return tf.reduce_max(tf.abs(gram - eye)) < 1e-10

    first, r_first, gram = cholesky_qr(wide, tf.linalg.matmul(wide, wide, transpose_a=True))

    def again() -> tuple[Any, Any]:
        q, r_second, regram = cholesky_qr(first, gram)
        return tf.cond(orthonormal(regram),
                       lambda: (tf.cast(q, moved.dtype), r_second @ r_first), householder)

    return tf.cond(orthonormal(gram), lambda: (tf.cast(first, moved.dtype), r_first), again)


def folded_pairs(path: Trajectory, steps: np.ndarray | None = None
                 ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Every pair (x_t, s_{t−1}) a step ran on (of ``steps`` only, when given), time folded
    into the batch: x (N, ·), the states (N, w) each, and the (example, step) of each row
    (N, 2)."""
    ran = path.ran
    if steps is not None:
        ran = ran & np.isin(np.arange(ran.shape[1]), steps)[None, :]
    rows = np.argwhere(ran)
    x = path.x[rows[:, 0], rows[:, 1]]
    previous = [p[rows[:, 0], rows[:, 1]] for p in path.previous]
    return x, previous, rows


def step_norms(engine: Any, path: Trajectory, exact: bool | None = None,
               seed: int = 0, compiled: bool | None = None) -> tuple[np.ndarray, str, int]:
    """The spectral norm ‖J_t‖₂ of every step that ran (at most :data:`NORM_STEPS` steps,
    evenly spaced), (B, T), NaN where a step did not run or was not taken; how it was
    computed; and at how many steps it was taken. ``exact`` (default: for states of at most
    :data:`EXACT_STATE` numbers): ``batch_jacobian`` and SVD; else Lanczos on JᵀJ
    (:func:`_lanczos`), :data:`POWER_STEPS` products, each a JVP then a VJP of one step: a
    Keras GRU, LSTM or SimpleRNN's step linearised by hand (:func:`_by_hand`: its values
    computed once per pair, each product two matmuls), else forward mode through the
    layer's own step and the tape back. Each pair (example, step) steps with its example's
    dropout masks. ``compiled``: a step linearised by hand under XLA (default: where the work
    reaches :data:`XLA_WORK`)."""
    tf = engine.tf
    widths, size = path.widths, path.size
    exact = size <= EXACT_STATE if exact is None else exact
    steps = path.ran.shape[1]
    taken = (np.arange(steps) if steps <= NORM_STEPS else
             np.unique(np.linspace(0, steps - 1, NORM_STEPS).round().astype(int)))
    x, previous, rows = folded_pairs(path, taken)
    by_hand = None if exact else by_hand_kept(engine, path)
    products = min(POWER_STEPS, size)
    # XLA where its compilation (about 0.4 s) pays: a wide layer's many products.
    compiled = by_hand is not None and (len(rows) * size * size * products >= XLA_WORK
                                        if compiled is None else compiled)
    dtype = path.layer.cell.compute_dtype
    # A step linearised by hand: one function for every layer of its algebra, given the
    # projected inputs and the step weights (:func:`_projected_scan`).
    traced = (shared_function(("step norms by hand", by_hand.key, tuple(widths), compiled),
                              lambda: _by_hand_norms_function(tf, by_hand.step_linear, widths,
                                                              dtype, compiled))
              if by_hand is not None else
              engine_cached(engine, ("step norms", id(path.layer), bool(engine.training),
                                     tuple(widths), exact),
                            lambda: _norms_function(engine, path.layer, widths, exact,
                                                    path.shapes)))

    from gradscope._tf import native_stderr_silenced, without_grappler

    norms = np.full(len(rows), np.nan)
    unsettled = 0
    generator = np.random.default_rng(seed)
    with native_stderr_silenced(), without_grappler():
        weights = by_hand.weights() if by_hand is not None else None
        for part, taken_rows in even_folds(len(rows), FOLD_ROWS):
            xs = tf.convert_to_tensor(x[taken_rows])
            if by_hand is not None and weights is not None:  # projected, the step weights
                xs = (by_hand.projected(tf.cast(xs, dtype)[None], weights)[0], weights[1])
            joined = [tf.convert_to_tensor(p[taken_rows]) for p in previous]
            held = masks_for_rows(tf, path.masks, rows[taken_rows, 0])  # each row's example's
            real = part.stop - part.start
            if exact:
                found = np.asarray(traced(xs, joined, held), np.float64)[:real]
                norms[part] = np.linalg.svd(found, compute_uv=False)[:, 0]
                continue
            drawn = generator.standard_normal((real, size))
            start = tf.constant(drawn[np.minimum(np.arange(len(taken_rows)), real - 1)])
            alphas, betas = traced(xs, joined, held, start, tf.constant(products))
            norms[part], moving = ritz_largest(np.asarray(alphas).T[:real],
                                               np.asarray(betas).T[:real])
            unsettled += moving
    sampled = (f"at {len(taken)} of {steps} steps, evenly spaced; " if len(taken) < steps
               else "")
    method = sampled + ("exact: batch_jacobian of one step and its SVD" if exact else
              f"Lanczos on JᵀJ, {products} products (a JVP and a VJP of one step"
              + (", linearised by hand" if by_hand is not None else "") + ")" + (
                  f"; {unsettled} of {len(rows)} steps still moved by more than "
                  f"{POWER_RTOL:g} at the last product (their norms are lower bounds)"
                  if unsettled else f", each settled to {POWER_RTOL:g}"))
    grid = np.full(path.ran.shape, np.nan)
    grid[rows[:, 0], rows[:, 1]] = norms
    return grid, method, len(taken)


def even_folds(count: int, most: int) -> list[tuple[slice, np.ndarray]]:
    """Rows 0 … ``count`` − 1 in folds of one size, at most ``most`` (as few folds as that
    allows): each fold's rows, and the indices to take for them, the last fold's padded with
    its own last row up to that size. Every call of a traced function then takes one shape:
    one trace, and under XLA one compilation (a last, shorter fold was traced, or compiled,
    a second time: 0.4–0.5 s a layer on a small GRU model's step norms)."""
    if count <= 0:
        return []
    folds = -(-count // most)
    size = -(-count // folds)
    found = []
    for first in range(0, count, size):
        stop = min(first + size, count)
        found.append((slice(first, stop),
                      np.minimum(np.arange(first, first + size), stop - 1)))
    return found


def by_hand_kept(engine: Any, path: Trajectory) -> Any:
    """:func:`_by_hand`, witnessed once per layer and kept on the engine."""
    return engine_cached(engine, ("lyapunov by hand", id(path.layer), bool(engine.training)),
                         lambda: [_by_hand(engine, path)])[0]


def _norms_function(engine: Any, layer: Any, widths: list[int], exact: bool,
                    shapes: list[tuple[int, ...]] | None) -> Any:
    """The traced function of :func:`step_norms` through the layer's own step:
    ``(x, previous, masks)`` → the step Jacobians (N, S, S) where ``exact``; else
    ``(x, previous, masks, start, products)`` → Lanczos' α and β (products, N) each, in
    float64, each product forward mode through the step and the tape back. ``masks``: the
    dropout masks of each row (None: none)."""
    tf = engine.tf
    step = _step(engine, layer, shapes)
    dtype = layer.cell.compute_dtype

    if exact:
        @tf.function(autograph=False, reduce_retracing=True)
        def jacobian(x: Any, previous: list[Any], masks: Masks | None) -> Any:
            joined = tf.cast(tf.concat(previous, 1), dtype)
            with tf.GradientTape() as tape:
                tape.watch(joined)
                new = tf.concat(step(x, list(tf.split(joined, widths, axis=1)), masks), 1)
            return tape.batch_jacobian(new, joined, experimental_use_pfor=False)

        return jacobian

    def tridiagonal(x: Any, previous: list[Any], masks: Masks | None, start: Any,
                    products: Any) -> Any:
        joined = tf.concat([tf.cast(p, dtype) for p in previous], 1)

        def normal(q: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(joined)
                with tf.autodiff.ForwardAccumulator(joined, tf.cast(q, dtype)) as acc:
                    new = tf.concat(step(x, list(tf.split(joined, widths, axis=1)), masks), 1)
                moved = acc.jvp(new, unconnected_gradients="zero")
            return tape.gradient(new, joined, output_gradients=moved,
                                 unconnected_gradients="zero")

        return _lanczos(tf, lambda q: tf.cast(normal(q), tf.float64), start, products)

    return tf.function(tridiagonal, autograph=False, reduce_retracing=True)


def _by_hand_norms_function(tf: Any, step_linear: Any, widths: list[int], dtype: Any,
                            compiled: bool) -> Any:
    """The traced function of :func:`step_norms` through a step linearised by hand
    (``step_linear``, which holds no layer): ``(x, previous, masks, start, products)`` →
    Lanczos' α and β (products, N) each, in float64, ``x`` being (the projected inputs, the
    step weights), so that it serves every layer of its algebra, in every engine; each
    product two matmuls. ``masks`` is None (the step has none). ``compiled``: under XLA
    where it compiles."""
    def tridiagonal(x: Any, previous: list[Any], masks: Masks | None, start: Any,
                    products: Any) -> Any:
        _, apply = step_linear([tf.cast(p, dtype) for p in previous], *x)

        def normal(q: Any) -> Any:
            v = tf.cast(q, dtype)
            with tf.GradientTape() as tape:
                tape.watch(v)
                moved = tf.concat(apply(tf.split(v[None], widths, axis=2)), axis=2)[0]
            return tape.gradient(moved, v, output_gradients=moved)

        return _lanczos(tf, lambda q: tf.cast(normal(q), tf.float64), start, products)

    if compiled:
        from gradscope._tf import xla_or_graph

        # XLA fuses each product's elementwise ops (on the LSTM 256 × 2 at 1000 steps, 1.1 s
        # a layer instead of 2.0 s).
        return xla_or_graph(tf, tridiagonal, autograph=False, reduce_retracing=True)
    return tf.function(tridiagonal, autograph=False, reduce_retracing=True)


#: How many functions of a step linearised by hand :func:`shared_function` keeps.
SHARED_FUNCTIONS = 16
_shared: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()
_shared_lock = threading.Lock()


def shared_function(key: tuple[Any, ...], build: Any) -> Any:
    """``build()`` (a traced function of a step linearised by hand, whose every value is
    its arguments: the projected inputs, the states, the step weights), made once for the
    process per ``key`` (its algebra, shapes and compilation) and kept for the next
    diagnosis, of this model or another, as the engine keeps a layer's own: a notebook's
    second ``gradscope.diagnose`` of the LSTM 256 × 2 at 1000 steps no longer compiles its
    Lyapunov scan and step norms again (about 2 s). The last :data:`SHARED_FUNCTIONS`."""
    with _shared_lock:
        if key in _shared:
            _shared.move_to_end(key)
            return _shared[key]
    function = build()
    with _shared_lock:
        function = _shared.setdefault(key, function)
        _shared.move_to_end(key)
        while len(_shared) > SHARED_FUNCTIONS:
            _shared.popitem(last=False)
    return function


def _lanczos(tf: Any, normal: Any, start: Any, products: Any) -> tuple[Any, Any]:
    """Lanczos on a symmetric positive semi-definite JᵀJ per row, given ``normal(q)`` =
    JᵀJ·q (rows of q), from ``start``: its α and β (products, rows), in float64. Without
    re-orthogonalisation the basis loses orthogonality once a value has converged, which only
    repeats that value among the Ritz values: the largest stays right. A row whose Krylov
    space is whole (β = 0) goes on from a zero vector: its tridiagonal is then exact."""
    q = start / tf.maximum(tf.norm(start, axis=1, keepdims=True), 1e-300)
    rows = tf.shape(start)[0]

    def body(j: Any, q: Any, before: Any, beta: Any, alphas: Any, betas: Any) -> Any:
        w = normal(q)
        alpha = tf.reduce_sum(q * w, axis=1)
        w = w - alpha[:, None] * q - beta[:, None] * before
        beta = tf.norm(w, axis=1)
        safe = tf.where(beta > 0, beta, tf.ones_like(beta))
        following = tf.where(beta[:, None] > 0, w / safe[:, None], tf.zeros_like(w))
        return j + 1, following, q, beta, alphas.write(j, alpha), betas.write(j, beta)

    empty = tf.TensorArray(tf.float64, size=products, element_shape=[None])
    *_, alphas, betas = tf.while_loop(
        lambda j, *rest: j < products, body,
        (tf.constant(0), q, tf.zeros_like(q), tf.zeros([rows], tf.float64), empty, empty))
    return alphas.stack(), betas.stack()


def ritz_largest(alphas: np.ndarray, betas: np.ndarray) -> tuple[np.ndarray, int]:
    """Per row, the largest singular value of J from Lanczos' α, β (rows, m) on JᵀJ: the
    square root of the largest eigenvalue of the m × m tridiagonal (its error after m
    products falls as the power method's after about m²; a Ritz value never exceeds the
    largest eigenvalue); and how many rows it still moved for, by more than
    :data:`POWER_RTOL` relatively, from m − 1 products to m (theirs are lower bounds)."""
    def top(m: int) -> np.ndarray:
        rows = alphas.shape[0]
        tridiagonal = np.zeros((rows, m, m))
        index = np.arange(m)
        tridiagonal[:, index, index] = alphas[:, :m]
        tridiagonal[:, index[1:], index[:-1]] = betas[:, :m - 1]
        tridiagonal[:, index[:-1], index[1:]] = betas[:, :m - 1]
        return np.sqrt(np.maximum(np.linalg.eigvalsh(tridiagonal)[:, -1], 0.0))

    m = alphas.shape[1]
    last = top(m)
    if m < 2:
        return last, 0
    moving = np.abs(last - top(m - 1)) > POWER_RTOL * np.maximum(last, 1e-30)
    return last, int(np.sum(moving))
