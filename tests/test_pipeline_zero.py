"""Pipeline stages composed with ZeRO 0-3 on the pp x dp mesh, against single-process AdamW."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.tiny import ds_config, make_model, oracle_run, rank_micro_batches, token_batches

STEPS, GAS, PP, DP = 5, 4, 2, 2
RTOL = 1e-5


def train_pipeline(kind: str, stage: int, schedule: str, extra: dict, zero: dict | None = None) -> tuple[list[float], dict]:
    """``extra``: more of the config's ``pipeline`` section; ``zero``: more of ``zero_optimization``."""
    import parallel3d

    config = ds_config(stage, GAS, DP, stage3_param_persistence_threshold=0, reduce_bucket_size=3000, **(zero or {}))
    config["pipeline"] = {"stages": PP, "schedule": schedule, **extra}
    model = make_model(kind, num_hidden_layers=4) if kind == "llama" else make_model(kind, n_layer=4)
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, DP), engine.mesh.local_rank("dp")))
    losses = [engine.train_batch(data_iter) for _ in range(STEPS)]
    return losses, engine.full_parameters()


@functools.cache
def oracle_dp(kind: str, dp: int):
    overrides = {"num_hidden_layers": 4} if kind == "llama" else {"n_layer": 4}
    return oracle_run(kind, token_batches(STEPS, GAS, dp), model=make_model(kind, **overrides))


def origin(name: str, params: dict) -> str:
    """The oracle's name for a stage's param: GPT-2's head is a copy of the tied embedding."""
    return name if name in params else {"lm_head.weight": "transformer.wte.weight"}[name]


def assert_stages_match(results: list, want_losses: list[float], want_params: dict) -> None:
    """Every rank's losses, and each stage's parameters, equal the oracle's; together they cover it."""
    seen = set()
    for losses, params in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        for name, got in params.items():
            want = want_params[origin(name, want_params)]
            err = ((got - want).norm() / want.norm()).item()
            assert err < RTOL, f"{name} differs by {err:.2e}"
            seen.add(origin(name, want_params))
    assert seen == set(want_params)  # the stages together hold every parameter


@pytest.mark.parametrize(
    "kind,stage,schedule,extra",
    [
        ("llama", 0, "1f1b", {}),
        ("llama", 1, "gpipe", {}),
        ("llama", 2, "zb_h1", {}),
        ("llama", 3, "1f1b", {}),
        ("llama", 3, "interleaved_1f1b", {"virtual_stages": 2}),
        ("gpt2", 2, "1f1b", {}),
        ("gpt2", 3, "zb_h1", {"activation_checkpointing": True}),
        # each chunk's gradients reduced after its own passes; the tied copy held for the stage sum
        ("gpt2", 1, "interleaved_1f1b", {"virtual_stages": 2}),
        ("llama", 2, "interleaved_1f1b", {"virtual_stages": 2}),
        ("gpt2", 3, "1f1b", {"keep_full_gradients": True}),
        # stage 3 gathers each block around each use, also when backward recomputes it
        ("gpt2", 3, "gpipe", {"activation_checkpointing": True}),
    ],
)
def test_pp_x_dp_matches_single_process(dist, kind, stage, schedule, extra):
    results = dist.run(PP * DP, train_pipeline, kind, stage, schedule, extra)
    assert_stages_match(results, *oracle_dp(kind, DP))


