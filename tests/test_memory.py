"""``engine.memory_report()`` against the ZeRO paper's per-rank bytes, and against the tensors.

For Psi trainable parameters, mixed precision (bf16 working params and grads: 2 bytes; fp32
master: 4; Adam's m and v: 8) and data-parallel size dp, the ZeRO paper gives per rank:

    stage   params    gradients   master    optimizer states    total
    0       2 Psi     2 Psi       4 Psi     8 Psi               16 Psi
    1       2 Psi     2 Psi       4 Psi/dp  8 Psi/dp            4 Psi + 12 Psi/dp
    2       2 Psi     2 Psi/dp    4 Psi/dp  8 Psi/dp            2 Psi + 14 Psi/dp
    3       2 Psi/dp  2 Psi/dp    4 Psi/dp  8 Psi/dp            16 Psi/dp

"Within padding": each flat unit is padded to a multiple of dp on its own, so a whole
(unsharded) buffer holds at most dp - 1 extra elements per unit and a shard less than one
extra element per unit (the bounds below are these, tighter than units x dp). Stage 0 does
not shard, so it pads nothing. AdamW also keeps one fp32 ``step`` scalar per master tensor
(one per unit): those bytes are counted exactly, on top of 8 bytes per master element.

The report gives each category at its largest in a step, so it is compared with the storage
the engine actually holds (distinct tensor storages, found independently of
``memory_report``) right after ``initialize``, at the end of a backward (every gradient buffer
exists) and after the step (the gradient buffers are gone again, the rest is as reported). The
optimizer-state formula is checked after the step only: torch optimizers create their states
lazily, at the first step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed

from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches
from zero.sizing import CATEGORIES
WORK_BYTES = {"bf16": 2, "fp32": 4}


def _storage_bytes(tensors, exclude: set[int] = frozenset()) -> tuple[int, set[int]]:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values()), set(seen)


def _held_storage(engine) -> dict[str, int]:
    """What the engine holds per category, measured from the tensors themselves."""
    opt = engine.optimizer
    units = opt.units
    trainable = [p for u in units for p in u.params]
    params, param_ptrs = _storage_bytes([u.full for u in units] + [u.shard for u in units] + [p.data for p in trainable])
    grad_tensors = [u.grad_full for u in units] + [u.grad_shard for u in units] + [p.grad for p in trainable]
    grad_tensors += [m.grad for m in opt.master_pieces] + [s for s in opt.reducer._staging if s is not None]
    grads, _ = _storage_bytes(grad_tensors)
    # under fp32 the master is the working shard itself: its bytes are already in params
    master, _ = _storage_bytes([u.master for u in units] + list(opt.masters), exclude=param_ptrs)
    states = [v for st in opt.inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    optim, _ = _storage_bytes(states)
    frozen_units = opt.frozen_units
    frozen, _ = _storage_bytes([u.full if u.persistent else u.shard for u in frozen_units])
    return {"params": params, "gradients": grads, "master_params": master, "optimizer_states": optim,
            "frozen_params": frozen}


def measure(stage: int, precision: str, zero_extra: dict) -> dict:
    """On every rank: reports and held storage right after initialize and after one step."""
    import parallel3d

    dp = torch.distributed.get_world_size()
    model = make_model("llama")
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = ds_config(stage, 1, dp, **zero_extra)
    config["bf16"] = {"enabled": precision == "bf16"}
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    opt = engine.optimizer
    out = {
        "psi": psi,
        "units": len(opt.units),
        "unit_params": sum(len(u.params) for u in opt.units),
        "report_init": engine.memory_report(),
        "held_init": _held_storage(engine),
    }
    batch = rank_micro_batches(token_batches(1, 1, dp), torch.distributed.get_rank())[0]
    engine.backward(engine(**batch).loss)
    out["report_backward"] = engine.memory_report()
    out["held_backward"] = _held_storage(engine)
    engine.step()
    out["report_step"] = engine.memory_report()
    out["held_step"] = _held_storage(engine)
    out["step_bytes"] = sum(st["step"].numel() * st["step"].element_size() for st in opt.inner.state.values())
    out["state_tensors"] = sum(1 for st in opt.inner.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    out["pieces"] = len(opt.master_pieces)
    out["piece_numel"] = sum(m.numel() for m in opt.master_pieces)
    out["master_aliases_shard"] = [
        u.master.data_ptr() == u.shard.data_ptr() and m.data_ptr() == u.shard.data_ptr() and u.master.numel() == u.shard.numel()
        for u, m in zip(opt.units, opt.masters)
    ]
    return out


def paper_bytes(stage: int, psi: int, dp: int, work: int) -> dict[str, float]:
    """The ZeRO paper's bytes per category (Adam: m and v, 8 bytes; fp32 master: 4)."""
    sharded = lambda from_stage, n: n if stage < from_stage else n / dp  # noqa: E731
    return {
        "params": sharded(3, work * psi),
        "gradients": sharded(2, work * psi),
        "master_params": sharded(1, 4 * psi),
        "optimizer_states": sharded(1, 8 * psi),
    }


def padding_slack(stage: int, dp: int, units: int, work: int) -> dict[str, float]:
    """Most bytes that per-unit padding can add to each category."""
    if stage == 0:
        return dict.fromkeys(CATEGORIES, 0)
    full_pad, shard_pad = units * (dp - 1), units  # elements
    return {
        "params": work * (full_pad if stage < 3 else shard_pad),
        "gradients": work * (full_pad if stage < 2 else shard_pad),
        "master_params": 4 * shard_pad,
        "optimizer_states": 8 * shard_pad,
    }


