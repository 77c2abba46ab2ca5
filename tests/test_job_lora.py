"""`zero3d train` with a `lora` section (issue 29, item 5): a local model directory fine-tuned
with LoRA adapters, its checkpoints holding the adapters only, exported as a PEFT directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from parallel3d import cli
from parallel3d.errors import ConfigError
from tests.test_train_cli import ROOT, read_metrics, tiny_job


def test_lora_job_from_a_model_directory(tmp_path, cache_dir, tiny_run):
    """train -> export -> a LoRA job on the export at ZeRO 3: it starts from the exported model
    (lora_B starts at zero), trains, saves the adapters only, and exports a PEFT adapter directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, _ = tiny_run
    hf = tmp_path / "hf"
    assert cli.main(["export", str(run / "checkpoints" / "latest"), str(hf)]) == 0
    second = tmp_path / "second"
    second.mkdir()
    job = tiny_job(second / "run", max_steps=4, save_interval=0)
    job["model"] = {"path": str(hf)}
    job["tokenizer"] = {}
    job["engine"]["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    job["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    (second / "lora.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, ZERO3D_CACHE=str(cache_dir), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(second / "lora.yaml"),
                           "--nproc-per-node", "2"], cwd=second, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_metrics(second / "run")
    first_last = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r][-1]
    assert records[0]["val_loss"] == pytest.approx(first_last, rel=1e-6)
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 2 and vals[-1] < vals[0], vals  # steps 0 and 4
    tag = second / "run" / "checkpoints" / "global_step4"
    from parallel3d.checkpoint.storage import read_metadata

    saved = [f for f in read_metadata(tag).state_dict_metadata if f.startswith("model/")]
    assert saved and all(".lora_" in f for f in saved)
    adapter = tmp_path / "adapter"
    assert cli.main(["export", str(second / "run"), str(adapter)]) == 0
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf), adapter)
    assert sum(".lora_B." in n and p.abs().sum() > 0 for n, p in model.named_parameters()) == 2 * 3


@pytest.mark.parametrize("lora,message", [
    ({"target_modules": ["q_proj", "qkv"]}, "lora.target_modules: 'qkv' matches no module of LlamaForCausalLM; its "
                                            "Linear layers are named down_proj, gate_proj, k_proj, lm_head"),
    ({"target_modules": "layers\\.\\d+\\.attn"}, "the regular expression"),
    ({"target_modules": []}, "lora.target_modules"),
    ({"lora_rank": 4}, "lora_rank"),
])
def test_bad_lora_section_is_one_message(tmp_path, lora, message):
    from parallel3d.job.config import load_job_config
    from parallel3d.job.lora import apply_lora
    from parallel3d.job.model import build_model, hf_config

    job = tiny_job(tmp_path / "run")
    job["lora"] = lora
    with pytest.raises(ConfigError) as caught:
        cfg = load_job_config(job)
        apply_lora(cfg, build_model(cfg, hf_config(cfg), log=False))
    assert message in str(caught.value)


def test_axolotl_names_are_read():
    from parallel3d.job.config import load_job_config

    job = tiny_job(Path("run"))
    job["lora"] = {"lora_r": 16, "lora_target_modules": ["q_proj"], "lora_dropout": 0.05}
    lora = load_job_config(job).lora
    assert (lora.r, lora.target_modules, lora.lora_dropout) == (16, ["q_proj"], 0.05)
