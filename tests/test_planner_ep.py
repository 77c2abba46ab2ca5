"""The planner's model-state bytes under expert parallelism, against ``memory_report()`` to the byte.

With ``expert_parallel.autoep_size`` E a rank holds 1/E of every MoE layer's routed experts,
whose ZeRO units are sharded over the expert-shard group (dp / E ranks) rather than dp; the rest
is as without it; with expert tensor parallelism (``expert_tensor_parallel_size`` = tp) each
expert is also split over the tp ranks, 1/(E x tp) of it on a rank. Every layout is initialized
for real on CPU/gloo and trained one step; the planner predicts each rank's report from the model
and the layout alone
(``ModelShapes(model, tp, ep=E, etp=T)``, ``states.model_state_bytes``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.tiny import rank_micro_batches, token_batches
from tests.tiny_moe import ep_config, make_moe

LAYOUTS = {  # name: (model kind, tp, ep, dp, [(stage, precision)], expert_tensor_parallel_size)
    "dp4-ep2": ("mixtral", 1, 2, 4, [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16")], 1),
    "dp4-ep4": ("qwen3_moe", 1, 4, 4, [(2, "fp32"), (3, "fp32")], 1),
    "tp2-dp2-ep2": ("qwen3_moe", 2, 2, 2, [(1, "bf16"), (3, "bf16")], 1),
    "tp2-dp2-ep2-etp2": ("mixtral", 2, 2, 2, [(1, "bf16"), (3, "bf16")], 2),
}
CASES = [(name, stage, precision) for name, layout in LAYOUTS.items() for stage, precision in layout[4]]
ZERO = {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 50}


def measure(name: str) -> list[dict]:
    """On one rank, for each case of the layout: the reports after one step and where the rank sits."""
    import parallel3d

    kind, tp, ep, dp, cases, etp = LAYOUTS[name]
    out = []
    for stage, precision in cases:
        config = ep_config(stage, 2, dp, ep, **ZERO)
        config["bf16"] = {"enabled": precision == "bf16"}
        config["tensor_parallel"] = {"size": tp}
        config["expert_parallel"]["expert_tensor_parallel_size"] = etp
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

        kind, tp, ep, dp, cases, etp = LAYOUTS[name]
        measured = dist.run(tp * dp, measure, name)
        shapes = ModelShapes(make_moe(kind), tp, ep=ep, etp=etp)
        for i, (stage, precision) in enumerate(cases):
            setup = ZeroSetup(stage, dp, 2 if precision == "bf16" else 4, bucket_size=3000, persistence_threshold=50)
            for rank in measured:
                m = rank[i]
                params = shapes.rank_params(tp_rank=m["ranks"]["tp"], stage3=stage == 3)
                m["predicted"] = model_state_bytes(params, setup, dp_rank=m["ranks"]["dp"])
                m["predicted_expert_params"] = sum(p.numel for g in params.groups for p in g if p.expert) * 2
                m["sets"] = len(shard_sets(params, setup))
        _cache[name] = measured
    return _cache[name]


@pytest.mark.parametrize("name,stage,precision", CASES)
def test_prediction_equals_memory_report_under_expert_parallelism(dist, name, stage, precision):
    index = LAYOUTS[name][4].index((stage, precision))
    for rank, m in enumerate(r[index] for r in _results(dist, name)):
        assert m["sets"] == 2, "the experts are a shard set of their own"
        assert m["predicted"] == m["report"], (rank, m["predicted"], m["report"])


def test_expert_tensor_parallel_holds_one_tp_th_of_each_expert(dist):
    """At tp 2 x dp 2 x ep 2 with expert_tensor_parallel_size 2 (ZeRO 1, bf16) a rank's expert params in
    ``memory_report(experts=True)`` are 1/(E x tp) of the model's experts, as the planner's inventory says."""
    kind, tp, ep, dp, cases, etp = LAYOUTS["tp2-dp2-ep2-etp2"]
    experts = sum(p.numel() for n, p in make_moe(kind).named_parameters() if ".mlp.experts." in n)
    for m in (r[cases.index((1, "bf16"))] for r in _results(dist, "tp2-dp2-ep2-etp2")):
        assert m["experts"]["params"] == 2 * experts // (ep * tp) == m["predicted_expert_params"]


def test_search_prices_tp_with_whole_experts(dist):
    """At tp 2 x dp 2 x ep 2 the planner's own prediction (tp rank 0, dp rank 0) holds the engine's model
    states to the byte, and its profile keeps the experts whole on the tp rank, as the engine does."""
    import torch

    from parallel3d.planner.hardware import a100
    from parallel3d.planner.predict import Layout, Planner, Workload

    kind, tp, ep, dp, cases, _ = LAYOUTS["tp2-dp2-ep2"]
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


def test_search_prices_expert_tensor_parallelism(dist):
    """At tp 2 x dp 2 x ep 2 with expert_tensor_parallel_size 2 the planner's own prediction (tp rank 0,
    dp rank 0) holds the engine's model states to the byte, and its profile is tp's own (experts split)."""
    import torch

    from parallel3d.planner.hardware import a100
    from parallel3d.planner.predict import Layout, Planner, Workload

    kind, tp, ep, dp, cases, etp = LAYOUTS["tp2-dp2-ep2-etp2"]
    measured = _results(dist, "tp2-dp2-ep2-etp2")
    planner = Planner(make_moe(kind), Workload(seq=16, global_batch=8, dtype=torch.bfloat16, bucket_size=3000,
                                               persistence_threshold=50))
    for i, (stage, _) in enumerate(cases):
        first = next(r[i] for r in measured if r[i]["ranks"] == {"tp": 0, "dp": 0})
        layout = Layout(1, dp, tp, stage, 2, ep=ep, etp=etp)
        assert planner.predict(layout, a100(1, 4)).ranks[0].states == first["report"]
    keys = planner.profile_keys(layout, a100(1, 4), False)
    assert keys and not any(key[8] for key in keys)  # experts split over tp, as without expert parallelism
    assert keys == planner.profile_keys(replace(layout, ep=1, etp=1), a100(1, 4), False)


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


def _etp_rows(memory: float | None = None):
    """The search's rows for a tiny Mixtral at pp 1 x dp 2 x tp 2 x ep 2, ZeRO 1, micro-batch 2, both
    expert tensor parallel sizes, on 4 A100s (``memory`` bytes each, if given)."""
    from parallel3d.planner.hardware import a100
    from parallel3d.planner.search import Choice, search

    planner, hw = _planner(), a100(4, 4)
    if memory is not None:
        hw = hw.with_devices(4, memory=memory)
    choice = Choice(tp=2, pp=1, zero_stage=1, micro_batch=2, checkpointing=False, sequence_parallel=False, ep=2,
                    hybrid_sharding=False, zeropp=False)
    return planner, hw, search(planner, hw, choice).best


def test_plan_splits_experts_over_tp_where_whole_ones_do_not_fit():
    """With room for the experts split over tp and not for them whole, the plan is etp 2."""
    planner, hw, rows = _etp_rows()
    assert sorted(p.layout.etp for p in rows) == [1, 2]
    peak = {p.layout.etp: p.peak for p in rows}
    assert peak[2] < peak[1]
    planner, hw, rows = _etp_rows((peak[1] + peak[2]) / 2)
    assert [p.layout.etp for p in rows] == [2]


def test_plan_keeps_experts_whole_where_tp_communication_dominates():
    """Where both fit and the experts' compute is tiny, splitting them saves less than the all-reduce
    it adds to every MoE layer's forward and backward: the plan is etp 1, etp 2 second."""
    planner, hw, rows = _etp_rows()
    assert [p.layout.etp for p in rows] == [1, 2]
    # one block, one micro-batch: whole experts compute more and all-reduce less over tp
    whole, split = (planner._profile(*planner.chunk_keys(p.layout, "only", hw)[0]) for p in rows)
    assert sum(whole.flops) > sum(split.flops) and len(whole.comm) < len(split.comm)


