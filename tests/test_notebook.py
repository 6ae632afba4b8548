"""A real notebook, executed by a real Jupyter kernel (nbclient + ipykernel, no mocks): it
builds a small GRU model, calls ``gradscope.explain(model, x=…, y=…)``, and displays the report
and its plot. The kernel is this interpreter, with this checkout's gradscope first on its path.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

NOTEBOOK = Path(__file__).parent / "notebooks" / "gru_in_a_notebook.ipynb"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    # A kernelspec of our own: this interpreter (not whatever `python` is on the PATH), and
    # PYTHONPATH reaching the kernel so that it imports this checkout's gradscope.
    jupyter = tmp_path_factory.mktemp("jupyter")
    spec = jupyter / "kernels" / "gradscope-test"
    spec.mkdir(parents=True)
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gradscope test", "language": "python",
        "env": {"PYTHONPATH": path}}))
    previous = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(jupyter), previous]))
    try:
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        client = nbclient.NotebookClient(notebook, kernel_name="gradscope-test", timeout=300,
                                         resources={"metadata": {"path": str(jupyter)}})
        client.execute()
    finally:
        if previous is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = previous
    return notebook


def _outputs(notebook: Any) -> list[dict[str, Any]]:
    return [output for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.get("outputs", [])]


def test_no_cell_raised(executed):
    errors = [o for o in _outputs(executed) if o["output_type"] == "error"]
    assert not errors, errors
    assert all(cell.get("execution_count") for cell in executed.cells
               if cell.cell_type == "code")


def test_the_report_is_html_with_the_weight_table(executed):
    html = [o["data"]["text/html"] for o in _outputs(executed)
            if "text/html" in o.get("data", {})]
    assert len(html) == 1
    page = html[0]
    assert page.startswith("<pre")
    assert "Gradients of the loss" in page  # the weight table's title, as in the terminal
    for weight in ("gru/kernel", "gru/recurrent_kernel", "gru/bias", "dense/kernel",
                   "dense/bias"):
        assert weight in page
    assert "in memory" in page and "supplied (x, y)" in page
    assert "∂L/∂gru/h_t" in page  # the gradient flow, asked for with flow=True


def test_the_plot_is_an_inline_png(executed):
    import base64

    images = [o["data"]["image/png"] for o in _outputs(executed)
              if "image/png" in o.get("data", {})]
    assert len(images) == 1
    assert base64.b64decode(images[0])[:8] == b"\x89PNG\r\n\x1a\n"
