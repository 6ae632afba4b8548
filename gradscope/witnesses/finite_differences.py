"""Finite differences: the witness that knows nothing of derivatives.

For every tensor (each weight, each initial state and the input x), on the float64 copy of the
model: central differences of the loss along a few random unit directions restricted to that
tensor, plus single elements (the largest |g| and random ones), compared with the autodiff
directional derivative ⟨g, v⟩.

Cost: two loss evaluations per probe, never two per element. The perturbed copies of a tensor
are evaluated together in one call: perturbations of x and of the initial states are folded
into the batch axis (each copy is a block of examples), and perturbations of a weight run as
one in-graph ``tf.map_fn`` over the stacked perturbed weights. A perturbation of layer k runs
the model from layer k on, from the unperturbed output of the layers below it (the layer
outputs of the autodiff pass). The weight copies and the x and state copies are evaluated at
the same time, on two threads: while one traces its functions (Python) the other's run
(TensorFlow's own threads) goes on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.witnesses.context import CheckContext, WitnessResult

WITNESS = "finite_differences"
#: Step along a unit direction. Central differences in float64: the truncation error grows
#: as step², the rounding error of the loss as 1/step. At 1e-3 the truncation error on these
#: models is ~1e-7 relative and the rounding error ~1e-11 absolute.
STEP = 1e-3
RANDOM_ELEMENTS = 2
#: Perturbed copies of x or of an initial state folded into one forward pass.
COPIES_PER_CALL = 4


@dataclass(frozen=True)
class Probe:
    tensor: str
    label: str  # "direction 1", "element (3, 7) (largest |g|)"
    direction: np.ndarray  # unit norm, the tensor's shape


def probes_for(name: str, gradient: np.ndarray, directions: int,
               rng: np.random.Generator) -> list[Probe]:
    """Random unit directions, the element of largest |g|, and random single elements."""
    out = []
    for k in range(directions):
        v = rng.standard_normal(gradient.shape)
        out.append(Probe(name, f"direction {k + 1}", v / np.linalg.norm(v)))
    flat_size = gradient.size
    largest = int(np.argmax(np.abs(gradient)))
    chosen = [(largest, "largest |g|")]
    others = [i for i in rng.choice(flat_size, size=min(flat_size, RANDOM_ELEMENTS + 1),
                                    replace=False) if i != largest]
    chosen += [(int(i), "random") for i in others[:RANDOM_ELEMENTS]]
    for index, why in chosen:
        v = np.zeros(gradient.size)
        v[index] = 1.0
        where = np.unravel_index(index, gradient.shape)
        out.append(Probe(name, f"element {tuple(int(w) for w in where)} ({why})",
                         v.reshape(gradient.shape)))
    return out


class _Evaluator:
    """Loss evaluations of perturbed copies of the model, traced once per starting layer.

    A perturbation of layer k's weights or initial state changes nothing below layer k, so the
    pass starts at layer k from the unperturbed output of layer k−1 (the autodiff pass's own
    sequences, from the same forward); the dense layers' weights start after the last
    recurrent layer. The loss is still the full model's: the layers below simply have no
    perturbed input.
    Weight copies of the layers run are flattened into rows of one matrix and evaluated by one
    ``tf.map_fn``; copies of x and of the initial states are folded into the batch axis of one
    forward pass.
    """

    def __init__(self, ctx: CheckContext) -> None:
        self.ctx = ctx
        tf = self.tf = ctx.tf
        self.engine = ctx.engine
        cells = [cell.name for cell in ctx.shapes.cells]
        #: The recurrent layer (index into shapes.cells) where a tensor's perturbation starts
        #: to matter: its own layer; len(cells) for a dense layer's weights; 0 for x.
        self.start = {info.name: (cells.index(info.layer) if info.layer in cells else len(cells))
                      for info in (*ctx.shapes.weights, *ctx.shapes.states)}
        self.start["x"] = 0
        self.batch_size = ctx.batch.x.shape[0]
        self.x, self.y = tf.constant(ctx.batch.x), tf.constant(ctx.batch.y)
        self.states = {k: tf.constant(v) for k, v in ctx.batch.initial_states.items()}
        self.params = {k: tf.constant(v) for k, v in ctx.params.items()}
        sequences = ctx.autodiff.sequences
        if sequences is None:
            raise ValueError("finite differences start from the autodiff pass's layer outputs: "
                             "run it with engine.run(..., per_step=True)")
        #: The batch-major input of each starting layer, unperturbed, as NumPy and as tensors:
        #: x, then each layer's h.
        self.arrays = [ctx.batch.x] + [sequences[f"{name}/h"] for name in cells]
        self.inputs = [self.x] + [tf.constant(value) for value in self.arrays[1:]]
        self._stacked: dict[int, Any] = {}
        self._folded: dict[int, Any] = {}

    def _example_losses(self, params: dict[str, Any], inputs: Any, y: Any,
                        states: dict[str, Any], start: int) -> Any:
        """Each example's share of the mean loss: copies folded into the batch axis are summed
        back per copy."""
        tf = self.tf
        spec = self.ctx.shapes.spec
        predictions, _ = self.engine.forward(params, inputs, states, start=start)
        if spec.loss == "softmax_cross_entropy":
            per_position = tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=predictions)
        else:
            per_position = tf.reduce_mean(tf.square(predictions - y), axis=-1)
        if spec.sequence_output:
            per_position = tf.reduce_mean(per_position, axis=1)
        return per_position / self.batch_size

    def _weights_from(self, start: int) -> list[str]:
        return [name for name in self.ctx.params if self.start[name] >= start]

    def _stacked_function(self, start: int) -> Any:
        """Loss per row of perturbed weights (those of layers ≥ ``start``, flattened)."""
        if start in self._stacked:
            return self._stacked[start]
        tf = self.tf
        names = self._weights_from(start)
        shapes = [self.ctx.params[n].shape for n in names]
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
        inputs = self.inputs[start]

        @tf.function(autograph=False)
        def stacked(rows: Any) -> Any:
            def one(row: Any) -> Any:
                pieces = tf.split(row, sizes)
                perturbed = {name: tf.reshape(piece, shape)
                             for name, piece, shape in zip(names, pieces, shapes, strict=True)}
                return tf.reduce_sum(
                    self._example_losses(perturbed, inputs, self.y, self.states, start))

            return tf.map_fn(one, rows, fn_output_signature=rows.dtype)

        self._stacked[start] = stacked
        return stacked

    def _folded_function(self, start: int) -> Any:
        if start in self._folded:
            return self._folded[start]
        tf = self.tf

        @tf.function(autograph=False)
        def folded(inputs: Any, y: Any, states: dict[str, Any]) -> Any:
            losses = self._example_losses(self.params, inputs, y, states, start)
            return tf.reduce_sum(tf.reshape(losses, [-1, self.batch_size]), axis=1)

        self._folded[start] = folded
        return folded

    def weight_losses(self, perturbations: list[tuple[str, np.ndarray]]) -> np.ndarray:
        """Loss with weight ``name`` replaced by each ``value``, in the order given."""
        losses = np.empty(len(perturbations))
        for start in sorted({self.start[name] for name, _ in perturbations}):
            chosen = [i for i, (name, _) in enumerate(perturbations)
                      if self.start[name] == start]
            names = self._weights_from(start)
            flat = np.concatenate([self.ctx.params[n].ravel() for n in names])
            offsets = np.cumsum([0, *(self.ctx.params[n].size for n in names)])
            rows = np.repeat(flat[None, :], len(chosen), axis=0)
            for row, i in zip(rows, chosen, strict=True):
                name, value = perturbations[i]
                k = names.index(name)
                row[offsets[k]:offsets[k + 1]] = value.ravel()
            stacked = self._stacked_function(start)
            losses[chosen] = stacked(self.tf.constant(rows)).numpy()
        return losses

    def input_losses(self, perturbations: list[tuple[str, np.ndarray]]) -> np.ndarray:
        """Loss with x or one initial state replaced by each ``value``, in the order given.

        The copies go through in groups of ``COPIES_PER_CALL`` folded into the batch axis, one
        starting layer at a time: one trace per starting layer (the last group is padded to
        the same shape), and a working set that stays in memory instead of growing with the
        number of probes.
        """
        losses = np.empty(len(perturbations))
        for start in sorted({self.start[name] for name, _ in perturbations}):
            chosen = [i for i, (name, _) in enumerate(perturbations)
                      if self.start[name] == start]
            for first in range(0, len(chosen), COPIES_PER_CALL):
                group = chosen[first:first + COPIES_PER_CALL]
                padded = group + [group[-1]] * (COPIES_PER_CALL - len(group))
                values = self._input_group([perturbations[i] for i in padded], start)
                losses[group] = values[: len(group)]
        return losses

    def _input_group(self, perturbations: list[tuple[str, np.ndarray]],
                     start: int) -> np.ndarray:
        batch = self.ctx.batch
        base = self.arrays[start]
        inputs = [value if name == "x" else base for name, value in perturbations]
        states = {
            key: np.concatenate([value if name == key else initial
                                 for name, value in perturbations])
            for key, initial in batch.initial_states.items()
        }
        tf = self.tf
        return np.asarray(self._folded_function(start)(
            tf.constant(np.concatenate(inputs)),
            tf.constant(np.concatenate([batch.y] * len(perturbations))),
            {k: tf.constant(v) for k, v in states.items()},
        ).numpy())


def finite_difference_witness(ctx: CheckContext) -> list[WitnessResult]:
    rng = np.random.default_rng([ctx.shapes.spec.seed, 2])
    gradients = ctx.autodiff_gradients()
    values = {**ctx.params, **ctx.batch.initial_states, "x": ctx.batch.x}
    probes = {name: probes_for(name, g, ctx.directions, rng) for name, g in gradients.items()}

    def jobs(weights: bool) -> list[tuple[str, np.ndarray]]:
        """The perturbed values, + then − for each tensor's probes, in the probes' order."""
        out: list[tuple[str, np.ndarray]] = []
        for name, tensor_probes in probes.items():
            if (name in ctx.params) == weights:
                for sign in (1.0, -1.0):
                    out += [(name, values[name] + sign * STEP * p.direction)
                            for p in tensor_probes]
        return out

    evaluator = _Evaluator(ctx)
    counts = {w: sum(2 * len(p) for n, p in probes.items() if (n in ctx.params) == w)
              for w in (True, False)}
    ctx.progress(f"finite differences: {counts[True]} weight evaluations and "
                 f"{counts[False]} input and state evaluations")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradscope-fd") as pool:
        # The copies of x (the largest tensor) are made on the worker too.
        inputs_done = (pool.submit(lambda: evaluator.input_losses(jobs(weights=False)))
                       if counts[False] else None)
        weight_losses = (iter(evaluator.weight_losses(jobs(weights=True))) if counts[True]
                         else iter(()))
        input_losses = iter(inputs_done.result()) if inputs_done is not None else iter(())

    rtol = ctx.tolerance(WITNESS)
    results = []
    for name, tensor_probes in probes.items():
        source = weight_losses if name in ctx.params else input_losses
        count = len(tensor_probes)
        plus = np.array([next(source) for _ in range(count)])
        minus = np.array([next(source) for _ in range(count)])
        error, passed, detail = directional_error(gradients[name], tensor_probes, plus, minus,
                                                  ctx.autodiff.loss, rtol, ctx.atol)
        results.append(WitnessResult(WITNESS, name, error, rtol, passed, detail))
    return results


def directional_error(gradient: np.ndarray, probes: list[Probe], plus: np.ndarray,
                      minus: np.ndarray, loss: float, rtol: float, atol: float | None,
                      step: float = STEP) -> tuple[float, bool, str]:
    """Central differences along ``probes`` (loss at ±``step``) against ⟨g, v⟩: the worst
    normalised error, whether it is within ``rtol``, and a line naming the worst probe and both
    values."""
    numerical = (plus - minus) / (2 * step)
    analytic = np.array([float(np.sum(gradient * p.direction)) for p in probes])
    # A directional derivative can be near zero by chance: measure errors against the typical
    # size of one, ‖g‖/√n, when that is larger.
    typical = float(np.linalg.norm(gradient)) / np.sqrt(max(gradient.size, 1))
    scale = np.maximum(np.maximum(np.abs(analytic), typical), 1e-300)
    # Rounding in the loss, amplified by 1/(2·step): below this no disagreement is real.
    noise = 64 * np.finfo(np.float64).eps * max(abs(loss), 1.0) / (2 * step)
    # Passing means |fd − ad| ≤ rtol·scale + noise (+ atol): the error is normalised so that
    # it passes exactly when it is ≤ rtol.
    errors = np.abs(numerical - analytic) / (scale + (noise + (atol or 0.0)) / rtol)
    worst = int(np.argmax(errors))
    detail = (f"{len(probes)} probes; worst: {probes[worst].label}, finite difference "
              f"{numerical[worst]:.6e} vs autodiff {analytic[worst]:.6e}")
    return float(errors[worst]), bool(errors[worst] <= rtol), detail
