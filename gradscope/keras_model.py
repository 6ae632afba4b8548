"""A saved Keras 3 model (``.keras``) as a gradscope spec plus its own weights.

Supported: Sequential or functional models made of GRU, LSTM, SimpleRNN and Dense layers
(Dense may be wrapped in TimeDistributed), in a chain, with the default activations and no
dropout. Everything else is listed in one clear error (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gradscope.errors import ConfigError
from gradscope.spec import Spec, spec_from_dict

RECURRENT = {"GRU": "gru", "LSTM": "lstm", "SimpleRNN": "simple_rnn"}
#: Settings that change the maths; gradscope's cells implement the defaults only.
DEFAULTS = {"activation": "tanh", "recurrent_activation": "sigmoid", "use_bias": True,
            "go_backwards": False, "stateful": False, "dropout": 0.0,
            "recurrent_dropout": 0.0, "unit_forget_bias": True}


def is_keras_file(source: str | None) -> bool:
    return source is not None and str(source).endswith(".keras")


def load_keras_model(path: str, batch_size: int | None = None, time_steps: int | None = None,
                     loss: str = "softmax_cross_entropy",
                     dtype: str = "float32") -> tuple[Spec, dict[str, np.ndarray]]:
    """The spec of a saved model (keras layout, the model's layer names) and its weights."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"{path}: file not found", where=path)
    if file.is_dir():
        raise ConfigError(f"{path}: is a directory; expected a .keras file", where=path)
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
    layers, unsupported = _chain(model)
    if unsupported:
        raise ConfigError(
            f"{path}: unsupported layers: {', '.join(unsupported)}; gradscope explains chains "
            "of GRU, LSTM, SimpleRNN and Dense (or TimeDistributed(Dense)) with default "
            "activations and no dropout",
            where=path,
        )
    input_shape = tuple(model.inputs[0].shape)
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
        "layers": [entry for entry, _ in layers], "loss": loss, "dtype": dtype,
    }, origin=path)
    params: dict[str, np.ndarray] = {}
    for (entry, layer), resolved in zip(layers, spec.layers, strict=True):
        names = (["kernel", "recurrent_kernel", "bias"] if entry["type"] != "dense"
                 else ["kernel", "bias"])
        for short, variable in zip(names, layer.weights, strict=True):
            params[f"{resolved.name}/{short}"] = np.asarray(variable.numpy(), dtype=dtype)
    return spec, params


def _chain(model: Any) -> tuple[list[tuple[dict[str, Any], Any]], list[str]]:
    """The layers as spec entries (with the Keras layer objects), and what is unsupported."""
    import keras

    entries: list[tuple[dict[str, Any], Any]] = []
    unsupported: list[str] = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        inner = layer.layer if isinstance(layer, keras.layers.TimeDistributed) else layer
        kind = type(inner).__name__
        config = inner.get_config()
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
            entries.append((entry, inner))
        elif kind == "Dense":
            if config.get("activation") != "linear" or not config.get("use_bias", True):
                unsupported.append(f"{layer.name} (Dense with activation "
                                   f"{config.get('activation')!r}; expected linear, with bias)")
                continue
            entries.append(({"type": "dense", "units": int(config["units"]),
                             "name": layer.name}, inner))
        else:
            unsupported.append(f"{layer.name} ({type(layer).__name__})")
    return entries, unsupported
