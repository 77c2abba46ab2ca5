"""Types the coverage script used to skip (its tiny configs did not run in transformers), now
built from their config's metadata by ``models/tiny_config.py``, at tp 2 and pp 2 (1F1B)
against the single-process model in float64.

Each rank trains the same tiny model (the coverage script's, in float64, the experts' loop in
place of grouped_mm) a few plain-SGD steps in one process and under the layout, then compares
every step's loss and every parameter's update: dots1 (shared experts) and Cohere Compass
(rotary parameters per layer type). Gemma 4 (per-layer head dims: its global layers' heads are
twice as wide, and transformers refuses to read such an attribute globally) is compared one
step's gradients at a time: transformers computes the loss in float32 even for a float64 model
(as the vocabulary-parallel loss does, in another order), and Gemma 4's SGD updates grow that
rounding (5e-7 in the gradients) past the tolerance within three steps; so is Qwen4-Exp, whose
hyper-connection mixer splits its replicated input itself (``rowwise_split_input``) beside
computations on the whole input (its module is no region: summing at its entry doubled their
gradients). Under sequence parallelism (``tp2-sp``): HunYuan (its plan splits no attention),
Gemma 3 (a vision tower before its text blocks) and Qwen3.5 (linear attention with
tensor-parallel projections).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_pp import accumulate, micro_batches, pp_group, rel_error
from tests.tiny_pp_families import sgd_train
from tests.tiny_tp import tp_group

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

RTOL = 1e-5


def _tiny(model_type: str) -> torch.nn.Module:
    from coverage_check import tiny_model

    from tests.tiny import _randomize_zero_init

    return _randomize_zero_init(tiny_model(model_type, experts_implementation="eager")).double()


def _errors(named: dict[str, torch.Tensor], before: dict, after: dict, local=None) -> dict[str, float]:
    local = local or (lambda name, t: t)
    return {n: rel_error(p - local(n, before[n]), local(n, after[n] - before[n])) for n, p in named.items()}


def train(model_type: str, layout: str) -> dict:
    """On every rank: losses and each parameter's update error against the single process."""
    import torch.distributed as dist

    start = _tiny(model_type)
    before = {n: p.detach().clone() for n, p in start.named_parameters(remove_duplicate=False)}
    oracle = copy.deepcopy(start)
    want = sgd_train(oracle.parameters(), lambda batches: accumulate(oracle, batches))
    after = {n: p.detach().clone() for n, p in oracle.named_parameters(remove_duplicate=False)}
    if layout in ("tp2", "tp2-sp"):
        from parallel3d.tensor_parallel import apply_tensor_parallel

        model = copy.deepcopy(start)
        info = apply_tensor_parallel(model, tp_group(2), sequence_parallel=layout == "tp2-sp")
        losses = sgd_train(model.parameters(), lambda batches: accumulate(model, batches))

        def local(name: str, t: torch.Tensor) -> torch.Tensor:
            spec = info.shard_specs.get(name)
            return t if spec is None else spec.shard(t, info.tp_rank, 2)

        named = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        return {"losses": losses, "want": want, "errors": _errors(named, before, after, local)}
    from parallel3d.pipeline.executor import PipelineExecutor
    from parallel3d.pipeline.stage import split_model

    group = pp_group(2)
    pipe = split_model(copy.deepcopy(start), 2, dist.get_rank(group))
    executor = PipelineExecutor(pipe, group, "1f1b")
    losses = sgd_train(pipe.parameters(), lambda batches: executor.run(batches).item())
    named = {n: p.detach() for n, p in pipe.hf_named_parameters()}
    return {"losses": losses, "want": want, "errors": _errors(named, before, after)}


@pytest.mark.parametrize("model_type,layout", [
    ("dots1", "tp2"), ("dots1", "pp2"), ("cohere_compass_text", "pp2"),
    # sequence parallelism around modules that mix tokens without being split: an attention its
    # plan leaves whole (HunYuan), a multimodal model whose vision blocks come first (Gemma 3: the
    # sequence is split at its first text block). State-space mixers (Falcon-H1, Bamba) take the
    # same path; the coverage script runs them (70 s here in float64, too slow for the suite).
    ("hunyuan_v1_dense", "tp2-sp"), ("gemma3", "tp2-sp"),
    # a mixer holding tensor-parallel layers (linear attention whose projections gather their
    # outputs): every rank runs it whole, forward and backward
    ("qwen3_5_text", "tp2-sp")])
