"""Click commands only: load a spec, make one library call, hand the report to a renderer.

Exit codes are decided here and nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
from click.shell_completion import CompletionItem
from rich.console import Console
from rich.status import Status
from rich.text import Text

import gradscope
from gradscope import __version__, preflight
from gradscope.arrays import DataFiles
from gradscope.errors import GradscopeError, on_command_line
from gradscope.report import json as json_render
from gradscope.report.models import REPORTS, Report, json_schema, json_text

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

EXIT_CODES_HELP = """\b
Exit codes:
  0  all good
  1  a check found a problem (or gradscope disagreed with itself), a NaN/Inf
     in a Keras model's loss or gradients (where it was born is said), or a
     flag that --fail-on names (explain --flow)
  2  usage, config or data error, or a result gradscope cannot vouch for
     and so refuses (one line says why)
"""

MAIN_HELP = f"""Explain and verify the gradients of recurrent TensorFlow models.

CONFIG is a saved Keras 3 model (model.keras), run by Keras itself, or a YAML
config (GRU, LSTM or SimpleRNN layers, then dense layers) that gradscope builds;
in Python, a Keras model object too. explain runs one real forward and backward
pass and explains every gradient: its shape, the arithmetic behind it with your
numbers, what its rows and columns hold, its statistics; check verifies each one
with independent witnesses. With no CONFIG, commands use the embedded seed model
(input 200 → GRU 64 → GRU 32 → dense 3, batch 34, 100 steps).

\b
Examples:
  gradscope explain                      # the embedded seed model
  gradscope explain model.keras          # your saved Keras model
  gradscope check model.keras            # every gradient against witnesses
  gradscope diagnose model.keras         # why its gradients vanish or explode
  gradscope explain sample_configs/keras_gru.yaml
  gradscope shapes config.yaml --json    # shapes only, no TensorFlow

{EXIT_CODES_HELP}"""


class _State:
    """Per-invocation settings that the error handler needs too."""

    json_errors = False


#: Width for output that is not going to a terminal (a pipe, a file) unless COLUMNS says.
PIPE_WIDTH = 120


class _StdoutConsole(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (`gradscope explain | head`): that is not a failure."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(EXIT_OK)


def _stdout_console() -> Console:
    no_color = bool(os.environ.get("NO_COLOR"))
    console = _StdoutConsole(color_system=None if no_color else "auto", no_color=no_color,
                      highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = PIPE_WIDTH
    return console


def _stderr_console(quiet: bool = False) -> Console:
    no_color = bool(os.environ.get("NO_COLOR"))
    return Console(stderr=True, quiet=quiet, color_system=None if no_color else "auto",
                   no_color=no_color, highlight=False)


def _one_line(status: Status) -> Callable[[str], None]:
    """What a command says it is doing, on ``status``'s one line: cut with an ellipsis where
    the terminal is narrower, never wrapped (found tried as a new user would: check's line of
    82 columns put its last word alone on a second line, redrawn at every tick)."""
    def update(text: str) -> None:
        shown = Text(text)
        shown.truncate(max(status.console.width - 2, 10), overflow="ellipsis")  # the spinner's 2
        status.update(shown)

    return update


def _said(text: str) -> None:
    """``text`` on stderr: wrapped at the terminal's width between words where stderr is a
    terminal (:func:`~gradscope.report.layout.wrapped`), else one line per line as written,
    for a log that is read with grep."""
    console = _stderr_console()
    if console.is_terminal:
        from gradscope.report.layout import wrapped

        text = wrapped(text, console.width)
    console.print(text, markup=False, soft_wrap=True)


def _complete_path(ctx: click.Context, param: click.Parameter,
                   incomplete: str) -> list[CompletionItem]:
    """Let the shell complete file names, while gradscope keeps its own messages for missing
    or unreadable files (a click.Path type would check them itself)."""
    return [CompletionItem(incomplete, type="file")]


def config_argument(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.argument("config", required=False, shell_complete=_complete_path)(func)


def output_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The output flags every reporting command shares."""

    @click.option("--json", "as_json", is_flag=True,
                  help="Print exactly one JSON document on stdout (see `gradscope schema`).")
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                  help="Write the report to FILE instead of stdout. Refuses to overwrite an "
                       "existing file unless --force is given. A FILE ending in .json needs "
                       "--json (a text report there is refused).")
    @click.option("--force", is_flag=True,
                  help="Overwrite the -o FILE (for explain, also the --plot FILE) if it "
                       "exists.")
    @click.option("-q", "--quiet", is_flag=True, help="No progress messages on stderr.")
    @functools.wraps(func)
    def wrapper(*args: Any, as_json: bool, **kwargs: Any) -> Any:
        _State.json_errors = as_json
        return func(*args, as_json=as_json, **kwargs)

    return wrapper


