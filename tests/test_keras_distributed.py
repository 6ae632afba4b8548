"""A model trained on several devices (tf.distribute.MirroredStrategy, here over two logical
CPU devices): explain, check and GradientFlow observe the loss fit minimises over the global
batch, and their numbers equal a tape on that batch.

Logical devices are set before TensorFlow starts, so each case runs in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from conftest import REPO

SCRIPT = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np
import gradscope
from gradscope.errors import ConfigError
from gradscope.keras import GradientFlow

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def build():
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(5),
                                  keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse")
    return model


model, plain = build(), build()
rng = np.random.default_rng(0)
x = rng.standard_normal((32, 6, 3)).astype("float32")
y = rng.standard_normal((32, 2)).astype("float32")


def tape(xb, yb):
    with tf.GradientTape() as t:
        loss = model.compute_loss(xb, yb, model(xb))
    grads = t.gradient(loss, model.trainable_variables)
    return float(loss), {v.path: float(tf.norm(g)) for v, g in zip(model.trainable_variables,
                                                                   grads)}

out = {"replicas": strategy.num_replicas_in_sync}
# Batches of 8 split 4 + 4 across the replicas; every=4 observes the last of 4 steps, after
# its update: the final weights, on the global batch x[24:32].
# diagnose_every=4 diagnoses that batch too, with those weights: as diagnose does afterwards.
flow = GradientFlow(every=4, diagnose_every=4)
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[flow])
plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
out["trained_alike"] = max(float(np.max(np.abs(a.numpy() - b.numpy())))
                           for a, b in zip(model.weights, plain.weights))
history = flow.history
truth = gradscope.diagnose(model, x=x[24:], y=y[24:], exponents=1,
                           counterfactuals=False).layers[0]
out["diagnosed"] = {"steps": history.diagnosis_steps,
                    "lyapunov": history.diagnoses[0].lyapunov[-1], "truth": truth.lyapunov,
                    "gates": {k: v.to_dict() for k, v in history.diagnoses[0].gates[-1].items()},
                    "truth_gates": {k: v.to_dict() for k, v in truth.gates.items()}}
loss, norms = tape(x[24:], y[24:])
out["flow"] = {"steps": [o.step for o in history.observations],
               "batch_size": history.observations[-1].batch_size,
               "loss": history.observations[-1].loss, "tape_loss": loss,
               "norms": {v.path: w.norms[-1] for v, w in zip(model.trainable_variables,
                                                             history.weights, strict=True)},
               "names": [w.weight for w in history.weights], "tape_norms": norms}
# An epoch's last batch smaller than the others (4 = 2 + 2). (steps_per_execution > 1 under
# MirroredStrategy fails in Keras 3.15 itself, with or without a callback.)
uneven = GradientFlow(every=4)
model.fit(x[:28], y[:28], batch_size=8, epochs=1, shuffle=False, verbose=0,
          callbacks=[uneven])
plain.fit(x[:28], y[:28], batch_size=8, epochs=1, shuffle=False, verbose=0)
loss, norms = tape(x[24:28], y[24:28])
last = uneven.history.observations[-1]
out["uneven"] = {"batch_size": last.batch_size, "loss": last.loss, "tape_loss": loss,
                 "norms": {v.path: w.norms[-1] for v, w in zip(model.trainable_variables,
                                                               uneven.history.weights,
                                                               strict=True)},
                 "tape_norms": norms,
                 "trained_alike": max(float(np.max(np.abs(a.numpy() - b.numpy())))
                                      for a, b in zip(model.weights, plain.weights))}
report = gradscope.explain(model, x=x[:8], y=y[:8])
out["explain"] = {"loss": report.loss.value, "tape_loss": tape(x[:8], y[:8])[0],
                  "norms": {g.path: g.stats.l2 for g in report.gradients if g.stats},
                  "names": [g.name for g in report.gradients if g.stats],
                  "tape_norms": tape(x[:8], y[:8])[1]}
out["check"] = gradscope.check(model, x=x[:8], y=y[:8], directions=1).summary.passed
try:
    central = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
except Exception:
    central = None
if central is not None:
    with central.scope():
        other = keras.Sequential([keras.Input((6, 3)), keras.layers.GRU(5),
                                  keras.layers.Dense(2)])
        other.compile(optimizer="adam", loss="mse")
    try:
        other.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[GradientFlow(every=2)])
        out["refused"] = None
    except ConfigError as exc:
        out["refused"] = str(exc)
print(json.dumps(out))
"""


def test_mirrored_strategy_is_observed_on_the_global_batch_as_a_tape_sees_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2
    assert out["trained_alike"] == 0.0  # the observed step trained on the same batch
    flow = out["flow"]
    assert flow["steps"] == [4] and flow["batch_size"] == 8  # the global batch, not 4
    assert abs(flow["loss"] - flow["tape_loss"]) <= 1e-6 * abs(flow["tape_loss"])
    for path, norm in flow["tape_norms"].items():
        assert abs(flow["norms"][path] - norm) <= 1e-5 * norm, path
    # The weights named as explain names them.
    assert flow["names"] == out["explain"]["names"]
    uneven = out["uneven"]
    assert uneven["batch_size"] == 4 and uneven["trained_alike"] == 0.0
    assert abs(uneven["loss"] - uneven["tape_loss"]) <= 1e-6 * abs(uneven["tape_loss"])
    for path, norm in uneven["tape_norms"].items():
        assert abs(uneven["norms"][path] - norm) <= 1e-5 * norm, path
    explain = out["explain"]
    assert explain["loss"] == explain["tape_loss"]
    for path, norm in explain["tape_norms"].items():
        assert abs(explain["norms"][path] - norm) <= 1e-6 * norm, path
    assert out["check"] is True
    diagnosed = out["diagnosed"]
    assert diagnosed["steps"] == [4]
    np.testing.assert_allclose(diagnosed["lyapunov"], diagnosed["truth"], rtol=1e-9)
    assert diagnosed["gates"] == diagnosed["truth_gates"]
    if "refused" in out:
        assert out["refused"] is not None
        assert "CentralStorageStrategy" in out["refused"]
