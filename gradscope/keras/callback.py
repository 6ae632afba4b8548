"""``gradscope.keras.GradientFlow``: a Keras callback that watches the gradient flow of a model
while it trains, so that vanishing or exploding gradients show during ``fit``, not after it.

Every ``every`` batches of ``model.fit`` (or at each ``observe(x, y)`` of a custom training
loop) it takes one extra forward and backward pass on the current batch, with the model's own
loss, and records ‖∂L/∂w‖ of every weight and, for every recurrent layer, ‖∂L/∂h0‖ and the
profile ‖∂L/∂h_t‖ over the steps, with the flag of ``explain --flow``. What it records, which
batch, what runs beside training and what that costs: docs/training.md. The code below says
where each of those happens.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gradscope._tf import import_tensorflow
from gradscope.errors import ConfigError, whole_number

# The history draws itself in a notebook and as a figure: those renderers register here.
from gradscope.report import display as _display  # noqa: F401
from gradscope.report import plot as _plot  # noqa: F401
from gradscope.report.models import FlowHistoryReport, NonFiniteEntry

tf = import_tensorflow(start=False)  # the runtime is the user's to configure
import keras  # noqa: E402  (after TensorFlow's quiet import)

from gradscope.diagnosis_record import DiagnosisRecord  # noqa: E402
from gradscope.keras.diagnosis_twin import DiagnosisTwin  # noqa: E402
from gradscope.keras.engine import KerasPass  # noqa: E402
from gradscope.keras.flow_record import FlowRecord  # noqa: E402
from gradscope.keras.mixed_precision_fit import MixedPrecisionRecord  # noqa: E402
from gradscope.keras.nan_stop import snapshot  # noqa: E402
from gradscope.keras.per_example_fit import PerExampleRecord  # noqa: E402
from gradscope.keras.replay import FedIterator, global_batch, replay  # noqa: E402
from gradscope.keras.traced_pass import TracedPass  # noqa: E402
from gradscope.keras.weight_names import live_names  # noqa: E402
from gradscope.keras.whole_model import (  # noqa: E402
    all_variables,
    carried_state_variables,
    moved_state_of,
    stateful_layers,
    states_at,
)
from gradscope.keras.whole_model import snapshot as values_now  # noqa: E402

#: GradientFlow is ``async_safe`` where diagnoses are at least this many batches apart. On
#: bench/callback_overhead.py's GRU model (1000 batches, every=50): at diagnose_every=16,
#: 1.12× a plain fit with Keras not waiting for each step's logs, 1.17–1.19× waiting (about
#: 3 ms a step); at diagnose_every=4, 1.26× not waiting, 1.16–1.21× waiting.
ASYNC_FROM = 8


class GradientFlow(keras.callbacks.Callback):
    """Record the gradient flow of the model every ``every`` batches of ``model.fit``.

    Args:
        every: one extra pass after every ``every`` batches (counted across epochs: after
            batches every, 2·every, …). The cost is bounded by one forward and backward pass
            per ``every`` batches (and one trace).
        log_dir: write TensorBoard summaries there (needs the ``tensorboard`` package). Read
            them back in a terminal with ``gradscope watch LOG_DIR``.
        model: the model, for a custom training loop (``fit`` sets it itself).
        loss: a Keras loss name for the extra pass (``"mse"``, ``"categorical_crossentropy"``,
            …) when the model is not compiled; by default the compiled loss.
        stop_on_nan: at the first batch of ``fit`` whose loss is not finite, say where the
            NaN was born (on that batch, with the weights its step started from: printed,
            kept as ``callback.nonfinite``, and with ``log_dir`` written as
            ``nonfinite.json`` and a TensorBoard text summary) and stop training, as
            ``TerminateOnNaN`` does. It keeps a copy of the weights per step.
        diagnose_every: every this many batches (None: never), diagnose every recurrent call
            on the batch fit has just trained on, with the weights its step left, as
            ``gradscope diagnose`` does: the top Lyapunov exponents (nats per step), the gate
            saturation shares (Keras GRU and LSTM) and the horizon predicted from λ₁
            (docs/diagnose.md, "During training"). In fit it runs on a copy of the model,
            given the weights the step left, beside training (the first traces its
            functions); in a custom loop, ``observe`` diagnoses at the steps it divides.
        diagnose_exponents: how many Lyapunov exponents each diagnosis takes (default 1,
            λ₁; each one more costs about as much again).
        diagnose_horizon: with ``diagnose_every``, measure the memory horizon too (each
            diagnosis takes about twice as long).
        diagnose_examples: each diagnosis reads this many of its batch's examples, evenly
            spaced (all of a batch that has no more; None: every example). The cost of a
            diagnosis grows with them; λ₁ is their mean. Every example where a layer is
            stateful (its carried state is the whole batch's).
        per_example: at each observation, explain's per-example section too (each example's
            ‖∂L_i/∂θ‖ per layer and in total, the top share, the outliers and the gradient
            noise scale B_simple), on the observed batch with the weights the step left:
            see :mod:`~gradscope.keras.per_example_fit` and docs/training.md.

    Under a ``mixed_float16`` or ``mixed_bfloat16`` policy, each observation also records
    explain's mixed-precision section (the shares each gradient tensor loses at the
    optimizer's loss scale, against a float32 shadow; two more passes): see
    :mod:`~gradscope.keras.mixed_precision_fit`.

    The current batch, in ``fit``, is the batch the observed train step has just been given
    (the last of ``steps_per_execution``), read after that step's weight update, in inference
    mode, with the weights that step left (right after it, before any callback's
    ``on_train_batch_end``; with ``stop_on_nan``, at GradientFlow's own, where a callback
    placed before it that changes them changes them here too). After
    training, ``callback.history`` is the report (``to_dict()``, ``to_json()``) and
    ``callback.report()`` prints it. In a custom loop, call ``callback.observe(x, y)``.
    """

    def __init__(self, every: int = 50, log_dir: str | Path | None = None, model: Any = None,
                 loss: str | None = None, stop_on_nan: bool = False,
                 diagnose_every: int | None = None, diagnose_exponents: int = 1,
                 diagnose_horizon: bool = False, diagnose_examples: int | None = 8,
                 per_example: bool = False) -> None:
        super().__init__()
        if not whole_number(every) or every < 1:
            raise ConfigError(f"GradientFlow(every={every!r}): expected a whole number of "
                              "batches ≥ 1", where="every")
        if diagnose_every is not None and (not whole_number(diagnose_every)
                                           or diagnose_every < 1):
            raise ConfigError(f"GradientFlow(diagnose_every={diagnose_every!r}): expected a "
                              "whole number of batches ≥ 1, or None (no diagnosis)",
                              where="diagnose_every")
        if not whole_number(diagnose_exponents) or diagnose_exponents < 1:
            raise ConfigError(f"GradientFlow(diagnose_exponents={diagnose_exponents!r}): "
                              "expected a whole number ≥ 1", where="diagnose_exponents")
        if diagnose_examples is not None and (not whole_number(diagnose_examples)
                                              or diagnose_examples < 1):
            raise ConfigError(f"GradientFlow(diagnose_examples={diagnose_examples!r}): "
                              "expected a whole number of examples ≥ 1, or None (every "
                              "example of the batch)", where="diagnose_examples")
        if log_dir is not None and not isinstance(log_dir, str | os.PathLike):
            # Found tried as a new user would: log_dir=123 raised Python's own TypeError.
            raise ConfigError(f"GradientFlow(log_dir={log_dir!r}): expected a folder's path, "
                              "a str or a pathlib.Path", where="log_dir")
        if log_dir is not None:
            from gradscope.training_log import require_tensorboard

            require_tensorboard("GradientFlow(log_dir=...)")
            # Imported here, not at the first observation: fit's cores are busy then.
            import gradscope.keras.summaries  # noqa: F401
            if Path(log_dir).exists() and not Path(log_dir).is_dir():
                raise ConfigError(f"GradientFlow(log_dir={str(log_dir)!r}): is a file; expected "
                                  "a folder", where="log_dir")
        # Python's own ints (a NumPy one would reach the reports' JSON).
        self.every = int(every)
        self.diagnose_every = None if diagnose_every is None else int(diagnose_every)
        self.diagnose_exponents = int(diagnose_exponents)
        self.diagnose_horizon = bool(diagnose_horizon)
        self.diagnose_examples = None if diagnose_examples is None else int(diagnose_examples)
        self._diagnoses = DiagnosisRecord()
        self._diagnosis_pending = False  # the train step about to run is diagnosed
        self._fed: FedIterator | None = None  # the iterator this fit's batches go back through
        self._diagnosis_functions: dict[Any, Any] = {}
        self._compiled: bool | None = None  # the diagnoses scan under XLA (at the first)
        self._compiled_rows: int | None = None  # the batch size they compile for
        self._twin: Any = None  # the copy of the model diagnosed in fit (False: none)
        #: Diagnoses the worker could not read on the copy (none was made): the main thread
        #: reads them on the model itself (``_read_on_the_model``'s arguments).
        self._on_the_model: list[tuple[Any, ...]] = []
        self._witnessing: Future[Any] | None = None  # the job witnessing the copy
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.loss_name = loss
        self._engine: Any = None
        self._inputs: tuple[Any, list[str]] | None = None  # the model, its input names
        self._pass: TracedPass | None = None  # the engine's, made with it
        self._writer: Any = None
        self._record_of = FlowRecord()
        self._mixed_precision = MixedPrecisionRecord()  # under a mixed policy only
        self.per_example = bool(per_example)
        self._per_example = PerExampleRecord() if per_example else None
        self._batches = 0  # batches trained while this callback watched fit
        self._epoch_base = 0
        self._epoch: int | None = None
        self._pending = False  # the train step about to run is observed
        self._through = 0  # the batches trained once the execution about to run has run
        self._last_batch: Any = None
        self._original_train_function: Any = None
        self._worker: ThreadPoolExecutor | None = None
        self._pending_work: list[Future[Any]] = []
        self._warm: Future[Any] | None = None
        self._warm_tried = False
        self._warm_up_released = threading.Event()  # opens the warm-up's gate: see _warm_up
        self._first_step = threading.Event()  # set while fit's first step runs
        self._calls = threading.RLock()  # the model's call, one thread at a time: see _one_call
        self._own_call: tuple[Any, Any] | None = None  # (model, its own call before) in a fit
        self._fit_spec: Any = None
        self._fit_first = 0  # batches watched before this fit
        self._fitted = False  # a fit has run: ``every`` applies (not to a custom loop)
        self.stop_on_nan = bool(stop_on_nan)
        #: Where the first NaN of fit was born (``stop_on_nan``), and at which step.
        self.nonfinite: NonFiniteEntry | None = None
        self.nonfinite_step: int | None = None
        self._held: list[tuple[Any, list[np.ndarray]]] = []  # (batch, weights before its step)
        #: The carried states of stateful layers as the observed or diagnosed step started.
        self._start_states: list[tuple[Any, np.ndarray]] | None = None
        if model is not None:
            self.set_model(model)

    # -- model.fit -----------------------------------------------------------------------------

    @property
    def async_safe(self) -> bool:
        """Whether Keras may call :meth:`on_train_batch_end` on a thread of its own, without
        waiting for each step's logs, as it does for a plain fit: the observations and
        diagnoses are taken in fit's train function, on the training thread, right after
        their step (:meth:`_take`), so the batch's end has nothing of theirs to do. Not with
        ``stop_on_nan``, which reads each step's loss before the next step runs, nor where
        diagnoses come closer than :data:`ASYNC_FROM` batches apart: the worker diagnoses
        beside training nearly all the time then, and a training thread that runs ahead
        contends with it."""
        return not self.stop_on_nan and (self.diagnose_every is None
                                         or self.diagnose_every >= ASYNC_FROM)

    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        strategy = model.distribute_strategy
        served = ("MirroredStrategy", "OneDeviceStrategy", "_DefaultDistributionStrategy")
        if type(strategy).__name__ not in served:
            raise ConfigError(f"GradientFlow: the model trains under {type(strategy).__name__}, "
                              "which GradientFlow does not serve: its extra pass runs on one "
                              "device, on the whole global batch; MirroredStrategy and one "
                              "device are served", where="GradientFlow")
        if (self.loss_name is None and getattr(model, "compiled", False)
                and getattr(model, "loss", None) is None and _own_train_step(model)):
            # Found tried as a new user would: keras.io's "customizing fit" model, compiled
            # with an optimizer alone, its loss in its own train_step: the whole fit ran,
            # then its end raised "fit has nothing to minimise".
            raise ConfigError(
                f"GradientFlow: model '{model.name}' was compiled with no loss, and its own "
                "train_step computes the loss fit minimises, which GradientFlow cannot read: "
                "pass GradientFlow(loss=NAME), the Keras loss that train_step minimises",
                where="loss")
        self._pending = self._diagnosis_pending = False  # a fit that raised may leave them
        original = model.train_function
        # A fit that raised (Keras then calls no on_train_end) left this wrapper, or another
        # GradientFlow's, in place: Keras keeps a made train function.
        original = getattr(original, "_gradscope_wraps", original)
        self._original_train_function = original
        self._fitted = True
        self._fit_first = self._batches
        self._fit_spec = None  # read from this fit's first batches
        self._compiled = self._compiled_rows = None  # decided at this fit's first diagnosis
        steps = int(getattr(model, "steps_per_execution", 1) or 1)
        self._fed = None  # made at this fit's first replay
        for name, every, what in (("every", self.every, "observation"),
                                  ("diagnose_every", self.diagnose_every, "diagnosis")):
            if every is not None and every < steps:
                # Found tried as a new user would: diagnose_every=2 at 4 steps per execution
                # gave as many diagnoses as diagnose_every=4, and the report said "one
                # every 2 batches".
                warnings.warn(f"GradientFlow({name}={every}): the model runs {steps} steps "
                              "per execution, and the callback sees the last batch of each: "
                              f"at most one {what} per execution, of its last batch (an "
                              "epoch's last execution may hold fewer batches)", stacklevel=2)
            elif every is not None and steps > 1 and every % steps:
                # Found tried as a new user would: every=3 at 2 steps per execution observed
                # batches 4, 6, 10 and 12, without a word.
                taken = sorted({-(-n // steps) * steps
                                for n in range(every, every * 4 + 1, every)})[:4]
                warnings.warn(f"GradientFlow({name}={every}): the model runs {steps} steps "
                              "per execution, and the callback sees the last batch of each: "
                              f"each {what} is of the last batch of an execution that holds "
                              f"a multiple of {every} (batches {', '.join(map(str, taken))}, "
                              f"…); a {name} that is a multiple of {steps} takes one at "
                              "each of its multiples",
                              stacklevel=2)
        if self.stop_on_nan and steps > 1:
            raise ConfigError(f"GradientFlow(stop_on_nan=True): the model runs {steps} steps "
                              "per execution; the failing batch is rerun with the weights its "
                              "own step started from, so it needs steps_per_execution=1",
                              where="stop_on_nan")
        self._held = []

        def train_function(iterator: Any) -> Any:
            if self._fit_spec is None:
                self._fit_spec = getattr(iterator, "element_spec", None)
                self._first_step.set()  # the warm-up's gate watches this step
                try:
                    self._warm_up(self._fit_spec, self._first_step)  # beside this step
                    return step(iterator)
                finally:
                    self._first_step.clear()
            return step(iterator)

        def step(iterator: Any) -> Any:
            if not self._pending and not self._diagnosis_pending and not self.stop_on_nan:
                return original(iterator)
            batches = list(itertools.islice(iterator, steps))
            if not batches:
                self._pending = self._diagnosis_pending = False  # no step to take it of
                # The end of data: Keras' own call on the spent iterator, which it counts as
                # fit does (found tried as a new user would: raised here, a generator's fit
                # ended with optimizer.iterations one short, and Adam's next steps moved).
                return original(iterator)
            self._last_batch = global_batch(strategy, batches[-1])
            if self._fed is None and isinstance(iterator, tf.data.Iterator):
                self._fed = FedIterator(iterator.element_spec, steps)
            if self.stop_on_nan:
                self._held = [*self._held[-1:], (self._last_batch, snapshot(model))]
            # A stateful layer's carried state as this batch starts: an observation or a
            # diagnosis reruns the batch from it, not from where the step leaves it. With
            # several steps per execution, the steps before the last run first, as Keras runs
            # them, so that the last one's start is seen.
            self._start_states = None
            if self._pending or self._diagnosis_pending:
                carried = carried_state_variables(model)
                if carried and len(batches) > 1:
                    original(replay(iterator, batches[:-1], strategy, self._fed))
                    batches = batches[-1:]
                self._start_states = moved_state_of(carried) if carried else None
            # Keras' step, on these tensors.
            logs = original(replay(iterator, batches, strategy, self._fed))
            if not self.stop_on_nan:  # else at the batch's end, once its loss is read
                self._batches = self._through
                self._take(self._through)
            return logs

        train_function._gradscope_wraps = original  # type: ignore[attr-defined]
        model.train_function = train_function
        if strategy.num_replicas_in_sync == 1:
            self._one_call(model)

    def _one_call(self, model: Any) -> None:
        """The model's call, one thread at a time while this fit runs: Keras traces it on
        the training thread (at the first step, and where a batch's signature is new), the
        worker traces it beside (the observation's pass, the copy's witness), and Keras'
        layers keep state from the start of a call to its end (a recurrent cell caches its
        dropout masks there). Found in a loaded run of the suite: a GRU with recurrent
        dropout, fit's first step; the warm-up's trace began while Keras still traced its
        step, and Keras' trace took the worker's mask ("defined in FuncGraph(name=stateless),
        which is out of scope"), a TypeError out of fit. Compiled steps do not call it: only
        traces wait, and only for each other. Not under several replicas, whose threads
        take turns inside a call (a lock held across a turn would never be given back)."""
        stale = model.__dict__.get("call")
        if hasattr(stale, "_gradscope_own"):  # a fit that raised left its lock in place
            self._own_call = (model, stale._gradscope_own)
            self._whole_call()
        inner = model.call
        calls = self._calls

        @functools.wraps(inner)
        def call(*args: Any, **kwargs: Any) -> Any:
            with calls:
                return inner(*args, **kwargs)

        call._gradscope_own = model.__dict__.get("call")  # type: ignore[attr-defined]
        self._own_call = (model, call._gradscope_own)  # type: ignore[attr-defined]
        object.__setattr__(model, "call", call)  # past Keras' attribute tracking

    def _whole_call(self) -> None:
        """The model's own call again (:meth:`_one_call`), as it was before this fit."""
        if self._own_call is None:
            return
        (model, own), self._own_call = self._own_call, None
        if own is None:
            model.__dict__.pop("call", None)
        else:
            object.__setattr__(model, "call", own)

    def on_train_end(self, logs: Any = None) -> None:
        if self._original_train_function is not None:
            self.model.train_function = self._original_train_function
            self._original_train_function = None
        self._drain()
        self._whole_call()
        if self.log_dir is not None:
            from gradscope.keras.summaries import FlowSummaryWriter

            if self._writer is None:
                self._writer = FlowSummaryWriter(tf, self.log_dir)
            # The run's description at fit's last batch, with the batches trained: watch reads
            # a run that observed nothing (found tried as a new user would: "no such
            # folder"), and says why nothing was taken, as report() does ("2 batches trained,
            # fewer than every=50": found tried as a new user would, watch said nothing).
            history = self._history()
            self._writer.write_run(self._batches, {**self._run(history),
                                                   "batches": self._batches})

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch
        self._epoch_base = self._batches

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        steps = int(getattr(self.model, "steps_per_execution", 1) or 1)
        first = self._epoch_base + batch + 1
        # The batches this execution runs: an epoch's last may run fewer than
        # steps_per_execution (found tried as a new user would: the last two of an epoch of
        # 10 at 4 per execution were diagnosed, for the 12 they do not reach).
        end = first + steps
        epoch = (getattr(self, "params", None) or {}).get("steps")
        if epoch:
            end = min(end, self._epoch_base + int(epoch) + 1)
        if self._pending or self._diagnosis_pending:  # the last execution's, not taken
            self._not_seen()
        self._through = end - 1  # the batches trained once this execution has run
        self._pending = any(n % self.every == 0 for n in range(first, end))
        self._diagnosis_pending = self.diagnose_every is not None and any(
            n % self.diagnose_every == 0 for n in range(first, end))
        self._last_batch = None

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        # With steps_per_execution, Keras names the last step of an execution as if it were
        # whole: one that runs past the epoch's end is numbered beyond it.
        steps = (getattr(self, "params", None) or {}).get("steps")
        if steps:
            batch = min(batch, int(steps) - 1)
        # Called on a thread of Keras' own where async_safe, maybe after the next step has
        # begun: the count never goes back.
        self._batches = max(self._batches, self._epoch_base + batch + 1)
        self._warm_up_released.set()
        if not self.stop_on_nan:
            return  # the step's own observation and diagnosis are taken (_take)
        loss = (logs or {}).get("loss")
        if loss is not None and not np.all(np.isfinite(np.asarray(loss))):
            self._pending = False
            self._stop_for_nan(self._batches)
            return
        self._take(self._batches)

    def _not_seen(self) -> None:
        raise ConfigError("GradientFlow: the batch fit trained on was not seen: "
                          "model.train_function was replaced after training began",
                          where="GradientFlow")

    def _take(self, step: int) -> None:
        """The observation and the diagnosis the step that has just run owes, on fit's
        thread, before the next step: its batch, its weights as it left them. ``step``: the
        batches trained once it ran (given, not read from ``_batches``, which Keras' thread
        of batch ends also writes)."""
        observed, diagnosed = self._pending, self._diagnosis_pending
        if not observed and not diagnosed:
            return
        self._pending = self._diagnosis_pending = False
        data, self._last_batch = self._last_batch, None
        if data is None:
            self._not_seen()
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if y is None and not self._engine_for(x).added_only:
            raise ConfigError("GradientFlow: the batches carry no targets y", where="y")
        start, self._start_states = self._start_states, None
        with states_at(start):
            if observed:
                self._observe(x, y, step, self._epoch, sample_weight)
            if diagnosed:
                self._diagnose(x, y, step, sample_weight)

    def _stop_for_nan(self, step: int) -> None:
        """Where the NaN of this step was born; said, kept, written; training stops."""
        from gradscope.keras import nan_stop

        self._drain()
        self._settle_warm_up()
        engine = self._engine_for()
        found, at = None, step
        for back, (batch, weights) in enumerate(reversed(self._held)):
            diagnosed = self._diagnosed(engine, batch, weights)
            if diagnosed is None:
                continue
            if found is None or found.origin == "weight":
                found, at = diagnosed, step - back
            if found.origin != "weight":
                break
        if found is None:
            found = NonFiniteEntry.model_validate({
                "pass": "forward", "origin": "unknown", "layer": None, "step": None,
                "examples": [], "operation": None,
                "cause": "fit's loss is not finite at this step, but a rerun of its batch in "
                         "inference mode is finite: training mode differs (dropout, batch "
                         "norm's batch statistics)"})
        if found.origin in ("loss", "layer") and at == step and len(self._held) == 2:
            grown = nan_stop.diverging(self.model, self._held[0][1], self._held[1][1],
                                       step - 1)
            if grown is not None:
                found = found.model_copy(update={"cause": f"{found.cause}; {grown}"})
        self.nonfinite, self.nonfinite_step = found, at
        self._held = []
        self.model.stop_training = True
        sys.stderr.write(nan_stop.text(found, at))
        if self.log_dir is not None:
            from gradscope.keras.summaries import FlowSummaryWriter

            if self._writer is None:
                self._writer = FlowSummaryWriter(tf, self.log_dir)
            nan_stop.write(self.log_dir, self._writer.writer, tf, found, at, self._history())

    def _diagnosed(self, engine: Any, batch: Any, weights: list[np.ndarray],
                   ) -> NonFiniteEntry | None:
        """One held batch rerun on the weights its step started from, diagnosed."""
        from gradscope.keras import nan_stop
        from gradscope.keras.nonfinite import diagnose

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        inputs, targets = self._names(engine, x, y)
        weighed = nan_stop.as_arrays(sample_weight)
        with nan_stop.weights_held(self.model, weights):
            result = engine.run(inputs, targets, sample_weight=weighed)
            return diagnose(engine, inputs, targets, weighed, result)

    # -- a custom training loop ----------------------------------------------------------------

    def observe(self, x: Any, y: Any, step: int | None = None,
                sample_weight: Any = None) -> None:
        """Take the extra pass now on the batch ``(x, y)`` (arrays or tensors, structured as
        the model's inputs and outputs), with the model's current weights, recorded at
        ``step`` (default: one more than the last recorded step). ``sample_weight`` weighs
        the loss as ``compute_loss`` does (as fit's batches do)."""
        self._drain()
        if step is None:
            step = self._record_of.next_step()
        last = self._record_of.next_step() - 1
        if self._record_of.observations and int(step) <= last:
            # Found tried as a new user would: step 5 after 47 was recorded last, the report
            # ended at step 5 ("steps 0–5") and watch, ordering by step, put it fourth.
            raise ConfigError(f"GradientFlow.observe(step={step}): the steps observed go "
                              f"forward, and step {last} is recorded; expected a step after "
                              f"{last} (or none: {last + 1})", where="step")
        self._observe(x, y, int(step), None, sample_weight)
        if self.diagnose_every is not None and int(step) % self.diagnose_every == 0:
            self._diagnose(x, y, int(step), sample_weight)

    # -- work beside training ------------------------------------------------------------------

    def _submit(self, job: Any, *args: Any, pending: bool = True) -> Future[Any]:
        """Run ``job`` on the worker, after what it was given before. With ``pending``,
        ``_drain`` waits for it and raises its error."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix="gradscope-GradientFlow")
        future = self._worker.submit(job, *args)
        if pending:
            self._pending_work.append(future)
        return future

    def _drain(self) -> None:
        """Wait for the recordings handed to the worker (an error raised there is raised
        here), and read the diagnoses it left to this thread (``_read_on_the_model``)."""
        while self._pending_work or self._on_the_model:
            pending, self._pending_work = self._pending_work, []
            for future in pending:
                future.result()
            waiting, self._on_the_model = self._on_the_model, []
            for job in waiting:
                self._read_on_the_model(*job)

    def _settle_warm_up(self) -> None:
        """Wait for the trace made beside training, if any, and for the copy's witness (it
        calls the model): the model is this thread's then. If the trace failed, the
        pass is traced again where it is needed, on this thread, and raises its error
        there."""
        warm, self._warm = self._warm, None
        if warm is not None:
            self._warm_up_released.set()  # a warm-up still at its gate traces now
            self._warmed(warm)
        if self._witnessing is not None:  # the copy's witness calls the model
            self._witnessing.result()
        self._witnessing = None

    def _warmed(self, warm: Future[Any]) -> None:
        """The trace made beside training, waited for: if it failed, the pass is traced
        again where it is needed, and raises its error there."""
        try:
            warm.result()
        except Exception:  # noqa: BLE001  (traced again where needed; that error is raised)
            if self._pass is not None:
                self._pass.forget()

    def _compiles_diagnoses(self) -> bool:
        """Whether this fit's diagnoses scan under XLA: where fit knows its length and takes
        at least ``COMPILED_DIAGNOSES`` more
        (:mod:`~gradscope.keras.diagnose.during_training`), which the compilation pays for."""
        from gradscope.keras.diagnose.during_training import COMPILED_DIAGNOSES

        params = self.params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        if not steps or not epochs or self.diagnose_every is None:
            return False
        left = self._fit_first + int(steps) * int(epochs) - self._batches
        return left // self.diagnose_every + 1 >= COMPILED_DIAGNOSES

    def _observes_later(self) -> bool:
        """Whether this fit reaches another observed batch (when fit knows its length)."""
        params = self.params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        if not steps or not epochs:
            return True
        following = (self._batches // self.every + 1) * self.every
        return following <= self._fit_first + int(steps) * int(epochs)

    def _warm_up(self, spec: Any, stepping: threading.Event) -> None:
        """At the first step of a fit that reaches an observed batch, trace the pass on the
        worker, from the element spec of fit's batches, while Keras trains. Only where those
        shapes are whole but for the batch axis (else the first observation traces, as
        ``observe`` does) and where Keras runs compiled steps: an eager (``run_eagerly``) step
        calls the layers in Python on this thread meanwhile.

        The worker waits at a gate first: Keras traces its own train step in Python at this
        first step (holding the GIL, on one core), then builds and runs it in TensorFlow's
        runtime (the GIL released, one core busy and the other free for a while). The trace
        starts there (``_native_call``; ``stepping`` is set while the call that runs the
        step), and takes little from training; if that moment is not seen, it starts when the
        first step ends, as it would without the gate."""
        if (spec is None or getattr(self.model, "run_eagerly", False)
                or self.model.distribute_strategy.num_replicas_in_sync > 1):
            return  # a distributed fit's first observation traces the pass
        x, y, _ = keras.utils.unpack_x_y_sample_weight(spec)
        try:
            engine = self._engine_for(x)  # a new model resets what was traced
            if self._warm_tried or not self._observes_later():
                return
            self._warm_tried = True
            inputs, targets = self._names(engine, x, y)
        except ConfigError:
            return  # the observation says why, with the batch itself
        specs = list(inputs.values()) + list(targets.values())
        if not all(isinstance(s, tf.TensorSpec) and s.shape.rank and
                   s.shape[1:].is_fully_defined() for s in specs):
            return
        self._warm_up_released.clear()
        self._warm = self._submit(self._trace_beside, threading.get_ident(), stepping,
                                  self._pass, list(inputs.values()), list(targets.values()),
                                  pending=False)

    def _trace_beside(self, thread: int, stepping: threading.Event, traced: TracedPass,
                      inputs: list[Any], targets: list[Any]) -> None:
        traced.trace["gate"] = _native_call(thread, self._warm_up_released, stepping)
        traced.trace["began_after"] = self._batches  # batches trained when the trace began
        traced.warm(inputs, targets)
        self._mixed_precision.warm(traced.engine, inputs, targets)  # a mixed policy's passes

    # -- the pass ------------------------------------------------------------------------------

    def _engine_for(self, x: Any = None) -> Any:
        """The engine of the model fit trains, made at its first need; ``x``: a batch of
        fit's inputs (or their specs), whose dtypes read a subclassed model's graph."""
        if self._engine is not None and self._engine.model is not self.model:
            # Another model (set_model by a later fit): its own engine and trace.
            self._drain()
            self._settle_warm_up()
            self._warm_tried = False
            self._engine = self._pass = None
        if self._engine is None:
            if self.model is None:
                raise ConfigError("GradientFlow.observe: no model; give it with "
                                  "GradientFlow(model=model) or callback.set_model(model)",
                                  where="model")
            from gradscope.keras.live_engine import make_engine
            from gradscope.keras.subclassed import data_dtypes

            self._engine = make_engine(self.model, self.loss_name, data_dtypes(x))
            # Stateless (it reads the weights it is given), so that an observation in fit
            # runs beside training (``_observe``); not under a distribution strategy.
            self._pass = TracedPass(
                self._engine, stateless=self.model.distribute_strategy.num_replicas_in_sync == 1)
            self._record_of.names = live_names(self._engine)
            self._diagnosis_functions = {}  # the diagnosis's traced functions, this engine's
            self._twin = None  # and its copy of the model
        return self._engine

    def _names(self, engine: Any, x: Any, y: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The batch's inputs and targets by the names of the model's inputs and of the
        engine's outputs (NumPy arrays; ``tf.TensorSpec``s stay as they are)."""
        model = self.model
        if self._inputs is None or self._inputs[0] is not model:
            self._inputs = (model, _input_names(model))
        inputs = _flat(x, self._inputs[1], "x")
        if y is None and engine.added_only:
            return inputs, _unread_targets(model, engine, inputs)
        outputs = list(getattr(model, "output_names", None) or engine.output_names)
        targets = _flat(y, outputs, "y")
        return inputs, dict(zip(engine.output_names, targets.values(), strict=True))

    def _weights_of(self, engine: Any, sample_weight: Any) -> Any:
        """A batch's sample weights as the engine's compute_loss takes them: None, one tensor,
        or a list of tensors by output (a structure of them, as fit gives, is flattened)."""
        if sample_weight is None:
            return None
        if isinstance(sample_weight, dict | list | tuple):
            names = list(getattr(self.model, "output_names", None) or engine.output_names)
            by_name = _flat(sample_weight, names, "sample_weight")
            return [tf.cast(tf.convert_to_tensor(v), engine.dtype_name)
                    for v in by_name.values()]
        return tf.cast(tf.convert_to_tensor(sample_weight), engine.dtype_name)

    def _observe(self, x: Any, y: Any, step: int, epoch: int | None,
                 sample_weight: Any = None) -> None:
        engine = self._engine_for(x)
        inputs, targets = self._names(engine, x, y)
        sample = self._weights_of(engine, sample_weight)
        failed = [f for f in self._pending_work if f.done() and f.exception() is not None]
        if failed:
            self._drain()  # an earlier recording failed: say so now
        beside = self._observes_beside(inputs, targets, sample)
        if not beside:
            self._settle_warm_up()
        traced = self._pass
        assert traced is not None
        # Beside training, the pass runs on the worker from a copy of the weights this step
        # left (about 2 ms here, where the pass itself took training about 25 ms on
        # bench/callback_overhead.py's model); else now, here.
        values = values_now(traced.variables) if beside and traced.variables else None

        def passed() -> tuple[KerasPass, Callable[[], None] | None]:
            result = traced.run(inputs, targets, sample, values)
            return result, traced.witness(inputs, targets, result, sample, values)

        now = None if beside else passed()
        # Under a mixed policy: the shares lost at the loss scale, now (None otherwise).
        mixed = self._mixed_precision.observe(engine, inputs, targets, sample)
        # With per_example=True (never beside): explain's per-example section of this batch.
        examples = (None if self._per_example is None or now is None else
                    self._per_example.observe(engine, inputs, targets, sample, now[0]))

        def record() -> None:
            result, witness = now if now is not None else passed()
            if witness is not None:  # nothing is recorded that Keras' own call contradicts
                witness()
            if mixed is not None:
                mixed(len(self._record_of.observations))
            if examples is not None:
                examples(len(self._record_of.observations))
            self._record(engine, inputs, result, step, epoch)

        if self._original_train_function is None:
            record()  # a custom loop's observe(): done when it returns
        else:
            self._submit(record)

    def _observes_beside(self, inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                         sample: Any) -> bool:
        """Whether this observation runs on the worker, beside training: in fit, once the pass
        is traced (beside training, at fit's first step), reads only the weights it is given
        (``TracedPass.beside``) and takes this batch as traced: a batch it would trace again
        for (an epoch's shorter last one, sample weights) is observed here, so that no other
        thread traces the model's layers while this one may (a validation's first
        evaluation). Not with ``per_example``, whose section reads the pass's result here."""
        warm = self._warm
        if warm is not None and warm.done():
            self._warm = None
            self._warmed(warm)
        return (self._original_train_function is not None and self._per_example is None
                and self._warm is None and self._pass is not None and self._pass.beside
                and self._pass.takes(inputs, targets, sample))

    def _diagnose(self, x: Any, y: Any, step: int, sample_weight: Any = None) -> None:
        """Diagnose every recurrent call on this batch with the weights fit has just updated.
        In fit, on a copy of the model given those weights
        (:mod:`~gradscope.keras.diagnosis_twin`), on the worker while training goes on: from
        copies of the variables until the copy is witnessed and its functions traced, then
        from its own variables, given the model's here (training waits for that copy alone);
        where the model cannot be copied, and in a custom loop, on the model itself, here
        (training waits). Recorded and written on the worker, after the observations before
        it."""
        from gradscope.keras import nan_stop

        engine = self._engine_for(x)
        inputs, targets = self._names(engine, x, y)
        weighed = nan_stop.as_arrays(sample_weight)
        inputs, targets, weighed = self._diagnosed_examples(inputs, targets, weighed)
        rows = _rows(inputs)
        if self._compiled is None:
            self._compiled = self._compiles_diagnoses()
            self._compiled_rows = rows
        # XLA compiles for one batch size: a batch of another (an epoch's last, shorter) is
        # read as a graph, traced once, rather than compiled again (found tried as a new
        # user would: about 1 s more a fit).
        compiled = self._compiled and rows == self._compiled_rows

        def record(readings: list[Any], skipped: list[tuple[str, str]]) -> None:
            self._diagnoses.add(readings, skipped, step)
            if self.log_dir is not None:
                self._write_diagnosis(step, readings, skipped)

        if self._original_train_function is not None and self._twin is None:
            self._make_twin()  # this fit's first diagnosis
        twin = self._twin
        if (isinstance(twin, DiagnosisTwin) and twin.ready and twin.witnessed
                and all(job.done() for job in self._pending_work)):
            # Its functions traced (and compiled) by the first diagnosis. The reads before
            # this one ended, the copy takes the weights this step left (one traced function,
            # about 0.4 ms, training waiting), and is read on the worker while training goes
            # on: nothing else runs on the copy until it has ended. While the worker still
            # has work (the reads queued while the first was traced and compiled), the read
            # is queued behind it with copies of the weights, as those were: training does
            # not wait for them (found measuring: about 0.4 s of a fit of 1000 batches, at
            # diagnose_every=4, when the first read ended).
            self._drain()
            twin.take_weights(self.model)
            self._submit(self._read_copy, twin, inputs, targets, weighed, compiled, record)
            return
        if twin is not None and twin is not False:  # witnessed, or its first read
            variables = all_variables(self.model)
            values = values_now(variables)
            if self._witnessing is None and not (isinstance(twin, DiagnosisTwin)
                                                 and twin.witnessed):
                # Once, on this batch. The witness calls the model: waited for where this
                # thread may trace it (not behind the reads queued after it).
                self._witnessing = self._submit(self._witness_beside, inputs, variables,
                                                values, pending=False)
            self._submit(self._read_beside, engine, variables, values, inputs, targets,
                         weighed, compiled, record)
            return
        # The model's own layers are traced here: nothing may trace them on the worker
        # meanwhile (the warm-up, a first observation's witness, the copy's).
        self._drain()
        self._settle_warm_up()
        self._read_on_the_model(engine, None, inputs, targets, weighed, compiled, record)

    def _make_twin(self) -> None:
        """Make the copy of the model (:func:`~gradscope.keras.diagnosis_twin.copy_of`), or
        False where there is none (a stateful layer's model: its diagnoses read the state
        the step started from, on the model itself). Here, between two steps (about 0.04 s),
        not on the worker: Keras' layers draw their seeds from Python's global generator as
        they are made, whose state is put back, which only this thread may do while training
        goes on (found tried as a new user would: a PyDataset, shuffled by Python's
        generator at each epoch, trained in another order with diagnoses)."""
        import random

        from gradscope.keras.diagnosis_twin import copy_of

        if stateful_layers(self.model):
            self._twin = False
            return
        python, numpy = random.getstate(), np.random.get_state()
        try:
            self._twin = copy_of(self.model, self.loss_name) or False
        finally:
            random.setstate(python)
            np.random.set_state(numpy)

    def _read_copy(self, twin: DiagnosisTwin, inputs: dict[str, np.ndarray],
                   targets: dict[str, np.ndarray], weighed: Any, compiled: bool,
                   record: Any) -> None:
        """On the worker: a diagnosis read on the copy as it holds its weights, recorded."""
        record(*twin.read(None, inputs, targets, weighed, self.diagnose_exponents,
                          self.diagnose_horizon, compiled))

    def _read_beside(self, engine: Any, variables: list[Any], values: list[Any],
                     inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                     weighed: Any, compiled: bool, record: Any) -> None:
        """On the worker: a diagnosis read on the copy holding ``values`` (the model's
        variables as the step left them); where there is no copy (or its witness failed),
        kept for the main thread, which reads it on the model itself holding those weights
        (between two steps)."""
        from gradscope.keras.diagnosis_twin import weights_of

        twin = self._twin
        if isinstance(twin, DiagnosisTwin) and twin.witnessed:
            twin.hold(variables, values)
            self._read_copy(twin, inputs, targets, weighed, compiled, record)
            return
        self._on_the_model.append((engine, weights_of(engine.user_model, variables, values),
                                   inputs, targets, weighed, compiled, record))

    def _witness_beside(self, inputs: dict[str, np.ndarray], variables: list[Any],
                        values: list[Any]) -> None:
        """On the worker: the copy witnessed on a diagnosis's batch (once); False where there
        is none, or its witness fails."""
        twin = self._twin
        if isinstance(twin, DiagnosisTwin) and not twin.witnessed and not twin.witness(
                inputs, variables, values):
            self._twin = False

    def _read_on_the_model(self, engine: Any, weights: list[np.ndarray] | None,
                           inputs: dict[str, np.ndarray], targets: dict[str, np.ndarray],
                           weighed: Any, compiled: bool, record: Any) -> None:
        """A diagnosis read on the model itself, now, holding ``weights`` (None: its own).
        Recorded now in a custom loop, else on the worker."""
        from gradscope.keras import nan_stop
        from gradscope.keras.diagnose.during_training import read_calls

        with (nan_stop.weights_held(engine.user_model, weights) if weights is not None
              else contextlib.nullcontext()):
            found = read_calls(engine, inputs, targets, weighed, self.diagnose_exponents,
                               self.diagnose_horizon, self._diagnosis_functions, compiled)
        if self._original_train_function is None:
            record(*found)
        else:
            self._submit(record, *found)

    def _diagnosed_examples(self, *parts: Any) -> tuple[Any, ...]:
        """The batch's inputs, targets and sample weights at the examples a diagnosis reads
        (``diagnose_examples``, evenly spaced)."""
        from gradscope.keras.checked_examples import take
        from gradscope.keras.diagnose.horizon import evenly

        size = _rows(parts[0])
        if (self.diagnose_examples is None or size is None or size <= self.diagnose_examples
                or carried_state_variables(self.model)):
            return parts
        rows = evenly(size, self.diagnose_examples)
        return tuple(None if part is None else
                     keras.tree.map_structure(lambda v: take(v, rows, size), part)
                     for part in parts)

    def _write_diagnosis(self, step: int, readings: list[Any],
                         skipped: list[tuple[str, str]]) -> None:
        from gradscope.keras.summaries import FlowSummaryWriter

        if self._writer is None:
            self._writer = FlowSummaryWriter(tf, self.log_dir)  # type: ignore[arg-type]
        # The run's description once before the first observation, which describes it whole
        # (the whole history is built for it: a fit that diagnosed without observing built it
        # at every diagnosis, and wrote it again, each time longer).
        run = self._run(self._history()) if self._writer.wants_run else None
        self._writer.write_diagnosis(step, readings, skipped, run)

    def _record(self, engine: Any, inputs: dict[str, np.ndarray], result: KerasPass,
                step: int, epoch: int | None) -> None:
        skipped = self._record_of.add(engine, inputs, result, step, epoch)
        if self.log_dir is not None:
            self._write(step, epoch, _rows(inputs), skipped)

    def _write(self, step: int, epoch: int | None, size: int | None,
               skipped: list[Any]) -> None:
        from gradscope.keras.summaries import FlowSummaryWriter

        if self._writer is None:
            self._writer = FlowSummaryWriter(tf, self.log_dir)  # type: ignore[arg-type]
        history = self._history()
        details = {"epoch": epoch, "batch_size": size,
                   "not_analysed": [{"layer": s.layer, "reason": s.reason} for s in skipped]}
        self._writer.write(history, self._run(history), details)

    @staticmethod
    def _run(history: FlowHistoryReport) -> dict[str, Any]:
        """The run's description, as ``gradscope watch`` reads it back."""
        return {"source": history.source, "loss": history.loss, "mode": history.mode,
                "every": history.every, "flag_factor": history.flag_factor,
                "method": history.method, "diagnose_every": history.diagnose_every,
                "diagnose_exponents": history.diagnose_exponents,
                "diagnose_examples": history.diagnose_examples,
                "weights": [{"weight": w.weight, "shape": w.shape} for w in history.weights],
                "recurrent": [{"layer": r.layer, "class_name": r.class_name, "units": r.units,
                               "states": list(r.initial_state_norms),
                               "backwards": r.backwards} for r in history.recurrent]}

    # -- the report ----------------------------------------------------------------------------

    @property
    def history(self) -> FlowHistoryReport:
        """Everything recorded so far, as a report (``to_dict()``, ``to_json()``)."""
        self._drain()
        return self._history()

    def _history(self) -> FlowHistoryReport:
        engine = self._engine
        model = self.model
        source = f"model '{model.name}'" if model is not None else "no model yet"
        loss = _loss_text(engine.plan) if engine is not None else (self.loss_name or
                                                                   "the compiled loss")
        # every is fit's (found tried as a new user would: a custom loop's report said "one
        # pass every 50 batches", the default, of steps observe() was given).
        report = self._mixed_precision.attached(self._record_of.report(
            source, loss, self.every if self._fitted else None))
        report = report.model_copy(update={"batches": self._batches})
        if self._per_example is not None:
            report = self._per_example.attached(report)
        if self.diagnose_every is not None:
            report = report.model_copy(update={
                "diagnose_every": self.diagnose_every,
                "diagnose_exponents": self.diagnose_exponents,
                "diagnose_examples": self.diagnose_examples,
                "diagnosis_steps": list(self._diagnoses.steps),
                "diagnoses": self._diagnoses.series(),
                "not_diagnosed": self._diagnoses.not_diagnosed()})
        if self.nonfinite is None:
            return report
        return report.model_copy(update={"nonfinite": self.nonfinite,
                                         "nonfinite_step": self.nonfinite_step})

    def report(self, width: int | None = None) -> None:
        """Print the history as ``gradscope watch`` does (in a notebook: as HTML, when the
        report can render itself so)."""
        history = self.history
        if _in_notebook() and hasattr(history, "_repr_html_"):
            from IPython.display import display

            display(history)
            return
        from rich.console import Console

        from gradscope.report.render import print_report

        print_report(Console(width=width, highlight=False), history)

    def close(self) -> None:
        """Close the TensorBoard writer (it is flushed after every observation anyway)."""
        self._drain()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _native_call(thread: int, released: threading.Event, stepping: threading.Event) -> str:
    """Return once ``thread`` is running compiled TensorFlow code while ``stepping`` is set:
    one and the same call of TensorFlow's eager ``quick_execute`` (where the GIL is released)
    is its innermost Python frame at ten looks in a row. (While Keras traces its step, it
    runs short eager calls too, such as one that initialises the optimizer's variables; ten
    looks, at least 18 ms of one call, pass over them.) Only the thread's innermost frame is
    read: walking a running thread's frames backwards (``f_back``) can crash CPython 3.11,
    and did here once. It looks every 10 ms, and every 2 ms once such a call is seen: each
    look takes the GIL from the thread it watches. Return also once ``released`` is set, or
    once ``stepping`` is clear (the step ended or failed) or the thread is gone. Only the
    moment the warm-up starts depends on it, never a number. Returns which of these it was:
    "compiled", "released" or "left"."""
    running: Any = None
    seen = 0
    while not released.wait(0.002 if seen else 0.010):
        if not stepping.is_set():
            return "left"
        top = sys._current_frames().get(thread)
        if top is None:
            return "left"
        code = top.f_code
        if code.co_name == "quick_execute" and code.co_filename.endswith("execute.py"):
            # The same frame object across looks: the same call (the reference kept here
            # keeps a later call from reusing its address).
            seen = seen + 1 if top is running else 1
            running = top
            if seen >= 10:
                return "compiled"
        else:
            running, seen = None, 0
    return "released"


def _unread_targets(model: Any, engine: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Targets for a model compiled with no loss, whose batches carry none: zeros of each
    output's shape (``TensorSpec``s for specs), which its loss, the added terms, never
    reads."""
    specs = [keras.KerasTensor(tuple(v.shape), dtype=v.dtype.name if hasattr(v.dtype, "name")
                               else str(v.dtype)) for v in inputs.values()]
    outputs = keras.tree.flatten(model.compute_output_spec(specs if len(specs) > 1
                                                           else specs[0]))
    made: dict[str, Any] = {}
    for name, spec in zip(engine.output_names, outputs, strict=True):
        if all(isinstance(v, tf.TensorSpec) for v in inputs.values()):
            made[name] = tf.TensorSpec(spec.shape, "float32")
        else:
            batch = int(next(iter(inputs.values())).shape[0])
            made[name] = np.zeros((batch, *spec.shape[1:]), "float32")
    return made


def _rows(inputs: dict[str, Any]) -> int | None:
    """The batch size of ``inputs`` (the first input's leading axis; None: not known)."""
    first = next(iter(inputs.values()), None)
    shape = getattr(first, "shape", None)
    return None if not shape else (None if shape[0] is None else int(shape[0]))


def _own_train_step(model: Any) -> bool:
    """Whether the model's class overrides Keras' ``train_step``."""
    import keras

    return type(model).train_step is not keras.Model.train_step


def _loss_text(plan: Any) -> str:
    """The loss and where it came from, in the words of a model in memory: its compiled loss,
    or the ``loss=`` given to GradientFlow (an uncompiled model without it is refused)."""
    if plan.added_only or plan.custom_compute_loss:
        return plan.description
    losses = " + ".join(o.label if len(plan.outputs) == 1 else f"{o.output} {o.label}"
                        for o in plan.outputs)
    return f"{losses} ({'compiled' if plan.source == 'compiled' else 'GradientFlow loss='})"


def _input_names(model: Any) -> list[str]:
    """The names of the model's inputs: a functional model's own; a subclassed model has no
    ``inputs`` (Keras raises), and its graph, read from one symbolic call as explain reads
    it, names them."""
    try:
        tensors = model.inputs
    except AttributeError:
        tensors = None
    if tensors:
        return [getattr(t, "name", f"input {i}") for i, t in enumerate(tensors)]
    from gradscope.keras.live import read_live_graph

    return [ref.layer for ref in read_live_graph(model).inputs]


def _flat(value: Any, names: list[str], what: str) -> dict[str, Any]:
    """The batch's x (or y) as NumPy arrays in the order of the model's inputs (outputs): a
    dict by the names Keras gives them, a list, or one array."""
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise ConfigError(f"GradientFlow: {what} has no array for {missing[0]!r}; expected "
                              f"keys {', '.join(names)}", where=what)
        items = [value[n] for n in names]
    else:
        items = keras.tree.flatten(value)
    if len(items) != len(names):
        raise ConfigError(f"GradientFlow: {what} holds {len(items)} arrays; the model has "
                          f"{len(names)} ({', '.join(names)})", where=what)
    return {name: item if isinstance(item, tf.TensorSpec) else np.asarray(item)
            for name, item in zip(names, items, strict=True)}


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
