"""Pipeline runtime: stage split, p2p and the executor against the single-process model.

Every rank builds the same tiny model, computes the oracle (mean micro-batch loss and its
gradient, fp32) itself, then splits a copy and runs a schedule; it returns only the loss and
the worst relative gradient errors, so nothing large crosses the harness. Micro-batches carry
padding and ignored labels, so token counts differ between them: the oracle is the mean of
the micro-batch losses (the executor's definition), which also checks the 1/m scaling.
"""

from __future__ import annotations

import copy

import pytest
import torch

from parallel3d.errors import ConfigError
from tests.tiny_pp import FAMILIES, LAYERS, make_pp_model, micro_batches, oracle, pp_group, rel_error

RTOL = 1e-5
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
M = 4  # micro-batches: a multiple of P for interleaving, >= P for 1f1b / zb_h1


def parity(kind: str, pp: int, attn: str, schedules: tuple[str, ...], m: int = M) -> dict:
    """On every rank: each schedule's loss and gradients over ``m`` micro-batches against the
    single-process model."""
    import torch.distributed as dist

    from parallel3d.pipeline.executor import PipelineExecutor
    from parallel3d.pipeline.stage import split_model

    group = pp_group(pp)
    rank = dist.get_rank(group)
    ref = make_pp_model(kind, attn=attn)
    batches = micro_batches(m)
    want_loss, want = oracle(ref, batches)
    out = {}
    for schedule in schedules:
        v = 2 if schedule == "interleaved_1f1b" else 1
        pipe = split_model(copy.deepcopy(ref), pp, rank, virtual_stages=v)
        loss = PipelineExecutor(pipe, group, schedule).run(batches)
        errors, missing = {}, []
        for name, p in pipe.hf_named_parameters():
            if p.grad is None:
                missing.append(name)
            else:
                errors[name] = rel_error(p.grad, want[name])
        tied = {t.name: rel_error(t.param.grad, want[t.name]) for t in pipe.tied}
        out[schedule] = {"loss": loss.item(), "want": want_loss, "errors": errors, "missing": missing,
                         "tied": tied, "names": sorted(errors) + missing}
    return out


CASES = [(kind, pp, "sdpa") for kind in FAMILIES for pp in (2, 4)] + [("llama", 2, "eager"), ("gpt2", 4, "eager")]


@pytest.mark.parametrize("m", [1, 3])
def test_one_f_one_b_with_fewer_micro_batches_than_stages(dist, m):
    """1f1b and zb_h1 with m < P (a DeepSpeed config with gradient_accumulation_steps 1 and
    pipeline stages): the warm-up holds every micro-batch, and the step still equals one process."""
    for rank, r in enumerate(dist.run(4, parity, "llama", 4, "sdpa", ("1f1b", "zb_h1"), m)):
        for schedule, got in r.items():
            assert got["loss"] == pytest.approx(got["want"], rel=RTOL), (rank, schedule)
            assert not got["missing"] and max(got["errors"].values()) < RTOL, (rank, schedule)


@pytest.mark.parametrize("kind,pp,attn", CASES, ids=lambda v: str(v))
def test_every_schedule_matches_single_process(dist, kind, pp, attn):
    results = dist.run(pp, parity, kind, pp, attn, SCHEDULES)
    all_names = {n for n, _ in make_pp_model(kind).named_parameters(remove_duplicate=False)}
    for schedule in SCHEDULES:
        seen: set[str] = set()
        for rank, r in enumerate(results):
            got = r[schedule]
            assert got["loss"] == pytest.approx(got["want"], rel=RTOL), f"{schedule} rank {rank} loss"
            assert not got["missing"], f"{schedule} rank {rank}: no gradient for {got['missing']}"
            worst = max(got["errors"], key=got["errors"].get)
            assert got["errors"][worst] < RTOL, f"{schedule} rank {rank}: {worst} off by {got['errors'][worst]:.2e}"
            seen.update(got["names"])
            if kind in ("qwen2", "gpt2"):  # tied head: a copy on ranks 0 and P-1, summed gradient
                assert len(got["tied"]) == (1 if rank in (0, pp - 1) else 0), got["tied"]
            for name, err in got["tied"].items():
                assert err < RTOL, f"{schedule} rank {rank}: tied {name} off by {err:.2e}"
        tied_aliases = {"lm_head.weight"} if kind in ("qwen2", "gpt2") else set()
        assert seen | tied_aliases == all_names, f"{schedule}: parameters held by no rank: {all_names - seen}"