def memory_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--max-memory", metavar="SIZE",
        help="Refuse (exit 2, before anything is allocated) a run estimated to need more than "
             "SIZE, e.g. 4G or 512M. Default: a quarter of physical RAM.")(func)


def data_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The flags that replace the synthetic batch with the user's own arrays."""
    return _data_options(func, yaml=True)


def keras_data_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`data_options` of a command that reads a saved Keras model first (diagnose, which
    builds a YAML config as one): no --x/--y (a Keras model takes its batch as --data)."""
    return _data_options(func, yaml=False)


def _data_options(func: Callable[..., Any], yaml: bool) -> Callable[..., Any]:
    data_help = ("Use this batch: arrays x (B, T, F), y (targets) and optionally initial "
                 "states named like gru_1/h0. Batch and time sizes come from the data. "
                 "For a .keras model: arrays named after its inputs and outputs, and "
                 "optionally sample_weight (or sample_weight/OUTPUT)." if yaml else
                 "Use this batch: arrays named after the model's inputs and outputs, and "
                 "optionally sample_weight (or sample_weight/OUTPUT); for a YAML config, x "
                 "(B, T, F) and y. Batch and time sizes come from the data.")
    # --x/--y are a YAML config's (found tried as a new user would: "for a .keras model
    # without --data/--x" read as if a .keras model took them; it refuses them).
    without = "without --data"
    options = [
        click.option("--data", "data_file", metavar="FILE.npz", shell_complete=_complete_path,
                     help=data_help),
        *([click.option("--x", "x_file", metavar="FILE.npy", shell_complete=_complete_path,
                        help="A YAML config's inputs (B, T, F); with --y (a .keras "
                             "model takes --data)."),
           click.option("--y", "y_file", metavar="FILE.npy", shell_complete=_complete_path,
                        help="A YAML config's targets; with --x.")] if yaml else []),
        click.option("--batch-size", type=click.IntRange(min=1), metavar="B",
                     help=f"For a .keras model {without}: the batch size (default 32)."),
        click.option("--time-steps", type=click.IntRange(min=1), metavar="T",
                     help=f"For a .keras model whose time dimension is None, {without}."),
    ]

    @functools.wraps(func)
    def wrapper(*args: Any, data_file: str | None, batch_size: int | None,
                time_steps: int | None, x_file: str | None = None, y_file: str | None = None,
                **kwargs: Any) -> Any:
        # --batch-size and --time-steps go on to keras_options, which makes them part of the
        # Keras run's options.
        return func(*args, data_files=DataFiles(data_file, x_file, y_file),
                    batch_size=batch_size, time_steps=time_steps, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def weights_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--weights PATH``: a YAML-described model's trained weights."""
    return click.option(
        "--weights", metavar="PATH", shell_complete=_complete_path,
        help="Use these trained weights instead of ones drawn from the seed: an .npz file, a "
             "TensorFlow checkpoint (TF1 name-based or TF2 object-based), named by gradscope "
             "(gru_1/w_ru), TF1 (GRU_Layer1/rnn/gru_cell/gates/kernel) or Keras "
             "(gru/gru_cell/kernel), or a saved MODEL.keras of the YAML spec's kind of model "
             "(see `gradscope spec`). The mapping is printed; a missing, extra or misshapen "
             "variable exits 2. YAML configs only.")(func)


def keras_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of a saved .keras model's run (a YAML config sets these itself)."""

    @click.option("--loss", "loss_name", metavar="NAME",
                  help="For a .keras model: use this Keras loss (e.g. mse, "
                       "categorical_crossentropy; from_logits is set when the output is "
                       "linear) instead of the compiled or inferred one.")
    @click.option("--training", is_flag=True,
                  help="For a .keras model: run in training mode (dropout on, batch norm with "
                       "batch statistics), with a fixed seed. Default: inference mode.")
    @click.option("--pad", type=click.IntRange(min=0), default=0, metavar="N",
                  help="For a .keras model: pad the last N steps of the synthetic sequences "
                       "(with the Masking layer's mask_value, or token 0), to see masking's "
                       "effect.")
    @click.option("--seed", type=click.IntRange(min=0), default=0, metavar="N",
                  help="For a .keras model: the seed of every random draw (synthetic batch, "
                       "dropout and noise in training mode). Default 0.")
    @functools.wraps(func)
    def wrapper(*args: Any, loss_name: str | None, training: bool, pad: int, seed: int,
                batch_size: int | None, time_steps: int | None, **kwargs: Any) -> Any:
        given = {"batch_size": batch_size, "time_steps": time_steps, "loss": loss_name,
                 "training": training, "pad": pad, "seed": seed}
        # Only what the user gave: the library refuses each for a YAML config.
        run = {name: value for name, value in given.items() if value not in (None, False, 0)}
        return func(*args, keras_run=run, **kwargs)

    return wrapper


