"""gradscope: explain and verify the gradients of recurrent TensorFlow models.

Python API (the CLI is a thin layer over exactly these)::

    import gradscope
    spec = gradscope.load_spec("config.yaml")     # or a dict, or None for the seed model
    report = gradscope.explain(spec)
    report.to_dict()
    gradscope.explain("model.keras")              # a saved Keras model, run by Keras

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
        ShapesReport,
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


def explain(spec: Spec | str, data: Any = None, chunks: int | None = None,
            **keras_options: Any) -> ExplainReport | KerasExplainReport:
    """One forward/backward pass in TensorFlow, every gradient explained.

    ``data`` is None (a synthetic batch from the seed), a path to an .npz file or a dict
    of arrays ``{"x": ..., "y": ..., "gru_1/h0": ...}``. ``chunks`` (K ≥ 2, YAML specs) adds
    the carry in numbers under ``report.carry``: per weight ``l2_full``, ``l2_truncated``,
    ``l2_carried``. Refused (ConfigError) when the
    resource guard estimates more memory than a quarter of RAM. ``spec`` may be the path of a
    saved ``model.keras``: Keras runs it (``keras_options`` as the CLI's flags, e.g.
    ``batch_size=8, loss="mse", training=True``).
    """
    from gradscope.guard import guard
    from gradscope.inspect import explain as _explain
    from gradscope.keras.archive import is_keras_file

    if is_keras_file(spec):
        from gradscope.errors import ConfigError
        from gradscope.keras.explain import explain as _explain_keras

        if chunks is not None:
            raise ConfigError("chunks is for YAML specs; a .keras model's recurrent layers are "
                              "not cut into chunks yet", where="chunks")
        return _explain_keras(_keras_job(spec, data, keras_options))
    spec = load_spec(spec) if isinstance(spec, str) else spec

    spec, batch = _with_data(spec, data)
    guard(spec, "explain", chunks=chunks)
    return _explain(spec, data=batch, chunks=chunks)


def check(spec: Spec | str, against: Any = None, chunks: int | None = None,
          data: Any = None, **options: Any) -> CheckReport | KerasCheckReport:
    """Verify every gradient with independent witnesses (see ``gradscope check --help``).

    ``against`` is ``"FILE.py:FUNC"`` or a callable ``FUNC(params, x, y, h0) -> dict``. The
    names it leaves out are in ``report.against_not_returned``; if it raises or returns no
    known name, ``ConfigError`` says where.
    """
    from gradscope.guard import guard
    from gradscope.keras.archive import is_keras_file
    from gradscope.witnesses import check as _check

    if is_keras_file(spec):
        from gradscope.keras.check import check as _check_keras

        keras_keys = {"batch_size", "time_steps", "loss", "training", "pad", "seed"}
        job = _keras_job(spec, data, {k: v for k, v in options.items() if k in keras_keys})
        return _check_keras(job, **{k: v for k, v in options.items() if k not in keras_keys})
    spec = load_spec(spec) if isinstance(spec, str) else spec

    spec, batch = _with_data(spec, data)
    guard(spec, "check")
    return _check(spec, against=against, chunks=chunks, data=batch, **options)


__all__ = ["__version__", "check", "explain", "load_spec", "shapes"]
