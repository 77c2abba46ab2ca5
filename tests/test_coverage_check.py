"""The coverage script's own check (``scripts/coverage_check.py``): its meta-device start and its
resumed layouts pass on a family known to work, and a resume that loses the checkpoint is
reported as a failure, not a pass (the check can fail)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def outcomes(cases: list[tuple[str, bool]], scratch: str, drop_load: bool = False) -> list[str]:
    """On every rank: ``check("llama", layout, meta, scratch)`` for each case; with ``drop_load``
    the engine's ``load_checkpoint`` does nothing (a resume that forgets its state)."""
    from coverage_check import check

    from parallel3d.engine import Engine

    original = Engine.load_checkpoint
    if drop_load:
        Engine.load_checkpoint = lambda self, *args, **kwargs: (None, None)
    try:
        return [check("llama", layout, meta, scratch) for layout, meta in cases]
    finally:
        Engine.load_checkpoint = original


def test_meta_start_and_resume_pass(dist, tmp_path):
    cases = [("tp2", True), ("pp2>zero3", False), ("zero3>tp2", True)]
    for rank, got in enumerate(dist.run(2, outcomes, cases, str(tmp_path))):
        assert got == ["pass"] * len(cases), f"rank {rank}: {got}"


def test_resume_without_the_checkpoint_fails(dist, tmp_path):
    for rank, (got,) in enumerate(dist.run(2, outcomes, [("tp2>pp2", False)], str(tmp_path), True)):
        assert got.startswith("fail: "), f"rank {rank}: {got}"
