"""gradscope: explain and verify the gradients of recurrent TensorFlow models.

Python API (the CLI is a thin layer over exactly these)::

    import gradscope
    spec = gradscope.load_spec("config.yaml")     # or a dict, or None for the seed model
    report = gradscope.explain(spec)
    report.to_dict()
    gradscope.explain("model.keras")              # a saved Keras model, run by Keras
    gradscope.explain(model, x=x, y=y, flow=True)  # a Keras model object, e.g. in a notebook

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


#: The options of a Keras model's batch and loss (as the CLI's flags).
KERAS_JOB_OPTIONS = ("batch_size", "time_steps", "loss", "training", "pad", "seed")


def _is_keras(source: Any) -> bool:
    from gradscope.keras.archive import is_keras_file
    from gradscope.keras.live import is_live_model

    return is_keras_file(source) or is_live_model(source)


def _keras_job(source: Any, data: Any, x: Any, y: Any, options: dict[str, Any]) -> Any:
    """A saved Keras model (read without TensorFlow) or a model object, with its batch.
    ``options``: batch_size, time_steps, loss, training, pad, seed (as the CLI's flags);
    ``data``: a path to an .npz named by inputs and outputs; ``x``/``y``: arrays."""
    from gradscope.errors import ConfigError
    from gradscope.keras.explain import prepare
    from gradscope.keras.live import is_live_model

    unknown = sorted(set(options) - set(KERAS_JOB_OPTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]}=: not an option for a Keras model; expected "
                          f"{', '.join(KERAS_JOB_OPTIONS)}", where=unknown[0])
    if data is not None and not isinstance(data, str | PathLike):
        raise ConfigError("data=: for a Keras model, the path of an .npz file; pass arrays "
                          "as x= and y=", where="data")
    return prepare(source if is_live_model(source) else str(source),
                   data=None if data is None else str(data), x=x, y=y, **options)


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


def explain(spec: Any, data: Any = None, *, x: Any = None, y: Any = None, flow: bool = False,
            jacobians: bool = False, **keras_options: Any) -> ExplainReport | KerasExplainReport:
    """One forward/backward pass in TensorFlow, every gradient explained.

    ``spec`` is a YAML path, a dict or a Spec: ``data`` is then None (a synthetic batch from
    the seed), a path to an .npz file or a dict of arrays ``{"x": ..., "y": ..., "gru_1/h0":
    ...}``. Refused (ConfigError) when the resource guard estimates more memory than a quarter
    of RAM.

    ``spec`` may instead be a Keras model: the path of a saved ``model.keras``, or the model
    object itself (Sequential or functional). Keras runs it, with:

    - ``x``: the inputs, NumPy or TensorFlow arrays: one array for a single input, a list in
      the model's input order, or a dict by input name (a float input is cast to its Input's
      dtype, as Keras does). ``y``: the targets, likewise by output; None: synthetic targets
      that match the loss. Without ``x``: a synthetic batch (or ``data``, an .npz path).
    - ``keras_options`` as the CLI's flags: ``batch_size``, ``time_steps`` (synthetic batch),
      ``loss`` (a Keras loss name; default: the compiled loss, else inferred from the output),
      ``training`` (dropout and batch norm in training mode, seeded), ``pad``, ``seed``.
    - ``flow``: ‖∂L/∂h_t‖ per step of every recurrent call; ``jacobians``: ∂h_T/∂h_0.

    A shape or name that does not fit the model is a ConfigError/DataError naming the array
    (``x['tokens']``, ``y[1]``).
    """
    from gradscope.guard import guard
    from gradscope.inspect import explain as _explain

    if _is_keras(spec):
        from gradscope.keras.explain import explain as _explain_keras

        return _explain_keras(_keras_job(spec, data, x, y, keras_options), flow=flow,
                              jacobians=jacobians)
    if x is not None or y is not None:
        from gradscope.errors import ConfigError

        raise ConfigError("x= and y= are for a Keras model; for a YAML spec pass "
                          "data={'x': ..., 'y': ...}", where="x")
    spec = load_spec(spec) if isinstance(spec, str) else spec

    spec, batch = _with_data(spec, data)
    guard(spec, "explain")
    return _explain(spec, data=batch)


def check(spec: Any, against: Any = None, chunks: int | None = None,
          data: Any = None, *, x: Any = None, y: Any = None,
          **options: Any) -> CheckReport | KerasCheckReport:
    """Verify every gradient with independent witnesses (see ``gradscope check --help``).

    ``against`` is ``"FILE.py:FUNC"`` or a callable ``FUNC(params, x, y, h0) -> dict``. The
    names it leaves out are in ``report.against_not_returned``; if it raises or returns no
    known name, ``ConfigError`` says where.

    ``spec`` may be a Keras model, a ``model.keras`` path or the model object, with ``x``,
    ``y`` and the options of :func:`explain` (plus ``directions``, ``rtol``, ``atol``): finite
    differences and the NumPy reference on a float64 copy of the model with the same weights.
    """
    from gradscope.guard import guard
    from gradscope.witnesses import check as _check

    if _is_keras(spec):
        from gradscope.keras.check import check as _check_keras

        job = _keras_job(spec, data, x, y,
                         {k: v for k, v in options.items() if k in KERAS_JOB_OPTIONS})
        return _check_keras(job, **{k: v for k, v in options.items()
                                    if k not in KERAS_JOB_OPTIONS})
    if x is not None or y is not None:
        from gradscope.errors import ConfigError

        raise ConfigError("x= and y= are for a Keras model; for a YAML spec pass "
                          "data={'x': ..., 'y': ...}", where="x")
    spec = load_spec(spec) if isinstance(spec, str) else spec

    spec, batch = _with_data(spec, data)
    guard(spec, "check")
    return _check(spec, against=against, chunks=chunks, data=batch, **options)


__all__ = ["__version__", "check", "explain", "load_spec", "shapes"]
