"""`zero3d train` on two processes stops when told, whichever process of the job gets the signal.

The job is launcher (``zero3d train``) -> agent (torchrun's, ``parallel3d.launch.agent``) -> two
workers. Each case sends one signal to one of them while the job trains and asserts that no
process of the job is left a few seconds later, that ``latest`` names a complete checkpoint,
and what the job said. Processes are found by an environment variable only this job carries.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.test_checkpoint_kill import _complete
from tests.test_train_cli import ROOT, read_metrics, tiny_job

MARK = "ZERO3D_TEST_JOB"
GONE_S = 30.0  # a graceful stop ends the step, saves and tears torch down: seconds on a loaded 2-core box
# A worker whose peer died names the missing rank after asking the others for two heartbeat
# intervals (comm.timeout_s / 10 each, parallel3d/runtime/watchdog.py): 20 s at the default 300 s,
# and the agent waits for it. The jobs that lose a worker use 30 s (a 6.5 s wait), far above any
# wait of a healthy tiny job (its longest, a rank saving alone, is under a second); the message is
# the same.
PEER_LOSS_TIMEOUT_S = 30
PEER_LOSS_TIMEOUT = f"engine.comm.timeout_s={PEER_LOSS_TIMEOUT_S}"


def job_processes(mark: str) -> dict[int, tuple[str, dict[str, str]]]:
    """pid -> (command line, environment) of every live process whose environment carries ``mark``."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            if env.get(MARK.encode()) != mark.encode():
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found[int(name)] = (cmd, {k.decode(): v.decode() for k, v in env.items()})
    return found


def wait_for_agent(mark: str, launcher: subprocess.Popen, timeout: float = 300.0) -> None:
    """Wait until the launcher of the job marked ``mark`` has started torchrun's agent: its checks are
    done and the tokenizer and packed data are in the cache, so another job may start beside it
    without both building them at once."""
    deadline = time.monotonic() + timeout
    while not any("parallel3d.launch.agent" in cmd for cmd, _ in job_processes(mark).values()):
        assert launcher.poll() is None, f"the job ended before its agent started (exit code {launcher.returncode})"
        assert time.monotonic() < deadline, f"no agent within {timeout} s"
        time.sleep(0.2)


