"""Resuming with another global batch: one message, before any worker starts, naming the
setting that restores the checkpoint's global batch on this world size."""

from __future__ import annotations

import yaml

from parallel3d import cli
from parallel3d.job.resume_batch import restoring_settings
from tests.test_schedule_resume import _train
from tests.test_train_cli import tiny_job


def test_another_global_batch_is_refused_once_with_the_setting_that_restores_it(dist, tmp_path, capsys, monkeypatch):
    from parallel3d.job.config import load_job_config
    from parallel3d.job.prepare import prepare

    cache = tmp_path / "cache"
    job = tiny_job(tmp_path / "run", max_steps=2, save_interval=2, eval_interval=0, progress=False, resume="auto")
    dist.run(1, _train, job, str(cache))  # one process: global batch 4 x 2 x 1 = 8
    monkeypatch.setenv("ZERO3D_CACHE", str(cache))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    # two processes: 4 x 2 x 2 = 16 blocks per step
    assert cli.main(["train", str(config), "--nproc-per-node", "2", "train.max_steps=4"]) == 2
    err = capsys.readouterr().err
    ckpt = tmp_path / "run" / "checkpoints" / "global_step2"
    want = (f"zero3d train: error: train.resume: checkpoint {ckpt} was trained with a global batch of 8 blocks per step "
            "(train_batch_size) but this run's is 16 (train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 "
            "x data-parallel size 2); the data position continues only with the same global batch; to keep it on this "
            "world size, resume with engine.gradient_accumulation_steps=1; or use another train.output_dir to start a "
            "new run with this batch")
    assert err.splitlines().count(want) == 1 and err.count("error:") == 1, err
    assert not (tmp_path / "run" / "checkpoints" / "global_step4").exists()
    # the setting it names does restore the batch
    prep = prepare(load_job_config(str(config), ["train.max_steps=4", "engine.gradient_accumulation_steps=1"]), 2)
    assert prep.resolved.train_batch_size == 8 and prep.resume_from == ckpt


def test_settings_that_restore_a_global_batch():
    assert restoring_settings(64, 4, 8, 1, set()) == {"gradient_accumulation_steps": 2}
    assert restoring_settings(48, 4, 8, 3, set()) == {"train_micro_batch_size_per_gpu": 4}  # 12 = 4 x 3
    assert restoring_settings(20, 2, 4, 3, set()) == {"train_micro_batch_size_per_gpu": 10,
                                                      "gradient_accumulation_steps": 1}
    assert restoring_settings(64, 4, 8, 1, {"train_batch_size", "train_micro_batch_size_per_gpu"}) == {
        "train_batch_size": 64, "gradient_accumulation_steps": 2}
    assert restoring_settings(8, 3, 1, 1, set()) is None  # no pair gives 8 blocks on 3 ranks
