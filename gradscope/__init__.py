"""gradscope: explain and verify the gradients of recurrent TensorFlow models.

Python API (the CLI is a thin layer over exactly these)::

    import gradscope
    spec = gradscope.load_spec("config.yaml")     # or a dict, or None for the seed model
    report = gradscope.explain(spec)
    report.to_dict()
    gradscope.explain("model.keras")              # a saved Keras model, run by Keras
    gradscope.explain(spec, weights="model.ckpt") # your trained weights (npz or checkpoint)
    gradscope.infer_spec("model.ckpt").yaml       # the config a checkpoint's shapes imply
    gradscope.estimate_memory("model.keras", "check")  # bytes by term, nothing run
    gradscope.explain(model, x=x, y=y, flow=True) # a Keras model object, e.g. in a notebook
    gradscope.shapes(model)                       # its algebra alone, nothing run
    gradscope.watch("runs/gru")                   # what GradientFlow wrote to its log_dir
    gradscope.diff("base.json", "new.json")       # gradients drifted between two reports

A Keras model object (Sequential or functional, built) goes through the same Keras engine as
a ``.keras`` file: its graph is read from the config Keras would save, and it runs as it is,
with its current weights. gradscope never changes it: its weights, compiled state and dtype
are the same afterwards (the loss gradscope chooses for an uncompiled model is computed
beside it, never compiled into it; ``check`` works on a float64 copy). Its layers' code is
the user's own, already running, so a Lambda or a custom layer is not refused as in a file: it
is run, and listed with its real gradient and "no derivation for this layer type".

Every report draws itself in Jupyter (``_repr_html_``: the terminal's tables, formulas and
flags), ``report.plot()`` returns a matplotlib Figure, ``report.to_dict()`` and
``report.to_json()`` give the ``--json`` document.

Importing gradscope does not import TensorFlow; ``explain`` does, quietly.
"""

from __future__ import annotations

from collections.abc import Callable
from os import PathLike
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gradscope.arrays import DataFiles
    from gradscope.report.models import (
        CheckReport,
        DiffReport,
        ExplainReport,
        FlowHistoryReport,
        KerasCheckReport,
        KerasExplainReport,
        KerasShapesReport,
        LayerCheckReport,
        ShapesReport,
        SpecInference,
    )
    from gradscope.yaml.config import Spec


def load_spec(source: Any = None) -> Spec:
    """A validated spec from a YAML path, a dict, or ``None`` (the embedded seed model)."""
    from gradscope.yaml.config import load_spec as _load_spec

    return _load_spec(source)


def _as_spec(source: Any) -> Spec:
    """What the API's first argument names, as a validated Spec: a YAML path, a dict, a Spec,
    or None (the embedded seed model). Anything else is refused in one line."""
    from gradscope.yaml.config import Spec

    if isinstance(source, Spec):
        return source
    if source is None or isinstance(source, str | PathLike | dict):
        return load_spec(source)
    from gradscope.errors import ConfigError

    raise ConfigError(f"the model: got an object of type {type(source).__name__}; expected a "
                      "YAML path, a "
                      "dict or a Spec (gradscope.load_spec), a saved model.keras path, or a "
                      "Keras model object (Sequential or functional)", where="spec")


def _drawn(report: Any) -> Any:
    """``report``, able to draw itself: the notebook's HTML and ``report.plot()`` come from
    renderers that register themselves when imported (the report models know nothing of
    them)."""
    import gradscope.report.display  # noqa: F401
    import gradscope.report.plot  # noqa: F401

    return report


def _is_keras(source: Any) -> bool:
    from gradscope.keras.archive import is_keras_file
    from gradscope.keras.live import is_live_model

    return is_keras_file(source) or is_live_model(source)


