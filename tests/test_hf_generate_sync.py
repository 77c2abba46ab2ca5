"""``parallel3d.hf.Trainer.generate`` on ranks whose sequences end at different lengths.

A forward can be a collective: expert parallelism's all-to-all in every MoE layer, and at ZeRO
stage 3 the first forward's order check (one all-reduce per block). A rank whose prompt reaches
EOS at once would stop calling the model while its peer waits in that collective; generate keeps
the ranks in step (``synced_gpus``). Each rank's tokens must be those of the plain model.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.tiny import VOCAB, make_model
from tests.tiny_moe import ep_config, make_moe

DP = 2
NEW = 6


def build(kind: str):
    return make_moe("mixtral") if kind == "mixtral" else make_model("llama")


def prompts() -> torch.Tensor:
    return torch.randint(0, VOCAB, (DP, 1, 6), generator=torch.Generator().manual_seed(7))


def plain_generate(kind: str, eos: int | None) -> list[torch.Tensor]:
    model = build(kind).eval()
    with torch.no_grad():
        return [model.generate(input_ids=p, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
                for p in prompts()]


def first_token(kind: str, rank: int) -> int:
    model = build(kind).eval()
    with torch.no_grad():
        return int(model(input_ids=prompts()[rank]).logits[0, -1].argmax())


def engine_generate(kind: str, config: dict, eos: int | None) -> torch.Tensor:
    import torch.distributed

    import parallel3d
    from parallel3d.hf.trainer import Zero3DTrainerMixin

    engine = parallel3d.initialize(model=build(kind), config=config)[0]
    prompt = prompts()[torch.distributed.get_rank()]
    return Zero3DTrainerMixin.generate(types.SimpleNamespace(engine=engine), input_ids=prompt, max_new_tokens=NEW,
                                       do_sample=False, eos_token_id=eos, pad_token_id=0)


NOT_PERSISTENT = {"stage3_param_persistence_threshold": 0}  # every block gathered around its forward


@pytest.mark.parametrize("kind, config", [("mixtral", ep_config(3, 1, DP, 2, **NOT_PERSISTENT)),
                                          ("mixtral", ep_config(1, 1, DP, 2)),
                                          ("llama", ep_config(3, 1, DP, 1, **NOT_PERSISTENT))],
                         ids=["ep2_zero3", "ep2_zero1", "zero3"])
def test_ranks_stopping_at_different_lengths(dist, kind, config):
    eos = first_token(kind, 0)  # rank 0 stops after one token, rank 1 (another prompt) runs on
    assert first_token(kind, 1) != eos
    want = plain_generate(kind, eos)
    got = dist.run(DP, engine_generate, kind, config, eos, timeout=120)
    assert [g.shape[1] for g in got] == [7, 6 + NEW]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
