"""What ``zero3d plan`` prints around its table: the assumed devices before it, a legend, the
chosen layout's config in DeepSpeed JSON keys (a config initialize accepts, for that mesh), and
no transformers warnings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from parallel3d.config.config import load_config
from parallel3d.planner.predict import Layout
from parallel3d.planner.report import LEGEND, layout_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("layout", [
    Layout(2, 4, 1, 3, 1, "interleaved_1f1b", 2, True, False),
    Layout(1, 2, 4, 1, 2, "1f1b", 1, False, True),
    Layout(4, 2, 1, 0, 4, "zb_h1", 1, False, False),
])
def test_the_config_of_a_layout_is_one_initialize_accepts(layout):
    config = layout_config(layout, 64, "bf16")
    resolved = load_config(config, layout.pp * layout.dp * layout.tp)
    assert (resolved.pipeline.stages, resolved.data_parallel_size, resolved.tensor_parallel.size) == (
        layout.pp, layout.dp, layout.tp)
    assert resolved.zero_optimization.stage == layout.zero_stage and resolved.bf16.enabled
    assert resolved.train_micro_batch_size_per_gpu == layout.micro_batch
    assert resolved.gradient_accumulation_steps * layout.micro_batch * layout.dp == 64
    assert resolved.tensor_parallel.sequence_parallel == layout.sequence_parallel
    assert (resolved.pipeline.schedule, resolved.pipeline.virtual_stages) == (
        (layout.schedule, layout.virtual_stages) if layout.pp > 1 else ("1f1b", 1))
    assert resolved.pipeline.activation_checkpointing == (layout.checkpointing and layout.pp > 1)


def test_plan_prints_devices_legend_and_config_without_warnings(tmp_path):
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    # checkpointing on: profiling it made transformers warn (a deprecation and use_cache) before the table
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "plan", str(tmp_path), "--gpus", "8", "--gpu-memory",
                           "2GB", "--seq-len", "64", "--global-batch", "16", "--pp", "2", "--tp", "1", "--zero-stage",
                           "1", "--checkpointing", "on", "--schedule", "1f1b", "--device", "h100"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    out = proc.stdout
    assert out.splitlines()[0] == ("assuming 8 x H100-80GB (2 GB, 8 per node, 989 TFLOP/s peak at 75% efficiency, "
                                   "3.35 TB/s memory, NVLink 450 GB/s, network 50 GB/s per GPU); bf16, seq len 64, "
                                   "global batch 16")
    assert LEGEND in out and "fwd+bwd s" in out and "bubble+pp" not in out
    first = next(line for line in out.splitlines() if line.startswith("  1  "))
    layout = first.split("  ")[2].strip()
    head, _, body = out.partition(f"config of #1 ({layout}), DeepSpeed JSON keys:\n")
    assert body, out
    assert json.loads(body) == {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": int(layout.split(" mb")[1].split()[0]),
        "gradient_accumulation_steps": 16 // (4 * int(layout.split(" mb")[1].split()[0])), "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "pipeline": {"stages": 2, "schedule": "1f1b", "activation_checkpointing": True}}
