"""Sharded checkpoints at dp = 2: a resumed run is bit-identical to the uninterrupted one.

Run A trains steps 1-3, saves, and goes on to step 6. Run B builds the model with a different
init seed (so only the checkpoint can give it A's weights), loads, and trains steps 4-6 on the
same micro-batches: its losses and its final params must equal A's exactly (``==`` and
``torch.equal``, not approximately), and the LR schedule, step counters and client state must
come back. Errors on loading are checked by their messages.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed

from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches

DP, GAS, STEPS, SAVE_AT = 2, 2, 6, 3

# lr moves every step: linear warmup over 5 steps (after DeepSpeed's extra first step at min)
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                                            "warmup_num_steps": 5, "warmup_type": "linear"}}


def _config(stage: int, precision: str) -> dict:
    cfg = ds_config(stage, GAS, DP, clip=0.5, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}))
    cfg["scheduler"] = SCHEDULER
    cfg["bf16"] = {"enabled": precision == "bf16"}
    return cfg


def _engine(stage: int, precision: str, seed: int):
    import parallel3d

    engine, _, _, sched = parallel3d.initialize(model=make_model("llama", seed=seed), config=_config(stage, precision))
    return engine, sched


def _counters(engine, sched) -> dict:
    return {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples, "lr": engine.get_lr(),
            "sched": sched.last_batch_iteration}


def resume(stage: int, precision: str, ckpt_dir: str) -> dict:
    """On every rank: the uninterrupted run A and the resumed run B (see the module doc)."""
    rank = torch.distributed.get_rank()
    batches = rank_micro_batches(token_batches(STEPS, GAS, DP), rank)
    first = lambda step: iter(batches[step * GAS :])  # noqa: E731 - micro-batches from `step` on

    engine, sched = _engine(stage, precision, seed=0)
    data = first(0)
    losses_a = [engine.train_batch(data) for _ in range(SAVE_AT)]
    saved = _counters(engine, sched)
    tag = engine.save_checkpoint(ckpt_dir, client_state={"epoch": 7, "note": "hi"})
    latest = Path(ckpt_dir, "latest").read_text()
    losses_a += [engine.train_batch(data) for _ in range(SAVE_AT, STEPS)]
    params_a, working_a = engine.full_parameters(), {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    final_a = _counters(engine, sched)
    del engine, sched

    engine, sched = _engine(stage, precision, seed=123)
    fresh = engine.full_parameters()
    path, client_state = engine.load_checkpoint(ckpt_dir)
    restored = _counters(engine, sched)
    data = first(SAVE_AT)
    losses_b = [engine.train_batch(data) for _ in range(SAVE_AT, STEPS)]
    params_b, working_b = engine.full_parameters(), {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {
        "tag": tag, "latest": latest, "path": path, "client_state": client_state,
        "saved": saved, "restored": restored, "final_a": final_a, "final_b": _counters(engine, sched),
        "losses_a": losses_a, "losses_b": losses_b,
        "different_init": any(not torch.equal(fresh[n], params_a[n]) for n in fresh),
        "params_equal": {n: torch.equal(params_a[n], params_b[n]) for n in params_a},
        "working_equal": {n: torch.equal(working_a[n], working_b[n]) for n in working_a},
        "working_dtype": str(next(iter(working_b.values())).dtype),
    }


CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")]


@pytest.mark.parametrize("stage,precision", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_resume_is_bit_identical(dist, tmp_path, stage, precision):
    for rank, r in enumerate(dist.run(DP, resume, stage, precision, str(tmp_path))):
        assert r["tag"] == "global_step3" and r["latest"] == "global_step3"
        assert r["path"] == str(tmp_path / "global_step3")
        assert sorted(os.listdir(tmp_path / "global_step3")) == [
            "__0_0.distcp", "__1_0.distcp", "checkpoint.json", "config.json", "dcp.json"]
        assert r["client_state"] == {"epoch": 7, "note": "hi"}
        assert r["different_init"], "run B started from the same weights: the test proves nothing"
        # counters and schedule come back as they were at the save
        assert r["restored"] == r["saved"]
        assert r["saved"]["global_steps"] == SAVE_AT and r["saved"]["micro_steps"] == SAVE_AT * GAS
        assert r["saved"]["lr"] != r["final_a"]["lr"]  # the lr does move after the save
        assert r["final_b"] == r["final_a"]
        # and training goes on bit for bit
        assert r["losses_b"] == r["losses_a"][SAVE_AT:], (rank, r["losses_a"], r["losses_b"])
        assert all(r["params_equal"].values()), [n for n, ok in r["params_equal"].items() if not ok]
        assert all(r["working_equal"].values()), [n for n, ok in r["working_equal"].items() if not ok]
        assert r["working_dtype"] == {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[precision]


# --- errors on loading ------------------------------------------------------------------------


class NotAWeight:
    """Pickles as a call of os.getpid: code that a weights_only load must refuse to run."""

    def __reduce__(self):
        return (os.getpid, ())


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts on type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def load_errors(root: str) -> dict:
    """On every rank: what loading says for a stage mismatch, a missing dir/tag, pickled code."""
    rank = torch.distributed.get_rank()
    engine, _ = _engine(2, "fp32", seed=0)
    engine.train_batch(iter(rank_micro_batches(token_batches(1, GAS, DP), rank)))
    engine.save_checkpoint(f"{root}/ckpt")
    stage1, _ = _engine(1, "fp32", seed=0)
    evil = Path(root, "evil", "global_step1")
    evil.mkdir(parents=True, exist_ok=True)
    torch.save({"payload": NotAWeight()}, evil / f"rank{rank}.pt")
    return {
        "stage": _error(lambda: stage1.load_checkpoint(f"{root}/ckpt")),
        "missing_dir": _error(lambda: engine.load_checkpoint(f"{root}/nowhere")),
        "missing_tag": _error(lambda: engine.load_checkpoint(f"{root}/ckpt", tag="global_step9")),
        "pickled_code": _error(lambda: engine.load_checkpoint(f"{root}/evil", tag="global_step1")),
    }


def test_load_errors(dist, tmp_path):
    for rank, msg in enumerate(dist.run(DP, load_errors, str(tmp_path))):
        assert msg["stage"] == ("ConfigError: checkpoint was written with ZeRO stage 2 on data-parallel size 2; "
                                "this engine runs stage 1 on 2")
        assert msg["missing_dir"] == f"ConfigError: no checkpoint in {tmp_path}/nowhere: {tmp_path}/nowhere/latest does not exist"
        assert msg["missing_tag"] == f"ConfigError: checkpoint {tmp_path}/ckpt/global_step9 does not exist"
        unreadable = f"ConfigError: checkpoint file {tmp_path}/evil/global_step1/rank{rank}.pt is unreadable: "
        assert msg["pickled_code"].startswith(unreadable), msg["pickled_code"]
        assert "Weights only load failed" in msg["pickled_code"] and "getpid" in msg["pickled_code"]


def load_other_layout(root: str) -> dict:
    """On every rank: save with 3000-element buckets, load into an engine with 4000-element ones.

    Both layouts start with the same two unit sizes (2048 and 2096 elements per rank), then
    differ, so a loader that copies master after master fails only part-way through."""
    import parallel3d

    rank = torch.distributed.get_rank()
    cfg = ds_config(2, GAS, DP, reduce_bucket_size=3000)
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=cfg)
    engine.train_batch(iter(rank_micro_batches(token_batches(1, GAS, DP), rank)))
    engine.save_checkpoint(root)
    other, _, _, _ = parallel3d.initialize(model=make_model("llama", seed=5), config={**cfg, "zero_optimization": {
        "stage": 2, "reduce_bucket_size": 4000}})
    before = other.full_parameters()
    error = _error(lambda: other.load_checkpoint(root))
    after = other.full_parameters()
    return {"error": error, "untouched": all(torch.equal(before[n], after[n]) for n in before)}


def test_load_into_a_different_unit_layout_is_refused_cleanly(dist, tmp_path):
    for r in dist.run(DP, load_other_layout, str(tmp_path)):
        assert r["error"].startswith("ConfigError: "), r["error"]
        assert r["untouched"], "a refused load must leave the engine as it was"


def _load_with_one_file_missing(ckpt_dir: str) -> str:
    import parallel3d

    engine, _ = _engine(2, "fp32", seed=0)
    tag = engine.save_checkpoint(ckpt_dir)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        Path(ckpt_dir, tag, "rank1.pt").unlink()
    torch.distributed.barrier()
    try:
        engine.load_checkpoint(ckpt_dir)
    except parallel3d.ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_file_missing_on_one_rank_stops_every_rank(dist, tmp_path):
    msg0, msg1 = dist.run(DP, _load_with_one_file_missing, str(tmp_path), timeout=120)
    assert msg1 == (f"checkpoint {tmp_path}/global_step0 has no file for rank 1 (rank1.pt); "
                    "was it written by a larger world?")
    assert msg0 == (f"checkpoint {tmp_path}/global_step0 could not be loaded on another rank (see its error); "
                    "nothing was changed")
