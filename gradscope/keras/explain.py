"""``gradscope explain MODEL.keras``: the user's own model, run by Keras, explained layer by
layer. :func:`prepare` does everything that needs no TensorFlow (and refuses early);
:func:`explain` runs the model once under the tape and builds the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradscope.errors import ConfigError, InternalError
from gradscope.keras.data import (
    InputSpec,
    KerasBatch,
    arrays_batch,
    batch_targets,
    drawn_targets,
    input_specs,
    load_named,
    synthetic_inputs,
    unused_targets,
)
from gradscope.keras.facts import layer_facts, no_derivation
from gradscope.keras.graph import YOUR_CALL, LayerNode, ModelGraph, mode_effects
from gradscope.keras.layers import deriving_explainer
from gradscope.keras.layers.base import StateNote
from gradscope.keras.live import LOADED_FROM
from gradscope.keras.loss import LossPlan, output_aliases, output_names
from gradscope.keras.weight_names import weight_names
from gradscope.report.models import (
    BlockEntry,
    CrossCheckEntry,
    KerasExplainReport,
    KerasGradientEntry,
    KerasLayerEntry,
    KerasLossEntry,
    KerasLossTerm,
    KerasModelEntry,
    KerasOutputLoss,
    KerasStateEntry,
    KerasTensorSpec,
    SparseRows,
)
from gradscope.timing import Clock, Progress


@dataclass(frozen=True)
class KerasJob:
    """A model, read and checked (for a saved one: without TensorFlow), with the batch to run
    it on. ``model`` is the user's model object when it came from memory (``path`` then names
    it for messages); None for a ``.keras`` file."""

    path: str
    graph: ModelGraph
    plan: LossPlan
    inputs: list[InputSpec]
    outputs: list[str]
    batch: KerasBatch
    batch_size: int
    training: bool
    seed: int
    model: Any = None

    @property
    def source(self) -> Any:
        """What :class:`~gradscope.keras.engine.KerasEngine` loads: the path or the object."""
        return self.path if self.model is None else self.model


def prepare(path: Any, batch_size: int | None = None, time_steps: int | None = None,
            loss: str | None = None, training: bool = False, pad: int = 0,
            data: str | None = None, seed: int = 0, x: Any = None, y: Any = None,
            sample_weight: Any = None) -> KerasJob:
    """Read the model's structure, choose the loss, make or load the batch: no TensorFlow for
    a saved model. ``path`` may be a Keras model object instead (Keras is then imported
    already): its graph is read from the config it would save, and its code is not refused,
    since it is the user's own code, already running. ``x``/``y``: arrays from Python (see
    :func:`~gradscope.keras.data.arrays_batch`) instead of ``data``."""
    from gradscope.keras.live import is_live_model, read_model
    from gradscope.keras.subclassed import data_dtypes, file_dtypes, is_subclassed

    # A subclassed model's graph is read from a symbolic call with its data's dtypes.
    dtypes = data_dtypes(x)
    if (dtypes is None and data is not None and is_live_model(path)
            and is_subclassed(path)):
        dtypes = file_dtypes(data)
    graph, plan, path, model = read_model(path, loss, dtypes)
    specs = input_specs(graph)
    outputs = output_names(graph)
    fixed = _fixed_batch(specs)
    if sample_weight is not None and x is None:
        raise ConfigError("sample_weight= was given without x= and y=; weights go with your "
                          "own batch (in an .npz: an array named sample_weight)",
                          where="sample_weight")
    if x is not None or y is not None:
        if x is None:
            raise ConfigError("y= was given without x=; pass the inputs too", where="x")
        if data is not None or pad:
            raise ConfigError(f"{'data' if data is not None else 'pad'}= and x= both give the "
                              "batch; pass one of them", where="x")
        batch = arrays_batch(specs, outputs, x, y, output_aliases(graph), sample_weight)
    elif data is not None:
        if pad:
            raise ConfigError("--pad pads the synthetic batch; pad your own data in the file",
                              where="--pad")
        batch = load_named(data, specs, outputs, output_aliases(graph),
                           read=None if plan.custom_compute_loss else
                           {entry.output for entry in plan.outputs})
    else:
        _time_steps_read(specs, time_steps)
        batch = synthetic_inputs(specs, batch_size or fixed or 32, time_steps, pad, seed)
    size = next(iter(batch.inputs.values())).shape[0]
    if fixed is not None and size != fixed:
        given = ("--batch-size" if x is None and data is None
                 else "x=" if x is not None else str(data))
        raise ConfigError(f"{given}: a batch of {size}, but the model's input has a fixed "
                          f"batch size of {fixed} (its Input's batch_shape; a stateful layer "
                          f"needs it); give {fixed} examples", where=given)
    return KerasJob(path=path, graph=graph, plan=plan, inputs=specs, outputs=outputs,
                    batch=batch, batch_size=int(size), training=training, seed=seed,
                    model=model)


def _fixed_batch(specs: list[InputSpec]) -> int | None:
    """The batch size an Input fixes (``batch_shape=(4, ...)``, as a stateful model needs)."""
    sizes = {int(spec.shape[0]) for spec in specs if spec.shape and spec.shape[0] is not None}
    return min(sizes) if sizes else None


def _time_steps_read(specs: list[Any], time_steps: int | None) -> None:
    """``--time-steps`` sets a time axis that is None; a model whose every input fixes its own
    to another length would run with that length, silently: refused instead."""
    timed = {spec.name: spec.shape[1] for spec in specs if len(spec.shape) > 1}
    if time_steps is None or not timed or any(steps is None for steps in timed.values()):
        return
    if any(steps != time_steps for steps in timed.values()):
        listed = ", ".join(f"'{name}' {steps}" for name, steps in timed.items())
        raise ConfigError(f"--time-steps {time_steps}: the model's inputs fix their time axis "
                          f"({listed} steps); --time-steps is for a time axis that is None",
                          where="--time-steps")


def loaded(job: KerasJob, say: Progress, clock: Clock) -> tuple[Any, dict[str, np.ndarray]]:
    """The engine of ``job``'s model (TensorFlow imported, the model loaded with
    ``safe_mode``) and the targets its batch is run with (drawn where the batch has none)."""
    from gradscope.keras.engine import KerasEngine

    say("importing TensorFlow and loading the model (safe_mode)")
    engine = KerasEngine(job.source, job.outputs, job.plan, training=job.training, seed=job.seed)
    clock.lap("load")
    return engine, batch_targets(job.plan, job.batch.targets,
                                 engine.output_shapes(job.batch.inputs), job.seed,
                                 job.batch.path)


def explain(job: KerasJob, progress: Progress | None = None, timings: bool = False,
            flow: bool = False, jacobians: bool = False, at: int | None = None,
            heatmap: bool = False, chunks: int | None = None,
            per_example: bool = False) -> KerasExplainReport:
    """``flow``: ‖∂L/∂h_t‖ (with the recurrence) of every recurrent call and ‖∂L/∂x_t‖ of every
    float sequence input; ``jacobians``: ∂h_T/∂h_0 of every recurrent call; ``at`` (or
    ``heatmap``, over up to 16 steps t): the influence ‖∂h_t/∂x_s‖ of every recurrent
    call (both imply ``flow``); ``chunks``: truncated BPTT in that many chunks, with and
    without the carry; ``per_example``: each example's gradient norms (see
    :mod:`~gradscope.keras.per_example`). Under a mixed dtype policy, always: what the
    compute dtype loses at the loss scale (:mod:`~gradscope.keras.mixed_precision`)."""
    flow = flow or heatmap or at is not None
    say = progress or (lambda message: None)
    clock = Clock()
    engine, targets = loaded(job, say, clock)
    say("running the model forward and backward under the tape")
    result = engine.run(job.batch.inputs, targets, watch_outputs=flow, watch_inputs=flow,
                        sample_weight=job.batch.sample_weight, probe_states=flow)
    clock.lap("forward_backward")
    report = _report(job, engine, result)
    clock.lap("explain")
    update: dict[str, Any] = {}
    from gradscope.keras.nonfinite import all_finite, diagnose

    if not all_finite(result):
        say("a number is not finite: where it was born, on this batch")
        nonfinite = diagnose(engine, job.batch.inputs, targets, job.batch.sample_weight,
                             result)
        clock.lap("nonfinite")
        skipped = [name for name, asked in (("--flow", flow), ("--jacobians", jacobians),
                                            ("--chunks", chunks is not None),
                                            ("--per-example", per_example)) if asked]
        report = report.model_copy(update={"nonfinite": nonfinite, "warnings": [
            *report.warnings, *([f"{', '.join(skipped)} not computed: the numbers are not "
                                 "finite"] if skipped else [])]})
        flow = jacobians = heatmap = per_example = False
        at = chunks = None
    if flow:
        from gradscope.keras.flow import gradient_flow

        say("gradient flow: the total ∂L/∂h_t of every recurrent call")
        update["gradient_flow"] = gradient_flow(job, engine, result)
        clock.lap("flow")
        if heatmap or at is not None:
            from gradscope.keras.flow import influences

            say("the influence ‖∂h_t/∂x_s‖ of every recurrent call")
            update["gradient_flow"] = update["gradient_flow"].model_copy(update={
                "influence": influences(engine, result, at, heatmap)})
            clock.lap("influence")
    if jacobians:
        from gradscope.keras.flow import state_jacobians

        say("state Jacobians ∂h_T/∂h_0 of every recurrent call: " + jacobian_sizes(result))
        update["state_jacobians"] = state_jacobians(job, engine, result)
        clock.lap("jacobians")
    if chunks is not None:
        from gradscope.keras.truncation import carry_section

        say(f"truncated BPTT in {chunks} chunks, with and without the carry")
        names = {entry.path: entry.name for entry in report.gradients if entry.trainable}
        update["carry"] = carry_section(engine, job.batch.inputs, targets,
                                        job.batch.sample_weight, result.gradients, names,
                                        chunks)
        clock.lap("carry")
    if per_example:
        from gradscope.keras.per_example import per_example as examples_section

        say("per-example gradients: the batched backward pass, split by example")
        update["per_example"] = examples_section(
            engine, job.batch.inputs, targets, job.batch.sample_weight,
            {entry.path: entry.layer for entry in report.gradients if entry.trainable})
        clock.lap("per_example")
    if report.nonfinite is None:
        from gradscope.keras.mixed_precision import compute_dtype, mixed_precision

        if compute_dtype(engine.model) is not None:
            say("mixed precision: the scaled backward against a float32 shadow")
            update["mixed_precision"] = mixed_precision(engine, job.batch.inputs, targets,
                                                        job.batch.sample_weight)
            clock.lap("mixed_precision")
    if update:
        report = report.model_copy(update=update)
    if timings:
        report = report.model_copy(update={"timings": clock.laps()})
    return report


# -- the report -----------------------------------------------------------------------------------


def _batchless(shape: tuple[int, ...]) -> tuple[int | None, ...]:
    return (None, *shape[1:])


def jacobian_sizes(result: Any) -> str:
    """What ``--jacobians`` will carry, call by call (``result``: a KerasPass): as many
    tangents as the call's state has numbers per example, each through every step (what its
    time goes by)."""
    from gradscope.keras.engine import call_label

    sizes = []
    for call in result.calls:
        if not call.states or not call.args or len(np.shape(call.args[0])) < 3:
            continue
        width = sum(int(np.prod(np.shape(s)[1:])) for s in call.states)
        steps = int(np.shape(call.args[0])[1])
        sizes.append(f"{call_label(call.layer, call.index)} {width:,} tangents × {steps:,} "
                     "steps")
    return ", ".join(sizes) if sizes else "none"


def _report(job: KerasJob, engine: Any, result: Any) -> KerasExplainReport:
    from gradscope.gradient_stats import stats

    graph, model = job.graph, engine.model
    calls = {(c.layer, c.index): c for c in result.calls}
    layers: list[KerasLayerEntry] = []
    gradients: list[KerasGradientEntry] = []
    states: list[KerasStateEntry] = []
    witnesses: list[CrossCheckEntry] = []
    trainable_ids = {id(v) for v in model.trainable_variables}
    names = weight_names(graph, engine.operation, model)
    seen: set[int] = set()
    for node in graph.computing_layers:
        call = calls.get((node.name, 0))
        outs = ([_batchless(tuple(int(d) for d in o.shape)) for o in call.outputs]
                if call is not None else [])
        facts = layer_facts(graph, node, _positional_shapes(node, call), outs)
        explainer = deriving_explainer(node.class_name, node.module, facts)
        notes = {}
        if explainer is not None:
            try:
                notes = {note.key: note for note in explainer.weights(facts)}
            except (KeyError, ValueError, TypeError) as exc:
                raise InternalError(f"internal error: layer {node.name} ({node.class_name}): "
                                    f"its algebra failed: {exc}; please report it") from None
        layers.append(KerasLayerEntry(
            name=node.name, class_name=node.class_name, calls=len(node.calls),
            input_shapes=[list(s) for s in facts.input_shapes],
            output_shapes=[list(s) for s in facts.output_shapes],
            summary=(explainer.summary(facts) if explainer
                     else _plain_summary(node.class_name, engine.operation(node.name))),
            gradient_note=(explainer.gradient_note(facts) if explainer
                           else no_derivation(node)),
            derivation=explainer is not None))
        keras_layer = engine.operation(node.name)
        for variable in getattr(keras_layer, "weights", []):
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            key = names[id(variable)].key
            shape = [int(d) for d in variable.shape]
            note = notes.get(key)
            if explainer is not None and note is None:
                raise InternalError(f"internal error: layer {node.name} ({node.class_name}) has "
                                    f"the weight {variable.path}, which gradscope's algebra for "
                                    f"{node.class_name} does not know; please report it")
            if note is not None and list(note.shape) != shape:
                raise InternalError(f"internal error: {variable.path} is {tuple(shape)} in "
                                    f"Keras, but the algebra says {note.shape} = "
                                    f"{note.formula}; please report it")
            trainable = id(variable) in trainable_ids
            gradient = result.gradients.get(variable.path) if trainable else None
            meaning = note.meaning if note else no_derivation(node, weight=True)
            if not trainable:
                meaning += "; non-trainable: it gets no gradient"
            elif gradient is None:
                meaning += "; it does not reach the loss: no gradient"
            sparse = result.sparse_rows.get(variable.path)
            gradients.append(KerasGradientEntry(
                name=f"{node.name}/{key}", path=variable.path, layer=node.name,
                class_name=node.class_name, shape=shape,
                formula=note.formula if note else None, meaning=meaning,
                rows=[BlockEntry(start=b.start, stop=b.stop, label=b.label)
                      for b in (note.rows if note else ())],
                columns=[BlockEntry(start=b.start, stop=b.stop, label=b.label)
                         for b in (note.columns if note else ())],
                trainable=trainable, stats=None if gradient is None else stats(gradient),
                sparse=SparseRows(rows_with_gradient=sparse[0], rows=sparse[1],
                                  rows_nonzero=sparse[2])
                if sparse else None))
        for index in range(len(node.calls)):
            captured = calls.get((node.name, index))
            if captured is None or not captured.states:
                continue
            states += _state_entries(graph, node, index, captured,
                                     (explainer.states(facts) if explainer else [])
                                     or _cell_states(keras_layer, captured),
                                     result.state_gradients, engine.live)
            if explainer is None:
                continue
            from gradscope.keras.layers.recurrent import RecurrentExplainer

            if isinstance(explainer, RecurrentExplainer):
                from gradscope.keras.cross_check import cross_check_call, weights_by_key

                witnesses.append(cross_check_call(captured, facts, explainer,
                                              weights_by_key(keras_layer, facts),
                                              engine.dtype_name, job.training))
            elif node.class_name == "Bidirectional":
                witnesses.append(_both_directions(captured, engine))
    # Weights no layer holds: a subclassed model's own (self.add_weight in its __init__).
    owner = graph.your_call or graph.name
    for variable in model.weights:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        trainable = id(variable) in trainable_ids
        gradient = result.gradients.get(variable.path) if trainable else None
        meaning = ("the model's own weight, used by its call: your code, no derivation"
                   + ("" if trainable else "; non-trainable: it gets no gradient")
                   + ("; it does not reach the loss: no gradient"
                      if trainable and gradient is None else ""))
        gradients.append(KerasGradientEntry(
            name=names[id(variable)].name, path=variable.path,
            layer=owner, class_name=YOUR_CALL, shape=[int(d) for d in variable.shape],
            formula=None, meaning=meaning, rows=[], columns=[], trainable=trainable,
            stats=None if gradient is None else stats(gradient), sparse=None))
    warnings = _warnings(result, gradients)
    warnings += _own_loops(engine, result)
    if graph.your_call is not None:
        # Found tried as a new user would: a call that only chains its layers was said to
        # compute something between them that has no explanation.
        between = (f"what {graph.your_call} computes between them has no explanation"
                   if graph.computes_between else
                   f"{graph.your_call} computed nothing outside them: each layer read the "
                   "inputs or another layer's output")
        warnings.append(f"a subclassed model: every number is Keras' own, and the layers are "
                        f"read from one symbolic call, listed in the order it made them; "
                        f"{between}")
    drawn = drawn_targets(job.plan, job.batch)
    warnings += [drawn] if drawn else []
    unused = unused_targets(job.plan, job.batch.targets)
    if unused:
        warnings.append(f"the targets given for {', '.join(unused)} are not used: the model "
                        "was compiled with no loss for "
                        + ("them" if len(unused) > 1 else "it")
                        + ", so fit never reads them (its loss is what the model adds)")
    return KerasExplainReport(
        model=model_entry(job, engine, result), loss=loss_entry(job, result),
        layers=layers, gradients=gradients, initial_state_gradients=states,
        witnesses=witnesses, warnings=warnings)


def _plain_summary(class_name: str, layer: Any) -> str:
    """A layer gradscope has no algebra for, by its class; a recurrent one with its cell and
    the numbers its state carries (a custom cell's RNN read "RNN" alone)."""
    from keras.layers import RNN

    from gradscope.keras.engine import class_label

    cell = getattr(layer, "cell", None) if isinstance(layer, RNN) else None
    if cell is None:
        return class_name
    size = getattr(cell, "state_size", None)
    sizes = size if isinstance(size, list | tuple) else [size]
    if all(isinstance(n, int) and n > 0 for n in sizes):  # a ConvLSTM cell's is -1
        carried = sum(sizes)
        state = f", a state of {carried} number{'' if carried == 1 else 's'} an example"
    else:
        state = ""
    inner = getattr(cell, "cells", None)  # StackedRNNCells
    named = (f"{class_label(cell)} of " + ", ".join(class_label(c) for c in inner)
             if isinstance(inner, list | tuple) and inner else f"the cell {class_label(cell)}")
    returns = ("its output at every step" if getattr(layer, "return_sequences", False)
               else "its last output")
    if getattr(layer, "return_state", False):
        returns += " and its final states"
    order = (", reading the steps last to first (go_backwards)"
             if getattr(layer, "go_backwards", False) else "")
    return f"{class_name} over {named}{state}; returns {returns}{order}"


def _own_loops(engine: Any, result: Any) -> list[str]:
    """Why a recurrent call has no initial-state gradient: a subclass of ``RNN`` whose
    ``inner_loop`` is its own, which the run does not look inside, or a cell whose states
    gradscope does not probe (not vectors of a fixed size, or the cell's own)."""
    from keras.layers import RNN

    from gradscope.keras.engine import call_label, cell_state_units, class_label

    said = []
    for call in result.calls:
        layer = engine.operation(call.layer)
        if not isinstance(layer, RNN) or call.states:
            continue
        if type(layer).inner_loop is not RNN.inner_loop:
            said.append(f"{call_label(call.layer, call.index)}: a subclass of RNN with a loop "
                        f"of its own ({class_label(layer)}.inner_loop): its ∂L/∂(initial "
                        "state) is not read (the run does not look inside that loop); --flow "
                        "steps its cell instead")
        elif min(cell_state_units(layer.cell), default=0) <= 0:  # none, or not sizes
            # Found tried as a new user would: a ConvLSTM's report had no initial-state
            # gradients and said nothing of it (its cell's state_size is -1).
            said.append(f"{call_label(call.layer, call.index)}: its ∂L/∂(initial state) is "
                        "not read: gradscope does not probe the states of its cell "
                        f"({class_label(layer.cell)}), which are not vectors of a fixed size "
                        "(a ConvLSTM's feature maps) or are made by the cell itself; --flow "
                        "and --jacobians step its cell instead")
    return said


def _both_directions(call: Any, engine: Any) -> CrossCheckEntry:
    """Both directions of a Bidirectional call rerun in gradscope's NumPy cells, merged as
    Keras merges them, against every output Keras gave; or why they are not."""
    from gradscope.gradcheck import tolerance
    from gradscope.keras.cross_check import computed_in, not_finite
    from gradscope.keras.engine import call_label
    from gradscope.keras.flow import output_error, rerun_call

    label = call_label(call.layer, call.index)
    name = "gradscope's NumPy cells of both directions"
    rtol = tolerance("cross_check", computed_in(call, engine.dtype_name)).rtol
    found = not_finite(call) or rerun_call(call, engine)
    if isinstance(found, str):
        return CrossCheckEntry(layer=label, witness=name, max_abs_error=None,
                                 tolerance=rtol, passed=None, detail=f"not witnessed: {found}")
    error = output_error(found, engine.dtype_name)
    assert not isinstance(error, str)  # rerun_call has held the outputs to the tolerance
    keys = ", ".join(f"{unit.label.rsplit('/', 1)[-1]} {unit.cell.key}"
                     for unit in found.units)
    return CrossCheckEntry(layer=label, witness=f"{name} ({keys})",
                             max_abs_error=error[0], tolerance=rtol, passed=True,
                             allowed=error[1],
                             detail=f"reproduce Keras' merged output to {error[0]:.1e} "
                                    f"(allowed {error[1]:.1e})")


def model_entry(job: KerasJob, engine: Any, result: Any) -> KerasModelEntry:
    model = engine.model
    trainable_count = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    non_trainable = sum(int(np.prod(v.shape)) for v in model.non_trainable_variables
                        if "seed_generator" not in v.path)
    # Where some layer computes in another dtype than its variables' (mixed_float16): the
    # model object's own policy may be float32's while its layers' are mixed.
    mixed = sorted({(str(policy.name), str(policy.compute_dtype)) for policy in (
        getattr(layer, "dtype_policy", None)
        for layer in [model, *model._flatten_layers(include_self=False, recursive=True)])
        if policy is not None and getattr(policy, "compute_dtype", None)
        and str(policy.compute_dtype) != str(getattr(policy, "variable_dtype", ""))})
    # Each output's dtype, as Keras built it (a subclassed model has no symbolic outputs).
    symbolic = getattr(model, "outputs", None) or []
    dtypes = ([str(getattr(t, "dtype", "")) or None for t in symbolic]
              if len(symbolic) == len(result.output_shapes) else
              [None] * len(result.output_shapes))
    return KerasModelEntry(
        name=job.graph.name,
        file=(job.path if job.model is None
              else getattr(job.model, LOADED_FROM, None) or "in memory"),
        kind=job.graph.kind,
        inputs=[KerasTensorSpec(name=name, shape=[None, *value.shape[1:]],
                                dtype=str(value.dtype))
                for name, value in job.batch.inputs.items()],
        outputs=[KerasTensorSpec(name=name, shape=[None, *shape[1:]], dtype=dtype)
                 for (name, shape), dtype in zip(result.output_shapes.items(), dtypes,
                                                 strict=True)],
        batch_size=job.batch_size, mode="training" if job.training else "inference",
        seed=job.seed, mode_effects=mode_effects(job.graph),
        weight_count=trainable_count, non_trainable_count=non_trainable,
        data=job.batch.source, data_digest=job.batch.digest(),
        dtype_policy=", ".join(name for name, _ in mixed) if mixed else None,
        compute_dtype=", ".join(sorted({dtype for _, dtype in mixed})) if mixed else None)


def loss_entry(job: KerasJob, result: Any) -> KerasLossEntry:
    """The loss, its plan, and its terms as Keras added them up (``result``: a KerasPass)."""
    value = result.loss
    return KerasLossEntry(
        name=job.plan.description, value=value if np.isfinite(value) else None,
        source=job.plan.source,
        outputs=[KerasOutputLoss(output=o.output, loss=o.loss, from_logits=o.from_logits,
                                 weight=o.weight, rule=o.rule) for o in job.plan.outputs],
        terms=[KerasLossTerm(kind=t.kind, name=t.name, detail=t.detail,
                             value=t.value if np.isfinite(t.value) else None,
                             settings=t.settings, weight=t.weight, counted=t.counted)
               for t in result.loss_terms])


def _positional_shapes(node: LayerNode, call: Any) -> list[tuple[int | None, ...]] | None:
    """The captured shapes of the tensors passed positionally (not masks or states)."""
    if call is None or not node.calls:
        return None
    saved = node.calls[0]
    count = len(saved.input_refs())
    return [_batchless(tuple(int(d) for d in a.shape)) for a in call.args[:count]]


def _cell_states(layer: Any, captured: Any) -> list[StateNote]:
    """An RNN over a cell gradscope does not derive (your own): its initial states by Keras'
    order, with the sizes the call took."""
    from gradscope.keras.engine import state_names

    return [StateNote(key=name, units=int(state.shape[-1]),
                      role="initial state of the cell (your cell: gradscope does not read "
                           "its code)")
            for name, state in zip(state_names(layer), captured.states, strict=False)]


def _final(key: str, backwards: bool = False) -> str:
    """What an initial state is to the previous batch: ``h0`` → its final h_T; of a direction
    that runs from the last step back, its final h, the one after the batch's first step."""
    name = key.split("/")[-1]
    if backwards:
        state = name[0] if name in ("h0", "c0") else name
        return (f"final {state} (the one after its first step: this direction runs from the "
                "last step back)")
    return f"final {name[0]}_T" if name in ("h0", "c0") else f"{name} at its last step"


def _runs_backwards(node: LayerNode, key: str) -> bool:
    """Whether the recurrence whose initial state is ``key`` runs from the last step back:
    ``go_backwards``, or a Bidirectional's backward direction (Keras builds a Bidirectional
    only of a layer that runs forward)."""
    if node.class_name == "Bidirectional":
        return key.split("/")[:-1][-1:] == ["backward"]
    return bool(node.config.get("go_backwards", False))


def _state_entries(graph: ModelGraph, node: LayerNode, index: int, captured: Any,
                   notes: list[StateNote], gradients: dict[str, list[np.ndarray | None]],
                   live: bool = True) -> list[KerasStateEntry]:
    """``live``: the model is the user's object, which holds the state its last batch left
    (a file's model holds none: it loads with zeros)."""
    from gradscope.gradient_stats import per_example_norms, stats
    from gradscope.keras.engine import call_label

    label = call_label(node.name, index)
    wired = _wired_sources(graph, node, index)
    entries = []
    for k, (note, value) in enumerate(zip(notes, gradients.get(label, []), strict=False)):
        shape = [int(d) for d in captured.states[k].shape]
        if captured.state_source == "carried":
            source = ("carried: the state the previous batch left (stateful=True); zeros "
                      "after reset_states()")
            if not live:
                # Found tried as a new user would: a saved stateful model was said to start
                # from what the previous batch left; a file holds no state, and loads zeros.
                source = ("carried (stateful=True), but a saved file holds no state: it "
                          "loads with zeros; the state a previous batch left is on the model "
                          "object (gradscope.explain(model, …) in Python)")
            flows_to = ("nowhere in this batch: fit stops the gradient at the batch's "
                        "start; with truncated BPTT it is the grad_y of the previous batch's "
                        f"{_final(note.key, _runs_backwards(node, note.key))}")
        elif captured.state_source == "zeros":
            source = "zeros (Keras' default, made explicit by gradscope)"
            # No previous batch feeds a start of zeros (found tried as a new user would: a
            # seq2seq encoder's h0 was said to be truncated BPTT's grad_y, which only a
            # carried start, stateful=True, is).
            flows_to = ("nowhere: the zeros are a constant; a learned initial state, shared "
                        "by the examples, would receive its sum over the batch")
        else:
            origin = wired[k] if k < len(wired) else "another layer"
            source = f"wired from {origin}"
            flows_to = f"back into {origin}, and through it to the layers below"
        per_example = (None if value is None or value.ndim != 2
                       or not np.isfinite(value).all() else per_example_norms(value))
        entries.append(KerasStateEntry(
            name=f"{label}/{note.key}", layer=node.name, shape=shape, source=source,
            flows_to=flows_to, stats=None if value is None else stats(value),
            per_example_norm=per_example))
    return entries


def _wired_sources(graph: ModelGraph, node: LayerNode, index: int) -> list[str]:
    if index >= len(node.calls):
        return []
    refs = node.calls[index].kwarg_refs().get("initial_state", [])
    return [f"a state {ref.layer} computes in your code (get_initial_state, a sum, …)"
            if ref.layer == graph.your_call
            else f"{ref.layer}'s returned state (its output {ref.index})" for ref in refs]


def _warnings(result: Any, gradients: list[KerasGradientEntry]) -> list[str]:
    warnings = []
    if not np.isfinite(result.loss):
        warnings.append(f"the loss is not finite ({result.loss}) in Keras' own call on this "
                        "batch, and its gradients may not be either: where the first NaN or "
                        "Inf was born is said below")
    if result.loss == 0:
        warnings.append("the loss is exactly 0: every gradient is 0 and says nothing about "
                        "the model; check the targets and the loss (--loss, --data)")
    trained = [g for g in gradients if g.trainable and g.stats is not None]
    if trained and all(g.stats.l2 == 0 and not g.stats.nonfinite for g in trained
                       if g.stats is not None):
        warnings.append("every gradient is exactly 0: nothing of the loss reaches the "
                        "weights on this batch")
    missing = [g.name for g in gradients if g.trainable and g.stats is None]
    if missing:
        warnings.append(f"{len(missing)} trainable weight(s) get no gradient from this loss: "
                        + ", ".join(missing))
    return warnings
