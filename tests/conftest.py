import os
import tempfile

# One profile cache per test session: measurements are shared between tests, never with the user's cache.
os.environ.setdefault("MONET_OPT_CACHE", tempfile.mkdtemp(prefix="monet-opt-test-cache-"))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # 6 also silences the per-session USDT lines
# The test suite itself loads the CPU; profile-cache entries are not flagged busy in tests (the
# busy-CPU test sets its own threshold).
os.environ.setdefault("MONET_OPT_BUSY_LOAD", "1000")
