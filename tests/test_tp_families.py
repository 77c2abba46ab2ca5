"""Tensor parallelism (tp = 2) for the families whose configs carry no plan (zero3d's records in
models/families.py) and the mixture-of-experts families (HF's ``moe_tp_experts`` plans), against
the single-process model.

Each rank trains the same tiny float64 model a few plain-SGD steps in one process (the oracle)
and sharded with ``apply_tensor_parallel``, then compares every step's loss and every
parameter's update with this rank's slice of the oracle's update (``ShardSpec.shard``; a
replicated parameter with the whole update). SGD makes a wrong gradient a wrong parameter; in
float64 any difference above the tolerance is a bug. The specs cover each fused q|k|v layout:
per head (classic Falcon, BLOOM, GPT-BigCode without multi-query), grouped by kv head (Falcon's
new decoder architecture), [query heads | k | v] (multi-query Falcon and GPT-BigCode, gathered),
CodeGen's four head groups; ALiBi (BLOOM, Falcon); OPT's fc1/fc2 in the decoder layer itself;
StableLM's per-head LayerNorms; experts split with their router's gradient intact (and with the
router's load-balancing loss added to the token loss, ``mixtral_aux``); DeepSeek's
multi-head latent attention (V2's plan splits its heads: the compressing q_a_proj and norms and
the replicated kv_a_proj_with_mqa sum their partial gradients) and shared experts.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.tiny_pp import accumulate, rel_error
from tests.tiny_pp_families import make_family_model, sgd_train
from tests.tiny_tp import tp_group

RTOL = 1e-5
# sequence parallelism with experts split over tp: the experts gather the ranks' tokens (a
# shared expert, Qwen2-MoE's and DeepSeek's, on inputs flattened to [tokens, hidden]), and the
# router's loss reads every rank's router logits
SP_KINDS = ("mixtral", "mixtral_aux", "qwen2_moe", "deepseek_v3")
KINDS = ("falcon", "falcon_mqa", "falcon_new", "falcon_alibi", "gpt_bigcode", "gpt_bigcode_mha", "opt", "bloom", "gptj",
         "codegen", "stablelm", "stablelm_qk", "mixtral", "mixtral_aux", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2")


def train_tp(kind: str, tp: int, sequence_parallel: bool = False) -> dict:
    """On every rank: losses and each parameter's update error against the single process."""
    from parallel3d.tensor_parallel import apply_tensor_parallel

    group = tp_group(tp)
    start = make_family_model(kind).double()
    before = {n: p.detach().clone() for n, p in start.named_parameters(remove_duplicate=False)}
    oracle = copy.deepcopy(start)
    want = sgd_train(oracle.parameters(), lambda batches: accumulate(oracle, batches))
    after = {n: p.detach().clone() for n, p in oracle.named_parameters(remove_duplicate=False)}

    model = copy.deepcopy(start)
    info = apply_tensor_parallel(model, group, sequence_parallel=sequence_parallel)
    losses = sgd_train(model.parameters(), lambda batches: accumulate(model, batches))
    errors, sharded = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = info.shard_specs.get(name)
        local = (lambda t: t) if spec is None else (lambda t: spec.shard(t, info.tp_rank, tp))
        errors[name] = rel_error(p.detach() - local(before[name]), local(after[name] - before[name]))
        if spec is not None:
            sharded.append(name)
    return {"losses": losses, "want": want, "errors": errors, "sharded": sharded, "source": info.plan_source}


@pytest.mark.parametrize("kind,sp", [(k, False) for k in KINDS] + [(k, True) for k in SP_KINDS],
                         ids=[*KINDS, *(f"{k}-sp" for k in SP_KINDS)])
