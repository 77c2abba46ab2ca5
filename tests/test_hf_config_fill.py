"""A Trainer DeepSpeed JSON (configs/hf_trainer_zero3.json, "auto" everywhere) filled from
TrainingArguments as transformers fills it for DeepSpeed (parallel3d/hf/config_fill.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel3d.errors import ConfigError
from parallel3d.hf.config_fill import scheduler_section, trainer_config
from tests.tiny import make_model

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "hf_trainer_zero3.json"


def arguments(tmp_path, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=4,
                  learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-7, weight_decay=0.05,
                  max_grad_norm=0.7, warmup_steps=10, report_to=[], use_cpu=True)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def test_auto_values_come_from_the_arguments_and_the_model(tmp_path):
    data, schedule = trainer_config(str(CONFIG), arguments(tmp_path), make_model("llama"))
    assert "train_batch_size" not in data  # derived over the data-parallel ranks
    assert (data["train_micro_batch_size_per_gpu"], data["gradient_accumulation_steps"], data["gradient_clipping"]) \
        == (3, 4, 0.7)
    assert data["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.05}
    assert data["bf16"] == {"enabled": False}
    zero = data["zero_optimization"]  # from hidden_size 32, as transformers fills them
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (1024, 921, 320)
    section = scheduler_section(schedule, arguments(tmp_path), 100)
    assert section.type == "WarmupDecayLR"
    assert {k: section.params[k] for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")} \
        == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 10, "total_num_steps": 100}


def test_keys_left_out_take_the_arguments(tmp_path):
    data, schedule = trainer_config({"zero_optimization": {"stage": 3}}, arguments(tmp_path, bf16=True))
    assert schedule is None and data["bf16"] == {"enabled": True}
    assert (data["train_micro_batch_size_per_gpu"], data["gradient_accumulation_steps"]) == (3, 4)


def test_a_scheduler_disagreeing_with_the_step_count(tmp_path):
    _, schedule = trainer_config({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}},
                                 arguments(tmp_path))
    with pytest.raises(ConfigError, match=r"scheduler.params.total_num_steps=50 but TrainingArguments "
                                          r"num_training_steps \(calculated\)=100"):
        scheduler_section(schedule, arguments(tmp_path), 100)
