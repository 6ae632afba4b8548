"""The front door: which wing a model belongs to, asked once per call, then the one path every
command takes through that wing: job (options checked once, the batch loaded) → memory guard
→ explain or check. The public functions in ``gradscope/__init__.py`` call only this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np


def wing(source: Any) -> Any:
    """The wing ``source`` belongs to, asked once per call: :mod:`gradscope.keras.job` for a
    saved ``.keras`` file or a Keras model object, else :mod:`gradscope.yaml.job`."""
    from gradscope.keras.archive import is_keras_file
    from gradscope.keras.live import is_live_model

    if is_keras_file(source) or is_live_model(source):
        from gradscope.keras import job as keras_job

        return keras_job
    from gradscope.yaml import job as yaml_job

    return yaml_job


def prepared(command: str, source: Any, data: Any, x: Any, y: Any, sample_weight: Any,
             options: dict[str, Any]) -> tuple[Any, Any]:
    """The wing, and ``source`` made ready for ``command`` by it: every option checked once,
    the batch loaded."""
    from gradscope.arrays import as_data_files

    chosen = wing(source)
    if is_keras_path(options.get("weights")):
        options = {**options, "weights": SavedModelWeights(str(options["weights"]))}
    data = as_data_files(data)
    return chosen, chosen.prepare(command, source, data, x, y, sample_weight, options)


def run(command: str, source: Any, data: Any, x: Any, y: Any, sample_weight: Any,
        options: dict[str, Any], max_memory: int | str | None,
        progress: Callable[[str], None] | None, timings: bool) -> Any:
    """The front door: the wing, then job → memory guard → explain or check."""
    from gradscope._tf import tensorflow_logger_quieted
    from gradscope.guard import memory_limit

    chosen, ready = prepared(command, source, data, x, y, sample_weight, options)
    chosen.guard(ready, memory_limit(max_memory))
    with tensorflow_logger_quieted():
        return drawn(chosen.run(ready, progress, timings))


@dataclass(frozen=True)
class SpecAsKeras:
    """A YAML spec's model built from Keras' layers (:func:`spec_as_keras`), its batch, where
    that came from, and the spec's loss by its name."""

    model: Any
    x: np.ndarray
    y: np.ndarray
    data: str
    loss: str
    #: Where the weights came from, in words: the seed's draw, or the ``weights`` file and how
    #: its variables met the spec's layers.
    weights: str
    #: The spec's seed (its weights' and synthetic batch's draws).
    seed: int


def spec_as_keras(source: Any, data: Any, weights: Any = None,
                  progress: Callable[[str], None] | None = None) -> SpecAsKeras:
    """A YAML spec (a path, a dict, a Spec, or None: the embedded seed model) as a Keras model
    of Keras' own layers with the spec's weights (:mod:`gradscope.yaml.keras_layers`; the
    seed's draw, or ``weights``), held to the spec's own NumPy predictions, with the spec's
    batch (``data``, or its synthetic one). What ``diagnose CONFIG`` runs on, so that the
    dynamics are read from Keras' cells. A batch's non-zero initial states are refused (the
    Keras model starts every layer from zeros)."""
    from pathlib import Path

    from gradscope.arrays import as_data_files
    from gradscope.errors import ConfigError
    from gradscope.yaml import job as yaml_job
    from gradscope.yaml.algebra import model_shapes
    from gradscope.yaml.data import initial_params, synthetic_batch
    from gradscope.yaml.keras_layers import KERAS_LOSSES, keras_layers
    from gradscope.yaml.reference import predictions
    from gradscope.yaml.weights import chosen_weights

    if is_keras_path(weights):
        weights = SavedModelWeights(str(weights))
    ready = yaml_job.prepare("explain", source, as_data_files(data), None, None, None,
                             {} if weights is None else {"weights": weights})
    spec = ready.spec
    shapes = model_shapes(spec)
    batch = ready.batch if ready.batch is not None else synthetic_batch(shapes)
    given = sorted(name for name, value in batch.initial_states.items() if np.any(value))
    if given:
        raise ConfigError(f"{', '.join(given)}: diagnose starts every recurrent layer from "
                          "zeros, and the data's own initial states are not diagnosed yet; "
                          "leave them out of the data (explain and check take them)",
                          where="--data")
    params, entry = chosen_weights(spec, weights, None, progress or (lambda message: None))
    params = initial_params(shapes) if params is None else params
    told = (f"drawn from the spec's seed {spec.seed}" if entry is None else
            f"read from {entry.source} ({entry.format}; {len(entry.mapping)} weights, "
            f"{entry.matched_by})")
    if source is None:
        name, label = "seed", "the seed model"
    elif isinstance(source, str | PathLike):
        name, label = Path(source).stem, str(source)
    else:
        name, label = "spec", "a YAML spec"
    from gradscope.keras.from_layers import built  # imports TensorFlow

    model = built(name, spec.time_steps, spec.input_size, keras_layers(shapes, params),
                  KERAS_LOSSES[spec.loss], label, batch.x,
                  predictions(shapes, params, batch.x), spec.dtype)
    return SpecAsKeras(model, batch.x.astype(spec.dtype), batch.y.astype(spec.dtype),
                       batch.source, spec.loss, told, spec.seed)


