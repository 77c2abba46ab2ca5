"""Build DeepSpeed's JIT ops before DeepSpeed's unit tests run (used by scripts/ds_unit_tests.py).

Why: DeepSpeed compiles a C++ op with ninja the first time a process loads it, inside whichever
test first constructs it, so the build counts against that test's pytest-timeout. On two loaded
cores the build of FusedAdam's op took 710 s (ninja's log), and
``test_fp16.py::TestZeroSupportedClientOptimizer::test[FusedAdam-1]`` hit the 660 s timeout; alone,
with the op cached, the test takes 5 s. Built here first, each op under its own timeout, a test
only loads the cached library, and the count no longer depends on the machine's load.

A build that is killed (its timeout) leaves torch's ``lock`` file in the op's build directory,
and every later load of that op would wait for it for ever; the lock of a build killed here is
removed. A lock that was there before the build started is only reported: another process may
be building.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("ds_unit_tests")

SHIM_OPS = ("FusedAdamBuilder", "PinMemoryBuilder")
"""The op builders the pinned subset loads under the shim (the tests that construct DeepSpeed's FusedAdam,
and test_destroy_unpin.py's pinned buffers): the two ops whose build files a whole run rewrote."""
BASELINE_OPS = (*SHIM_OPS, "CPUAdamBuilder", "CPULionBuilder")
"""And with DeepSpeed itself (``--rebaseline``): its optimizer offload (DeepSpeedCPUAdam) and DeepSpeedCPULion."""


_BUILD = """
import os, sys
from deepspeed.accelerator import get_accelerator
from torch.utils.cpp_extension import _get_build_directory
builder = get_accelerator().create_op_builder(sys.argv[1])
build_dir = _get_build_directory(builder.NAME, False)
print(build_dir, "locked" if os.path.exists(os.path.join(build_dir, "lock")) else "free", flush=True)
builder.load(verbose=False)
"""
"""Run in a child: prints the op's build directory (where torch's lock file goes) and whether a lock
is there already, then builds the op or loads it from the cache."""


def build_op(builder: str, timeout: float, env: dict[str, str] | None = None) -> tuple[bool, float, str]:
    """Build (or load, if cached) one op in a child process: (ok, seconds, what happened)."""
    env = dict(os.environ if env is None else env, DS_ACCELERATOR="cpu")
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _BUILD, builder], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return False, time.monotonic() - start, f"not built within {timeout:g} s (killed){_lock_left(out)}{_tail(out)}"
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        return False, seconds, f"failed (exit code {proc.returncode}){_tail(out)}"
    return True, seconds, "built or loaded from the cache"


def _lock_left(out: str) -> str:
    """Remove the lock file of a build killed here; name one that was there before it started."""
    first = out.splitlines()[0].rsplit(" ", 1) if out.strip() else []
    if len(first) != 2:
        return ""
    lock = Path(first[0]) / "lock"
    if first[1] == "locked":
        return (f"; {lock} was there before the build started: if no other process is building the op, "
                "remove it, or every load of the op waits for ever")
    if lock.exists():
        lock.unlink()  # left by the build killed here, it would block every later load of the op
        return f"; removed the lock file it left, {lock}"
    return ""


def _tail(out: str | None) -> str:
    """The end of the build's output (after the child's first line, the build directory's)."""
    lines = (out or "").strip().splitlines()[1:][-15:]
    return ":\n" + "\n".join(lines) if lines else ""


def build_ops(builders: list[str], timeout: float) -> dict[str, float]:
    """Build each op before any test runs; op -> seconds. A failure is logged (the tests that load that
    op then fail with the same error), not raised: the other files' tests still run."""
    seconds = {}
    for builder in builders:
        ok, seconds[builder], what = build_op(builder, timeout)
        log = logger.info if ok else logger.warning
        log("op %s: %s in %.0f s", builder, what, seconds[builder])
    return seconds
