"""The rest of the engine surface: dataloader, client optimizers and schedulers, step counting."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches


def _dataloader_shards():
    import parallel3d

    data = torch.arange(40).reshape(20, 2)
    engine, _, loader, _ = parallel3d.initialize(
        model=make_model("llama"), config=ds_config(1, 1, 2), training_data=torch.utils.data.TensorDataset(data)
    )
    rows = [r for (batch,) in loader for r in batch[:, 0].tolist()]
    return rows, [len(b) for (b,) in loader]


def test_dataloader_shards_over_dp(dist):
    (rows0, sizes0), (rows1, sizes1) = dist.run(2, _dataloader_shards)
    assert sizes0 == sizes1 == [2] * 5  # micro-batch 2, 20 samples over 2 ranks
    assert sorted(rows0 + rows1) == list(range(0, 40, 2))  # disjoint and complete


def _client_optimizer_and_scheduler(kind: str):
    import parallel3d

    model = make_model("llama")
    config = ds_config(2, 2, 1)
    del config["optimizer"]
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "instance":
        optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
        sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))  # noqa: E731
        engine, opt, _, lr_sched = parallel3d.initialize(model=model, config=config, optimizer=optimizer, lr_scheduler=sched)
    else:
        factory = lambda gs: torch.optim.AdamW(gs, lr=1e-3, betas=(0.9, 0.95))  # noqa: E731
        engine, opt, _, lr_sched = parallel3d.initialize(model=model, config=config, model_parameters=groups, optimizer=factory)
    batches = iter(rank_micro_batches(token_batches(3, 2, 1), 0))
    lrs = []
    for _ in range(3):
        engine.train_batch(batches)
        lrs.append(engine.get_lr())
    return [g["weight_decay"] for g in opt.param_groups], lrs, engine.global_steps, engine.micro_steps


def test_client_optimizer_instance_keeps_groups_and_scheduler():
    wd, lrs, steps, micro = _client_optimizer_and_scheduler("instance")
    assert wd == [0.1, 0.0]
    assert lrs == [[pytest.approx(1e-3 / (s + 2))] * 2 for s in range(3)]
    assert (steps, micro) == (3, 6)


def test_client_optimizer_factory_with_model_parameters():
    wd, lrs, steps, _ = _client_optimizer_and_scheduler("factory")
    assert wd == [0.1, 0.0]
    assert lrs == [[1e-3, 1e-3]] * 3 and steps == 3


def test_step_only_at_accumulation_boundary():
    import parallel3d

    engine, opt, _, _ = parallel3d.initialize(model=make_model("llama"), config=ds_config(1, 2, 1))
    before = {n: p.clone() for n, p in engine.full_parameters().items()}
    mb = rank_micro_batches(token_batches(1, 2, 1), 0)
    engine.backward(engine(**mb[0]).loss)
    engine.step()
    assert engine.global_steps == 0
    assert all(torch.equal(before[n], p) for n, p in engine.full_parameters().items())
    engine.backward(engine(**mb[1]).loss)
    engine.step()
    assert engine.global_steps == 1
    assert not all(torch.equal(before[n], p) for n, p in engine.full_parameters().items())


@pytest.mark.parametrize("stage", [0, 1])
def test_user_zero_grad_between_micro_batches_is_respected(stage):
    """model.zero_grad() (set_to_none) mid-window drops the earlier micro-batch, as in plain torch.

    Stages 0-1 keep gradients in ``.grad`` (views of the flat buffer) until the step; stages
    2-3 move them into the shard every micro-batch, so there ``engine.zero_grad()`` is the way.
    """
    import parallel3d

    mb = rank_micro_batches(token_batches(1, 2, 1), 0)
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=ds_config(stage, 2, 1, clip=0.0))
    reference = make_model("llama")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    engine.backward(engine(**mb[0]).loss)
    engine.step()
    engine.module.zero_grad()  # the user discards the first micro-batch's gradients
    engine.backward(engine(**mb[1]).loss)
    engine.step()
    (reference(**mb[1]).loss / 2).backward()
    ref_opt.step()
    got = engine.full_parameters()
    for name, p in reference.named_parameters():
        assert torch.allclose(got[name], p, rtol=1e-5, atol=1e-7), name


def test_lr_scheduler_instance_on_the_client_optimizer_drives_the_lr():
    """A torch scheduler built on the client optimizer (as DeepSpeed users do) keeps working."""
    import parallel3d

    model = make_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    config = ds_config(1, 1, 1)
    del config["optimizer"]
    engine, opt, _, sched = parallel3d.initialize(model=model, config=config, optimizer=optimizer, lr_scheduler=scheduler)
    batches = iter(rank_micro_batches(token_batches(3, 1, 1), 0))
    lrs = []
    for _ in range(3):
        engine.train_batch(batches)
        lrs.append(engine.get_lr()[0])
    assert opt.inner is optimizer and sched is scheduler
    assert lrs == pytest.approx([1e-4, 1e-5, 1e-6])


@pytest.mark.parametrize(
    "params,message",
    [({"lr": 1e-3, "betas": [1.5, 0.9]}, "optimizer options are invalid: Invalid beta parameter at index 0: 1.5"),
     ({"lr": -1.0}, "optimizer.params.lr: -1.0 must be a number >= 0")],
)
def test_bad_optimizer_values_stop_before_training(params, message):
    import parallel3d

    config = ds_config(1, 1, 1)
    config["optimizer"]["params"] = params
    with pytest.raises(parallel3d.ConfigError, match=message.replace("(", r"\(")):
        parallel3d.initialize(model=make_model("llama"), config=config)


def test_api_misuse_is_named():
    """A step without a backward, two backwards for one micro-batch, an iterator that runs dry,
    ``loss.backward()`` in place of ``engine.backward(loss)``."""
    import parallel3d
    from parallel3d.errors import UsageError

    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=ds_config(1, 2, 1))
    ids = torch.arange(8)[None]
    with pytest.raises(UsageError, match=r"step\(\) without engine.backward"):
        engine.step()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    with pytest.raises(UsageError, match="called twice"):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    assert engine.global_steps == 0 and engine.micro_steps == 1
    with pytest.raises(UsageError, match="ran out after 1 of the 2"):
        engine.train_batch(iter([{"input_ids": ids, "labels": ids}]))
    with pytest.raises(UsageError, match="ran out after 0 of the 2"):
        engine.eval_batch(iter([]))
    with pytest.raises(RuntimeError, match=r"Direct calls to tensor.backward\(\) bypass the engine"):
        engine(input_ids=ids, labels=ids).loss.backward()


def _no_sync(stage: int, split: bool) -> dict:
    """Two micro-batches' losses per step: backward of each (the first inside no_sync), or of their sum."""
    import parallel3d

    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=ds_config(stage, 1, 2, clip=0.0))
    rank = torch.distributed.get_rank()
    for step in range(2):
        first, second = (torch.arange(8)[None] * (3 + step + 2 * rank + k) % 96 for k in (0, 1))
        if split:
            from parallel3d.runtime.comm_counter import count_collectives

            with engine.no_sync():
                loss = engine(input_ids=first, labels=first).loss  # its batch check agrees on one flag over the ranks
                with count_collectives(engine.mesh) as comm:
                    engine.backward(loss)
            assert not comm.select(group="dp"), "no_sync reduced gradients"
            engine.backward(engine(input_ids=second, labels=second).loss)
        else:
            loss = engine(input_ids=first, labels=first).loss + engine(input_ids=second, labels=second).loss
            engine.backward(loss)
        engine.step()
    return engine.full_parameters()


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_and_the_next_backward_reduces(dist, stage):
    from tests.tiny import max_rel_param_error

    together = dist.run(2, _no_sync, stage, False)
    split = dist.run(2, _no_sync, stage, True)
    for want, got in zip(together, split):
        err, name = max_rel_param_error(got, want)
        assert err < 1e-5, f"{name} differs by {err:.2e}"