def user_code_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--import`` and ``--unsafe``: the user's own code for a saved model's custom classes."""

    @click.option("--import", "imports", multiple=True, metavar="MODULE_OR_FILE",
                  help="For a .keras model: import this module (a dotted name, or a .py file) "
                       "before the model loads, so that the custom classes it registers with "
                       "keras.saving.register_keras_serializable load under safe_mode=True. "
                       "Repeatable. It runs that module's code, as your own program would.")
    @click.option("--unsafe", is_flag=True,
                  help="For a .keras model: load it with safe_mode=False, which runs the Python "
                       "code stored inside the file (a Lambda layer's function). Only for files "
                       "you trust.")
    @functools.wraps(func)
    def wrapper(*args: Any, imports: tuple[str, ...], unsafe: bool, **kwargs: Any) -> Any:
        return func(*args, user_code=(imports, unsafe), **kwargs)

    return wrapper


def _model_source(config: str | None, user_code: tuple[tuple[str, ...], bool]) -> Any:
    """CONFIG, or, with --import or --unsafe, the saved model loaded with the user's code."""
    imports, unsafe = user_code
    if not imports and not unsafe:
        return config
    preflight.check_user_code(config, imports, unsafe)
    return gradscope.load_model(str(config), imports, unsafe)


def _emit(report: Report, as_json: bool, output: Path | None, force: bool) -> None:
    from gradscope.report.render import print_report

    if output is None:
        if as_json:
            sys.stdout.write(json_render.render_report(report))
            sys.stdout.flush()
        else:
            print_report(_stdout_console(), report)
        return
    if output.exists() and not force:
        raise GradscopeError(
            f"-o {output}: already exists; gradscope does not overwrite files (use --force)",
            where=str(output),
        )
    if as_json:
        text = json_render.render_report(report)
    else:
        console = Console(record=True, file=open(os.devnull, "w"), width=_file_width(),  # noqa: SIM115
                          color_system=None, highlight=False)
        print_report(console, report)
        text = console.export_text()
    _write_atomically(output, text)


#: Width of a text report written with -o, unless COLUMNS says.
FILE_WIDTH = 100


def _file_width() -> int:
    """-o FILE: the width COLUMNS sets, else :data:`FILE_WIDTH` (a file has no terminal)."""
    try:
        return max(int(os.environ.get("COLUMNS", "")), 40)
    except ValueError:
        return FILE_WIDTH


def _write_atomically(path: Path, text: str) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise GradscopeError(f"-o {path}: the folder {directory} does not exist; expected an "
                             "existing folder", where=str(path))
    try:
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        # mkstemp makes the file 0600; a report is as readable as any file the user writes.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except OSError as exc:
        message = f"{path}: cannot write: {exc.strerror or exc}"
        raise GradscopeError(message, where=str(path)) from None