def _keras_job(source: Any, data: DataFiles | None, x: Any, y: Any, options: dict[str, Any],
               sample_weight: Any = None) -> Any:
    """A saved Keras model (read without TensorFlow) or a model object, with its batch.
    ``options``: batch_size, time_steps, loss, training, pad, seed (as the CLI's flags);
    ``data``: the .npz named by inputs and outputs; ``x``/``y``: arrays."""
    from gradscope import preflight
    from gradscope.arrays import DataFiles
    from gradscope.errors import ConfigError, flag, given
    from gradscope.keras.explain import prepare
    from gradscope.keras.live import is_live_model
    from gradscope.keras.options import KerasJobOptions

    checked = KerasJobOptions.from_options(options)
    files = data or DataFiles()
    preflight.check_keras_sizes(checked.batch_size, checked.time_steps, files)
    if files.x is not None or files.y is not None:
        raise ConfigError(f"{given('x', files.x or files.y)}: a Keras model takes its batch as "
                          f"{flag('data')} FILE.npz with arrays named after the model's inputs "
                          "and outputs (x and y for one of each)", where=flag("x"))
    return prepare(source if is_live_model(source) else str(source),
                   data=files.data, x=x, y=y, sample_weight=sample_weight,
                   batch_size=checked.batch_size, time_steps=checked.time_steps,
                   loss=checked.loss, training=checked.training, pad=checked.pad,
                   seed=checked.seed)


def _data_files(data: Any) -> Any:
    """``data`` as the API takes it: None, an .npz path (as :class:`DataFiles`), a
    :class:`DataFiles` (the CLI's ``--data`` or ``--x`` with ``--y``), or a dict of arrays (YAML
    specs). Files are checked to exist before anything loads."""
    from gradscope.arrays import DataFiles

    if isinstance(data, str | PathLike):
        data = DataFiles(data=str(data))
    if isinstance(data, DataFiles):
        data.check()
        return data if data.given() else None
    if data is None or isinstance(data, dict):
        return data
    from gradscope.errors import ConfigError

    raise ConfigError(f"data=: got an object of type {type(data).__name__}; expected the path "
                      "of an .npz file or, for a YAML spec, a dict of arrays", where="data")


def _keras_data(data: Any) -> DataFiles | None:
    if isinstance(data, dict):
        from gradscope.errors import ConfigError

        raise ConfigError("data=: for a Keras model, the path of an .npz file; pass arrays "
                          "as x= and y=", where="data")
    return data


def _limit(max_memory: int | str | None) -> int | None:
    """``max_memory`` in bytes, or as a size such as ``"4G"``."""
    if isinstance(max_memory, str):
        from gradscope.guard import parse_size

        return parse_size(max_memory)
    return max_memory


def shapes(spec: Any) -> ShapesReport | KerasShapesReport:
    """The shape algebra of ``spec``, of a saved ``model.keras`` or of a Keras model object
    (from its config, as a file's), without running anything: no TensorFlow is imported for a
    spec or a file."""
    from gradscope.yaml.shapes import shapes as _shapes

    if _is_keras(spec):
        from gradscope.keras.shapes import keras_shapes

        return _drawn(keras_shapes(spec if not isinstance(spec, PathLike) else str(spec)))
    spec = _as_spec(spec)

    return _drawn(_shapes(spec))


def _yaml_job(source: Any, data: DataFiles | dict[str, Any] | None, weights: Any, x: Any,
              y: Any, sample_weight: Any, keras_options: dict[str, Any],
              command: str) -> tuple[Spec, Any]:
    """A YAML spec, resized to the user's batch, and the batch (None: synthetic); a Keras
    model's options and arrays are refused first, and a weights file must exist."""
    from gradscope import preflight

    preflight.refuse_keras_options(keras_options, command)
    if x is not None or y is not None or sample_weight is not None:
        from gradscope.errors import ConfigError

        raise ConfigError("x=, y= and sample_weight= are for a Keras model; for a YAML spec "
                          "pass data={'x': ..., 'y': ...}", where="x")
    from gradscope.yaml.options import check_weights

    check_weights(weights)
    spec = _as_spec(source)
    if data is None:
        return spec, None
    from gradscope.yaml.data import load_batch, validate_batch

    if isinstance(data, dict):
        return validate_batch(spec, data, origin="the data")
    return load_batch(spec, data=data.data, x=data.x, y=data.y)


