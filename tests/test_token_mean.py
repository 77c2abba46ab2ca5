"""``loss_normalization: "tokens"``: the loss is the mean over the global batch's label tokens.

The data has very uneven label counts per row (most of some rows are prompt, labelled -100),
so the mean of micro-batch means differs from the token mean of the concatenated batch. The
oracle is one process running the tiny Llama on all eight rows at once (HF's loss is then the
token mean of the whole batch) with AdamW; every layout -- dp 2 x micro 2 x accumulation 2 at
ZeRO 0-3, dp 1 x micro 8, tp 2, pp 2, tp 2 x dp 2 at stage 3 -- must give its losses and
parameters to 1e-5 after several steps (the engine keeps fp32 master weights, so fp32 here),
and each step's gradient norm before clipping: Adam's steps and clipping hide a gradient that is
off by a constant factor (a dp or accumulation factor), the norm does not.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from tests.tiny import MICRO, SEQ, VOCAB, ds_config, make_model, max_rel_param_error

STEPS = 3
ROWS = 8  # the global batch
RTOL = 1e-5
# Adam's eps bounds how much it amplifies rounding noise in a near-zero gradient entry: at 1e-8 one
# gate_proj entry whose gradient is 9e-10 (the median is 4e-4) moves by lr x sign(noise), and
# summing the same tokens in another order differs there by 2e-6 after three steps.
EPS = 1e-6


def global_batches(steps: int = STEPS, seed: int = 3) -> list[dict]:
    """Per step, ROWS rows whose first k labels are -100, k from 0 to SEQ - 2 (uneven counts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        for row, k in enumerate(torch.randint(0, SEQ - 1, (ROWS,), generator=g).tolist()):
            labels[row, :k] = -100
        labels[0, : SEQ - 2] = -100  # one row with a single label token
        out.append({"input_ids": ids, "labels": labels})
    return out


def rank_windows(dp: int, dp_rank: int, micro: int) -> list[list[dict]]:
    """Per step, this dp rank's micro-batches: global micro-batch g is rows [g*dp*micro, (g+1)*dp*micro),
    rank r takes its r-th slice of ``micro`` rows (the order of parallel3d/job/sampler.py)."""
    windows = []
    for batch in global_batches():
        gas = ROWS // (dp * micro)
        window = []
        for g in range(gas):
            start = (g * dp + dp_rank) * micro
            window.append({k: v[start : start + micro] for k, v in batch.items()})
        windows.append(window)
    return windows


@functools.cache
def oracle() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    model = make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=EPS)
    losses, norms = [], []
    for batch in global_batches():
        loss = model(**batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def train_layout(dp: int, micro: int, stage: int, tp: int = 1, pp: int = 1, normalization: str = "tokens",
                 manual: bool = False, sequence_parallel: bool = False) -> tuple[list[float], dict, list[float]]:
    import parallel3d
    from parallel3d.engine.token_mean import global_label_tokens

    gas = ROWS // (dp * micro)
    config = ds_config(stage, gas, dp, stage3_param_persistence_threshold=0)
    config.update(train_batch_size=ROWS, train_micro_batch_size_per_gpu=micro, loss_normalization=normalization)
    config["optimizer"]["params"]["eps"] = EPS
    if tp > 1:
        config["tensor_parallel"] = {"size": tp, "sequence_parallel": sequence_parallel}
    if pp > 1:
        config["pipeline"] = {"stages": pp}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    dp_rank = engine.mesh.local_rank("dp")
    losses, norms = [], []
    for window in rank_windows(dp, dp_rank, micro):
        if not manual:
            losses.append(engine.train_batch(iter(window)))
            norms.append(engine.get_global_grad_norm())
            continue
        count = global_label_tokens(window, engine.mesh.dp_group, engine.device)  # HF's num_items_in_batch
        total = torch.zeros(())
        for mb in window:
            loss = engine(**mb, num_items_in_batch=count).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        if dp > 1:
            dist.all_reduce(total, group=engine.mesh.dp_group)
        losses.append(total.item())
        norms.append(engine.get_global_grad_norm())
    return losses, engine.full_parameters(), norms


def _check(results: list) -> None:
    """Every rank's losses and parameters (a pipeline rank holds its stage's) against the oracle's."""
    want_losses, want_params, want_norms = oracle()
    for losses, params, norms in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert norms == pytest.approx(want_norms, rel=RTOL)
        err, name = max_rel_param_error(params, {n: want_params[n] for n in params})
        assert err < RTOL, f"{name} differs by {err:.2e}"
    assert set().union(*(params for _, params, _ in results)) == set(want_params)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp2_micro2_accumulation2_equals_one_process(dist, stage):
    _check(dist.run(2, train_layout, 2, 2, stage))


def test_dp1_micro8_equals_one_process(dist):
    _check(dist.run(1, train_layout, 1, 8, 0))


def test_manual_loop_with_num_items_in_batch(dist):
    """The DeepSpeed loop, as HF Trainer drives it: the count passed to forward, backward sums."""
    _check(dist.run(2, train_layout, 2, 2, 2, manual=True))


def test_tensor_parallel_vocab_loss(dist):
    _check(dist.run(2, train_layout, 1, 4, 1, tp=2))


def test_tensor_parallel_with_sequence_parallel(dist):
    _check(dist.run(2, train_layout, 1, 4, 2, tp=2, sequence_parallel=True))


def test_pipeline_last_stage_loss(dist):
    _check(dist.run(2, train_layout, 1, 2, 1, pp=2))


def test_tp2_dp2_stage3(dist):
    _check(dist.run(4, train_layout, 2, 2, 3, tp=2))


def test_pp2_dp2_stage1(dist):
    _check(dist.run(4, train_layout, 2, 1, 1, pp=2))


def test_micro_batch_mean_differs_on_this_data(dist):
    """The default (mean of micro-batch means) does not give the token mean here: the data tests something."""
    losses, _, _ = dist.run(2, train_layout, 2, 2, 0, normalization="micro_batch")[0]
    assert abs(losses[0] - oracle()[0][0]) > 1e-3


def test_refused_with_gradient_sum():
    from parallel3d.config.config import load_config
    from parallel3d.errors import ConfigError

    config = {**ds_config(0, 1, 1), "loss_normalization": "tokens", "gradient_allreduce_op": "sum"}
    with pytest.raises(ConfigError, match='loss_normalization "tokens" with gradient_allreduce_op "sum"'):
        load_config(config, 1)


def _tuple_batches():
    import parallel3d
    from parallel3d.errors import ConfigError

    config = {**ds_config(0, 1, 2), "loss_normalization": "tokens"}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    ids = torch.zeros(MICRO, SEQ, dtype=torch.long)
    try:
        engine.train_batch(iter([(ids, None, None)] if dist.get_rank() == 0 else [{"input_ids": ids, "labels": ids}]))
    except ConfigError as exc:
        return str(exc)
    return None


def test_refuses_batches_it_cannot_count(dist):
    """A rank whose micro-batch has no labels stops every rank with one message, before the count."""
    for message in dist.run(2, _tuple_batches):
        assert message is not None and 'loss_normalization "tokens" needs each micro-batch as a dict' in message


def test_direct_call_with_labels_needs_num_items_in_batch():
    """engine(**batch) under "tokens" without num_items_in_batch would get the micro-batch mean, which
    backward scales as a token-mean loss (no 1/accumulation, times dp): refused; train_batch still trains."""
    import parallel3d
    from parallel3d.errors import ConfigError
    from parallel3d.engine.token_mean import global_label_tokens

    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config={
        **ds_config(0, 2, 1), "loss_normalization": "tokens"})
    window = rank_windows(1, 0, MICRO)[0][:2]
    with pytest.raises(ConfigError, match=r'engine\(\.\.\.\): loss_normalization "tokens": a call with labels needs '
                                          r"num_items_in_batch, .*global_label_tokens.*train_batch.*\"micro_batch\""):
        engine(**window[0])
    assert engine(input_ids=window[0]["input_ids"]).loss is None  # no labels: nothing to scale
    count = global_label_tokens(window, engine.mesh.dp_group, engine.device)
    assert torch.isfinite(engine(**window[0], num_items_in_batch=count).loss)
    assert torch.isfinite(torch.tensor(engine.train_batch(iter(window))))


def test_model_whose_loss_ignores_num_items_is_refused():
    """transformers marks such classes (qwen3_vl, glm4v) accepts_loss_kwargs = False: refused under
    "tokens" at initialize, accepted under "micro_batch"."""
    import parallel3d
    from parallel3d.errors import ConfigError

    model = make_model("llama")
    model.__class__ = type("NoLossKwargsForCausalLM", (type(model),), {"accepts_loss_kwargs": False})
    with pytest.raises(ConfigError, match='loss_normalization "tokens": NoLossKwargsForCausalLM computes its loss '
                                          "without num_items_in_batch .*accepts_loss_kwargs = False"):
        parallel3d.initialize(model=model, config={**ds_config(0, 1, 1), "loss_normalization": "tokens"})
    parallel3d.initialize(model=model, config=ds_config(0, 1, 1))
