"""A damaged `latest`, or one naming a missing or damaged checkpoint, stops the resume with one
message (rank 0's) that names the newest complete checkpoint and how to resume from it, and
changes nothing (issue 35)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from parallel3d.checkpoint.storage import CorruptCheckpointError
from parallel3d.errors import ConfigError
from parallel3d.job import checkpoints
from parallel3d.job.config import load_job_config
from parallel3d.job.resume_check import with_fallback
from parallel3d.runtime.worker_errors import REPORTED_BY_RANK0, reported_by_rank0
from tests.test_nothing_lost import snapshot
from tests.test_train_cli import _train_in_workers, tiny_job


def _job(run: Path, steps: int) -> dict:
    return tiny_job(run, max_steps=steps, save_interval=3, keep_last=5, eval_interval=0, progress=False)


@pytest.fixture(scope="module")
def earlier(dist, tmp_path_factory, cache_dir) -> Path:
    """A run of 6 steps on 2 ranks: checkpoints global_step3 and global_step6, latest global_step6."""
    run = tmp_path_factory.mktemp("fallback") / "run"
    dist.run(2, _train_in_workers, _job(run, 6), str(cache_dir))
    return run


def _copy(earlier: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(earlier, run)
    return run, run / "checkpoints"


def _flip(file: Path, at: int = 5000) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(data)


def _resume_error(run: Path) -> str:
    job = _job(run, 9)
    job["train"]["resume"] = True
    with pytest.raises(ConfigError) as info:
        checkpoints.find_resume(load_job_config(job))
    return str(info.value)


def _damage(root: Path, case: str) -> None:
    step6 = root / "global_step6"
    if case == "garbage latest":
        (root / "latest").write_bytes(b"\x00\xffglobal")
    elif case == "empty latest":
        (root / "latest").write_text("")
    elif case == "latest names a missing tag":
        (root / "latest").write_text("global_step9")
    elif case == "truncated file":
        with open(step6 / "__1_0.distcp", "r+b") as f:
            f.truncate(1000)
    elif case == "deleted file":
        (step6 / "__0_0.distcp").unlink()
    elif case == "manifest of another save":
        shutil.copy(root / "global_step3" / "checkpoint.json", step6 / "checkpoint.json")


CASES = {
    "garbage latest": "train.resume: checkpoint tag '\\x00\ufffdglobal' is not allowed",
    "empty latest": "train.resume: {root}/latest is empty; it should name the newest checkpoint directory beside it "
                    "(such as global_step12): write that name into it; the newest",  # not "or delete it"
    "latest names a missing tag": "train.resume: checkpoint {root}/global_step9 does not exist ({root}/latest names it)",
    "truncated file": "train.resume: checkpoint file {root}/global_step6/__1_0.distcp is damaged (truncated): 1000 "
                      "bytes, its chunks need ",
    "deleted file": "train.resume: checkpoint file {root}/global_step6/__0_0.distcp is damaged (missing): "
                    "{root}/global_step6/dcp.json names it",
    "manifest of another save": "train.resume: checkpoint {root}/global_step6: checkpoint.json was written by save ",
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_resume_error_names_the_previous_complete_checkpoint(earlier, tmp_path, case):
    run, root = _copy(earlier, tmp_path)
    _damage(root, case)
    before = snapshot(run)
    message = _resume_error(run)
    assert message.startswith(CASES[case].format(root=root)), message
    hint = f"; the newest complete checkpoint there is global_step3: to resume from it, write global_step3 into {root}/latest"
    moved = f" (move {root}/global_step6 aside first to keep it: the run saves over it at step 6)"
    expected_hint = hint + ("" if case in ("garbage latest", "empty latest", "latest names a missing tag") else moved)
    if case in ("garbage latest", "empty latest", "latest names a missing tag"):
        expected_hint = expected_hint.replace("global_step3", "global_step6")
    assert message.endswith(expected_hint), message
    assert message.count("\n") == 0 and snapshot(run) == before


def test_without_another_complete_checkpoint_it_says_so(earlier, tmp_path):
    run, root = _copy(earlier, tmp_path)
    (root / "global_step3" / "dcp.json").unlink()
    _damage(root, "deleted file")
    assert _resume_error(run).endswith(f"; {root} holds no other complete checkpoint to resume from")


def _load_damaged(job: dict, cache: str) -> str:
    """run_job on a rank: the ConfigError's type, message and whether it is marked as rank 0's."""
    try:
        _train_in_workers(job, cache)
    except ConfigError as exc:
        return f"{type(exc).__name__} {getattr(exc, REPORTED_BY_RANK0, False)}: {exc}"
    return "no error"


def test_a_checkpoint_damaged_inside_a_tensor_file_gets_the_hint_from_rank_0(dist, earlier, tmp_path, cache_dir):
    """A flipped byte is found by the ranks' checksums as they load: rank 0's error names the
    fallback, the others' (marked as printed by rank 0) stay as they were."""
    run, root = _copy(earlier, tmp_path)
    _flip(root / "global_step6" / "__0_0.distcp")
    before = snapshot(run)
    job = _job(run, 9)
    job["train"]["resume"] = True
    rank0, rank1 = dist.run(2, _load_damaged, job, str(cache_dir))
    damaged = (f"checkpoint file {root}/global_step6/__0_0.distcp is damaged (altered): the chunk of "
               "model/lm_head.weight at [0, 0] does not match its checksum")
    assert rank0 == (f"CorruptCheckpointError True: {damaged}; the newest complete checkpoint there is global_step3: "
                     f"to resume from it, write global_step3 into {root}/latest (move {root}/global_step6 aside first "
                     "to keep it: the run saves over it at step 6)"), rank0
    assert rank1 == f"CorruptCheckpointError True: {damaged}", rank1
    assert snapshot(run) == before  # job.yaml and the tokenizer too: the trainer writes them after a load


def test_only_damage_of_the_resumed_checkpoint_gets_the_hint(tmp_path):
    resumed = tmp_path / "checkpoints" / "global_step6"
    other = CorruptCheckpointError(f"saving checkpoint {tmp_path}/checkpoints/.global_step60.tmp failed")
    assert with_fallback(other, resumed, []) is other
    unfit = ConfigError(f"checkpoint {resumed} holds the state of a AdamW optimizer and this engine's optimizer is SGD")
    assert with_fallback(unfit, resumed, ["global_step3"]) is unfit  # global_step3 is no better
    assert with_fallback(CorruptCheckpointError(f"x {resumed}0/y"), resumed, []).args == (f"x {resumed}0/y",)
    damaged = reported_by_rank0(CorruptCheckpointError(f"checkpoint file {resumed}/a is damaged"))
    marked = with_fallback(damaged, resumed, [])
    assert str(marked).endswith(f"; {tmp_path / 'checkpoints'} holds no other complete checkpoint to resume from")
    assert getattr(marked, REPORTED_BY_RANK0, False)


def test_a_worker_prints_an_error_every_rank_raised_once(monkeypatch, capsys):
    from parallel3d.job import run as job_run

    def fail(job):
        raise reported_by_rank0(ConfigError("the checkpoint is damaged"))

    monkeypatch.setattr(job_run, "run_job", fail)
    monkeypatch.setattr(job_run, "setup_logging", lambda rank: None)
    for rank, said in (("1", ""), ("0", "zero3d train: error: the checkpoint is damaged\n")):
        monkeypatch.setenv("RANK", rank)
        assert job_run.main([]) == 2
        assert capsys.readouterr().err == said
