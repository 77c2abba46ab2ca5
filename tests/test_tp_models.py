"""Tensor parallelism on whole HF models against the single-process model (fp64, CPU gloo).

Every rank builds the same full model, runs it once as the oracle, then shards a copy with
``apply_tensor_parallel`` and compares: loss, gathered logits, and every parameter's
gradient against this rank's slice of the full gradient (``ShardSpec.shard``). The
comparison runs inside the workers; they return only the worst errors, the replicated
gradients (to check that they agree across tp ranks bit for bit) and shard sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.tiny_tp import make_tp_model, tp_batch, tp_group

# float64 on both sides (the loss too: tests/float64_loss.py). HF's RMS norms still compute in
# float32 inside (``hidden_states.to(torch.float32)``), so inputs that differ in their last float64
# bits can round to neighbouring float32 values there: errors of a few float32 ulps (1.2e-7 is
# one) on any CPU, against 1e-3 and more for a wrong split or reduction.
RTOL = 1e-6


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def compare_with_full(kind: str, tp: int, sequence_parallel: bool, checkpointing: bool = False,
                      overrides: dict | None = None) -> dict:
    """On every rank: single-process vs tensor-parallel forward/backward of ``kind``."""
    from parallel3d.tensor_parallel import apply_tensor_parallel

    group = tp_group(tp)
    ref = make_tp_model(kind, **(overrides or {})).double()
    model = copy.deepcopy(ref)
    batch = tp_batch(ref.config.vocab_size)
    want = ref(**batch)
    want.loss.backward()

    info = apply_tensor_parallel(model, group, sequence_parallel=sequence_parallel)
    if checkpointing:  # blocks re-run forward (and the tp hooks' collectives) inside backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    out = model(**batch, gather_logits=True)
    out.loss.backward()
    with torch.no_grad():
        no_logits = model(**batch).logits
        unlabelled = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    full = dict(ref.named_parameters(remove_duplicate=False))
    errors, sizes, replicated = {}, {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = info.shard_specs.get(name)
        want_grad = full[name].grad if spec is None else spec.shard(full[name].grad, info.tp_rank, tp)
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.shape == want_grad.shape, (name, p.grad.shape, want_grad.shape)
        errors[name] = _rel(p.grad, want_grad)
        sizes[name] = (p.numel(), full[name].numel())
        if spec is None:
            replicated[name] = p.grad.clone()
        assert (p in info.sharded_params) == (spec is not None), name
    return {
        "loss": (out.loss.item(), want.loss.item()),
        "logits": _rel(out.logits, want.logits),
        "no_logits": no_logits is None,
        "unlabelled_logits": _rel(unlabelled, want.logits),
        "grad_errors": errors,
        "sizes": sizes,
        "replicated": replicated,
        "specs": {n: (s.dim, s.full_size, s.padded_size, s.replicas) for n, s in info.shard_specs.items()},
        "padded_vocab": info.padded_vocab_size,
        "config_intact": model.config.to_dict() == ref.config.to_dict(),
        "no_split": model._no_split_modules == ref._no_split_modules,
        "tied": [n for n, p in model.named_parameters(remove_duplicate=False)
                 if any(p is q for m, q in model.named_parameters(remove_duplicate=False) if m != n)],
    }


CASES = [(kind, tp, sp, False) for kind in ("llama", "qwen2", "gpt_neox", "gpt2") for tp in (2, 4)
         for sp in (False, True)]
CASES += [("qwen3", 2, False, False), ("qwen3", 2, True, False), ("llama_tied", 2, True, False),
          ("llama", 2, True, True), ("gpt2", 2, False, True), ("gemma2", 2, False, False), ("phi3", 2, True, False)]


@pytest.mark.parametrize("kind,tp,sp,ckpt", CASES, ids=lambda v: str(v))
def test_matches_single_process(dist, kind, tp, sp, ckpt):
    check_against_full(dist.run(tp, compare_with_full, kind, tp, sp, ckpt), kind, tp)


# Key/value heads replicated (tp > num_key_value_heads), multi-query attention, and parameters
# inside split regions that no plan entry names (Apertus' xIELU scalars, Cohere's per-head q/k norms).
REGION_CASES = [
    ("llama", 4, False, dict(num_key_value_heads=2)),
    ("llama", 2, True, dict(num_key_value_heads=1)),
    ("qwen2", 4, False, dict(num_key_value_heads=1)),  # k/v biases replicated too
    ("apertus", 2, False, {}),
    ("apertus", 4, True, dict(num_key_value_heads=2)),
    ("cohere", 2, False, {}),
    ("cohere", 4, False, dict(num_key_value_heads=2)),  # k_norm [kv, head_dim] replicated with its heads
    ("olmo2", 2, False, {}),  # q/k norms over all heads, on gathered (replicated) q/k: left alone
]


@pytest.mark.parametrize("kind,tp,sp,overrides", REGION_CASES, ids=lambda v: str(v))
def test_regions_match_single_process(dist, kind, tp, sp, overrides):
    check_against_full(dist.run(tp, compare_with_full, kind, tp, sp, False, overrides), kind, tp)


def check_against_full(results: list[dict], kind: str, tp: int) -> None:
    """Every rank: loss, logits and every gradient as the single process; replicated grads agree."""
    for rank, r in enumerate(results):
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=RTOL), f"rank {rank} loss"
        assert r["logits"] < RTOL, f"rank {rank} logits differ by {r['logits']:.2e}"
        assert r["no_logits"], "logits must be None unless gather_logits=True"
        assert r["unlabelled_logits"] < RTOL, "without labels the logits are gathered"
        worst = max(r["grad_errors"], key=r["grad_errors"].get)
        assert r["grad_errors"][worst] < RTOL, f"rank {rank}: grad of {worst} differs by {r['grad_errors'][worst]:.2e}"
        assert r["config_intact"] and r["no_split"]
        for name, (local, full) in r["sizes"].items():
            if name in r["specs"]:
                _, full_size, padded, replicas = r["specs"][name]
                assert local * tp == full * padded // full_size * replicas, f"{name}: {local} of {full} is not 1/{tp}"
            else:
                assert local == full, name
    # replicated params: the same gradient on every tp rank, bit for bit
    for name, grad in results[0]["replicated"].items():
        for r in results[1:]:
            assert torch.equal(grad, r["replicated"][name]), f"replicated {name} differs across tp ranks"
    specs = results[0]["specs"]
    if kind in ("gpt2", "qwen2", "llama_tied", "gemma2", "cohere"):  # tied: one parameter under two names
        assert len(results[0]["tied"]) == 2, results[0]["tied"]
    vocab = make_tp_model(kind).config.vocab_size
    assert results[0]["padded_vocab"] == -(-vocab // tp) * tp
    assert any(n.endswith("embed_tokens.weight") or n.endswith("wte.weight") or n.endswith("embed_in.weight")
               for n in specs)


def _tp_error(model: torch.nn.Module) -> str:
    """The ConfigError ``apply_tensor_parallel`` raises for ``model`` at tp 2, or "no error"."""
    from parallel3d.errors import ConfigError
    from parallel3d.tensor_parallel import apply_tensor_parallel

    try:
        apply_tensor_parallel(model, tp_group(2))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def bad_sizes(kind: str, overrides: dict) -> str:
    return _tp_error(make_tp_model(kind, **overrides))


def bad_sequence_length() -> str:
    from parallel3d.errors import ConfigError
    from parallel3d.tensor_parallel import apply_tensor_parallel

    model = make_tp_model("llama")
    apply_tensor_parallel(model, tp_group(2), sequence_parallel=True)
    try:
        model(input_ids=torch.zeros(1, 7, dtype=torch.long), labels=torch.zeros(1, 7, dtype=torch.long))
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("kind,overrides,message", [
    ("llama", dict(num_attention_heads=3, num_key_value_heads=3, head_dim=8, hidden_size=24),
     "tensor_parallel.size=2 must divide num_attention_heads=3 of LlamaForCausalLM"),
    ("llama", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=24),
     "tensor_parallel.size=2 must divide num_key_value_heads=3 of LlamaForCausalLM or be a multiple of it "
     "(num_attention_heads=6"),
    ("qwen2", dict(intermediate_size=63), "tensor_parallel.size=2 must divide intermediate_size=63 of Qwen2ForCausalLM"),
    ("gpt2", dict(n_head=1), "tensor_parallel.size=2 must divide num_attention_heads=1 of GPT2LMHeadModel"),
    ("gpt_neox", dict(num_attention_heads=1), "must divide num_attention_heads=1 of GPTNeoXForCausalLM"),
])
def test_bad_sizes(dist, kind, overrides, message):
    for msg in dist.run(2, bad_sizes, kind, overrides):
        assert message in msg, msg


def unhandled_region_param() -> str:
    """A per-feature scale between up_proj and down_proj: neither a scalar nor per head."""
    model = make_tp_model("llama")
    model.model.layers[1].mlp.scale = torch.nn.Parameter(torch.ones(64))
    return _tp_error(model)


def test_unhandled_region_param_is_refused(dist):
    for msg in dist.run(2, unhandled_region_param):
        assert msg.startswith("LlamaForCausalLM: parameter model.layers.1.mlp.scale (shape [64], in LlamaMLP) acts on "
                              "the activations that tensor parallelism splits between ['model.layers.1.mlp.gate_proj', "
                              "'model.layers.1.mlp.up_proj'] and the row layer of model.layers.1.mlp"), msg


def test_bad_sequence_length(dist):
    for msg in dist.run(2, bad_sequence_length):
        assert msg == ("sequence parallelism: sequence length 7 must be divisible by tensor_parallel.size=2 (under "
                       "context parallelism this is a rank's part of the sequence: the length given must then be "
                       "divisible by context_parallel.size x tensor_parallel.size)"), msg


def unsupported(name: str, config: dict, plan: dict | None = None) -> str:
    import transformers

    model = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**config))
    if plan is not None:
        model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, **plan}
    return _tp_error(model)


def test_unsupported_models(dist):
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    msg = dist.run(2, unsupported, "Llama", small, {"layers.*.mlp.down_proj": "packed_rowwise"})[0]
    assert msg.startswith("LlamaForCausalLM: base_model_tp_plan entry 'layers.*.mlp.down_proj': 'packed_rowwise' is "
                          "not supported by zero3d"), msg
    msg = dist.run(2, unsupported, "XGLM", dict(vocab_size=64, d_model=32, num_layers=1, attention_heads=4, ffn_dim=64))[0]
    assert msg.startswith("XGLMForCausalLM (model_type 'xglm') has no base_model_tp_plan in its config and zero3d "
                          "declares no plan for its family (declared: BLOOM, CodeGen, Falcon, GPT-2"), msg