def explain(spec: Any = None, data: Any = None, weights: Any = None, chunks: int | None = None,
            *, x: Any = None, y: Any = None, sample_weight: Any = None, flow: bool = False,
            jacobians: bool = False, at: int | None = None, heatmap: bool = False,
            max_memory: int | str | None = None, timings: bool = False,
            progress: Callable[[str], None] | None = None,
            **keras_options: Any) -> ExplainReport | KerasExplainReport:
    """One forward/backward pass in TensorFlow, every gradient explained.

    ``spec`` is a YAML path, a dict or a Spec: ``data`` is then None (a synthetic batch from
    the seed), a path to an .npz file or a dict of arrays ``{"x": ..., "y": ...,
    "gru_1/h0": ...}``. ``weights`` is None (weights drawn from the spec's seed) or your
    trained weights: a path to an .npz file or a TensorFlow checkpoint (TF1 name-based or TF2
    object-based), or a dict of arrays. Their names may be gradscope's (``gru_1/w_ru``), TF1's
    (``GRU_Layer1/rnn/gru_cell/gates/kernel``) or Keras' (``sequential/gru/gru_cell/kernel``);
    they are matched to the spec's layers by scope order and shape, converted where the
    layouts differ, and ``report.weights.mapping`` says where each weight came from. A
    variable that is missing, extra or misshapen raises ConfigError, one line per variable.
    ``chunks`` (K ≥ 2, YAML specs) adds the carry in numbers under ``report.carry``: per
    weight ``l2_full``, ``l2_truncated``, ``l2_carried``. ``at`` (the step t of ‖∂h_t/∂x_s‖)
    and ``heatmap`` (‖∂h_t/∂x_s‖ over (t, s), drawn by ``report.plot()``) are for YAML specs
    and imply ``flow``.

    ``spec`` may instead be a Keras model: the path of a saved ``model.keras``, or the model
    object itself (Sequential or functional). Keras runs it, with:

    - ``x``: the inputs, NumPy or TensorFlow arrays: one array for a single input, a list in
      the model's input order, or a dict by input name (a float input is cast to its Input's
      dtype, as Keras does). ``y``: the targets, likewise by output; None: synthetic targets
      that match the loss. Without ``x``: a synthetic batch (or ``data``, an .npz path).
      ``sample_weight``: as ``fit`` takes it (one array, or a list or dict by output), with
      ``y``; the loss is weighed exactly as ``compute_loss`` weighs it.
    - ``keras_options`` as the CLI's flags: ``batch_size``, ``time_steps`` (synthetic batch),
      ``loss`` (a Keras loss name; default: the compiled loss, else inferred from the output),
      ``training`` (dropout and batch norm in training mode, seeded), ``pad``, ``seed``.
    - ``flow``: ‖∂L/∂h_t‖ per step of every recurrent call; ``jacobians``: ∂h_T/∂h_0.

    ``max_memory`` (bytes, or a size such as ``"4G"``; default a quarter of RAM) refuses,
    before TensorFlow is imported for a file, a run estimated to need more.
    ``progress(message)`` hears each phase as it starts; ``timings`` adds the seconds each
    phase took to the report.

    A shape or name that does not fit the model is a ConfigError/DataError naming the array
    (``x['tokens']``, ``y[1]``).
    """
    from gradscope import preflight
    from gradscope.yaml.memory import guard
    from gradscope.yaml.options import check_chunks, check_time_steps

    check_chunks(chunks)
    limit = _limit(max_memory)
    data = _data_files(data)
    if _is_keras(spec):
        preflight.refuse_yaml_options({"weights": weights, "chunks": chunks, "at": at,
                                       "heatmap": heatmap}, "explain")
        from gradscope.keras.explain import explain as _explain_keras
        from gradscope.keras.memory import guard as keras_guard

        job = _keras_job(spec, _keras_data(data), x, y, keras_options, sample_weight)
        keras_guard(job, "explain", limit)
        return _drawn(_explain_keras(job, progress=progress, timings=timings, flow=flow,
                                     jacobians=jacobians))
    spec, batch = _yaml_job(spec, data, weights, x, y, sample_weight, keras_options, "explain")
    check_time_steps(spec.time_steps, at=at)
    check_chunks(chunks, spec.time_steps)
    flow = flow or heatmap or at is not None
    guard(spec, "explain", limit, across_time=jacobians or flow, chunks=chunks)
    from gradscope.yaml.explain import explain as _explain

    return _drawn(_explain(spec, data=batch, weights=_read_weights(weights), chunks=chunks,
                           flow=flow, jacobians=jacobians, at=at, heatmap=heatmap,
                           progress=progress, timings=timings))


