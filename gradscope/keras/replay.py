"""The batches ``GradientFlow`` takes from ``fit``'s iterator, handed back to Keras' compiled
train step: as an iterator of the same element spec, so that the function Keras traced for
``fit`` runs as it is and trains bit for bit as a plain ``fit`` (the callback reads an observed
or diagnosed batch itself, then gives it back)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from gradscope._tf import import_tensorflow

tf = import_tensorflow(start=False)  # the runtime is the user's to configure


def _replay_options() -> Any:
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


_REPLAY_OPTIONS = _replay_options()


def global_batch(strategy: Any, batch: Any) -> Any:
    """A batch of a distributed fit (each value split across the replicas) as the global batch
    fit minimises its loss over: each value's replicas' parts, in order. Others as they are."""
    def whole(value: Any) -> Any:
        if isinstance(value, tf.distribute.DistributedValues):
            return tf.concat(strategy.experimental_local_results(value), axis=0)
        return value

    return tf.nest.map_structure(whole, batch)


class FedIterator:
    """One ``tf.data`` iterator of fit's element spec, fed through a queue: each replay
    enqueues its batches (one per step of the execution) and hands Keras' train function this
    iterator, which its loop over fit's iterator takes as it takes fit's own (the same spec:
    the function traced for fit runs as it is, bit for bit). On the GRU 64 → GRU 32 of
    bench/callback_overhead.py: made once in 0.06 s, then about 0.2 ms a replay, where a new
    ``tf.data`` iterator took 5–15 ms a step, and the batches handed over as a list (Keras'
    one-step function run on its own) took 0.18 s at the first (made ready on its own) and
    rounded a GRU's step with recurrent dropout otherwise than fit (found tried as a new user
    would).

    Keras' loop takes exactly ``steps_per_execution`` elements from the iterator: fewer
    batches (an epoch's last execution) go another way, and the queue must be empty before
    each replay."""

    def __init__(self, spec: Any, steps: int) -> None:
        flat = tf.nest.flatten(spec, expand_composites=True)
        self.steps = steps
        self.iterator: Any = None
        if not all(isinstance(s, tf.TensorSpec) for s in flat):
            return
        self.queue = tf.queue.FIFOQueue(steps, [s.dtype for s in flat])

        def take(_: Any) -> Any:
            values = self.queue.dequeue()
            return tf.nest.pack_sequence_as(spec, [tf.ensure_shape(v, s.shape) for v, s in
                                                   zip(values, flat, strict=True)])

        # No element is taken before Keras asks for it: no prefetching, no autotune.
        options = tf.data.Options()
        options.autotune.enabled = False
        options.experimental_optimization.inject_prefetch = False
        dataset = tf.data.Dataset.from_tensors(0).repeat().map(take).with_options(options)
        if dataset.element_spec == spec:
            self.iterator = iter(dataset)

    def __call__(self, batches: list[Any]) -> Any:
        """The iterator, holding ``batches``; None where it cannot."""
        if self.iterator is None or len(batches) != self.steps:
            return None
        if int(self.queue.size()) != 0:
            raise RuntimeError("GradientFlow: Keras' step left a batch handed back to it "
                               "untaken; nothing more is handed back so")
        for batch in batches:
            self.queue.enqueue(tf.nest.flatten(batch, expand_composites=True))
        return self.iterator


def replay(iterator: Any, batches: list[Any], strategy: Any = None,
            fed: FedIterator | None = None) -> Any:
    """An iterator over exactly ``batches`` that Keras' compiled train function takes as it
    takes fit's own: ``fed`` (made at fit's first replay) where it can; else a new ``tf.data``
    iterator of the same element spec, so the function traced for fit's iterator runs again
    as it is.

    A pure graph pipeline serves where its spec is fit's: the batches as they are, one element
    each (where fit's batch axis is static: 5 ms), or their rows batched again (where it is
    free: 15 ms). Where the spec still differs (ragged or sparse parts, batches of unequal
    size), a generator with fit's exact spec serves instead (a Python call per element: ~0.05 s
    more). Anything else (an eager ``run_eagerly`` loop, another iterator type) gets the
    list.

    A distributed fit's iterator (MirroredStrategy) is replayed by distributing the global
    batches again, which splits them across the replicas as fit's own dataset did: the same
    spec, so Keras' traced step runs as it is."""
    if isinstance(iterator, tf.distribute.DistributedIterator) and strategy is not None:
        # One element per global batch; concatenated, not stacked: batches of unequal size
        # (an epoch's last) replay too.
        dataset = functools.reduce(lambda a, b: a.concatenate(b), [
            tf.data.Dataset.from_tensors(global_batch(strategy, batch)) for batch in batches])
        return iter(strategy.experimental_distribute_dataset(
            dataset.with_options(_REPLAY_OPTIONS)))
    spec = getattr(iterator, "element_spec", None)
    if not isinstance(iterator, tf.data.Iterator) or spec is None:
        return batches
    held = fed(batches) if fed is not None else None
    if held is not None:
        return held
    for dataset in _graph_replays(batches):
        if dataset.element_spec == spec:
            return iter(dataset.with_options(_REPLAY_OPTIONS))
    dataset = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)
    return iter(dataset.with_options(_REPLAY_OPTIONS))


def _graph_replays(batches: list[Any]) -> Iterator[Any]:
    """Graph-only datasets of exactly ``batches``, cheapest first: the batches themselves (a
    static batch axis), then their rows batched again with a static and a free batch axis."""
    sizes = {int(t.shape[0]) for t in tf.nest.flatten(batches)
             if isinstance(t, tf.Tensor) and t.shape.rank}
    if len(sizes) != 1:
        return
    try:
        whole = tf.data.Dataset.from_tensor_slices(
            tf.nest.map_structure(lambda *parts: tf.stack(parts), *batches))
    except (TypeError, ValueError, tf.errors.OpError):
        return  # parts that do not stack: the generator
    yield whole
    size = sizes.pop()
    rows = whole.unbatch()
    yield rows.batch(size, drop_remainder=True)
    yield rows.batch(size)


__all__ = ["FedIterator", "global_batch", "replay"]