# ---------------------------------------------------------------------------------------------
# hooks, timeline, evaluation, accumulation over two steps, activation checkpointing,
# P = 1 with local hand-offs, tied copies stay bitwise equal, executor bad input


def extras(tmp: str) -> dict:
    import torch.distributed as dist

    from parallel3d.pipeline.draw import read_chrome_trace
    from parallel3d.pipeline.executor import PipelineExecutor
    from parallel3d.pipeline.stage import split_model

    out: dict = {}
    group = pp_group(2)
    rank = dist.get_rank(group)
    ref = make_pp_model("gpt2")
    batches = micro_batches(M)
    want_loss, want = oracle(ref, batches)

    # hooks around every B and W; is_last once per chunk, on the weight-accumulating pass.
    # zb_h1 runs with activation checkpointing: recomputation under the split backward
    for schedule in ("zb_h1", "interleaved_1f1b"):
        v = 2 if schedule == "interleaved_1f1b" else 1
        pipe = split_model(copy.deepcopy(ref), 2, rank, virtual_stages=v,
                           activation_checkpointing=schedule == "zb_h1")
        calls: list = []
        runs = [0] * sum(len(c.layers) for c in pipe.chunks)  # forward calls of each of this rank's blocks
        blocks = [b for c in pipe.chunks for b in c.layers]
        hooks = [b.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
                 for i, b in enumerate(blocks)]
        ex = PipelineExecutor(pipe, group, schedule, before_backward=lambda bp: calls.append(("pre", *bp)),
                              after_backward=lambda bp: calls.append(("post", *bp)), record=True)
        loss = ex.run(batches)
        for h in hooks:
            h.remove()
        out[schedule] = {"loss": loss.item(), "calls": list(calls), "timeline": ex.gather_timeline(),
                         "block_runs": runs}
        if schedule == "zb_h1":
            path = ex.write_chrome_trace(f"{tmp}/trace.json")
            out["trace"] = (path is not None, read_chrome_trace(path) if path else None)
        # a second step accumulates into .grad; the tied copies stay bitwise equal
        ex.run(batches)
        out[schedule]["tied_grad"] = [t.param.grad.clone() for t in pipe.tied]
        out[schedule]["grad2"] = max(rel_error(p.grad, 2 * want[n]) for n, p in pipe.hf_named_parameters())
        out[schedule]["eval"] = ex.evaluate(batches).item()

    # P = 1 (pp groups of one rank): interleaved chunks hand over locally, the tie stays one tensor
    solo = pp_group(1)
    pipe = split_model(copy.deepcopy(ref), 1, 0, virtual_stages=2)
    # use_cache=False (what HF training loops pass) is accepted and changes nothing
    loss = PipelineExecutor(pipe, solo, "interleaved_1f1b").run([{**b, "use_cache": False} for b in batches])
    out["solo"] = {"loss": loss.item(), "tied": len(pipe.tied),
                   "err": max(rel_error(p.grad, want[n]) for n, p in pipe.hf_named_parameters())}
    out["want"] = want_loss

    # bad input to the executor, before any communication
    pipe = split_model(copy.deepcopy(ref), 2, rank)
    errors = []
    for schedule, batch in (("gpipe", [{"input_ids": batches[0]["input_ids"]}]),
                            ("gpipe", [{**batches[0], "token_type_ids": batches[0]["input_ids"]}]),
                            ("gpipe", [{**batches[0], "use_cache": True}])):
        try:
            PipelineExecutor(pipe, group, schedule).run(batch)
        except ConfigError as exc:
            errors.append(str(exc))
    for schedule, v in (("interleaved_1f1b", 1), ("pipedream", 1)):
        try:
            PipelineExecutor(pipe, group, schedule)
        except ConfigError as exc:
            errors.append(str(exc))
    try:
        pipe(batches[0]["input_ids"])
    except ConfigError as exc:
        errors.append(str(exc))
    out["errors"] = errors

    # tied copies made unequal are re-synchronised from pp rank 0
    from parallel3d.pipeline.stage import sync_tied_params

    with torch.no_grad():
        pipe.tied[0].param.add_(float(rank))
    sync_tied_params(pipe, group)
    out["synced"] = pipe.tied[0].param.detach().clone()
    return out


