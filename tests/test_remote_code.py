"""A model, tokenizer or checkpoint directory whose config names its own Python code (auto_map) is
refused unless trust_remote_code is set, before transformers can prompt or run it (issue 35)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel3d.errors import ConfigError
from parallel3d.job import model as model_lib
from parallel3d.job.config import load_job_config
from parallel3d.job.tokenizer import local_tokenizer
from tests.test_job_config import job
from tests.tiny import make_model


def code_dir(path: Path, file: str = "config.json") -> Path:
    """A directory whose ``file`` maps auto classes to its own module, which leaves a mark when run."""
    path.mkdir(parents=True)
    make_model("llama").config.to_json_file(path / "config.json")
    doc = json.loads((path / file).read_text()) if (path / file).exists() else {}
    doc["auto_map"] = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}
    (path / file).write_text(json.dumps(doc))
    (path / "custom.py").write_text(f"open({str(path / 'RAN')!r}, 'w').write('ran')\n")
    return path


def _message(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return str(info.value)


def test_model_path_with_auto_map_is_refused_unless_trusted(tmp_path):
    path = code_dir(tmp_path / "model")
    data = job()
    data["model"] = {"path": str(path)}
    cfg = load_job_config(data)
    assert cfg.model.trust_remote_code is False and cfg.tokenizer.trust_remote_code is False
    assert _message(model_lib.hf_config, cfg) == (
        f"{path} asks to run its own Python code (config.json has auto_map: custom.CustomConfig, custom.CustomModel); "
        "Zero3D runs such code only with model.trust_remote_code set to true: set it if you trust the code in that "
        "directory")
    assert not (path / "RAN").exists()


def test_tokenizer_with_auto_map_is_refused_unless_trusted(tmp_path):
    path = code_dir(tmp_path / "tok", "tokenizer_config.json")
    assert _message(local_tokenizer, str(path)).endswith(
        "Zero3D runs such code only with tokenizer.trust_remote_code set to true: set it if you trust the code in "
        "that directory")
    assert not (path / "RAN").exists()


def test_plan_and_export_refuse_it_too(tmp_path, capsys):
    from parallel3d.export.export import main as export_main
    from parallel3d.planner.cli import main as plan_main

    path = code_dir(tmp_path / "model")
    assert plan_main([str(path), "--gpus", "8", "--seq-len", "64", "--global-batch", "8"]) == 2
    assert "Zero3D runs such code only with --trust-remote-code set to true" in capsys.readouterr().err
    tag = code_dir(tmp_path / "ckpt" / "global_step1")
    assert export_main([str(tag), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zero3d export: error: {tag} asks to run its own Python code") and err.count("\n") == 1
    assert not (path / "RAN").exists() and not (tag / "RAN").exists() and not (tmp_path / "out").exists()


def test_export_passes_the_setting_to_the_tokenizer_and_model_it_loads(tmp_path, monkeypatch):
    """export reads the job's trained tokenizer (its special token ids) and builds the model on meta
    (its parameter order): both loads get --trust-remote-code, and the tokenizer's code is refused
    without it."""
    import yaml
    from transformers import AutoModelForCausalLM

    from parallel3d.export import export
    from parallel3d.export.tokens import save_model_configs

    run = tmp_path / "run"
    tag = run / "checkpoints" / "global_step1"
    tag.mkdir(parents=True)
    (run / "job.yaml").write_text(yaml.safe_dump({"model": {"model_type": "llama"}, "tokenizer": {"vocab_size": 512}}))
    tokenizer = code_dir(run / "tokenizer", "tokenizer_config.json")
    config = make_model("llama").config
    assert _message(save_model_configs, config, tmp_path / "out", tag, tokenizer) == (
        f"{tokenizer} asks to run its own Python code (tokenizer_config.json has auto_map: custom.CustomConfig, "
        "custom.CustomModel); Zero3D runs such code only with --trust-remote-code set to true: set it if you trust "
        "the code in that directory")
    assert not (tokenizer / "RAN").exists()

    seen = []

    def from_config(cfg, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        raise ValueError("not built here")

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", from_config)
    for trust in (False, True):
        assert export._meta_model(config, trust) is None
    assert export._model_order(None, ["b", "a"]) == ["a", "b"]
    assert seen == [False, True]
