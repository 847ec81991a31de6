"""Execute a notebook in place, top to bottom, and keep its outputs (plots included).

    python notebooks/run.py budget_sweep.ipynb
    MONET_NB_MODEL=resnet50 MONET_NB_BATCH=8 MONET_NB_IMAGE=224 python notebooks/run.py budget_sweep.ipynb

Parameters come from the MONET_NB_* variables the notebook's first code cell reads.
The file is replaced atomically once every cell has run; a failing cell leaves it untouched.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    path = Path(sys.argv[1])
    if not path.is_absolute() and not path.exists():
        path = HERE / path
    if not path.exists():
        print(f"no such notebook: {path}", file=sys.stderr)
        return 2
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    nb = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    client = nbclient.NotebookClient(
        nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        print(f"{path.name}: a cell failed, the file is unchanged:\n{exc}", file=sys.stderr)
        return 1
    tmp = path.with_suffix(".ipynb.tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, path)
    print(f"{path.name}: executed in {time.perf_counter() - started:.0f} s, outputs saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
