"""Progress lines of a solve: one per event, on stderr, each with the seconds since the solve began."""

from __future__ import annotations

import sys
import time

# when the solve that is logging started (`solve`, `minimum_peak`): each log line says the
# seconds since, so a log shows where the time went
_log_start = [time.perf_counter()]


def log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[solver {time.perf_counter() - _log_start[0]:5.1f} s] {msg}", file=sys.stderr, flush=True)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def start_clock(t: float) -> None:
    """Log lines from now on count seconds from `t` (a solve's start)."""
    _log_start[0] = t
