"""The memory horizon of one direction of a stepped call, measured: per example and for a few
steps t (in the second half of the steps the examples ran), ‖∂h_t/∂x_{t−k}‖ / ‖∂h_t/∂x_t‖
for every lag k in a window before t. A masked step reads no input (it keeps its state): its
lag is left out, not counted as an influence of 0, and so is every lag of a masked t.

Exact, two ways. A Keras GRU, LSTM or SimpleRNN whose step gradscope's cells linearise by
hand (held to the layer's own states): the cotangent of h_t goes back through Jᵀ of each
step, one lag at a time, read at the trajectory's own states, every output unit of every
(t, example) folded into one block. Any other cell, and dropout masks: the window's steps are
stepped again through the layer's own cell from the state the trajectory held where the
window begins (h_t depends on x_s, s ≥ t − W, through those steps alone), with the output
units folded into the batch, so one backward pass gives every row of ∂h_t/∂x; in training
mode with dropout, each folded row steps with the masks of its own example. The window
doubles until the median ratio falls below 10⁻³, up to a budget (the second way's memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.dynamics import measured_horizon, median_ratios
from gradscope.keras.diagnose.trajectory import (
    XLA_WORK,
    Trajectory,
    by_hand_kept,
    shared_function,
)
from gradscope.keras.stepped import Masks, cell_holding, engine_cached, masks_for_rows, scan_cell

#: At most this many steps t, and examples, are measured (evenly spaced).
STEPS, EXAMPLES = 8, 8
#: The first window, in steps before t.
FIRST_WINDOW = 16
#: The most numbers one window's backward pass holds: per row and step, the input, its
#: gradient and what the cell keeps for the backward pass (about 10 numbers per state number).
WINDOW_NUMBERS = 2**26


@dataclass
class Measured:
    """The median ratio per lag (0 to ``window``), the horizon (None: beyond the window), the
    steps t and examples it was measured at (processing order), and the longest lag those
    steps have (a window below it stopped at the memory budget)."""

    medians: np.ndarray
    horizon: int | None
    window: int
    steps: list[int]
    examples: list[int]
    longest: int = 0


def evenly(count: int, most: int, start: int = 0) -> list[int]:
    """Up to ``most`` of ``start`` … ``count`` − 1, evenly spaced, the last among them."""
    return sorted({int(round(v)) for v in np.linspace(start, count - 1, min(most, count - start))})


def output_width(layer: Any, path: Trajectory) -> int:
    cell = layer.cell
    size = getattr(cell, "output_size", None)
    if isinstance(size, int):
        return size
    return path.widths[0]


def measure(engine: Any, path: Trajectory, mask: np.ndarray | None,
            compiled: bool | None = None) -> Measured:
    """The measured horizon of ``path`` (``mask``: the call's, input order, or None).
    ``compiled``: a step linearised by hand goes back under XLA (default: where the widest
    window's work, the lags × the pairs (t, example) × the output units × the state's
    numbers², reaches :data:`~gradscope.keras.diagnose.trajectory.XLA_WORK`: on the LSTM
    256 × 2 at 1000 steps, 1.8 × 10¹⁰; a small model's compilation, 0.15–0.3 s a layer and
    again on each copy a change runs on, cost more than it saved)."""
    tf = engine.tf
    layer = path.layer
    batch, steps = path.ran.shape
    units = output_width(layer, path)
    features = int(np.prod(path.x.shape[2:]))
    per_step = units * (2 * features + 10 * path.size)  # one example, one window step
    # as many examples (up to EXAMPLES) as the first window affords, at least one
    examples = _with_longest(evenly(batch, max(1, min(EXAMPLES, WINDOW_NUMBERS // (
        per_step * (FIRST_WINDOW + 1))))), path.ran)
    # Steps in the second half of those the chosen examples ran: a padded batch's masked
    # tail reads no input, and steps there would measure nothing.
    live = np.nonzero(path.ran[examples].any(axis=0))[0]
    live = live if live.size else np.arange(steps)
    ts = [int(live[k]) for k in evenly(len(live), STEPS, start=len(live) // 2)]
    budget = max(1, WINDOW_NUMBERS // (per_step * len(examples)))
    # The longest lag any step t can have: back to the first step the examples ran (a batch
    # padded before its sequences reads no input before it: lags there are not measured).
    reach = max(ts) - int(live[0])

    by_hand = by_hand_kept(engine, path) if units == path.widths[0] else None
    window = min(FIRST_WINDOW, reach)
    most = _widest(window, reach, budget)
    if compiled is None:
        compiled = ((most + 1) * len(ts) * len(examples) * units * path.size ** 2
                    >= XLA_WORK)
    dtype = layer.cell.compute_dtype
    # A step linearised by hand: the process's function of its algebra, given the layer's
    # weights (trajectory.shared_function).
    window_norms = (
        engine_cached(engine, ("horizon", id(layer), bool(engine.training), units),
                      lambda: _window_norms(engine, layer, units)) if by_hand is None else
        shared_function(("horizon by hand", by_hand.key, units, compiled),
                        lambda: _by_hand_norms(tf, units, by_hand.projected,
                                               by_hand.step_linear, dtype, compiled)))
    # Row e·units + u of the fold is output unit u of example examples[e]: its masks.
    held = masks_for_rows(tf, path.masks, np.repeat(np.asarray(examples), units))

    from gradscope._tf import native_stderr_silenced, without_grappler

    lags = (_LagReader(tf, window_norms, path, examples, ts, most, units, by_hand.weights())
            if by_hand is not None else None)
    while True:
        with native_stderr_silenced(), without_grappler():
            ratios = (lags.ratios(window) if lags is not None else
                      _each_window(tf, window_norms, path, mask, held, examples, ts, window))
        medians = median_ratios(ratios)
        horizon = measured_horizon(medians)
        wider = _wider(window, reach, budget)
        if horizon is not None or wider is None:
            return Measured(medians=medians, horizon=horizon, window=window, steps=ts,
                            examples=examples, longest=reach)
        window = wider


def _with_longest(examples: list[int], ran: np.ndarray) -> list[int]:
    """``examples`` with the batch's example that ran the most steps among them (in place of
    the nearest), so that the lags measured reach as far back as any example's do: a padded
    batch's evenly spaced examples may all be shorter (found tried as a new user would: "every
    lag there is" said of 18 lags where one example, not measured, had 19)."""
    counts = np.sum(ran, axis=1)
    longest = int(np.argmax(counts))
    if counts[examples].max() >= counts[longest]:
        return examples
    nearest = min(examples, key=lambda e: abs(e - longest))
    return sorted({*examples, longest} - {nearest})


