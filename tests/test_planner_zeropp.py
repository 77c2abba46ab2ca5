"""The planner prices ZeRO++: int8 gathers and reductions (qwZ, qgZ in two hops across nodes) and
hpZ's backward gathers inside a node, in time and memory, and offers it where it is faster."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from parallel3d.planner.hardware import Link, a100
from parallel3d.planner.memory import gathered
from parallel3d.planner.predict import Layout, Planner, Workload
from parallel3d.planner.search import Choice, search
from parallel3d.planner.states import padded, units
from parallel3d.planner.timing import _collective_seconds, int8_bytes, zero_links

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2)
WORKLOAD = Workload(seq=64, global_batch=32, dtype=torch.bfloat16, persistence_threshold=0)


def _planner(workload: Workload = WORKLOAD) -> Planner:
    with torch.device("meta"):
        return Planner(LlamaForCausalLM(CONFIG), workload)


def test_int8_bytes_are_the_wire_format():
    from zero.quantized_comm import quantize

    for n in (1, 256, 300, 1024):
        values, scales = quantize(torch.randn(n))
        assert int8_bytes(n) == values.numel() * values.element_size() + scales.numel() * scales.element_size()


def test_zeropp_moves_int8_across_nodes_and_backward_gathers_inside_one():
    planner, hw = _planner(), a100(16, 8)
    layout = Layout(pp=1, dp=16, tp=1, zero_stage=3, micro_batch=1)
    plain, zpp = planner.zero(layout), planner.zero(replace(layout, zeropp=8))
    assert (zpp.quantized_weights, zpp.quantized_gradients, zpp.hpz, zpp.node) == (True, True, 8, 8)
    params = planner.shapes(1).rank_params(stage3=True)
    links = zero_links(hw, 1, zpp)
    assert links.shard == hw.link(1, 16)
    assert links.hpz == hw.nvlink and links.node == hw.nvlink and links.across == hw.link(8, 2)
    got = _collective_seconds(params, zpp, links)
    before = _collective_seconds(params, plain, zero_links(hw, 1, plain))
    plan = units(params, zpp)
    sharded = [u for u in plan if not u.persistent]
    assert got["gather sharded"] == pytest.approx(
        sum(links.shard.seconds("all_gather", int8_bytes(padded(u, zpp)), 16) for u in sharded))
    assert got["gather blocks back"] < before["gather blocks"]  # inside the node, over NVLink
    two_hops = sum(hw.nvlink.seconds("reduce_scatter", int8_bytes(padded(u, zpp)), 8)
                   + hw.link(8, 2).seconds("reduce_scatter", int8_bytes(padded(u, zpp) // 8), 2) for u in plan)
    assert got["reduce_scatter"] == pytest.approx(two_hops)
    assert got["reduce_scatter"] < before["reduce_scatter"]
    # hpZ's copies: 1/8 of the blocks' gathered bytes, held with the root units
    extra = gathered(params, zpp, prefetch=0, max_live=10**12)[0] - gathered(params, plain, prefetch=0, max_live=10**12)[0]
    block_bytes = sum(padded(u, zpp) for u in sharded if u.module is not None and not u.root)
    assert extra == 2 * (block_bytes // 8)


def test_the_search_offers_zeropp_only_where_faster_than_its_twin():
    slow = replace(a100(16, 8), network=Link(1e9, 10e-6))
    choice = Choice(tp=1, pp=1, zero_stage=3, micro_batch=1, checkpointing=False)
    with_zpp = search(_planner(), slow, choice, top=8).best
    assert any(p.layout.zeropp == 8 for p in with_zpp)
    twins = {p.layout: p.step_seconds for p in search(_planner(), slow, replace(choice, zeropp=False), top=40).best}
    for p in with_zpp:
        if p.layout.zeropp:
            assert p.step_seconds < twins[replace(p.layout, zeropp=0)]
    assert not any(p.layout.zeropp for p in search(_planner(), slow, replace(choice, zeropp=False), top=8).best)


def test_a_workload_with_zeropp_keys_is_priced_at_the_stages_that_take_them():
    from parallel3d.errors import ConfigError

    planner = _planner(replace(WORKLOAD, quantized_weights=True, quantized_gradients=True, hpz=2, gpus_per_node=4))
    layout = Layout(pp=1, dp=8, tp=1, zero_stage=3, micro_batch=1)
    zero = planner.zero(layout)
    assert (zero.quantized_weights, zero.quantized_gradients, zero.hpz, zero.node) == (True, True, 2, 4)
    with pytest.raises(ConfigError, match="need ZeRO stage 3"):
        planner.check(replace(layout, zero_stage=2))
