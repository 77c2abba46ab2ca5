"""Commands that would replace what a user wrote refuse before writing anything (issue 35):
a fresh `zero3d train` in a run directory with checkpoints but no `latest`, and `zero3d export`
into a directory that holds its source or is not an earlier export."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from parallel3d import cli
from parallel3d.errors import ConfigError
from parallel3d.export.export import export_checkpoint, main as export_main
from tests.test_train_cli import _train_in_workers, tiny_job
from tests.tiny import make_model


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (and every directory) with a digest of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def earlier_run(run: Path) -> None:
    """What a finished run leaves (the tensors' bytes do not matter to the refusals)."""
    for step in (3, 6):
        tag = run / "checkpoints" / f"global_step{step}"
        tag.mkdir(parents=True)
        (tag / "checkpoint.json").write_text(f'{{"format": "zero3d-checkpoint/3", "global_steps": {step}}}')
        (tag / "dcp.json").write_text("{}")
        make_model("llama").config.to_json_file(tag / "config.json")
    (run / "checkpoints" / "latest").write_text("global_step6")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "job.yaml").write_text("train: {}\n")


@pytest.mark.parametrize("resume", ["false", "auto", "true"])
def test_a_fresh_start_never_replaces_checkpoints_without_latest(tmp_path, capsys, resume):
    run = tmp_path / "run"
    earlier_run(run)
    (run / "checkpoints" / "latest").unlink()
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(tiny_job(run, max_steps=6, save_interval=3)))
    before = snapshot(tmp_path)
    assert cli.main(["train", str(config), f"train.resume={resume}", "train.seed=99"]) == 2
    err = capsys.readouterr().err
    root = run / "checkpoints"
    if resume == "true":
        assert err.strip() == (
            f"zero3d train: error: train.resume: true, but {root} has no 'latest' file naming the checkpoint to "
            f"continue from (it holds global_step6, global_step3); write that checkpoint's name into {root / 'latest'} "
            "(such as global_step6)")
    else:
        assert err.strip() == (
            f"zero3d train: error: train.output_dir: {root} holds checkpoints (global_step6, global_step3) but no "
            f"'latest' file naming the one to continue from, so train.resume={resume} would start over and replace "
            f"them and metrics.jsonl; to continue, write the checkpoint's name into {root / 'latest'} (such as "
            "global_step6) and set train.resume=auto; to start fresh, use another train.output_dir (or delete this one)")
    assert snapshot(tmp_path) == before


def test_a_checkpoint_of_another_tag_name_counts_and_a_failed_save_does_not(tmp_path):
    from parallel3d.job.checkpoints import stored_checkpoints

    root = tmp_path / "checkpoints"
    (root / "mine").mkdir(parents=True)
    (root / ".global_step9.tmp").mkdir()  # a save that never finished
    (root / "notes").mkdir()  # neither a global_step name nor a manifest
    assert stored_checkpoints(root) == []
    (root / "mine" / "checkpoint.json").write_text("{}")
    (root / "global_step2").mkdir()
    assert stored_checkpoints(root) == ["global_step2", "mine"]


def test_a_fresh_start_never_replaces_an_earlier_runs_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(tiny_job(run)))
    before = snapshot(tmp_path)
    assert cli.main(["train", str(config)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"zero3d train: error: train.output_dir: {run} already holds an earlier run's metrics.jsonl (and no "
        "checkpoint to continue from); use another train.output_dir (or delete it) to start fresh")
    assert snapshot(tmp_path) == before


def _export_error(capsys, *argv: str) -> str:
    assert export_main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero3d export: error: ") and err.count("\n") == 1, err
    return err.strip().removeprefix("zero3d export: error: ")


def test_export_never_deletes_its_source_or_anything_but_an_earlier_export(tmp_path, capsys):
    run = tmp_path / "run"
    earlier_run(run)
    tag = run / "checkpoints" / "global_step6"
    before = snapshot(tmp_path)
    advice = "an export replaces its output directory, so write it to a directory outside the run (such as a new sibling of it)"
    for source in (run / "checkpoints" / "latest", run, tag):
        assert _export_error(capsys, str(source), str(run), "--overwrite") == (
            f"output directory {run} contains the checkpoint {tag}; {advice}")
    assert _export_error(capsys, str(tag), str(run / "checkpoints"), "--overwrite") == (
        f"output directory {run / 'checkpoints'} contains the checkpoint {tag}; {advice}")
    assert _export_error(capsys, str(tag), str(tag), "--overwrite") == f"output directory {tag} is the checkpoint; {advice}"
    assert _export_error(capsys, str(tag), str(tag / "hf")) == (
        f"output directory {tag / 'hf'} lies inside the checkpoint {tag}; write the export to a directory outside it")
    other = tmp_path / "other"  # a second run: not an export, so --overwrite does not delete it
    earlier_run(other)
    assert _export_error(capsys, str(tag), str(other), "--overwrite") == (
        f"--overwrite replaces only an earlier export (plain files: config.json or adapter_config.json and weights), and {other} is not one: "
        "it holds checkpoints/, job.yaml, metrics.jsonl; give a new or empty directory, or remove it yourself")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    assert _export_error(capsys, str(tag), str(notes), "--overwrite") == (
        f"--overwrite replaces only an earlier export (plain files: config.json or adapter_config.json and weights), and {notes} is not one: "
        "it has no config.json (or adapter_config.json) with weight files (*.safetensors); give a new or empty "
        "directory, or remove it yourself")
    assert snapshot(tmp_path) == {**before, **{k: v for k, v in snapshot(tmp_path).items() if k.startswith(("other", "notes"))}}
    assert snapshot(run) == {k.removeprefix("run/"): v for k, v in before.items() if k.startswith("run/")}


def test_export_refuses_a_shard_size_that_is_not_positive(tmp_path, capsys):
    for size in ("0", "-1", "-2GB", "0MB"):
        assert export_main([str(tmp_path), str(tmp_path / "out"), f"--max-shard-size={size}"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"zero3d export: error: argument --max-shard-size: must be a positive size like 500MB or 2GB, got {size!r}")
    with pytest.raises(ConfigError, match=r"^--max-shard-size must be a positive number of bytes, got 0$"):
        export_checkpoint(tmp_path, tmp_path / "out", max_shard_size=0)
    assert not (tmp_path / "out").exists()


class _Engine:
    save_in_flight = False


def test_keep_last_prunes_only_once_a_background_save_is_published(tmp_path):
    from parallel3d.job.checkpoints import Pruner

    for step in (1, 2):
        (tmp_path / f"global_step{step}").mkdir()
    (tmp_path / "latest").write_text("global_step2")
    engine, pruner = _Engine(), Pruner(tmp_path, 2, active=True)
    engine.save_in_flight = True  # global_step3 is being written: nothing is deleted for it yet
    pruner.saved(engine)
    pruner.poll(engine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "global_step2", "latest"]
    (tmp_path / "global_step3").mkdir()  # published
    (tmp_path / "latest").write_text("global_step3")
    engine.save_in_flight = False
    pruner.poll(engine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "global_step3", "latest"]


def test_async_save_keeps_exactly_keep_last(dist, tmp_path, cache_dir):
    job = tiny_job(tmp_path / "run", max_steps=5, save_interval=1, keep_last=2, eval_interval=0, progress=False)
    job["engine"]["checkpoint"] = {"async_save": True}
    records = dist.run(2, _train_in_workers, job, str(cache_dir))[0]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "global_step4", "global_step5", "latest"]
