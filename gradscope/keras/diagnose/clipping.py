"""The compiled optimizer's gradient clipping, read from the model's compile config (a saved
file's, without TensorFlow), and what it does to one batch's gradients: Keras' own rule
(keras/src/optimizers/base_optimizer.py ``_clip_gradients``): clipnorm per tensor first, else
global_clipnorm, else clipvalue per element.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.formats import number
from gradscope.report.models import Clipping

SETTINGS = ("clipnorm", "global_clipnorm", "clipvalue")


def optimizer_config(compile_config: dict[str, Any] | None,
                     model: Any = None) -> tuple[str | None, dict[str, Any]]:
    """The optimizer's class name and its config (empty: not compiled, or none known). A
    model object compiled under a mixed-precision policy holds Keras' LossScaleOptimizer
    around the one compiled (whose clipping applies, to the unscaled gradient): both are
    named, as explain names them."""
    optimizer = getattr(model, "optimizer", None) if model is not None else None
    wrapper = type(optimizer).__name__ if optimizer is not None else ""
    inner = getattr(optimizer, "inner_optimizer", None) if wrapper == "LossScaleOptimizer" else None
    found = (compile_config or {}).get("optimizer")
    if isinstance(found, dict):
        name, config = found.get("class_name"), dict(found.get("config") or {})
    elif isinstance(found, str):
        name, config = found, {}
    elif optimizer is not None and hasattr(optimizer, "get_config"):
        chosen = inner if inner is not None else optimizer
        name, config = type(chosen).__name__, dict(chosen.get_config())
    else:
        return None, {}
    if inner is not None and name != wrapper:
        name = f"{wrapper}({type(inner).__name__})"
    return name, config


def clipping(compile_config: dict[str, Any] | None, gradients: dict[str, Any],
             model: Any = None) -> Clipping:
    """What the optimizer's clipping does to ``gradients`` (variable path → array or None)."""
    name, config = optimizer_config(compile_config, model)
    arrays = {path: np.asarray(g, np.float64) for path, g in gradients.items() if g is not None}
    norms = {path: float(np.linalg.norm(g)) for path, g in arrays.items()}
    total = float(np.sqrt(sum(n * n for n in norms.values())))
    chosen = _setting(config)
    if name is None:
        return Clipping(optimizer=None, setting=None,
                        effect="the model is not compiled with an optimizer: no clipping")
    if not np.isfinite(total):
        # Keras scales by c/‖g‖ (or clips each entry): a NaN stays NaN, and Inf/Inf is NaN.
        return Clipping(optimizer=name, setting=None if chosen is None else
                        f"{chosen[0]}={chosen[1]:g}",
                        effect="this batch's gradient is not finite: no clipping makes it "
                               "finite, and the update would hold NaN")
    if chosen is None:
        return Clipping(optimizer=name, setting=None,
                        effect=f"{name} clips nothing: this batch's gradient goes to the "
                               f"update as it is (global norm {number(total)})")
    key, value = chosen
    setting = f"{key}={value:g}"
    if key == "clipnorm":
        scaled = {p: value / n for p, n in norms.items() if n > value}
        if not scaled:
            effect = (f"no tensor's gradient norm exceeds {value:g} (the largest is "
                      f"{number(max(norms.values(), default=0.0))}): nothing is clipped")
        else:
            worst = min(scaled, key=lambda p: scaled[p])
            effect = (f"{len(scaled)} of {len(norms)} tensors scaled down to norm {value:g}, "
                      f"the most {worst} (×{number(scaled[worst])}, from "
                      f"{number(norms[worst])})")
    elif key == "global_clipnorm":
        effect = (f"the global norm {number(total)} is scaled by ×{number(value / total)} "
                  f"to {value:g}" if total > value else
                  f"the global norm {number(total)} is within {value:g}: nothing is clipped")
    else:
        clipped = sum(int(np.sum(np.abs(g) > value)) for g in arrays.values())
        count = sum(int(g.size) for g in arrays.values())
        effect = (f"{clipped} of {count} gradient values are cut to ±{value:g}"
                  if clipped else f"no gradient value exceeds {value:g}: nothing is clipped")
    return Clipping(optimizer=name, setting=setting, effect=effect)


def after_clipping(compile_config: dict[str, Any] | None, gradients: dict[str, Any],
                   model: Any = None) -> tuple[dict[str, np.ndarray], str | None]:
    """``gradients`` (variable path → array or None) as the compiled optimizer's clipping
    leaves them, by Keras' rule (``_clip_gradients``: ``clip_by_norm`` per tensor, else
    ``clip_by_global_norm``, else each entry to ±c), and the setting that did it (None: the
    optimizer clips nothing, or there is none)."""
    _, config = optimizer_config(compile_config, model)
    arrays = {path: np.asarray(g, np.float64) for path, g in gradients.items() if g is not None}
    chosen = _setting(config)
    if chosen is None:
        return arrays, None
    key, value = chosen
    if key == "clipnorm":
        clipped = {p: g * (value / max(float(np.linalg.norm(g)), value))
                   for p, g in arrays.items()}
    elif key == "global_clipnorm":
        total = float(np.sqrt(sum(float(np.sum(g * g)) for g in arrays.values())))
        clipped = {p: g * (value / max(total, value)) for p, g in arrays.items()}
    else:
        clipped = {p: np.clip(g, -value, value) for p, g in arrays.items()}
    return clipped, f"{key}={value:g}"


def _setting(config: dict[str, Any]) -> tuple[str, float] | None:
    """The clipping setting Keras applies (it takes one), and its value; None: none."""
    return next(((key, float(config[key])) for key in SETTINGS
                 if config.get(key) and float(config[key]) > 0), None)


def global_norm(gradients: dict[str, Any]) -> float | None:
    """√Σ‖g‖² over every gradient given (None when there is none, or it is not finite)."""
    squares = [float(np.sum(np.asarray(g, np.float64) ** 2)) for g in gradients.values()
               if g is not None]
    if not squares:
        return None
    total = float(np.sqrt(sum(squares)))
    return total if np.isfinite(total) else None
