"""Truncated BPTT on the user's Keras model (``--chunks K``): what carrying gradients across
chunk boundaries is worth (explain), and that, carried, the chunks add up to full BPTT (check).

Keras' own call of the model runs with every recurrent layer's loop (``inner_loop``) stepping
its own cell in ``tf.scan`` (:mod:`~gradscope.keras.stepped`), each state held
(``tf.stop_gradient``) where a chunk begins, with a zero "edge" added there. ∂L/∂θ of the
cut run is truncated BPTT; the carry is found as the seed question asks, each chunk's
∂L/∂(initial states) the ``grad_ys`` of the chunk before's final states, one boundary further
back per pass. Only recurrent states are cut. How, for a reader: docs/keras.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradscope.chunks import chunk_lengths, chunk_starts
from gradscope.errors import ConfigError
from gradscope.gradcheck import relative_error, rounding_of, tolerance
from gradscope.keras.engine import call_label, class_label, state_names


@dataclass(eq=False)
class CutLoop:
    """One direction of one recurrent call, as cut: its processing positions where a chunk
    begins (0 first), the input steps those chunks begin at, and (while tracing) its edges
    and state sequences, time-major in processing order."""

    label: str
    names: list[str]
    steps: int
    backwards: bool
    positions: list[int]
    starts: list[int]
    edges: list[Any] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)

    def chunk_span(self, j: int) -> tuple[int, int]:
        """Input steps [start, stop) of the j-th chunk in processing order."""
        ends = [*self.positions, self.steps]
        first, last = ends[j], ends[j + 1]
        return (self.steps - last, self.steps - first) if self.backwards else (first, last)

    def entering(self, j: int) -> int:
        """The input step whose state enters the j-th chunk (j ≥ 1) in processing order."""
        p = self.positions[j] - 1
        return self.steps - 1 - p if self.backwards else p


@dataclass(frozen=True)
class Boundary:
    """One chunk of one direction (in processing order) and what crosses its end: the next
    chunk's ∂L/∂(initial states) (``grad_ys``), and the product of the carry through it onto
    its own initial states (``products``), by state name."""

    loop: CutLoop
    chunk: int
    grad_ys: list[np.ndarray]
    products: list[np.ndarray]


@dataclass(frozen=True)
class Chunked:
    """Truncated BPTT on one batch: the loss of the cut run, every weight's gradient without
    the carry (``truncated``) and with it, chunk by chunk (``carried``), by variable path."""

    chunks: int
    loss: float
    loops: list[CutLoop]
    truncated: dict[str, np.ndarray]
    carried: dict[str, np.ndarray]
    boundaries: list[Boundary]
    rounds: int


def recurrent_layers(model: Any) -> list[Any]:
    """Every layer of ``model`` that loops a cell (``keras.layers.RNN`` and its subclasses,
    the directions of a Bidirectional included)."""
    import keras

    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, keras.layers.RNN)]


def _owners(model: Any) -> dict[int, tuple[str, str]]:
    """Each Bidirectional's directions: id → (the Bidirectional's name, "forward"/"backward")."""
    found = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if class_label(layer) == "Bidirectional":
            found[id(layer.forward_layer)] = (layer.name, "forward")
            found[id(layer.backward_layer)] = (layer.name, "backward")
    return found


@contextlib.contextmanager
def loops_cut(model: Any, chunks: int, loops: list[CutLoop], watch: Any,
              refused: list[ConfigError] | None = None) -> Iterator[None]:
    """While inside, each recurrent layer's loop, run by this thread, steps its cell with the
    state held where each of ``chunks`` chunks of its own time axis begins; every call adds
    its :class:`CutLoop` to ``loops`` and gives ``watch`` its edges. A loop that cannot be
    cut raises :class:`ConfigError`, kept in ``refused`` too: Keras wraps what a layer's call
    raises in words of its own (found tried as a new user would: a decoder of 3 steps under
    --chunks 4 printed "Exception encountered when calling LSTM.call()" and its escapes)."""
    import keras
    import tensorflow as tf

    from gradscope.keras.observed_call import inner_loops_replaced
    from gradscope.keras.stepped import scan_cell, zero_output

    owners = _owners(model)
    counts: dict[int, int] = {}

    def cut(layer: Any) -> Any:
        def inner_loop(own: Any, sequences: Any, initial_state: Any, mask: Any,
                       training: bool) -> Any:
            index = counts.get(id(layer), 0)
            counts[id(layer)] = index + 1
            name, direction = owners.get(id(layer), (layer.name, ""))
            label = call_label(name, index) + (f"/{direction}" if direction else "")
            given = list(initial_state) if keras.tree.is_nested(initial_state) \
                else [initial_state]
            if any(keras.tree.is_nested(state) for state in given):
                raise ConfigError(f"--chunks: {label} carries nested states (a stack of "
                                  "cells), which gradscope does not cut into chunks yet",
                                  where="--chunks")
            if keras.tree.is_nested(mask):
                mask = mask[0]
            steps = sequences.shape[1]
            if steps is None:
                raise ConfigError(f"--chunks: {label} runs over a time axis of no fixed "
                                  "length", where="--chunks")
            steps = int(steps)
            starts = chunk_starts(chunk_lengths(steps, chunks, f"the steps {label} runs:"))
            backwards = bool(getattr(layer, "go_backwards", False))
            positions = sorted([0, *((steps - s) if backwards else s for s in starts[1:])])
            flags = np.zeros(steps, np.float32)
            flags[positions[1:]] = 1.0
            dtype = layer.cell.compute_dtype
            edges = [tf.zeros(tf.concat([[steps], tf.shape(state)], 0), dtype)
                     for state in given]
            probes = [tf.zeros_like(edge) for edge in edges]
            last = None
            if mask is not None:
                # Behind a mask a step's output may be the last output the loop carries, a
                # path across a boundary beside the states: held there too (found tried as
                # a new user would: a padded batch's truncated gradients crossed the
                # boundaries by it, gru/bias 3.5e-3 against 8.0e-2 cut by hand).
                last = zero_output(tf, layer, sequences, given, training)
                edges.append(tf.zeros(tf.concat([[steps], tf.shape(last)], 0), last.dtype))
            for edge in edges:
                watch(edge)
            states, outs = scan_cell(tf, keras, layer, sequences, mask, given, probes, training,
                                     tf.constant(flags), edges, last_output=last)
            names = state_names(layer)
            if len(names) != len(given):  # a layer whose states gradscope does not name
                names = ["h0", "c0"] if len(given) == 2 and "LSTM" in class_label(layer) \
                    else [f"states[{k}]" for k in range(len(given))]
            carried = list(states)
            if last is not None:
                names, carried = [*names, "output"], [*carried, outs]
            loops.append(CutLoop(label, names, steps, backwards, positions, starts, edges,
                                 carried))
            final = [sequence[-1] for sequence in states]
            outputs = tf.transpose(outs, [1, 0, *range(2, len(outs.shape))])
            return outs[-1], outputs, final if keras.tree.is_nested(initial_state) \
                else final[0]

        def kept(*args: Any) -> Any:
            try:
                return inner_loop(*args)
            except ConfigError as exc:
                if refused is not None:
                    refused.append(exc)
                raise

        return kept

    with inner_loops_replaced([(layer, cut(layer)) for layer in recurrent_layers(model)]):
        yield


def chunked(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
            weights: Any, chunks: int) -> Chunked:
    """The model's loss on the batch, run with its recurrent states cut into ``chunks``
    chunks: the truncated gradients, and the carried ones, boundary after boundary.
    ``weights``: the sample weights as ``engine.weight_tensors`` gives them."""
    from gradscope._tf import native_stderr_silenced, without_grappler
    from gradscope.keras.observed_call import NotObserved
    from gradscope.keras.subclassed import is_subclassed
    from gradscope.keras.whole_model import as_a_run_starts, dense_gradients, losses_kept

    tf = engine.tf
    feed, y = engine.tensors(inputs, targets)
    variables = engine.model.trainable_variables
    seen: dict[str, Any] = {}

    def one_pass(feed: list[Any], y: list[Any], carried: list[Any] | None, own: bool) -> Any:
        """The cut run and one backward pass of ``loss + Σ ⟨carried, the states leaving each
        chunk but the last⟩`` (just the loss with ``carried`` None): the weight gradients,
        and each edge's gradient at its loop's positions. One tape, not persistent: a second
        backward pass of the same run would keep every step's intermediates once more."""
        loops: list[CutLoop] = []
        with tf.GradientTape() as tape:
            with loops_cut(engine.model, chunks, loops, tape.watch,
                           seen.setdefault("refused", [])):
                loss, _, _ = engine.forward(feed, y, lambda tensor: None,
                                            sample_weight=weights, own=own)
            leaving = [loop.states[k][p - 1] for loop in loops for p in loop.positions[1:]
                       for k in range(len(loop.edges))]
            objective = loss if carried is None else loss + tf.add_n(
                [tf.reduce_sum(tf.stop_gradient(g) * state)
                 for g, state in zip(carried, leaving, strict=True)] or [tf.zeros_like(loss)])
        if not loops:
            raise ConfigError("--chunks: the model has no recurrent layer whose loop could "
                              "be cut", where="--chunks")
        seen["loops"] = loops
        edges = [edge for loop in loops for edge in loop.edges]
        gradients, edge_gradients = tape.gradient(objective, [variables, edges],
                                                  unconnected_gradients="zero")
        at = [tf.gather(g, loop.positions) for loop in loops
              for g in edge_gradients[_first(loops, loop):][:len(loop.edges)]]
        return loss, gradients, at

    function = tf.function(one_pass, autograph=False)

    def run(carried: list[np.ndarray] | None) -> Any:
        """One pass, from the model's state as the tape saw it; the replay where Keras' own
        call cannot be looked on. A loop that cannot be cut is refused in gradscope's own
        words, not Keras' wrapping of them."""
        try:
            return passed(carried)
        except Exception:
            if seen.get("refused"):
                raise seen["refused"][0] from None
            raise

    def passed(carried: list[np.ndarray] | None) -> Any:
        with native_stderr_silenced(), without_grappler(), losses_kept(engine.model):
            if seen.get("own", True):
                try:
                    with as_a_run_starts(engine.model, engine.training, engine.seed):
                        return function(feed, y, carried, True)
                except NotObserved:
                    if is_subclassed(engine.model):
                        raise
                    seen["own"] = False
            with as_a_run_starts(engine.model, engine.training, engine.seed):
                return function(feed, y, carried, False)

    def carried_of(at: list[Any]) -> list[np.ndarray]:
        """What each edge's gradient carries into the state leaving the chunk before."""
        found, flat = [], iter(at)
        for loop in seen["loops"]:
            mine = [np.asarray(next(flat)) for _ in loop.edges]
            found += [g[j] for j in range(1, len(loop.positions)) for g in mine]
        return found

    loss, truncated, cut_at = run(None)
    loops: list[CutLoop] = seen["loops"]
    # Each round carries the gradients one chunk further back, until carrying once more
    # moves nothing. A chain of chunks crosses each loop's K − 1 boundaries at most once, and
    # may run from one loop into another (a decoder started from its encoder's final
    # states: its first chunk's carry goes on into the encoder's last), so it is at most
    # (K − 1) times the loops long.
    most = (chunks - 1) * max(1, len(loops))
    carried = carried_of(cut_at)
    rounds = 1
    while True:
        _, whole, full_at = run(carried)
        again = carried_of(full_at)
        if _settled(carried, again, engine.dtype_name, rounds, last=rounds >= most):
            break
        carried, rounds = again, rounds + 1
    truncated_arrays, _ = dense_gradients(variables, truncated)
    whole_arrays, _ = dense_gradients(variables, whole)
    at = [[full, cut] for full, cut in zip(full_at, cut_at, strict=True)]
    return Chunked(chunks=chunks, loss=float(loss), loops=loops,
                   truncated=_zeros_for_none(variables, truncated_arrays),
                   carried=_zeros_for_none(variables, whole_arrays),
                   boundaries=_boundaries(loops, at), rounds=rounds)


