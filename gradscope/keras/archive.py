"""Read a saved Keras 3 model (``.keras``, a zip archive) without TensorFlow or Keras.

Only ``config.json`` and ``metadata.json`` are read, as JSON: nothing in the file is executed,
and no Python object is built from it.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from gradscope.errors import ConfigError

#: A config.json larger than this is not a model gradscope reads (a model of a few thousand
#: layers is a few MiB).
MAX_CONFIG_BYTES = 64 << 20

#: The weights of a model saved by Keras 3: model.weights.h5 (the default), or model.weights.npz
#: (``weights_format="npz"``). Keras cannot load a model without one of them.
WEIGHTS_FILES = ("model.weights.h5", "model.weights.npz")


def is_keras_file(source: object) -> bool:
    return isinstance(source, str | Path) and str(source).endswith(".keras")


def read_config(path: str | Path) -> dict[str, Any]:
    """The model's ``config.json`` as a dict, with ``compile_config`` if it was saved.

    An archive without the model's weights (no model.weights.h5) is refused here, from the
    zip's list of files, before TensorFlow is imported."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"{path}: file not found", where=str(path))
    if file.is_dir():
        raise ConfigError(f"{path}: is a directory; expected a .keras file", where=str(path))
    try:
        with zipfile.ZipFile(file) as archive:
            try:
                info = archive.getinfo("config.json")
            except KeyError:
                raise ConfigError(f"{path}: the archive has no config.json; expected a model "
                                  "saved by Keras 3 with model.save('model.keras')",
                                  where=str(path)) from None
            if info.file_size > MAX_CONFIG_BYTES:
                raise ConfigError(f"{path}: config.json is {info.file_size} bytes; expected at "
                                  f"most {MAX_CONFIG_BYTES}", where=str(path))
            raw = archive.read(info)
            names = archive.namelist()
    except zipfile.BadZipFile:
        # Found tried as a new user would: model.save of a model Keras cannot serialise
        # raises, and leaves an empty file behind.
        empty = file.stat().st_size == 0
        raise ConfigError(f"{path}: " + ("the file is empty (0 bytes: did model.save raise "
                                         "while writing it?)" if empty else
                                         "not a zip archive")
                          + "; expected a model saved by Keras 3 with "
                          "model.save('model.keras')", where=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}", where=str(path)) \
            from None
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: config.json is not valid JSON: {exc}", where=str(path)) \
            from None
    if not isinstance(config, dict) or "class_name" not in config:
        raise ConfigError(f"{path}: config.json does not describe a Keras model; expected an "
                          "object with class_name and config", where=str(path))
    if not any(name in names for name in WEIGHTS_FILES):
        found = ", ".join(sorted(names)[:6]) + (", …" if len(names) > 6 else "")
        raise ConfigError(f"{path}: the file has no weights: model.weights.h5 is missing from "
                          f"the archive (it holds {found}); expected a model saved with its "
                          "weights by Keras 3 with model.save('model.keras')", where=str(path))
    return config
