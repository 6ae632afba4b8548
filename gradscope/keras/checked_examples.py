"""Which examples of the batch ``check`` verifies a Keras model's gradients on.

check's cost is float64 work linear in the examples, and the examples past a few say nothing
more about how the gradient is computed: what tells one from another is its data. So check
takes at most :data:`DEFAULT_EXAMPLES`: an example whose data holds NaN or Inf, for every
masked input the example with the fewest kept steps and the one with the most, for every
sample weight the smallest and largest total weight, and the rest drawn with the seed, in
the batch's order. A model whose Input fixes the batch size is checked whole. docs/keras.md
gives the measured costs. No TensorFlow here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradscope.errors import ConfigError, flag, given, whole_number
from gradscope.report.models import CheckedExamples

#: At most this many examples, unless asked (``--examples N`` or ``all``): room for the
#: examples picked for their masks and weights, and as many again drawn. Half the default
#: synthetic batch: check then stays within 2.1× the user's tape at 3000 steps and at 512
#: units (``bench/user_sized.py``; docs/performance.md).
DEFAULT_EXAMPLES = 16

#: What ``examples=`` takes for every example.
ALL = "all"


def examples_option(value: Any) -> int | None:
    """``examples`` as given (None, a whole number ≥ 1, "all" or its digits as text): the most
    examples to check, None for every one. Anything else is a ConfigError naming the option."""
    if value is None:
        return DEFAULT_EXAMPLES
    if isinstance(value, str):
        text = value.strip().lower()
        if text == ALL:
            return None
        if text.isdigit():
            value = int(text)
    if not whole_number(value) or value < 1:
        raise ConfigError(f"{given('examples', value)}: expected a whole number of examples "
                          f"(1 or more) or '{ALL}'", where=flag("examples"))
    return int(value)


def choose(job: Any, examples: int | None) -> CheckedExamples:
    """At most ``examples`` examples of ``job``'s batch (None: all), as the module says: what
    the report gives as ``examples``."""
    size = int(job.batch_size)
    if examples is None or size <= examples:
        return CheckedExamples(checked=size, of=size)
    if any(spec.shape and spec.shape[0] is not None for spec in job.inputs):
        return CheckedExamples(checked=size, of=size, whole_because=(
            "the model's Input fixes the batch size (a stateful layer keeps a state per "
            "example)"))
    wanted: list[tuple[int, str]] = []  # where the examples differ at all
    # An example whose data holds NaN or Inf first: where the loss would not be finite.
    for what, arrays in (("input", job.batch.inputs), ("target", job.batch.targets or {})):
        for name, value in arrays.items():
            value = np.asarray(value)
            if value.dtype.kind == "f" and value.ndim and value.shape[0] == size:
                bad = ~np.isfinite(value.reshape(size, -1)).all(axis=1)
                wanted += [(int(i), f"a NaN or Inf in {what} {name}")
                           for i in np.flatnonzero(bad)[:2]]
    for name, kept in _kept_steps(job).items():
        if kept.min() < kept.max():
            wanted += [(int(np.argmin(kept)), f"the fewest kept steps of {name}"),
                       (int(np.argmax(kept)), f"the most kept steps of {name}")]
    for name, total in _total_weights(job.batch.sample_weight, size).items():
        if total.min() < total.max():
            wanted += [(int(np.argmin(total)), f"the smallest {name}"),
                       (int(np.argmax(total)), f"the largest {name}")]
    chosen: list[int] = []
    picked: list[str] = []
    for index, why in wanted:
        if len(chosen) < examples and index not in chosen:
            chosen.append(index)
            picked.append(f"{index} ({why})")
    rest = np.setdiff1d(np.arange(size), chosen)
    rng = np.random.default_rng([job.seed, 4])
    drawn = rng.choice(rest, size=examples - len(chosen), replace=False)
    return CheckedExamples(checked=examples, of=size,
                           indices=sorted(chosen + [int(i) for i in drawn]), picked=picked)


def _kept_steps(job: Any) -> dict[str, np.ndarray]:
    """Per masked input, the steps each example keeps."""
    kept = {}
    for spec in job.inputs:
        value = job.batch.inputs.get(spec.name)
        reader = job.graph.layer(spec.pad_reader) if spec.pad_reader else None
        if value is None or reader is None:
            continue
        # Masking keeps a step where any feature differs from mask_value; an Embedding with
        # mask_zero keeps every token but 0.
        steps = (np.any(value != spec.pad_value, axis=-1) if reader.class_name == "Masking"
                 else value != 0)
        if steps.ndim >= 2:
            kept[f"input {spec.name}"] = steps.reshape(steps.shape[0], -1).sum(axis=1)
    return kept


def _total_weights(sample_weight: Any, size: int) -> dict[str, np.ndarray]:
    """Per sample-weight array, each example's total weight."""
    if sample_weight is None:
        return {}
    arrays = (sample_weight.items() if isinstance(sample_weight, dict)
              else [("", sample_weight)])
    totals = {}
    for name, value in arrays:
        value = np.asarray(value, np.float64)
        if value.ndim and value.shape[0] == size:
            label = f"sample weight of {name}" if name else "sample weight"
            totals[label] = np.abs(value.reshape(size, -1)).sum(axis=1)
    return totals


def take(value: Any, indices: list[int] | None, size: int) -> Any:
    """``value`` (an array, a dict of arrays, or None) at the examples ``indices``: every
    array whose first axis is the batch's."""
    if indices is None or value is None:
        return value
    if isinstance(value, dict):
        return {name: take(item, indices, size) for name, item in value.items()}
    array = np.asarray(value)
    return array[indices] if array.ndim and array.shape[0] == size else value