def test_search_tries_both_expert_tensor_parallel_sizes_and_the_snippet_names_them():
    from parallel3d.planner.hardware import a100
    from parallel3d.planner.report import layout_config
    from parallel3d.planner.search import Choice, candidates

    pinned = dict(pp=1, micro_batch=1, zero_stage=3, checkpointing=False, hybrid_sharding=False,
                  sequence_parallel=False)
    planner, hw = _planner(), a100(8, 8)
    both = {(c.ep, c.etp) for c in candidates(planner, hw, Choice(tp=2, **pinned))}
    assert both == {(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)}
    assert {c.etp for c in candidates(planner, hw, Choice(tp=1, **pinned))} == {1}
    refused: dict = {}
    assert not list(candidates(planner, hw, Choice(tp=4, ep=2, etp=2, **pinned), refused))
    assert any("expert_tensor_parallel_size 2 with tensor_parallel.size 4: allowed: 1 or 4" in r for r in refused)
    layout = next(iter(candidates(planner, hw, Choice(tp=2, ep=2, etp=2, **pinned))))
    assert layout.describe().split()[3:5] == ["ep2", "etp2"]
    assert layout_config(layout, 8, "bf16")["expert_parallel"] == {"enabled": True, "autoep_size": 2,
                                                                   "expert_tensor_parallel_size": 2}
    assert "expert_tensor_parallel_size" not in layout_config(replace(layout, etp=1), 8, "bf16")["expert_parallel"]


