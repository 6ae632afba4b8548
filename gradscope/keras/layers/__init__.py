"""One module per Keras layer type: its algebra (weight shapes with formulas in the user's
numbers, what their rows and columns hold) and what it does to the gradient.

Adding a layer type means adding one module here: a function of the layer's facts that
returns its two :class:`~gradscope.keras.layers.base.Sentences`, decorated with ``@explains``,
for a layer without weights; else a subclass of
:class:`~gradscope.keras.layers.base.LayerExplainer` decorated with ``@register``. Every module
of this package is imported by :func:`explainer_for`. Pure Python: no TensorFlow.
"""

from __future__ import annotations

import importlib
import pkgutil

from gradscope.keras.layers.base import (
    REGISTRY,
    LayerExplainer,
    LayerFacts,
    Sentences,
    WeightNote,
    explains,
    register,
)

_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")
    _loaded = True


def explainer_for(class_name: str, module: str | None = None) -> LayerExplainer | None:
    """The explainer registered for a Keras class name, or None (no derivation).

    ``module`` is the config entry's own: a ``keras.ops`` call in a functional model has module
    ``keras.src.ops.*`` and class names that layers share (``x + y`` is an ``Add`` too), so it is
    looked up among the operations (see :mod:`gradscope.keras.layers.ops`).
    """
    _load_all()
    if module is not None and module.startswith("keras.src.ops"):
        from gradscope.keras.layers.ops import op_key

        return REGISTRY.get(op_key(class_name))
    return REGISTRY.get(class_name)


def deriving_explainer(class_name: str, module: str | None,
                       facts: LayerFacts) -> LayerExplainer | None:
    """The explainer of this layer call if it derives the layer's weights, else None (the
    layer is then listed with its real gradients and "no derivation for this layer type")."""
    explainer = explainer_for(class_name, module)
    return explainer if explainer is not None and explainer.derives(facts) else None


def sized_weights(explainer: LayerExplainer | None,
                  facts: LayerFacts) -> list[WeightNote] | None:
    """The weights ``explainer`` derives for this call, or None where the algebra cannot size
    them from what the config says (no explainer: no weights derived, an empty list)."""
    if explainer is None:
        return []
    try:
        return list(explainer.weights(facts))
    except (KeyError, ValueError, TypeError):
        return None


def known_layers() -> list[str]:
    _load_all()
    return sorted(REGISTRY)


__all__ = ["LayerExplainer", "LayerFacts", "Sentences", "WeightNote", "deriving_explainer",
           "explainer_for", "explains", "known_layers", "register", "sized_weights"]