def _first(loops: list[CutLoop], loop: CutLoop) -> int:
    """Where ``loop``'s edges start among every loop's."""
    return sum(len(other.edges) for other in loops[:next(
        k for k, other in enumerate(loops) if other is loop)])


def _zeros_for_none(variables: list[Any], arrays: dict[str, np.ndarray | None]
                    ) -> dict[str, np.ndarray]:
    return {v.path: np.zeros(v.shape, np.float64) if arrays.get(v.path) is None
            else np.asarray(arrays[v.path]) for v in variables}


def _settled(carried: list[Any], again: list[Any], dtype: str, rounds: int,
             last: bool) -> bool:
    """Whether the carried gradients, carried once more, are what they were, to the
    rounding of ``dtype`` (:func:`~gradscope.gradcheck.rounding_of`): every chain of chunks
    was followed to its end. Not to the carry's tolerance: a chain from one loop into
    another moves a boundary's carry by little (3.6e-5 of it, found tried as a new user
    would: a Bidirectional LSTM under an LSTM run backwards, float32), and stopping there
    left a weight's gradient 8.8e-4 away from Keras' own, and the run refused; one round
    more gave it to the last bit. After the ``last`` round a chain can take, within the
    carry's tolerance is settled; else the run is refused, never shown. A carry that was 0
    and is not has moved without bound (it is where a chain has just arrived: at 3 chunks
    of the same model, 2.2e-6 read as an absolute change kept the weight 3.6e-4 off)."""
    error = max((_moved(np.asarray(before), np.asarray(after))
                 for before, after in zip(carried, again, strict=True)), default=0.0)
    if error <= rounding_of(dtype):
        return True
    if not last:
        return False
    if error <= tolerance("tbptt_carry", dtype).rtol:
        return True
    raise ConfigError(
        f"--chunks: the gradients carried across the chunk boundaries did not settle in "
        f"{rounds} rounds (they moved by {error:.1e} in one more); expected them to: please "
        "report it", where="--chunks")


