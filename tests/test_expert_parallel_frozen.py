"""Expert parallelism with frozen experts against one process (issue 31).

Frozen experts (``requires_grad=False``: only routers and attention train, or LoRA adapters
around attention) are laid out with the trained experts, over the ranks that hold the same
experts; laid out with the dense params they were taken from ep rank 0, so every other ep rank
computed with rank 0's experts. Each rank's training losses, the trained params and this rank's
frozen experts (unchanged, its own slice) are compared with one process.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed

from tests.tiny import oracle_run, rank_micro_batches, token_batches, update_mismatch
from tests.tiny_moe import EXPERTS, ep_config, make_moe

STEPS, GAS, DP, EP = 2, 2, 2, 2
RTOL = 1e-5
LORA_TARGETS = ("q_proj", "v_proj", "o_proj")


def _frozen_experts_model() -> torch.nn.Module:
    model = make_moe("mixtral")
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    return model


def _lora_model() -> torch.nn.Module:
    """The tiny Mixtral with LoRA around attention (random on both sides, so every adapter trains
    from the first step); the experts are part of the frozen base."""
    from peft import LoraConfig, get_peft_model

    base = make_moe("mixtral")
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    return get_peft_model(base, config)


MODELS = {"frozen_experts": _frozen_experts_model, "lora": _lora_model}


def _hf_name(name: str) -> str:
    return name.removeprefix("base_model.model.")


def _train(which: str, stage: int) -> tuple[list[float], dict, dict]:
    """On every rank: losses, trained params (whole) and this rank's experts after training."""
    import parallel3d

    config = ep_config(stage, GAS, DP, EP, stage3_param_persistence_threshold=0, reduce_bucket_size=2000)
    engine, _, _, _ = parallel3d.initialize(model=MODELS[which](), config=config)
    data = iter(rank_micro_batches(token_batches(STEPS, GAS, DP), torch.distributed.get_rank()))
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    experts = {n: p for n, p in engine.named_parameters() if ".experts." in n}
    with parallel3d.GatheredParameters(list(experts.values())):
        kept = {n: p.detach().clone() for n, p in experts.items()}
    return losses, engine.full_parameters(), {"ep_rank": engine.ep_info.rank, "experts": kept}


@functools.cache
def _oracle(which: str) -> tuple[list[float], dict, dict]:
    model = MODELS[which]()
    start = {_hf_name(n): p.detach().clone() for n, p in model.named_parameters()}
    losses, params = oracle_run("mixtral", token_batches(STEPS, GAS, DP), model=model)
    trained = {_hf_name(n): params[n] for n, p in model.named_parameters() if p.requires_grad}
    return losses, trained, start


@pytest.mark.parametrize("which,stage", [("frozen_experts", 0), ("frozen_experts", 3), ("lora", 1), ("lora", 3)])
def test_frozen_experts_match_single_process(dist, which, stage):
    want_losses, want_params, start = _oracle(which)
    local = EXPERTS // EP
    for rank, (losses, params, experts) in enumerate(dist.run(DP, _train, which, stage)):
        assert losses == pytest.approx(want_losses, rel=RTOL), f"rank {rank}"
        assert set(params) == set(want_params)
        ratio, name, rel = update_mismatch(params, want_params, start, STEPS, RTOL)
        assert ratio <= 1, f"{name}: update off by {rel:.2e}"
        lo = experts["ep_rank"] * local
        assert experts["experts"], "no expert parameter found"
        for name, value in experts["experts"].items():
            assert torch.equal(value, start[name][lo : lo + local]), f"rank {rank}: {name} is not its own experts"


def _save_16bit(stage: int, path: str) -> None:
    import parallel3d

    config = ep_config(stage, 1, DP, EP, stage3_gather_16bit_weights_on_model_save=True)
    engine = parallel3d.initialize(model=_frozen_experts_model(), config=config)[0]
    engine.save_16bit_model(path)


@pytest.mark.parametrize("stage", [1, 3])
def test_save_16bit_model_writes_every_frozen_expert(dist, tmp_path, stage):
    """save_16bit_model gathers frozen expert weights over the ep group, as full_parameters does the
    trained ones: the state dict is the one-process model's."""
    dist.run(DP, _save_16bit, stage, str(tmp_path))
    saved = torch.load(tmp_path / "pytorch_model.bin")
    want = _frozen_experts_model().state_dict()
    assert set(saved) == set(want)
    for name, value in want.items():
        assert torch.equal(saved[name], value), name
