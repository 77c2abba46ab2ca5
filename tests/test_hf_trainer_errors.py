"""What ``parallel3d.hf.Trainer`` refuses, each with one message naming the problem and the way out."""

from __future__ import annotations

import pytest

from parallel3d.errors import ConfigError
from tests.test_hf_trainer import rows, training_args
from tests.tiny import make_model

ZERO3 = {"zero_optimization": {"stage": 3}}


def make(tmp_path, config=ZERO3, trainer_kwargs: dict | None = None, **arg_overrides):
    from parallel3d.hf import Trainer

    return Trainer(model=make_model("llama"), args=training_args(str(tmp_path), 2, **arg_overrides),
                   train_dataset=rows(8), zero3d_config=config, **(trainer_kwargs or {}))


def refusal(out: str, *args, **kwargs) -> str:
    """The message ``make(out, *args, **kwargs)`` stops with (run on every rank)."""
    try:
        make(out, *args, **kwargs)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_deepspeed_argument_beside_a_zero3d_config(tmp_path):
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    try:
        with pytest.raises(ConfigError, match=r"TrainingArguments\(deepspeed=...\) was given together with "
                                              r"zero3d_config.*Move the DeepSpeed JSON to zero3d_config="):
            make(tmp_path, deepspeed={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"})
    finally:
        unset_hf_deepspeed_config()


def test_accelerate_launch_is_refused_with_the_command_to_use(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    with pytest.raises(ConfigError, match=r"started by `accelerate launch`.*`torchrun --nproc-per-node \S+ SCRIPT "
                                          r"\[ARGS\]` or `zero3d launch --nproc-per-node"):
        make(tmp_path)


def test_config_disagreeing_with_the_arguments(tmp_path):
    config = {**ZERO3, "train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=3 but TrainingArguments "
                                          r"per_device_train_batch_size=2; optimizer.params.lr=0.5 but .*\"auto\""):
        make(tmp_path, config)


def test_context_parallel_layout(tmp_path):
    with pytest.raises(ConfigError, match=r"context_parallel.size 2 with parallel3d.hf.Trainer"):
        make(tmp_path, {**ZERO3, "context_parallel": {"size": 2}})
    # DeepSpeed's spelling of the same axis (Ulysses) is refused alike
    with pytest.raises(ConfigError, match=r"sequence_parallel_size 2 with parallel3d.hf.Trainer"):
        make(tmp_path, {**ZERO3, "sequence_parallel_size": 2})


def test_torch_compile_argument(tmp_path):
    """The Trainer compiles in accelerate's prepare, which the engine replaces: it would train uncompiled."""
    with pytest.raises(ConfigError, match=r"TrainingArguments\(torch_compile=True\) was given together with "
                                          r"zero3d_config.*\"compile\": \{\"enabled\": true"):
        make(tmp_path, torch_compile=True, torch_compile_backend="eager")


def test_torch_empty_cache_steps_is_honoured(tmp_path, monkeypatch):
    """The engine's training step replaces the Trainer's, which is where the argument is read."""
    import parallel3d.hf.trainer as module

    steps = []
    monkeypatch.setattr(module, "clear_device_cache", lambda: steps.append(trainer.state.global_step))
    trainer = make(tmp_path, {"zero_optimization": {"stage": 1}}, torch_empty_cache_steps=2, max_steps=4,
                   gradient_accumulation_steps=1)
    trainer.train()
    assert steps == [0, 2], steps  # read before the step counter moves, as the Trainer's own step does


def test_missing_config_and_model_init(tmp_path):
    from parallel3d.hf import Trainer

    with pytest.raises(ConfigError, match="needs zero3d_config="):
        Trainer(model=make_model("llama"), args=training_args(str(tmp_path), 2))
    with pytest.raises(ConfigError, match="not model_init="):
        Trainer(args=training_args(str(tmp_path), 2), model_init=lambda: make_model("llama"), zero3d_config=ZERO3)
    with pytest.raises(ConfigError, match="not a local Hugging Face model directory"):
        Trainer(model=str(tmp_path / "nowhere"), args=training_args(str(tmp_path), 2), zero3d_config=ZERO3)


def own_loss(outputs, labels, num_items_in_batch=None):
    return outputs.loss


def test_pipeline_with_a_loss_of_the_trainers_own(dist, tmp_path):
    for message in dist.run(2, refusal, str(tmp_path), {"pipeline": {"stages": 2}},
                            {"compute_loss_func": own_loss}):
        assert message.startswith("pipeline.stages 2 with parallel3d.hf.Trainer, and compute_loss_func is set")


def test_accelerate_seeing_another_world(dist, tmp_path):
    for message in dist.run(2, refusal, str(tmp_path), use_cpu=False):
        assert message.startswith("the Trainer's accelerate state sees 1 process(es) and the process group has 2")
        assert message.endswith("TrainingArguments(use_cpu=True)")


@pytest.mark.parametrize("config, what", [({**ZERO3, "loss_normalization": "tokens"}, 'loss_normalization "tokens"'),
                                          ({"tensor_parallel": {"size": 2}}, "tensor_parallel.size 2")])
def test_local_token_counts_where_the_count_must_be_global(dist, tmp_path, config, what):
    """Each rank's own label count would be taken for the step's (the loss dp or tp times too large)."""
    for message in dist.run(2, refusal, str(tmp_path), config, average_tokens_across_devices=False):
        assert message.startswith(f"TrainingArguments(average_tokens_across_devices=False) with {what} in zero3d_config")
