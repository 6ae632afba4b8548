"""gradscope: explain and verify the gradients of recurrent TensorFlow models.

The public API; the CLI is a thin layer over exactly these functions. Each takes a model of
either wing, a YAML spec or a Keras model (a saved ``.keras`` file or the model object), asks
once which wing it belongs to, and returns a report that renders as text, as the ``--json``
document (``report.to_dict()``), as HTML in Jupyter and with ``report.plot()``. A Keras
model runs as it is, and is left as it was. Importing gradscope does not import TensorFlow.
docs/notebook.md has a tour of every call.
"""

from __future__ import annotations

from collections.abc import Callable
from os import PathLike
from typing import TYPE_CHECKING, Any

from gradscope import front

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gradscope.report import models as reports
    from gradscope.yaml.config import Spec


def load_spec(source: Any = None) -> Spec:
    """A validated YAML spec.

    Args:
        source: A YAML path, a dict, or None (the embedded seed model).

    Raises:
        ConfigError: a key that is missing, unknown or out of range, named.
    """
    from gradscope.yaml.config import load_spec as _load_spec

    return _load_spec(source)


def shapes(spec: Any) -> reports.ShapesReport | reports.KerasShapesReport:
    """The shape algebra of a model, without running anything.

    Args:
        spec: A YAML path, a dict, a Spec or None (the seed model); a saved ``model.keras``
            path; or a Keras model object (read from its config, as a file's).

    Returns:
        A report of every gradient's shape, with the formula that gives it.

    Raises:
        ConfigError: the model cannot be read, or a layer is not one gradscope reads.

    No TensorFlow is imported for a spec or a file.

    Example:
        >>> import gradscope
        >>> spec = {"input_size": 136, "time_steps": 10, "batch_size": 4,
        ...         "layers": [{"gru": 64}, {"dense": 10}]}
        >>> report = gradscope.shapes(spec)
        >>> report.tensors[0].name, report.tensors[0].shape, report.tensors[0].formula
        ('gru_1/w_ru', [200, 128], '(input 136 + units 64) × 2·units 64')
    """
    return front.drawn(front.wing(spec).shapes(spec))


def explain(spec: Any = None, data: Any = None, weights: Any = None, chunks: int | None = None,
            *, x: Any = None, y: Any = None, sample_weight: Any = None, flow: bool = False,
            jacobians: bool = False, at: int | None = None, heatmap: bool = False,
            per_example: bool = False, max_memory: int | str | None = None, timings: bool = False,
            progress: Callable[[str], None] | None = None,
            **keras_options: Any) -> reports.ExplainReport | reports.KerasExplainReport:
    """One forward and backward pass, every gradient explained.

    Args:
        spec: The model. A YAML path, a dict or a Spec, or None for the embedded seed model;
            or a Keras model: a saved ``model.keras`` path or the model object (Sequential,
            functional or subclassed), run by Keras as it is.
        data: The batch. For a YAML spec: None (synthetic, from the seed), an .npz path or a
            dict of arrays ``{"x": ..., "y": ..., "gru_1/h0": ...}``. For a Keras model: an
            .npz path with arrays named after its inputs and outputs.
        weights: YAML specs: trained weights (an .npz, a TF1 or TF2 checkpoint, a dict, or a
            saved ``model.keras``), matched to the layers by scope order and shape;
            ``report.weights.mapping`` says where each came from.
        chunks: K ≥ 2 adds truncated BPTT, with and without the carry, under
            ``report.carry`` (a Keras model: each recurrent call in K chunks of its steps).
        x: Keras models: the inputs, one array, a list in input order or a dict by name.
        y: Keras models: the targets, likewise; None gives synthetic targets for the loss
            (with x given, the report warns that its gradients are of them).
        sample_weight: Keras models: as ``fit`` takes it, weighed as ``compute_loss`` does.
        flow: ‖∂L/∂h_t‖ per step of every recurrent layer.
        jacobians: ∂h_T/∂h_0 of every recurrent layer.
        at: The step t of the influence ‖∂h_t/∂x_s‖ (implies ``flow``).
        heatmap: ‖∂h_t/∂x_s‖ over (t, s), drawn by ``report.plot()`` (implies ``flow``).
        per_example: Keras models: each example's gradient norm, per layer and in total, the
            share the top examples carry, the outliers and the gradient noise scale, under
            ``report.per_example``.
        max_memory: Bytes, or a size such as ``"4G"`` (default a quarter of RAM): a run
            estimated to need more is refused before TensorFlow is imported for a file.
        timings: Add the seconds each phase took.
        progress: ``progress(message)`` hears each phase as it starts.
        **keras_options: Keras models, as the CLI's flags: ``batch_size``, ``time_steps``
            (of a synthetic batch), ``loss`` (a Keras loss name; default the compiled one),
            ``training`` (dropout and batch norm in training mode, seeded), ``pad``, ``seed``.

    Returns:
        The report: ``report.to_dict()`` is the ``--json`` document, and it draws itself
        in Jupyter and with ``report.plot()``. For a Keras model whose loss or a gradient is
        not finite, ``report.nonfinite`` says where the first NaN or Inf was born.

    Raises:
        ConfigError: an option the model does not take, or a model gradscope cannot read.
        DataError: an array that does not fit the model, named (``x['tokens']``, ``y[1]``).

    Example:
        >>> import gradscope
        >>> spec = {"input_size": 3, "time_steps": 5, "batch_size": 2,
        ...         "layers": [{"gru": 4}, {"dense": 2}]}
        >>> report = gradscope.explain(spec)
        >>> report.loss.name
        'softmax_cross_entropy'
    """
    options = {"weights": weights, "chunks": chunks, "flow": flow, "jacobians": jacobians,
               "at": at, "heatmap": heatmap, **keras_options}
    if per_example:
        options["per_example"] = per_example
    return front.run("explain", spec, data, x, y, sample_weight, options, max_memory, progress,
                timings)


