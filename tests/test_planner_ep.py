"""The planner's model-state bytes under expert parallelism, against ``memory_report()`` to the byte.

With ``expert_parallel.autoep_size`` E a rank holds 1/E of every MoE layer's routed experts,
whose ZeRO units are sharded over the expert-shard group (dp / E ranks) rather than dp; the rest
is as without it. Every layout is initialized for real on CPU/gloo and trained one step; the
planner predicts each rank's report from the model and the layout alone
(``ModelShapes(model, tp, ep=E)``, ``states.model_state_bytes``).
"""

from __future__ import annotations

import pytest

from tests.tiny import rank_micro_batches, token_batches
from tests.tiny_moe import ep_config, make_moe

LAYOUTS = {  # name: (model kind, tp, ep, dp, [(stage, precision)])
    "dp4-ep2": ("mixtral", 1, 2, 4, [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16")]),
    "dp4-ep4": ("qwen3_moe", 1, 4, 4, [(2, "fp32"), (3, "fp32")]),
    "tp2-dp2-ep2": ("qwen3_moe", 2, 2, 2, [(1, "bf16"), (3, "bf16")]),
}
CASES = [(name, stage, precision) for name, layout in LAYOUTS.items() for stage, precision in layout[4]]
ZERO = {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 50}


def measure(name: str) -> list[dict]:
    """On one rank, for each case of the layout: the reports after one step and where the rank sits."""
    import parallel3d

    kind, tp, ep, dp, cases = LAYOUTS[name]
    out = []
    for stage, precision in cases:
        config = ep_config(stage, 2, dp, ep, **ZERO)
        config["bf16"] = {"enabled": precision == "bf16"}
        config["tensor_parallel"] = {"size": tp}
        engine = parallel3d.initialize(model=make_moe(kind), config=config)[0]
        data = iter(rank_micro_batches(token_batches(1, 2, dp), engine.mesh.local_rank("dp")))
        engine.train_batch(data)
        out.append({"report": engine.memory_report(), "experts": engine.memory_report(experts=True),
                    "ranks": {a: engine.mesh.local_rank(a) for a in ("tp", "dp")}})
    return out


_cache: dict = {}


def _results(dist, name: str) -> list[list[dict]]:
    if name not in _cache:
        from parallel3d.planner.inventory import ModelShapes
        from parallel3d.planner.states import ZeroSetup, model_state_bytes, shard_sets

        kind, tp, ep, dp, cases = LAYOUTS[name]
        measured = dist.run(tp * dp, measure, name)
        shapes = ModelShapes(make_moe(kind), tp, ep=ep)
        for i, (stage, precision) in enumerate(cases):
            setup = ZeroSetup(stage, dp, 2 if precision == "bf16" else 4, bucket_size=3000, persistence_threshold=50)
            for rank in measured:
                m = rank[i]
                params = shapes.rank_params(tp_rank=m["ranks"]["tp"], stage3=stage == 3)
                m["predicted"] = model_state_bytes(params, setup, dp_rank=m["ranks"]["dp"])
                m["sets"] = len(shard_sets(params, setup))
        _cache[name] = measured
    return _cache[name]


@pytest.mark.parametrize("name,stage,precision", CASES)
def test_prediction_equals_memory_report_under_expert_parallelism(dist, name, stage, precision):
    index = LAYOUTS[name][4].index((stage, precision))
    for rank, m in enumerate(r[index] for r in _results(dist, name)):
        assert m["sets"] == 2, "the experts are a shard set of their own"
        assert m["predicted"] == m["report"], (rank, m["predicted"], m["report"])


def test_inventory_holds_one_ep_th_of_the_experts():
    """The expert params are 1/E of the stacked weights, kept whole over tp; the rest as without ep."""
    from parallel3d.planner.inventory import ModelShapes

    model = make_moe("qwen3_moe")
    whole = {p.name: p for p in ModelShapes(model, 2).params}
    split = ModelShapes(model, 2, ep=4).params
    experts = [p for p in split if p.expert]
    assert experts and all(".mlp.experts." in p.name for p in experts)
    full = dict(model.named_parameters())
    for p in split:
        if p.expert:
            assert p.numel * 4 == full[p.name].numel() and not p.sharded
        else:
            assert p == whole[p.name]
    assert {p.name for p in split} == set(whole)


def test_ep_must_divide_experts_and_shard_ranks():
    from parallel3d.errors import ConfigError
    from parallel3d.planner.inventory import ModelShapes
    from parallel3d.planner.states import ZeroSetup, shard_sets

    with pytest.raises(ConfigError, match="does not divide the 8 experts"):
        ModelShapes(make_moe("mixtral"), 1, ep=3)
    params = ModelShapes(make_moe("mixtral"), 1, ep=4).rank_params()
    with pytest.raises(ConfigError, match="does not divide the 2 ranks"):
        shard_sets(params, ZeroSetup(1, 2))
