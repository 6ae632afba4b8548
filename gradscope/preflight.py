"""Checks of the options, on the command line or in the API, that run before TensorFlow is
imported.

A wrong option should cost the user a fraction of a second, not a whole run: every check here
is pure Python (no TensorFlow, no matplotlib import) and raises a one-line
:class:`GradscopeError` (exit 2) naming the option or file and what was expected. The API
calls them before it loads anything (option combinations, files) and after loading the spec
and the data (anything that depends on the number of time steps); the CLI adds its own (the
files it writes).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from gradscope.errors import ConfigError, GradscopeError, flag, given

if TYPE_CHECKING:
    from gradscope.arrays import DataFiles

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
    """``--import`` and ``--unsafe`` bring code for a saved ``.keras`` model only."""
    option = "--unsafe" if unsafe and not imports else "--import"
    if config is None or not str(config).endswith(".keras"):
        found = (f"{config} is not one (a YAML config or a weights file names no code)"
                 if config else "the embedded seed model is a YAML config, which names no code")
        raise GradscopeError(f"{option} is for a saved .keras model whose classes are your own "
                             f"code; {found}", where=option)


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


def check_keras_sizes(batch_size: int | None, time_steps: int | None,
                      data_files: DataFiles) -> None:
    """``batch_size`` and ``time_steps`` size a Keras model's synthetic batch; supplied data
    brings its own."""
    if batch_size is None and time_steps is None:
        return
    named = "batch_size" if batch_size is not None else "time_steps"
    data, x = data_files.data, data_files.x
    if data is not None or x is not None:
        source = given("data", data) if data is not None else given("x", x)
        raise GradscopeError(f"{flag(named)} does not go with {source}: the batch and time "
                             "sizes come from the data; expected one or the other",
                             where=flag(named))


#: What a YAML config sets itself, and why a Keras model's option is refused for it.
_KERAS_ONLY = {
    "loss": "a YAML config sets its loss and has no training mode or padding",
    "training": "a YAML config sets its loss and has no training mode or padding",
    "pad": "a YAML config sets its loss and has no training mode or padding",
    "batch_size": "set batch_size and time_steps in the YAML config",
    "time_steps": "set batch_size and time_steps in the YAML config",
    "seed": "a YAML config sets its seed",
    "examples": "a YAML config's batch is checked whole (set batch_size in it)",
}


def refuse_keras_options(options: dict[str, object], command: str) -> None:
    """A Keras model's options (``loss``, ``batch_size``, …), given for a YAML config: each is
    refused in one line, as is a name that is no option at all (only the API can give one)."""
    for name, value in options.items():
        if name in _KERAS_ONLY and value not in (None, False, 0):
            raise ConfigError(f"{flag(name)} is for Keras models; {_KERAS_ONLY[name]}",
                              where=flag(name))
    unknown = sorted(set(options) - set(_KERAS_ONLY))
    if unknown:
        raise ConfigError(f"{' and '.join(flag(n) for n in unknown)}: not options of "
                          f"{command} for a YAML spec; see help(gradscope.{command})",
                          where=unknown[0])


def refuse_yaml_options(options: dict[str, object], command: str) -> None:
    """Options of a YAML-described model (``weights``, ``chunks``, …), given for a Keras
    model: each is refused in one line saying what a Keras model takes instead."""
    influence = ("the influence ‖∂h_t/∂x_s‖ is not available for Keras models yet; "
                 f"{flag('flow')} and {flag('jacobians')} are")
    reasons = {
        "weights": "a Keras model carries its own weights",
        "chunks": "a Keras model's recurrent layers are not cut into chunks yet",
        "at": influence,
        "heatmap": influence,
        "against": f"{command} of your own backward is not available for Keras models yet",
        "layer": f"{command} of your own backward is not available for Keras models yet",
        "time_last": f"{command} of your own backward is not available for Keras models yet",
        "params": "a Keras model carries its own weights",
        "equations": "the corrected GRUBlockCellGrad equations go with block-layout GRUs",
    }
    for name, value in options.items():
        if value is not None and value is not False:
            raise ConfigError(f"{flag(name)} is for YAML configs; {reasons[name]}",
                              where=flag(name))


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
    if directions is not None and (isinstance(directions, bool)
                                   or not isinstance(directions, int) or directions < 1):
        raise ConfigError(f"{given('directions', directions)}: expected a whole number ≥ 1",
                          where=flag("directions"))
    for name, value, smallest in (("rtol", rtol, "positive number"),
                                  ("atol", atol, "number ≥ 0")):
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not (value > 0 if name == "rtol" else value >= 0)):
            raise ConfigError(f"{given(name, value)}: expected a {smallest}", where=flag(name))
