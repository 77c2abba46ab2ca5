"""Process lifetimes of a job: nothing it started may outlive the process that started it.

The tree of a local job is ``zero3d`` (launcher) -> ``parallel3d.launch.agent`` (torchrun's agent) ->
workers, and torchrun starts each worker in a session of its own, so neither a terminal's
Ctrl-C nor a signal to a process group reaches them. Three Linux facilities close the gaps:

* a parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the agent and every worker get SIGTERM
  when their parent dies, even by SIGKILL;
* a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): workers orphaned by an agent killed
  with SIGKILL become children of the launcher, which stops and reaps them before it exits;
* an environment marker (``ZERO3D_AGENT_PID``): the launcher stops only orphans that carry
  its own agent's pid, never an unrelated child of the same process (pytest's, say).

Elsewhere (macOS) these are no-ops and the job relies on signals alone.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import NoReturn

logger = logging.getLogger(__name__)

AGENT_PID_ENV = "ZERO3D_AGENT_PID"
"""Set by ``parallel3d.launch.agent`` for its workers: the pid their parent must have."""
PARENT_PID_ENV = "ZERO3D_PARENT_PID"
"""Set by the launcher for the agent: the pid its parent must have."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that ask a job to stop; a second one (of any of them) stops it at once."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies.

    If the parent is already gone (it is not ``expected_parent`` any more), send it now: the
    death happened before the request could take effect.
    """
    if not _prctl(_PR_SET_PDEATHSIG, int(sig)):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)


def die_with_agent() -> None:
    """In a worker started by ``parallel3d.launch.agent``: SIGTERM when the agent dies (no-op otherwise)."""
    agent = os.environ.get(AGENT_PID_ENV)
    if agent is not None and agent.isdigit():
        die_with_parent(int(agent))


def exit_now(code: int) -> NoReturn:
    """End a process whose work is done without tearing torch down (seconds on a loaded machine)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (so it can stop and reap them)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def orphans_of_agent(agent_pid: int) -> list[int]:
    """This process's children whose environment names ``agent_pid`` as their agent."""
    me, found = os.getpid(), []
    marker = f"{AGENT_PID_ENV}={agent_pid}".encode()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return found


def _reap(pids: list[int]) -> list[int]:
    """Collect the exit status of those of ``pids`` that ended; return the ones still running."""
    running = []
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done == 0:
            running.append(pid)
    return running


def stop_orphans(agent_pid: int, grace_s: float) -> int:
    """Stop the agent's orphaned workers: they get ``grace_s`` to finish on the SIGTERM the
    agent's death sent them, then SIGTERM, then (after another ``grace_s``) SIGKILL.

    Returns how many there were. Orphans that the kernel re-parents to us while we wait (a
    worker's own children) are included.
    """
    seen: set[int] = set()
    deadline, stage = time.monotonic() + grace_s, 0
    while True:
        orphans = orphans_of_agent(agent_pid)
        seen.update(orphans)
        running = _reap(orphans)
        if not running:
            return len(seen)
        if time.monotonic() >= deadline and stage < 2:
            sig = signal.SIGTERM if stage == 0 else signal.SIGKILL
            logger.warning("%s to %d leftover worker process(es) of the stopped agent", sig.name, len(running))
            for pid in running:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            stage += 1
            deadline = time.monotonic() + grace_s
        time.sleep(0.05)


def run_supervised(cmd: list[str], env: Mapping[str, str], grace_s: float = 10.0) -> int:
    """Run ``cmd`` (a ``parallel3d.launch.agent`` command) until it ends and nothing it started is left.

    A stop signal (`STOP_SIGNALS`) is forwarded to the agent, which stops the workers; a second
    one kills the agent, and its workers stop on their parent-death signal. The agent runs in a
    session of its own, so a terminal's Ctrl-C reaches it once, through here. Returns the agent's
    exit code, or 128 + the first signal received.
    """
    become_subreaper()
    proc = subprocess.Popen(cmd, env={**env, PARENT_PID_ENV: str(os.getpid())}, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        if len(received) == 1:
            print(f"zero3d: {signal.Signals(signum).name}: stopping the job at its next step "
                  "(again to stop it at once)", file=sys.stderr, flush=True)
        try:
            proc.send_signal(signum if len(received) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stop_orphans(proc.pid, grace_s)
    if received:
        return 128 + received[0]
    return code if code >= 0 else 128 - code


_EXIT_GRACE_S = 0.1


def _let_backend_threads_finish() -> None:
    """At interpreter exit: destroy unreachable process groups, then release the GIL a moment.

    A gloo worker thread drops its finished collective's tensors after the caller's ``wait``
    returns, and with torch 2.13 that needs the GIL. If the interpreter is already finalizing,
    the thread exits inside a ``noexcept`` destructor and the process aborts ("terminate called
    without an active exception", exit -6), so a script that ends right after a collective
    fails at random. Collecting garbage destroys the groups nothing refers to (their
    destructors join the workers without the GIL); the pause lets the workers of groups still
    referenced finish their last release while Python still runs.
    """
    gc.collect()
    time.sleep(_EXIT_GRACE_S)


@functools.cache
def install_exit_guard() -> None:
    """Register `_let_backend_threads_finish`, once per process (``parallel3d.initialize`` does)."""
    atexit.register(_let_backend_threads_finish)
