"""Atomic JSON writes and reads with errors that name the file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private (0600): give it the mode a plain open() would (the
        # replaced file's, else 0666 less the umask), so teammates can read shared schedules
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def read_json_object(path: str | Path, what: str) -> dict:
    """Read a JSON object; raise ValueError naming the file if it is missing or corrupt."""
    if isinstance(path, str) and path.lstrip().startswith("{"):
        raise TypeError(
            f"{what}: expected the path of a JSON file, got JSON text; "
            "parse it with json.loads and pass the dict to from_dict"
        )
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} file {path} is corrupt (not valid JSON: {exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path} is corrupt (expected a JSON object)")
    return data
