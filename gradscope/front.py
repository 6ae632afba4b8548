"""The front door: which wing a model belongs to, asked once per call, then the one path every
command takes through that wing: job (options checked once, the batch loaded) → memory guard
→ explain or check. The public functions in ``gradscope/__init__.py`` call only this.
"""

from __future__ import annotations

from collections.abc import Callable
from os import PathLike
from typing import Any


def wing(source: Any) -> Any:
    """The wing ``source`` belongs to, asked once per call: :mod:`gradscope.keras.job` for a
    saved ``.keras`` file or a Keras model object, else :mod:`gradscope.yaml.job`."""
    from gradscope.keras.archive import is_keras_file
    from gradscope.keras.live import is_live_model

    if is_keras_file(source) or is_live_model(source):
        from gradscope.keras import job as keras_job

        return keras_job
    from gradscope.yaml import job as yaml_job

    return yaml_job


def prepared(command: str, source: Any, data: Any, x: Any, y: Any, sample_weight: Any,
             options: dict[str, Any]) -> tuple[Any, Any]:
    """The wing, and ``source`` made ready for ``command`` by it: every option checked once,
    the batch loaded."""
    from gradscope.arrays import as_data_files

    chosen = wing(source)
    if is_keras_path(options.get("weights")):
        options = {**options, "weights": SavedModelWeights(str(options["weights"]))}
    data = as_data_files(data)
    return chosen, chosen.prepare(command, source, data, x, y, sample_weight, options)


def run(command: str, source: Any, data: Any, x: Any, y: Any, sample_weight: Any,
        options: dict[str, Any], max_memory: int | str | None,
        progress: Callable[[str], None] | None, timings: bool) -> Any:
    """The front door: the wing, then job → memory guard → explain or check."""
    from gradscope._tf import tensorflow_logger_quieted
    from gradscope.guard import memory_limit

    chosen, ready = prepared(command, source, data, x, y, sample_weight, options)
    chosen.guard(ready, memory_limit(max_memory))
    with tensorflow_logger_quieted():
        return drawn(chosen.run(ready, progress, timings))


def drawn(report: Any) -> Any:
    """``report``, able to draw itself: the notebook's HTML and ``report.plot()`` come from
    renderers that register themselves when imported (the report models know nothing of
    them)."""
    import gradscope.report.display  # noqa: F401
    import gradscope.report.plot  # noqa: F401

    return report


class SavedModelWeights(str):
    """The path of a saved ``model.keras`` given as a YAML spec's weights: its arrays are read
    by Keras only when the spec runs."""

    __slots__ = ()

    def read(self) -> Any:
        from gradscope.keras.yaml_form import read_saved_form
        from gradscope.yaml.weights import SavedArrays

        return SavedArrays(read_saved_form(str(self)).arrays, str(self))


def is_keras_path(source: Any) -> bool:
    return isinstance(source, str | PathLike) and str(source).endswith(".keras")


def imports_of(imports: Any) -> tuple[str, ...]:
    return (imports,) if isinstance(imports, str) else tuple(imports)


