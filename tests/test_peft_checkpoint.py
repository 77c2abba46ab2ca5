"""Checkpoints and export of PEFT (LoRA) models (issue 29, item 3).

A checkpoint holds the adapters and their optimizer state, not the frozen base; it resumes on
another layout with the base built again by the loading script, and ``zero3d export`` writes a
PEFT adapter directory (or, with ``--merged``, the base with the adapters merged)."""

from __future__ import annotations

import json

import pytest
import torch

from parallel3d.checkpoint.storage import read_metadata
from parallel3d.export.export import main
from tests.peft_tiny import hf_name, make_peft_model
from tests.tiny import VOCAB, ds_config, make_model, oracle_run, rank_micro_batches, token_batches

STEPS, GAS = 3, 2
RTOL = 1e-5


def _engine(stage: int, dp: int, tp: int, seed: int):
    import parallel3d

    config = ds_config(stage, GAS, dp, stage3_param_persistence_threshold=0)
    config["tensor_parallel"] = {"size": tp}
    return parallel3d.initialize(model=make_peft_model(adapter_seed=seed), config=config)[0]


def train_save(save_dir: str) -> dict:
    """ZeRO-3 at dp 2: train, save; the trained params."""
    engine = _engine(3, 2, 1, seed=1)
    data = iter(rank_micro_batches(token_batches(STEPS, GAS, 2), engine.mesh.local_rank("dp")))
    for _ in range(STEPS):
        engine.train_batch(data)
    engine.save_checkpoint(save_dir)
    return engine.full_parameters()


def resume_train(save_dir: str) -> tuple[list[float], dict]:
    """tp 2 at ZeRO-1 with adapters initialized otherwise: load, train on; losses and trained params."""
    engine = _engine(1, 1, 2, seed=5)
    engine.load_checkpoint(save_dir)
    data = iter(rank_micro_batches(token_batches(STEPS, GAS, 1, seed=2), 0))
    return [float(engine.train_batch(data)) for _ in range(STEPS)], engine.full_parameters()


def test_resume_on_another_layout_and_export(dist, tmp_path):
    from peft import PeftModel

    ckpt = tmp_path / "ckpt"
    saved = dist.run(2, train_save, str(ckpt))[0]
    tag = next(p for p in ckpt.iterdir() if p.is_dir())
    names = {fqn.split("/", 1)[1] for fqn in read_metadata(tag).state_dict_metadata if fqn.startswith("model/")}
    assert names == set(saved) and all(".lora_" in n for n in names)  # the adapters only, no frozen base

    model = make_peft_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    oracle_run("llama", token_batches(STEPS, GAS, 2), model=model, optimizer=lambda _: opt)
    want_losses, want = oracle_run("llama", token_batches(STEPS, GAS, 1, seed=2), model=model, optimizer=lambda _: opt)
    trained = {hf_name(n): p for n, p in want.items() if model.get_parameter(n).requires_grad}
    for losses, params in dist.run(2, resume_train, str(ckpt)):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        for name, value in trained.items():
            torch.testing.assert_close(params[name], value, rtol=RTOL, atol=1e-7)

    adapter = tmp_path / "adapter"
    assert main([str(ckpt), str(adapter)]) == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    loaded = PeftModel.from_pretrained(make_model("llama", seed=0), adapter)  # the base as the loading script builds it
    adapters = {hf_name(n): p.detach() for n, p in loaded.named_parameters() if ".lora_" in n}
    assert adapters.keys() == saved.keys()
    for name, value in adapters.items():
        assert torch.equal(value, saved[name]), name
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want_logits = loaded(input_ids=ids).logits

    base_dir, merged = tmp_path / "base", tmp_path / "merged"
    make_model("llama", seed=0).save_pretrained(base_dir)
    assert main([str(ckpt), str(merged), "--merged", "--base", str(base_dir)]) == 0
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
    torch.testing.assert_close(got, want_logits, rtol=1e-5, atol=1e-5)


def test_merged_needs_a_base_and_a_peft_checkpoint(dist, tmp_path):
    ckpt = tmp_path / "ckpt"
    dist.run(2, train_save, str(ckpt))
    assert main([str(ckpt), str(tmp_path / "out"), "--merged"]) == 2
    assert main([str(ckpt), str(tmp_path / "out"), "--merged", "--base", str(tmp_path / "nowhere")]) == 2
    assert not (tmp_path / "out").exists()


def test_adapter_keys_are_those_peft_saves():
    """Our names for a checkpoint's trained parameters map to the keys peft writes (and reads),
    a modules_to_save copy included."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from parallel3d.export.adapter import adapter_key

    model = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    ours = {adapter_key(n, "default") for n, p in model.base_model.model.named_parameters() if p.requires_grad}
    assert any("lm_head" in k for k in ours)
    assert ours == set(get_peft_model_state_dict(model))
