"""The DeepSpeed engine surface a script touches: getters, counters, destroy, attribute forwarding,
save_16bit_model, partial checkpoint loads, a client optimizer beside a config section, and the
config keys gradient_allreduce_op and bf16.check_grad_overflow. DeepSpeed is the oracle where
it can run the same thing."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import ds_config, make_model, max_rel_param_error, rank_micro_batches, token_batches

GETTERS = [
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "steps_per_print", "dataloader_drop_last", "zero_optimization", "zero_optimization_stage", "zero_optimization_partition_gradients",
    "zero_optimization_partition_weights", "zero_reduce_bucket_size", "zero_allgather_bucket_size",
    "zero_overlap_comm", "zero_contiguous_gradients", "zero_reduce_scatter", "zero_allgather_partitions",
    "zero_round_robin_gradients", "zero_sub_group_size", "zero_prefetch_bucket_size",
    "zero_param_persistence_threshold", "zero_max_live_parameters", "zero_max_reuse_distance",
    "zero_gather_16bit_weights_on_model_save", "zero_offload_optimizer", "zero_offload_param", "zero_cpu_offload",
    "fp16_enabled", "bfloat16_enabled", "fp16_auto_cast", "loss_scale", "dynamic_loss_scale",
    "initial_dynamic_scale", "dynamic_loss_scale_args", "optimizer_name", "optimizer_params", "scheduler_name",
    "scheduler_params", "postscale_gradients", "gradient_predivide_factor", "get_data_types", "wall_clock_breakdown",
    "memory_breakdown", "flops_profiler_enabled", "autotuning_enabled", "get_lr",
    "get_mom",
]
ATTRIBUTES = ["communication_data_type", "dp_world_size", "mp_world_size", "global_steps", "skipped_steps"]


def _getter_config(precision: str, stage: int) -> dict:
    config = ds_config(stage, 2, 1, clip=0.3, lr=2e-3, reduce_bucket_size=12345, allgather_bucket_size=6788,
                       stage3_prefetch_bucket_size=4321, stage3_param_persistence_threshold=99,
                       stage3_max_live_parameters=777777, stage3_gather_16bit_weights_on_model_save=True)
    config["optimizer"] = {"type": "Adam", "params": {"lr": 2e-3, "betas": [0.8, 0.9], "torch_adam": True}}
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 7, "warmup_max_lr": 2e-3}}
    config["steps_per_print"] = 77
    config["dataloader_drop_last"] = stage == 2
    config["prescale_gradients"] = stage == 0  # DeepSpeed's ZeRO stages refuse prescaling and predivision
    config["gradient_predivide_factor"] = 2.0 if stage == 0 else 1.0
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50, "hysteresis": 3,
                          "min_loss_scale": 2}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def getters(engine_kind: str, precision: str, stage: int) -> dict:
    config = _getter_config(precision, stage)
    if engine_kind == "deepspeed":
        from tests.ds_oracle import allow_fp16_on_cpu, make_engine

        allow_fp16_on_cpu()
        engine = make_engine(make_model("llama"), config, [{"input_ids": torch.zeros(2, 1)}])
    else:
        import parallel3d

        engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    values = {name: getattr(engine, name)() for name in GETTERS}
    values.update({name: getattr(engine, name) for name in ATTRIBUTES})
    engine.destroy()
    return values


@pytest.mark.parametrize("precision,stage", [("fp32", 0), ("fp16", 2), ("bf16", 3)])
def test_getters_match_deepspeed(dist, precision, stage):
    (ours,) = dist.run(1, getters, "zero3d", precision, stage)
    (theirs,) = dist.run(1, getters, "deepspeed", precision, stage)
    assert ours == theirs


def engine_helpers() -> dict:
    import parallel3d

    model = make_model("llama")
    engine, *_ = parallel3d.initialize(model=model, config=ds_config(3, 1, 1))
    batch = rank_micro_batches(token_batches(1, 1, 1), 0)[0]
    before = (engine.was_step_applied(), engine.get_global_grad_norm())
    loss = engine(**batch).loss
    returned = engine.backward(loss)
    engine.step()
    try:
        engine.no_such_thing
        missing = "no error"
    except AttributeError as err:
        missing = str(err)
    hooks_before = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    engine.destroy()
    hooks_after = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return {"before": before, "applied": engine.was_step_applied(), "norm": engine.get_global_grad_norm(),
            "skipped": engine.skipped_steps, "gas_call": engine.gradient_accumulation_steps(),
            "forwarded": engine.lm_head is model.lm_head and engine.model is model.model, "missing": missing,
            "returned": torch.equal(returned, loss), "hooks": (hooks_before, hooks_after)}


def test_engine_helpers(dist):
    (r,) = dist.run(1, engine_helpers)
    assert r["before"] == (False, None)
    assert r["applied"] is True and r["norm"] > 0 and r["skipped"] == 0 and r["gas_call"] == 1
    assert r["forwarded"] and r["returned"]  # backward returns loss / gradient_accumulation_steps (1 here)
    assert r["missing"] == "'Engine' object has no attribute 'no_such_thing', nor has the model it wraps"
    assert r["hooks"][0] > 0 and r["hooks"][1] == 0


# --- save_16bit_model against DeepSpeed's file ---------------------------------------------------


def save_16bit(engine_kind: str, stage: int, path: str, gather: bool) -> bool:
    config = ds_config(stage, 1, 2)
    config["bf16"] = {"enabled": True}
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    if engine_kind == "deepspeed":
        from tests.ds_oracle import make_engine

        engine = make_engine(make_model("gpt2"), config, [{"input_ids": torch.zeros(2, 1)}])
    else:
        import parallel3d

        engine, *_ = parallel3d.initialize(model=make_model("gpt2"), config=config)
    try:
        return engine.save_16bit_model(path, "model.bin")
    finally:
        engine.destroy()


def heartbeat_after_destroy() -> tuple[bool, bool]:
    import threading

    import parallel3d

    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=ds_config(2, 1, 2))

    def beating() -> bool:
        return any(t.name == "zero3d-heartbeat" and t.is_alive() for t in threading.enumerate())

    before = beating()
    engine.destroy()
    return before, beating()


def test_destroy_stops_the_heartbeat(dist):
    """destroy() ends the watchdog's thread (a thread inside a store call at exit aborts the process)."""
    assert dist.run(2, heartbeat_after_destroy) == [(True, False)] * 2


