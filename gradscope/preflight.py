"""Checks of options that both wings share, and of the files the CLI writes, run before
TensorFlow is imported.

A wrong option should cost the user a fraction of a second, not a whole run: every check here
is pure Python and raises a one-line :class:`GradscopeError` (exit 2) naming the option or
file and what was expected. What depends on one wing's model is checked by that wing's job
(``keras/job.py``, ``yaml/job.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from gradscope.errors import ConfigError, GradscopeError, flag, given, imports_given, whole_number

#: The file types matplotlib's Agg backend writes, by extension.
PLOT_EXTENSIONS = (".png", ".pdf", ".svg", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif",
                   ".tiff", ".webp", ".pgf", ".raw", ".rgba")


def check_output(output: Path | None, force: bool, as_json: bool) -> None:
    """``-o FILE``: writable, not an existing file (without ``--force``), and not FILE.json
    for a text report."""
    if output is None:
        return
    if output.suffix.lower() == ".json" and not as_json:
        raise GradscopeError(
            f"-o {output}: the name ends in .json but the report would be text; add --json, or "
            "choose another extension",
            where="--output",
        )
    _check_new_file("-o", output, force)


def check_plot(plot: Path | None, force: bool, output: Path | None = None) -> None:
    """``--plot FILE.png``: matplotlib installed (looked up, not imported), a file type it
    writes, a new file (without ``--force``) in an existing folder, not the ``-o`` file."""
    if plot is None:
        return
    try:
        missing = importlib.util.find_spec("matplotlib") is None
    except (ImportError, ValueError):  # hidden or broken: as good as missing
        missing = True
    if missing:
        from gradscope.report.plot import matplotlib_install_line

        raise GradscopeError("--plot needs matplotlib, which is not installed; install it with: "
                             + matplotlib_install_line(), where="--plot")
    if plot.suffix and plot.suffix.lower() not in PLOT_EXTENSIONS:
        raise GradscopeError(
            f"--plot {plot}: matplotlib cannot write {plot.suffix} files; expected FILE.png "
            f"(or {', '.join(PLOT_EXTENSIONS[1:4])}, …)",
            where="--plot",
        )
    if output is not None and _same_file(plot, output):
        raise GradscopeError(f"--plot and -o both name {plot}; expected two different files",
                             where="--plot")
    _check_new_file("--plot", plot, force)


def check_user_code(config: str | None, imports: tuple[str, ...], unsafe: bool) -> None:
    """``--import`` and ``--unsafe`` (``imports=`` and ``unsafe=`` in Python) bring code for a
    saved ``.keras`` model only; each ``--import`` must be found (:func:`missing_code`)."""
    option = flag("unsafe" if unsafe and not imports else "imports")
    if config is None or not str(config).endswith(".keras"):
        found = (f"{config} is not one (a YAML config or a weights file names no code)"
                 if config else "the embedded seed model is a YAML config, which names no code")
        raise GradscopeError(f"{option} is for a saved .keras model whose classes are your own "
                             f"code; {found}", where=option)
    for source in imports:
        missing = missing_code(source)
        if missing is not None:
            raise ConfigError(missing, where="--import")


#: What ``--import`` takes, said where what it was given is not that.
IMPORTABLE = "expected a dotted module name or a path to a .py file"


def is_a_path(source: str) -> bool:
    """Whether ``--import SOURCE`` names a file (else a dotted module name)."""
    return source.endswith(".py") or "/" in source or "\\" in source


def no_module(source: str, name: str) -> str:
    """``--import SOURCE`` where Python finds no module ``name``."""
    return (f"{imports_given(source)}: no module named {name!r} on the Python path (the "
            f"current folder included); {IMPORTABLE}")


def missing_code(source: str) -> str | None:
    """Why ``--import SOURCE`` cannot be imported, seen without importing anything (so before
    TensorFlow loads: found tried as a new user would, a misspelt module took 5.6 s to be
    refused): a file that does not exist, or a top-level module that is not on the Python
    path, the current folder included. None where it may be imported."""
    if is_a_path(source):
        return (None if Path(source).is_file() else
                f"{imports_given(source)}: no such file; {IMPORTABLE}")
    top = source.split(".")[0]
    here = str(Path.cwd())
    sys.path.insert(0, here)
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # a name Python refuses: the import says why
        return None
    finally:
        sys.path.remove(here)
    return None if found is not None else no_module(source, top)


def check_junit(junit: Path | None, force: bool, output: Path | None) -> None:
    """``check --junit FILE``: a new file (without ``--force``) in a writable folder, not the
    ``-o`` file."""
    if junit is None:
        return
    if output is not None and _same_file(junit, output):
        raise GradscopeError(f"--junit and -o both name {junit}; expected two different files",
                             where="--junit")
    _check_new_file("--junit", junit, force)


def check_force(force: bool, files: dict[str, Path | None]) -> None:
    """``--force`` only means something with a file to overwrite: ``files`` maps each file
    option of the command (``-o``, ``--plot``) to its value."""
    if force and all(file is None for file in files.values()):
        options = " or ".join(f"{option} FILE" for option in files)
        raise GradscopeError(f"--force overwrites an existing output file; expected it "
                             f"together with {options}", where="--force")


def _check_new_file(option: str, path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise GradscopeError(
            f"{option} {path}: already exists; gradscope does not overwrite files (use --force)",
            where=str(path),
        )
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise GradscopeError(f"{option} {path}: the folder {folder} does not exist; expected "
                             "an existing folder", where=str(path))
    try:  # os.access says yes to root on a read-only file system: try a real file
        with tempfile.TemporaryFile(dir=folder, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise GradscopeError(f"{option} {path}: cannot write in the folder {folder}: "
                             f"{exc.strerror or exc}", where=str(path)) from None


def _same_file(first: Path, second: Path) -> bool:
    return os.path.abspath(first) == os.path.abspath(second)


def check_layer_options(against: object, layer: str | None, time_last: bool,
                        others: dict[str, object]) -> None:
    """``check`` of one layer (``layer``, ``time_last``): one layer's backward, so it needs
    ``against``; ``time_last`` lays out that function's arrays, so it needs ``layer``.
    ``others`` maps the whole-model options (``chunks``, …) to their values: none goes with
    ``layer``."""
    if time_last and layer is None:
        raise GradscopeError(f"{flag('time_last')} lays out the arrays of the one-layer "
                             f"backward that {flag('layer')} checks as (features, batch, time); "
                             f"expected it together with {flag('layer')} NAME",
                             where=flag("time_last"))
    if layer is None:
        return
    if against is None:
        raise GradscopeError(f"{given('layer', layer)} checks your backward of one layer; "
                             f"expected it together with {flag('against')} FILE.py:FUNC",
                             where=flag("layer"))
    for name, value in others.items():
        if value:
            raise GradscopeError(f"{flag(name)} does not go with {flag('layer')}, which checks "
                                 "one layer's backward given dh; expected one or the other",
                                 where=flag(name))


def check_witness_options(directions: object, rtol: object, atol: object) -> None:
    """check's tuning of its witnesses, for either wing, each when given: ``directions`` a
    whole number ≥ 1 (none would leave the finite differences nothing to compare), ``rtol``
    positive and ``atol`` at least 0."""
    if directions is not None and (not whole_number(directions)
                                   or directions < 1):  # type: ignore[operator]
        raise ConfigError(f"{given('directions', directions)}: expected a whole number ≥ 1",
                          where=flag("directions"))
    for name, value, smallest in (("rtol", rtol, "positive number"),
                                  ("atol", atol, "number ≥ 0")):
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not (value > 0 if name == "rtol" else value >= 0)):
            raise ConfigError(f"{given(name, value)}: expected a {smallest}", where=flag(name))
