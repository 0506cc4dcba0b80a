"""The example notebook runs headless, top to bottom, then again cell by cell as a user
re-running cells would, in the same kernel (with the local device server it started)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "tf_ipu_quickstart.ipynb"


def test_notebook_runs_and_reruns(tmp_path, monkeypatch):
    monkeypatch.delenv("TF_IPU_SERVER", raising=False)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    with client.setup_kernel(env=dict(os.environ)):
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
        # Re-run configure, model, fit and evaluate cells in the same kernel.
        for i in code_cells[1:]:
            client.execute_cell(nb.cells[i], i)
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "peak tile memory" in outputs
    assert "Error" not in outputs