class Job:
    """A `zero3d train` of the tiny job on two local processes, started in the background.

    It trains "for ever" (100000 steps) and saves every 2 steps unless ``args`` (overrides and
    flags, later ones win) say otherwise.
    """

    def __init__(self, tmp_path: Path, cache_dir: Path, *args: str) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.run = tmp_path / "run"
        self.mark = uuid.uuid4().hex
        config = tmp_path / "job.yaml"
        config.write_text(yaml.safe_dump(tiny_job(self.run, progress=False, eval_interval=0)))
        env = dict(os.environ, ZERO3D_CACHE=str(cache_dir), PYTHONPATH=str(ROOT), **{MARK: self.mark})
        self.err_path = tmp_path / "stderr.txt"
        self.err = open(self.err_path, "w")
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "parallel3d.cli", "train", str(config), "--nproc-per-node", "2",
             "train.max_steps=100000", "train.save_interval=2", *args],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=self.err)

    def wait_for_step(self, step: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            metrics = self.run / "metrics.jsonl"
            saved = (self.run / "checkpoints" / "latest").is_file()
            if saved and metrics.is_file() and len(read_metrics(self.run)) >= step:
                return
            assert self.launcher.poll() is None, f"the job ended early:\n{self.stderr()[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"no step {step} within {timeout} s:\n{self.stderr()[-3000:]}")

    def pid_of(self, role: str) -> int:
        if role == "launcher":
            return self.launcher.pid
        procs = job_processes(self.mark)
        if role == "agent":
            return next(pid for pid, (cmd, _) in procs.items() if "parallel3d.launch.agent" in cmd)
        return next(pid for pid, (cmd, env) in procs.items() if "parallel3d.job.run" in cmd and env.get("RANK") == "1")

    def wait_gone(self, timeout: float = GONE_S) -> dict:
        """Wait for every process of the job to end; returns the survivors (then killed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.launcher.poll()
            left = job_processes(self.mark)
            if not left:
                return {}
            time.sleep(0.2)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return {pid: cmd for pid, (cmd, _) in left.items()}

    def stderr(self) -> str:
        self.err.flush()
        return self.err_path.read_text()

    def close(self) -> None:
        for pid in job_processes(self.mark):
            os.kill(pid, signal.SIGKILL)
        self.launcher.wait(30)
        self.err.close()


CASES = [("launcher", signal.SIGTERM, 143), ("launcher", signal.SIGINT, 130), ("launcher", signal.SIGKILL, -9),
         ("agent", signal.SIGTERM, 143), ("agent", signal.SIGKILL, 137),
         ("worker", signal.SIGTERM, 143), ("worker", signal.SIGKILL, 137)]


@pytest.mark.parametrize("role,sig,code", CASES, ids=[f"{role}-{sig.name}" for role, sig, _ in CASES])
def test_nothing_outlives_a_signal_and_latest_loads(tmp_path, cache_dir, role, sig, code):
    loses_a_peer = (role, sig) == ("worker", signal.SIGKILL)
    job = Job(tmp_path, cache_dir, "train.save_on_signal=true", *([PEER_LOSS_TIMEOUT] if loses_a_peer else []))
    try:
        job.wait_for_step(3)
        before = len(job.stderr())
        os.kill(job.pid_of(role), sig)
        survivors = job.wait_gone()
        assert not survivors, f"left running after {sig.name} to the {role}: {survivors}\n{job.stderr()[-3000:]}"
        assert job.launcher.wait(5) == code, job.stderr()[-3000:]
        said, earlier = job.stderr()[before:], job.stderr()[:before][-2000:]
    finally:
        job.close()
    latest = (job.run / "checkpoints" / "latest").read_text()
    _complete(job.run / "checkpoints" / latest)
    assert "Traceback" not in said, said
    if sig == signal.SIGKILL and role == "worker":
        assert "zero3d: worker rank 1" in said and "was killed by SIGKILL" in said, said
        return
    # every other case is a graceful stop: the workers got SIGTERM (from the agent, or from the
    # kernel when their parent died) or SIGINT, stopped after the same step and saved it
    stopped = "SIGINT" if sig == signal.SIGINT else "SIGTERM"
    lines = [line for line in said.splitlines() if f"stopped by {stopped} after step" in line]
    assert len(lines) == 1, f"after the signal:\n{said}\nbefore:\n{earlier}"
    step = int(lines[0].split("after step ")[1].split(";")[0])
    assert latest == f"global_step{step}" and read_metrics(job.run)[-1]["step"] == step
    if role == "launcher" and sig != signal.SIGKILL:  # Ctrl-C: one line from zero3d, one from rank 0
        progress = re.compile(r"\d\d:\d\d:\d\d parallel3d\.")  # rank 0's log of its last steps and save
        assert len([line for line in said.splitlines() if not progress.match(line)]) <= 2, said


_HANDLER = """
import os, signal, sys, time
from parallel3d.job.stop import StopSignals
with StopSignals() as stop:
    for sig in sys.argv[1:]:
        os.kill(os.getpid(), getattr(signal, sig))
        time.sleep(0.05)
    print(stop.received, flush=True)
"""


@pytest.mark.parametrize("signals,code,received", [
    (["SIGTERM", "SIGTERM"], 0, signal.SIGTERM),  # the agent's forward, then the parent-death signal
    (["SIGHUP", "SIGTERM"], 0, signal.SIGHUP),
    (["SIGINT", "SIGINT"], 130, None),  # Ctrl-C twice: out at once
    (["SIGTERM", "SIGINT"], 130, None),
])
def test_a_repeated_stop_signal_is_absorbed_and_a_second_ctrl_c_exits(signals, code, received):
    done = subprocess.run([sys.executable, "-c", _HANDLER, *signals], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == code, done.stderr
    assert done.stdout.strip() == ("" if received is None else str(int(received)))
