"""zero3d export: checkpoints of ZeRO stages 1 and 3 at dp=2, and of pp 2 x tp 2, -> from_pretrained
gives the engine's logits (or, under pipeline stages, its loss)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed
from safetensors import safe_open

from parallel3d.errors import ConfigError
from parallel3d.export.export import export_checkpoint, main, resolve_checkpoint
from tests.tiny import VOCAB, ds_config, make_model, rank_micro_batches, token_batches

STEPS = 3


def train_and_save(kind: str, stage: int, save_dir: str, freeze: str | None = None) -> tuple:
    """On every rank: train a few steps at dp=2, save; rank 0 returns logits and full params."""
    import parallel3d

    model = make_model(kind)
    if freeze:
        model.get_parameter(freeze).requires_grad_(False)
    extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    engine, _, _, _ = parallel3d.initialize(model=model, config=ds_config(stage, 1, 2, **extra))
    rank = torch.distributed.get_rank()
    for mb in rank_micro_batches(token_batches(STEPS, 1, 2), rank):
        engine.backward(engine(**mb).loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    params = engine.full_parameters()
    return (ids, logits, params) if rank == 0 else None


def load_exported(out: Path) -> dict[str, torch.Tensor]:
    files = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values() \
        if (out / "model.safetensors.index.json").exists() else ["model.safetensors"]
    tensors = {}
    for f in set(files):
        with safe_open(out / f, "pt") as sf:
            tensors |= {k: sf.get_tensor(k) for k in sf.keys()}
    return tensors


@pytest.mark.parametrize("kind,stage", [("llama", 1), ("llama", 3), ("gpt2", 1), ("gpt2", 3)])
def test_export_matches_engine(dist, tmp_path, kind, stage):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer_config.json").write_text("{}")
    (run / "tokenizer" / "config.json").write_text("{}")  # not a tokenizer file: must not be copied
    ids, want_logits, want_params = dist.run(2, train_and_save, kind, stage, str(run / "checkpoints"))[0]
    out = tmp_path / "hf"
    # the 'latest' pointer file; a small shard size so the index is exercised
    assert main([str(run / "checkpoints" / "latest"), str(out), "--max-shard-size", "20KB"]) == 0
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    assert (out / "tokenizer_config.json").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == kind

    got = load_exported(out)
    assert set(got) == set(want_params)  # tied lm_head appears once (GPT-2), as in the checkpoint
    for name, want in want_params.items():
        assert torch.equal(got[name], want), name

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if kind == "gpt2":
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)

    bf16 = tmp_path / "hf16"
    export_checkpoint(run / "checkpoints", bf16, dtype="bf16")  # the save dir resolves to its newest tag
    assert (bf16 / "model.safetensors").exists() and not (bf16 / "model.safetensors.index.json").exists()
    for name, t in load_exported(bf16).items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want_params[name].to(torch.bfloat16))
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16


def test_frozen_params_reported(dist, tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    dist.run(2, train_and_save, "llama", 1, str(ckpt), "model.norm.weight")
    with caplog.at_level(logging.WARNING, logger="parallel3d.export.export"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert "1 parameters are not in the checkpoint" in caplog.text and "model.norm.weight" in caplog.text


def train_pp_tp_and_save(kind: str, save_dir: str) -> tuple:
    """pp 2 x tp 2 x ZeRO-1: train, save, and the engine's loss on a fixed batch and its parameters."""
    import parallel3d

    config = ds_config(1, 2, 1)
    config["pipeline"] = {"stages": 2}
    config["tensor_parallel"] = {"size": 2}
    model = make_model(kind, **({"num_hidden_layers": 4} if kind == "llama" else {"n_layer": 4}))
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    data = token_batches(STEPS, 2, 1)
    engine.train_batch(iter([{"input_ids": data[s, a, 0], "labels": data[s, a, 0]} for s in range(STEPS) for a in range(2)]))
    engine.save_checkpoint(save_dir)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    loss = engine.eval_batch(iter([{"input_ids": ids, "labels": ids}]), num_micro_batches=1)
    return loss, engine.full_parameters()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_export_of_a_pipeline_and_tensor_parallel_checkpoint(dist, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    results = dist.run(4, train_pp_tp_and_save, kind, str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    assert main([str(tmp_path / "ckpt"), str(out)]) == 0
    got = load_exported(out)
    tied = {"lm_head.weight": "transformer.wte.weight"}
    for _, params in results:
        for name, want in params.items():
            assert torch.equal(got[tied.get(name, name) if name not in got else name], want), name
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert [r[0] for r in results] == pytest.approx([loss] * 4, rel=1e-5)


def test_bad_input(tmp_path, capsys):
    def error(*argv: str) -> str:
        assert main([*argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("zero3d export: error: ") and err.count("\n") == 1, err
        return err

    assert "does not exist" in error(str(tmp_path / "nope"), str(tmp_path / "out"))
    (tmp_path / "save").mkdir()
    (tmp_path / "save" / "latest").write_text("global_step9")
    assert "does not exist" in error(str(tmp_path / "save"), str(tmp_path / "out"))
    tag = tmp_path / "save" / "global_step9"
    tag.mkdir()
    assert "no config.json" in error(str(tag), str(tmp_path / "out"))
    make_model("llama").config.to_json_file(tag / "config.json")
    assert "is not a complete zero3d checkpoint: it has no checkpoint.json" in error(str(tag), str(tmp_path / "out"))
    (tag / "rank0.pt").write_bytes(b"not a checkpoint")
    assert "was written by Zero3D before mesh-free checkpoints" in error(str(tag), str(tmp_path / "out"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "is not empty" in error(str(tag), str(tmp_path / "full"))
    assert main([str(tag)]) == 2  # argparse: missing OUT
    capsys.readouterr()
    assert resolve_checkpoint(tmp_path / "save" / "latest") == tag
    (tmp_path / "a_file").write_text("")
    assert f"output {tmp_path / 'a_file'} is a file; give the directory to write" in error(str(tag), str(tmp_path / "a_file"))
    (tmp_path / "save" / "latest").write_text("\n")
    for where in (tmp_path / "save", tmp_path / "save" / "latest"):
        assert f"{tmp_path / 'save' / 'latest'} is empty; it should name the newest checkpoint directory" in error(
            str(where), str(tmp_path / "out"))


def test_a_damaged_checkpoint_is_not_exported(dist, tmp_path, capsys):
    dist.run(2, train_and_save, "llama", 1, str(tmp_path / "ckpt"))
    file = tmp_path / "ckpt" / "global_step3" / "__1_0.distcp"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert "__1_0.distcp is damaged" in capsys.readouterr().err and not (tmp_path / "hf").exists()