def test_hooks_timeline_eval_and_local_handoff(dist, tmp_path):
    results = dist.run(2, extras, str(tmp_path))
    want = results[0]["want"]
    for rank, r in enumerate(results):
        for schedule in ("zb_h1", "interleaved_1f1b"):
            got = r[schedule]
            assert got["loss"] == pytest.approx(want, rel=RTOL)
            assert got["eval"] == pytest.approx(want, rel=RTOL)
            assert got["grad2"] < RTOL, "a second run must accumulate into .grad"
            v = 2 if schedule == "interleaved_1f1b" else 1
            pre = [c[1:] for c in got["calls"] if c[0] == "pre"]
            post = [c[1:] for c in got["calls"] if c[0] == "post"]
            assert pre == post
            kinds = {"B", "W"} if schedule == "zb_h1" else {"B"}
            assert {c[2] for c in pre} == kinds
            assert len(pre) == M * v * len(kinds)
            weight_passes = [c for c in pre if c[3]]  # accumulates_weights
            assert all(c[2] == ("W" if schedule == "zb_h1" else "B") for c in weight_passes)
            assert len(weight_passes) == M * v
            lasts = [c for c in pre if c[4]]
            assert sorted(c[1] for c in lasts) == list(range(v)), "is_last once per chunk"
            assert [c for c in pre if c[5]] == [weight_passes[-1]]
            # timeline: every compute action of both ranks, ordered, non-overlapping per rank
            tl = got["timeline"]
            assert len(tl) == 2 * M * v * (3 if schedule == "zb_h1" else 2)
            for rk in range(2):
                mine = [iv for iv in tl if iv.rank == rk]
                assert all(a.end <= b.start + 1e-9 for a, b in zip(mine, mine[1:]))
                assert all(iv.end >= iv.start >= 0 for iv in mine)
        # each checkpointed block runs in F and is recomputed once by B and once by W (one weight
        # call per block, not one per parameter group); stage 0 has no B: its whole backward is W
        assert r["zb_h1"]["block_runs"] == [M * (2 if rank == 0 else 3)] * 4, r["zb_h1"]["block_runs"]
        assert r["interleaved_1f1b"]["block_runs"] == [M] * 4
        assert torch.equal(results[0]["zb_h1"]["tied_grad"][0], results[1]["zb_h1"]["tied_grad"][0])
        assert r["solo"]["loss"] == pytest.approx(want, rel=RTOL)
        assert r["solo"]["err"] < RTOL and r["solo"]["tied"] == 0
    written, intervals = results[0]["trace"]
    assert written and results[1]["trace"] == (False, None)
    assert sorted((iv.rank, iv.kind, iv.microbatch) for iv in intervals) == sorted(
        (iv.rank, iv.kind, iv.microbatch) for iv in results[0]["zb_h1"]["timeline"])
    errors = results[0]["errors"]
    assert len(errors) == 6, errors
    assert "micro-batch 0 must be a dict with 'input_ids' and 'labels'" in errors[0]
    assert "micro-batch 0 has unsupported keys ['token_type_ids']" in errors[1]
    assert "micro-batch 0 asks for use_cache=True; pipeline stages train without a key/value cache" in errors[2]
    assert "schedule 'interleaved_1f1b' needs virtual_stages >= 2" in errors[3]
    assert "unknown pipeline schedule 'pipedream'" in errors[4]
    assert "a pipelined model is not called directly: run a step with PipelineExecutor.run" in errors[5]
    assert torch.equal(results[0]["synced"], results[1]["synced"])