@pytest.mark.parametrize("stage", [2, 3])
def test_save_16bit_model_matches_deepspeed(dist, tmp_path, stage):
    assert dist.run(2, save_16bit, "zero3d", stage, str(tmp_path / "ours"), True) == [True, True]
    assert dist.run(2, save_16bit, "deepspeed", stage, str(tmp_path / "ds"), True) == [True, True]
    ours = torch.load(tmp_path / "ours" / "model.bin", weights_only=True)
    theirs = torch.load(tmp_path / "ds" / "model.bin", weights_only=True)
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), name
    if stage == 3:  # as DeepSpeed: nothing written unless stage3_gather_16bit_weights_on_model_save
        assert dist.run(2, save_16bit, "zero3d", 3, str(tmp_path / "off"), False) == [False, False]
        assert not (tmp_path / "off").exists()


# --- load_checkpoint(load_optimizer_states=..., load_module_only=...) ------------------------------


def partial_loads(path: str) -> dict:
    import parallel3d

    config = ds_config(2, 1, 2)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    batches = rank_micro_batches(token_batches(4, 1, 2), torch.distributed.get_rank())

    def train(batch) -> None:
        engine.backward(engine(**batch).loss)
        engine.step()

    def exp_avgs() -> list[torch.Tensor]:
        return [s["exp_avg"].clone() for s in engine.optimizer.piece_states()]

    train(batches[0])
    train(batches[1])
    engine.save_checkpoint(path, tag="two")
    saved = (engine.full_parameters(), exp_avgs(), engine.lr_scheduler.last_batch_iteration)
    train(batches[2])
    now = (exp_avgs(), engine.lr_scheduler.last_batch_iteration, engine.global_steps)
    out = {}
    for name, kwargs in {"weights_only": dict(load_optimizer_states=False, load_lr_scheduler_states=False),
                         "module_only": dict(load_module_only=True),
                         "everything": {}}.items():
        engine.load_checkpoint(path, tag="two", **kwargs)
        out[name] = {
            "params": max_rel_param_error(engine.full_parameters(), saved[0])[0],
            "states_kept": all(torch.equal(a, b) for a, b in zip(exp_avgs(), now[0])),
            "states_loaded": all(torch.equal(a, b) for a, b in zip(exp_avgs(), saved[1])),
            "scheduler": engine.lr_scheduler.last_batch_iteration, "steps": engine.global_steps}
        train(batches[3])  # training goes on from each load
        engine.load_checkpoint(path, tag="two")
        train(batches[2])
    out["saved_scheduler"], out["now_scheduler"], out["now_steps"] = saved[2], now[1], now[2]
    return out


