"""A Keras model object in memory (a notebook, a training script), read as gradscope reads a
``.keras`` file, so that from there on both go one way.

The graph is what Keras would write to a saved file's ``config.json`` (:func:`model_config`).
The user's layer code already runs in the user's own process, so Lambda layers and custom
classes are not refused as they are in a file. What gradscope cannot vouch for is a custom
class's meaning: it is named with its module (``__main__.GRU``), so that it never matches the
explanation of a built-in layer that shares its class name, and it is listed with its real
gradient and "no derivation for this layer type".
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from gradscope.errors import ConfigError, first_line
from gradscope.keras.graph import (
    ModelGraph,
    graph_from_config,
    qualify_custom,
    read_graph,
    refuse_code,
    saved_name,
)
from gradscope.keras.loss import LossPlan, plan_loss

#: Keras' own model classes (a subclass of these written by the user is not one of them).
MODEL_CLASSES = {"Functional", "Sequential", "Model"}


def is_live_model(value: object) -> bool:
    """Whether ``value`` is a Keras 3 model object (without importing Keras for anything else).
    """
    return any(cls.__module__.startswith("keras.") and cls.__name__ == "Model"
               for cls in type(value).__mro__)


#: The attribute ``gradscope.load_model`` leaves on a model it loaded: the file it came from.
LOADED_FROM = "_gradscope_loaded_from"


def model_label(model: Any) -> str:
    """How messages and reports name a model object: the file ``gradscope.load_model`` read it
    from, else "in memory"."""
    loaded = getattr(model, LOADED_FROM, None)
    if loaded:
        return f"{loaded} (model '{getattr(model, 'name', 'model')}', loaded with your code)"
    return f"model '{getattr(model, 'name', 'model')}' (in memory)"


def is_builtin(module: str | None) -> bool:
    return module is not None and (module == "keras" or module.startswith("keras."))


def model_config(model: Any) -> dict[str, Any]:
    """What ``model.save('m.keras')`` would write to config.json, as a dict. A subclass of a
    functional model that keeps its ``call`` is read as the functional model it is."""
    label = model_label(model)
    if not getattr(model, "built", False) or not getattr(model, "inputs", None):
        raise ConfigError(f"{label}: is not built (no input shape yet); give it a "
                          "keras.Input or call it once on a batch", where=label)
    from keras.saving import serialize_keras_object
    from keras.src.models.functional import Functional
    from keras.src.saving.serialization_lib import ObjectSharingScope

    # What a saved file's config.json holds: serialised inside an ObjectSharingScope, then
    # through JSON and back (as saving_lib._serialize_model_as_json does), so that a model
    # object and a file are read in one format. Keras is already imported when a model object
    # exists, so this adds no import.
    try:
        with ObjectSharingScope():
            serialized = serialize_keras_object(model)
            if type(model).__name__ not in MODEL_CLASSES or not is_builtin(
                    type(model).__module__):
                # A functional subclass: its graph is the functional one.
                functional = getattr(model, "_functional", None) or model
                serialized = {**serialized, "class_name": "Functional", "module": "keras",
                              "registered_name": None,
                              "config": Functional.get_config(functional)}
        config = json.loads(json.dumps(serialized))
        _name_unnamed(model, config)
    except Exception as exc:  # get_config() of a custom layer may raise anything
        first = first_line(exc)
        raise ConfigError(f"{label}: Keras cannot serialise its config, so gradscope cannot "
                          f"read its graph exactly: {first}", where=label) from None
    qualify_custom(config)
    return config


def _name_unnamed(model: Any, config: dict[str, Any]) -> None:
    """A Sequential's layer saved without a name (its ``__init__`` takes ``**kw``, not
    ``**kwargs``, and it has no ``get_config``) is named as the object is."""
    if config.get("class_name") != "Sequential":
        return
    entries = config["config"].get("layers") or []
    layers = list(getattr(model, "_layers", None) or [])  # with its InputLayer, as saved
    if len(entries) != len(layers):
        return
    for entry, layer in zip(entries, layers, strict=True):
        if not saved_name(entry):
            entry["name"] = layer.name


def read_live_graph(model: Any, data: list[str] | None = None) -> ModelGraph:
    """The graph of a model object; ConfigError (exit 2) when it cannot be read exactly. A
    subclassed model's is read from one symbolic call (:mod:`~gradscope.keras.subclassed`;
    ``data``: the dtypes of the user's inputs, where known)."""
    from gradscope.keras.subclassed import is_subclassed, observed_graph

    if is_subclassed(model):
        return observed_graph(model, model_label(model), data)
    config = model_config(model)
    return graph_from_config(config, model_label(model), what="its config")


def read_model(source: Any, loss: str | None = None, data: list[str] | None = None,
               ) -> tuple[ModelGraph, LossPlan, str, Any]:
    """A saved model's graph (its code refused, no TensorFlow) or a model object's, with the
    loss gradscope will use: ``(graph, plan, label, model)``, where ``label`` names the model
    in reports and ``model`` is the object (None for a file). ``data``: see
    :func:`read_live_graph`."""
    model = source if is_live_model(source) else None
    if model is not None:
        graph = read_live_graph(model, data)
        label = model_label(model)
    else:
        graph = read_graph(source)
        refuse_code(graph)
        label = str(source)
    plan = plan_loss(graph, loss)
    if model is not None and loss is None and overrides_compute_loss(model):
        return graph, replace(plan, custom_compute_loss=type(model).__name__), label, model
    if model is not None and plan.source == "compiled" and not getattr(model, LOADED_FROM,
                                                                       None):
        # A model object compiled in memory; one Keras loaded from a file (--import) has the
        # loss saved with it, said as without --import.
        how = "the model's compiled loss"
        plan = replace(plan, compiled_how=how,
                       outputs=tuple(replace(o, rule=how) for o in plan.outputs))
    return graph, plan, label, model


def overrides_compute_loss(model: Any) -> bool:
    """Whether the model's class writes its own ``compute_loss`` (fit calls it)."""
    from keras.src.trainers.trainer import Trainer

    return getattr(type(model), "compute_loss", None) is not Trainer.compute_loss