def check(spec: Any = None, against: Any = None, chunks: int | None = None,
          data: Any = None, layer: str | None = None, time_last: bool = False,
          weights: Any = None, *, x: Any = None, y: Any = None, sample_weight: Any = None,
          directions: int | None = None, rtol: float | None = None,
          atol: float | None = None, equations: bool = False,
          max_memory: int | str | None = None, timings: bool = False,
          progress: Callable[[str], None] | None = None, params: Any = None,
          after_autodiff: Callable[[Any], None] | None = None, examples: int | str | None = None,
          **keras_options: Any) -> CheckReport | KerasCheckReport | LayerCheckReport:
    """Verify every gradient with independent witnesses (see ``gradscope check --help``).

    ``against`` is ``"FILE.py:FUNC"`` or a callable ``FUNC(params, x, y, h0) -> dict``. The
    names it leaves out are in ``report.against_not_returned``; if it raises or returns no
    known name, ``ConfigError`` says where. With ``layer``, ``against`` is the backward of that
    one recurrent layer, ``FUNC(x, h0, params, dh) -> dict`` (``time_last``: arrays laid out
    (features, batch, time)); the report is a ``LayerCheckReport`` (see docs/check.md).
    ``chunks``: truncated BPTT in K chunks, the carry compared with full BPTT.
    ``weights``: your trained weights, as for :func:`explain`. (``params={"gru_1/w_ru": …}``,
    by gradscope name and in the spec's layout, also works: taken as they are, with no
    mapping reported.) ``equations``: the report, drawn, ends with GRUBlockCellGrad's
    corrected backward equations (block-layout GRUs).

    ``directions`` (random directions of the finite differences: per tensor for a spec,
    default 3; for a Keras model, joint directions that move every tensor at once, default 2,
    then 3 per tensor wherever a joint one disagrees; a number given serves both), ``rtol``
    (replaces every float64 tolerance) and ``atol`` (added to the finite differences) tune the
    witnesses; ``max_memory``, ``timings`` and ``progress`` are as for :func:`explain`.

    ``spec`` may be a Keras model, a ``model.keras`` path or the model object, with ``x``,
    ``y`` and the options of :func:`explain`: finite differences and the NumPy reference on a
    float64 copy of the model with the same weights, on at most ``examples`` examples of the
    batch (default 16: a mask's shortest and longest, the smallest and largest sample weight,
    the rest drawn with the seed; ``"all"``: every one; ``report.examples`` names them; a model
    whose Input fixes the batch size is checked whole). (``after_autodiff(model)`` runs on that
    copy between the tape and the witnesses: this project's tests change it there, to see the
    witnesses fail.)
    """
    from gradscope import preflight
    from gradscope.yaml.memory import guard
    from gradscope.yaml.options import check_time_steps

    preflight.check_layer_options(against, layer, time_last,
                                  {"chunks": chunks, "atol": atol, "equations": equations})
    preflight.check_witness_options(directions, rtol, atol)
    from gradscope.keras.checked_examples import examples_option

    most = examples_option(examples)
    limit = _limit(max_memory)
    data = _data_files(data)
    if _is_keras(spec):
        preflight.refuse_yaml_options({"weights": weights, "chunks": chunks, "against": against,
                                       "layer": layer, "time_last": time_last,
                                       "equations": equations, "params": params}, "check")
        from gradscope.keras.checked_examples import choose
        from gradscope.keras.memory import guard as keras_guard

        job = _keras_job(spec, _keras_data(data), x, y, keras_options, sample_weight)
        keras_guard(job, "check", limit, examples=choose(job, most).checked)
        from gradscope.keras.check import check as _check_keras

        return _drawn(_check_keras(job, directions=directions, rtol=rtol, atol=atol,
                                   progress=progress, timings=timings,
                                   after_autodiff=after_autodiff, examples=most))
    spec, batch = _yaml_job(spec, data, weights, x, y, sample_weight,
                            {**keras_options, "examples": examples}, "check")
    check_time_steps(spec.time_steps, chunks=chunks)
    if layer is not None:
        from gradscope.yaml.options import check_layer_name

        check_layer_name(spec, layer)
    guard(spec, "check", limit)
    weights = _read_weights(weights)
    if layer is not None:
        from gradscope.yaml.check.layer_backward import check_layer

        return _drawn(check_layer(spec, against, layer, time_last=time_last, rtol=rtol,
                                  data=batch, params=params, weights=weights,
                                  progress=progress, timings=timings))
    from gradscope.gradcheck import PER_TENSOR_DIRECTIONS
    from gradscope.yaml.check import check as _check

    report = _check(spec, against=against, chunks=chunks,
                    directions=PER_TENSOR_DIRECTIONS if directions is None else directions,
                    rtol=rtol, atol=atol, data=batch, weights=weights, params=params,
                    progress=progress, timings=timings)
    if equations:
        from gradscope.yaml.check.block_kernel import CORRECTED_EQUATIONS

        report.show_equations(CORRECTED_EQUATIONS)
    return _drawn(report)