def check(spec: Any = None, against: Any = None, chunks: int | None = None,
          data: Any = None, layer: str | None = None, time_last: bool = False,
          weights: Any = None, *, x: Any = None, y: Any = None, sample_weight: Any = None,
          directions: int | None = None, rtol: float | None = None,
          atol: float | None = None, equations: bool = False,
          max_memory: int | str | None = None, timings: bool = False,
          progress: Callable[[str], None] | None = None, params: Any = None,
          after_autodiff: Callable[[Any], None] | None = None, examples: int | str | None = None,
          **keras_options: Any,
          ) -> reports.CheckReport | reports.KerasCheckReport | reports.LayerCheckReport:
    """Verify every gradient against independent witnesses (finite differences, the NumPy
    reference, and more; docs/check.md).

    Args:
        spec, data, weights, x, y, sample_weight, max_memory, timings, progress,
            **keras_options: As for :func:`explain`. A Keras model is checked on a float64
            copy with the same weights, or in its own dtype where its code does not run in
            float64 (the report says why, and what it costs).
        against: YAML specs: your backward, ``"FILE.py:FUNC"`` or a callable
            ``FUNC(params, x, y, h0) -> dict``; with ``layer``, one recurrent layer's
            backward ``FUNC(x, h0, params, dh) -> dict`` (a ``LayerCheckReport``).
        chunks: truncated BPTT in K chunks, carried, against full BPTT (a Keras model's:
            its own tape).
        layer: YAML specs: the recurrent layer ``against`` is the backward of.
        time_last: With ``layer``: arrays laid out (features, batch, time).
        directions: Random directions of the finite differences (YAML: per tensor, default
            3; Keras: joint, default 2, then 3 per tensor where a joint one disagrees).
        rtol: Replaces every float64 tolerance.
        atol: Added to the finite differences' tolerance.
        equations: YAML specs: end with GRUBlockCellGrad's corrected equations.
        params: YAML specs: weights by gradscope name, in the spec's layout, taken as they
            are.
        after_autodiff: ``after_autodiff(model)`` runs between the tape and the witnesses
            (this project's tests plant wrong gradients there, to see the witnesses fail).
        examples: Keras models: check at most this many examples of the batch (default 16,
            chosen to include a mask's shortest and longest; ``"all"``: every one).

    Returns:
        The report: ``report.summary.passed`` is the verdict, each tensor with its witnesses
        (a Keras model whose loss or a gradient is not finite fails with
        ``report.nonfinite``, where the first NaN or Inf was born, and compares nothing).

    Raises:
        ConfigError: an option the model does not take, or a model check cannot witness.
        DataError: an array that does not fit the model.

    Example:
        >>> import gradscope
        >>> spec = {"input_size": 3, "time_steps": 5, "batch_size": 2,
        ...         "layers": [{"gru": 4}, {"dense": 2}]}
        >>> gradscope.check(spec).summary.passed
        True
    """
    options = {"against": against, "chunks": chunks, "layer": layer, "time_last": time_last,
               "weights": weights, "directions": directions, "rtol": rtol, "atol": atol,
               "equations": equations, "params": params, "after_autodiff": after_autodiff,
               "examples": examples, **keras_options}
    return front.run("check", spec, data, x, y, sample_weight, options, max_memory, progress,
                timings)


