"""The notebooks run top to bottom (small parameters) and draw their plots.

Each notebook reads its parameters from MONET_NB_* environment variables; here it
runs on ResNet-18 at batch 2, 32x32, where parameter gradients dominate the peak,
so budgets are given in "span" mode (between the smallest baseline peak and the
no-recompute peak: always feasible) and torch.compile is switched off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

SMALL = {
    "MONET_NB_MODEL": "resnet18",
    "MONET_NB_BATCH": "2",
    "MONET_NB_IMAGE": "32",
    "MONET_NB_BUDGETS": "1.0,0.3",
    "MONET_NB_BUDGET_MODE": "span",
    "MONET_NB_TIME_LIMIT": "3",
    "MONET_NB_STEPS": "1",
    "MONET_NB_COMPILE_BUDGETS": "",
    "KINETO_LOG_LEVEL": "6",
}


@pytest.mark.parametrize("name", ["budget_sweep.ipynb", "solver_anatomy.ipynb"])
def test_notebook_runs_and_plots(name, tmp_path):
    """Through `notebooks/run.py`, as the README says, on a copy (the committed outputs stay)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    copy = tmp_path / name
    nbformat.write(nb, copy)
    env = {**os.environ, **SMALL, "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    done = subprocess.run(
        [sys.executable, str(NOTEBOOKS / "run.py"), str(copy)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outputs saved" in done.stdout
    nb = nbformat.read(copy, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} produced no image output"
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "Traceback" not in text, text[-2000:]
