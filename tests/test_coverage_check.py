"""The coverage script's own check (``scripts/coverage_check.py``): its meta-device start and its
resumed layouts pass on a family known to work, and a resume that loses the checkpoint, or only
the optimizer's state in it, is reported as a mismatch (the check can fail)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def outcomes(cases: list[tuple[str, bool]], scratch: str, lose: str = "") -> list[str]:
    """On every rank: ``check("llama", layout, meta, scratch)`` for each case. ``lose``: ``"all"``
    makes the engine's ``load_checkpoint`` do nothing, ``"optimizer"`` makes it skip the
    optimizer's state (the momentum)."""
    from coverage_check import check

    from parallel3d.engine.engine import Engine

    original = Engine.load_checkpoint
    if lose == "all":
        Engine.load_checkpoint = lambda self, *args, **kwargs: (None, None)
    elif lose == "optimizer":
        Engine.load_checkpoint = lambda self, *args, **kwargs: original(self, *args, **kwargs,
                                                                        load_optimizer_states=False)
    try:
        return [check("llama", layout, meta, scratch) for layout, meta in cases]
    finally:
        Engine.load_checkpoint = original


def test_meta_start_and_resume_pass(dist, tmp_path):
    cases = [("tp2", True), ("tp2>pp2", False), ("pp2>zero3", False), ("zero3>tp2", True)]
    for rank, got in enumerate(dist.run(2, outcomes, cases, str(tmp_path))):
        assert got == ["pass"] * len(cases), f"rank {rank}: {got}"


@pytest.mark.parametrize("lose", ["all", "optimizer"])
def test_a_resume_that_loses_state_fails(dist, tmp_path, lose):
    for rank, (got,) in enumerate(dist.run(2, outcomes, [("tp2>pp2", False)], str(tmp_path), lose)):
        assert got.startswith(("fail: loss of step 1", "fail: update of")), f"rank {rank}: {got}"