def diagnose(model: Any, data: Any = None, *, x: Any = None, y: Any = None,
             sample_weight: Any = None, exponents: int | None = None,
             counterfactuals: bool = True, weights: Any = None,
             max_memory: int | str | None = None, timings: bool = False,
             progress: Callable[[str], None] | None = None,
             **keras_options: Any) -> reports.DiagnoseReport:
    """Why the gradients of each recurrent call vanish or explode, measured on the batch.

    Every recurrent call is stepped through the cell the model holds, along the batch's own
    trajectory: the spectral norm of each step Jacobian, the Lyapunov spectrum, the gates and
    unit timescales (GRU, LSTM), the memory horizon (measured and predicted from λ₁), where
    ∂L/∂s_t grows, the optimizer's clipping, and a verdict in words (docs/diagnose.md).

    Args:
        model: A Keras model (a saved ``model.keras`` path or the model object), or a YAML
            spec (a path, a dict, a Spec, or None: the embedded seed model), whose model is
            built from Keras' own layers with the spec's weights (held to the spec's NumPy
            predictions) and diagnosed as such.
        data, x, y, sample_weight, max_memory, timings, progress, **keras_options: As for
            :func:`explain`.
        exponents: How many Lyapunov exponents (default 8; every one when the state has at
            most 32 numbers).
        counterfactuals: Measure each change (keep-gate bias +1, an orthogonal recurrent
            kernel, the clipping the batch suggests) on a copy of the model (the model
            itself where Keras cannot copy it, each change undone after its run), run again
            on the batch; False skips those reruns.
        weights: For a YAML spec: its trained weights, as :func:`explain` reads them.

    Returns:
        The report: ``report.layers`` one entry per recurrent call (per direction of a
        Bidirectional), each with its ``verdict``; ``report.to_dict()`` is the ``--json``
        document.

    Raises:
        ConfigError: an option the model does not take, or a model gradscope cannot read.
        DataError: an array that does not fit the model.

    Example:
        >>> report = gradscope.diagnose("model.keras")  # doctest: +SKIP
        >>> print(report.layers[0].verdict)  # doctest: +SKIP
        lstm: vanishing: 100% of forget-gate values below 0.1, median τ 0.2 steps, so …
    """
    options = {"exponents": exponents, "counterfactuals": counterfactuals, **keras_options}
    if front.wing(model).__name__.startswith("gradscope.keras."):
        # weights= goes to the wing, which says why a Keras model takes none.
        return front.run("diagnose", model, data, x, y, sample_weight,
                         {**options, **({} if weights is None else {"weights": weights})},
                         max_memory, progress, timings)
    return front.diagnose_spec(model, data, x, y, sample_weight, weights, options,
                               max_memory, progress, timings)


def estimate_memory(spec: Any = None, command: str = "explain", data: Any = None, *,
                    x: Any = None, y: Any = None, across_time: bool = False,
                    chunks: int | None = None, examples: int | str | None = None,
                    **keras_options: Any) -> dict[str, int]:
    """What a command is estimated to hold at its peak, without running it.

    Args:
        spec, data, x, y, **keras_options: The model and its batch, as :func:`explain`
            takes them.
        command: ``"explain"`` or ``"check"``.
        across_time: With ``flow`` or ``jacobians`` (a Keras model: explain's
            ``jacobians``).
        chunks: as for :func:`explain`.
        examples: Keras models, for check: as :func:`check` takes it.

    Returns:
        Bytes by term; their sum is what ``max_memory`` (``--max-memory``) is held against.

    Raises:
        ConfigError: an unknown command, or an option the model does not take.

    No TensorFlow is imported for a YAML spec or a saved file.

    Example:
        >>> import gradscope
        >>> spec = {"input_size": 3, "time_steps": 5, "batch_size": 2, "layers": [{"gru": 8}]}
        >>> terms = gradscope.estimate_memory(spec, "check")
        >>> sum(terms.values()) > 0
        True
    """
    if command not in ("explain", "check"):
        from gradscope.errors import ConfigError

        raise ConfigError(f"command={command!r}: expected 'explain' or 'check'",
                          where="command")
    options = {"chunks": chunks, "examples": examples, **keras_options}
    chosen, ready = front.prepared(command, spec, data, x, y, None, options)
    return chosen.estimate(ready, across_time=across_time)


