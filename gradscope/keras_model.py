"""A saved Keras 3 model (``.keras``) as a gradscope spec plus its own weights.

Supported: single-input, single-output chains of GRU, LSTM, SimpleRNN and Dense layers (Dense
may be wrapped in TimeDistributed), with the default activations and no dropout. Everything else
is refused from ``config.json`` alone, before TensorFlow is imported (exit 2): a model that is
not read exactly is never explained.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.errors import ConfigError
from gradscope.keras.archive import is_keras_file
from gradscope.keras.graph import LayerNode, plain_chain, read_graph, refuse_code
from gradscope.spec import Spec, spec_from_dict

__all__ = ["is_keras_file", "load_keras_model"]

RECURRENT = {"GRU": "gru", "LSTM": "lstm", "SimpleRNN": "simple_rnn"}
#: Settings that change the maths; gradscope's cells implement the defaults only.
DEFAULTS = {"activation": "tanh", "recurrent_activation": "sigmoid", "use_bias": True,
            "go_backwards": False, "stateful": False, "dropout": 0.0,
            "recurrent_dropout": 0.0, "unit_forget_bias": True}


def load_keras_model(path: str, batch_size: int | None = None, time_steps: int | None = None,
                     loss: str = "softmax_cross_entropy",
                     dtype: str = "float32") -> tuple[Spec, dict[str, np.ndarray]]:
    """The spec of a saved model (keras layout, the model's layer names) and its weights."""
    graph = read_graph(path)
    refuse_code(graph)
    layers, reason = plain_chain(graph)
    if reason is not None:
        raise ConfigError(
            f"{path}: not a single chain of layers ({reason}); this version of gradscope reads "
            "only one-input, one-output chains of GRU, LSTM, SimpleRNN and Dense layers, and "
            "refuses other models rather than misread them", where=path)
    entries, unsupported = _chain(layers)
    if unsupported:
        raise ConfigError(
            f"{path}: unsupported layers: {', '.join(unsupported)}; gradscope explains chains "
            "of GRU, LSTM, SimpleRNN and Dense (or TimeDistributed(Dense)) with default "
            "activations and no dropout",
            where=path,
        )
    input_layer = graph.layer(graph.inputs[0].layer)
    input_shape = tuple(input_layer.config.get("batch_shape") or ())
    if len(input_shape) != 3:
        raise ConfigError(f"{path}: the model's input has shape {input_shape}; expected "
                          "(batch, time, features)", where=path)
    _, model_steps, features = input_shape
    steps = model_steps if model_steps is not None else time_steps
    if steps is None:
        raise ConfigError(f"{path}: the model's time dimension is None; pass --time-steps",
                          where="--time-steps")
    if time_steps is not None and model_steps is not None and time_steps != model_steps:
        raise ConfigError(f"--time-steps {time_steps} differs from the model's input "
                          f"({model_steps} steps)", where="--time-steps")
    spec = spec_from_dict({
        "input_size": int(features), "time_steps": int(steps),
        "batch_size": batch_size or 32, "layout": "keras",
        "layers": entries, "loss": loss, "dtype": dtype,
    }, origin=path)

    from gradscope._tf import import_tensorflow, native_stderr_silenced

    import_tensorflow()
    import keras

    try:
        with native_stderr_silenced():
            model = keras.saving.load_model(path, compile=False, safe_mode=True)
    except Exception as exc:  # keras raises many kinds; all mean "not a model we can read"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path}: cannot load as a Keras 3 model: {first}", where=path) \
            from None
    params: dict[str, np.ndarray] = {}
    for entry, resolved in zip(entries, spec.layers, strict=True):
        layer = model.get_layer(entry["name"])
        inner = layer.layer if isinstance(layer, keras.layers.TimeDistributed) else layer
        names = (["kernel", "recurrent_kernel", "bias"] if entry["type"] != "dense"
                 else ["kernel", "bias"])
        for short, variable in zip(names, inner.weights, strict=True):
            params[f"{resolved.name}/{short}"] = np.asarray(variable.numpy(), dtype=dtype)
    return spec, params


def _chain(layers: list[LayerNode]) -> tuple[list[dict[str, Any]], list[str]]:
    """The layers as spec entries, and what is unsupported, from their saved configs."""
    entries: list[dict[str, Any]] = []
    unsupported: list[str] = []
    for layer in layers:
        inner = layer.inner if layer.class_name == "TimeDistributed" else layer
        kind = inner.class_name if inner is not None else layer.class_name
        config = inner.config if inner is not None else {}
        if kind in RECURRENT:
            wrong = [f"{key}={config[key]!r}" for key, value in DEFAULTS.items()
                     if key in config and config[key] != value]
            if wrong:
                unsupported.append(f"{layer.name} ({kind} with {', '.join(wrong)})")
                continue
            entry: dict[str, Any] = {"type": RECURRENT[kind], "units": int(config["units"]),
                                     "name": layer.name,
                                     "return_sequences": bool(config["return_sequences"])}
            if kind == "GRU":
                entry["reset_after"] = bool(config.get("reset_after", True))
            entries.append(entry)
        elif kind == "Dense":
            if config.get("activation") != "linear" or not config.get("use_bias", True):
                unsupported.append(f"{layer.name} (Dense with activation "
                                   f"{config.get('activation')!r}; expected linear, with bias)")
                continue
            entries.append({"type": "dense", "units": int(config["units"]), "name": layer.name})
        else:
            unsupported.append(f"{layer.name} ({layer.class_name})")
    return entries, unsupported
