"""gradscope: explain and verify the gradients of recurrent TensorFlow models.

Python API (the CLI is a thin layer over exactly these)::

    import gradscope
    spec = gradscope.load_spec("config.yaml")     # or a dict, or None for the seed model
    report = gradscope.explain(spec)
    report.to_dict()

Importing gradscope does not import TensorFlow; ``explain`` does, quietly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gradscope.report.models import CheckReport, ExplainReport, ShapesReport
    from gradscope.spec import Spec


def load_spec(source: Any = None) -> Spec:
    """A validated spec from a YAML path, a dict, or ``None`` (the embedded seed model)."""
    from gradscope.spec import load_spec as _load_spec

    return _load_spec(source)


def shapes(spec: Spec) -> ShapesReport:
    """The shape algebra of ``spec``, without TensorFlow."""
    from gradscope.inspect import shapes as _shapes

    return _shapes(spec)


def _with_data(spec: Spec, data: Any) -> tuple[Spec, Any]:
    """``data``: None (synthetic), a path to an .npz, or a dict of arrays (x, y, h0s)."""
    if data is None:
        return spec, None
    from gradscope.data import load_batch, validate_batch

    if isinstance(data, dict):
        return validate_batch(spec, data, origin="the data")
    return load_batch(spec, data=data)


def explain(spec: Spec, data: Any = None) -> ExplainReport:
    """One forward/backward pass in TensorFlow, every gradient explained.

    ``data`` is None (a synthetic batch from the seed), a path to an .npz file or a dict
    of arrays ``{"x": ..., "y": ..., "gru_1/h0": ...}``. Refused (ConfigError) when the
    resource guard estimates more memory than a quarter of RAM.
    """
    from gradscope.guard import guard
    from gradscope.inspect import explain as _explain

    spec, batch = _with_data(spec, data)
    guard(spec, "explain")
    return _explain(spec, data=batch)


def check(spec: Spec, against: Any = None, chunks: int | None = None,
          data: Any = None, **options: Any) -> CheckReport:
    """Verify every gradient with independent witnesses (see ``gradscope check --help``).

    ``against`` is ``"FILE.py:FUNC"`` or a callable ``FUNC(params, x, y, h0) -> dict``. The
    names it leaves out are in ``report.against_not_returned``; if it raises or returns no
    known name, ``ConfigError`` says where.
    """
    from gradscope.guard import guard
    from gradscope.witnesses import check as _check

    spec, batch = _with_data(spec, data)
    guard(spec, "check")
    return _check(spec, against=against, chunks=chunks, data=batch, **options)


__all__ = ["__version__", "check", "explain", "load_spec", "shapes"]
