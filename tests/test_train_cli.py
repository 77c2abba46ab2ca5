"""`zero3d train` end to end: the real CLI on 2 processes (loss falls, checkpoints, keep-last,
tokenizer, metrics), resume equality on the shared gloo harness, and bad input at the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from parallel3d import cli

ROOT = Path(__file__).resolve().parent.parent


def tiny_job(output_dir: Path, **train) -> dict:
    """A job that trains in seconds: a 2-layer Llama on the bundled corpus, 512-token BPE, 32-token blocks."""
    return {
        "model": {"model_type": "llama", "config": {
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64}},
        "tokenizer": {"vocab_size": 512},
        "data": {"builder": "pydoc", "seq_len": 32, "validation_fraction": 0.05},
        "engine": {
            "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}},
            "zero_optimization": {"stage": 2}},
        "train": {"max_steps": 12, "eval_interval": 4, "eval_batches": 4, "save_interval": 4, "keep_last": 2,
                  "output_dir": str(output_dir), "seed": 3, "progress": True, **train},
    }


def assert_close_records(got: dict, want: dict, keys: tuple[str, ...], rel: float) -> None:
    """Each of ``keys`` is absent from both records or present in both with values within ``rel``
    (a record of a step without validation has no ``val_loss``: absent keys are equal)."""
    for key in keys:
        assert (key in got) == (key in want), (key, got, want)
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=rel), (key, got, want)


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_two_processes(tmp_path: Path, cache_dir: Path, *overrides: str) -> tuple[Path, subprocess.CompletedProcess]:
    """`zero3d train` of the tiny job on 2 local processes, as a user runs it: the run dir and the process."""
    run = tmp_path / "run"
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_job(run)))
    env = dict(os.environ, ZERO3D_CACHE=str(cache_dir), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(config), "--nproc-per-node", "2",
                           "train.max_steps=12", *overrides], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run, proc


def test_exported_model_trains_on_from_model_path(tmp_path, cache_dir, tiny_run):
    """train -> zero3d export -> a job with model.path: it starts from the exported weights.

    The same data split, seed and layout, so the second job's step-0 validation loss is the
    first job's last one: every rank read exactly its share of the exported tensors.
    """
    run, _ = tiny_run
    hf = tmp_path / "hf"
    assert cli.main(["export", str(run / "checkpoints" / "latest"), str(hf)]) == 0
    second = tmp_path / "second"
    second.mkdir()
    job = tiny_job(second / "run")
    job["model"] = {"path": str(hf)}
    job["tokenizer"] = {}
    (second / "tiny.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, ZERO3D_CACHE=str(cache_dir), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(second / "tiny.yaml"),
                           "--nproc-per-node", "2", "train.max_steps=1"], cwd=second, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first_last = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r][-1]
    second_first = read_metrics(second / "run")[0]["val_loss"]
    assert second_first == pytest.approx(first_last, rel=1e-6)


def test_zero3d_train_with_pipeline_stages(tmp_path, cache_dir):
    """Two processes as two pipeline stages (1F1B, ZeRO 2): training and validation losses fall."""
    records = read_metrics(train_two_processes(tmp_path, cache_dir, "engine.pipeline.stages=2")[0])
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 4 and vals[-1] < vals[0] - 0.5, vals
    losses = [r["loss"] for r in records[1:]]
    assert losses[-1] < losses[0] - 0.5, losses


def test_zero3d_train_two_processes_end_to_end(tiny_run):
    run, proc = tiny_run
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(13))
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 4 and vals[-1] < vals[0] - 0.5, vals  # step 0, 4, 8, 12
    losses = [r["loss"] for r in records[1:]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(r["tokens_per_s"] > 0 and r["memory_mib"] > 0 for r in records[1:])
    assert records[-1]["tokens"] == 12 * 4 * 2 * 2 * 32  # steps x micro x accumulation x dp x seq_len
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["global_step12", "global_step8", "latest"]  # keep_last 2
    assert (ckpts / "latest").read_text() == "global_step12"
    assert sorted(p.name for p in (ckpts / "global_step12").iterdir()) == [
        "__0_0.distcp", "__1_0.distcp", "checkpoint.json", "config.json", "dcp.json"]
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(run / "tokenizer"))) == 512
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["last_val_loss"] == vals[-1] and summary["world_size"] == 2
    assert "val loss" in proc.stderr and "train:" in proc.stderr  # summary and progress bar (rank 0)
    assert proc.stderr.count("summary:") == 1


def _train_in_workers(job: dict, cache: str) -> list[dict]:
    os.environ["ZERO3D_CACHE"] = cache
    from parallel3d.job.config import load_job_config
    from parallel3d.job.run import run_job

    return run_job(load_job_config(job))["records"]


def test_resumed_run_continues_exactly_as_the_uninterrupted_one(dist, tmp_path, cache_dir):
    def job(run, steps, **train):
        j = tiny_job(run, max_steps=steps, save_interval=3, keep_last=5, eval_interval=3, progress=False, **train)
        j["engine"]["zero_optimization"]["stage"] = 3
        return j

    full = dist.run(2, _train_in_workers, job(tmp_path / "a", 6), str(cache_dir))[0]
    first = dist.run(2, _train_in_workers, job(tmp_path / "b", 3), str(cache_dir))[0]
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    second = dist.run(2, _train_in_workers, job(tmp_path / "b", 6, resume=True), str(cache_dir))[0]
    # the same run resumed on another layout: tp 2, so dp 1 with micro-batches twice as large
    # (the same global micro-batch of dp x micro = 8 blocks: the same training and validation blocks)
    other = job(tmp_path / "c", 6, resume=True)
    other["engine"].update(train_micro_batch_size_per_gpu=8, tensor_parallel={"size": 2})
    moved = dist.run(2, _train_in_workers, other, str(cache_dir))[0]
    assert [r["step"] for r in moved] == [4, 5, 6]
    for got, want in zip(moved, full[4:], strict=True):
        assert (got["step"], got["lr"], got["tokens"]) == (want["step"], want["lr"], want["tokens"])
        assert_close_records(got, want, ("loss", "val_loss"), rel=1e-5)
    assert [r["step"] for r in first] == [0, 1, 2, 3] and [r["step"] for r in second] == [4, 5, 6]

    def numbers(records):
        return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("lr"), r.get("tokens")) for r in records]

    assert numbers(first + second) == numbers(full)  # bit-identical losses, val losses, lrs
    assert numbers(read_metrics(tmp_path / "b")) == numbers(read_metrics(tmp_path / "a"))  # one history
    auto = dist.run(2, _train_in_workers, job(tmp_path / "b", 6, resume="auto"), str(cache_dir))[0]
    assert auto == []  # already at max_steps: nothing to train


def test_cli_bad_input_is_one_message_before_launch(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    job = tiny_job(tmp_path / "run")
    job["data"] = {"builder": "text", "data_files": str(tmp_path / "missing.txt"), "seq_len": 32}
    config.write_text(yaml.safe_dump(job))
    assert cli.main(["train", str(config), "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert f'zero3d train: error: data.data_files: "{tmp_path / "missing.txt"}" does not exist' in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    assert cli.main(["train", str(config), "train.max_stepz=3"]) == 2
    assert "did you mean 'train.max_steps'?" in capsys.readouterr().err
    assert cli.main(["train", str(config), "--nproc-per-node", "0"]) == 2  # not read as "not given"
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zero3d train: error: argument --nproc-per-node: must be a whole number >= 1, got '0'")


def test_corrupt_pretrained_weights_stop_before_workers(tmp_path, cache_dir, capsys, monkeypatch):
    """model.path's safetensors headers are read by `zero3d train` itself, not first by each worker."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("ZERO3D_CACHE", str(cache_dir))
    job = tiny_job(tmp_path / "run")
    hf = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**job["model"]["config"], vocab_size=512)).save_pretrained(hf)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    job["model"] = {"path": str(hf)}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert cli.main(["train", str(tmp_path / "job.yaml"), "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"zero3d train: error: pretrained: {weights}: ") and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_cli_print_config_and_dispatch(capsys, monkeypatch):
    assert cli.main(["train", "--print-config", "train.max_steps=9", "engine.zero_optimization.stage=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["max_steps"] == 9 and printed["engine"]["zero_optimization"]["stage"] == 3
    assert printed["model"]["model_type"] == "llama"  # the built-in default
    seen = {}
    for name, (module_name, _) in cli._DISPATCH.items():
        module = __import__(module_name, fromlist=["main"])
        monkeypatch.setattr(module, "main", lambda argv, name=name: seen.setdefault(name, list(argv)) and 0)
    assert cli.main(["launch", "--dry-run", "x.py"]) == 0 and seen["launch"] == ["--dry-run", "x.py"]
    assert cli.main(["export", "a", "b"]) == 0 and seen["export"] == ["a", "b"]
    assert cli.main(["plot", "runs/x"]) == 0 and seen["plot"] == ["runs/x"]
    assert cli.main(["bogus"]) == 2


def _error_in_workers(job: dict) -> tuple[str, str]:
    from parallel3d import ConfigError
    from parallel3d.job.config import load_job_config
    from parallel3d.job.run import run_job

    try:
        run_job(load_job_config(job))
    except ConfigError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def test_worker_bad_input_stops_every_rank_and_one_reports_it(dist, tmp_path):
    job = tiny_job(tmp_path / "run")
    job["data"] = {"builder": "json", "data_files": str(tmp_path / "gone.jsonl"), "seq_len": 32}
    (rank0_kind, rank0_msg), (rank1_kind, rank1_msg) = dist.run(2, _error_in_workers, job)
    assert rank0_kind == "ConfigError" and rank1_kind == "ReportedElsewhere"  # rank 1 stays quiet
    assert rank0_msg == rank1_msg and "data.data_files" in rank0_msg and "does not exist" in rank0_msg


def test_tensorboard_events_when_tensorboard_is_importable(tmp_path, monkeypatch):
    import types

    from parallel3d.job.metrics import Metrics

    scalars = []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, key, value, step):
            scalars.append((key, value, step))

        def close(self):
            scalars.append("closed")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    metrics = Metrics(tmp_path, active=True, total_steps=2, start_step=0, progress=False)
    metrics.log({"step": 0, "val_loss": 5.0})
    metrics.log({"step": 1, "loss": 4.0, "lr": 0.1})
    metrics.close()
    assert scalars == [("val_loss", 5.0, 0), ("loss", 4.0, 1), ("lr", 0.1, 1), "closed"]
    assert read_metrics(tmp_path) == [{"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 4.0, "lr": 0.1}]
