"""ZeRO-Offload (``offload_optimizer``, ``offload_param`` with device cpu) at dp 2.

This machine has no accelerator: the compute device is the CPU, so offload moves nothing to
another memory. What runs is the same code as on an accelerator: every unit's fp32 master is
a host tensor of its own (also under fp32, where it is otherwise the working shard), each step
copies the reduced gradient shards into host fp32 buffers and steps there, and the updated
masters are copied back into the working shards. So the tests below fail if a copy is missing
or lands in the wrong place:

* parity with the single-process fp32 oracle at stages 1-3 (clipping on), at stage 3 with the
  parameter shards offloaded too, under pipeline stages (pp 2 x dp 2, a tied embedding) and
  under tensor parallelism (tp 2 x dp 2);
* under bf16 and fp16 (dynamic loss scaling, overflowing steps), the offloaded run equals the
  run without offload exactly: the same skipped steps, loss scales, gradient norms and params
  (the norm, clipping and overflow check work on exact fp32 copies of the same gradients);
* the optimizer states live on the CPU, in host tensors apart from the working shards, and
  ``memory_report()`` counts them (and the masters, the host gradient buffers and offloaded
  parameter shards) as host memory;
* a checkpoint written with offload resumes bit-identically, with or without offload;
* a model built on the meta device trains bit-identically to the eager one with offload.

The physical copies between an accelerator and pinned host memory (``pin_memory``, the
non-blocking copies, ``zero.comm.gather_shards`` copying a host shard into its device chunk)
are not run here; ``scripts/gpu_check.py`` runs them on a GPU (docs/benchmarks.md, "On one GPU").
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed

from tests.test_zero_parity import GAS, RTOL, STEPS, oracle, train_ranks
from tests.tiny import ds_config, make_model, max_rel_param_error, rank_micro_batches, token_batches

DP = 2
OPTIMIZER = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
BOTH = {**OPTIMIZER, "offload_param": {"device": "cpu"}}
SHARD_ALL = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000}


@pytest.mark.parametrize("stage,extra", [
    (1, OPTIMIZER),
    (2, {**OPTIMIZER, "reduce_bucket_size": 3000}),
    (3, {**OPTIMIZER, **SHARD_ALL}),
    (3, {"offload_param": {"device": "cpu"}, **SHARD_ALL}),
    (3, {**BOTH, **SHARD_ALL}),
], ids=["z1-optimizer", "z2-optimizer", "z3-optimizer", "z3-param", "z3-both"])
def test_offload_matches_single_process(dist, stage, extra):
    results = dist.run(DP, train_ranks, "llama", stage, DP, extra)
    want_losses, want_params = oracle("llama", DP)
    for losses, params in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e} (relative to its largest entry)"


def _config(stage: int, precision: str, offload: dict) -> dict:
    cfg = ds_config(stage, GAS, DP, clip=0.5, **SHARD_ALL, **offload)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":  # 2^21 overflows at first: the first steps are skipped, the scale halves
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 21, "hysteresis": 1}
    return cfg


def run_engine(stage: int, precision: str, offload: dict, steps: int = STEPS) -> dict:
    """On every rank: train ``steps`` steps with train_batch; losses, params and what offload placed where."""
    import parallel3d

    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=_config(stage, precision, offload))
    data = iter(rank_micro_batches(token_batches(steps, GAS, DP), torch.distributed.get_rank()))
    losses, scales, norms = [], [], []
    for _ in range(steps):
        losses.append(engine.train_batch(data))
        scales.append(engine.optimizer.loss_scale)
        norms.append(engine.get_global_grad_norm())
    opt = engine.optimizer
    states = [v for s in opt.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "losses": losses, "scales": scales, "norms": norms, "skipped": engine.skipped_steps,
        "params": engine.full_parameters(),
        "state_devices": sorted({v.device.type for v in states}),
        "elementwise_states": sum(v.numel() for v in states if v.dim() > 0),
        "masters_apart": all(u.master is not u.shard for u in opt.units),
        "report": engine.memory_report(),
        "bytes": {
            "masters": sum(u.master.nbytes for u in opt.units),
            "states": sum(v.nbytes for v in states),
            "sharded_params": sum(u.shard.nbytes for u in opt.units if not u.persistent),
            "grad_shards": sum(4 * u.shard_size for u in opt.units),
        },
        "getters": (engine.zero_cpu_offload(), engine.zero_offload_optimizer(), engine.zero_offload_param()),
    }


OFFLOADS = {"optimizer": OPTIMIZER, "both": BOTH}


@functools.cache
def _pair(dist, stage: int, precision: str, offload: str) -> tuple[list[dict], list[dict]]:
    """(without offload, with ``OFFLOADS[offload]``) on both ranks."""
    return (dist.run(DP, run_engine, stage, precision, {}),
            dist.run(DP, run_engine, stage, precision, OFFLOADS[offload]))


@pytest.mark.parametrize("stage,precision,offload", [
    (1, "bf16", "optimizer"), (2, "fp16", "optimizer"), (3, "bf16", "both"), (3, "fp16", "both"),
])
def test_offload_is_exact_in_mixed_precision(dist, stage, precision, offload):
    """Offloading changes where the step runs, not a bit of what it computes."""
    plain, offloaded = _pair(dist, stage, precision, offload)
    for a, b in zip(plain, offloaded):
        assert b["losses"] == a["losses"] and b["scales"] == a["scales"]
        assert [str(n) for n in b["norms"]] == [str(n) for n in a["norms"]]  # nan (an overflow) included
        assert b["skipped"] == a["skipped"]
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), name
    if precision == "fp16":
        assert plain[0]["skipped"] > 0, "the fp16 runs were meant to overflow at first"


@pytest.mark.parametrize("stage,offload", [(2, "optimizer"), (3, "both")])
def test_states_live_in_host_memory_and_are_reported_there(dist, stage, offload):
    plain, offloaded = _pair(dist, stage, "bf16", offload)
    for a, b in zip(plain, offloaded):
        assert b["state_devices"] == ["cpu"] and b["elementwise_states"] == a["elementwise_states"] > 0
        assert b["masters_apart"]
        report, held = b["report"], b["bytes"]
        assert report["optimizer_states"] == report["master_params"] == 0
        assert report["offloaded_optimizer_states"] == held["states"] == a["report"]["optimizer_states"]
        assert report["offloaded_master_params"] == held["masters"] == a["report"]["master_params"]
        assert report["offloaded_gradients"] == held["grad_shards"]
        assert report["gradients"] == a["report"]["gradients"]
        if offload == "both":
            assert report["offloaded_params"] == held["sharded_params"] > 0
            assert report["params"] == a["report"]["params"] - held["sharded_params"]
        else:
            assert report["offloaded_params"] == 0 and report["params"] == a["report"]["params"]
        enabled, optimizer_block, param_block = b["getters"]
        assert enabled and optimizer_block.device == "cpu" and optimizer_block.pin_memory
        assert (param_block is not None and param_block.device == "cpu") == (offload == "both")
        assert "offloaded_params" not in a["report"] and a["getters"] == (False, None, None)


def resume(stage: int, ckpt_dir: str, offload_a: dict, offload_b: dict) -> tuple:
    """Run A (``offload_a``) trains 4 steps, saving after 2; run B (``offload_b``, another init) loads
    and trains steps 3-4: B's losses and params must be A's."""
    import parallel3d

    rank = torch.distributed.get_rank()
    batches = rank_micro_batches(token_batches(4, GAS, DP), rank)
    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=_config(stage, "bf16", offload_a))
    data = iter(batches)
    losses_a = [engine.train_batch(data) for _ in range(2)]
    engine.save_checkpoint(ckpt_dir)
    losses_a += [engine.train_batch(data) for _ in range(2)]
    engine.wait_for_checkpoint()
    params_a = engine.full_parameters()
    engine.destroy()
    engine, *_ = parallel3d.initialize(model=make_model("llama", seed=123), config=_config(stage, "bf16", offload_b))
    engine.load_checkpoint(ckpt_dir)
    devices = sorted({v.device.type for s in engine.optimizer.inner.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor)})
    data = iter(batches[2 * GAS:])
    losses_b = [engine.train_batch(data) for _ in range(2)]
    same = all(torch.equal(v, params_a[n]) for n, v in engine.full_parameters().items())
    return losses_a[2:], losses_b, same, devices


@pytest.mark.parametrize("stage,offload_a,offload_b", [
    (2, OPTIMIZER, OPTIMIZER), (3, BOTH, BOTH), (2, OPTIMIZER, {}), (3, {}, BOTH),
], ids=["z2", "z3", "z2-offloaded-to-plain", "z3-plain-to-offloaded"])
def test_checkpoint_round_trip_with_offload(dist, tmp_path, stage, offload_a, offload_b):
    for losses_a, losses_b, same, devices in dist.run(DP, resume, stage, str(tmp_path), offload_a, offload_b):
        assert losses_b == losses_a and same
        assert devices == ["cpu"]


@pytest.mark.parametrize("stage,offload", [(2, OPTIMIZER), (3, BOTH)], ids=["z2-optimizer", "z3-both"])
def test_offload_under_pipeline_stages(dist, stage, offload):
    """pp 2 x dp 2 with GPT-2's tied embedding (its gradient summed across stages before the step)."""
    from tests.test_pipeline_zero import DP as PIPE_DP, PP, assert_stages_match, oracle_dp, train_pipeline

    results = dist.run(PP * PIPE_DP, train_pipeline, "gpt2", stage, "1f1b", {}, offload)
    assert_stages_match(results, *oracle_dp("gpt2", PIPE_DP))