def _hf_checkpointing_under_zb_h1(reentrant: bool) -> str | list[int]:
    """ZB-H1 through initialize on a model checkpointed by transformers itself: the ConfigError's message
    (reentrant), or how often each of this rank's blocks' MLP ran over one step (non-reentrant; module
    hooks on the block itself run outside transformers' checkpoint, so not in its recomputations)."""
    import parallel3d
    from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches

    model = make_model("llama", num_hidden_layers=4)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    config = ds_config(1, M, 1)
    config["pipeline"] = {"stages": 2, "schedule": "zb_h1"}
    try:
        engine = parallel3d.initialize(model=model, config=config)[0]
    except ConfigError as exc:
        return str(exc)
    blocks = [b for c in engine.loop.pipe.chunks for b in c.layers]
    runs = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.mlp.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    engine.train_batch(iter(rank_micro_batches(token_batches(1, M, 1), 0)))
    return runs


def test_zb_h1_under_the_models_own_checkpointing(dist):
    """Reentrant checkpointing cannot run ZB-H1's split backward: refused at initialize on every rank (it
    raised on the second stage mid-step while the first waited). Non-reentrant runs, and its blocks are
    recomputed once by the input-gradient pass and once by the weight pass, as under the pipeline's own
    checkpointing (one weight-gradient call per block, not one per parameter group)."""
    for message in dist.run(2, _hf_checkpointing_under_zb_h1, True):
        assert "pipeline.schedule 'zb_h1'" in message and "use_reentrant" in message, message
    for rank, runs in enumerate(dist.run(2, _hf_checkpointing_under_zb_h1, False)):
        assert runs == [M * (2 if rank == 0 else 3)] * 2, runs


# ---------------------------------------------------------------------------------------------
# splitting without processes: balance, partition, memory, bad input


def _blocks(pipe) -> list[list[int]]:
    return [c.block_indices for c in pipe.chunks]


def test_balance_methods_and_partition():
    from parallel3d.pipeline.stage import partition_blocks, split_model

    # equal blocks, a heavy embedding: parameter balancing gives stage 0 fewer blocks
    assert partition_blocks([1.0] * 8, 3) == [3, 3, 2] or partition_blocks([1.0] * 8, 3) == [2, 3, 3]
    assert partition_blocks([1.0] * 8, 2, first_extra=2.0) == [3, 5]
    assert partition_blocks([1.0, 1.0, 4.0, 1.0], 2) == [2, 2]
    big_vocab = dict(vocab_size=4000)
    by_params = [_blocks(split_model(make_pp_model("llama", **big_vocab), 4, r)) for r in range(4)]
    assert by_params[0][0][0] == 0 and by_params[-1][0][-1] == LAYERS - 1
    assert len(by_params[0][0]) < len(by_params[1][0]), by_params  # 128k-param embedding vs ~13k blocks
    by_layers = [_blocks(split_model(make_pp_model("llama"), 3, r, balance="layers")) for r in range(3)]
    assert by_layers == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7]]]
    explicit = [_blocks(split_model(make_pp_model("gpt2"), 2, r, virtual_stages=2, partition=[1, 3, 2, 2]))
                for r in range(2)]
    assert explicit == [[[0], [4, 5]], [[1, 2, 3], [6, 7]]]  # chunk c of rank r is stage c*P + r


def test_split_keeps_only_this_ranks_parameters():
    from parallel3d.pipeline.stage import split_model

    for kind in ("llama", "gpt2"):
        ref = make_pp_model(kind)
        full = {n: p.numel() for n, p in ref.named_parameters()}
        held = []
        for rank in range(4):
            model = copy.deepcopy(ref)
            pipe = split_model(model, 4, rank)
            names = [n for n, _ in pipe.hf_named_parameters()]
            held.append(set(names))
            # the HF shell keeps exactly the stage's parameters, under the same names
            assert {n for n, _ in model.named_parameters()} == set(names) or kind == "gpt2"
            assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in pipe.parameters())
            assert sum(p.numel() for p in pipe.parameters()) < 0.45 * sum(full.values())
        assert set().union(*held) | {"lm_head.weight"} >= set(full)
        if kind == "gpt2":
            assert "transformer.wte.weight" in held[0] and "lm_head.weight" in held[3]
            assert "transformer.wpe.weight" in held[0]