def _moved(before: np.ndarray, after: np.ndarray) -> float:
    """How far a carry moved, relative to where it was (from 0 to anything else: infinitely)."""
    if not np.any(before):
        return 0.0 if not np.any(after) else float("inf")
    return relative_error(after, before)


def _boundaries(loops: list[CutLoop], at: list[list[Any]]) -> list[Boundary]:
    """Per loop and chunk but the last: the grad_ys at its end and the product through it.
    ``at``: per loop and state, the full and the truncated edge gradients at its positions.
    The full pass's edge gradient at a chunk's start less the truncated one is what crosses
    the chunk's end: the product of the carry through the chunk."""
    found = []
    flat = iter(at)
    for loop in loops:
        mine = [next(flat) for _ in loop.edges]
        full = [np.asarray(pair[0], np.float64) for pair in mine]
        cut = [np.asarray(pair[1], np.float64) for pair in mine]
        for j in range(len(loop.positions) - 1):
            found.append(Boundary(loop=loop, chunk=j,
                                  grad_ys=[f[j + 1] for f in full],
                                  products=[f[j] - c[j] for f, c in zip(full, cut,
                                                                         strict=True)]))
    return found


def carried_error(result: Chunked, full: Mapping[str, np.ndarray | None]) -> dict[str, float]:
    """Per weight: the relative error of the chunks, carried, against ``full`` (Keras' own
    tape), where either has a gradient."""
    errors = {}
    for path, value in result.carried.items():
        expected = full.get(path)
        expected = np.zeros_like(value) if expected is None else expected
        errors[path] = relative_error(value, expected)
    return errors


