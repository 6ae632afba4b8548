"""gradscope: explain and verify the gradients of recurrent TensorFlow models.

Python API (the CLI is a thin layer over exactly these)::

    import gradscope
    spec = gradscope.load_spec("config.yaml")     # or a dict, or None for the seed model
    report = gradscope.explain(spec)
    report.to_dict()
    gradscope.explain("model.keras")              # a saved Keras model, run by Keras
    gradscope.explain(spec, weights="model.ckpt") # your trained weights (npz or checkpoint)
    gradscope.infer_spec("model.ckpt").yaml       # the config a checkpoint's shapes imply
    gradscope.explain(model, x=x, y=y, flow=True) # a Keras model object, e.g. in a notebook
    gradscope.shapes(model)                       # its algebra alone, nothing run
    gradscope.watch("runs/gru")                   # what GradientFlow wrote to its log_dir

A Keras model object (Sequential or functional, built) goes through the same Keras engine as
a ``.keras`` file: its graph is read from the config Keras would save, and it runs as it is,
with its current weights. gradscope never changes it: its weights, compiled state and dtype
are the same afterwards (the loss gradscope chooses for an uncompiled model is computed
beside it, never compiled into it; ``check`` works on a float64 copy). Its layers' code is
the user's own, already running, so a Lambda or a custom layer is not refused as in a file: it
is run, and listed with its real gradient and "no derivation for this layer type".

Every report draws itself in Jupyter (``_repr_html_``: the terminal's tables, formulas and
flags), ``report.plot()`` returns a matplotlib Figure, ``report.to_dict()`` and
``report.to_json()`` give the ``--json`` document.

Importing gradscope does not import TensorFlow; ``explain`` does, quietly.
"""

from __future__ import annotations

from os import PathLike
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gradscope.report.models import (
        CheckReport,
        ExplainReport,
        FlowHistoryReport,
        KerasCheckReport,
        KerasExplainReport,
        KerasShapesReport,
        LayerCheckReport,
        ShapesReport,
        SpecInference,
    )
    from gradscope.yaml.config import Spec


def load_spec(source: Any = None) -> Spec:
    """A validated spec from a YAML path, a dict, or ``None`` (the embedded seed model)."""
    from gradscope.yaml.config import load_spec as _load_spec

    return _load_spec(source)


def _as_spec(source: Any) -> Spec:
    """What the API's first argument names, as a validated Spec: a YAML path, a dict, a Spec,
    or None (the embedded seed model). Anything else is refused in one line."""
    from gradscope.yaml.config import Spec

    if isinstance(source, Spec):
        return source
    if source is None or isinstance(source, str | PathLike | dict):
        return load_spec(source)
    from gradscope.errors import ConfigError

    raise ConfigError(f"the model: got an object of type {type(source).__name__}; expected a "
                      "YAML path, a "
                      "dict or a Spec (gradscope.load_spec), a saved model.keras path, or a "
                      "Keras model object (Sequential or functional)", where="spec")


def _drawn(report: Any) -> Any:
    """``report``, able to draw itself: the notebook's HTML and ``report.plot()`` come from
    renderers that register themselves when imported (the report models know nothing of
    them)."""
    import gradscope.report.display  # noqa: F401
    import gradscope.report.plot  # noqa: F401

    return report


def _is_keras(source: Any) -> bool:
    from gradscope.keras.archive import is_keras_file
    from gradscope.keras.live import is_live_model

    return is_keras_file(source) or is_live_model(source)


def _keras_job(source: Any, data: Any, x: Any, y: Any, options: dict[str, Any],
               sample_weight: Any = None) -> Any:
    """A saved Keras model (read without TensorFlow) or a model object, with its batch.
    ``options``: batch_size, time_steps, loss, training, pad, seed (as the CLI's flags);
    ``data``: a path to an .npz named by inputs and outputs; ``x``/``y``: arrays."""
    from gradscope.errors import ConfigError
    from gradscope.keras.explain import prepare
    from gradscope.keras.live import is_live_model
    from gradscope.keras.options import KerasJobOptions

    checked = KerasJobOptions.from_options(options)
    if data is not None and not isinstance(data, str | PathLike):
        raise ConfigError("data=: for a Keras model, the path of an .npz file; pass arrays "
                          "as x= and y=", where="data")
    return prepare(source if is_live_model(source) else str(source),
                   data=None if data is None else str(data), x=x, y=y,
                   sample_weight=sample_weight,
                   batch_size=checked.batch_size, time_steps=checked.time_steps,
                   loss=checked.loss, training=checked.training, pad=checked.pad,
                   seed=checked.seed)


