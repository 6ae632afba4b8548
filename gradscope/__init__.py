"""gradscope: explain and verify the gradients of recurrent TensorFlow models.

Python API (the CLI is a thin layer over exactly these)::

    import gradscope
    spec = gradscope.load_spec("config.yaml")     # or a dict, or None for the seed model
    report = gradscope.explain(spec)
    report.to_dict()
    gradscope.explain("model.keras")              # a saved Keras model, run by Keras
    gradscope.explain(spec, weights="model.ckpt") # your trained weights (npz or checkpoint)
    gradscope.infer_spec("model.ckpt").yaml       # the config a checkpoint's shapes imply

Importing gradscope does not import TensorFlow; ``explain`` does, quietly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gradscope.report.models import (
        CheckReport,
        ExplainReport,
        KerasCheckReport,
        KerasExplainReport,
        KerasShapesReport,
        LayerCheckReport,
        ShapesReport,
        SpecInference,
    )
    from gradscope.spec import Spec


def load_spec(source: Any = None) -> Spec:
    """A validated spec from a YAML path, a dict, or ``None`` (the embedded seed model)."""
    from gradscope.spec import load_spec as _load_spec

    return _load_spec(source)


def _keras_job(path: Any, data: Any, options: dict[str, Any]) -> Any:
    """A saved Keras model read without TensorFlow. ``options``: batch_size, time_steps, loss,
    training, pad, seed (as the CLI's flags); ``data``: a path to an .npz named by inputs and
    outputs."""
    from gradscope.keras.explain import prepare

    return prepare(str(path), data=None if data is None else str(data), **options)


def shapes(spec: Spec | str) -> ShapesReport | KerasShapesReport:
    """The shape algebra of ``spec`` (or of a saved ``model.keras``), without TensorFlow."""
    from gradscope.inspect import shapes as _shapes
    from gradscope.keras.archive import is_keras_file

    if is_keras_file(spec):
        from gradscope.keras.shapes import keras_shapes

        return keras_shapes(str(spec))
    spec = load_spec(spec) if isinstance(spec, str) else spec

    return _shapes(spec)


def _with_data(spec: Spec, data: Any) -> tuple[Spec, Any]:
    """``data``: None (synthetic), a path to an .npz, or a dict of arrays (x, y, h0s)."""
    if data is None:
        return spec, None
    from gradscope.data import load_batch, validate_batch

    if isinstance(data, dict):
        return validate_batch(spec, data, origin="the data")
    return load_batch(spec, data=data)


def _refuse_weights_for_keras(weights: Any) -> None:
    if weights is not None:
        from gradscope.errors import ConfigError

        raise ConfigError("weights= is for YAML specs; a saved .keras model carries its own "
                          "weights", where="--weights")


def explain(spec: Spec | str, data: Any = None, weights: Any = None,
            **keras_options: Any) -> ExplainReport | KerasExplainReport:
    """One forward/backward pass in TensorFlow, every gradient explained.

    ``data`` is None (a synthetic batch from the seed), a path to an .npz file or a dict
    of arrays ``{"x": ..., "y": ..., "gru_1/h0": ...}``. ``weights`` is None (weights drawn
    from the spec's seed) or your trained weights: a path to an .npz file or a TensorFlow
    checkpoint (TF1 name-based or TF2 object-based), or a dict of arrays. Their names may be
    gradscope's (``gru_1/w_ru``), TF1's (``GRU_Layer1/rnn/gru_cell/gates/kernel``) or Keras'
    (``sequential/gru/gru_cell/kernel``); they are matched to the spec's layers by scope
    order and shape, converted where the layouts differ, and ``report.weights.mapping`` says
    where each weight came from. A variable that is missing, extra or misshapen raises
    ConfigError, one line per variable. Refused (ConfigError) when the resource guard
    estimates more memory than a quarter of RAM. ``spec`` may be the path of a saved
    ``model.keras``: Keras runs it (``keras_options`` as the CLI's flags, e.g.
    ``batch_size=8, loss="mse", training=True``).
    """
    from gradscope.guard import guard
    from gradscope.inspect import explain as _explain
    from gradscope.keras.archive import is_keras_file

    if is_keras_file(spec):
        _refuse_weights_for_keras(weights)
        from gradscope.keras.explain import explain as _explain_keras

        return _explain_keras(_keras_job(spec, data, keras_options))
    spec = load_spec(spec) if isinstance(spec, str) else spec

    spec, batch = _with_data(spec, data)
    guard(spec, "explain")
    return _explain(spec, data=batch, weights=weights)


def check(spec: Spec | str, against: Any = None, chunks: int | None = None,
          data: Any = None, layer: str | None = None, time_last: bool = False,
          weights: Any = None,
          **options: Any) -> CheckReport | KerasCheckReport | LayerCheckReport:
    """Verify every gradient with independent witnesses (see ``gradscope check --help``).

    ``against`` is ``"FILE.py:FUNC"`` or a callable ``FUNC(params, x, y, h0) -> dict``. The
    names it leaves out are in ``report.against_not_returned``; if it raises or returns no
    known name, ``ConfigError`` says where. With ``layer``, ``against`` is the backward of that
    one recurrent layer, ``FUNC(x, h0, params, dh) -> dict`` (``time_last``: arrays laid out
    (features, batch, time)); the report is a ``LayerCheckReport`` (see README).
    ``weights``: your trained weights, as for :func:`explain`. (``params={"gru_1/w_ru": …}``,
    by gradscope name and in the spec's layout, also works: taken as they are, with no
    mapping reported.)
    """
    from gradscope.guard import guard
    from gradscope.keras.archive import is_keras_file
    from gradscope.witnesses import check as _check

    if is_keras_file(spec):
        _refuse_weights_for_keras(weights)
        from gradscope.keras.check import check as _check_keras

        keras_keys = {"batch_size", "time_steps", "loss", "training", "pad", "seed"}
        job = _keras_job(spec, data, {k: v for k, v in options.items() if k in keras_keys})
        return _check_keras(job, **{k: v for k, v in options.items() if k not in keras_keys})
    spec = load_spec(spec) if isinstance(spec, str) else spec

    spec, batch = _with_data(spec, data)
    if layer is not None or time_last:
        from gradscope import preflight
        from gradscope.witnesses.layer_backward import check_layer

        preflight.check_layer_options(against, layer, time_last, {"chunks": chunks})
        assert layer is not None and against is not None
        preflight.check_layer_name(spec, layer)
        guard(spec, "check")
        return check_layer(spec, against, layer, time_last=time_last, data=batch,
                           weights=weights, **options)
    guard(spec, "check")
    return _check(spec, against=against, chunks=chunks, data=batch, weights=weights, **options)


def infer_spec(source: Any) -> SpecInference:
    """The config that a checkpoint's or an .npz file's variable shapes imply (no TensorFlow
    for an .npz): ``report.yaml`` loads with :func:`load_spec`, ``report.inferences`` says
    why each value is what it is. Ambiguous or unknown variables raise ConfigError."""
    from gradscope.spec_inference import infer_spec as _infer_spec

    return _infer_spec(source)


__all__ = ["__version__", "check", "explain", "infer_spec", "load_spec", "shapes"]