def test_partial_checkpoint_loads(dist, tmp_path):
    for r in dist.run(2, partial_loads, str(tmp_path)):
        for name in ("weights_only", "module_only", "everything"):
            assert r[name]["params"] == 0.0, name
        assert r["weights_only"]["states_kept"] and not r["weights_only"]["states_loaded"]
        assert r["weights_only"]["scheduler"] == r["now_scheduler"] and r["weights_only"]["steps"] == 2
        assert r["module_only"]["states_kept"] and r["module_only"]["steps"] == r["now_steps"] == 3
        assert r["module_only"]["scheduler"] == r["now_scheduler"]
        assert r["everything"]["states_loaded"] and r["everything"]["scheduler"] == r["saved_scheduler"]


def refused_checkpoint_arguments(path: str) -> list[str]:
    import parallel3d

    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=ds_config(0, 1, 1))
    messages = []
    for call in (lambda: engine.save_checkpoint(path, save_latest=False),
                 lambda: engine.load_checkpoint(path, load_module_strict=False),
                 lambda: engine.load_checkpoint(path, custom_load_fn=print)):
        try:
            call()
        except parallel3d.ConfigError as err:
            messages.append(str(err).split(":")[0])
    return messages


def test_refused_checkpoint_arguments(dist, tmp_path):
    (messages,) = dist.run(1, refused_checkpoint_arguments, str(tmp_path))
    assert messages == ["save_checkpoint(save_latest=False) is not supported",
                        "load_checkpoint(load_module_strict=False) is not supported",
                        "load_checkpoint(custom_load_fn=...) is not supported"]


# --- a client optimizer beside a config section; gradient_allreduce_op "sum" -----------------------


def client_optimizer_wins() -> tuple[str, str, float]:
    import parallel3d

    model = make_model("llama")
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, optimizer, *_ = parallel3d.initialize(model=model, config=ds_config(1, 1, 1), optimizer=sgd)
    return engine.optimizer_name(), type(optimizer.inner).__name__, optimizer.param_groups[0]["lr"]


def test_client_optimizer_wins_over_the_config_section(dist):
    assert dist.run(1, client_optimizer_wins) == [("SGD", "SGD", 0.5)]


def allreduce_sum_run(engine_kind: str, stage: int):
    config = ds_config(stage, 2, 2, clip=0.0, lr=1e-3)
    config["gradient_allreduce_op"] = "sum"
    batches = rank_micro_batches(token_batches(3, 2, 2), torch.distributed.get_rank())
    if engine_kind == "deepspeed":
        from tests.ds_oracle import deepspeed_losses

        return deepspeed_losses(make_model("llama"), config, batches, return_params=True)
    import parallel3d

    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    losses = []
    for s in range(3):
        total = 0.0
        for batch in batches[2 * s : 2 * s + 2]:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / 2
        t = torch.tensor([total])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.AVG)
        losses.append(t.item())
    return losses, engine.full_parameters()


@pytest.mark.parametrize("stage", [0, 2])
def test_gradient_allreduce_sum_matches_deepspeed(dist, stage):
    ours = dist.run(2, allreduce_sum_run, "zero3d", stage)
    theirs = dist.run(2, allreduce_sum_run, "deepspeed", stage)
    mean = dist.run(2, allreduce_sum_mean_control, stage)
    for (our_losses, our_params), (ds_losses, ds_params), control in zip(ours, theirs, mean):
        assert our_losses == pytest.approx(ds_losses, rel=2e-6)
        err, name = max_rel_param_error({n: our_params[n] for n in ds_params}, ds_params)
        assert err < 2e-6, f"{name} differs from DeepSpeed by {err:.2e}"
        assert max_rel_param_error(control, ds_params)[0] > 1e-4  # the mean would not have matched


