"""Build DeepSpeed's JIT ops before DeepSpeed's unit tests run (used by scripts/ds_unit_tests.py).

Why: DeepSpeed compiles a C++ op with ninja the first time a process loads it, inside whichever
test first constructs it, so the build counts against that test's pytest-timeout. On two loaded
cores the build of FusedAdam's op took 710 s (ninja's log), and
``test_fp16.py::TestZeroSupportedClientOptimizer::test[FusedAdam-1]`` hit the 660 s timeout; alone,
with the op cached, the test takes 5 s. Built here first, each op under its own timeout, a test
only loads the cached library, and the count no longer depends on the machine's load.

A build that is killed (its timeout) may leave torch's ``lock`` file in the op's build directory
(``torch.utils.file_baton.FileBaton``: created with O_EXCL by the process that builds, removed
when it is done; every other loader waits while it exists), and every later load of that op
would wait for it for ever. The child says when its baton takes and gives back the lock, so a
lock is removed only when the killed child held it: a child that was waiting for another run's
build (two runs building the same op at once) leaves that run's lock alone, and it is only
reported. A child killed in the instant between creating the lock and saying so leaves a lock
that is reported, never one removed that was not its own.
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


MARK = "ds_unit_ops:"
BUILD_DIR, TOOK, RELEASING = f"{MARK} build directory", f"{MARK} took", f"{MARK} releasing"
"""The child's own lines: the op's build directory, its baton taking torch's lock file, and giving it back
(said before the file is removed)."""

_BUILD = f"""
import sys
from deepspeed.accelerator import get_accelerator
from torch.utils.cpp_extension import _get_build_directory
from torch.utils.file_baton import FileBaton

_try_acquire, _release = FileBaton.try_acquire, FileBaton.release


def try_acquire(self):
    took = _try_acquire(self)
    if took:
        print("{TOOK}", self.lock_file_path, flush=True)
    return took


def release(self):
    print("{RELEASING}", self.lock_file_path, flush=True)
    _release(self)


FileBaton.try_acquire, FileBaton.release = try_acquire, release
builder = get_accelerator().create_op_builder(sys.argv[1])
print("{BUILD_DIR}", _get_build_directory(builder.NAME, False), flush=True)
builder.load(verbose=False)
"""
"""Run in a child: prints the op's build directory (where torch's lock file goes), then builds the op or
loads it from the cache, saying when it takes and gives back the lock."""


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
    """Remove the lock file the killed child held; name a lock of the op's that another process holds."""
    held: set[str] = set()
    build_dir = None
    for line in out.splitlines():
        if line.startswith(TOOK + " "):
            held.add(line[len(TOOK) + 1:])
        elif line.startswith(RELEASING + " "):
            held.discard(line[len(RELEASING) + 1:])
        elif line.startswith(BUILD_DIR + " "):
            build_dir = line[len(BUILD_DIR) + 1:]
    removed = sorted(path for path in held if os.path.exists(path))
    for path in removed:
        os.remove(path)  # the killed build's own: it would block every later load of the op
    if removed:
        return f"; removed the lock file it held, {', '.join(removed)}"
    lock = Path(build_dir) / "lock" if build_dir is not None else None
    if lock is not None and lock.exists():
        return (f"; {lock} is not this build's (it was waiting for it): if no other process is building the op, "
                "remove it, or every load of the op waits for ever")
    return ""


def _tail(out: str | None) -> str:
    """The end of the build's output (without the child's own lines)."""
    lines = [line for line in (out or "").strip().splitlines() if not line.startswith(MARK)][-15:]
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