def infer_spec(source: Any, imports: Any = (), unsafe: bool = False) -> reports.SpecInference:
    """The YAML config that a checkpoint, an .npz file or a saved model implies.

    Args:
        source: A TF checkpoint or an .npz file (its variables' shapes; no TensorFlow for an
            .npz), or a saved ``model.keras`` whose layers are ones a YAML spec holds (Keras
            GRU, LSTM, SimpleRNN, then Dense).
        imports: Module names or ``.py`` paths of your classes, as for :func:`load_model`.
        unsafe: Load with ``safe_mode=False``, as for :func:`load_model`.

    Returns:
        ``report.yaml`` loads with :func:`load_spec`; ``report.inferences`` says why each
        value is what it is.

    Raises:
        ConfigError: an ambiguous or unknown variable, a layer a YAML spec does not hold, or
            a spec whose own forward pass does not predict what Keras predicts.

    Example:
        >>> import gradscope  # doctest: +SKIP
        >>> print(gradscope.infer_spec("model.ckpt").yaml)  # doctest: +SKIP
    """
    from gradscope.yaml.inference import infer_spec as _infer_spec

    if front.is_keras_path(source):
        from gradscope.keras.yaml_form import read_saved_form
        from gradscope.yaml.weights import SavedArrays

        saved = read_saved_form(str(source), front.imports_of(imports), unsafe)
        return _infer_spec(SavedArrays(saved.arrays, saved.source), saved)
    from gradscope.yaml.options import check_weights

    check_weights(source, option="")
    if imports or unsafe:
        from gradscope import preflight

        shown = str(source) if isinstance(source, str | PathLike) else "the arrays"
        preflight.check_user_code(shown, front.imports_of(imports), unsafe)
    return _infer_spec(source)


def watch(log_dir: str | PathLike[str]) -> reports.FlowHistoryReport:
    """What ``gradscope.keras.GradientFlow(log_dir=...)`` wrote during training.

    Args:
        log_dir: The callback's ``log_dir``; its TensorBoard event files are read without
            TensorFlow (the tensorboard package reads them).

    Returns:
        The history: per recurrent layer and step, the flow and its flags.
    """
    from gradscope.training_log import watch as _watch

    return front.drawn(_watch(log_dir))


def load_model(path: str | PathLike[str], imports: Any = (), unsafe: bool = False) -> Any:
    """A saved ``.keras`` model that names classes of your own code, as a Keras model object
    for :func:`explain`, :func:`check` or :func:`shapes` (the CLI's ``--import``).

    Args:
        path: The ``.keras`` file.
        imports: Module names or ``.py`` paths, imported first so that their
            ``register_keras_serializable`` classes load under ``safe_mode=True``.
        unsafe: Load with ``safe_mode=False``: Keras then runs the Python code stored in the
            file (a Lambda layer's function). Only for files you trust.

    Returns:
        The Keras model. TensorFlow is imported.

    Raises:
        ConfigError: a class the file names and no import registers, or code in the file
            without ``unsafe``.

    Example:
        >>> model = gradscope.load_model("model.keras", imports=["my_layers"])  # doctest: +SKIP
        >>> gradscope.check(model).summary.passed  # doctest: +SKIP
        True
    """
    from gradscope.keras.user_code import load_user_model

    return load_user_model(str(path), front.imports_of(imports), unsafe)


def diff(base: Any, new: Any, rtol: float | None = None) -> reports.DiffReport:
    """What changed in the gradients between two explain reports of the same model inputs
    and data: shapes added, removed or changed, ‖g‖ drifting beyond ``rtol``, new NaN or Inf,
    flipped vanishing or exploding flags, the loss. No TensorFlow.

    Args:
        base: The earlier report: the path of an ``explain --json`` document, its dict, or a
            report object.
        new: The later report, likewise.
        rtol: The relative drift of ‖g‖ that counts (default ``gradscope.drift.DEFAULT_RTOL``,
            1e-4).

    Returns:
        The report; ``report.drifted`` is the verdict.

    Raises:
        ConfigError: reports of different data, batch size, seed or inputs.

    Example:
        >>> report = gradscope.diff("base.json", "new.json")  # doctest: +SKIP
        >>> report.drifted  # doctest: +SKIP
        False
    """
    from gradscope.drift import DEFAULT_RTOL
    from gradscope.drift import diff as _diff

    return front.drawn(_diff(base, new, DEFAULT_RTOL if rtol is None else rtol))


__all__ = ["__version__", "check", "diagnose", "diff", "explain", "infer_spec", "load_model",
           "load_spec", "shapes", "watch"]
