"""The search's shortcuts give what pricing every layout gives, and its fake process group stays its own.

* The first pass walks the memory of the fastest layouts only (`search._fastest_that_fit`): the
  same list as predicting every layout and sorting by (step, peak), ties and layouts that do
  not fit included, and the same plan.
* It prices a layout only when its lower bound (`bound.step_floor`) says it could rank: the bound
  is never above the step, nor is a ZB-H1 layout's second bound from its one-backward passes
  (`bound.split_floor`, where GPT-2's LayerNorm runs its backward twice), on every candidate of
  several families (tied heads, GPT-2's Conv1D, experts under expert parallelism, softcapping), and a compute-bound model's first pass never
  profiles recomputation, which cannot rank there, yet gives the same list as pricing everything.
* Tensor parallelism is priced with the engine's ``apply_tensor_parallel`` on a fake default
  process group (`planner.fake_tp`): none is left behind, none is made beside an existing
  group, and ``"auto"``'s choice in a process with a group (planned in a child process) is the
  one planned in a process without.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config, LlamaConfig, LlamaForCausalLM, MixtralConfig

from parallel3d.planner.fake_tp import fake_tp_group
from parallel3d.pipeline.schedules import has_weight_pass
from parallel3d.planner.bound import split_floor, step_floor
from parallel3d.planner.hardware import a100
from parallel3d.planner.predict import Planner, Workload
from parallel3d.planner.profile import profile_pass
from parallel3d.planner.search import Choice, _fastest_that_fit, candidates, model_states_fit, search

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2)
WORKLOAD = Workload(seq=64, global_batch=16, dtype=torch.bfloat16)
CHOICE = Choice(tp=2, micro_batch=2, checkpointing=False, sequence_parallel=False)  # pp 1, 2, 4; stages 0-3


def _planner() -> Planner:
    with torch.device("meta"):
        return Planner(LlamaForCausalLM(CONFIG), WORKLOAD)


def _row(p) -> tuple:
    return p.layout, p.step_seconds, p.peak


def test_the_first_pass_walks_only_the_fastest_and_gives_every_layouts_order():
    planner = _planner()
    layouts = list(candidates(planner, a100(8, 8), CHOICE))
    every = [planner.predict(layout, a100(8, 8), exact=False) for layout in layouts]
    # memory that only part of the layouts fit: the median predicted peak
    hw = replace(a100(8, 8), memory=float(sorted(p.peak for p in every)[len(every) // 2]))
    assert all(model_states_fit(planner, layout, hw) for layout in layouts)
    fitting = sorted((p for p in every if p.fits(hw.memory)), key=lambda p: (p.step_seconds, p.peak))
    assert 0 < len(fitting) < len(every)
    for count in (1, 3, 7, len(fitting) + 5):
        got = _fastest_that_fit(planner, hw, layouts, count, {})
        assert [_row(p) for p in got] == [_row(p) for p in fitting[:count]]
    exact = sorted((p for p in (planner.predict(p.layout, hw) for p in fitting[:9]) if p.fits(hw.memory)),
                   key=lambda p: (p.step_seconds, p.peak))
    assert [_row(p) for p in search(_planner(), hw, CHOICE, top=3).best] == [_row(p) for p in exact[:3]]


def test_a_compute_bound_model_profiles_only_the_settings_that_can_rank():
    """A 7B-wide Llama (fake tensors: the size costs nothing) on two devices: recomputation adds a
    third to each step, so its bound is above the fastest steps and its passes are never profiled;
    nor are ZB-H1's split-backward passes, whose second bound (its pipeline of two stages priced from
    one-backward passes) is above them too; the first pass's list is still the sort of every layout's step."""
    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=32)
    with torch.device("meta"):
        planner = Planner(LlamaForCausalLM(config), Workload(seq=4096, global_batch=8, dtype=torch.bfloat16))
    hw = a100(2, 2)
    layouts = list(candidates(planner, hw, Choice(max_micro_batch=2)))
    got = _fastest_that_fit(planner, hw, layouts, 3, {})
    assert not any(key[5] or key[7] for key in planner._profiles)  # no checkpointing nor split-backward pass
    assert any(layout.checkpointing for layout in layouts) and any(layout.schedule == "zb_h1" for layout in layouts)
    steps = {layout: sum(planner.step_time(layout, hw, exact=False)[0].values()) for layout in layouts}
    assert [p.layout for p in got] == sorted(layouts, key=lambda layout: steps[layout])[:3]
    assert all(step_floor(planner, layout, hw) <= steps[layout] for layout in layouts)


@pytest.mark.parametrize("config, choice", [
    (GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4),  # pipeline chunks, split backward
     Choice(tp=2, pp=2, zero_stage=1, micro_batch=2, sequence_parallel=False)),
    (MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),  # experts whole or split
     Choice(tp=2, pp=1, zero_stage=1, micro_batch=2, ep=2)),
    (Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),  # tied head, softcapping, sequence parallelism
     Choice(tp=2, pp=1, zero_stage=1, micro_batch=2)),
], ids=["gpt2", "mixtral", "gemma2"])
def test_the_bound_is_never_above_the_step(config, choice):
    with torch.device("meta"):
        planner = Planner(AutoModelForCausalLM.from_config(config), WORKLOAD)
    hw = a100(4, 4)
    layouts = list(candidates(planner, hw, replace(choice, hybrid_sharding=False, zeropp=False)))
    assert any(layout.checkpointing for layout in layouts)
    splits = 0
    for layout in layouts:
        step = sum(planner.step_time(layout, hw, exact=False)[0].values())
        floor = step_floor(planner, layout, hw)
        assert 0 < floor <= step, layout.describe()
        if has_weight_pass(layout.schedule):  # the second bound of a split backward, from one-backward profiles
            splits += 1
            assert floor <= split_floor(planner, layout, hw) <= step, layout.describe()
    assert splits or all(layout.pp == 1 for layout in layouts)


def test_no_fake_group_is_left_behind():
    profile_pass(CONFIG, "only", 1, micro_batch=1, seq=16, dtype=torch.bfloat16, tp=2, sequence_parallel=True)
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError):
        with fake_tp_group(2):
            assert dist.get_world_size() == 2 and dist.get_backend() == "fake"
            raise ZeroDivisionError
    assert not dist.is_initialized()


def test_a_process_with_a_group_plans_in_a_child(tmp_path):
    """``choose`` with a (gloo) default group: refused in this process, planned in a child, the
    same choice as without the group; the group is untouched."""
    from parallel3d.planner.auto import choose

    hw = a100(2, 2)
    want, _ = choose(_planner(), hw, Choice(tp=2, zero_stage=1))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        with pytest.raises(RuntimeError, match="fake process group"):
            with fake_tp_group(2):
                pass
        got, result = choose(_planner(), hw, Choice(tp=2, zero_stage=1))
        assert dist.group.WORLD is group and dist.get_backend() == "gloo" and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
    assert _row(got) == _row(want) and result.best