def test_matches_single_process(dist, model_type, layout):
    results = dist.run(2, train, model_type, layout)
    names = {n for n, _ in _tiny(model_type).named_parameters()}
    seen: set[str] = set()
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(r["want"], rel=RTOL), f"rank {rank} losses"
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] < RTOL, f"rank {rank}: update of {worst} off by {r['errors'][worst]:.2e}"
        seen.update(r["errors"])
    assert names <= seen, f"parameters no rank holds: {sorted(names - seen)[:5]}"


# HF's modules compute parts of a float64 model in float32 (RMS norms, DeepSeek V4's hyper-connection
# projections), so a gradient that sums N per-token contributions c_t in another order (the
# sequence split across ranks) may differ by up to ~N float32 rounding steps of sum_t |c_t|: where
# the c_t cancel (a softmax bias), that is far more than a rounding step of the sum itself.
_FLOAT32_UNIT = torch.finfo(torch.float32).eps


def token_magnitudes(model: torch.nn.Module, batch: dict) -> tuple[dict[str, torch.Tensor], int]:
    """``sum_t |c_t|`` for every parameter, c_t the gradient of token t's share of the mean loss
    (one backward per token, in float64), and the token count N."""
    out = model(input_ids=batch["input_ids"])
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:].flatten()
    per_token = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).double(), labels, reduction="none")
    tokens = (labels != -100).nonzero().flatten().tolist()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sums = {n: torch.zeros_like(p) for n, p in named}
    for t in tokens:
        grads = torch.autograd.grad(per_token[t] / len(tokens), [p for _, p in named], retain_graph=True,
                                    allow_unused=True)
        for (name, _), g in zip(named, grads):
            if g is not None:
                sums[name] += g.abs()
    return sums, len(tokens)


def gradients_tp2(model_type: str, sequence_parallel: bool = False) -> dict:
    """On every rank: the loss, and every parameter's gradient error over its bound: the largest of
    RTOL of the gradient's norm, N float32 rounding steps of its per-token magnitudes, and 1e-12 of
    the largest gradient."""
    from parallel3d.tensor_parallel import apply_tensor_parallel

    start = _tiny(model_type)
    batch = micro_batches(1, seed=5)[0]
    oracle = copy.deepcopy(start)
    want = oracle(**batch)
    want.loss.backward()
    magnitudes, n_tokens = token_magnitudes(copy.deepcopy(start), batch)
    model = copy.deepcopy(start)
    info = apply_tensor_parallel(model, tp_group(2), sequence_parallel=sequence_parallel)
    got = model(**batch, gather_logits=True)
    got.loss.backward()
    grads = {n: p.grad for n, p in oracle.named_parameters()}
    # A gradient that is zero up to rounding (DeepSeek V4's routers: its normalized routing weights
    # leave them ~1e-19 here) is compared against the largest gradient instead of itself.
    floor = 1e-12 * max(g.norm().item() for g in grads.values() if g is not None)
    errors = {}
    for name, p in model.named_parameters():
        spec = info.shard_specs.get(name)
        if p.grad is None or grads[name] is None:  # an expert no token was routed to: none on both sides
            errors[name] = 0.0 if p.grad is None and grads[name] is None else float("inf")
            continue
        shard = (lambda t: t) if spec is None else (lambda t: spec.shard(t, info.tp_rank, 2))
        want_grad, magnitude = shard(grads[name]), shard(magnitudes[name])
        bound = max(RTOL * want_grad.norm().item(), n_tokens * _FLOAT32_UNIT * magnitude.norm().item(), floor)
        errors[name] = (p.grad - want_grad).norm().item() / bound
    logits = (got.logits[..., :want.logits.shape[-1]] - want.logits).abs().max().item()
    return {"loss": got.loss.item(), "want": want.loss.item(), "logits": logits, "errors": errors}


@pytest.mark.parametrize("model_type,sp", [("gemma4_text", False), ("qwen4_exp_text", False),
                                           ("gemma4_text", True), ("deepseek_v4", True)],
                         ids=["gemma4_text", "qwen4_exp_text", "gemma4_text-sp", "deepseek_v4-sp"])
def test_gradients_tp2(dist, model_type, sp):
    """Under sequence parallelism (``-sp``) Gemma 4's per-layer inputs and DeepSeek V4's token ids
    (its hash router's) reach every block whole and are cut to the rank's part of the sequence."""
    for rank, r in enumerate(dist.run(2, gradients_tp2, model_type, sp)):
        assert r["logits"] < 1e-12, f"rank {rank}: logits off by {r['logits']:.2e}"
        assert r["loss"] == pytest.approx(r["want"], rel=RTOL)
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= 1, f"rank {rank}: gradient of {worst} off by {r['errors'][worst]:.2f} x its bound"
