"""What a gradient check costs: ``gradscope check`` against ``tf.test.compute_gradient``.

``tf.test.compute_gradient`` builds the numerical Jacobian element by element: two loss
evaluations per weight element. It is measured here on a random subset of the seed model's
weight elements (float64, inside a tf.function, as a careful user would run it) and
extrapolated to all of them. ``gradscope check`` is timed as a whole process, alternating
with the hand-written floor program of bench/floor_explain.py, whose time is the budget
(target: check ≤ 1.5× the floor).

    .venv/bin/python bench/check_cost.py [--repeats 5] [--elements 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from explain_latency import wall  # noqa: E402  (the same whole-process timer)


def compute_gradient_seconds_per_element(elements: int) -> tuple[float, int]:
    """Seconds per weight element for tf.test.compute_gradient on the seed model."""
    sys.path.insert(0, str(REPO))
    import numpy as np

    from gradscope._tf import import_tensorflow
    from gradscope.yaml.algebra import model_shapes
    from gradscope.yaml.config import load_spec
    from gradscope.yaml.data import initial_params, synthetic_batch
    from gradscope.yaml.engine import Engine

    tf = import_tensorflow()
    algebra = model_shapes(load_spec())
    engine = Engine(algebra, dtype="float64")
    params = {k: tf.constant(v.astype(np.float64)) for k, v in initial_params(algebra).items()}
    batch = synthetic_batch(algebra).astype("float64")
    x, y = tf.constant(batch.x), tf.constant(batch.y)
    states = {k: tf.constant(v) for k, v in batch.initial_states.items()}
    total = sum(int(np.prod(v.shape)) for v in params.values())

    # The subset of elements varies; every other weight stays fixed.
    name = "gru_1/w_ru"
    base = params[name]
    rng = np.random.default_rng(0)
    indices = rng.choice(int(np.prod(base.shape)), size=elements, replace=False)
    scatter = tf.constant(indices[:, None])

    @tf.function
    def loss_of_subset(values: tf.Tensor) -> tf.Tensor:
        flat = tf.tensor_scatter_nd_update(tf.reshape(base, [-1]), scatter, values)
        perturbed = {**params, name: tf.reshape(flat, base.shape)}
        predictions, _ = engine.forward(perturbed, x, states)
        return engine.loss(predictions, y)

    start_values = tf.gather(tf.reshape(base, [-1]), indices)
    loss_of_subset(start_values)  # trace once, outside the timing
    start = time.perf_counter()
    tf.test.compute_gradient(loss_of_subset, [start_values])
    return (time.perf_counter() - start) / elements, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--elements", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    check = [sys.executable, "-m", "gradscope", "check", "--quiet"]
    floor = [sys.executable, str(REPO / "bench" / "floor_explain.py")]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    wall(check), wall(floor)  # warm the file cache
    check_times, floor_times = [], []
    for _ in range(args.repeats):
        floor_times.append(wall(floor))
        check_times.append(wall(check))
    per_element, total = compute_gradient_seconds_per_element(args.elements)
    figures = {
        "check_median_s": statistics.median(check_times),
        "floor_median_s": statistics.median(floor_times),
        "check_over_floor": statistics.median(check_times) / statistics.median(floor_times),
        "compute_gradient_s_per_element": per_element,
        "weight_elements": total,
        "compute_gradient_extrapolated_s": per_element * total,
        "repeats": args.repeats,
        "elements_measured": args.elements,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    check_s, floor_s = figures["check_median_s"], figures["floor_median_s"]
    print(f"gradscope check (seed model, whole process)   median {check_s:.2f} s")
    print(f"floor program (explain floor, whole process)   median {floor_s:.2f} s")
    print(f"check / floor                                  {figures['check_over_floor']:.2f}×"
          "  (target ≤ 1.5×)")
    print(f"tf.test.compute_gradient                       {per_element * 1e3:.1f} ms per element"
          f" × {total} elements ≈ {per_element * total / 60:.0f} min (measured on "
          f"{args.elements} elements)")


if __name__ == "__main__":
    main()
