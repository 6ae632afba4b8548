"""Finite differences: the witness that knows nothing of derivatives.

For every tensor (each weight, each initial state and the input x), on the float64 copy of the
model: central differences of the loss along a few random unit directions restricted to that
tensor, plus single elements (the largest |g| and random ones), compared with autodiff's
directional derivative ⟨g, v⟩. Two loss evaluations per probe, never two per element, each as
small as it can be: a probe of layer k runs from layer k on (:class:`_Evaluator`), perturbed
copies share one call, and most of the work runs beside the autodiff pass
(:class:`FiniteDifferences`). How a reader sees it: docs/check.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.gradcheck import (
    RANDOM_ELEMENTS,
    ROUNDING,
    ROUNDING_STEPS,
    SMALL_LOSS,
    Probe,
    WitnessResult,
    can_tell,
    directional_error,
    element_probe,
    elements_for,
    extrapolated_error,
    random_probes,
    retakes_for,
    small_loss_rounding,
    step_for,
)
from gradscope.timing import Progress
from gradscope.yaml.algebra import ModelShapes
from gradscope.yaml.check.context import CheckContext
from gradscope.yaml.data import Batch

WITNESS = "finite_differences"
#: Step along a unit direction: gradscope's own cells are smooth.
SPEC_STEP = step_for("float64", "smooth")
#: Smaller steps a tensor whose probes disagree is taken again at, in turn: smooth cells have
#: no kink, but with large weights the loss curves within 1e-3 (a correct GRU's bias read
#: 1.5e-5 > 1e-5 there, found tried as a new user would).
RETAKES = retakes_for("float64", "smooth")
#: Perturbed copies of x or of an initial state folded into one forward pass (a copy of one
#: example counts as 1/batch of a copy).
COPIES_PER_CALL = 4
#: Perturbed weight rows in one ``tf.map_fn`` call, and how many of them it runs at once.
#: Two calls may run at the same time (one per thread of the queue).
ROWS_PER_CALL = 12
PARALLEL_ITERATIONS = 5
#: The queue's threads, largest group first: while one traces a function (Python), the other's
#: run (TensorFlow's own threads) goes on.
THREADS = 2


@dataclass(frozen=True)
class Perturbation:
    """One loss evaluation: tensor ``name`` replaced by ``value``. With ``example`` (x or an
    initial state only), ``value`` is that one example (batch axis of size 1), and the loss
    evaluated is that example's share of it. ``key`` is the probe's, with the sign."""

    name: str
    value: np.ndarray
    key: tuple[Any, ...]
    example: int | None = None


class _Evaluator:
    """Loss evaluations of perturbed copies of the model, traced once per starting layer.

    A perturbation of layer k's weights or initial state changes nothing below layer k, so the
    pass starts at layer k from the unperturbed output of layer k−1 (the autodiff pass's own
    sequences, from the same forward, given by :meth:`layer_outputs`); the dense layers'
    weights start after the last recurrent layer. The loss is still the full model's: the
    layers below simply have no perturbed input.
    """

    def __init__(self, shapes: ModelShapes, params: dict[str, np.ndarray], batch: Batch,
                 engine: Any) -> None:
        self.shapes, self.params, self.batch, self.engine = shapes, params, batch, engine
        tf = self.tf = engine.tf
        cells = [cell.name for cell in shapes.cells]
        #: The recurrent layer (index into shapes.cells) where a tensor's perturbation starts
        #: to matter: its own layer; len(cells) for a dense layer's weights; 0 for x.
        self.start = {info.name: (cells.index(info.layer) if info.layer in cells else len(cells))
                      for info in (*shapes.weights, *shapes.states)}
        self.start["x"] = 0
        self.batch_size = batch.x.shape[0]
        self.y = tf.constant(batch.y)
        self.states = {k: tf.constant(v) for k, v in batch.initial_states.items()}
        #: The batch-major input of each starting layer, unperturbed, as NumPy and as tensors:
        #: x, then each layer's h once the autodiff pass has given it.
        self.arrays = [batch.x]
        self.inputs = [tf.constant(batch.x)]
        #: Each starting layer's input features: x's, then each recurrent layer's units.
        self.features = [batch.x.shape[-1], *(cell.units for cell in shapes.cells)]
        self._functions: dict[int, Any] = {}
        self._lock = threading.Lock()

    def layer_outputs(self, sequences: dict[str, np.ndarray] | None) -> None:
        """The autodiff pass's layer outputs, where perturbations of the layers above start."""
        if sequences is None:
            raise ValueError("finite differences start from the autodiff pass's layer outputs: "
                             "run it with engine.run(..., per_step=True)")
        self.arrays = [self.batch.x] + [sequences[f"{cell.name}/h"]
                                        for cell in self.shapes.cells]
        self.inputs = self.inputs[:1] + [self.tf.constant(a) for a in self.arrays[1:]]

    def _example_losses(self, params: dict[str, Any], inputs: Any, y: Any,
                        states: dict[str, Any], start: int) -> Any:
        """Each example's share of the mean loss (of the batch the model was given)."""
        tf = self.tf
        spec = self.shapes.spec
        predictions, _ = self.engine.forward(params, inputs, states, start=start)
        if spec.loss == "softmax_cross_entropy":
            per_position = tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=predictions)
        else:
            per_position = tf.reduce_mean(tf.square(predictions - y), axis=-1)
        if spec.sequence_output:
            per_position = tf.reduce_mean(per_position, axis=1)
        return per_position / self.batch_size

    def _weights_from(self, start: int) -> list[str]:
        return [name for name in self.params if self.start[name] >= start]

    def _function(self, start: int) -> Any:
        """Per-example losses ``(rows, examples)`` of the model from layer ``start`` on: one row
        per copy of the weights of layers ≥ ``start`` (flattened), each run on the batch given.
        Weight copies come as many rows on the model's batch; copies of x and of the initial
        states as one row (the weights as they are) on a batch of folded copies. Both axes are
        free: one trace per starting layer serves every group."""
        with self._lock:  # one function per starting layer, whichever thread asks first
            if start not in self._functions:
                self._functions[start] = self._build(start)
            return self._functions[start]

    def _build(self, start: int) -> Any:
        tf = self.tf
        names = self._weights_from(start)
        shapes = [self.params[n].shape for n in names]
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]

        def free(*shape: int) -> Any:
            return tf.TensorSpec([None, *shape], tf.float64)

        steps = self.batch.x.shape[1]
        signature = [free(sum(sizes)), free(steps, self.features[start]),
                     free(*self.batch.y.shape[1:]),
                     {k: free(*v.shape[1:]) for k, v in self.batch.initial_states.items()}]

        @tf.function(autograph=False, input_signature=signature)
        def losses(rows: Any, inputs: Any, y: Any, states: dict[str, Any]) -> Any:
            def one(row: Any) -> Any:
                pieces = tf.split(row, sizes)
                weights = {name: tf.reshape(piece, shape)
                           for name, piece, shape in zip(names, pieces, shapes, strict=True)}
                return self._example_losses(weights, inputs, y, states, start)

            return tf.map_fn(one, rows, fn_output_signature=tf.TensorSpec([None], tf.float64),
                             parallel_iterations=PARALLEL_ITERATIONS)

        return losses

    def tasks(self, perturbations: list[Perturbation],
              into: dict[tuple[Any, ...], float]) -> list[tuple[float, Callable[[], None]]]:
        """The evaluations in groups, each a job that puts its losses in ``into`` by key, with
        its cost in example-layers."""
        layers = len(self.shapes.cells) + 1
        out: list[tuple[float, Callable[[], None]]] = []
        for start in sorted({self.start[p.name] for p in perturbations}):
            here = [p for p in perturbations if self.start[p.name] == start]
            weights = [p for p in here if p.name in self.params]
            groups = [(weights[k:k + ROWS_PER_CALL], self._rows)
                      for k in range(0, len(weights), ROWS_PER_CALL)]
            whole = [p for p in here if p.name not in self.params and p.example is None]
            groups += [(whole[k:k + COPIES_PER_CALL], self._copies)
                       for k in range(0, len(whole), COPIES_PER_CALL)]
            single = [p for p in here if p.example is not None]
            per_call = COPIES_PER_CALL * self.batch_size
            groups += [(single[k:k + per_call], self._copies)
                       for k in range(0, len(single), per_call)]
            for group, evaluate in groups:
                examples = sum(1 if p.example is not None else self.batch_size for p in group)
                out.append((examples * (layers - start),
                            self._job(into, group, start, evaluate)))
        return out

    @staticmethod
    def _job(into: dict[tuple[Any, ...], float], group: list[Perturbation], start: int,
             evaluate: Callable[[list[Perturbation], int], np.ndarray]) -> Callable[[], None]:
        def job() -> None:
            into.update(zip((p.key for p in group), evaluate(group, start), strict=True))

        return job

    def _flat_weights(self, start: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        names = self._weights_from(start)
        flat = np.concatenate([self.params[n].ravel() for n in names])
        return names, flat, np.cumsum([0, *(self.params[n].size for n in names)])

    def _rows(self, perturbations: list[Perturbation], start: int) -> np.ndarray:
        """The loss with each weight replaced, one row of the stacked weights per copy."""
        names, flat, offsets = self._flat_weights(start)
        rows = np.repeat(flat[None, :], len(perturbations), axis=0)
        for row, p in zip(rows, perturbations, strict=True):
            k = names.index(p.name)
            row[offsets[k]:offsets[k + 1]] = p.value.ravel()
        tf = self.tf
        per_example = self._function(start)(tf.constant(rows), self.inputs[start], self.y,
                                            self.states).numpy()
        return np.asarray(per_example.sum(axis=1))

    def losses_along(self, seed: int, steps: tuple[float, ...]) -> np.ndarray:
        """The loss with every weight moved by each of ``steps`` along one random unit
        direction drawn from ``seed``, in one call."""
        _, flat, _ = self._flat_weights(0)
        direction = np.random.default_rng([seed, 5]).standard_normal(flat.shape)
        direction /= np.linalg.norm(direction) or 1.0
        rows = flat[None, :] + np.asarray(steps)[:, None] * direction[None, :]
        tf = self.tf
        per_example = self._function(0)(tf.constant(rows), self.inputs[0], self.y,
                                        self.states).numpy()
        return np.asarray(per_example.sum(axis=1))

    def _copies(self, perturbations: list[Perturbation], start: int) -> np.ndarray:
        """The loss with x or one initial state replaced, each copy a block of the batch axis
        (a single example's copy: that example's share of the loss)."""
        batch = self.batch
        base = self.arrays[start]

        def block(array: np.ndarray, p: Perturbation) -> np.ndarray:
            return array if p.example is None else array[p.example:p.example + 1]

        inputs = [p.value if p.name == "x" else block(base, p) for p in perturbations]
        states = {key: np.concatenate([p.value if p.name == key else block(initial, p)
                                       for p in perturbations])
                  for key, initial in batch.initial_states.items()}
        tf = self.tf
        per_example = self._function(start)(
            tf.constant(self._flat_weights(start)[1][None, :]),
            tf.constant(np.concatenate(inputs)),
            tf.constant(np.concatenate([block(batch.y, p) for p in perturbations])),
            {k: tf.constant(v) for k, v in states.items()},
        ).numpy()[0]
        ends = np.cumsum([len(value) for value in inputs])
        return np.array([float(np.sum(part)) for part in np.split(per_example, ends[:-1])])


class FiniteDifferences:
    """The witness in two halves, so that most of its work runs beside the autodiff pass.

    ``begin()`` (once the engine is built) draws every probe that needs no gradient and starts
    evaluating those of the tensors whose perturbations run the whole model from x: the first
    recurrent layer's weights and initial states, and x. ``finish(ctx)`` adds the probes of the
    largest |g| and those of the layers above, waits for every evaluation and compares with
    autodiff. ``close()`` stops what is left (after an error elsewhere)."""

    def __init__(self, shapes: ModelShapes, params: dict[str, np.ndarray], batch: Batch,
                 engine: Any, directions: int = 3,
                 progress: Progress | None = None) -> None:
        self.evaluator = _Evaluator(shapes, params, batch, engine)
        self.progress = progress or (lambda message: None)
        rng = np.random.default_rng([shapes.spec.seed, 2])
        self.values = {**params, **batch.initial_states, "x": batch.x}
        #: Per tensor, in the order of autodiff's gradients: the directions and the
        #: candidates for random elements (the random draws never depend on a gradient).
        self.drawn = {name: random_probes(name, value.shape, directions, rng)
                      for name, value in self.values.items()}
        self.losses: dict[tuple[Any, ...], float] = {}
        self._submitted: set[tuple[str, Any]] = set()
        self._futures: list[Future[Any]] = []
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="gradscope-fd")

    def begin(self) -> None:
        early = []
        for name, (directions, candidates) in self.drawn.items():
            if self.evaluator.start[name] != 0:
                continue
            shape = self.values[name].shape
            early += directions + [element_probe(name, shape, i, "random")
                                   for i in candidates[:RANDOM_ELEMENTS]]
        self._submit(early)

    def finish(self, ctx: CheckContext) -> list[WitnessResult]:
        gradients = ctx.autodiff_gradients()
        self.evaluator.layer_outputs(ctx.autodiff.sequences)
        probes = {name: directions + elements_for(name, gradients[name], candidates)
                  for name, (directions, candidates) in self.drawn.items() if name in gradients}
        weights = sum(2 * len(p) for n, p in probes.items() if n in ctx.params)
        inputs = sum(2 * len(p) for n, p in probes.items() if n not in ctx.params)
        self.progress(f"finite differences: {weights} weight evaluations and {inputs} input "
                      "and state evaluations")
        self._submit([p for tensor_probes in probes.values() for p in tensor_probes])
        try:
            for future in self._futures:
                future.result()
        finally:
            self.close()

        rtol = ctx.tolerance(WITNESS)
        loss = ctx.autodiff.loss
        # 64 epsilons of 1 would hide a small loss's gradients, and keep a smaller step from
        # seeing a right one agree: its rounding is measured.
        rounding = (small_loss_rounding(self.evaluator.losses_along(ctx.shapes.spec.seed,
                                                                    ROUNDING_STEPS))
                    if abs(loss) < SMALL_LOSS else ROUNDING)
        results = []
        for name, tensor_probes in probes.items():
            plus = np.array([self.losses[p.key + (1.0,)] for p in tensor_probes])
            minus = np.array([self.losses[p.key + (-1.0,)] for p in tensor_probes])
            error, passed, detail = directional_error(
                gradients[name], tensor_probes, plus, minus, loss, rtol, ctx.atol, SPEC_STEP,
                rounding)
            for step in () if passed else RETAKES:
                # The loss may curve within the step (large weights): a right gradient agrees
                # at a smaller one, a wrong one disagrees at every step; a step whose rounding
                # would hide the disagreement is not taken (nor, then, any smaller one).
                if not can_tell(gradients[name], tensor_probes, plus, minus, loss, rtol,
                                ctx.atol, SPEC_STEP, step, rounding):
                    break
                taken = self._taken_at(tensor_probes, step)
                again = directional_error(
                    gradients[name], tensor_probes,
                    np.array([taken[p.key + (step, 1.0)] for p in tensor_probes]),
                    np.array([taken[p.key + (step, -1.0)] for p in tensor_probes]),
                    loss, rtol, ctx.atol, step, rounding)
                if again[1]:
                    error, passed = again[0], True
                    detail = (f"{again[2]} (at step {step:g}: at {SPEC_STEP:g} the loss "
                              f"curves within the step, {_error_at(detail)})")
                    break
            if not passed:
                # The loss curves within the step by less than a smaller step's rounding
                # would let it see: Richardson's extrapolation from half the step resolves it.
                half = self._taken_at(tensor_probes, SPEC_STEP / 2)
                extrapolated = extrapolated_error(
                    gradients[name], tensor_probes, plus, minus,
                    np.array([half[p.key + (SPEC_STEP / 2, 1.0)] for p in tensor_probes]),
                    np.array([half[p.key + (SPEC_STEP / 2, -1.0)] for p in tensor_probes]),
                    loss, rtol, ctx.atol, SPEC_STEP, rounding)
                if extrapolated[1]:
                    error, passed = extrapolated[0], True
                    detail = (f"{extrapolated[2]} (at {SPEC_STEP:g} the loss curves within the "
                              f"step, {_error_at(detail)})")
            results.append(WitnessResult(WITNESS, name, error, rtol, passed, detail))
        return results

    def _taken_at(self, probes: list[Probe], step: float) -> dict[tuple[Any, ...], float]:
        """The loss at ±``step`` along each probe, now, keyed ``probe.key + (step, sign)``."""
        taken: dict[tuple[Any, ...], float] = {}
        for _, job in self.evaluator.tasks(self._perturbations(probes, step, (step,)), taken):
            job()
        return taken

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, probes: list[Probe]) -> None:
        """Evaluate the probes not yet submitted, + and −; an element probe of x or an initial
        state perturbs its one example."""
        fresh = [p for p in probes if p.key not in self._submitted]
        self._submitted.update(p.key for p in fresh)
        tasks = self.evaluator.tasks(self._perturbations(fresh, SPEC_STEP), self.losses)
        # Largest first, so that the last job to finish is a small one.
        tasks.sort(key=lambda task: -task[0])
        self._futures += [self._pool.submit(job) for _, job in tasks]

    def _perturbations(self, probes: list[Probe], step: float,
                       tag: tuple[Any, ...] = ()) -> list[Perturbation]:
        """Each probe at ±``step``, keyed ``probe.key + tag + (sign,)``; an element probe of
        x or an initial state perturbs its one example."""
        perturbations = []
        for p in probes:
            name = p.tensor
            for sign in (1.0, -1.0):
                key = p.key + tag + (sign,)
                if name in self.evaluator.params or p.element is None:
                    perturbations.append(Perturbation(
                        name, self.values[name] + sign * step * p.direction, key))
                else:
                    # The loss is a sum of one share per example, and an example's share
                    # depends on its own x and initial states alone: moving one example, its
                    # share's difference is the loss's, with less rounding.
                    e = p.element[0]
                    perturbations.append(Perturbation(
                        name, self.values[name][e:e + 1] + sign * step * p.direction[e:e + 1],
                        key, e))
        return perturbations


def _error_at(detail: str) -> str:
    """What a probe's first difference read, from its detail ("worst: …"), for the line
    that says a smaller step agrees."""
    return detail.split("; worst: ", 1)[-1]


def finite_difference_witness(ctx: CheckContext) -> list[WitnessResult]:
    """The whole witness at once, on a context whose autodiff pass has run."""
    witness = FiniteDifferences(ctx.shapes, ctx.params, ctx.batch, ctx.engine, ctx.directions,
                                ctx.progress)
    witness.begin()
    return witness.finish(ctx)