def allreduce_sum_mean_control(stage: int) -> dict:
    """The same run with the default mean: SGD without clipping steps twice as far with the sum."""
    import parallel3d

    config = ds_config(stage, 2, 2, clip=0.0, lr=1e-3)
    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    for batch in rank_micro_batches(token_batches(3, 2, 2), torch.distributed.get_rank()):
        engine.backward(engine(**batch).loss)
        engine.step()
    return engine.full_parameters()


# --- set_gradient_accumulation_boundary ------------------------------------------------------------


def manual_boundary_run(engine_kind: str, stage: int) -> dict:
    """DeepSpeed's manual boundary: three backward passes per optimizer step at gas 1, the boundary
    set before each (True for the last), one ``step()`` after them, two steps."""
    config = ds_config(stage, 1, 2, clip=0.0, lr=1e-3)
    batches = rank_micro_batches(token_batches(6, 1, 2), torch.distributed.get_rank())
    model = make_model("llama")
    if engine_kind == "deepspeed":
        from tests.ds_oracle import deepspeed_full_params, make_engine

        engine = make_engine(model, config, batches)
    else:
        import parallel3d

        engine, *_ = parallel3d.initialize(model=model, config=config)
    for s in range(2):
        for i, batch in enumerate(batches[3 * s : 3 * s + 3]):
            loss = engine(**batch).loss
            engine.set_gradient_accumulation_boundary(i == 2)
            engine.backward(loss)
        engine.step()
    counts = (engine.global_steps, engine.micro_steps)
    params = deepspeed_full_params(engine) if engine_kind == "deepspeed" else engine.full_parameters()
    return {"params": params, "counts": counts}


@pytest.mark.parametrize("stage", [1, 2])
def test_manual_accumulation_boundary_matches_deepspeed(dist, stage):
    ours = dist.run(2, manual_boundary_run, "zero3d", stage)
    theirs = dist.run(2, manual_boundary_run, "deepspeed", stage)
    for mine, ds in zip(ours, theirs):
        assert mine["counts"] == ds["counts"] == (2, 2)
        err, name = max_rel_param_error({n: mine["params"][n] for n in ds["params"]}, ds["params"])
        assert err < 2e-6, f"{name} differs from DeepSpeed by {err:.2e}"


# --- zero_optimization.ignore_unused_parameters -----------------------------------------------------


class WithSpare(torch.nn.Module):
    """``spare`` runs on the ranks listed in ``spare_on`` only."""

    def __init__(self, spare_on: tuple[int, ...]) -> None:
        super().__init__()
        self.used = torch.nn.Linear(8, 8)
        self.spare = torch.nn.Linear(8, 8)
        self.spare_on = spare_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.used(x)
        if torch.distributed.get_rank() in self.spare_on:
            h = self.spare(h)
        return h.square().mean()


def unused_run(stage: int, ignore: bool, spare_on: tuple[int, ...]) -> str:
    import parallel3d

    torch.manual_seed(0)
    config = ds_config(stage, 2, 2, ignore_unused_parameters=ignore)
    engine, *_ = parallel3d.initialize(model=WithSpare(spare_on), config=config)
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8)))
            engine.step()
    except AssertionError as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"trained {engine.global_steps}"


@pytest.mark.parametrize("stage", [1, 3])
def test_ignore_unused_parameters_false_names_them(dist, stage):
    for msg in dist.run(2, unused_run, stage, False, ()):
        assert msg.startswith("UnusedParametersError: 2 parameter(s) got no gradient in this accumulation window on "
                              "any data-parallel rank: spare.weight, spare.bias"), msg
    assert dist.run(2, unused_run, stage, False, (0,)) == ["trained 1"] * 2  # used on one rank: used
    assert dist.run(2, unused_run, stage, True, ()) == ["trained 1"] * 2  # DeepSpeed's default


# --- bf16.check_grad_overflow --------------------------------------------------------------------


def bf16_overflow(check: bool) -> tuple[int, bool, bool]:
    import parallel3d

    config = ds_config(2, 1, 1, clip=0.0)
    config["bf16"] = {"enabled": True, "check_grad_overflow": check}
    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    before = engine.full_parameters()
    batch = rank_micro_batches(token_batches(1, 1, 1), 0)[0]
    engine.backward(engine(**batch).loss * float("inf"))
    engine.step()
    after = engine.full_parameters()
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    return engine.skipped_steps, unchanged, all(bool(t.isfinite().all()) for t in after.values())