def test_cli_pins_expert_tensor_parallelism():
    """``zero3d plan --ep 2 --etp 2`` pins both sizes in the search's Choice; a non-positive --etp is refused, and
    so is one the search would ignore (it priced no expert tensor parallelism, silently) or cannot meet."""
    from parallel3d.errors import ConfigError
    from parallel3d.planner.cli import _choice, build_parser

    args = build_parser().parse_args(["model", "--gpus", "4", "--seq-len", "16", "--global-batch", "8",
                                      "--ep", "2", "--etp", "2"])
    assert (_choice(args).ep, _choice(args).etp) == (2, 2)
    base = ["model", "--gpus", "4", "--seq-len", "16", "--global-batch", "8"]
    with pytest.raises(ConfigError, match="--etp"):
        _choice(build_parser().parse_args([*base, "--etp", "0"]))
    # pins the search would ignore (no expert parallelism or no tp to split over), or cannot meet
    for pins, message in ((["--ep", "1", "--etp", "2"], "needs --ep > 1 and --tp > 1"),
                          (["--tp", "1", "--etp", "2"], "needs --ep > 1 and --tp > 1"),
                          (["--tp", "2", "--ep", "1", "--etp", "1"], "needs --ep > 1 "),
                          (["--tp", "4", "--ep", "2", "--etp", "2"], "allowed: 1 or 4")):
        with pytest.raises(ConfigError, match=message):
            _choice(build_parser().parse_args([*base, *pins]))


def test_auto_tp_returns_the_expert_tensor_parallel_size_it_priced():
    """tensor_parallel.size "auto" under expert_tensor_parallel_size 2: on 2 ranks with ep 2 only tp 1 leaves
    ZeRO two ranks to fold the experts over, so the planner picks tp 1 with whole experts, and the config it
    returns says so (it kept the 2, which the engine refuses at tp 1)."""
    import torch

    from parallel3d.config.config import load_config
    from parallel3d.planner.auto import resolve_auto

    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"size": "auto"},
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "expert_parallel": {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2},
              "planner": {"seq_length": 16, "device_memory": "2000MB"}}
    resolved = resolve_auto(config, make_moe("mixtral"), 2, torch.device("cpu"))
    assert resolved["tensor_parallel"]["size"] == 1
    assert resolved["expert_parallel"]["expert_tensor_parallel_size"] == 1
    assert load_config(resolved, 2).expert_parallel.size == 2