def shapes(spec: Any) -> ShapesReport | KerasShapesReport:
    """The shape algebra of ``spec``, of a saved ``model.keras`` or of a Keras model object
    (from its config, as a file's), without running anything: no TensorFlow is imported for a
    spec or a file."""
    from gradscope.yaml.shapes import shapes as _shapes

    if _is_keras(spec):
        from gradscope.keras.shapes import keras_shapes

        return _drawn(keras_shapes(spec if not isinstance(spec, PathLike) else str(spec)))
    spec = _as_spec(spec)

    return _drawn(_shapes(spec))


def _with_data(spec: Spec, data: Any) -> tuple[Spec, Any]:
    """``data``: None (synthetic), a path to an .npz, or a dict of arrays (x, y, h0s)."""
    if data is None:
        return spec, None
    from gradscope.yaml.data import load_batch, validate_batch

    if isinstance(data, dict):
        return validate_batch(spec, data, origin="the data")
    return load_batch(spec, data=data)


def _refuse_weights_for_keras(weights: Any) -> None:
    if weights is not None:
        from gradscope.errors import ConfigError

        raise ConfigError("weights= is for YAML specs; a Keras model carries its own "
                          "weights", where="--weights")


#: explain's options for a YAML spec only: ``at`` (the step t of ‖∂h_t/∂x_s‖, as --at) and
#: ``heatmap`` (‖∂h_t/∂x_s‖ over (t, s), as --plot draws it; read it with ``report.plot()``).
#: Either implies ``flow``.
YAML_EXPLAIN_OPTIONS = ("at", "heatmap")


def explain(spec: Any, data: Any = None, weights: Any = None, chunks: int | None = None,
            *, x: Any = None, y: Any = None, sample_weight: Any = None, flow: bool = False,
            jacobians: bool = False, **keras_options: Any) -> ExplainReport | KerasExplainReport:
    """One forward/backward pass in TensorFlow, every gradient explained.

    ``spec`` is a YAML path, a dict or a Spec: ``data`` is then None (a synthetic batch from
    the seed), a path to an .npz file or a dict of arrays ``{"x": ..., "y": ..., "gru_1/h0":
    ...}``. ``weights`` is None (weights drawn from the spec's seed) or your trained weights:
    a path to an .npz file or a TensorFlow checkpoint (TF1 name-based or TF2 object-based),
    or a dict of arrays. Their names may be gradscope's (``gru_1/w_ru``), TF1's
    (``GRU_Layer1/rnn/gru_cell/gates/kernel``) or Keras' (``sequential/gru/gru_cell/kernel``);
    they are matched to the spec's layers by scope order and shape, converted where the
    layouts differ, and ``report.weights.mapping`` says where each weight came from. A
    variable that is missing, extra or misshapen raises ConfigError, one line per variable.
    ``chunks`` (K ≥ 2, YAML specs) adds the carry in numbers under ``report.carry``: per
    weight ``l2_full``, ``l2_truncated``, ``l2_carried``. Refused (ConfigError) when the
    resource guard estimates more memory than a quarter of RAM.

    ``spec`` may instead be a Keras model: the path of a saved ``model.keras``, or the model
    object itself (Sequential or functional). Keras runs it, with:

    - ``x``: the inputs, NumPy or TensorFlow arrays: one array for a single input, a list in
      the model's input order, or a dict by input name (a float input is cast to its Input's
      dtype, as Keras does). ``y``: the targets, likewise by output; None: synthetic targets
      that match the loss. Without ``x``: a synthetic batch (or ``data``, an .npz path).
      ``sample_weight``: as ``fit`` takes it (one array, or a list or dict by output), with
      ``y``; the loss is weighed exactly as ``compute_loss`` weighs it.
    - ``keras_options`` as the CLI's flags: ``batch_size``, ``time_steps`` (synthetic batch),
      ``loss`` (a Keras loss name; default: the compiled loss, else inferred from the output),
      ``training`` (dropout and batch norm in training mode, seeded), ``pad``, ``seed``.
    - ``flow``: ‖∂L/∂h_t‖ per step of every recurrent call; ``jacobians``: ∂h_T/∂h_0 (for a
      YAML spec too, with ``at`` and ``heatmap``: see :data:`YAML_EXPLAIN_OPTIONS`).

    A shape or name that does not fit the model is a ConfigError/DataError naming the array
    (``x['tokens']``, ``y[1]``).
    """
    from gradscope.errors import ConfigError
    from gradscope.guard import guard
    from gradscope.yaml.explain import explain as _explain

    yaml_only = {k: keras_options.pop(k) for k in YAML_EXPLAIN_OPTIONS if k in keras_options}
    if _is_keras(spec):
        _refuse_weights_for_keras(weights)
        if chunks is not None:
            raise ConfigError("chunks is for YAML specs; a Keras model's recurrent layers "
                              "are not cut into chunks yet", where="chunks")
        if yaml_only:
            raise ConfigError(f"{'= and '.join(sorted(yaml_only))}= are for YAML specs so far; "
                              "a Keras model takes flow= and jacobians=",
                              where=sorted(yaml_only)[0])
        from gradscope.keras.explain import explain as _explain_keras

        return _drawn(_explain_keras(_keras_job(spec, data, x, y, keras_options, sample_weight),
                                     flow=flow, jacobians=jacobians))
    if x is not None or y is not None or sample_weight is not None:
        raise ConfigError("x=, y= and sample_weight= are for a Keras model; for a YAML spec "
                          "pass data={'x': ..., 'y': ...}", where="x")
    if keras_options:  # never silently ignored
        unknown = sorted(keras_options)
        raise ConfigError(f"{'= and '.join(unknown)}= are not options of explain for a YAML "
                          f"spec; expected some of data, weights, chunks, flow, jacobians, "
                          f"{', '.join(YAML_EXPLAIN_OPTIONS)}", where=unknown[0])
    spec = _as_spec(spec)

    spec, batch = _with_data(spec, data)
    guard(spec, "explain", chunks=chunks)
    heatmap = bool(yaml_only.get("heatmap", False))
    return _drawn(_explain(spec, data=batch, weights=weights, chunks=chunks,
                           flow=flow or heatmap or yaml_only.get("at") is not None,
                           jacobians=jacobians, **yaml_only))


