"""Shared helpers: the repository root and a way to run the real CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_configs"


def run_gradscope(*args: str, env: dict[str, str] | None = None,
                  timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gradscope ARGS`` as a user would, without a TTY."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    full_env.pop("COLUMNS", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gradscope", *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


#: Runs the CLI exactly as ``python -m gradscope`` does, then fails (exit 99) if TensorFlow,
#: Keras or matplotlib got imported.
TF_GUARD_DRIVER = """
import sys
from gradscope.cli import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "matplotlib"))
if heavy:
    sys.stderr.write("imported: " + ", ".join(heavy[:3]) + "\\n")
    sys.exit(99)
sys.exit(code)
"""


def run_without_tensorflow(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI as ``python -m gradscope ARGS`` does; exit 99 if TF/Keras got imported."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    full_env.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-c", TF_GUARD_DRIVER, *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def tf():
    from gradscope._tf import import_tensorflow

    return import_tensorflow()