def estimate_memory(spec: Any = None, command: str = "explain", data: Any = None, *,
                    x: Any = None, y: Any = None, across_time: bool = False,
                    chunks: int | None = None, examples: int | str | None = None,
                    **keras_options: Any) -> dict[str, int]:
    """What ``command`` ("explain" or "check") is estimated to hold at its peak, in bytes by
    term; their sum is what ``max_memory`` (``--max-memory``) is held against. ``spec`` and
    its batch as :func:`explain` takes them: a YAML spec (``across_time``: with ``flow`` or
    ``jacobians``; ``chunks`` as for explain) or a Keras model with its batch options (for
    check, ``examples`` as :func:`check` takes it). Nothing is run, and no TensorFlow is
    imported for a YAML spec or a saved file."""
    if command not in ("explain", "check"):
        from gradscope.errors import ConfigError

        raise ConfigError(f"command={command!r}: expected 'explain' or 'check'",
                          where="command")
    data = _data_files(data)
    if _is_keras(spec):
        from gradscope.keras.checked_examples import choose, examples_option
        from gradscope.keras.memory import estimate as keras_estimate

        most = examples_option(examples)
        job = _keras_job(spec, _keras_data(data), x, y, keras_options)
        return keras_estimate(job, command,
                              choose(job, most).checked if command == "check" else None)
    from gradscope.yaml.memory import estimate as yaml_estimate

    spec, _ = _yaml_job(spec, data, None, x, y, None, {**keras_options, "examples": examples},
                        command)
    return yaml_estimate(spec, command, across_time=across_time, chunks=chunks)


