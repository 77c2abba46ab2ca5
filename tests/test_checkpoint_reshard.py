"""Save on one layout, resume on another: the run goes on as one process would have run it.

Each case trains three steps on layout A (its own world size, mesh and ZeRO stage) with an LR
schedule moving every step, saves, and a new job on layout B (another world size, mesh, stage
or schedule, and a different init seed, so only the checkpoint can give it A's state) loads
and trains three more. All six steps' losses and B's final parameters must match one process
running AdamW over the same global batches with the learning rates the engines used (1e-5).

Every layout reads the same four micro-batches per step (eight in the 8-rank cases): a layout
with dp ranks gives rank r the micro-batches ``r, r + dp, ...`` (gradient_accumulation_steps =
4 / dp), so the global batch, and with it the gradient, is the same everywhere.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import ds_config, make_model, token_batches

MICRO_PER_STEP, STEPS, SAVE_AT, LAYERS = 4, 6, 3, 4
RTOL = 1e-5
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                                            "warmup_num_steps": 5, "warmup_type": "linear"}}
# Two param groups, the first held by the first pipeline stage only: per-group options (its
# own peak lr, no weight decay) must reach the same group on every stage and every layout.
EMBEDDING_GROUP = {"weight_decay": 0.0}
GROUP_PEAK_LRS = [1e-3, 3e-3]


def _param_groups(model, two_groups: bool) -> list[dict]:
    if not two_groups:
        return [{"params": list(model.parameters())}]
    first = [p for n, p in model.named_parameters() if "embed_tokens" in n]
    rest = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    return [{"params": first, **EMBEDDING_GROUP}, {"params": rest}]


def _model(kind: str, seed: int):
    if kind == "llama-mqa":  # one key/value head: every tp rank holds a replica of it
        return make_model("llama", seed=seed, num_hidden_layers=LAYERS, num_key_value_heads=1)
    return make_model(kind, seed=seed, **({"num_hidden_layers": LAYERS} if kind == "llama" else {"n_layer": LAYERS}))


def _engine(kind: str, layout: dict, seed: int):
    import parallel3d

    world = torch.distributed.get_world_size()
    pp, tp = layout.get("pp", 1), layout.get("tp", 1)
    dp = world // (pp * tp)
    gas = layout.get("micro", MICRO_PER_STEP) // dp
    config = ds_config(layout["stage"], gas, dp, stage3_param_persistence_threshold=0, reduce_bucket_size=3000,
                       mics_shard_size=layout.get("shard", -1))
    config["scheduler"] = SCHEDULER
    two_groups = layout.get("groups", False)
    if two_groups:
        config["scheduler"] = {**SCHEDULER, "params": {**SCHEDULER["params"], "warmup_max_lr": GROUP_PEAK_LRS}}
    if pp > 1:
        config["pipeline"] = {"stages": pp, "schedule": layout.get("schedule", "1f1b"),
                              **({"virtual_stages": layout["virtual"]} if "virtual" in layout else {})}
    if tp > 1:
        config["tensor_parallel"] = {"size": tp}
    model = _model(kind, seed)
    engine, _, _, _ = parallel3d.initialize(model=model, config=config,
                                            model_parameters=_param_groups(model, two_groups))
    return engine


def _data(engine, first_step: int, micro: int):
    data = token_batches(STEPS, micro, 1)
    dp, r = engine.mesh.dp, engine.mesh.local_rank("dp")
    return iter([{"input_ids": data[s, a, 0], "labels": data[s, a, 0]}
                 for s in range(first_step, STEPS) for a in range(r, micro, dp)])


def _train(engine, data, steps: int) -> tuple[list[float], list[float]]:
    losses, lrs = [], []
    for _ in range(steps):
        lrs.append(list(engine.get_lr()))
        losses.append(engine.train_batch(data))
    return losses, lrs


def run_a(kind: str, layout: dict, root: str) -> dict:
    engine = _engine(kind, layout, seed=0)
    losses, lrs = _train(engine, _data(engine, 0, layout.get("micro", MICRO_PER_STEP)), SAVE_AT)
    engine.save_checkpoint(root, client_state={"step": SAVE_AT})
    return {"losses": losses, "lrs": lrs}


def run_b(kind: str, layout: dict, root: str) -> dict:
    engine = _engine(kind, layout, seed=123)
    _, client = engine.load_checkpoint(root)
    counters = (engine.global_steps, engine.micro_steps)
    losses, lrs = _train(engine, _data(engine, SAVE_AT, layout.get("micro", MICRO_PER_STEP)), STEPS - SAVE_AT)
    return {"losses": losses, "lrs": lrs, "params": engine.full_parameters(), "client": client, "counters": counters,
            "gas": engine.gradient_accumulation_steps}


def oracle(kind: str, lrs: list[list[float]], two_groups: bool, micro: int) -> tuple[list[float], dict]:
    """One process, AdamW with the given per-step, per-group learning rates, clipping at 0.5."""
    model = _model(kind, seed=0)
    opt = torch.optim.AdamW(_param_groups(model, two_groups), lr=1.0, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    data, losses = token_batches(STEPS, micro, 1), []
    for s in range(STEPS):
        for g, lr in zip(opt.param_groups, lrs[s], strict=True):
            g["lr"] = lr
        loss = sum(model(input_ids=data[s, a, 0], labels=data[s, a, 0]).loss for a in range(micro))
        (loss / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() / micro)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


TIED_COPIES = {"lm_head.weight": "transformer.wte.weight"}  # GPT-2's head on the last pipeline stage

CASES = {
    "dp2-z2 -> 1 process": ("llama", 2, {"stage": 2}, 1, {"stage": 2}),
    "pp2xdp2-z1 -> tp2-z3 (gpt2, tied)": ("gpt2", 4, {"stage": 1, "pp": 2}, 2, {"stage": 3, "tp": 2}),
    "tp2xdp2-z3 -> pp2xtp2 interleaved-z0": ("llama", 4, {"stage": 3, "tp": 2}, 4,
                                             {"stage": 0, "pp": 2, "tp": 2, "schedule": "interleaved_1f1b",
                                              "virtual": 2}),
    "dp4-z3 -> dp2-z3": ("llama", 4, {"stage": 3}, 2, {"stage": 3}),
    # hybrid sharding: the first replica writes; the shards are read back into any grouping
    "dp4 as 2 replicas x 2-z3 -> dp4 flat-z2": ("llama", 4, {"stage": 3, "shard": 2}, 4, {"stage": 2}),
    "dp4 flat-z1 -> dp4 as 2 replicas x 2-z2": ("llama", 4, {"stage": 1}, 4, {"stage": 2, "shard": 2}),
    # a job moves from 8 flat ranks to 2 x 4 and back
    "dp8 flat-z3 -> dp8 as 2 replicas x 4-z3": ("llama", 8, {"stage": 3, "micro": 8}, 8,
                                               {"stage": 3, "shard": 4, "micro": 8}),
    "dp8 as 2 replicas x 4-z1 -> dp8 flat-z2": ("llama", 8, {"stage": 1, "shard": 4, "micro": 8}, 8,
                                               {"stage": 2, "micro": 8}),
    # 2 kv heads on 4 tp ranks: each kv head held by two ranks, written once
    "tp4 (kv heads replicated)-z1 -> dp2-z2": ("llama", 4, {"stage": 1, "tp": 4}, 2, {"stage": 2}),
    # ZeRO cuts the replicas of the one kv head differently on the two tp ranks: one writes it
    "tp2xdp2 (one kv head)-z2 -> 1 process": ("llama-mqa", 4, {"stage": 2, "tp": 2}, 1, {"stage": 2}),
    # the embedding's group lives on stage 0 only; the other stage still has it, empty
    "pp2-z1 (two param groups) -> pp2-z1": ("llama", 2, {"stage": 1, "pp": 2, "groups": True}, 2,
                                            {"stage": 1, "pp": 2, "groups": True}),
    "pp2-z1 (two param groups) -> dp2-z3": ("llama", 2, {"stage": 1, "pp": 2, "groups": True}, 2,
                                            {"stage": 3, "groups": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_on_another_layout_matches_one_process(dist, tmp_path, case):
    kind, world_a, layout_a, world_b, layout_b = CASES[case]
    a = dist.run(world_a, run_a, kind, layout_a, str(tmp_path))
    b = dist.run(world_b, run_b, kind, layout_b, str(tmp_path))
    lrs = a[0]["lrs"] + b[0]["lrs"]
    # WarmupLR holds its minimum for one extra first step (as DeepSpeed's), then moves every step
    assert len({tuple(lr) for lr in lrs[1:]}) == STEPS - 1, "the learning rate must move across the save"
    micro = layout_a.get("micro", MICRO_PER_STEP)
    assert layout_b.get("micro", MICRO_PER_STEP) == micro
    want_losses, want_params = oracle(kind, lrs, layout_a.get("groups", False), micro)
    for r in a:
        assert r["losses"] == pytest.approx(want_losses[:SAVE_AT], rel=RTOL)
    seen = set()
    for r in b:
        assert r["client"] == {"step": SAVE_AT}
        assert r["counters"] == (SAVE_AT, SAVE_AT * r["gas"])
        assert r["losses"] == pytest.approx(want_losses[SAVE_AT:], rel=RTOL)
        for name, got in r["params"].items():
            name = name if name in want_params else TIED_COPIES[name]
            err = ((got - want_params[name]).norm() / want_params[name].norm()).item()
            assert err < RTOL, f"{name} differs by {err:.2e}"
            seen.add(name)
    assert seen == set(want_params)  # pipeline stages each hold some; together all
