"""Ranks started with different settings stop in `initialize` with one message naming the difference.

Each case gives rank 1 another value than rank 0 (a per-rank config mix-up) on the 2-rank
pool; both ranks must raise the same `ConfigError`, which names the first differing key and
the values by rank, instead of training silently wrong or aborting in gloo.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

import parallel3d
from parallel3d import ConfigError
from tests.tiny import ds_config, make_model


def _initialize_per_rank(case: str) -> str:
    rank, local_world = dist.get_rank(), os.environ.get("LOCAL_WORLD_SIZE")
    config, model = ds_config(2, 1, 2), make_model("llama")
    if case == "stage":
        config = ds_config(2 + rank, 1, 2)
    elif case == "accumulation":
        config = ds_config(2, 1 + rank, 2)
    elif case == "model shape":
        model = make_model("llama", intermediate_size=64 * (1 + rank))
    elif case == "node size":  # qgZ's two hops build their groups from each rank's LOCAL_WORLD_SIZE
        config = ds_config(3, 1, 2, zero_quantized_gradients=True)
        os.environ["LOCAL_WORLD_SIZE"] = str(1 + rank)
    elif case == "bad input on one rank":
        config = ds_config(2, 1, 2) if rank == 0 else {**ds_config(2, 1, 2), "gradient_clipping": -1}
    try:
        parallel3d.initialize(model=model, config=config)
    except ConfigError as exc:
        return str(exc)
    finally:  # the pool's processes serve later tests
        os.environ.update({} if local_world is None else {"LOCAL_WORLD_SIZE": local_world})
    return "no error"


@pytest.mark.parametrize("case,expected", [
    ("stage", "config key zero_optimization.stage: 2 on rank 0, 3 on rank 1"),
    ("accumulation", "config key gradient_accumulation_steps: 1 on rank 0, 2 on rank 1"),
    ("model shape", 'model parameter model.layers.0.mlp.gate_proj.weight: "[64, 32] float32" on rank 0, '
                    '"[128, 32] float32" on rank 1'),
    ("node size", "mesh ZeRO shard ranks per node (qgZ; LOCAL_WORLD_SIZE / tp): 1 on rank 0, 2 on rank 1"),
])
def test_ranks_that_disagree_stop_with_the_difference(dist, case, expected):
    messages = dist.run(2, _initialize_per_rank, case, timeout=120)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("the ranks were started with different settings: ") and expected in messages[0]


def test_bad_input_on_one_rank_stops_both(dist):
    own, other = dist.run(2, _initialize_per_rank, "bad input on one rank", timeout=120)[::-1]
    assert own.startswith("gradient_clipping") and other == f"rank 1 stopped: {own}", (own, other)


def test_ranks_that_agree_start(dist):
    assert dist.run(2, _initialize_per_rank, "same", timeout=120) == ["no error", "no error"]