def test_family_matches_single_process(dist, kind, sp):
    results = dist.run(2, train_tp, kind, 2, sp)
    names = {n for n, _ in make_family_model(kind).named_parameters(remove_duplicate=False)}
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(r["want"], rel=RTOL), f"rank {rank} losses"
        assert set(r["errors"]) == names
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] < RTOL, f"rank {rank}: update of {worst} off by {r['errors'][worst]:.2e}"
    sharded = results[0]["sharded"]
    assert any("embed" in n or "wte" in n for n in sharded), "the vocabulary is split"
    blocks = [n for n in sharded if ".0." in n]
    assert len(blocks) >= 3, f"block weights are split: {blocks}"
    if kind in ("mixtral", "mixtral_aux", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2"):
        assert any(n.endswith("experts.gate_up_proj") for n in sharded)
        assert any(n.endswith("experts.down_proj") for n in sharded)


def refusal(kind: str, tp: int, overrides: dict, sequence_parallel: bool = False) -> str:
    from parallel3d.errors import ConfigError
    from parallel3d.tensor_parallel import apply_tensor_parallel

    try:
        apply_tensor_parallel(make_family_model(kind, **overrides), tp_group(tp), sequence_parallel=sequence_parallel)
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("kind,overrides,sp,message", [
    ("codegen", dict(num_attention_heads=4), False,
     "CodeGen reads its fused q|v|k projection in 4 fixed groups of heads, so num_attention_heads=4 must be a "
     "multiple of 4 x tensor_parallel.size=2"),
    ("bloom", dict(pretraining_tp=2, slow_but_exact=True), False,
     "BLOOM with slow_but_exact=True slices its projections by pretraining_tp, which tensor parallelism does not "
     "reproduce"),
    ("opt", {}, True, "sequence parallelism: column-parallel model.decoder.layers.0.fc1 is not inside a module that "
                      "ends in a row-parallel layer"),
], ids=["codegen-groups", "bloom-slow", "opt-sp"])
def test_refused(dist, kind, overrides, sp, message):
    for msg in dist.run(2, refusal, kind, 2, overrides, sp):
        assert message in msg, msg


def _mixtral_with_expert_bias() -> torch.nn.Module:
    model = make_family_model("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts.down_proj_bias = torch.nn.Parameter(torch.zeros(experts.num_experts, experts.hidden_dim))
    return model


def _refuse_built(build) -> str:
    from parallel3d.errors import ConfigError
    from parallel3d.tensor_parallel import apply_tensor_parallel

    try:
        apply_tensor_parallel(build(), tp_group(2))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_expert_bias_is_refused(dist):
    """A parameter of the experts module that the plan does not split would be added once per rank."""
    msg = dist.run(2, _refuse_built, _mixtral_with_expert_bias)[0]
    assert msg.startswith("MixtralForCausalLM: parameter model.layers.0.mlp.experts.down_proj_bias (shape [4, 32]) of "
                          "the experts module is not split by its tensor-parallel plan"), msg


def _experts_called_with(extra) -> str:
    from parallel3d.errors import ConfigError
    from parallel3d.tensor_parallel import apply_tensor_parallel

    model = make_family_model("mixtral")
    apply_tensor_parallel(model, tp_group(2), sequence_parallel=True)
    experts = model.model.layers[0].mlp.experts
    tokens, hidden = 4, model.config.hidden_size
    try:
        experts(torch.zeros(tokens, hidden), torch.zeros(tokens, 2, dtype=torch.long), torch.ones(tokens, 2), extra)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_experts_input_that_is_no_token_tensor_is_refused(dist):
    """Under sequence parallelism the experts gather every input along its tokens: one that is not
    a tensor of the tokens (a per-expert count list, an expert-major layout) is refused by name."""
    msg = dist.run(2, _experts_called_with, [2, 2])[0]
    assert msg == ("sequence parallelism: MixtralExperts is called with an input (list) that is not a tensor of its "
                   "4 tokens, so the ranks' parts of the sequence cannot be gathered for it")
    msg = dist.run(2, _experts_called_with, torch.zeros(3, 2))[0]
    assert "an input (shape [3, 2]) that is not a tensor of its 4 tokens" in msg