@click.group(help=MAIN_HELP, context_settings={"help_option_names": ["-h", "--help"],
                                                 "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="gradscope")
def cli() -> None:
    pass


@cli.command(epilog=EXIT_CODES_HELP)
@config_argument
@user_code_options
@output_options
def shapes(config: str | None, as_json: bool, output: Path | None, force: bool,
           quiet: bool, user_code: tuple[tuple[str, ...], bool]) -> int:
    """Derive every weight and initial-state shape from CONFIG (or MODEL.keras), without TF.

    Each shape comes with its formula, your numbers substituted, and what its rows and
    column blocks hold. Nothing is run: this answers instantly.

    \b
    Example:
      gradscope shapes sample_configs/seed.yaml
    """
    preflight.check_force(force, {"-o": output})
    preflight.check_output(output, force, as_json)
    _emit(gradscope.shapes(_model_source(config, user_code)), as_json, output, force)
    return EXIT_OK


#: The mechanisms ``--fail-on`` (explain --flow, diagnose) takes.
FAIL_ON = ("vanishing", "exploding")


@cli.command(epilog=EXIT_CODES_HELP)
@config_argument
@data_options
@click.option("--jacobians", is_flag=True,
              help="Add ∂h_T/∂h_0 between every pair of recurrent layers (of a .keras model: "
                   "of every recurrent call), per example: Frobenius norm and singular values.")
@click.option("--flow", is_flag=True,
              help="Add the gradient norms per time step, the influence ‖∂h_t/∂x_s‖ of every "
                   "input step (for a .keras model: with --at or --plot), and flags for "
                   "vanishing or exploding gradients.")
@click.option("--at", type=int, metavar="T",
              help="The step t of ‖∂h_t/∂x_s‖, 0 to time steps − 1 (default: the last step). "
                   "Implies --flow.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE.png",
              help="Write norm curves and a heatmap of ‖∂h_t/∂x_s‖ over (t, s) to FILE.png "
                   "(needs matplotlib: `make install` in the clone, or "
                   "`.venv/bin/pip install matplotlib`). Implies --flow.")
@click.option("--per-example", "per_example", is_flag=True,
              help="Add each example's gradient norm ‖∂L_i/∂θ‖ (L_i: its share of the batch "
                   "loss), per layer and in total, the share the top 10% carry, the outliers "
                   "and the gradient noise scale. Keras models.")
@weights_option
@click.option("--chunks", type=int, metavar="K",
              help="Cut the time axis into K ≥ 2 chunks (K need not divide the steps: the "
                   "first chunks are one step longer) and report, per weight, the gradient "
                   "norm of full BPTT, of truncated BPTT without the carry, and of their "
                   "difference; and per chunk, ∂(final states)/∂(initial states) applied to "
                   "the next chunk's ∂L/∂h0. On a Keras model, each recurrent call is cut "
                   "into K chunks of its own steps.")
@keras_options
@user_code_options
@memory_option
@output_options
@click.option("--timings", is_flag=True, help="Add the seconds each phase took to the report.")
@click.option("--fail-on", "fail_on", type=click.Choice(FAIL_ON), multiple=True,
              help="With --flow: exit 1 where the flow flags this (repeat the option for "
                   "both): for CI.")
def explain(config: str | None, data_files: DataFiles, jacobians: bool, flow: bool,
            at: int | None, per_example: bool, plot: Path | None, weights: str | None,
            chunks: int | None, keras_run: dict[str, Any],
            max_memory: str | None, as_json: bool, output: Path | None, force: bool,
            quiet: bool, timings: bool,
            user_code: tuple[tuple[str, ...], bool], fail_on: tuple[str, ...]) -> int:
    """Build the model in CONFIG, run one forward/backward pass, and explain every gradient.

    For each weight gradient: its name and TF1/Keras alias, its shape (the real TF gradient
    shape, cross-checked against the shape algebra), the formula behind it with your numbers,
    what its rows and column blocks mean, and its L2 norm, mean |g|, max |g| and count of
    non-finite values. Then the initial-state gradients ∂L/∂h0 and how to carry them into the
    previous truncated batch.

    \b
    Example:
      gradscope explain sample_configs/seed.yaml
      gradscope explain --json > report.json
      gradscope explain --jacobians --flow --plot flow.png
      gradscope explain model.yaml --weights model.ckpt
      gradscope explain --chunks 2
      gradscope explain model.keras --per-example
    """
    preflight.check_force(force, {"-o": output, "--plot": plot})
    preflight.check_output(output, force, as_json)
    preflight.check_plot(plot, force, output)
    if fail_on and not flow:
        raise GradscopeError("--fail-on reads the flow's flags: add --flow", where="--fail-on")
    source = _model_source(config, user_code)
    progress = _stderr_console(quiet=quiet)
    with progress.status("gradscope explain", spinner="dots") as status:
        report = gradscope.explain(source, data=data_files, weights=weights, chunks=chunks,
                                   flow=flow, jacobians=jacobians, at=at,
                                   per_example=per_example, heatmap=plot is not None,
                                   max_memory=max_memory,
                                   timings=timings, progress=_one_line(status), **keras_run)
    if plot is not None:
        from gradscope.report.plot import write_flow_plot

        write_flow_plot(report, plot, force)
    _emit(report, as_json, output, force)
    if (getattr(report, "nonfinite", None) is not None
            or getattr(report, "not_finite", None) is not None):
        return EXIT_PROBLEM
    section = getattr(report, "gradient_flow", None)
    return _failed_on("explain", fail_on, [
        (flag.what, flag.kind) for flag in (section.flags if section is not None else [])],
        [(entry.layer, entry.reason) for entry in getattr(section, "not_analysed", None) or []])


def _failed_on(command: str, fail_on: tuple[str, ...], found: list[tuple[str, str]],
               unread: list[tuple[str, str]]) -> int:
    """EXIT_PROBLEM where any of ``found`` ((what, mechanism) pairs) has a mechanism that
    ``--fail-on`` names; else, with ``--fail-on``, EXIT_USAGE where a recurrent call was not
    read (``unread``: (call, why) pairs): a job that asked cannot pass on a layer nobody
    looked at. One line on stderr says which (the report itself goes to stdout or -o); else
    EXIT_OK."""
    if not fail_on:
        return EXIT_OK
    failing = [f"{what} ({kind})" for what, kind in found if kind in fail_on]
    said = f"gradscope {command}: --fail-on {','.join(fail_on)}: "
    if failing:
        _said(said + ", ".join(failing))
        return EXIT_PROBLEM
    if unread:
        _said(said + "not read, so not known: " + "; ".join(
            f"{what} ({why})" for what, why in unread))
        return EXIT_USAGE
    return EXIT_OK


#: How ``check --help`` names each witness of :data:`gradscope.gradcheck.TOLERANCES`, and a
#: note on it; a witness missing here is shown by its key. ``replay`` and ``cross_check`` are
#: not witnesses (they hold gradscope to Keras, not a gradient to TF).
WITNESS_HELP = {
    "finite_differences": ("finite differences", "as jax's check_grads"),
    "numpy_reference": ("NumPy reference", "gradscope's NumPy BPTT"),
    "gru_block_kernel": ("GRUBlockCellGrad", "its kernel is float32 only"),
    "tbptt_carry": ("TBPTT carry", "--chunks"),
    "against": ("--against", "also per element"),
}
NOT_WITNESSES = ("replay", "cross_check")


def _tolerance_help() -> str:
    """The tolerance table of ``check --help``, written from the one table in gradcheck.py."""
    from gradscope.gradcheck import TOLERANCES

    def shown(value: float) -> str:
        return f"{value:.0e}".replace("e-0", "e-")

    lines = ["\b", "Relative tolerances, by the dtype the check computes in (the table",
             "TOLERANCES of gradscope/gradcheck.py):", f"  {'witness':<20} float64  float32"]
    for key, row in TOLERANCES.items():
        if key in NOT_WITNESSES:
            continue
        name, note = WITNESS_HELP.get(key, (key, ""))
        lines.append(f"  {name:<20} {shown(row['float64'].rtol):<8} "
                     f"{shown(row['float32'].rtol):<8} {note}".rstrip())
    lines += ["--rtol replaces every float64 tolerance; --atol adds an absolute allowance to",
              "the finite differences.", ""]
    return "\n".join(lines) + "\n"


CHECK_EPILOG = _tolerance_help() + EXIT_CODES_HELP


@cli.command(epilog=CHECK_EPILOG)
@config_argument
@click.option("--against", metavar="FILE.py:FUNC", shell_complete=_complete_path,
              help="Also compare your own backward function FUNC(params, x, y, h0) -> dict of "
                   "gradients of the mean loss (see docs/check.md). This imports and runs FILE.py: "
                   "your code, at your request.")
@click.option("--layer", metavar="NAME",
              help="Check your backward of this one recurrent layer instead of the whole "
                   "model's: --against FUNC(x, h0, params, dh) -> dict, where dh is ∂L/∂h_t "
                   "from above at each step, without the carry (see docs/check.md).")
@click.option("--time-last", is_flag=True,
              help="With --layer: arrays laid out (features, batch, time) and states "
                   "(units, batch), as in the classic course code; a SimpleRNN's params then "
                   "also hold Wax, Waa, ba.")
@click.option("--chunks", type=int, metavar="K",
              help="Also run truncated BPTT in K ≥ 2 chunks, carrying each chunk's initial-state "
                   "gradients as grad_ys into the previous chunk, and compare the summed "
                   "weight gradients with full BPTT (on a Keras model: with Keras' own "
                   "tape).")
@click.option("--directions", type=click.IntRange(min=1, max=100), metavar="N",
              help="Random directions of the finite differences: per tensor for a spec "
                   "(default 3); for a Keras model, joint ones that move every tensor at once "
                   "(default 2), then per tensor (default 3) wherever a joint one disagrees.")
@click.option("--rtol", type=click.FloatRange(min=0, min_open=True), metavar="R",
              help="Relative tolerance for every float64 witness.")
@click.option("--atol", type=click.FloatRange(min=0), metavar="A",
              help="Absolute allowance added to the finite-difference comparison.")
@click.option("--examples", metavar="N|all",
              help="For a .keras model: check at most N examples of the batch (default 16): "
                   "one with NaN or Inf in its data, each masked input's shortest and "
                   "longest, the smallest and largest sample weight, the rest drawn with the "
                   "seed; the report names them. 'all' checks "
                   "every example.")
@click.option("--junit", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE.xml",
              help="Also write the result as JUnit XML (one test case per tensor, named by "
                   "layer and weight; a failure carries the diagnosis), for CI dashboards. "
                   "Refuses to overwrite FILE unless --force is given.")
@click.option("--equations", is_flag=True,
              help="Print GRUBlockCellGrad's corrected backward equations and the errata of its "
                   "public documentation, with evidence from this model (text only: the JSON "
                   "report always carries the errata).")
@data_options
@weights_option
@keras_options
@user_code_options
@memory_option
@output_options
@click.option("--timings", is_flag=True, help="Add the seconds each phase took to the report.")
def check(config: str | None, against: str | None, layer: str | None, time_last: bool,
          chunks: int | None, directions: int,
          rtol: float | None, atol: float | None, examples: str | None, junit: Path | None,
          equations: bool, data_files: DataFiles, weights: str | None,
          keras_run: dict[str, Any], max_memory: str | None, as_json: bool,
          output: Path | None, force: bool, quiet: bool, timings: bool,
          user_code: tuple[tuple[str, ...], bool]) -> int:
    """Verify every gradient of CONFIG's model with independent witnesses.

    Each weight, each initial state (gru_k/h0) and the input x is checked on a float64
    copy of the model against: finite differences along random directions and single
    elements; a NumPy forward/BPTT written without TensorFlow; for block-layout GRU layers,
    TF's GRUBlockCellGrad kernel; and, on request, truncated BPTT (--chunks) and your own
    backward (--against). Exits 1 if any witness disagrees.

    \b
    Example:
      gradscope check
      gradscope check config.yaml --chunks 4
      gradscope check config.yaml --against my_bptt.py:backward --json
      gradscope check c.yaml --against bp.py:backward --layer gru_1 --time-last
      gradscope check model.yaml --weights model.ckpt
      gradscope check model.keras --junit gradients.xml
    """
    preflight.check_force(force, {"-o": output, "--junit": junit})
    preflight.check_output(output, force, as_json)
    preflight.check_junit(junit, force, output)
    if equations and as_json:
        raise GradscopeError("--equations prints text and does not go with --json; the JSON "
                             "report has the errata (of block-layout GRU layers) under "
                             "'errata'", where="--equations")
    source = _model_source(config, user_code)
    progress = _stderr_console(quiet=quiet)
    try:
        with progress.status("gradscope check", spinner="dots") as status:
            report = gradscope.check(source, against=against, chunks=chunks, data=data_files,
                                     layer=layer, time_last=time_last, weights=weights,
                                     directions=directions, rtol=rtol, atol=atol,
                                     examples=examples, equations=equations,
                                     max_memory=max_memory, timings=timings,
                                     progress=_one_line(status), **keras_run)
    except Exception as exc:
        if junit is not None:  # CI reads the file whatever the outcome: why check did not run
            from gradscope.report.junit import junit_error_xml

            message = exc.message if isinstance(exc, GradscopeError) else (
                f"internal error: {type(exc).__name__}: {exc}")
            _write_atomically(junit, junit_error_xml(config or "the seed model", message,
                                                     type(exc).__name__))
        raise
    if junit is not None:
        from gradscope.report.junit import junit_xml

        _write_atomically(junit, junit_xml(report, config or "the seed model"))
    _emit(report, as_json, output, force)
    return EXIT_OK if report.summary.passed else EXIT_PROBLEM


DIAGNOSE_EPILOG = """\b
Exit codes:
  0  the diagnosis is made (whatever it finds: a vanishing or exploding
     layer is an answer, as explain's flags are, unless --fail-on names it)
  1  a NaN or Inf in the loss or a gradient on this batch (no layer is
     diagnosed; where it was born is said); with --fail-on, a layer whose
     verdict names that mechanism (one line on stderr says which); or
     gradscope disagreed with itself (an internal error)
  2  usage, config or data error, or a result gradscope cannot vouch for;
     with --fail-on, a recurrent call that could not be diagnosed
"""


@cli.command(epilog=DIAGNOSE_EPILOG)
@click.argument("config", metavar="CONFIG|MODEL.keras", required=False,
                shell_complete=_complete_path)
@click.option("--exponents", type=click.IntRange(min=1), metavar="K",
              help="How many Lyapunov exponents, largest first (default 8; every one when "
                   "the state has at most 32 numbers).")
@click.option("--no-counterfactuals", "no_counterfactuals", is_flag=True,
              help="Skip the counterfactuals (each change run again on a copy of the "
                   "model).")
@click.option("--fail-on", "fail_on", type=click.Choice(FAIL_ON), multiple=True,
              help="Exit 1 where some layer's verdict names this mechanism (repeat the "
                   "option for both): for CI.")
@keras_data_options
@weights_option
@keras_options
@user_code_options
@memory_option
@output_options
@click.option("--timings", is_flag=True, help="Add the seconds each phase took to the report.")
def diagnose(config: str | None, exponents: int | None, no_counterfactuals: bool,
             fail_on: tuple[str, ...], data_files: DataFiles, weights: str | None,
             keras_run: dict[str, Any], max_memory: str | None, as_json: bool,
             output: Path | None, force: bool, quiet: bool, timings: bool,
             user_code: tuple[tuple[str, ...], bool]) -> int:
    """Why the gradients of each recurrent layer vanish or explode, measured.

    Each recurrent call of MODEL.keras is stepped through the cell the model holds,
    along the batch's own trajectory: the spectral norm of each step Jacobian, the
    Lyapunov spectrum (QR along the trajectory), the gates and unit timescales (GRU,
    LSTM), the memory horizon (measured, and predicted from λ₁), where ∂L/∂s_t grows,
    what the optimizer's clipping does to this batch, and a verdict in words. A YAML
    CONFIG (or none: the seed model) is built from Keras' own layers with its weights
    and diagnosed so. See docs/diagnose.md for how to read it.

    \b
    Example:
      gradscope diagnose                       # the embedded seed model
      gradscope diagnose model.keras
      gradscope diagnose model.keras --data batch.npz --json
    """
    preflight.check_force(force, {"-o": output})
    preflight.check_output(output, force, as_json)
    source = _model_source(config, user_code)
    progress = _stderr_console(quiet=quiet)
    with progress.status("gradscope diagnose", spinner="dots") as status:
        report = gradscope.diagnose(source, data=data_files, exponents=exponents,
                                    counterfactuals=not no_counterfactuals, weights=weights,
                                    max_memory=max_memory, timings=timings,
                                    progress=_one_line(status), **keras_run)
    _emit(report, as_json, output, force)
    if report.nonfinite is not None:
        return EXIT_PROBLEM
    return _failed_on("diagnose", fail_on,
                      [(layer.call, layer.mechanism) for layer in report.layers],
                      [(entry.layer, entry.reason) for entry in report.not_diagnosed])


@cli.command("spec", epilog=EXIT_CODES_HELP)
@click.argument("path", shell_complete=_complete_path)
@user_code_options
@output_options
def spec_command(path: str, as_json: bool, output: Path | None, force: bool,
                 quiet: bool, user_code: tuple[tuple[str, ...], bool]) -> int:
    """Infer the YAML config from a checkpoint's or an .npz file's weight shapes, or from a
    saved MODEL.keras.

    The shape algebra run backwards: input size, layers, units, cell kind, layout and the
    dense output are read off the variables' shapes, each cross-checked. The YAML goes to
    stdout (or -o FILE) and loads as it is; why each value is what it is goes to stderr.
    Time steps, batch size and loss cannot be known from weights: they get a default and a
    comment, and --data sets the sizes. An .npz file needs no TensorFlow.

    A MODEL.keras has a YAML config when its layers are Keras GRU, LSTM and SimpleRNN in a
    chain, then Dense (a layer that is not is refused by name, before TensorFlow loads); its
    input shape and compiled loss fill in what weights cannot say, and the config's own
    NumPy forward pass must predict what Keras predicts. --import loads its classes of your
    own (an initializer, a loss) as for explain.

    \b
    Example:
      gradscope spec model.ckpt > model.yaml
      gradscope explain model.yaml --weights model.ckpt
      gradscope spec model.keras --import my_layers -o model.yaml
    """
    preflight.check_force(force, {"-o": output})
    preflight.check_output(output, force, as_json)
    imports, unsafe = user_code
    if imports or unsafe:
        preflight.check_user_code(path, imports, unsafe)
    report = gradscope.infer_spec(path, imports, unsafe)
    if not as_json and not quiet:
        from gradscope.report.yaml_text import inference_lines

        _stderr_console().print(inference_lines(report), markup=False)
    text = json_render.render_report(report) if as_json else report.yaml
    if output is None:
        sys.stdout.write(text)
    else:
        _write_atomically(output, text)
    return EXIT_OK


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("log_dir", metavar="LOG_DIR", shell_complete=_complete_path)
@output_options
def watch(log_dir: str, as_json: bool, output: Path | None, force: bool, quiet: bool) -> int:
    """Show what gradscope.keras.GradientFlow wrote to LOG_DIR during training.

    Per recurrent layer, sparklines across training of ‖∂L/∂h0‖ and of the ratio of
    ‖∂L/∂h_t‖ at the first and the last step, the vanishing/exploding flags, the last per-step
    profile ‖∂L/∂h_t‖, and ‖∂L/∂w‖ of every weight. Reads the TensorBoard event files without
    TensorFlow (needs the tensorboard package); readable over SSH.

    \b
    Example:
      gradscope watch runs/gru --json | jq '.recurrent[].flags'
    """
    preflight.check_force(force, {"-o": output})
    preflight.check_output(output, force, as_json)
    _emit(gradscope.watch(log_dir), as_json, output, force)
    return EXIT_OK


DIFF_EPILOG = """\b
Exit codes:
  0  no drift: the gradients, their shapes and the loss agree within --rtol
  1  something drifted (each change is listed)
  2  usage or data error, or reports of different models, data or seeds
"""


@cli.command(epilog=DIFF_EPILOG)
@click.argument("base", metavar="BASE.json", shell_complete=_complete_path)
@click.argument("new", metavar="NEW.json", shell_complete=_complete_path)
@click.option("--rtol", type=click.FloatRange(min=0, min_open=True), metavar="R",
              help="Relative tolerance of each ‖g‖ and of the loss  [default: 1e-4: float32 "
                   "rounding across machines stays far below it]")
@output_options
def diff(base: str, new: str, rtol: float | None, as_json: bool, output: Path | None,
         force: bool, quiet: bool) -> int:
    """Compare the gradients of two explain reports (explain --json), e.g. of two commits.

    Lists tensors added, removed or renamed, changed shapes, ‖g‖ drifting beyond --rtol,
    values that became NaN or Inf, vanishing/exploding flags that flip (where both reports
    ran --flow), and the loss. The reports must explain the same model inputs and data
    (batch size, seed, data files): otherwise the difference would be the data's, and it is
    refused. No TensorFlow.

    \b
    Example:
      gradscope explain model.keras --data batch.npz --json -o base.json
      ... change the code ...
      gradscope explain model.keras --data batch.npz --json -o new.json
      gradscope diff base.json new.json
    """
    preflight.check_force(force, {"-o": output})
    preflight.check_output(output, force, as_json)
    report = gradscope.diff(base, new, rtol=rtol)
    _emit(report, as_json, output, force)
    return EXIT_PROBLEM if report.drifted else EXIT_OK


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("command", type=click.Choice(sorted(REPORTS)), default="explain")
def schema(command: str) -> int:
    """Print the JSON Schema of a command's --json output.

    \b
    Example:
      gradscope schema explain > explain.schema.json
    """
    sys.stdout.write(json_text(json_schema(command)))
    return EXIT_OK


def _fail(message: str, where: str | None, code: int) -> None:
    if _State.json_errors:
        sys.stdout.write(json_render.render_error(message, where))
        sys.stdout.flush()
    _said(f"gradscope: error: {message}")
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    _State.json_errors = "--json" in args
    if not os.environ.get("GRADSCOPE_DEBUG"):
        # Deprecation chatter from TensorFlow, Keras or NumPy is not the user's business.
        warnings.simplefilter("ignore")
        # Nor TensorFlow's C++ log lines, whatever the shell says: the terminal is gradscope's.
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    try:
        with on_command_line():  # the library's messages spell options as flags
            code = cli.main(args=args, prog_name="gradscope", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        # `gradscope` alone asks for the help: it is not an error.
        sys.stdout.write(exc.ctx.get_help() + "\n")
        sys.exit(EXIT_OK)
    except GradscopeError as exc:
        _fail(exc.message, exc.where, exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        message = exc.format_message()
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            message += f" (see '{exc.ctx.command_path} --help')"
        _fail(message, getattr(getattr(exc, "param", None), "name", None), EXIT_USAGE)
    except click.exceptions.Abort:
        _fail("interrupted", None, 130)
    except KeyboardInterrupt:
        _fail("interrupted", None, 130)
    except BrokenPipeError:
        # The reader went away (`gradscope explain | head`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(EXIT_OK)
    except Exception as exc:  # a bug in gradscope: say so, in one line unless asked
        if os.environ.get("GRADSCOPE_DEBUG"):
            raise
        _fail(
            f"internal error: {type(exc).__name__}: {exc} (set GRADSCOPE_DEBUG=1 for the "
            "traceback, and please report it)",
            None,
            EXIT_PROBLEM,
        )
    _leave(code if isinstance(code, int) else EXIT_OK, program=argv is None)


def _leave(code: int, program: bool) -> NoReturn:
    """Exit with ``code``. Run as the program (not ``main(argv)`` from Python), a finished
    command skips the interpreter's teardown once TensorFlow is loaded: destroying its traced
    functions and thread pools takes about 1 s here and changes nothing the user can see.
    Both streams are flushed first; every file a command writes is closed when it returns."""
    if program and "tensorflow" in sys.modules:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)