def check(spec: Any, against: Any = None, chunks: int | None = None,
          data: Any = None, layer: str | None = None, time_last: bool = False,
          weights: Any = None, *, x: Any = None, y: Any = None, sample_weight: Any = None,
          **options: Any) -> CheckReport | KerasCheckReport | LayerCheckReport:
    """Verify every gradient with independent witnesses (see ``gradscope check --help``).

    ``against`` is ``"FILE.py:FUNC"`` or a callable ``FUNC(params, x, y, h0) -> dict``. The
    names it leaves out are in ``report.against_not_returned``; if it raises or returns no
    known name, ``ConfigError`` says where. With ``layer``, ``against`` is the backward of that
    one recurrent layer, ``FUNC(x, h0, params, dh) -> dict`` (``time_last``: arrays laid out
    (features, batch, time)); the report is a ``LayerCheckReport`` (see docs/check.md).
    ``weights``: your trained weights, as for :func:`explain`. (``params={"gru_1/w_ru": …}``,
    by gradscope name and in the spec's layout, also works: taken as they are, with no
    mapping reported.)

    ``spec`` may be a Keras model, a ``model.keras`` path or the model object, with ``x``,
    ``y`` and the options of :func:`explain` (plus ``directions``, ``rtol``, ``atol``): finite
    differences and the NumPy reference on a float64 copy of the model with the same weights.
    """
    from gradscope.guard import guard
    from gradscope.witnesses.check import check as _check

    if _is_keras(spec):
        _refuse_weights_for_keras(weights)
        from gradscope.keras.check import check as _check_keras
        from gradscope.keras.options import KerasJobOptions, check_witness_options

        job_options = KerasJobOptions.names()
        witness_options = {k: v for k, v in options.items() if k not in job_options}
        check_witness_options(witness_options)
        job = _keras_job(spec, data, x, y,
                         {k: v for k, v in options.items() if k in job_options}, sample_weight)
        return _drawn(_check_keras(job, **witness_options))
    if x is not None or y is not None or sample_weight is not None:
        from gradscope.errors import ConfigError

        raise ConfigError("x=, y= and sample_weight= are for a Keras model; for a YAML spec "
                          "pass data={'x': ..., 'y': ...}", where="x")
    spec = _as_spec(spec)

    spec, batch = _with_data(spec, data)
    if layer is not None or time_last:
        from gradscope import preflight
        from gradscope.witnesses.layer_backward import check_layer

        preflight.check_layer_options(against, layer, time_last, {"chunks": chunks})
        assert layer is not None and against is not None
        preflight.check_layer_name(spec, layer)
        guard(spec, "check")
        return _drawn(check_layer(spec, against, layer, time_last=time_last, data=batch,
                                  weights=weights, **options))
    guard(spec, "check")
    return _drawn(_check(spec, against=against, chunks=chunks, data=batch, weights=weights,
                         **options))


def infer_spec(source: Any) -> SpecInference:
    """The config that a checkpoint's or an .npz file's variable shapes imply (no TensorFlow
    for an .npz): ``report.yaml`` loads with :func:`load_spec`, ``report.inferences`` says
    why each value is what it is. Ambiguous or unknown variables raise ConfigError."""
    from gradscope.yaml.inference import infer_spec as _infer_spec

    return _infer_spec(source)


def watch(log_dir: str | PathLike[str]) -> FlowHistoryReport:
    """What ``gradscope.keras.GradientFlow(log_dir=...)`` wrote during training, read back from
    its TensorBoard event files without TensorFlow (needs the tensorboard package)."""
    from gradscope.training_log import watch as _watch

    return _drawn(_watch(log_dir))


__all__ = ["__version__", "check", "explain", "infer_spec", "load_spec", "shapes", "watch"]