#: How the numbers of ``explain --chunks`` on a Keras model are found, for the report.
METHOD = ("each recurrent layer's own cell stepped in tf.scan inside Keras' own call of the "
          "model, its states held (tf.stop_gradient) where each chunk begins: the gradient "
          "of that run is truncated BPTT (behind a mask, the last output Keras' loop carries "
          "held there too); the carry is taken back boundary by boundary from "
          "the last, each chunk's ∂L/∂(initial states) the grad_ys of the chunk before's "
          "final states, and the chunks so carried must add up to Keras' own full gradient; "
          "only recurrent states are cut (a layer that mixes steps otherwise, such as Conv1D "
          "or attention, still reaches across a boundary)")


def carry_section(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                  sample_weight: Any, full: dict[str, np.ndarray | None],
                  names: dict[str, str], chunks: int) -> Any:
    """``explain --chunks``: per weight (``names``: variable path → report name), Keras' own
    full gradient (``full``) against truncated BPTT; per chunk, the carry's product. Refused
    (exit 2) where the chunks, carried, do not give ``full``, or a gradient is not finite."""
    from gradscope.chunks import CARRIED_SHARE_THRESHOLD, carried_weights
    from gradscope.report.models import CarryProductEntry, KerasCarry, KerasChunkedCall

    result = chunked(engine, inputs, targets, engine.weight_tensors(sample_weight), chunks)
    paths = [path for path in result.carried if path in names]
    fulls = {path: np.zeros_like(result.carried[path]) if full.get(path) is None
             else np.asarray(full[path]) for path in paths}
    for kind, gradients in (("full", fulls), ("truncated", result.truncated)):
        for path in paths:
            if not np.all(np.isfinite(gradients[path])):
                raise ConfigError(f"--chunks: the {kind} BPTT gradient of {names[path]} has "
                                  "NaN or Inf values, so no carried share can be given; "
                                  "expected finite gradients (explain without --chunks shows "
                                  "where)", where="--chunks")
    errors = carried_error(result, fulls)
    rtol = tolerance("tbptt_carry", engine.dtype_name).rtol
    worst = max(paths, key=lambda path: errors[path]) if paths else None
    if worst is not None and not errors[worst] <= rtol:
        raise ConfigError(f"--chunks: carried across the chunk boundaries, the chunks give "
                          f"{names[worst]} a gradient {errors[worst]:.1e} away from Keras' "
                          f"own (tolerance {rtol:.0e}): gradscope's cut run of the model does "
                          "not reproduce it, so it shows no numbers", where="--chunks")
    weights, matters, verdict = carried_weights(
        {names[p]: fulls[p] for p in paths}, {names[p]: result.truncated[p] for p in paths},
        [names[p] for p in paths])
    products = []
    for boundary in result.boundaries:
        loop = boundary.loop
        start, stop = loop.chunk_span(boundary.chunk)
        for name, grad_y, product in zip(loop.names, boundary.grad_ys, boundary.products,
                                         strict=True):
            short = name[0] if name in ("h0", "c0") else name
            x = (f"{loop.label}/{name}" if boundary.chunk == 0 else
                 f"{loop.label}/{short}[t={loop.entering(boundary.chunk)}]")
            y = f"{loop.label}/{short}[t={loop.entering(boundary.chunk + 1)}]"
            products.append(CarryProductEntry(
                chunk=boundary.chunk, start=start, stop=stop, layer=loop.label, x=x, y=y,
                l2_grad_y=float(np.linalg.norm(grad_y)),
                l2_product=float(np.linalg.norm(product))))
    calls = [KerasChunkedCall(layer=loop.label, steps=loop.steps, backwards=loop.backwards,
                              chunk_lengths=[b - a for a, b in zip(
                                  loop.starts, [*loop.starts[1:], loop.steps], strict=True)])
             for loop in result.loops]
    return KerasCarry(chunks=chunks, dtype=engine.dtype_name, method=METHOD, calls=calls,
                      weights=weights, products=products,
                      carried_error=max(errors[p] for p in paths) if paths else 0.0,
                      threshold=CARRIED_SHARE_THRESHOLD, matters=matters, verdict=verdict)