def test_bad_split_input():
    from transformers import XGLMConfig, XGLMForCausalLM

    from parallel3d.pipeline.stage import split_model

    cases = [
        (lambda: split_model(make_pp_model("llama", num_hidden_layers=3), 4, 0),
         "LlamaForCausalLM has 3 blocks (model.layers) but 4 stages need at least one block each; use at most 3 "
         "stages"),
        (lambda: split_model(make_pp_model("llama", num_hidden_layers=6), 4, 0, virtual_stages=2),
         "LlamaForCausalLM has 6 blocks (model.layers) but 4 stages x 2 virtual stages = 8 model chunks need at "
         "least one block each"),
        (lambda: split_model(make_pp_model("gpt2", n_layer=10), 2, 0, virtual_stages=2),
         "interleaving needs the number of blocks to be a multiple of num_stages x virtual_stages (Megatron's "
         "rule), got 10 blocks for 2 stages x 2 virtual stages = 4 model chunks"),
        (lambda: split_model(make_pp_model("llama"), 2, 0, partition=[3, 4]),
         "pipeline.partition [3, 4] sums to 7 blocks but LlamaForCausalLM has 8 blocks (model.layers)"),
        (lambda: split_model(make_pp_model("llama"), 2, 0, partition=[8]),
         "pipeline.partition has 1 entries but the pipeline has 2 stages"),
        (lambda: split_model(make_pp_model("llama"), 2, 0, partition=[0, 8]),
         "pipeline.partition [0, 8] has a stage with fewer than 1 block"),
        (lambda: split_model(make_pp_model("llama"), 2, 0, balance="flops"),
         "pipeline balance 'flops' is unknown; allowed: parameters, layers"),
        (lambda: split_model(make_pp_model("llama"), 2, 2), "pipeline rank must be in [0, 2), got 2"),
        (lambda: split_model(XGLMForCausalLM(XGLMConfig(vocab_size=64, d_model=16, ffn_dim=32, num_layers=2,
                                                        attention_heads=2)), 2, 0),
         "pipeline parallelism does not support XGLMForCausalLM (model_type='xglm'): its config has no "
         "base_model_pp_plan and zero3d declares none for its family; supported: every family whose config ships "
         "base_model_pp_plan, and BLOOM, CodeGen, Falcon, GPT-2, GPT-BigCode, GPT-J, OPT, StableLM"),
        (lambda: split_model(make_pp_model("llama").model, 2, 0),
         "LlamaModel (model_type='llama') is not a causal LM with a head; pipeline parallelism splits the "
         "*ForCausalLM class (LlamaForCausalLM)"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError) as info:
            make()
        assert message in str(info.value), str(info.value)


def test_stages_chained_by_hand_match_hf_with_sliding_window_layers():
    """Qwen2 with sliding-window layers: each stage builds the mask of each block's layer type
    (eager and sdpa), so stages run in sequence in one process give HF's loss and gradients."""
    from parallel3d.pipeline.stage import split_model

    for attn in ("sdpa", "eager"):
        ref = make_pp_model("qwen2", attn=attn, use_sliding_window=True, sliding_window=3, max_window_layers=4)
        assert set(ref.config.layer_types) == {"full_attention", "sliding_attention"}
        batches = micro_batches(2)
        want_loss, want = oracle(ref, batches)
        pipes = [split_model(copy.deepcopy(ref), 2, r, partition=[3, 5]) for r in range(2)]
        total = 0.0
        for mb in batches:
            x = mb["input_ids"]
            for pipe in pipes:
                chunk = pipe.chunks[0]
                x = chunk(x, attention_mask=mb.get("attention_mask"), labels=mb["labels"] if chunk.is_last else None)
            (x / len(batches)).backward()
            total += x.item() / len(batches)
        assert total == pytest.approx(want_loss, rel=RTOL)
        for pipe in pipes:
            for name, p in pipe.hf_named_parameters():
                if not any(t.param is p for t in pipe.tied):  # the tie is summed by the executor
                    assert rel_error(p.grad, want[name]) < RTOL, name