# Stages 0-2 with small buckets so that many units (and their padding) are in play; stage 3
# with every param sharded (threshold 0): one unit per decoder layer plus the root.
ZERO = {0: {"reduce_bucket_size": 3000}, 1: {"reduce_bucket_size": 3000}, 2: {"reduce_bucket_size": 3000},
        3: {"stage3_param_persistence_threshold": 0}}

_cache: dict = {}


def _measured(dist, dp: int, stage: int, precision: str) -> list[dict]:
    key = (dp, stage, precision)
    if key not in _cache:
        _cache[key] = dist.run(dp, measure, stage, precision, ZERO[stage])
    return _cache[key]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_bf16_report_matches_zero_paper(dist, dp, stage):
    for rank, m in enumerate(_measured(dist, dp, stage, "bf16")):
        psi, units = m["psi"], m["units"]
        assert psi == 26784 and m["unit_params"] == 21  # the tiny Llama, every param in one unit
        assert units > 1
        want, slack = paper_bytes(stage, psi, dp, 2), padding_slack(stage, dp, units, 2)
        # gradient buffers and optimizer states are allocated by the first backward and step
        assert m["report_init"]["gradients"] == m["report_init"]["optimizer_states"] == 0
        for when in ("report_init", "report_step"):
            got = m[when]
            assert set(got) == set(CATEGORIES)
            for cat in ("params", "gradients", "master_params") if when == "report_step" else ("params", "master_params"):
                assert 0 <= got[cat] - want[cat] <= slack[cat], (rank, when, cat, got[cat], want[cat], slack[cat])
        # optimizer states exist once the optimizer has stepped: m and v per element of each
        # param piece in the shard (padding has none), plus AdamW's fp32 'step' scalar per piece
        assert m["step_bytes"] == 4 * m["pieces"]
        assert m["state_tensors"] == 3 * m["pieces"]
        adam = m["report_step"]["optimizer_states"] - m["step_bytes"]
        assert adam == 8 * m["piece_numel"] <= 2 * m["report_step"]["master_params"]
        total = sum(m["report_step"].values()) - m["step_bytes"]
        paper_total = {0: 16 * psi, 1: 4 * psi + 12 * psi / dp, 2: 2 * psi + 14 * psi / dp, 3: 16 * psi / dp}[stage]
        assert -8 * psi / dp <= total - paper_total <= sum(slack.values())
    # the pieces tile the model: over the ranks, Adam's m and v are 8 bytes per parameter exactly
    shards = 1 if stage == 0 else dp
    ranks = _measured(dist, dp, stage, "bf16")
    assert sum(m["piece_numel"] for m in ranks[:shards]) == psi


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_report_equals_held_storage(dist, dp, stage, precision):
    for rank, m in enumerate(_measured(dist, dp, stage, precision)):
        assert m["report_init"] == m["held_init"], (rank, "after initialize")
        assert m["report_backward"]["gradients"] > 0
        assert m["report_backward"] == {**m["held_backward"], "optimizer_states": 0}, (rank, "after a backward")
        assert m["report_step"] == {**m["held_step"], "gradients": m["report_backward"]["gradients"]}, (rank, "step")
        assert m["held_step"]["gradients"] == 0, (rank, "gradient buffers are dropped after the step")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_fp32_master_is_the_working_shard(dist, dp, stage):
    for rank, m in enumerate(_measured(dist, dp, stage, "fp32")):
        assert all(m["master_aliases_shard"]), (rank, m["master_aliases_shard"])
        psi, units = m["psi"], m["units"]
        want, slack = paper_bytes(stage, psi, dp, 4), padding_slack(stage, dp, units, 4)
        assert m["report_init"]["gradients"] == 0
        for when in ("report_init", "report_step"):
            got = m[when]
            assert got["master_params"] == 0
            for cat in ("params", "gradients") if when == "report_step" else ("params",):
                assert 0 <= got[cat] - want[cat] <= slack[cat], (rank, when, cat, got[cat], want[cat])
        adam = m["report_step"]["optimizer_states"] - m["step_bytes"]
        assert adam == 8 * m["piece_numel"]




def _strays_after_split(tp: int) -> list[tuple[int, ...]]:
    """Shapes of the parameters made since the model was built that are still alive after a
    pp 2 (x tp) initialize but belong to no module of it (the dropped chunks', the full weights
    tp replaced), with Python's cyclic collector off (it would run at a moment that depends on
    everything else the process allocated)."""
    import gc

    import parallel3d

    def parameters() -> list[torch.nn.Parameter]:
        return [o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)]

    gc.collect()
    gc.disable()
    try:
        before = {id(p) for p in parameters()}
        model = make_model("llama", num_hidden_layers=4)
        config = ds_config(1, 2, 1)
        config["tensor_parallel"] = {"size": tp}
        config["pipeline"] = {"stages": 2}
        engine, optimizer, *_ = parallel3d.initialize(model=model, config=config)
        kept = {id(p) for p in model.parameters()}
        kept |= {id(p) for group in optimizer.param_groups for p in group["params"]}  # the master pieces
        return sorted(tuple(p.shape) for p in parameters() if id(p) not in kept | before)
    finally:
        gc.enable()


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_split_frees_the_other_stages(dist, tp):
    """The chunks a pipeline rank drops (and, under tp, the weights tp replaced) are freed by
    ``initialize`` itself: they sit in reference cycles, and an eager pp 2 x tp 2 start kept
    3 MiB of a 20 MiB stage alive until the collector happened to run."""
    for rank, strays in enumerate(dist.run(2 * tp, _strays_after_split, tp)):
        assert strays == [], (rank, strays)
