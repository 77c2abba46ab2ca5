"""The planner's model-state bytes under expert parallelism, against ``memory_report()`` to the byte.

With ``expert_parallel.autoep_size`` E a rank holds 1/E of every MoE layer's routed experts,
whose ZeRO units are sharded over the expert-shard group (dp / E ranks) rather than dp; the rest
is as without it. Every layout is initialized for real on CPU/gloo and trained one step; the
planner predicts each rank's report from the model and the layout alone
(``ModelShapes(model, tp, ep=E)``, ``states.model_state_bytes``).
"""

from __future__ import annotations

from dataclasses import replace

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


def test_search_prices_tp_with_whole_experts(dist):
    """At tp 2 x dp 2 x ep 2 the planner's own prediction (tp rank 0, dp rank 0) holds the engine's model
    states to the byte, and its profile keeps the experts whole on the tp rank, as the engine does."""
    import torch

    from parallel3d.planner.hardware import a100
    from parallel3d.planner.predict import Layout, Planner, Workload

    kind, tp, ep, dp, cases = LAYOUTS["tp2-dp2-ep2"]
    measured = _results(dist, "tp2-dp2-ep2")
    for i, (stage, precision) in enumerate(cases):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        planner = Planner(make_moe(kind), Workload(seq=16, global_batch=8, dtype=dtype, bucket_size=3000,
                                                   persistence_threshold=50))
        first = next(r[i] for r in measured if r[i]["ranks"] == {"tp": 0, "dp": 0})
        assert planner.predict(Layout(1, dp, tp, stage, 2, ep=ep), a100(1, 4)).ranks[0].states == first["report"]
    keys = planner.profile_keys(Layout(1, dp, tp, 1, 2, ep=ep), a100(1, 4), False)
    assert keys and all(key[8] for key in keys)  # experts whole (key: ..., split, whole_experts, cp, cp_method)
    key = ("only", 1, 1, tp, False, False, a100(1, 4).attention, False)
    whole, split = planner._profile(*key, True, 1, "ulysses"), planner._profile(*key, False, 1, "ulysses")
    # one block, 16 tokens x top 2 rows through gate_up (h -> 2i) and down (i -> h): split over tp, or whole
    rows, hidden, inter = 16 * 2, planner.model.config.hidden_size, planner.model.config.moe_intermediate_size
    assert whole.flops[0] - split.flops[0] == (1 - 1 / tp) * 2 * rows * 3 * hidden * inter


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


def _planner(kind: str = "mixtral"):
    from parallel3d.planner.predict import Planner, Workload

    return Planner(make_moe(kind), Workload(seq=16, global_batch=8))


def test_all_to_all_adds_to_each_pass():
    """Per MoE layer and micro-batch: dispatch and combine in the forward, the same in the backward, each
    tokens x top_k x hidden x work bytes, (E-1)/E of it leaving the rank over the ep group's link."""
    from parallel3d.planner.hardware import a100
    from parallel3d.planner.predict import Layout

    planner, hw = _planner(), a100(8, 8)
    base = Layout(1, 8, 1, 1, 1)
    for ep in (2, 4, 8):
        with_ep = Layout(1, 8, 1, 1, 1, ep=ep)
        parts, _ = planner.step_time(with_ep, hw)
        without, _ = planner.step_time(base, hw)
        payload = 1 * 16 * 2 * 32 * 2  # micro-batch x seq x top_k x hidden x bf16
        one = (ep - 1) * hw.nvlink.latency + payload * (ep - 1) / ep / hw.nvlink.bandwidth
        microbatches, layers = 8 // 8, 2
        assert parts["pipeline"] - without["pipeline"] == pytest.approx(microbatches * 2 * 2 * layers * one, rel=1e-12)
        # at stage 1 a rank holds every parameter it trains: without the other ranks' experts under ep
        held = planner.predict(base, hw).ranks[0].states["params"] - planner.predict(with_ep, hw).ranks[0].states["params"]
        experts = sum(p.numel() for n, p in planner.model.named_parameters() if ".mlp.experts." in n)
        assert held == pytest.approx(2 * experts * (1 - 1 / ep), rel=1e-3)


def test_search_tries_expert_parallel_sizes_and_the_snippet_names_them():
    from parallel3d.planner.hardware import a100
    from parallel3d.planner.report import layout_config
    from parallel3d.planner.search import Choice, candidates

    pinned = dict(tp=1, pp=1, micro_batch=1, zero_stage=3, checkpointing=False, hybrid_sharding=False)
    planner = _planner()
    assert sorted({c.ep for c in candidates(planner, a100(8, 8), Choice(**pinned))}) == [1, 2, 4, 8]
    assert sorted({c.ep for c in candidates(planner, a100(4, 8), Choice(**pinned))}) == [1, 2, 4]
    assert sorted({c.ep for c in candidates(planner, a100(8, 8), Choice(**{**pinned, "tp": 2}))}) == [1, 2, 4]
    refused: dict = {}
    assert not list(candidates(planner, a100(8, 8), Choice(**pinned, ep=3), refused))
    assert any("does not divide the 8 experts" in reason for reason in refused)
    layout = next(iter(candidates(planner, a100(8, 8), Choice(**pinned, ep=4))))
    assert "ep4" in layout.describe().split()
    assert layout_config(layout, 8, "bf16")["expert_parallel"] == {"enabled": True, "autoep_size": 4}
    assert "expert_parallel" not in layout_config(replace(layout, ep=1), 8, "bf16")


def test_dense_model_gets_no_expert_parallel_sizes():
    from parallel3d.planner.hardware import a100
    from parallel3d.planner.predict import Planner, Workload
    from parallel3d.planner.search import Choice, candidates
    from tests.tiny import make_model

    planner = Planner(make_model("llama"), Workload(seq=16, global_batch=8))
    pinned = dict(tp=1, pp=1, micro_batch=1, zero_stage=3, checkpointing=False, hybrid_sharding=False)
    assert {c.ep for c in candidates(planner, a100(8, 8), Choice(**pinned))} == {1}
    refused: dict = {}
    assert not list(candidates(planner, a100(8, 8), Choice(**pinned, ep=2), refused))
    assert any("base_model_ep_plan" in reason for reason in refused)
