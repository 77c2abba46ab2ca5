"""Expert weights through the whole-parameter accessors under expert parallelism (issue 31).

``GatheredParameters(modifier_rank=r)``: each expert slice keeps the value of the rank holding it
in ``r``'s ep group, also where ``r`` is in another ep block or another hybrid-sharding replica
than rank 0. ``safe_set_full_grad`` takes one process's gradient: writing back what
``safe_get_full_grad`` read leaves the step's gradient norm at one process's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed

from tests.test_expert_parallel import _oracle_gradients
from tests.tiny import token_batches
from tests.tiny_moe import EXPERTS, ep_config, make_moe

DP, EP = 4, 2
NAME = "model.layers.0.mlp.experts.down_proj"


def _modify_experts(modifier: int, zero: dict) -> torch.Tensor:
    import parallel3d

    config = ep_config(3, 1, DP, EP, stage3_param_persistence_threshold=0, **zero)
    engine = parallel3d.initialize(model=make_moe("mixtral"), config=config)[0]
    param = dict(engine.module.named_parameters())[NAME]
    with parallel3d.GatheredParameters([param], modifier_rank=modifier):
        param.data.fill_(10.0 * torch.distributed.get_rank() + 1)
    return engine.full_parameters()[NAME]


@pytest.mark.parametrize("modifier,zero", [(2, {}), (3, {"mics_shard_size": 2})], ids=["second-block", "hybrid"])
def test_modifier_rank_keeps_its_ep_groups_experts(dist, modifier, zero):
    """Rank ``modifier``'s ep group is ranks {2, 3} (dp 4, ep 2; under hybrid sharding the second
    replica): experts 0-3 take rank 2's value, 4-7 rank 3's, on every rank."""
    local = EXPERTS // EP
    for rank, full in enumerate(dist.run(DP, _modify_experts, modifier, zero)):
        assert torch.equal(full[:local], torch.full_like(full[:local], 21.0)), f"rank {rank}"
        assert torch.equal(full[local:], torch.full_like(full[local:], 31.0)), f"rank {rank}"


def _write_back_gradients(stage: int) -> dict:
    """Read every expert weight's full gradient, write it back doubled and halved again (two writes),
    and step: the step's gradient norm, and what was read after the writes."""
    import parallel3d

    config = ep_config(stage, 1, DP, EP, reduce_bucket_size=2000, stage3_param_persistence_threshold=0)
    engine = parallel3d.initialize(model=make_moe("mixtral", experts_implementation="eager"), config=config)[0]
    ids = token_batches(1, 1, DP)[0, 0][torch.distributed.get_rank()]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    experts = {n: p for n, p in engine.module.named_parameters() if ".experts." in n}
    read = {}
    for name, p in experts.items():
        grad = parallel3d.safe_get_full_grad(p)
        parallel3d.safe_set_full_grad(p, 2 * grad)
        parallel3d.safe_set_full_grad(p, parallel3d.safe_get_full_grad(p) / 2)
        read[name] = parallel3d.safe_get_full_grad(p)
    engine.step()
    return {"ep_rank": engine.ep_info.rank, "norm": engine.get_global_grad_norm(), "read": read}


@pytest.mark.parametrize("stage", [1, 3])
def test_full_gradient_written_back_keeps_one_process_norm(dist, stage):
    want = _oracle_gradients("mixtral", False)
    mean = {n: sum(w["grads"][n] for w in want) / DP for n in want[0]["grads"]}
    norm = torch.sqrt(sum(g.pow(2).sum() for g in mean.values())).item()
    local = EXPERTS // EP
    for got in dist.run(DP, _write_back_gradients, stage):
        assert got["norm"] == pytest.approx(norm, rel=1e-5)
        lo = got["ep_rank"] * local
        for name, grad in got["read"].items():
            expected = mean[name][lo : lo + local]
            assert ((grad.double() - expected).norm() / expected.norm()).item() < 1e-5, name
