"""gradscope's Keras engine on a live model, with the loss ``fit`` minimises: what
``GradientFlow`` observes the model with, and its diagnosis the model's copy."""

from __future__ import annotations

from typing import Any

from gradscope.errors import ConfigError


def make_engine(model: Any, loss: str | None, data: list[str] | None = None) -> Any:
    """gradscope's Keras engine on the live model, with its compiled loss or ``loss``.
    ``data``: the dtypes of the user's inputs, where known (a subclassed model's graph is
    read with them: :func:`~gradscope.keras.subclassed.observed_graph`)."""
    from gradscope.keras.engine import KerasEngine
    from gradscope.keras.live import read_model
    from gradscope.keras.loss import output_names

    if loss is None and not getattr(model, "compiled", False):
        raise ConfigError(f"GradientFlow: model '{model.name}' is not compiled, so its loss is "
                          "unknown; pass GradientFlow(loss=NAME), the Keras loss your loop "
                          "minimises", where="loss")
    # As explain reads it: the loss fit minimises.
    graph, plan, _, _ = read_model(model, loss, data)
    return KerasEngine(model, output_names(graph), plan)
