"""``zero3d simulate``: one rank of a layout alone on the fake backend, measured beside the planner.

A tiny Llama at tp 2 x pp 2 x dp 2 (8 ranks, each simulated alone): the default ranks are the
first and last pipeline stage, each rank's model states as ``memory_report()`` counts them equal
the planner's to the byte, the optimizer step was taken (Adam's states exist), and the measured
peak is within 10% of the prediction. Bad arguments stop with one message each.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig

from parallel3d.cli import main as zero3d
from parallel3d.runtime.fake_backend import is_fake, receive_buffer
from parallel3d.pipeline.p2p import P2P

CONFIG = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, torch_dtype="bfloat16")
LAYOUT = ["--tp", "2", "--pp", "2", "--dp", "2", "--seq-len", "32", "--micro-batch", "2", "--stage", "1",
          "--device", "cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    CONFIG.save_pretrained(path)
    return path


def _simulate(capsys, *args) -> tuple[int, str, str]:
    code = zero3d(["simulate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_default_ranks(capsys, model_dir):
    code, out, err = _simulate(capsys, model_dir, *LAYOUT, "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["rank"], r["pp_rank"], r["tp_rank"], r["dp_rank"]) for r in rows] == [(0, 0, 0, 0), (4, 1, 0, 0)]
    for r in rows:
        assert r["measured"]["model_states"] == r["predicted"]["model_states"] > 0
        assert r["measured"]["optimizer_states"] > 0  # the step was taken (a skipped one allocates no Adam state)
        assert r["measured_peak_bytes"] > r["measured"]["model_states"]
        assert abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) <= 0.1 * r["measured_peak_bytes"]
        assert r["not_seen"]


def test_table_one_rank_stage3_checkpointing(capsys, model_dir):
    code, out, err = _simulate(capsys, model_dir, *LAYOUT[:-3], "3", "--checkpointing", "--rank", "5",
                               "--schedule", "gpipe", "--steps", "1", "--precision", "fp32")
    assert code == 0, err
    assert out.startswith("rank 5 of 8 (pp 1, dp 0, tp 1)")
    assert "prediction" in out and "Not seen by a simulated rank" in out and "NCCL" in out


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads"),
    (["--pp", "8"], "--pp 8 x --virtual-stages 1 = 8 pipeline chunks, but the model has 4 layers (at least one each)"),
    (["--rank", "8"], "--rank 8 is out of range: tp 2 x pp 2 x dp 2 is 8 ranks, 0 to 7"),
    (["--sequence-parallel", "--tp", "1"], "--sequence-parallel needs --tp > 1"),
])
def test_refusals(capsys, model_dir, args, message):
    code, out, err = _simulate(capsys, model_dir, *LAYOUT, *args)
    assert code == 2 and out == ""
    assert err.strip() == f"zero3d simulate: error: {message}"


def test_missing_model_dir(capsys, tmp_path):
    code, out, err = _simulate(capsys, tmp_path / "nowhere", *LAYOUT)
    assert code == 2 and out == ""
    assert err.strip().startswith("zero3d simulate: error: model ") and "no such file or directory" in err
    assert len(err.strip().splitlines()) == 1


def test_fake_receives_are_zero_filled():
    """On the fake backend a receive writes nothing: the buffer must not be the allocator's garbage."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not is_fake()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        assert is_fake()
        (pending,) = P2P(dist.group.WORLD, torch.device("cpu")).post([], [((1000,), torch.float32, 0)])
        assert torch.equal(pending.wait(), torch.zeros(1000))
        assert torch.equal(receive_buffer((3,), torch.bfloat16, torch.device("cpu"), None), torch.zeros(3, dtype=torch.bfloat16))
    finally:
        dist.destroy_process_group()