def _blocks_gathered_at_once(schedule: str, extra: dict) -> tuple[int, int]:
    """Stage 3 under pipelines, no prefetch: the most blocks (of this rank's) gathered at a time."""
    import parallel3d

    config = ds_config(3, GAS, DP, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    config["pipeline"] = {"stages": PP, "schedule": schedule, **extra}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama", num_hidden_layers=8), config=config)
    fetcher = engine.optimizer.fetcher
    blocks = [us for m, us in fetcher.module_units if type(m).__name__ == "LlamaDecoderLayer"]  # not table, head
    most = 0
    gather = fetcher.gather

    def counting(units):
        nonlocal most
        gather(units)
        most = max(most, sum(any(u.is_materialized for u in us) for us in blocks))

    fetcher.gather = counting
    data_iter = iter(rank_micro_batches(token_batches(2, GAS, DP), engine.mesh.local_rank("dp")))
    for _ in range(2):
        engine.train_batch(data_iter)
    return most, len(blocks)


@pytest.mark.parametrize("schedule,extra,most", [("1f1b", {}, 2), ("interleaved_1f1b", {"virtual_stages": 2}, 2),
                                                 ("gpipe", {"activation_checkpointing": True}, 2),
                                                 ("zb_h1", {}, 2), ("zb_h1", {"activation_checkpointing": True}, 2)])
def test_stage3_gathers_blocks_per_use_inside_pipelines(dist, schedule, extra, most):
    """Four blocks per rank: at most two are whole at a time (the one in use and one whose
    reduction is in flight); under ZB-H1 also across its input- and weight-gradient passes."""
    for gathered, blocks in dist.run(PP * DP, _blocks_gathered_at_once, schedule, extra):
        assert blocks == 4 and 1 <= gathered <= most, gathered


def _pending_at_block_forwards() -> tuple[list[int], list[int]]:
    """ZeRO-2 under 1F1B: the reductions still pending when each block's forward starts, before
    and after the engine's reap hook, once every one of them has completed on the wire."""
    import parallel3d

    config = ds_config(2, GAS, DP, reduce_bucket_size=3000, overlap_comm=True)
    config["pipeline"] = {"stages": PP, "schedule": "1f1b"}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama", num_hidden_layers=4), config=config)
    reducer = engine.optimizer.reducer
    before, after = [], []

    def complete_on_the_wire(*_):  # runs first: the collectives finish, their buffers stay held
        for work, *_ in reducer._pending:
            for w in getattr(work, "works", [work] if work is not None else []):
                w.wait()
        before.append(len(reducer._pending))

    for chunk in engine.loop.pipe.chunks:
        for block in chunk.layers:
            block.register_forward_pre_hook(complete_on_the_wire, prepend=True)
            block.register_forward_pre_hook(lambda *_: after.append(len(reducer._pending)))
    data_iter = iter(rank_micro_batches(token_batches(2, GAS, DP), engine.mesh.local_rank("dp")))
    for _ in range(2):
        engine.train_batch(data_iter)
    return before, after


def test_finished_reductions_are_freed_before_the_next_forward(dist):
    """The last units a backward pass launches (the embedding's, on the first stage) are not kept
    alive through the next forward once their collective is done."""
    results = dist.run(PP * DP, _pending_at_block_forwards)
    assert any(max(before) > 0 for before, _ in results)  # a pass left reductions in flight
    for _, after in results:
        assert after and max(after) == 0, after


def _forward_under_pipeline():
    import parallel3d

    config = ds_config(1, GAS, DP)
    config["pipeline"] = {"stages": PP}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    try:
        engine(input_ids=torch.zeros(1, 4, dtype=torch.long))
    except parallel3d.ConfigError as exc:
        return str(exc)
    return "no error"


def test_forward_under_pipeline_is_refused(dist):
    for message in dist.run(PP * DP, _forward_under_pipeline):
        assert message.startswith("engine.forward (engine(...)) is not available with pipeline.stages > 1")


def _eval_three(pp: int):
    import parallel3d

    config = ds_config(1, GAS, DP)
    config["pipeline"] = {"stages": pp}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama", num_hidden_layers=4), config=config)
    batches = rank_micro_batches(token_batches(1, GAS, DP), engine.mesh.local_rank("dp"))
    return engine.eval_batch(iter(batches), num_micro_batches=3)


@pytest.mark.parametrize("pp", [1, PP])
def test_eval_batch_of_any_length_is_the_single_process_mean(dist, pp):
    """One ``eval_batch`` call on every layout: a 3-micro-batch window (shorter than GAS)."""
    model, data = make_model("llama", num_hidden_layers=4), token_batches(1, GAS, DP)
    with torch.no_grad():
        want = sum(float(model(input_ids=data[0, a, r], labels=data[0, a, r]).loss)
                   for a in range(3) for r in range(DP)) / (3 * DP)
    assert dist.run(pp * DP, _eval_three, pp) == pytest.approx([want] * pp * DP, rel=RTOL)


def train_3d(kind: str, stage: int, schedule: str, dp: int, sequence_parallel: bool = False,
             extra: dict | None = None) -> tuple[list[float], dict]:
    import parallel3d

    config = ds_config(stage, GAS, dp, stage3_param_persistence_threshold=0, reduce_bucket_size=3000)
    config["pipeline"] = {"stages": PP, "schedule": schedule, **(extra or {})}
    config["tensor_parallel"] = {"size": 2, "sequence_parallel": sequence_parallel}
    model = make_model(kind, num_hidden_layers=4) if kind == "llama" else make_model(kind, n_layer=4)
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp")))
    return [engine.train_batch(data_iter) for _ in range(STEPS)], engine.full_parameters()


@pytest.mark.parametrize(
    "kind,stage,schedule,dp",
    [("llama", 1, "1f1b", 1), ("gpt2", 3, "zb_h1", 1), ("llama", 2, "1f1b", 2)],
)
def test_3d_mesh_matches_single_process(dist, kind, stage, schedule, dp):
    """pp x dp x tp on one mesh: tp-split blocks inside pipeline stages, ZeRO over dp."""
    results = dist.run(PP * dp * 2, train_3d, kind, stage, schedule, dp)
    assert_stages_match(results, *oracle_dp(kind, dp))


@pytest.mark.parametrize(
    "kind,stage,schedule,dp,extra",
    [("llama", 1, "1f1b", 1, {}), ("gpt2", 2, "interleaved_1f1b", 1, {"virtual_stages": 2}),
     ("llama", 3, "zb_h1", 1, {"activation_checkpointing": True})],
)
def test_sequence_parallel_inside_pipeline_stages_matches_single_process(dist, kind, stage, schedule, dp, extra):
    """Each chunk splits the sequence at its first block and gathers it after its last; stages
    exchange whole sequences, so every stage's program sees the masks and positions it would
    without tensor parallelism."""
    results = dist.run(PP * dp * 2, train_3d, kind, stage, schedule, dp, True, extra)
    assert_stages_match(results, *oracle_dp(kind, dp))
