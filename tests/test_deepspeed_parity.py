"""The same model, data and DeepSpeed config through DeepSpeed and through Zero3D, stage by stage."""

from __future__ import annotations

import pytest
import torch

from tests.test_zero_parity import GAS, RTOL, STEPS, train_ranks
from tests.tiny import ds_config, make_model, max_rel_param_error, rank_micro_batches, token_batches

DP = 2


def deepspeed_ranks(kind: str, stage: int) -> tuple[list[float], dict]:
    from tests.ds_oracle import deepspeed_losses

    config = ds_config(stage, GAS, DP)
    batches = rank_micro_batches(token_batches(STEPS, GAS, DP), torch.distributed.get_rank())
    return deepspeed_losses(make_model(kind), config, batches, return_params=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_matches_deepspeed(dist, kind, stage):
    extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    ours = dist.run(DP, train_ranks, kind, stage, DP, extra)
    theirs = dist.run(DP, deepspeed_ranks, kind, stage)
    for (our_losses, our_params), (ds_losses, ds_params) in zip(ours, theirs):
        assert our_losses == pytest.approx(ds_losses, rel=RTOL)
        # DeepSpeed lists a tied weight once; compare the params it reports.
        err, name = max_rel_param_error({n: our_params[n] for n in ds_params}, ds_params)
        assert err < RTOL, f"{name} differs from DeepSpeed by {err:.2e}"