def test_offload_under_tensor_parallelism(dist):
    """tp 2 x dp 2, stage 3, both offloads: the norm's model-parallel sum runs on the host's squares."""
    from tests.test_tp_zero import DP as TP_DP, TP
    from tests.test_tp_zero import oracle as tp_oracle
    from tests.test_tp_zero import train_tp

    want_losses, want_params = tp_oracle("llama")
    for losses, params, _ in dist.run(TP * TP_DP, train_tp, "llama", 3, False, BOTH):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e}"


def _meta_vs_eager() -> bool:
    """Stage 3 with both offloads, from a model built on the meta device and from the same model built
    eagerly: ZeRO fills the buffers from the meta model's initializers before offload moves them."""
    import parallel3d
    from tests.test_meta_init import _eager, _meta

    params = []
    for build in (_eager, _meta):
        engine, *_ = parallel3d.initialize(model=build("llama"), config=_config(3, "bf16", BOTH))
        data = iter(rank_micro_batches(token_batches(2, GAS, DP), torch.distributed.get_rank()))
        for _ in range(2):
            engine.train_batch(data)
        params.append(engine.full_parameters())
        engine.destroy()
    return all(torch.equal(params[1][n], value) for n, value in params[0].items())


def test_offload_from_a_meta_model(dist):
    assert all(dist.run(DP, _meta_vs_eager))