def test_no_sync_misuse_is_named():
    import parallel3d
    from parallel3d.errors import UsageError

    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=ds_config(1, 1, 1))
    ids = torch.arange(8)[None]
    with engine.no_sync():
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        with pytest.raises(UsageError, match=r"step\(\) inside engine.no_sync\(\)"):
            engine.step()
        with pytest.raises(UsageError, match="cannot be nested"):
            with engine.no_sync():
                pass
    stage2, *_ = parallel3d.initialize(model=make_model("llama"), config=ds_config(2, 1, 1))
    with pytest.raises(parallel3d.ConfigError, match="no_sync\\(\\) needs ZeRO stage 0 or 1, not 2"):
        with stage2.no_sync():
            pass
    with pytest.raises(AssertionError, match="ZeRO stage"):  # DeepSpeed's type for it, as its tests expect
        with stage2.no_sync():
            pass


def test_deepspeed_spellings(tmp_path):
    """``engine.optimizer.optimizer``, a load from a directory with no checkpoint yet, an Hjson config."""
    import parallel3d

    (tmp_path / "config.json").write_text("{\n  // DeepSpeed reads its .json configs as Hjson\n"
                                          "  train_micro_batch_size_per_gpu: 1\n  zero_optimization: {stage: 1}\n"
                                          "  optimizer: {type: \"Adam\", params: {lr: 1e-3}}\n}\n")
    engine, optimizer, *_ = parallel3d.initialize(model=make_model("llama"), config=str(tmp_path / "config.json"))
    assert engine.zero_optimization_stage() == 1 and optimizer.optimizer is optimizer.inner
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    with pytest.raises(parallel3d.ConfigError, match="no checkpoint in .*nowhere"):
        engine.load_checkpoint(str(tmp_path / "nowhere"))
