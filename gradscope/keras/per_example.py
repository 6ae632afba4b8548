"""``explain --per-example``: each example's gradient ‖∂L_i/∂θ‖, per layer and in total.

L_i is example i's share of the batch loss: Keras' own loss with the sample weights times
e_i. Keras' reductions are linear in the weights (``sum_over_batch_size`` divides by the
entries, or by the unmasked ones of the whole batch, never by the weights), so the shares add
up to the loss less its added terms (regularizers, ``add_loss``), which belong to no example;
this is checked on every run, and a loss that is not such a sum is refused. The per-example
gradients come from one batched backward pass under Keras' own call, split by example
(:mod:`~gradscope.keras.example_split`), where the examples do not interact; else (and the
method says why) from one Jacobian of the shares under Keras' own call of the model (pfor,
falling back to a loop). Either way they must add up to the tape's gradient of the shares'
sum.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from gradscope.errors import ConfigError, InternalError, first_line, flag
from gradscope.gradcheck import tolerance
from gradscope.report.models import KerasPerExample

#: The share of the batch's examples whose ‖g_i‖² is summed in ``top_share``.
TOP_FRACTION = 0.1
#: An example is an outlier when its ‖g_i‖ exceeds the median by more than this many scaled
#: median absolute deviations (1.4826 · MAD, the standard deviation of a normal sample).
OUTLIER_MADS = 3.5
#: ``method`` when the examples' gradients come from one batched backward pass, split.
SPLIT_METHOD = ("one batched backward pass under Keras' own call, split by example: per "
                "layer, the VJP of its own call (of one step of its own cell, on every step at "
                "once) vectorised over the examples")


def per_example(engine: Any, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                sample_weight: Any, layer_of: dict[str, str],
                traced: dict[Any, Any] | None = None) -> KerasPerExample:
    """Each example's gradient norms on this batch (see the module).

    Args:
        engine: the :class:`~gradscope.keras.engine.KerasEngine` explain ran.
        inputs: the batch's inputs, by name.
        targets: its targets, by output name.
        sample_weight: the sample weights as the job holds them (None, an array, a dict).
        layer_of: each trainable variable's path → the layer explain's report names.
        traced: the traced functions of earlier runs on this engine, kept here for the next
            (GradientFlow's observations: one trace, not one per batch); None: traced anew.

    Returns:
        The ``per_example`` section of the explain report.

    Raises:
        ConfigError: the loss is not a weighted sum over the examples (exit 2).
    """
    from gradscope.keras.whole_model import as_a_run_starts

    if engine.added_only:
        # Found tried as a new user would: a CTC model's whole loss an add_loss term, refused
        # with "'str' object has no attribute '_type_enum'".
        raise ConfigError(f"{engine.path}: {_asked()}: the model's loss is its "
                          "added terms alone (add_loss, regularizers), which belong to no "
                          "example: no example has a share of it to take the gradient of",
                          where=flag("per_example"))
    model = engine.model
    variables = list(model.trainable_variables)
    feed, y = engine.tensors(inputs, targets)
    size = int(feed[0].shape[0])
    weights = engine.weight_tensors(sample_weight)
    with as_a_run_starts(model, engine.training, engine.seed):
        found, method = _shares_and_jacobian(engine, variables, feed, y, weights, size,
                                             traced)
    loss, added, shares, squares, summed, gradient = found
    from gradscope.keras.mixed_precision import compute_dtype

    # Under a mixed policy the examples' gradients are summed from float16 or bfloat16
    # steps: their sum meets the tape's to that precision (found tried as a new user would:
    # a mixed_float16 GRU's was refused as an internal error at float32's).
    dtype = compute_dtype(model) or engine.dtype_name
    rule = tolerance("replay", dtype)
    if not np.isfinite(loss) or not np.isfinite(added):
        raise ConfigError(f"{engine.path}: {_asked()}: the loss with every "
                          "sample weight 0 is not finite: its reduction divides by the "
                          "weights (a mean weighted by them), so it is no sum of one share "
                          "per example",
                          where=flag("per_example"))
    scale = max(abs(loss), abs(added), float(np.sum(np.abs(shares))), 1e-30)
    if abs(float(np.sum(shares)) - (loss - added)) > rule.rtol * scale:
        raise ConfigError(f"{engine.path}: {_asked()}: the loss is not a sum of "
                          f"one share per example: the shares add up to {np.sum(shares):.9g}, the "
                          f"loss less its added terms is {loss - added:.9g} (a reduction "
                          "that divides by the sample weights, or a loss of your own that "
                          "mixes the examples)", where=flag("per_example"))
    for variable, total, truth in zip(variables, summed, gradient, strict=True):
        bound = rule.rtol * float(np.max(np.abs(truth), initial=0.0)) + rule.atol
        if np.max(np.abs(total - truth), initial=0.0) > max(bound, 1e-30):
            raise InternalError(f"internal error: per-example gradients: the examples' "
                                f"gradients of {variable.path} do not add up to the tape's "
                                "gradient of their losses; please report it")
    by_layer: dict[str, np.ndarray] = {}
    for variable, square in zip(variables, squares, strict=True):
        layer = layer_of.get(variable.path, variable.path.split("/")[0])
        by_layer[layer] = by_layer.get(layer, np.zeros(size)) + square
    total_squares = np.sum(list(by_layer.values()), axis=0) if by_layer else np.zeros(size)
    norms = np.sqrt(total_squares)
    batch_squared = float(sum(np.sum(g.astype(np.float64) ** 2) for g in gradient))
    top = max(1, int(np.ceil(TOP_FRACTION * size)))
    ordered = np.sort(total_squares)[::-1]
    energy = float(np.sum(total_squares))
    return KerasPerExample(
        l2=[float(v) for v in norms],
        layers={layer: [float(v) for v in np.sqrt(values)] for layer, values in by_layer.items()},
        top_examples=top,
        top_share=float(np.sum(ordered[:top]) / energy) if energy > 0 else None,
        outliers=outliers(norms),
        noise_scale=noise_scale(total_squares, batch_squared),
        added_terms=(None if added == 0 else float(added)),
        method=method, dtype=dtype)


def outliers(norms: np.ndarray) -> list[int]:
    """The examples whose norm exceeds the median by more than :data:`OUTLIER_MADS` scaled
    median absolute deviations, largest first (none where the MAD is 0)."""
    median = float(np.median(norms))
    spread = 1.4826 * float(np.median(np.abs(norms - median)))
    if spread == 0:
        return []
    above = [int(i) for i in np.argsort(-norms) if norms[i] > median + OUTLIER_MADS * spread]
    return above


def noise_scale(squares: np.ndarray, batch_squared: float) -> float | None:
    """B_simple = tr(Σ)/|G|² (McCandlish et al. 2018) from one batch of B examples.

    With g_i the gradient of example i's share and G = Σ_i g_i the batch gradient, B·g_i
    estimates one example's gradient, whose mean G estimates; the covariance's trace is the
    unbiased tr(Σ) = (B² Σ_i ‖g_i‖² − B ‖G‖²) / (B − 1), and |G|² is ‖G‖² as measured (an
    overestimate by tr(Σ)/B, so B_simple leans low). None for one example or G = 0."""
    size = len(squares)
    if size < 2 or batch_squared <= 0:
        return None
    trace = (size * size * float(np.sum(squares)) - size * batch_squared) / (size - 1)
    return max(trace, 0.0) / batch_squared


def _shares_and_jacobian(engine: Any, variables: list[Any], feed: list[Any], y: list[Any],
                         weights: Any, size: int, traced: dict[Any, Any] | None = None
                         ) -> tuple[tuple[Any, ...], str]:
    """(loss, loss with zero weights, shares, per variable ‖row‖² per example, per variable
    the rows' sum, per variable the tape's gradient of the shares' sum), and the method: split
    from one batched backward pass where that is shown to be exact (every recomputed call
    equals Keras', the loss keeps the examples apart, no variable is left out), else the
    Jacobian. ``traced``: the traced functions ("split", then by pfor), kept for another run
    on the same engine (GradientFlow's observations): everything that changes from batch to
    batch (the sample weights, the batch size) is their argument, none a value they close
    over, so that a function traced on one batch is right on the next."""
    from gradscope._tf import native_stderr_silenced
    from gradscope.keras import example_split as split_by
    from gradscope.keras.stopped import start_of_call
    from gradscope.keras.whole_model import losses_kept, model_outputs

    tf = engine.tf
    dtype = engine.dtype_name

    def weighted(scale: Any, outputs: list[Any], weights: Any) -> Any:
        # One weight per entry of each output's loss (all its axes but the last): Keras
        # does not broadcast a (batch,) weight over a sequence's steps.
        spread = [_spread(tf, scale, output) for output in outputs]
        if weights is None:
            return spread if len(spread) > 1 else spread[0]
        if isinstance(weights, list):
            return [part if w is None else _times(tf, part, w)
                    for part, w in zip(spread, weights, strict=True)]
        return _times(tf, spread[0], weights) if len(spread) == 1 else [
            _times(tf, part, weights) for part in spread]

    def losses(feed: list[Any], y: list[Any], outputs: list[Any], ones: Any,
               weights: Any) -> Any:
        """The loss, the loss with every weight 0 and each example's share (called under the
        tape that differentiates the shares)."""
        with tf.GradientTape() as inner:
            inner.watch(ones)
            loss = engine.compute_loss(feed, y, outputs, weighted(ones, outputs, weights))
        added = engine.compute_loss(feed, y, outputs,
                                    weighted(tf.zeros_like(ones), outputs, weights))
        # Linear in the weights: example i's share is ∂L/∂w_i at w_i = 1.
        shares = ones * inner.gradient(loss, ones,
                                       unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return loss, added, shares

    def step(feed: list[Any], y: list[Any], ones: Any, weights: Any, pfor: bool) -> Any:
        size = int(ones.shape[0])
        with tf.GradientTape(persistent=True) as tape:
            start_of_call()
            outputs = model_outputs(engine.model, feed, engine.training)
            loss, added, shares = losses(feed, y, outputs, ones, weights)
            total = tf.reduce_sum(shares)
        rows = tape.jacobian(shares, variables, experimental_use_pfor=pfor,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)
        gradient = tape.gradient(total, variables,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        squares = [tf.reduce_sum(tf.reshape(tf.square(r), [size, -1]), axis=1) for r in rows]
        summed = [tf.reduce_sum(r, axis=0) for r in rows]
        return loss, added, shares, squares, summed, [tf.convert_to_tensor(g)
                                                      for g in gradient]

    def split(feed: list[Any], y: list[Any], ones: Any, mixer: Any, weights: Any) -> Any:
        size = int(ones.shape[0])
        recorder = split_by.Recorder(watch=lambda _: None, training=engine.training)
        with tf.GradientTape() as tape:
            recorder.watch = tape.watch
            start_of_call()
            with split_by.observed(engine.model, recorder):
                outputs = model_outputs(engine.model, feed, engine.training)
        # The loss on a tape of its own: its gradients on the outputs, then one backward
        # pass of the model from there.
        with tf.GradientTape(persistent=True) as on_loss:
            on_loss.watch(outputs)
            loss, added, shares = losses(feed, y, outputs, ones, weights)
            total = tf.reduce_sum(shares)
            mixed = tf.reduce_sum(mixer * shares)
        on_outputs = on_loss.gradient(total, outputs,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
        mixed_on = on_loss.gradient(mixed, outputs,
                                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
        targets = {"loops": [split_by.loop_targets(r) for r in recorder.loops],
                   "calls": [r.outputs for r in recorder.calls]}
        on_targets, gradient = tape.gradient(
            outputs, [targets, variables], output_gradients=on_outputs,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        squares, summed, stray, scale, used = split_by.split_squares(tf, recorder, on_targets,
                                                            variables, size)
        # A variable no recorded call uses must have no gradient: else the split missed it.
        missed = [tf.reduce_max(tf.abs(tf.cast(g, tf.float64)))
                  for g, split_uses in zip(gradient, used, strict=True) if not split_uses]
        # A loss that keeps the examples apart: example i's row of ∂(Σ r_i L_i)/∂outputs is
        # r_i times its row of ∂(Σ L_i)/∂outputs.
        apart = [tf.reduce_max(tf.abs(tf.cast(m - tf.reshape(mixer, [-1] + [1] * (
            len(o.shape) - 1)) * o, tf.float64))) for m, o in zip(mixed_on, on_outputs,
                                                                  strict=True)]
        zero = tf.constant(0.0, tf.float64)
        sizes = [tf.reduce_max(tf.abs(tf.cast(m, tf.float64))) for m in mixed_on]
        return (loss, added, shares, squares, summed,
                [tf.convert_to_tensor(g) for g in gradient], stray, scale,
                tf.reduce_max(tf.stack([zero, *apart])), tf.reduce_max(tf.stack([zero, *sizes])),
                tf.reduce_max(tf.stack([zero, *missed])))

    ones = tf.ones([size], dtype=dtype)
    found = None
    method = ""
    traced = {} if traced is None else traced
    with native_stderr_silenced(), losses_kept(engine.model):
        why = _split_refused(engine)
        if why is None:
            try:
                if "split" not in traced:
                    traced["split"] = tf.function(split, autograph=False)
                mixer = tf.constant(np.random.default_rng(7).uniform(0.5, 1.5, size), dtype)
                *found, stray, scale, apart, spread, missed = traced["split"](
                    feed, y, ones, mixer, weights)
                rtol, atol = tolerance("replay", dtype)
                if float(missed) > 0:
                    why = "a trainable variable used outside the layer calls it splits"
                elif float(apart) > 10 * (rtol * float(spread) + atol):
                    why = "the loss mixes the examples"
                elif float(stray) > 10 * (rtol * float(scale) + atol):
                    why = ("a layer or cell, run on one example alone, does not give what "
                           "Keras' call of the batch gave (its examples interact)")
                else:
                    method = SPLIT_METHOD
                if method != SPLIT_METHOD:
                    found = None
            except split_by.NotSplit as exc:
                # Keras wraps an error raised inside a call in its own words, bolded
                # (found tried as a new user would: the method line held them, escape codes
                # and "Arguments received by Functional.call()" too): the reason alone.
                why = re.sub(r"^[\w.]+\.call\(\): ", "", first_line(exc))
            except Exception as exc:  # noqa: BLE001  (a cell or layer the split cannot run
                # alone, or vectorized_map cannot convert: the Jacobian takes it)
                why = f"it failed: {first_line(exc)}"
        for pfor in (True, False):
            if found is not None:
                break
            try:
                if pfor not in traced:
                    traced[pfor] = tf.function(step, autograph=False)
                found = traced[pfor](feed, y, ones, weights, pfor)
                method = ("one Jacobian of the examples' losses under Keras' own call, "
                          + ("vectorised (pfor)" if pfor else "one backward pass per example "
                             "(a tf.while_loop; pfor could not vectorise this model)")
                          # The norms are still grouped by layer: the words name the
                          # route not taken (found tried as a new user would: "not split
                          # by layer" under a table split by layer).
                          + f" (not the batched pass split at each layer's call: {why})")
                break
            except Exception as exc:  # noqa: BLE001  (pfor fails in many ways; loop next)
                failure = first_line(exc)
                if not pfor:
                    raise ConfigError(f"{engine.path}: {_asked()}: the Jacobian of the "
                                      f"examples' losses fails: {failure}",
                                      where=flag("per_example")) from None
    assert found is not None
    loss, added, shares, squares, summed, gradient = found
    return ((float(loss), float(added), np.asarray(shares, np.float64),
             [np.asarray(s, np.float64) for s in squares],
             [np.asarray(s, np.float64) for s in summed],
             [np.asarray(g, np.float64) for g in gradient]), method)


def _asked() -> str:
    """The option as the user gave it: ``--per-example`` or ``per_example=True``."""
    option = flag("per_example")
    return option + "True" if option.endswith("=") else option


def _split_refused(engine: Any) -> str | None:
    """Why the model's loss cannot be split by example whatever its layers (None: it may)."""
    if engine.plan.custom_compute_loss:
        return "a compute_loss of your own, which may read more than the model's outputs"
    return None


def _spread(tf: Any, scale: Any, output: Any) -> Any:
    """``scale`` (one number per example) over every axis of ``output`` but the last."""
    rank = max(len(output.shape) - 1, 1)
    shaped = tf.reshape(scale, [-1] + [1] * (rank - 1))
    return shaped * tf.ones(tf.shape(output)[:rank], scale.dtype)


def _times(tf: Any, spread: Any, weight: Any) -> Any:
    """A spread scale times the user's sample weight, each broadcast over the other's axes."""
    weight = tf.cast(weight, spread.dtype)
    low, high = sorted((spread, weight), key=lambda t: len(t.shape))
    low = tf.reshape(low, tf.concat([tf.shape(low),
                                     tf.ones([len(high.shape) - len(low.shape)], tf.int32)],
                                    axis=0))
    return low * high
