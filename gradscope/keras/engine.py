"""Run the user's own Keras model under ``tf.GradientTape``, with the loss ``fit`` computes
(``model.compute_loss``), so that every gradient gradscope shows is Keras' own.

The pass is Keras' own call of the model, looked on (:mod:`~gradscope.keras.observed_call`):
what each layer call received and returned is recorded for the explanation and the witnesses,
and the zero initial states come back as watched copies, so that ∂L/∂(initial state) is real.
Where the call cannot be looked on, the replay (the graph run by gradscope call by call, every
initial state explicit) runs instead, held to Keras' own call (:mod:`~gradscope.keras.whole_model`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gradscope._tf import import_tensorflow, native_stderr_silenced
from gradscope.errors import (
    ConfigError,
    GradscopeError,
    first_line,
    load_it,
    on_the_command_line,
)
from gradscope.keras.data import time_steps
from gradscope.keras.graph import INPUT_KEYWORDS, fresh_names
from gradscope.keras.loss import CROSS_ENTROPIES, LossPlan, OutputLoss
from gradscope.keras.loss_terms import LossTerm, added_terms, output_terms
from gradscope.keras.observed_call import (
    NotObserved,
    layers_wrapped,
    runner_wrapped,
    zero_states_watched,
)
from gradscope.keras.state_probes import (
    SQUARES,
    Probing,
    StateTotals,
    carried_back,
    carries_back,
    filled,
    probe_targets,
    probeable,
    state_totals,
    states_probed,
    tape_for,
)
from gradscope.keras.stopped import start_of_call
from gradscope.keras.subclassed import is_subclassed, tracked_layers
from gradscope.keras.whole_model import (
    confirm,
    dense_gradients,
    losses_kept,
    model_outputs,
    moved_state,
    restore,
    runs_eagerly,
    seed_random_draws,
    traced_or_eager,
    whole_model_pass,
)

RECURRENT = {"GRU", "LSTM", "SimpleRNN"}

#: From this many time steps on, a model with a recurrent layer runs its passes traced (one
#: tf.function each): eagerly, Keras runs the recurrence as a Python loop, about 1.2 s a pass
#: on the Keras seed model (100 steps), where tracing and running it takes 0.5 s. A short or
#: non-recurrent model runs eagerly: a trace costs more than its few ops (0.36 s against
#: 0.08 s for a GRU over 6 steps).
TRACE_FROM_STEPS = 32

#: Layers that loop over the time steps (in Python, eagerly).
LOOPING = RECURRENT | {"Bidirectional", "RNN", "ConvLSTM1D", "ConvLSTM2D"}


@dataclass
class CapturedCall:
    """One call of one layer: its tensors as they flowed, and the initial states it started
    from (``state_source`` says whether gradscope injected Keras' zeros or they were wired in)."""

    layer: str
    index: int
    class_name: str
    args: list[Any]
    outputs: list[Any]
    states: list[Any] = field(default_factory=list)
    state_source: str = ""  # "zeros" (injected), "wired" (from another layer) or "carried"
    mask: Any = None
    #: With ``probe_states``: the probed loop of each direction (see :mod:`state_probes`);
    #: symbolic while traced, so never handed on.
    probes: list[Any] = field(default_factory=list)


@dataclass
class KerasPass:
    loss: float
    gradients: dict[str, np.ndarray | None]  # by variable path
    #: path → (rows the batch indexes, rows, rows whose gradient is not 0)
    sparse_rows: dict[str, tuple[int, int, int]]
    state_gradients: dict[str, list[np.ndarray | None]]  # call label → per state
    calls: list[CapturedCall]
    output_shapes: dict[str, tuple[int, ...]]
    output_gradients: dict[str, list[np.ndarray | None]] = field(default_factory=dict)
    input_gradients: dict[str, np.ndarray | None] = field(default_factory=dict)
    #: The loss term by term, from Keras' own call (empty where the run did not read them).
    loss_terms: list[LossTerm] = field(default_factory=list)
    #: With ``probe_states``: by call label, each direction's total ∂L/∂(every state after
    #: every step), from this pass's own backward (a call whose loop was not probed: absent).
    state_totals: dict[str, list[StateTotals]] = field(default_factory=dict)


class CopyFails(ConfigError):
    """The copy of the model in another dtype cannot be built, or Keras' own call of it fails,
    where the model itself runs: the user's code does not run in that dtype. ``reason`` says
    where, in words."""

    def __init__(self, message: str, reason: str, where: str) -> None:
        super().__init__(message, where=where)
        self.reason = reason


class NotReplayable(ConfigError):
    """gradscope's layer-by-layer replay cannot run this model (a subclassed one)."""


def call_label(layer: str, index: int) -> str:
    return layer if index == 0 else f"{layer}[{index}]"


class KerasEngine:
    """Loads the model (``safe_mode=True``) and runs it forward and backward.

    ``source`` is a ``.keras`` path or the user's model object. An object is run as it is, with
    the user's current weights, for float32; ``dtype="float64"`` makes a copy with the same
    weights. The user's object is never changed: the loss gradscope chose is a separate
    ``CompileLoss`` (not compiled into the model), the compiled loss of a compiled model is
    used through a fresh ``CompileLoss`` of the same loss objects (its metric trackers are left
    alone), and the non-trainable variables a training-mode run moves (batch-norm statistics,
    dropout seeds) are restored after each run.
    """

    def __init__(self, source: Any, outputs: list[str], plan: LossPlan, training: bool = False,
                 seed: int = 0, dtype: str | None = None) -> None:
        self.tf = import_tensorflow()
        import keras

        from gradscope.keras.live import is_live_model, model_label

        self.keras = keras
        self.live = is_live_model(source)
        path = model_label(source) if self.live else str(source)
        self.path = path
        self.plan = plan
        self.output_names = outputs
        self.training = training
        #: Where each SeedGenerator's draws started in the last training-mode run, by ``id``.
        self.seeded: dict[int, Any] = {}
        #: Recurrent calls stepped through their cells in this engine's last pass, by label
        #: (:mod:`~gradscope.keras.stepped`): the flow steps them, the Jacobians reuse them.
        self.stepped_calls: dict[str, Any] = {}
        self.seed = seed
        self.dtype_name = dtype or "float32"  # the model's own, once it is loaded
        #: What :meth:`compute_loss` multiplies its total by before the tape differentiates
        #: it, as ``optimizer.scale_loss`` does in fit's train step (a LossScaleOptimizer's
        #: loss scale): 1 but for the scaled pass of :mod:`~gradscope.keras.mixed_precision`.
        self.loss_scale = 1.0
        #: The loss when it is not the model's own compiled one (a model object is never
        #: compiled by gradscope): a CompileLoss, called as Trainer.compute_loss calls it.
        self._user_loss_copy: Any = None
        compile_saved = plan.source == "compiled"
        if self.live:
            self.model = source
        else:
            self.model = self._load(path, compile_saved)
        if dtype is None:
            policy = getattr(self.model, "dtype_policy", None)
            self.dtype_name = str(getattr(policy, "variable_dtype", None) or "float32")
        if getattr(self.model, "outputs", None) is not None and \
                len(self.model.outputs) != len(outputs):
            raise ConfigError(f"{path}: Keras built {len(self.model.outputs)} outputs from "
                              f"{'its config' if self.live else 'the file'}, but the config "
                              f"lists {len(outputs)}", where=path)
        compiled = compile_saved and getattr(self.model, "compiled", False)
        #: Compiled with no loss: fit minimises the added losses alone (no CompileLoss at all).
        self.added_only = plan.added_only
        if self.live and compiled and getattr(self.model, "_compile_loss", None) is None:
            compiled = False
        user_model = self.user_model = self.model
        if dtype is not None:
            saved_compile = (self.model.get_compile_config()
                             if compiled and not self.added_only else None)
            self.model = self._cast(dtype)
            if saved_compile is not None:
                _set_dtype(saved_compile, dtype)
                try:
                    custom = _custom_classes(user_model) if self.live else {}
                    with self._floatx(), keras.saving.custom_object_scope(custom):
                        self.model.compile_from_config(saved_compile)
                except Exception as exc:  # a custom loss Keras cannot rebuild from its config
                    first = first_line(exc)
                    raise CopyFails(f"{path}: Keras cannot rebuild its compiled loss for the "
                                    f"{dtype} copy: {first}; pass loss=NAME to use a Keras "
                                    "loss", f"Keras cannot rebuild its compiled loss in {dtype} "
                                    f"({first})", where=path) from None
        if training and (not self.live or self.model is not user_model):
            # gradscope's own object (a file's model, a copy): seeded once, so that every pass
            # of check starts from the same draws. The user's object is seeded for each run
            # and given its own states back after it.
            seed_random_draws(self.model, seed)
        if self.added_only:
            pass  # no CompileLoss: compute_loss adds the model's own losses
        elif compiled and self.live and self.model is user_model:
            # The user's own loss objects, in a CompileLoss of gradscope's: fit's loss, without
            # touching the model's compiled state.
            from keras.src.trainers.compile_utils import CompileLoss

            user_loss = self.model._compile_loss
            # In the model's dtype: a CompileLoss casts its total to floatx as it was made.
            with self._floatx():
                self._user_loss_copy = CompileLoss(
                    user_loss._user_loss, user_loss._user_loss_weights,
                    output_names=getattr(self.model, "output_names", None))
        elif not compiled:
            by_output = {o.output: o for o in plan.outputs}
            losses = [self._loss(by_output.get(name)) for name in outputs]
            weights = [by_output[name].weight if name in by_output else 0.0 for name in outputs]
            if self.model is user_model and self.live:
                from keras.src.trainers.compile_utils import CompileLoss

                with self._floatx():
                    self._user_loss_copy = CompileLoss(
                        losses, weights, output_names=getattr(self.model, "output_names", None))
            else:
                with self._floatx():
                    self.model.compile(loss=losses, loss_weights=weights)

    def _load(self, path: str, compile_saved: bool) -> Any:
        keras = self.keras

        def load(compile: bool) -> Any:
            with native_stderr_silenced(), warnings.catch_warnings():
                # A compiled model's optimizer state is not restored until it is built: Keras
                # says so; gradscope never uses the optimizer.
                warnings.filterwarnings("ignore", message="Skipping variable loading for "
                                        "optimizer")
                with fresh_names():
                    return keras.saving.load_model(path, compile=compile, safe_mode=True)

        try:
            return load(compile_saved)
        except Exception as exc:  # Keras raises many kinds; all mean "not loaded safely"
            first = first_line(exc)
        hint = ""
        # The ways out as the user gives them: flags, or load_model's in Python.
        cli = on_the_command_line()
        importing = ("add --import MODULE (the module that registers it)" if cli else
                     load_it(path, "imports=['MODULE']", "(the module that registers it)"))
        if "Could not locate" in first:
            # Keras' own advice, and the whole config it prints, say less than the option.
            first = first.split(". Make sure custom")[0]
            hint = f"; if it is your code, {importing}"
        if compile_saved:
            # Whether the saved loss is what Keras cannot rebuild: then --loss is the way out.
            try:
                load(False)
                hint = ("; its saved loss cannot be rebuilt: "
                        + (f"{importing}, or " if hint else "")
                        + f"pass {'--loss NAME' if cli else 'loss=NAME'} to use another loss")
            except Exception:  # the model itself does not load: no loss would help
                pass
        raise ConfigError(f"{path}: Keras cannot load it safely: {first}{hint}", where=path)

    def _structured(self, flat: list[Any]) -> Any:
        """Targets or outputs as fit hands them to the loss: one tensor, a list, or a dict by
        key where the model's outputs are a dict (its loss is compiled by key)."""
        structure = getattr(getattr(self.model, "_functional", None) or self.model,
                            "_outputs_struct", None)
        if isinstance(structure, dict):
            return self.keras.tree.pack_sequence_as(structure, flat)
        return flat if len(flat) > 1 else flat[0]

    def compute_loss(self, feed: list[Any], targets: list[Any], flat_outputs: list[Any],
                     sample_weight: Any = None) -> Any:
        """Trainer.compute_loss: the compiled (or chosen) loss plus the model's added losses
        (regularisers, activity regularisers, add_loss). ``sample_weight``: None, one tensor
        for every output, or a list of them in the order of the outputs (see
        :meth:`weight_tensors`). Times :attr:`loss_scale` where it is not 1."""
        total = self._unscaled_loss(feed, targets, flat_outputs, sample_weight)
        if self.loss_scale == 1.0:
            return total
        ops = self.keras.ops
        return ops.multiply(total, ops.cast(self.loss_scale, total.dtype))

    def _unscaled_loss(self, feed: list[Any], targets: list[Any], flat_outputs: list[Any],
                       sample_weight: Any = None) -> Any:
        x = feed if len(feed) > 1 else feed[0]
        y, y_pred = self._structured(targets), self._structured(flat_outputs)
        weights = (self._structured(sample_weight) if isinstance(sample_weight, list)
                   else sample_weight)
        with self._floatx():  # a compiled loss builds its wrappers at its first call
            if self.plan.custom_compute_loss:
                return self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=weights,
                                               training=self.training)
            if self.added_only:
                # Trainer.compute_loss with no compiled loss: y is never read.
                added = [self.model._aggregate_additional_loss(loss)
                         for loss in self.model.losses]
                if not added:
                    raise ConfigError(
                        f"{self.path}: was compiled with no loss and adds none during its "
                        "call (no add_loss, no regularizer): fit has nothing to minimise "
                        "(Keras: 'No loss to compute'); compile it with a loss",
                        where=self.path)
                return added[0] if len(added) == 1 else self.keras.ops.sum(added)
            if self._user_loss_copy is None:
                return self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=weights,
                                               training=self.training)
            losses = [self._user_loss_copy(y, y_pred, weights)]
            losses += [self.model._aggregate_additional_loss(loss) for loss in self.model.losses]
            return losses[0] if len(losses) == 1 else self.keras.ops.sum(losses)

    def loss_terms(self, targets: list[Any], flat_outputs: list[Any],
                   added: dict[int, list[Any]], sample_weight: Any = None) -> list[LossTerm]:
        """The loss of a call, term by term (see :mod:`loss_terms`), from its outputs and what
        each layer added during it (by ``id(layer)``)."""
        compile_loss = (self._user_loss_copy if self._user_loss_copy is not None
                        else getattr(self.model, "_compile_loss", None))
        weights = (self._structured(sample_weight) if isinstance(sample_weight, list)
                   else sample_weight)
        with self._floatx():
            outputs = output_terms(compile_loss, self.output_names, self._structured(targets),
                                   self._structured(flat_outputs), weights)
        return outputs + added_terms(self.model, added)

    @contextlib.contextmanager
    def _floatx(self) -> Iterator[None]:
        """Keras builds its losses (and casts their sum) in floatx: the engine's dtype, while
        the model is compiled."""
        previous = self.keras.config.floatx()
        self.keras.config.set_floatx(self.dtype_name)
        try:
            yield
        finally:
            self.keras.config.set_floatx(previous)

    # -- pieces --------------------------------------------------------------------------------

    def _loss(self, entry: OutputLoss | None) -> Any:
        """A Keras loss object for one output (None: the output takes no part in the loss)."""
        if entry is None:
            return None
        class_name = "".join(part.capitalize() for part in entry.loss.split("_"))
        class_name = {"KlDivergence": "KLDivergence"}.get(class_name, class_name)
        config: dict[str, Any] = {"dtype": self.dtype_name}
        if entry.loss in CROSS_ENTROPIES:
            config["from_logits"] = entry.from_logits
        return self.keras.losses.get({"class_name": class_name, "config": config})

    def _cast(self, dtype: str) -> Any:
        """A copy of the model in ``dtype`` with the same weights (for check's float64 copy).

        A model object may hold the user's own classes and Lambda layers: they are rebuilt from
        the classes and functions in memory (the user's own code, already running), never from
        code serialised in a config."""
        keras = self.keras
        custom = _custom_classes(self.model) if self.live else {}
        try:
            # A subclassed model without get_config cannot be serialised: no copy either.
            config = keras.saving.serialize_keras_object(self.model)
            _set_dtype(config, dtype)
            subclassed = is_subclassed(self.model)
            if subclassed:
                # Keras would build it on float32 symbolic inputs: built below, in dtype.
                config.pop("build_config", None)
            with keras.saving.custom_object_scope(custom), warnings.catch_warnings(), \
                    _default_dtype(keras, dtype):
                warnings.simplefilter("ignore")
                copy = keras.saving.deserialize_keras_object(config, safe_mode=not self.live)
                if subclassed:
                    _built_in(keras, copy, self.model.get_build_config(), dtype, self.model)
            _same_functions(self.model, copy)
            copy.set_weights([np.asarray(w, dtype=dtype) if np.asarray(w).dtype.kind == "f"
                              else w for w in self.model.get_weights()])
            # Each weight of the copy by its original's path: the copy's own are what its
            # rebuilding named them (dense_1 for dense; a cell of each direction of a
            # Bidirectional under one and the same path), and reports name the user's.
            for mine, theirs in zip(copy.weights, self.model.weights, strict=True):
                mine._path = theirs.path
            # And each layer by its original's name and path (a subclassed model's sub-layers,
            # made in __init__, get new ones when it is rebuilt; a rebuilt layer's path leaves
            # out the model's scope that its weights' paths, given above, keep): check names
            # calls and weights as explain does.
            mine_layers, their_layers = _layers(copy), _layers(self.model)
            if [type(a) for a in mine_layers] == [type(b) for b in their_layers]:
                for mine_layer, their_layer in zip(mine_layers, their_layers, strict=True):
                    mine_layer.name = their_layer.name
                    mine_layer._path = their_layer.path
            _carried_states_copied(self.model, copy, dtype)
        except Exception as exc:  # the user's code, rebuilt from its config: anything
            first = first_line(exc)
            raise CopyFails(f"{self.path}: Keras cannot rebuild it in {dtype} from its "
                            f"config (the copy check compares against): {first}",
                            f"Keras cannot rebuild it in {dtype} from its config ({first})",
                            where=self.path) from None
        return copy

    def output_shapes(self, inputs: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        """The outputs' shapes for this batch, from Keras' own shape inference (no run)."""
        # A float input is cast to its Input's dtype by the model's call: so here.
        # (A subclassed model has no Inputs: its float inputs are cast to its own dtype.)
        own = ([getattr(tensor, "dtype", None) for tensor in self.model.inputs]
               if getattr(self.model, "inputs", None) else [self.dtype_name] * len(inputs))
        specs = [self.keras.KerasTensor(value.shape, dtype=dtype if value.dtype.kind == "f"
                                        and dtype is not None else str(value.dtype))
                 for value, dtype in zip(inputs.values(), own, strict=True)]
        try:
            result = self.model.compute_output_spec(specs if len(specs) > 1 else specs[0])
        except Exception as exc:  # Keras and TensorFlow raise many kinds
            if self.model is self.user_model:
                raise
            # Found tried as a new user would: a VAE's noise drawn in float32 beside its
            # float64 copy's means failed here, an internal error, before the copy's call
            # that says so and checks in the model's dtype.
            first = first_line(exc)
            raise CopyFails(f"{self.path}: Keras' shape inference of the {self.dtype_name} "
                            f"copy fails: {first}", f"Keras' shape inference of its "
                            f"{self.dtype_name} copy fails ({first})", where=self.path) from None
        flat = self.keras.tree.flatten(result)
        return {name: tuple(int(d) for d in spec.shape)
                for name, spec in zip(self.output_names, flat, strict=True)}

    def operation(self, name: str) -> Any:
        """The layer (or Keras op) of the model's graph called ``name``."""
        runner = getattr(self.model, "_functional", None) or self.model
        for operation in getattr(runner, "operations", None) or self.model.layers:
            if operation.name == name:
                return operation
        raise KeyError(name)

    # -- the run -------------------------------------------------------------------------------

    def forward(self, feed: list[Any], targets: list[Any], watch: Callable[[Any], None],
                deltas: dict[str, list[Any]] | None = None,
                watch_outputs: bool = False,
                sample_weight: Any = None,
                own: bool = False,
                probe_states: Probing = False,
                probe_inputs: bool = False,
                watch_only: str | None = None) -> tuple[Any, list[Any], list[CapturedCall]]:
        """The loss, the model's outputs and every layer call, from one run of the graph.

        ``watch`` is given every initial state (and, with ``watch_outputs``, every call's
        outputs) as it appears; with ``watch_only`` (a call's label), the outputs of that call
        alone: a tape that watches nothing else (``watch_accessed_variables=False``) records
        only what follows that call, and a gradient with respect to them differentiates no
        loop before it (TensorFlow would otherwise make every recorded loop keep its steps,
        at the cost of a backward pass, even for a gradient that does not go through it);
        ``deltas`` (call label → one tensor per state) are added to the initial states: finite
        differences perturb them that way. With ``probe_states``, each
        recurrent call's loop is probed (:mod:`~gradscope.keras.state_probes`; its probes are
        watched and kept in ``CapturedCall.probes``), with ``probe_inputs`` its input sequence
        too. Traceable by tf.function.

        With ``own``, the run is Keras' own call of the model, ``model(x, training=…)``, looked
        on (see :mod:`~gradscope.keras.observed_call`): the zero initial states are Keras' own,
        from each recurrent layer's ``get_initial_state``. It raises
        :class:`~gradscope.keras.observed_call.NotObserved` where a recurrent call does not ask
        for them. Without it, the replay: the graph run call by call, every zero initial state
        given explicitly (``deltas`` need it).
        """
        tf, keras = self.tf, self.keras
        model = self.model
        runner = getattr(model, "_functional", None) or model
        subclassed = is_subclassed(model)
        if subclassed and not own:
            # Its graph is its code: only Keras' own call runs it.
            raise NotReplayable(f"{self.path}: is a subclassed model, whose graph is its own "
                                "call: gradscope cannot run it layer by layer",
                                where=self.path)
        if own and deltas:
            raise ValueError("deltas perturb the replay's explicit initial states, not own=True")
        start_of_call()
        observer = _Observer(tf, keras, self.training, own, watch, deltas or {}, watch_outputs,
                             probe_states, probe_inputs, watch_only)
        operation_fn = observer.wrap

        if own:
            looking = (layers_wrapped(tracked_layers(model), operation_fn) if subclassed
                       else runner_wrapped(runner, operation_fn))
            with looking:
                flat_outputs = model_outputs(model, feed, self.training)
        else:
            with model_call_context(model, self.training):
                outputs = runner._run_through_graph(feed, operation_fn=operation_fn)
            flat_outputs = list(keras.tree.flatten(outputs))
        return (self.compute_loss(feed, targets, flat_outputs, sample_weight), flat_outputs,
                observer.calls)

    def tensors(self, inputs: dict[str, np.ndarray],
                targets: dict[str, np.ndarray]) -> tuple[list[Any], list[Any]]:
        tf = self.tf
        return ([tf.convert_to_tensor(value) for value in inputs.values()],
                [tf.convert_to_tensor(targets[name]) for name in self.output_names])

    def weight_tensors(self, sample_weight: Any) -> Any:
        """Sample weights (None, one array, or a dict by output name) as compute_loss takes
        them: None, one tensor, or a list of tensors in the order of the outputs (an output
        without weights weighs every example 1)."""
        if sample_weight is None:
            return None
        dtype = self.dtype_name
        if not isinstance(sample_weight, dict):
            return self.tf.constant(np.asarray(sample_weight, dtype))
        return [self.tf.constant(np.asarray(sample_weight[name], dtype)) if name in
                sample_weight else None for name in self.output_names]

    def run(self, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
            watch_outputs: bool = False, watch_inputs: bool = False,
            sample_weight: Any = None, probe_states: Probing = False,
            carry_back: bool = True) -> KerasPass:
        """One forward and backward pass: every weight, every initial state (and, on request,
        every float input and every call's outputs) gets its gradient.

        The pass is Keras' own call of the whole model, ``model(x)`` then ``compute_loss``,
        looked on (:mod:`~gradscope.keras.observed_call`): the loss and every gradient are
        Keras' own. Where it cannot be looked on (or fails), the replay runs instead, witnessed
        by Keras' own call of the whole model, run first from the same variables: the loss
        and weight gradients returned are that call's, and the replay must agree with them
        (else :class:`InternalError`); where Keras' own call fails, that is said as such.
        ``probe_states``: every recurrent call's total ∂L/∂(each state after each step) too
        (``KerasPass.state_totals``), from this same backward pass; and, with ``carry_back``,
        where a call returns its sequence, what arrives at its last step carried back
        (``StateTotals.carried_back``; a second backward through the loop, which keeps the
        forward pass's intermediates alive for it: on the LSTM 256 × 2 at 1000 steps, 0.4 GB
        more at the peak). ``probe_states=SQUARES`` (with ``carry_back=False``): of a loop
        without a mask, only what diagnose reads of its totals, per step ‖∂L/∂s_t‖² and ‖its
        carried part‖², and the totals after the last step (``StateTotals.squares`` and
        ``.last``; :func:`~gradscope.keras.state_probes.probed_loop`)."""
        self.stepped_calls = {}
        feed, y = self.tensors(inputs, targets)
        weights = self.weight_tensors(sample_weight)
        eager = runs_eagerly(self.user_model) or not self._worth_tracing(inputs)
        # A training-mode run moves batch-norm statistics, dropout seeds and the states of
        # stateful layers: each pass starts from the same values (gradscope's own load of a
        # file too: its next pass, a cut run of --chunks or a probe of check, must see the
        # model this one saw), and the user's model object gets its own values back.
        before = moved_state(self.model)
        try:
            if self.training:
                self.seeded = seed_random_draws(self.model, self.seed)
            try:
                return self._run(feed, y, inputs, watch_outputs, watch_inputs, weights, eager,
                                 own=True, probe_states=probe_states, carry_back=carry_back)
            except GradscopeError:
                raise
            except Exception:  # noqa: BLE001  (NotObserved, or a failure the replay explains)
                restore(before)
            return self._witnessed_replay(feed, y, inputs, watch_outputs, watch_inputs,
                                          weights, eager, before, probe_states, carry_back)
        finally:
            restore(before)

    def _witnessed_replay(self, feed: list[Any], y: list[Any], inputs: dict[str, np.ndarray],
                          watch_outputs: bool, watch_inputs: bool, weights: Any, eager: bool,
                          before: list[tuple[Any, np.ndarray]],
                          probe_states: Probing = False, carry_back: bool = True) -> KerasPass:
        """The replay, witnessed by Keras' own call (see :meth:`run`)."""
        if self.training:
            seed_random_draws(self.model, self.seed)
        # Keras' own call first: where it fails, the model (or Keras) cannot compute this
        # loss, and that is said as such; the replay failing after it is gradscope's.
        try:
            own = whole_model_pass(
                self.model,
                lambda f, t, o: self.compute_loss(f, t, o, weights), feed, y,
                self.training,
                terms=lambda outputs, added: self.loss_terms(y, outputs, added, weights),
                eager=eager)
        except GradscopeError:
            raise
        except Exception as exc:  # Keras and TensorFlow raise many kinds
            first = first_line(exc)
            if self.model is not self.user_model:
                raise CopyFails(f"{self.path}: Keras' own call of the model (the "
                                f"{self.dtype_name} copy) and its loss fails on this batch: "
                                f"{first}", f"Keras' own call of its {self.dtype_name} copy "
                                f"fails ({first})", where=self.path) from None
            raise ConfigError(f"{self.path}: Keras' own call of the model and its loss fails "
                              f"on this batch: {first}", where=self.path) from None
        restore(before)
        if self.training:
            self.seeded = seed_random_draws(self.model, self.seed)
        replay = self._run(feed, y, inputs, watch_outputs, watch_inputs, weights, eager,
                           probe_states=probe_states, carry_back=carry_back)
        confirm(replay.loss, replay.gradients, own, self.dtype_name, self.path)
        return replace(replay, loss=own.loss, gradients=own.gradients,
                       sparse_rows=own.sparse_rows, loss_terms=own.terms)

    def _worth_tracing(self, inputs: dict[str, np.ndarray]) -> bool:
        """Whether a recurrent layer loops over at least :data:`TRACE_FROM_STEPS` steps."""
        steps = time_steps(inputs)
        return steps >= TRACE_FROM_STEPS and any(class_label(layer) in LOOPING
                                                 for layer in _layers(self.model))

    def _run(self, feed: list[Any], y: list[Any], inputs: dict[str, np.ndarray],
             watch_outputs: bool, watch_inputs: bool, sample_weight: Any = None,
             eager: bool = False, own: bool = False, probe_states: Probing = False,
             carry_back: bool = True) -> KerasPass:
        """The pass under a tape (with ``own``, Keras' own call looked on; else the replay), as
        one ``tf.function`` (see :func:`~gradscope.keras.whole_model.traced_or_eager`); what
        each call received and returned comes back as eager tensors. Keras' own call also gives
        the loss term by term."""
        from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

        tf = self.tf
        variables = self.model.trainable_variables
        floating = [k for k, t in enumerate(feed) if t.dtype.is_floating] if watch_inputs else []
        traced: dict[str, Any] = {}
        layers = list(self.model._flatten_layers(include_self=True, recursive=True)) \
            if own else []

        def step(feed: list[Any], y: list[Any]) -> Any:
            watched_inputs = [feed[k] for k in floating]
            # What arrives at each example's last step is carried back once more
            # (:func:`carried_back`).
            with tape_for(tf, probe_states and carry_back) as tape:
                tape.watch(watched_inputs)
                loss, flat_outputs, calls = self.forward(feed, y, tape.watch,
                                                         watch_outputs=watch_outputs,
                                                         sample_weight=sample_weight, own=own,
                                                         probe_states=probe_states,
                                                         probe_inputs=watch_inputs)
            # What each layer added during the call (activity regularizers, add_loss), for
            # the loss term by term.
            added = [layer._get_own_losses() for layer in layers]
            states = [call.states for call in calls]
            watched_outputs = [call.outputs for call in calls] if watch_outputs else []
            probed = [probe_targets(call.probes) for call in calls]
            gradients = tape.gradient(loss, [variables, states, watched_outputs,
                                             watched_inputs, probed])
            gradients[-1] = filled(tf, probed, gradients[-1])
            gradients.append([carried_back(tf, tape, call.probes, found)
                              if found and carry_back else None
                              for call, found in zip(calls, gradients[-1], strict=True)])
            traced["calls"] = calls
            traced["output_shapes"] = [tuple(int(d) for d in value.shape)
                                       for value in flat_outputs]
            captured = [([a for a in call.args if tf.is_tensor(a)], call.outputs, call.states,
                         call.mask) for call in calls]
            return (loss, gradients, captured, flat_outputs,
                    [get_keras_mask(output) for output in flat_outputs], added)

        with native_stderr_silenced(), losses_kept(self.model):
            (loss, (grads, state_grads, output_grads, input_grads, probe_grads, back), captured,
             outputs, masks, added) = traced_or_eager(
                step, feed, y, eager=eager,
                optimised=probe_states and carry_back and carries_back(self.model))
            for output, mask in zip(outputs, masks, strict=True):
                if mask is not None:
                    set_keras_mask(output, mask)
            terms = self.loss_terms(y, outputs, {id(layer): list(values) for layer, values
                                                 in zip(layers, added, strict=True)},
                                    sample_weight) if own else []
        totals = {call_label(call.layer, call.index): state_totals(call.probes, grads, carried)
                  for call, grads, carried in zip(traced["calls"], probe_grads, back,
                                                  strict=True) if grads}
        calls = [_eager_call(call, *tensors)
                 for call, tensors in zip(traced["calls"], captured, strict=True)]
        gradients, sparse = dense_gradients(variables, grads)
        state_gradients = {
            call_label(call.layer, call.index): [_numpy(g) for g in grads]
            for call, grads in zip(calls, state_grads, strict=True) if call.states}
        output_gradients = {
            call_label(call.layer, call.index): [_numpy(g) for g in grads]
            for call, grads in zip(calls, output_grads, strict=True)} if watch_outputs else {}
        names = [name for name, value in inputs.items() if value.dtype.kind == "f"]
        input_gradients = (dict(zip(names, [_numpy(g) for g in input_grads], strict=True))
                           if watch_inputs else {})
        return KerasPass(
            loss=float(loss.numpy()), gradients=gradients, sparse_rows=sparse,
            state_gradients=state_gradients, calls=calls,
            output_shapes=dict(zip(self.output_names, traced["output_shapes"], strict=True)),
            output_gradients=output_gradients, input_gradients=input_gradients,
            loss_terms=terms, state_totals=totals)


def _eager_call(call: CapturedCall, args: list[Any], outputs: list[Any], states: list[Any],
                mask: Any) -> CapturedCall:
    """A call captured while tracing, with the values one run gave its tensors (a traced
    call's tensors are symbolic; its arguments that are not tensors stay as they were)."""
    import tensorflow as tf

    given = iter(args)
    return replace(call, args=[next(given) if tf.is_tensor(a) else a for a in call.args],
                   outputs=list(outputs), states=list(states), mask=mask, probes=[])


@contextlib.contextmanager
def model_call_context(model: Any, training: bool) -> Iterator[None]:
    """The layer calls of one replay inside one call of the model, as ``model(x)`` has them.

    Keras clears a layer's added losses (activity regularizers, ``add_loss``) when a call
    opens a new call context, that is, when it is not inside another layer's call. A replay
    that ran each layer call on its own would let the second call of a shared layer wipe the
    losses of its first call. Inside the model's context, as in ``Layer.__call__``, the
    model's losses are cleared once at the start and every call's losses are kept.
    """
    from keras.src.backend.common import global_state

    if global_state.get_global_attribute("current_call_ctx") is None:
        # The model's own context, as model(x) opens it: its losses are cleared once here.
        model._get_call_context().set_value("training", training)
    try:
        yield
    finally:
        model._maybe_reset_call_context()


def _numpy(tensor: Any) -> np.ndarray | None:
    return None if tensor is None else tensor.numpy()


@dataclass
class _Observer:
    """Every layer call of one run of the model: captured, with its initial states chosen,
    watched and shifted, and (``watch_outputs``) its outputs made fresh watched tensors.

    The initial states of a recurrent call come from one of four places (its
    ``state_source``): Keras' own ``get_initial_state`` (an observed call; zeros), what a
    stateful layer carried from the previous batch, zeros given explicitly (the replay), or a
    state wired in by the graph. A stateful layer with nothing carried runs as it is.
    """

    tf: Any
    keras: Any
    training: bool
    own: bool
    watch: Callable[[Any], None]
    deltas: dict[str, list[Any]]
    watch_outputs: bool
    probe_states: Probing = False
    probe_inputs: bool = False  # with probe_states: each loop's input sequence probed too
    watch_only: str | None = None  # only this call's outputs watched, no initial state
    calls: list[CapturedCall] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def wrap(self, operation: Any, keras_call: Callable[..., Any] | None = None,
             ) -> Callable[..., Any]:
        """``operation``'s call, observed (``keras_call``: Keras' own bound call of it)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(operation, keras_call, args, kwargs)

        return call

    def call(self, operation: Any, keras_call: Callable[..., Any] | None,
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if keras_call is None and "training" in getattr(operation, "_call_context_args", {}):
            kwargs["training"] = self.training
        captured = self._captured(operation, args, kwargs)
        units = _state_units(operation)
        asked = self._initial_states(operation, captured, units, kwargs)
        run = keras_call or operation
        loops = state_layers(operation) if self.probe_states else []
        with contextlib.ExitStack() as hooks:
            if asked is not None:
                hooks.enter_context(zero_states_watched(state_layers(operation), asked,
                                                        self._state_watch))
            if any(probeable(layer) for layer in loops):
                hooks.enter_context(states_probed(loops, captured.probes, self.watch,
                                                  self.probe_inputs,
                                                  self.probe_states == SQUARES))
            out = run(*args, **kwargs)
        if asked is not None:
            if len(asked) != len(units):
                raise NotObserved(f"{captured.layer}: {len(asked)} zero states asked of "
                                  f"get_initial_state, {len(units)} expected")
            captured.states = asked
        captured.outputs = list(self.keras.tree.flatten(out))
        if self.watch_outputs:
            out = self._fresh_outputs(captured, out)
        self.calls.append(captured)
        return out

    def _state_watch(self, state: Any) -> None:
        if self.watch_only is None:
            self.watch(state)

    def _captured(self, operation: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> CapturedCall:
        name = getattr(operation, "name", type(operation).__name__)
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        flatten = self.keras.tree.flatten
        return CapturedCall(layer=name, index=index, class_name=class_label(operation),
                            args=list(flatten(args)) + [t for key in INPUT_KEYWORDS
                                                        if key in kwargs
                                                        for t in flatten(kwargs[key])],
                            outputs=[], mask=kwargs.get("mask"))

    def _initial_states(self, operation: Any, captured: CapturedCall, units: list[int],
                        kwargs: dict[str, Any]) -> list[Any] | None:
        """Sets the call's initial states, and returns the list Keras' own zero states will be
        asked into (an observed call that leaves them to Keras), else None."""
        from keras.src.backend.common.masking import get_keras_mask

        tf = self.tf
        given = kwargs.get("initial_state")
        held = _carried_states(operation) if given is None else None
        stateful = getattr(operation, "stateful", False)
        if not units or (held is None and stateful):
            return None  # a stateful layer with nothing carried yet runs as it is
        if self.own and given is None and held is None:
            captured.state_source = "zeros"
            if kwargs.get("mask") is None:
                # What Keras' Layer.__call__ takes for a call with one tensor.
                captured.mask = get_keras_mask(captured.args[0])
            return []  # Keras' own, asked for in the call
        if held is not None:
            # A stateful layer starts from what the previous batch left: the same values,
            # made a tensor the tape watches.
            states = [tf.identity(tf.convert_to_tensor(v)) for v in held]
            captured.state_source = "carried"
        elif given is None:
            batch = tf.shape(captured.args[0])[0]
            states = [tf.zeros(tf.stack([batch, u]), dtype=captured.args[0].dtype)
                      for u in units]
            captured.state_source = "zeros"
        else:
            # A fresh tensor: the wired one may be used elsewhere too (a GRU's returned state
            # is also inside its own sequence), and ∂L/∂h0 is the gradient through this
            # layer's use only.
            states = [tf.identity(state) for state in self.keras.tree.flatten(given)]
            captured.state_source = "wired"
        for state in states:
            self._state_watch(state)
        shift = self.deltas.get(call_label(captured.layer, captured.index))
        if shift is not None:
            states = [state + d for state, d in zip(states, shift, strict=True)]
        if given is None and kwargs.get("mask") is None:
            # Called with its sequence alone, Keras takes the mask the sequence carries; with
            # an initial state as a second tensor it would not: the mask is handed over as
            # Keras would have taken it.
            carried = get_keras_mask(captured.args[0])
            if carried is not None:
                kwargs["mask"] = captured.mask = carried
        kwargs["initial_state"] = states
        captured.states = states
        return None

    def _fresh_outputs(self, captured: CapturedCall, out: Any) -> Any:
        """Fresh tensors (masks carried over), so that ∂L/∂output is what flows back from the
        layers that use the output, and nothing internal. A softmax's or sigmoid's logits are
        carried over too (Keras' activations leave them on their output): Keras'
        cross-entropy reads them where the output holds them, and clips the probabilities
        otherwise, so that an example whose probability is within 1e-7 of 1 gives no
        gradient (found tried as a new user would: a softmax classifier trained to a loss of
        7.6e-6, check's tape read 0 where fit's gradient is 2.6e-10, and every tensor
        failed)."""
        from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

        fresh = []
        watched = self.watch_only in (None, call_label(captured.layer, captured.index))
        for output in captured.outputs:
            copy = self.tf.identity(output)
            mask = get_keras_mask(output)
            if mask is not None:
                set_keras_mask(copy, mask)
            if hasattr(output, "_keras_logits"):
                copy._keras_logits = output._keras_logits
            if watched:
                self.watch(copy)
            fresh.append(copy)
        captured.outputs = fresh
        return self.keras.tree.pack_sequence_as(out, fresh)


def _state_units(operation: Any) -> list[int]:
    """Units of each initial state Keras takes, for GRU/LSTM/SimpleRNN, RNN(cell) and
    Bidirectional."""
    kind = class_label(operation)
    if kind in RECURRENT:
        units = int(operation.units)
        return [units, units] if kind == "LSTM" else [units]
    if kind == "RNN":
        return cell_state_units(operation.cell)
    if kind == "Bidirectional":
        forward = _state_units(operation.forward_layer)
        backward = _state_units(operation.backward_layer)
        # Keras hands a Bidirectional's initial states half to each direction: directions
        # with different numbers of states (an LSTM forward, a GRU backward) keep Keras'
        # own zero states, and their gradients are not reported.
        return forward + backward if len(forward) == len(backward) else []
    return []


def cell_state_units(cell: Any) -> list[int]:
    """An RNN's cell's state sizes, flat, where its initial states are zeros: the cell has no
    ``get_initial_state`` or Keras' own (a cell of the user's that makes its own initial
    states, or states that are not vectors, such as a ConvLSTM cell's, keeps them unreported).
    """
    import keras

    from gradscope.keras.live import is_builtin

    own = getattr(type(cell), "get_initial_state", None)
    if own is not None and not is_builtin(getattr(own, "__module__", None)):
        return []
    sizes = keras.tree.flatten(getattr(cell, "state_size", None))
    if not sizes or not all(isinstance(s, int | np.integer) and not isinstance(s, bool)
                            for s in sizes):
        return []
    return [int(s) for s in sizes]


def state_names(operation: Any) -> list[str]:
    """The names of a recurrent call's initial states, in Keras' order: ``h0`` (and ``c0`` for
    an LSTM, a ConvLSTM or an LSTMCell), ``states[k]`` for a cell of several other states, and
    ``forward/…``, ``backward/…`` in a Bidirectional."""
    kind = class_label(operation)
    if kind == "Bidirectional":
        return ([f"forward/{n}" for n in state_names(operation.forward_layer)]
                + [f"backward/{n}" for n in state_names(operation.backward_layer)])
    units = _state_units(operation)
    if kind in ("LSTM", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D") or (
            kind == "RNN" and class_label(operation.cell) == "LSTMCell"):
        return ["h0", "c0"]
    if kind == "RNN" and class_label(operation.cell) == "StackedRNNCells":
        stacked = _stacked_names(operation.cell, len(units))
        if stacked is not None:
            return stacked
    return ["h0"] if len(units) == 1 else [f"states[{k}]" for k in range(len(units))]


def _stacked_names(stack: Any, count: int) -> list[str] | None:
    """A stack of cells' states named by the cell each belongs to, in Keras' flat order:
    ``cells[i]/h0`` (and ``cells[i]/c0`` for an LSTMCell), ``cells[i]/states[k]`` for a cell
    of several other states (found tried as a new user would: ``RNN([GRUCell, LSTMCell])``'s
    three states were ``states[0]`` … ``states[2]``, whose cell and kind went unsaid). None
    where the cells' states do not make ``count``."""
    names: list[str] = []
    for index, cell in enumerate(getattr(stack, "cells", [])):
        own = len(cell_state_units(cell))
        inner = (["h0", "c0"] if class_label(cell) == "LSTMCell" and own == 2 else
                 ["h0"] if own == 1 else [f"states[{k}]" for k in range(own)])
        names += [f"cells[{index}]/{name}" for name in inner]
    return names if len(names) == count and count > 0 else None


def state_layers(operation: Any) -> list[Any]:
    """The layers whose ``get_initial_state`` a call of ``operation`` asks for its zero
    states, in the order of :func:`_state_units`."""
    if class_label(operation) == "Bidirectional":
        return [operation.forward_layer, operation.backward_layer]
    return [operation]


def _carried_states(operation: Any) -> list[Any] | None:
    """The state variables a stateful GRU, LSTM, SimpleRNN, ``RNN(cell)`` or Bidirectional of
    one holds between batches (a Bidirectional's: its forward direction's, then its backward
    one's, as its call splits ``initial_state``; None for any other layer, or before Keras
    has made them)."""
    if (class_label(operation) not in RECURRENT | {"RNN", "Bidirectional"}
            or not getattr(operation, "stateful", False)):
        return None
    states = getattr(operation, "states", None)
    if not states or any(isinstance(state, list | tuple) for state in states):
        return None  # nested, as a StackedRNNCells' are: Keras carries them itself
    return list(states)


def _built_in(keras: Any, model: Any, build_config: Any, dtype: str, original: Any) -> None:
    """A subclassed model's copy built as its original was, by one call, on zeros of its
    build shape (batch 1) in ``dtype``: Keras' own build would give it float32 inputs, which a
    call that mixes its input with a layer's output (``x + gru(x)``) cannot add up. An input
    of whole numbers (token ids, as the user's data gave them when the ``original``'s graph
    was read) stays one (found tried as a new user would: a call that one-hot encodes int32
    ids failed on float64 zeros, and check ran in float32)."""
    from gradscope.keras.subclassed import input_dtypes

    shape = (build_config or {}).get("input_shape")
    if shape is None:
        return
    shapes: list[Any] = []
    keras.tree.map_shape_structure(shapes.append, shape)
    dtypes = iter(input_dtypes(original, len(shapes), None, floats=dtype))
    zeros = keras.tree.map_shape_structure(
        lambda s: np.zeros([1, *(1 if d is None else int(d) for d in s[1:])], next(dtypes)),
        shape)
    model(zeros)


@contextlib.contextmanager
def _default_dtype(keras: Any, dtype: str) -> Iterator[None]:
    """Keras' default dtype policy and floatx while the copy is built: a sub-layer the user's
    code makes without a dtype (in ``__init__``, where no config reaches it) is then made in
    ``dtype`` too."""
    policy, floatx = keras.config.dtype_policy(), keras.config.floatx()
    keras.config.set_dtype_policy(dtype)
    keras.config.set_floatx(dtype)
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def _layers(model: Any) -> list[Any]:
    """Every layer of a model, nested ones included, in Keras' own order."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def _flat_losses(loss: Any) -> list[Any]:
    """The loss objects and functions of ``compile(loss=…)``: one, a list or a dict of them."""
    if isinstance(loss, dict):
        return [item for value in loss.values() for item in _flat_losses(value)]
    if isinstance(loss, list | tuple):
        return [item for value in loss for item in _flat_losses(value)]
    return [] if loss is None or isinstance(loss, str) else [loss]


def _custom_classes(model: Any) -> dict[str, Any]:
    """The user's own layer classes, by the names their configs carry, for deserialisation."""
    from gradscope.keras.live import is_builtin

    found: dict[str, Any] = {}
    # The compiled loss as the user gave it: a function or loss class of theirs, in memory,
    # unregistered (the tutorials' masked_loss), rebuilds the copy's compiled loss by name.
    for loss in _flat_losses(getattr(model, "loss", None)):
        if not is_builtin(getattr(loss, "__module__", None)):
            found[getattr(loss, "__name__", type(loss).__name__)] = (
                loss if callable(loss) and hasattr(loss, "__name__") else type(loss))
    for layer in [model, *_layers(model)]:  # a subclassed model's own class too
        cls = type(layer)
        if not is_builtin(cls.__module__):
            registered = keras_registered_name(cls)
            found[registered] = cls
            found[cls.__name__] = cls
    return found


def keras_registered_name(cls: type) -> str:
    from keras.saving import get_registered_name

    return str(get_registered_name(cls))


def _carried_states_copied(model: Any, copy: Any, dtype: str) -> None:
    """Each stateful recurrent layer's carried state (no weight: ``set_weights`` leaves a
    copy's at zeros) given to the same layer of ``copy``, in ``dtype``, so that the copy's
    call starts where the model's would (a copy that started from zeros measured another
    trajectory: found tried as a new user would, a stateful GRU's counterfactuals). Raises
    where a state the model carries has no place in the copy."""
    from gradscope.keras.whole_model import layer_carried_states, stateful_layers

    theirs, mine = stateful_layers(model), stateful_layers(copy)
    held = [layer_carried_states(layer) for layer in theirs]
    if not any(held):
        return
    if [type(a) for a in mine] != [type(b) for b in theirs]:
        raise ValueError("its stateful layers are not the copy's: their carried states "
                         "cannot be given to it")
    for into, values in zip(mine, held, strict=True):
        if not values:
            continue
        targets = layer_carried_states(into)
        if len(targets) != len(values):
            raise ValueError(f"the copy of the stateful layer {into.name} holds no state to "
                             "give its carried one to")
        for target, value in zip(targets, values, strict=True):
            target.assign(np.asarray(value).astype(dtype))


def _same_functions(model: Any, copy: Any) -> None:
    """A Lambda of the copy calls the user's function object itself, not one rebuilt from
    bytecode (which would lose its closure and globals)."""
    functions = {layer.name: layer.function for layer in _layers(model)
                 if class_label(layer) == "Lambda"}
    for rebuilt in _layers(copy):
        if class_label(rebuilt) == "Lambda" and rebuilt.name in functions:
            rebuilt.function = functions[rebuilt.name]


def class_label(operation: Any) -> str:
    """A layer's class name; a class that is not Keras' own is named with its module
    (``__main__.GRU``), so that it never passes for the built-in layer of that name."""
    from gradscope.keras.live import is_builtin

    cls = type(operation)
    return cls.__name__ if is_builtin(cls.__module__) else f"{cls.__module__}.{cls.__name__}"


def _set_dtype(config: Any, dtype: str) -> None:
    """Every float dtype and dtype policy in a serialised model config → ``dtype``."""
    if isinstance(config, dict):
        for key, value in list(config.items()):
            if key == "dtype" and isinstance(value, str) and value.startswith(("float",
                                                                               "mixed_")):
                config[key] = dtype
            elif (key == "dtype" and isinstance(value, dict)
                  and value.get("class_name") == "DTypePolicy"):
                value.setdefault("config", {})["name"] = dtype
            else:
                _set_dtype(value, dtype)
    elif isinstance(config, list | tuple):  # a model object's config keeps its tuples
        for item in config:
            _set_dtype(item, dtype)
