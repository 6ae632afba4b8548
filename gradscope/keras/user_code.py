"""The user's own code for a saved model: ``--import MODULE_OR_FILE`` and ``--unsafe``.

A ``.keras`` file names its custom classes but holds none of their code, and gradscope never
imports code on its own: such a file is refused before TensorFlow loads, naming the
``--import`` to add. With it, the user's modules are imported first, as the user's own
program would import them, and the file loads under ``safe_mode=True`` into a model object,
run as any other. ``--unsafe`` (``safe_mode=False``) runs the Python code stored in the file
itself: only for files one trusts. The rest: docs/keras.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from gradscope.errors import ConfigError, first_line, imports_given
from gradscope.keras.graph import fresh_names
from gradscope.keras.live import LOADED_FROM
from gradscope.preflight import is_a_path, missing_code, no_module


def import_user_code(sources: Iterable[str]) -> list[ModuleType]:
    """Import each of ``sources`` (a dotted module name, or a path to a ``.py`` file) once,
    in order. ConfigError (exit 2) names the one that fails, and why."""
    modules = []
    for source in sources:
        option = imports_given(source)
        missing = missing_code(source)
        if missing is not None:
            raise ConfigError(missing, where="--import")
        if is_a_path(source):
            path = Path(source)
            name = path.stem
            if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(
                    path.resolve()):
                modules.append(sys.modules[name])
                continue
            spec = importlib.util.spec_from_file_location(name, path.resolve())
            if spec is None or spec.loader is None:
                raise ConfigError(f"{option}: Python cannot import it as a module",
                                  where="--import")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # the user's code raises what it raises
                del sys.modules[name]
                raise ConfigError(f"{option}: importing it raised {type(exc).__name__}: "
                                  f"{first_line(exc)}", where="--import") from None
            modules.append(module)
            continue
        try:
            modules.append(importlib.import_module(source))
        except ModuleNotFoundError as exc:
            raise ConfigError(no_module(source, str(exc.name)), where="--import") from None
        except Exception as exc:  # noqa: BLE001  (the user's code raises what it raises)
            raise ConfigError(f"{option}: importing it raised {type(exc).__name__}: "
                              f"{first_line(exc)}", where="--import") from None
    return modules


def load_user_model(path: str | Path, imports: Iterable[str] = (), unsafe: bool = False) -> Any:
    """The saved model as a Keras model object, after importing ``imports``; ``safe_mode`` is
    Keras' default, True, unless ``unsafe``. ConfigError (exit 2) if Keras cannot load it."""
    from gradscope.keras.archive import read_config

    config = read_config(path)  # a file that is not a Keras model is refused as without --import
    from gradscope._tf import import_tensorflow, native_stderr_silenced

    # TensorFlow first, quietly: the user's modules import Keras, and with it TensorFlow.
    # Not started: a module may configure it (tf.config) as the user's program would.
    import_tensorflow(start=False)
    import keras

    # A module beside the model, in the current folder, imports as under `python -m`.
    here = str(Path.cwd())
    sys.path.insert(0, here)
    try:
        import_user_code(imports)
    finally:
        if here in sys.path:
            sys.path.remove(here)
    try:
        with native_stderr_silenced(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            with fresh_names():
                model = keras.saving.load_model(str(path), compile=True, safe_mode=not unsafe)
    except Exception as exc:  # noqa: BLE001  (Keras raises many kinds; all mean "not loaded")
        missing = _class_not_found(exc)
        if missing is not None:
            imported = imports_given(*imports) if imports else ""
            module = _module_of(config, missing)
            raise ConfigError(
                f"{path}: Keras could not find the class '{missing}'"
                + (f" (module {module})" if module else "") + " the file names"
                + (f", after {imported}" if imported else "")
                + ": import the module that defines and registers it ("
                + imports_given(module or "MODULE") + ", or "
                + imports_given("path/to/its_file.py") + ")", where=str(path)) from None
        hint = "" if unsafe else (
            f"; a class it names may need {imports_given('MODULE')} (the module that "
            "registers it)")
        raise ConfigError(f"{path}: Keras cannot load it{'' if unsafe else ' safely'}: "
                          f"{first_line(exc)}{hint}", where=str(path)) from None
    # Reports name the file (a hook on the object, not its state: Keras does not track it).
    object.__setattr__(model, LOADED_FROM, str(path))
    return model


def _module_of(config: Any, name: str) -> str | None:
    """The module the serialised config gives for the class ``name`` (None: not said)."""
    if isinstance(config, dict):
        names = (config.get("class_name"), str(config.get("registered_name", "")))
        module = config.get("module")
        if isinstance(module, str) and (name in names or names[1].endswith(f">{name}")):
            return module if module not in ("__main__", "builtins") else None
        found = (_module_of(value, name) for value in config.values())
    elif isinstance(config, list):
        found = (_module_of(value, name) for value in config)
    else:
        return None
    return next((module for module in found if module), None)


def _class_not_found(exc: BaseException) -> str | None:
    """The class Keras says it could not locate, anywhere in ``exc``'s chain (its message
    otherwise holds the whole serialised config, on one line), or None."""
    import re

    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        match = re.search(r"Could not locate (?:class|function) '([^']+)'", str(found))
        if match:
            return match.group(1)
        found = found.__cause__ or found.__context__
    return None


__all__ = ["import_user_code", "load_user_model"]
