"""A ConfigError/UsageError through the Python API under torchrun ends each worker with one
line (rank 0 prints the message, the others say they stopped for the same reason), not a
traceback per rank; every other exception keeps its traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel3d.runtime import worker_errors
from parallel3d.errors import ConfigError, UsageError

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import parallel3d
from tests.tiny import ds_config, make_model
cfg = ds_config(2, 1, 2)
cfg["zero_optimization"]["stage"] = 4
parallel3d.initialize(model=make_model("llama"), config=cfg)
"""


def test_a_bad_config_under_torchrun_is_one_line_per_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "launch", "--nproc-per-node", "2", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    message = "train.py: error: zero_optimization.stage: 4 is not allowed; must be one of 0, 1, 2, 3"
    assert sum(line.endswith(message) for line in lines) == 1, proc.stderr
    assert sum(line.endswith("rank 1 stopped: the same ConfigError as rank 0 (printed there)") for line in lines) == 1
    assert "Traceback" not in proc.stderr and "ConfigError(" not in proc.stderr


@pytest.fixture
def hook(monkeypatch):
    """The hook as installed in a torchrun worker, over a recording 'previous' hook."""
    seen = []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.delenv("ZERO3D_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, tb: seen.append(kind))
    monkeypatch.setattr(sys, "argv", ["train.py"])
    worker_errors.install()
    worker_errors.install()  # once: a second initialize does not wrap it again
    return sys.excepthook, seen


def test_hook_lines_by_rank_and_kind(hook, monkeypatch, capsys):
    excepthook, seen = hook
    shared = worker_errors.reported_by_rank0(ConfigError("stage: 4 is not allowed"))
    for rank, error, want in [
        ("0", shared, "train.py: error: stage: 4 is not allowed"),
        ("1", shared, "rank 1 stopped: the same ConfigError as rank 0 (printed there)"),
        ("1", UsageError("step() before backward()"), "rank 1: train.py: error: step() before backward()"),
    ]:
        monkeypatch.setenv("RANK", rank)
        excepthook(type(error), error, None)
        assert capsys.readouterr().err == want + "\n"
    assert seen == []
    excepthook(RuntimeError, RuntimeError("a bug"), None)  # a bug keeps its traceback
    monkeypatch.setenv("ZERO3D_TRACEBACK", "1")
    excepthook(ConfigError, shared, None)
    assert seen == [RuntimeError, ConfigError] and capsys.readouterr().err == ""


def test_no_hook_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    before = sys.excepthook
    worker_errors.install()
    assert sys.excepthook is before


def _agree_marks(messages: list) -> tuple[str, bool]:
    import torch.distributed as dist

    from parallel3d.runtime.agreement import agree

    mine = messages[dist.get_rank()]
    try:
        agree(ConfigError(mine) if mine else None, None if mine else {"x": 1})
    except ConfigError as exc:
        return str(exc), getattr(exc, worker_errors.REPORTED_BY_RANK0, False)
    return "", False


@pytest.mark.parametrize("messages,want", [
    ([None, "bad key"], [("rank 1 stopped: bad key", True), ("bad key", True)]),
    (["bad key", "bad key"], [("bad key", True), ("bad key", True)]),
    (["bad key", "another"], [("bad key", True), ("another", False)]),  # rank 0 does not print rank 1's
])
def test_agreed_errors_say_whether_rank0_prints_them(dist, messages, want):
    assert dist.run(2, _agree_marks, messages) == want