def _wider(window: int, reach: int, budget: int) -> int | None:
    """The window :func:`measure` tries after ``window``, where its horizon lies beyond it:
    twice as wide (up to ``reach``, the longest lag there is); None where ``window`` already
    reaches it, or twice it passes the memory ``budget``."""
    return None if window >= reach or 2 * window > budget else min(2 * window, reach)


def _widest(window: int, reach: int, budget: int) -> int:
    """The widest window :func:`measure` may try, from its first ``window``."""
    while (wider := _wider(window, reach, budget)) is not None:
        window = wider
    return window


def _each_window(tf: Any, window_norms: Any, path: Trajectory, mask: np.ndarray | None,
                 held: Masks | None, examples: list[int], ts: list[int],
                 window: int) -> np.ndarray:
    """The ratios of :meth:`_LagReader.ratios`, each t's window stepped again through the
    layer's own cell under a tape (:func:`_window_norms`; ``held``: each folded row's
    dropout masks), from the state the trajectory held where the window begins."""
    backwards = bool(getattr(path.layer, "go_backwards", False))
    steps = path.ran.shape[1]
    x_input = path.x[:, ::-1] if backwards else path.x  # back in input order
    ratios = []
    for t in ts:
        first = max(0, t - window)
        lags = t - first
        # processing steps first..t, in input order when the layer runs backwards
        span = (slice(steps - 1 - t, steps - first) if backwards else slice(first, t + 1))
        initial = [p[examples, first] for p in path.previous]
        if path.shapes is not None:  # read flat: given to the cell in their own shapes
            initial = [np.reshape(s, (len(examples), *shape))
                       for s, shape in zip(initial, path.shapes, strict=True)]
        x = x_input[examples, span]
        part = None if mask is None else np.asarray(mask, bool)[examples, span]
        norms = np.asarray(window_norms(tf.convert_to_tensor(x),
                                        None if part is None else tf.convert_to_tensor(part),
                                        [tf.convert_to_tensor(s) for s in initial], held))
        if backwards:
            norms = norms[:, ::-1]  # processing order
        own = norms[:, -1]
        row = np.full((len(examples), window + 1), np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            found = norms[:, ::-1] / own[:, None]  # lag 0 first
        found[~(own > 0)] = np.nan
        if part is not None:  # a masked step reads no input: no influence to measure
            ran = part[:, ::-1] if backwards else part  # processing order
            found[~ran[:, ::-1]] = np.nan
        row[:, :lags + 1] = found
        ratios.append(row)
    return np.concatenate(ratios, axis=0)


class _LagReader:
    """The ratios ‖∂h_t/∂x_(t−k)‖ / ‖∂h_t/∂x_t‖ of every pair (t, example) at once, through
    the step linearised by hand (:func:`_by_hand_norms`), window after window: each wider
    window goes on from the lags the one before went back through, carrying the cotangent
    on, where it started again from lag 0 (on an LSTM 16 × 2 at 400 steps whose horizon lies
    beyond every window, up to 399 lags: a change's horizon 0.12 s instead of 0.24 s). What
    each lag's pairs read (K = ``most`` + 1 lags) is gathered once."""

    def __init__(self, tf: Any, lag_norms: Any, path: Trajectory, examples: list[int],
                 ts: list[int], most: int, units: int, weights: Any) -> None:
        self.tf, self.lag_norms, self.weights = tf, lag_norms, weights
        lags = most + 1
        pairs = [(t, e) for t in ts for e in examples]
        steps = np.array([[t - k for t, _ in pairs] for k in range(lags)])  # (K, P)
        rows = np.array([e for _, e in pairs])[None, :].repeat(lags, axis=0)
        at = np.maximum(steps, 0)
        self.live = (steps >= 0) & path.ran[rows, at]
        self.x = tf.convert_to_tensor(path.x[rows, at])
        self.previous = [tf.convert_to_tensor(p[rows, at]) for p in path.previous]
        dtype = path.layer.cell.compute_dtype
        # The cotangent of h_t: every output unit of every pair, one row each.
        self.cotangent = [tf.tile(tf.eye(units, dtype=dtype)[:, None, :], [1, len(pairs), 1])]
        self.cotangent += [tf.zeros([units, len(pairs), p.shape[-1]], dtype)
                           for p in path.previous[1:]]
        self.squares = np.zeros((lags, len(pairs)))
        self.done = 0  # lags gone back through

    def ratios(self, window: int) -> np.ndarray:
        """(len(ts)·len(examples), window + 1), rows t-major, lag 0 first, NaN where step
        t − k is before step 0, did not run (masked), or where ‖∂h_t/∂x_t‖ is 0."""
        tf = self.tf
        if window + 1 > self.done:
            written, self.cotangent = self.lag_norms(
                self.x, self.previous, tf.convert_to_tensor(self.live),
                tf.constant(self.done), tf.constant(window + 1), self.cotangent, self.weights)
            self.squares += np.asarray(written, np.float64)
            self.done = window + 1
        norms = np.sqrt(self.squares).T[:, :window + 1]
        live = self.live[:window + 1]
        own = norms[:, :1]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = norms / own
        ratios[~live.T] = np.nan
        ratios[~(own[:, 0] > 0)] = np.nan
        return ratios


def _by_hand_norms(tf: Any, units: int, projected: Any, step_linear: Any, dtype: Any,
                   compiled: bool = True) -> Any:
    """The traced pass of :func:`measure` for a step linearised by hand
    (:func:`~gradscope.keras.diagnose.trajectory.by_hand_kept`; its ``projected`` and
    ``step_linear``, which hold no layer): ``lag_norms(x, previous, live, start, count,
    cotangent, weights)`` → (‖∂h_t/∂x_(t−k)‖² (K, P), the cotangent after lag ``count`` −
    1), ``weights`` the layer's (``weights()``: its cell's parameters and step weights),
    where x (K, P, ·) and the states (K, P, w) are what step t − k of each
    pair (t, example) ran on, and ``live`` (K, P) where it ran. Back from h_t, one lag at a
    time: the cotangent of the state, every output unit of every pair folded into one block
    (units, P, ·), goes through Jᵀ of the step (the VJP of the step's linear map, the
    projected input's tangent included); a step that did not run passes it on unchanged and
    reads no input. Only lags ``start`` to ``count`` − 1 are gone back through, from the
    ``cotangent`` the lags before left (the rest read 0): one compilation serves every
    window, each going on from the last (:class:`_LagReader`). No step is run again: the
    trajectory's states are read, and nothing is kept but the cotangent. ``compiled``: under
    XLA where it compiles (:func:`~gradscope._tf.xla_or_graph`), else a graph."""
    def project(x: Any, weights: Any) -> Any:
        return projected(x[None], weights)[0]

    def lag_norms(x: Any, previous: list[Any], live: Any, start: Any, count: Any,
                  cotangent: list[Any], weights: Any) -> Any:
        lags, pairs = tf.shape(x)[0], tf.shape(x)[1]

        def body(k: Any, g: list[Any], written: Any) -> tuple[Any, list[Any], Any]:
            x_k = project(tf.cast(x[k], dtype), weights)
            _, apply = step_linear([tf.cast(p[k], dtype) for p in previous], x_k, weights[1])
            width = tf.shape(x_k)[-1]
            # J is linear: its VJP read at zero tangents (under XLA the forward products,
            # unused, are not computed).
            along = [tf.zeros_like(part) for part in g]
            inputs = tf.zeros([units, pairs, width], dtype)
            with tf.GradientTape() as tape:
                tape.watch([*along, inputs])
                moved = apply(along, (inputs,))
            *back, to_input = tape.gradient(moved, [*along, inputs], output_gradients=g,
                                            unconnected_gradients="zero")
            anywhere = tf.zeros([units * pairs, tf.shape(x)[2]], dtype)  # the projection is
            with tf.GradientTape() as tape:  # affine: its VJP is the same at every x
                tape.watch(anywhere)
                moved_in = project(anywhere, weights)
            to_x = tape.gradient(moved_in, anywhere,
                                 output_gradients=tf.reshape(to_input, [units * pairs, -1]))
            squares = tf.reduce_sum(tf.reshape(tf.cast(to_x, tf.float64) ** 2,
                                               [units, pairs, -1]), axis=[0, 2])
            ran = live[k]
            squares = tf.where(ran, squares, tf.zeros_like(squares))
            g = [tf.where(ran[None, :, None], b, old) for b, old in zip(back, g, strict=True)]
            at = tf.cast(tf.equal(tf.range(lags), k), tf.float64)[:, None]
            return k + 1, g, written + at * squares[None, :]

        # Lags ``start`` … ``count`` − 1 of x's: a lag outside them is not gone back to here,
        # and reads 0.
        _, g, written = tf.while_loop(
            lambda k, g, written: k < tf.minimum(count, lags), body,
            (start, cotangent, tf.zeros([lags, pairs], tf.float64)))
        return written, g

    if not compiled:
        return tf.function(lag_norms, autograph=False, reduce_retracing=True)
    from gradscope._tf import xla_or_graph

    return xla_or_graph(tf, lag_norms, autograph=False, reduce_retracing=True)


def _window_norms(engine: Any, layer: Any, units: int) -> Any:
    """The traced pass of :func:`measure`: ``window_norms(x, mask, initial, masks)`` → per
    example and input step of the window, ‖∂h_t/∂x_s‖ (h_t the output after the window's
    last step), the output units folded into the batch (``masks``: the dropout masks of
    every folded row, or None)."""
    tf, keras = engine.tf, engine.keras

    @tf.function(autograph=False, reduce_retracing=True)
    def window_norms(x: Any, mask: Any, initial: list[Any], masks: Masks | None) -> Any:
        folded = tf.repeat(x, units, axis=0)
        start = [tf.repeat(tf.cast(s, layer.cell.compute_dtype), units, axis=0)
                 for s in initial]
        folded_mask = None if mask is None else tf.repeat(mask, units, axis=0)
        probes = [tf.zeros(tf.concat([[tf.shape(x)[1]], tf.shape(s)], 0), s.dtype)
                  for s in start]
        # x alone watched: no variable's gradient is asked.
        with tf.GradientTape(watch_accessed_variables=False) as tape, \
                cell_holding(layer.cell, masks):
            tape.watch(folded)
            _, outs = scan_cell(tf, keras, layer, folded, folded_mask, start, probes,
                                engine.training)
            last = tf.reshape(outs[-1], [tf.shape(folded)[0], -1])
            picked = tf.reduce_sum(last * tf.tile(tf.eye(units, dtype=last.dtype),
                                                  [tf.shape(x)[0], 1]))
        grads = tf.cast(tape.gradient(picked, folded), tf.float64)
        squares = tf.reduce_sum(grads ** 2, axis=list(range(2, len(grads.shape))))
        squares = tf.reduce_sum(tf.reshape(squares, [tf.shape(x)[0], units, -1]), axis=1)
        return tf.sqrt(squares)

    return window_norms
