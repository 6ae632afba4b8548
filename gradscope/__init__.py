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
    from gradscope.report.models import ExplainReport, ShapesReport
    from gradscope.spec import Spec


def load_spec(source: Any = None) -> Spec:
    """A validated spec from a YAML path, a dict, or ``None`` (the embedded seed model)."""
    from gradscope.spec import load_spec as _load_spec

    return _load_spec(source)


def shapes(spec: Spec) -> ShapesReport:
    """The shape algebra of ``spec``, without TensorFlow."""
    from gradscope.inspect import shapes as _shapes

    return _shapes(spec)


def explain(spec: Spec, data: Any = None) -> ExplainReport:
    """One forward/backward pass in TensorFlow, every gradient explained."""
    from gradscope.inspect import explain as _explain

    return _explain(spec, data=data)


__all__ = ["__version__", "explain", "load_spec", "shapes"]
