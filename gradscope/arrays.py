"""The user's array files (.npz, .npy), read safely (``allow_pickle=False``) and checked, for
both wings: a missing file, a pickled array or a non-finite value is a one-line error naming
the file or the array."""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradscope.errors import ConfigError, DataError, GradscopeError


@dataclass(frozen=True)
class DataFiles:
    """The user's batch as files (``--data``, or ``--x`` with ``--y``), not read yet."""

    data: str | None = None
    x: str | None = None
    y: str | None = None

    def given(self) -> bool:
        return any((self.data, self.x, self.y))

    def check(self) -> None:
        """The combination is one the commands take, and each file exists."""
        if self.given():
            check_data_files(self.data, self.x, self.y)


def as_data_files(data: Any) -> Any:
    """``data`` as the API takes it: None, an .npz path (as :class:`DataFiles`), a
    :class:`DataFiles` (the CLI's ``--data`` or ``--x`` with ``--y``), or a dict of arrays
    (YAML specs). Files are checked to exist before anything loads."""
    if isinstance(data, str | os.PathLike):
        data = DataFiles(data=str(data))
    if isinstance(data, DataFiles):
        data.check()
        return data if data.given() else None
    if data is None or isinstance(data, dict):
        return data
    keras = "; a Keras model's arrays go by keyword, x= and y=" if hasattr(data, "shape") else ""
    raise ConfigError(f"data=: got an object of type {type(data).__name__}; expected the path "
                      f"of an .npz file or, for a YAML spec, a dict of arrays{keras}",
                      where="data")


def check_data_files(data: str | os.PathLike[str] | None = None,
                     x: str | os.PathLike[str] | None = None,
                     y: str | os.PathLike[str] | None = None) -> None:
    """``data`` alone or ``x`` with ``y``, each an existing file; nothing is read yet.

    The CLI calls this before it loads the model (a saved Keras model needs TensorFlow), so
    a mistyped file name costs no TensorFlow import.
    """
    if data is not None and (x is not None or y is not None):
        raise DataError("give either --data FILE.npz or --x and --y, not both", where="--data")
    if data is None and (x is None or y is None):
        raise DataError("--x and --y go together: give both (a YAML config's; a .keras model "
                        "takes --data FILE.npz)", where="--x" if y is None else "--y")
    if data is not None:
        open_checked(Path(data), "an .npz file")
    for path in (x, y):
        if path is not None:
            open_checked(Path(path), "an .npy file")


def check_numeric(name: str, value: np.ndarray, finite: bool = True) -> None:
    """Real numbers, and (``finite``) no NaN or Inf among them: a Keras model's inputs and
    targets may hold them, and explain and check then say where they lead."""
    if value.dtype.kind not in "fiub":
        raise DataError(
            f"{name} has dtype {value.dtype}; expected real numbers (float or int)", where=name
        )
    if finite and value.dtype.kind == "f":
        bad = ~np.isfinite(value)
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise DataError(
                f"{name} has a non-finite value ({value[index]}) at index {index}; expected "
                "finite numbers",
                where=name,
            )


def open_checked(path: Path, what: str) -> None:
    if not path.exists():
        raise DataError(f"{path}: file not found", where=str(path))
    if path.is_dir():
        raise DataError(f"{path}: is a directory; expected {what}", where=str(path))


def load_npy(path: Path, name: str) -> np.ndarray:
    open_checked(path, "an .npy file")
    try:
        value = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise DataError(pickle_message(path, exc), where=name) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}", where=name) from None
    if not isinstance(value, np.ndarray):
        raise DataError(f"{path}: is an .npz archive; use --data for it", where=name)
    return value


def read_npz(path: str | os.PathLike[str], shown: str | None = None,
             single: str = "an .npz archive with x and y (or use --x and --y)",
             error: type[GradscopeError] = DataError,
             where: str | None = None) -> dict[str, np.ndarray]:
    """Every array of the .npz archive at ``path``, read with ``allow_pickle=False``.

    Messages start with ``shown`` (the path by default); ``single`` says what was expected
    when the file holds one array. Raises ``error`` (exit 2) at ``where`` (the path, or the
    array's name for a pickled array)."""
    shown = shown or str(path)
    try:
        with open(path, "rb") as opened:
            head = opened.read(6)
        if head and not head.startswith((b"PK", b"\x93NUMPY")):
            # NumPy would try it as a pickle and say so, which it is not (a text file, …)
            raise error(f"{shown}: not a readable .npz file: neither a zip archive of arrays "
                        "(np.savez) nor a NumPy array file", where=where or str(path))
        loaded = np.load(path, allow_pickle=False)
        if not hasattr(loaded, "files"):
            # An .npy file (np.save): one array, which no `with` takes (found tried as a new
            # user would: "internal error: TypeError: … context manager protocol").
            raise error(f"{shown}: is a single array (an .npy file, as np.save writes it); "
                        f"expected {single}", where=where or str(path))
        with loaded as archive:
            if {"config.json", "model.weights.h5"} <= set(archive.files):
                raise error(f"{shown}: is a saved Keras model (model.save), not arrays; "
                            f"expected {single}, as np.savez writes it",
                            where=where or str(path))
            arrays = {}
            for key in archive.files:
                try:
                    arrays[key] = archive[key]
                except ValueError:
                    raise error(f"{shown}: array '{key}' holds pickled Python objects; "
                                "gradscope reads plain numeric arrays only (allow_pickle=False)",
                                where=where or key) from None
            return arrays
    except GradscopeError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        message = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
        raise error(f"{shown}: not a readable .npz file: {message}",
                    where=where or str(path)) from None


def pickle_message(path: Path, exc: Exception) -> str:
    if "pickle" in str(exc).lower():
        return (f"{path}: holds pickled Python objects; gradscope loads plain numeric arrays "
                "only (allow_pickle=False)")
    return f"{path}: not a readable array file: {str(exc).splitlines()[0]}"
