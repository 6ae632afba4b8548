"""Checks of the command-line arguments that run before TensorFlow is imported.

A wrong option should cost the user a fraction of a second, not a whole run: every check here
is pure Python (no TensorFlow, no matplotlib import) and raises a one-line
:class:`GradscopeError` (exit 2) naming the option or file and what was expected. The CLI calls
them right after parsing (files, option combinations) and right after loading the spec and the
data (anything that depends on the number of time steps).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from gradscope.errors import GradscopeError

if TYPE_CHECKING:
    from gradscope.arrays import DataFiles
    from gradscope.yaml.config import Spec

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


def check_force(force: bool, files: dict[str, Path | None]) -> None:
    """``--force`` only means something with a file to overwrite: ``files`` maps each file
    option of the command (``-o``, ``--plot``) to its value."""
    if force and all(file is None for file in files.values()):
        options = " or ".join(f"{option} FILE" for option in files)
        raise GradscopeError(f"--force overwrites an existing output file; expected it "
                             f"together with {options}", where="--force")


def check_model_sizes(config: str | None, batch_size: int | None, time_steps: int | None,
                      data_files: DataFiles) -> None:
    """``--batch-size`` and ``--time-steps`` size a saved .keras model's synthetic batch; a
    YAML config sets them itself, and supplied data brings its own."""
    given = "--batch-size" if batch_size is not None else "--time-steps"
    if batch_size is None and time_steps is None:
        return
    if config is None or not str(config).endswith(".keras"):
        raise GradscopeError("--batch-size and --time-steps are for .keras models; set "
                             "batch_size and time_steps in the YAML config", where=given)
    data, x = data_files.data, data_files.x
    if data is not None or x is not None:
        source = f"--data {data}" if data is not None else f"--x {x}"
        raise GradscopeError(f"{given} does not go with {source}: the batch and time sizes "
                             "come from the data; expected one or the other", where=given)


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


def check_layer_options(against: str | None, layer: str | None, time_last: bool,
                        others: dict[str, object]) -> None:
    """``check --layer NAME [--time-last]``: one layer's backward, so it needs ``--against``;
    ``--time-last`` lays out that function's arrays, so it needs ``--layer``. ``others`` maps
    the whole-model options (``--chunks``, …) to their values: none goes with ``--layer``."""
    if time_last and layer is None:
        raise GradscopeError("--time-last lays out the arrays of --layer's backward as "
                             "(features, batch, time); expected it together with --layer NAME",
                             where="--time-last")
    if layer is None:
        return
    if against is None:
        raise GradscopeError(f"--layer {layer} checks your backward of one layer; expected it "
                             "together with --against FILE.py:FUNC", where="--layer")
    for option, given in others.items():
        if given:
            raise GradscopeError(f"{option} does not go with --layer, which checks one layer's "
                                 "backward given dh; expected one or the other",
                                 where=option)


def check_layer_name(spec: Spec, layer: str) -> None:
    """``--layer NAME`` must name one of the spec's recurrent layers."""
    recurrent = [item.name for item in spec.layers if item.recurrent]
    expected = f"expected one of the recurrent layers: {', '.join(str(n) for n in recurrent)}"
    for item in spec.layers:
        if item.name == layer and not item.recurrent:
            raise GradscopeError(f"--layer {layer} is a {item.type} layer; --layer checks a "
                                 f"recurrent layer's backward: {expected}", where="--layer")
    if layer not in recurrent:
        raise GradscopeError(f"--layer {layer}: the model has no layer of that name; {expected}",
                             where="--layer")


def check_weights(path: str | None, config: str | None, option: str = "--weights") -> None:
    """``--weights PATH`` (or ``gradscope spec PATH``): an .npz file or a checkpoint that
    exists, for a YAML config (a .keras model carries its own weights); nothing is read."""
    if path is None:
        return
    if config is not None and str(config).endswith(".keras"):
        raise GradscopeError(f"--weights is for YAML configs; {config} carries its own "
                             "weights", where="--weights")
    from gradscope.yaml.weights import locate

    locate(path, option if option == "--weights" else "")
