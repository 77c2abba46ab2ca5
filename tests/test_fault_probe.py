"""scripts/fault_probe.py stays runnable: two of its cases end to end (2 ranks, the real CLI) and
its verdicts (clear message, nothing lost) on made-up outcomes."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import fault_probe  # noqa: E402
from fault_kit import Proc, Result, is_clear, judge, snapshot  # noqa: E402


def test_two_cases_end_to_end(tmp_path, capsys):
    out = tmp_path / "faults.md"
    assert fault_probe.main(["--work", str(tmp_path / "work"), "--markdown", str(out),
                             "--only", "latest names a missing", "RUN/checkpoints/latest RUN --overwrite"]) == 0
    text = out.read_text()
    assert "**2 cases tried** (0 skipped): clear errors 2 of 2 that expect one; nothing lost in 2 of 2; as expected " \
           "2 of 2." in text, text
    assert "| checkpoint | resume: latest names a missing checkpoint |" in text
    assert "global_step9 does not exist (…/run/checkpoints/latest names it); the newest complete checkpoint" in text
    assert "| export | export RUN/checkpoints/latest RUN --overwrite |" in text and "contains the checkpoint" in text
    assert "**2 cases tried**" in capsys.readouterr().out


def test_the_verdicts(tmp_path):
    (tmp_path / "run").mkdir()
    for name in ("latest", "metrics.jsonl", "keep.txt"):
        (tmp_path / "run" / name).write_text("a\n")
    before = snapshot(tmp_path)
    (tmp_path / "run" / "latest").write_text("b\n")  # allowed below
    (tmp_path / "run" / "metrics.jsonl").write_text("a\nb\n")  # appended: kept
    (tmp_path / "run" / "keep.txt").write_text("c\n")  # changed: lost
    r = Result("c", "n", "e")
    judge(r, Proc(2, "", "12:00:00 parallel3d.x: log\nzero3d train: error: bad\n"), tmp_path, before, rc=2,
          says=["error:", "bad"], may_change=("run/latest",))
    assert r.clear and r.lost == ["run/keep.txt changed"] and not r.as_expected
    assert r.happened == "exit 2: zero3d train: error: bad"
    assert not is_clear("zero3d train: error: bad\nzero3d train: error: bad\n", ["error:"])  # once per rank
    assert not is_clear("Traceback (most recent call last):\nzero3d train: error: bad\n", ["error:"])
    assert not is_clear("zero3d train: error: bad\n", ["error:", "something else"])
