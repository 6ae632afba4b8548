"""Writes the data files of the bad-input corpus (run from this folder; outputs are committed)."""

import numpy as np

rng = np.random.default_rng(0)
x = rng.standard_normal((2, 3, 4))
y = np.eye(3)[rng.integers(0, 3, (2, 3))]
np.save("pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
np.save("y_ok.npy", y)
bad = x.copy()
bad[1, 2, 3] = np.nan
np.savez("nan.npz", x=bad, y=y)
bad = x.copy()
bad[0, 1, 0] = np.inf
np.savez("inf.npz", x=bad, y=y)
np.savez("wrong_rank.npz", x=x[:, 0], y=y)
np.savez("wrong_features.npz", x=rng.standard_normal((2, 3, 5)), y=y)
np.savez("y_wrong_classes.npz", x=x, y=np.eye(4)[rng.integers(0, 4, (2, 3))])
np.savez("unknown_state.npz", x=x, y=y, **{"gru_9/h0": np.zeros((2, 2))})
np.savez("missing_y.npz", x=x)
np.savez("string_dtype.npz", x=np.array([["a"]]), y=y)
np.savez("y_not_probabilities.npz", x=x, y=np.full((2, 3, 3), 0.5))
np.savez("state_wrong_shape.npz", x=x, y=y, **{"gru_1/h0": np.zeros((2, 5))})
with open("not_npz.npz", "w") as handle:
    handle.write("this is text, not an archive\n")
