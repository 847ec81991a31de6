"""Small C kernels: compiled on first use with the system C compiler, cached, loaded with ctypes.

`build(name, source)` compiles `source` (-O3, -march=native where the platform has it) into the
cache directory (`$MONET_OPT_CACHE`, like the profiles), keyed by the source and the CPU, and
loads it; nothing is compiled at import, and a file another process is writing is never loaded
half-written (atomic rename). It raises RuntimeError (no compiler, a failed compile) or OSError;
callers fall back to torch ops. `Kernel` wraps that for a module: compiled once per process on
first `get()`, None (and `error` saying why) where it cannot be, off by an environment switch.
Kernels split their work over OpenMP threads themselves (`-fopenmp`: the library binds to the
libgomp torch has loaded, so it shares torch's thread team rather than competing with it; a
Python thread pool did not scale while torch's workers spin).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path


def _cpu_key() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def build(name: str, source: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The shared library compiled from C `source` (cached as `<name>-<digest>.so`), loaded."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    from monet_opt.profile import cache_dir  # (here: profile imports the ops registry)

    all_flags = ["-O3", "-shared", "-fPIC", *flags]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        all_flags.append("-march=native")
    digest = hashlib.sha256((source + _cpu_key() + " ".join(all_flags)).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{digest}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            out = Path(tmp) / f"{name}.so"
            proc = subprocess.run([cc, *all_flags, str(src), "-o", str(out)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling the {name} kernel failed: {proc.stderr.strip()[:400]}")
            staged = path.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(out, staged)
            os.replace(staged, path)  # atomic: a concurrent process loads a whole file or none
    return ctypes.CDLL(str(path))


class Kernel:
    """A C kernel built on first `get()` (once per process) and declared by `declare(lib)` (its
    functions' argtypes); `get()` is None where it cannot be built (`error` says why) or while the
    environment variable `switch` is "0"."""

    def __init__(self, name: str, source: str, declare, switch: str, flags: tuple[str, ...] = ()):
        self.name, self.source, self.declare, self.switch, self.flags = name, source, declare, switch, flags
        self.error: str | None = None
        self._lib: ctypes.CDLL | None = None
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if os.environ.get(self.switch, "1") == "0":
            return None
        with self._lock:
            if self._lib is None and self.error is None:
                try:
                    lib = build(self.name, self.source, self.flags)
                    self.declare(lib)
                except (OSError, RuntimeError) as exc:
                    self.error = str(exc)
                else:
                    self._lib = lib
            return self._lib
