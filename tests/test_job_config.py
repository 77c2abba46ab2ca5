"""The `zero3d train` job config: schema, overrides, the built-in default, and each bad input
stopping before training with one message naming the key, the value and the rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel3d import ConfigError
from parallel3d.config.config import read_config_file
from parallel3d.job import checkpoints, model as model_lib
from parallel3d.job.config import apply_overrides, engine_dict, load_job_config, parse_override
from parallel3d.job.data import load_documents
from parallel3d.job.defaults import QUICKSTART

ROOT = Path(__file__).resolve().parent.parent


def job(**sections):
    """A small valid job dict with some sections replaced or extended."""
    base = {
        "model": {"model_type": "llama", "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2, "max_position_embeddings": 64}},
        "data": {"seq_len": 32},
        "engine": {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        "train": {"max_steps": 3, "output_dir": "unused"},
    }
    for name, value in sections.items():
        base[name] = {**base.get(name, {}), **value} if isinstance(value, dict) else value
    return base


def error_of(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return str(info.value)


# --- the built-in default and the example configs ---------------------------------------------


def test_quickstart_yaml_equals_builtin_default():
    assert read_config_file(ROOT / "configs" / "quickstart.yaml") == QUICKSTART


@pytest.mark.parametrize("name", ["quickstart.yaml", "llama-zero3.yaml", "chat-sft.yaml"])
def test_example_configs_validate(name):
    cfg = load_job_config(ROOT / "configs" / name)
    assert cfg.model.model_type == "llama" and cfg.train.max_steps > 0


def test_default_job_is_small_llama_on_pydoc_with_zero_on_2_processes():
    cfg = load_job_config(None)
    assert cfg.model.model_type == "llama" and cfg.data.source == "pydoc"
    assert cfg.train.nproc_per_node == 2 and cfg.engine["zero_optimization"]["stage"] == 2


# --- overrides ---------------------------------------------------------------------------------


def test_overrides_are_typed_like_yaml_scalars():
    assert parse_override("train.max_steps=200") == (["train", "max_steps"], 200)
    assert parse_override("engine.optimizer.params.lr=1e-4") == (["engine", "optimizer", "params", "lr"], 1e-4)
    assert parse_override("train.resume=true")[1] is True
    assert parse_override("train.resume=auto")[1] == "auto"
    assert parse_override("data.data_files=[a.txt, b.txt]")[1] == ["a.txt", "b.txt"]
    cfg = load_job_config(None, ["train.max_steps=7", "engine.zero_optimization.stage=3", "model.config.hidden_size=64"])
    assert cfg.train.max_steps == 7 and cfg.engine["zero_optimization"]["stage"] == 3
    assert cfg.model.config["hidden_size"] == 64 and QUICKSTART["model"]["config"]["hidden_size"] == 256


def test_bad_override_syntax():
    assert "must look like key.sub=value" in error_of(parse_override, "train.max_steps")
    msg = error_of(apply_overrides, {"engine": "ds.json"}, ["engine.zero_optimization.stage=3"])
    assert "engine is the file" in msg and "used unchanged" in msg


def test_scheduler_total_steps_auto_is_filled_from_the_job():
    cfg = load_job_config(None)
    assert engine_dict(cfg, 300)["scheduler"]["params"]["total_num_steps"] == 300
    assert cfg.engine["scheduler"]["params"]["total_num_steps"] == "auto"  # the job itself is unchanged


# --- messages: key, value, rule ---------------------------------------------------------------


@pytest.mark.parametrize("override, expected", [
    ("train.max_step=5", "unknown config key 'train.max_step'; did you mean 'train.max_steps'?"),
    ("dta.seq_len=5", "unknown config key 'dta'; did you mean 'data'?"),
    ("engine.zero_optimisation.stage=2",
     "unknown config key 'engine.zero_optimisation'; did you mean 'engine.zero_optimization'?"),
    ("engine.zero_optimization.stage=7", "engine.zero_optimization.stage: 7"),
    ("data.seq_len=0", "data.seq_len: 0 must be > 0"),
    ("data.builder=xml", 'data.builder: "xml" is not allowed; must be one of pydoc, text, json, csv, parquet, arrow'),
    ("train.epochs=2", "give exactly one of train.max_steps and train.epochs"),
    ("model.model_type=lama", 'model.model_type: "lama" is not a model type transformers knows; did you mean "llama"?'),
    ("model.model_type=vit", 'model.model_type: "vit" has no causal-LM class in transformers'),
    ("model.path=/some/dir", "give exactly one of model.model_type"),
    ("engine=/no/such/ds_config.json", 'engine: "/no/such/ds_config.json" does not exist'),
    ("data.validation_fraction=1.5", "data.validation_fraction: 1.5 must be < 1"),
])
def test_bad_job_config_messages(override, expected):
    assert expected in error_of(load_job_config, job(), [override])


def test_engine_batch_sizes_checked_for_the_world_size():
    from parallel3d.job.prepare import _resolve_engine

    cfg = load_job_config(job(engine={"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
                                      "gradient_accumulation_steps": 2}))
    assert error_of(_resolve_engine, engine_dict(cfg), 2).startswith("engine: train_batch_size 10 != ")


def test_engine_path_is_used_unchanged(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}))
    cfg = load_job_config(job(engine=str(path)))
    assert engine_dict(cfg) == json.loads(path.read_text())
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "zero_optimisation": {}}))
    assert "did you mean 'engine.zero_optimization'" in error_of(load_job_config, job(engine=str(path)))


# --- bad input found while preparing (before any process starts) --------------------------------


def test_unknown_model_config_key():
    cfg = load_job_config(job(), ["model.config.hiden_size=64"])
    assert error_of(model_lib.hf_config, cfg) == (
        "unknown config key 'model.config.hiden_size': LlamaConfig has no such field; did you mean "
        "'model.config.hidden_size'?")


def test_seq_len_above_max_position_embeddings():
    cfg = load_job_config(job(data={"seq_len": 128}))
    assert error_of(model_lib.hf_config, cfg) == (
        "data.seq_len: 128 is above the model's max_position_embeddings 64 (model.config.max_position_embeddings); "
        "lower data.seq_len or raise max_position_embeddings")


def test_model_dtype_must_agree_with_engine_precision():
    cfg = load_job_config(job(model={"dtype": "bfloat16"}))
    assert 'model.dtype: "bfloat16" disagrees with the engine\'s working precision float32' in error_of(
        model_lib.check_dtype, cfg, "fp32")


def test_missing_data_file(tmp_path):
    cfg = load_job_config(job(data={"builder": "text", "data_files": str(tmp_path / "nope.txt")}))
    assert error_of(load_documents, cfg) == (
        f'data.data_files: "{tmp_path / "nope.txt"}" does not exist (relative paths are read from {Path.cwd()})')
    cfg = load_job_config(job(data={"builder": "json", "data_files": {"train": str(tmp_path / "*.jsonl")}}))
    assert "data.data_files.train: " in error_of(load_documents, cfg) and "matches no file" in error_of(load_documents, cfg)


def test_dataset_without_the_text_column(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"content": f"document {i}", "id": i}) + "\n" for i in range(20)))
    cfg = load_job_config(job(data={"data_files": str(path)}))  # builder inferred from .jsonl
    assert error_of(load_documents, cfg) == 'data.text_column: "text" is not a column of the dataset (columns: content, id)'
    cfg = load_job_config(job(data={"data_files": str(path), "text_column": "id"}))
    assert 'data.text_column: column "id" holds' in error_of(load_documents, cfg)


def test_unknown_split(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("a line\nanother line\n" * 10)
    cfg = load_job_config(job(data={"data_files": str(path), "validation_split": "dev"}))
    assert error_of(load_documents, cfg) == 'data.validation_split: "dev" is not a split of the dataset (splits: train)'


def test_resume_modes_and_unreadable_checkpoint(tmp_path):
    cfg = load_job_config(job(train={"output_dir": str(tmp_path), "resume": True}))
    assert "train.resume: true, but" in error_of(checkpoints.find_resume, cfg)
    assert checkpoints.find_resume(load_job_config(job(train={"output_dir": str(tmp_path), "resume": "auto"}))) is None
    ckpt = tmp_path / "checkpoints" / "global_step3"
    ckpt.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("global_step3")
    for rank in range(2):
        (ckpt / f"rank{rank}.pt").write_bytes(b"not a checkpoint")
    msg = error_of(checkpoints.find_resume, cfg)
    assert msg.startswith(f"train.resume: checkpoint {ckpt} was written by Zero3D before mesh-free checkpoints")
    for rank in range(2):
        (ckpt / f"rank{rank}.pt").unlink()
    assert error_of(checkpoints.find_resume, cfg) == (
        f"train.resume: {ckpt} is not a complete zero3d checkpoint: it has no checkpoint.json; "
        f"{tmp_path / 'checkpoints'} holds no other complete checkpoint to resume from")
    fresh = load_job_config(job(train={"output_dir": str(tmp_path)}))
    assert "already holds checkpoints (latest: global_step3); set train.resume=auto" in error_of(
        checkpoints.find_resume, fresh)
    (tmp_path / "checkpoints" / "latest").write_text("global_step9")
    assert "checkpoints/global_step9 does not exist" in error_of(checkpoints.find_resume, cfg)
    (tmp_path / "checkpoints" / "latest").write_text("")  # not "a tag '' is not allowed"
    assert error_of(checkpoints.find_resume, cfg).startswith(
        f"train.resume: {tmp_path / 'checkpoints' / 'latest'} is empty; it should name the newest checkpoint directory")


def test_heads_that_do_not_divide_the_hidden_size():
    cfg = load_job_config(job(), ["model.config.num_attention_heads=3"])
    assert error_of(model_lib.hf_config, cfg) == (
        "model.config: transformers refuses these overrides for llama: The hidden size (32) is not a multiple of the "
        "number of attention heads (3).")


def test_output_dir_that_is_a_file_or_cannot_be_created(tmp_path):
    from parallel3d.job.prepare import _make_output_dir

    (tmp_path / "file").write_text("")
    assert error_of(_make_output_dir, tmp_path / "file") == f"train.output_dir: {tmp_path / 'file'} is a file, not a directory"
    assert error_of(_make_output_dir, tmp_path / "file" / "run") == (
        f"train.output_dir: {tmp_path / 'file' / 'run'} cannot be created or written: Not a directory")
    _make_output_dir(tmp_path / "new" / "run")
    assert [p.name for p in (tmp_path / "new" / "run").iterdir()] == []  # created, and the probe is gone


def test_keep_last_prunes_oldest_but_never_latest(tmp_path):
    for step in (5, 10, 15, 20):
        (tmp_path / f"global_step{step}").mkdir()
    (tmp_path / "latest").write_text("global_step20")
    removed = checkpoints.prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["global_step10", "global_step5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step15", "global_step20", "latest"]
