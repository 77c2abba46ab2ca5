"""The search's shortcuts give what pricing every layout gives, and its fake process group stays its own.

* The first pass walks the memory of the fastest layouts only (`search._fastest_that_fit`): the
  same list as predicting every layout and sorting by (step, peak), ties and layouts that do
  not fit included, and the same plan.
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
from transformers import LlamaConfig, LlamaForCausalLM

from parallel3d.planner.fake_tp import fake_tp_group
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