AUTO_ETP = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"size": "auto"},
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "expert_parallel": {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2},
            "planner": {"seq_length": 16, "device_memory": "450kB"}}
"""tp "auto" on 4 ranks, ep 2, etp 2, with room per device for the experts split over tp and not for them
whole (predicted: tp 1 513,076 bytes, tp 2 387,292)."""


def _planner_inputs(planner, hw, choice) -> tuple:
    return planner.workload, type(planner.model), planner.config.to_dict(), hw, choice


def _search_here(world: int) -> tuple:
    """resolve_auto's search for AUTO_ETP on ``world`` ranks, run in this process: (its inputs, its answer)."""
    import torch

    from parallel3d.planner import auto

    original, calls = auto.choose, []

    def recorded(planner, hw, choice):
        answer = original(planner, hw, choice)
        calls.append((_planner_inputs(planner, hw, choice), answer))
        return answer

    auto.choose = recorded
    try:
        auto.resolve_auto(AUTO_ETP, make_moe("mixtral"), world, torch.device("cpu"))
    finally:
        auto.choose = original
    (searched,) = calls
    return searched


def _auto_etp_step(searched: tuple) -> dict:
    """initialize the tiny Mixtral with AUTO_ETP on this rank, its search answered by ``searched`` when asked
    the same question, and train one step."""
    import math

    import parallel3d
    from parallel3d.planner import auto

    inputs, answer = searched
    asked = []

    def replay(planner, hw, choice):
        asked.append(_planner_inputs(planner, hw, choice) == inputs)
        return answer

    original, auto.choose = auto.choose, replay
    try:
        engine = parallel3d.initialize(model=make_moe("mixtral"), config=AUTO_ETP)[0]
    finally:
        auto.choose = original
    cfg = engine.config
    data = iter(rank_micro_batches(token_batches(1, cfg.gradient_accumulation_steps, 2), engine.mesh.local_rank("dp")))
    loss = float(engine.train_batch(data))
    assert math.isfinite(loss)
    return {"asked": asked, "loss": loss,
            "layout": (engine.mesh.tp, engine.ep_info.size, cfg.expert_parallel.expert_tensor_parallel_size,
                       cfg.gradient_accumulation_steps),
            "experts": {n: tuple(p.shape) for n, p in engine.named_parameters() if ".experts." in n}}


def test_auto_tp_picks_expert_tensor_parallelism_and_trains(dist, monkeypatch):
    """tensor_parallel.size "auto" with expert_tensor_parallel_size 2 (AUTO_ETP): initialize takes tp 2 with
    etp 2 and trains a step, each rank holding its half of the experts, each cut in half over tp. Each rank's
    search (a child process per rank, ~6 s CPU each: test_planner_cli's auto test runs those) is answered by
    the one this process ran, after checking that the rank asked it the same question."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # as on the ranks (one node): the workload's gpus_per_node
    searched = _search_here(4)
    assert searched[1][0].layout.describe().split()[:5] == ["pp1", "dp2", "tp2", "ep2", "etp2"]
    results = dist.run(4, _auto_etp_step, searched)
    full = {n: tuple(p.shape) for n, p in make_moe("mixtral").named_parameters() if ".experts." in n}
    for r in results:
        assert r["asked"] == [True]
        assert r["layout"] == (2, 2, 2, 2)  # tp, ep, etp, accumulation (dp 2)
        assert r["experts"] == {n: (s[0] // 2, s[1] // 2, s[2]) if n.endswith("gate_up_proj") else (s[0] // 2, s[1], s[2] // 2)
                                for n, s in full.items()}
        assert r["loss"] == results[0]["loss"]
