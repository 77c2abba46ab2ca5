"""Extending a finished run (train.max_steps raised, train.resume=auto) with a scheduler whose
total_num_steps is "auto": the saved schedule continues (no LR jump at the resume point), one
line says so and how to refit; a total set in the config is used as given, also said in one line."""

from __future__ import annotations

import logging
import shutil

import pytest

from parallel3d.job.schedule import lr_at
from tests.test_train_cli import tiny_job

LR, MIN_LR = 1e-2, 1e-3


def _job(run, steps: int, total="auto") -> dict:
    job = tiny_job(run, max_steps=steps, save_interval=6, keep_last=3, eval_interval=0, progress=False, resume="auto")
    job["engine"]["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": MIN_LR, "warmup_max_lr": LR, "warmup_num_steps": 2, "warmup_type": "linear",
        "total_num_steps": total}}
    return job


def _train(job: dict, cache: str) -> tuple[list[dict], list[str]]:
    """Run the job on this rank: (its metric records, the trainer's log lines about the scheduler)."""
    import os

    from parallel3d.job.config import load_job_config
    from parallel3d.job.run import run_job

    os.environ["ZERO3D_CACHE"] = cache
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("parallel3d.job.trainer")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        records = run_job(load_job_config(job))["records"]
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    return records, [line for line in lines if line.startswith("scheduler:")]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zero3d-cache"))


def lrs(records: list[dict]) -> list[float]:
    return [r["lr"] for r in records if "lr" in r]


def test_extended_run_continues_the_saved_schedule(dist, tmp_path, cache_dir):
    first, notes = dist.run(1, _train, _job(tmp_path / "a", 6), cache_dir)[0]
    assert notes == []
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    extended, notes = dist.run(1, _train, _job(tmp_path / "a", 10), cache_dir)[0]
    assert [r["step"] for r in extended] == [7, 8, 9, 10]
    # the uninterrupted run of 10 steps on the 6-step schedule: the same LR at every step
    straight, _ = dist.run(1, _train, _job(tmp_path / "c", 10, total=6), cache_dir)[0]
    assert lrs(first + extended) == lrs(straight)
    saved = _job(tmp_path / "a", 10)["engine"] | {"scheduler": {**_job(tmp_path, 10, total=6)["engine"]["scheduler"]}}
    # step k runs at the LR of scheduler iteration k - 2: the 6-step decay ends at step 8, its final LR holds
    assert lrs(extended) == pytest.approx([lr_at(saved, 5), MIN_LR, MIN_LR, MIN_LR])
    refit = {**saved, "scheduler": {**saved["scheduler"], "params": {**saved["scheduler"]["params"],
                                                                     "total_num_steps": 10}}}
    assert notes == [
        f"scheduler: continuing the checkpoint's WarmupDecayLR schedule (total_num_steps 6, as its LR scheduler "
        f"state was saved): LR {lr_at(saved, 5):.3g} at step 7, {lr_at(saved, 6):.3g} at step 8; 'auto' refit to "
        f"this job's 10 steps would move it to {lr_at(refit, 6):.3g} at step 8; it reaches its final LR "
        f"{MIN_LR:.3g} at step 8, which holds through step 10; to decay over the new total instead, set "
        "engine.scheduler.params.total_num_steps=10"]

    # a total set in the config wins, as in DeepSpeed, and says so: the LR moves at step 8
    moved, notes = dist.run(1, _train, _job(tmp_path / "b", 10, total=10), cache_dir)[0]
    assert lrs(moved) == pytest.approx([lr_at(saved, 5)] + [lr_at(refit, it) for it in (6, 7, 8)])
    assert len(notes) == 1 and notes[0].startswith(
        "scheduler: total_num_steps 10 (set in the engine config) replaces the checkpoint's 6: the WarmupDecayLR LR "
        f"moves from {lr_at(saved, 5):.3g} at step 7 to {lr_at(refit, 6):.3g} at step 8")