def diagnose_spec(source: Any, data: Any, x: Any, y: Any, sample_weight: Any, weights: Any,
                  options: dict[str, Any], max_memory: int | str | None,
                  progress: Callable[[str], None] | None, timings: bool) -> Any:
    """``gradscope.diagnose`` of a YAML spec: its model built from Keras' own layers
    (:func:`spec_as_keras`) and diagnosed as a Keras model is, the report then saying the
    spec's own batch, seed, loss and weights (and no optimizer: the spec names none)."""
    from gradscope.errors import ConfigError, flag

    if x is not None or y is not None or sample_weight is not None:
        raise ConfigError("x=, y= and sample_weight= are for a Keras model; for a YAML spec "
                          "pass data={'x': ..., 'y': ...}", where="x")
    keras_options = sorted(set(options) - {"exponents", "counterfactuals"})
    if keras_options:
        name = keras_options[0]
        raise ConfigError(f"{flag(name)} is for a Keras model: a YAML spec gives its own "
                          "batch, loss and weights", where=flag(name))
    # The spec's model, built from Keras' own layers with its weights: its dynamics are read
    # from Keras' cells, as a saved model's are.
    if progress is not None:
        progress("building the spec's model from Keras' layers")
    from gradscope.yaml.keras_layers import BUILT

    built = spec_as_keras(source, data, weights, progress)
    report = run("diagnose", built.model, None, built.x, built.y, None, options, max_memory,
                 progress, timings)
    loss = report.loss
    keras_loss = ", ".join(o.loss + (" from logits" if o.from_logits else "")
                           for o in loss.outputs)
    said = f"{built.loss}, the config's loss (Keras' {keras_loss})"
    norm = "" if report.gradient_norm is None else f" (global norm {report.gradient_norm:.3g})"
    return report.model_copy(update={
        "model": report.model.model_copy(update={"data": built.data, "seed": built.seed}),
        # The Keras model was compiled with a loss alone: its optimizer is Keras' default,
        # no part of the config (found tried as a new user would: "RMSprop clips nothing").
        "clipping": report.clipping.model_copy(update={
            "optimizer": None, "setting": None,
            "effect": "a YAML config names no optimizer, and so no clipping: the batch's "
                      f"gradient as it is{norm}"}),
        "loss": loss.model_copy(update={"name": said, "outputs": [
            o.model_copy(update={"rule": "the config's loss"}) for o in loss.outputs]}),
        "method": [BUILT.format(weights=built.weights), *report.method]})


def drawn(report: Any) -> Any:
    """``report``, able to draw itself: the notebook's HTML and ``report.plot()`` come from
    renderers that register themselves when imported (the report models know nothing of
    them)."""
    import gradscope.report.display  # noqa: F401
    import gradscope.report.plot  # noqa: F401

    return report


class SavedModelWeights(str):
    """The path of a saved ``model.keras`` given as a YAML spec's weights: its arrays are read
    by Keras only when the spec runs."""

    __slots__ = ()

    def read(self) -> Any:
        from gradscope.keras.yaml_form import read_saved_form
        from gradscope.yaml.weights import SavedArrays

        return SavedArrays(read_saved_form(str(self)).arrays, str(self))


def is_keras_path(source: Any) -> bool:
    return isinstance(source, str | PathLike) and str(source).endswith(".keras")


def imports_of(imports: Any) -> tuple[str, ...]:
    return (imports,) if isinstance(imports, str) else tuple(imports)