def infer_spec(source: Any, imports: Any = (), unsafe: bool = False) -> SpecInference:
    """The config that a checkpoint's or an .npz file's variable shapes imply (no TensorFlow
    for an .npz), or the one a saved ``model.keras`` is: ``report.yaml`` loads with
    :func:`load_spec`, ``report.inferences`` says why each value is what it is. Ambiguous or
    unknown variables raise ConfigError.

    A saved model's layers must be ones the YAML spec holds (Keras GRU, LSTM, SimpleRNN, then
    Dense, as :mod:`gradscope.keras.yaml_form` says), else ConfigError names the first that is
    not; ``imports`` and ``unsafe`` load its classes of your own as :func:`load_model` does.
    The spec's own forward pass must predict what Keras predicts, or it is refused."""
    from gradscope.yaml.inference import infer_spec as _infer_spec

    if _is_keras_path(source):
        from gradscope.keras.yaml_form import read_saved_form
        from gradscope.yaml.weights import SavedArrays

        saved = read_saved_form(str(source), _imports(imports), unsafe)
        return _infer_spec(SavedArrays(saved.arrays, saved.source), saved)
    if imports or unsafe:
        from gradscope import preflight

        shown = str(source) if isinstance(source, str | PathLike) else "the arrays"
        preflight.check_user_code(shown, _imports(imports), unsafe)
    return _infer_spec(source)


def _read_weights(weights: Any) -> Any:
    """``weights``, with a saved ``model.keras`` read into its layers' arrays (the YAML spec's
    kind of model only: see :func:`infer_spec`); anything else as it is."""
    if not _is_keras_path(weights):
        return weights
    from gradscope.keras.yaml_form import read_saved_form
    from gradscope.yaml.weights import SavedArrays

    return SavedArrays(read_saved_form(str(weights)).arrays, str(weights))


def _is_keras_path(source: Any) -> bool:
    return isinstance(source, str | PathLike) and str(source).endswith(".keras")


def _imports(imports: Any) -> tuple[str, ...]:
    return (imports,) if isinstance(imports, str) else tuple(imports)


def watch(log_dir: str | PathLike[str]) -> FlowHistoryReport:
    """What ``gradscope.keras.GradientFlow(log_dir=...)`` wrote during training, read back from
    its TensorBoard event files without TensorFlow (needs the tensorboard package)."""
    from gradscope.training_log import watch as _watch

    return _drawn(_watch(log_dir))


def load_model(path: str | PathLike[str], imports: Any = (), unsafe: bool = False) -> Any:
    """A saved ``.keras`` model whose file names classes of the user's own code, as a Keras
    model object to hand to :func:`explain`, :func:`check` or :func:`shapes` (as the CLI's
    ``--import`` and ``--unsafe`` do). ``imports``: module names or ``.py`` paths, imported
    first so that their ``register_keras_serializable`` classes load under
    ``safe_mode=True``. ``unsafe=True`` loads with ``safe_mode=False``: Keras then runs the
    Python code stored inside the file (a Lambda layer's function). Imports TensorFlow."""
    from gradscope.keras.user_code import load_user_model

    return load_user_model(str(path), _imports(imports), unsafe)


def diff(base: Any, new: Any, rtol: float | None = None) -> DiffReport:
    """What changed in the gradients between two explain reports of the same model inputs
    and data (each a path to an ``explain --json`` document, its dict, or a report object):
    shapes added, removed or changed, ‖g‖ drifting beyond ``rtol`` (default
    ``gradscope.drift.DEFAULT_RTOL``, 1e-4), new NaN/Inf, flipped vanishing/exploding flags,
    the loss. ``report.drifted`` is the verdict. Reports of different data, batch size, seed
    or inputs raise ConfigError. No TensorFlow."""
    from gradscope.drift import DEFAULT_RTOL
    from gradscope.drift import diff as _diff

    return _drawn(_diff(base, new, DEFAULT_RTOL if rtol is None else rtol))


__all__ = ["__version__", "check", "diff", "explain", "infer_spec", "load_model", "load_spec",
           "shapes", "watch"]