def test_bf16_check_grad_overflow(dist):
    assert dist.run(1, bf16_overflow, True) == [(1, True, True)]  # DeepSpeed's default: skipped
    assert dist.run(1, bf16_overflow, False) == [(0, False, False)]  # applied, as DeepSpeed does


# --- stage 3 fetch units of a model without _no_split_modules --------------------------------------


class PlainModel(torch.nn.Module):
    """No _no_split_modules: stage 3 gathers each Linear for its own forward; the tied pair stays whole."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 32 if i % 2 == 0 else 16) if i % 2 == 0
                                          else torch.nn.Linear(32, 16) for i in range(4))
        self.head = torch.nn.Linear(16, 16)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i in (2, 3, 0, 1):  # not registration order
            h = torch.relu(self.layers[i](h))
        return torch.nn.functional.mse_loss(self.head(h), y)


def plain_stage3(dp: int) -> dict:
    import parallel3d

    torch.manual_seed(0)
    model = PlainModel()
    config = ds_config(3, 1, dp, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    engine, *_ = parallel3d.initialize(model=model, config=config)
    fetcher = engine.optimizer.fetcher
    live = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: live.append(fetcher.live_numel()))  # after the gather
    g = torch.Generator().manual_seed(7)  # the same batch on every rank: dp 2 then equals one process
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.AVG)
        losses.append(t.item())
    return {"losses": losses, "max_live": max(live), "total": sum(u.padded for u in engine.optimizer.units),
            "params": engine.full_parameters()}


def test_plain_model_stage3_gathers_one_layer_at_a_time(dist):
    ours = dist.run(2, plain_stage3, 2)
    (whole,) = dist.run(1, plain_stage3, 1)  # one process: nothing is sharded
    for r in ours:
        assert r["max_live"] == 16 * 32 + 32  # one Linear (weight and bias) at a time; the tied pair is a root unit
        assert r["total"] > 4 * r["max_live"]
        assert r["losses"] == pytest.approx(whole["losses"], rel=1e-6)
        assert max_rel_param_error(r["params"], whole["params"])[0] < 1e-6


def dataloader_sizes(drop_last: bool) -> list[int]:
    import parallel3d

    config = {**ds_config(0, 1, 1), "dataloader_drop_last": drop_last}
    data = torch.utils.data.TensorDataset(torch.arange(5))
    _, _, loader, _ = parallel3d.initialize(model=make_model("llama"), config=config, training_data=data)
    return [len(batch) for (batch,) in loader]


def test_dataloader_drop_last(dist):
    assert dist.run(1, dataloader_sizes, False) == [[2, 2, 1]]
    assert dist.run(1, dataloader_sizes, True) == [[2, 2]]


def buffer_dtypes(buffer_dtype: str | None) -> tuple[str, str]:
    import parallel3d

    config = {**ds_config(3, 1, 1), "bf16": {"enabled": True}}
    if buffer_dtype is not None:
        config["data_types"] = {"buffer_dtype": buffer_dtype, "param_dtype": "bfloat16"}
    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    inv_freq = next(b for n, b in engine.module.named_buffers() if n.endswith("inv_freq"))
    return str(inv_freq.dtype), str(next(engine.module.parameters()).dtype)


def test_buffer_dtype(dist):
    assert dist.run(1, buffer_dtypes, None) == [("torch.float32", "torch.bfloat16")]  # buffers kept as loaded
    assert dist.run(1, buffer_dtypes, "bf16") == [("torch.bfloat16", "torch.bfloat16")]


def without_optimizer() -> tuple[float, str]:
    import parallel3d

    config = ds_config(3, 1, 1)
    del config["optimizer"]
    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    loss = engine.eval_batch(iter(rank_micro_batches(token_batches(1, 1, 1), 0)))
    batch = rank_micro_batches(token_batches(1, 1, 1), 0)[0]
    engine.backward(engine(**batch).loss)
    try:
        engine.step()
    except parallel3d.UsageError as err:
        return loss, str(err)
    return loss, "no error"


def test_engine_without_optimizer_evaluates_and_refuses_to_step(dist):
    ((loss, message),) = dist.run(1, without_optimizer)
    assert loss > 0
    assert message.startswith("this engine was built without an optimizer")
