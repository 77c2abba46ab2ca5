"""The planner's activation model: fake-tensor profiles against real runs, Korthikanti's count, schedules.

* A profile on fake tensors equals the same pass on real CPU tensors: bytes kept for backward,
  forward and backward peaks, FLOPs (the fake run executes the same code on shapes).
* Per GPT-2 block, what the profile keeps for backward is Korthikanti et al. 2022's count
  (Table 2, their GPT with fused kernels): 34 s b h + 5 a s^2 b bytes in 16-bit with
  Megatron's attention and GPU dropout, sbh (10 + 24/t) + 5 a s^2 b / t under tensor
  parallelism; plus the two LayerNorms' mean and rstd, which their count leaves out (8 s b bytes
  with the CPU kernels' bf16 statistics; CUDA keeps them in fp32, 16 s b). Under sequence
  parallelism Zero3D keeps each region's gathered input (4 s b h whole) where Megatron
  re-gathers it in backward: sbh (4 + 30/t).
* The activations a rank keeps alive follow its schedule: the memory walk counts p - r
  micro-batches in flight on rank r under 1F1B, all m under GPipe, and for interleaving and
  ZB-H1 what ``pipeline.simulate`` counts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MixtralConfig

from parallel3d.pipeline.schedules import schedule_table
from parallel3d.pipeline.simulate import simulate
from parallel3d.planner.memory import rank_peak
from parallel3d.planner.profile import LiveBytes, ProfileError, profile_pass, profile_passes

LLAMA = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
MIXTRAL = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=36, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)


def _real_pass(config, micro_batch: int, seq: int, prepare=None) -> tuple[int, int, int, int]:
    """(kept after forward, forward peak, backward peak, FLOPs) of a real CPU run, counted like the
    profile; ``prepare(model)``, if given, runs on the model first (tests/test_planner_cp.py: the
    cp attention installed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    model.train()
    if prepare is not None:
        prepare(model)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    live = LiveBytes()
    live.exclude([*model.parameters(), *model.buffers()])
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq))
    with live:
        loss = model(input_ids=ids, labels=ids).loss
        kept, forward_peak = live.live, live.peak
        live.reset_peak()
        loss.backward()
    flops = sum(f for ops in live.ops.values() for f, _ in ops)
    return kept, forward_peak, live.peak, flops


@pytest.mark.parametrize("config", [LLAMA, GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4), MIXTRAL],
                         ids=["llama", "gpt2", "mixtral"])
def test_fake_profile_equals_a_real_run(config):
    """In float32 (Mixtral: its experts' grouped matrix multiplies, which torch's meta kernel refuses
    outside bf16 while the kernels take float32; an intermediate size of 36 gives the experts' down
    projection a 144-byte stride, allowed in float32, not in bf16)."""
    fake = profile_pass(config, "only", 2, micro_batch=2, seq=32, dtype=torch.float32)
    kept, forward_peak, backward_peak, flops = _real_pass(config, 2, 32)
    assert (fake.at_rest, fake.forward_peak, fake.backward_peak, sum(fake.flops)) == \
        (kept, forward_peak, backward_peak, flops)
    assert kept > 0 and flops > 0


def test_fake_profile_refuses_a_float32_grouped_mm_the_kernel_refuses():
    """Mixtral with an intermediate size of 30: its experts' down projection has a 120-byte stride, which the
    grouped-mm kernel refuses in float32; the profile reports the kernel's own refusal."""
    config = MixtralConfig(**{**MIXTRAL.to_diff_dict(), "intermediate_size": 30})
    message = "strides should be multiple of 16 bytes"
    with pytest.raises(RuntimeError, match=message):
        _real_pass(config, 2, 8)
    with pytest.raises(ProfileError, match=message):
        profile_pass(config, "only", 2, micro_batch=2, seq=8, dtype=torch.float32)


def _fields(profile) -> tuple:
    """A profile's figures (PassProfile compares by identity)."""
    return tuple(getattr(profile, f.name) for f in fields(profile))


@pytest.mark.parametrize("config,keys", [
    (LLAMA, [("only", 2, 2, 2, True, True, "flash", False, False), ("first", 2, 2, 2, True, True, "flash", True, False),
             ("middle", 2, 2, 2, True, True, "flash", True, False),
             ("middle", 2, 2, 2, True, True, "flash", False, False),
             ("last", 2, 2, 2, True, True, "flash", True, False), ("last", 2, 1, 2, True, True, "flash", False, False),
             ("last", 1, 1, 1, False, False, "native", False, False),
             ("only", 1, 2, 1, False, False, "native", False, False)]),
    (GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4),
     [("middle", 2, 2, 2, False, False, "materialized", True, False),
      ("last", 2, 2, 2, False, False, "materialized", False, False)]),
], ids=["llama", "gpt2"])
def test_passes_on_one_built_model_equal_fresh_builds(config, keys):
    """profile_passes runs the passes of one (blocks, tp, sp, checkpointing, experts) on one built model:
    every figure equals the pass on a model of its own (profile_pass), whatever ran before it."""
    keys = [(*key, 1, "ulysses") for key in keys]  # cp 1 (its method then unused)
    shared = profile_passes(config, keys, seq=16, dtype=torch.bfloat16)
    assert set(shared) == set(keys)
    for key in keys:
        kind, blocks, mb, tp, sp, ac, attention, split, whole, cp, method = key
        alone = profile_pass(config, kind, blocks, micro_batch=mb, seq=16, dtype=torch.bfloat16, tp=tp,
                             sequence_parallel=sp, checkpointing=ac, attention=attention, split_backward=split,
                             whole_experts=whole, cp=cp, cp_method=method)
        assert _fields(shared[key]) == _fields(alone)


def test_split_backward_recomputes_each_checkpointed_block_once_per_pass(monkeypatch):
    """As the engine's ZB-H1 (tests/test_pipeline_runtime.py counts its blocks): under activation
    checkpointing the profile runs each block's MLP in the forward, in the input-gradient pass's
    recomputation and in the weight pass's one -- not once per parameter group of the block."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    runs = []
    forward = LlamaMLP.forward
    monkeypatch.setattr(LlamaMLP, "forward", lambda self, x: runs.append(1) or forward(self, x))
    profile_pass(LLAMA, "middle", 2, micro_batch=1, seq=8, dtype=torch.float32, checkpointing=True,
                 split_backward=True)
    assert len(runs) == 2 * 3


@pytest.mark.parametrize("config", [LLAMA, GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4),
                                    MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=32,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  num_local_experts=4)], ids=["llama", "gpt2", "mixtral"])
@pytest.mark.parametrize("tp,sp,ac", [(1, False, False), (2, True, True)], ids=["tp1", "tp2-sp-ac"])
def test_a_first_chunks_split_backward_is_derived_exactly(config, tp, sp, ac):
    """A first chunk's ZB-H1 pass is not profiled: profile_passes derives it from the unsplit pass
    (profile.first_split), and every figure equals the measured split pass."""
    key = ("first", 2, 2, tp, sp, ac, "flash", True, False, 1, "ulysses")
    derived = profile_passes(config, [key], seq=16, dtype=torch.bfloat16)[key]
    measured = profile_pass(config, "first", 2, micro_batch=2, seq=16, dtype=torch.bfloat16, tp=tp,
                            sequence_parallel=sp, checkpointing=ac, attention="flash", split_backward=True)
    assert _fields(derived) == _fields(measured)
    assert derived.split.held == derived.at_rest + derived.output_grad > derived.at_rest


def test_a_pass_that_cannot_build_is_reported_per_key():
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act="no-such-activation")
    keys = [("only", 1, mb, 1, False, False, "flash", False, False, 1, "ulysses") for mb in (1, 2)]
    got = profile_passes(config, keys, seq=16, dtype=torch.bfloat16)
    assert all(isinstance(got[key], ProfileError) for key in keys)


def _per_block(tp: int, sp: bool = False, s: int = 64, b: int = 2, h: int = 64, a: int = 4) -> tuple[int, dict]:
    config = GPT2Config(vocab_size=256, n_embd=h, n_layer=2, n_head=a, activation_function="gelu_pytorch_tanh")
    runs = [profile_pass(config, "middle", n, micro_batch=b, seq=s, dtype=torch.bfloat16, tp=tp,
                         sequence_parallel=sp, attention="materialized") for n in (1, 2)]
    return runs[1].at_rest - runs[0].at_rest, {"s": s, "b": b, "h": h, "a": a}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_block_activations_are_korthikanti(tp):
    got, d = _per_block(tp)
    s, b, h, a = d["s"], d["b"], d["h"], d["a"]
    want = s * b * h * (10 + 24 / tp) + 5 * a * s * s * b / tp + 8 * s * b
    assert got == want


def test_block_activations_under_sequence_parallel():
    tp = 2
    got, d = _per_block(tp, sp=True)
    s, b, h, a = d["s"], d["b"], d["h"], d["a"]
    assert got == s * b * h * (4 + 30 / tp) + 5 * a * s * s * b / tp + 8 * s * b / tp


@dataclass(frozen=True)
class _Unit:
    """A chunk whose every micro-batch keeps one byte: the walk's peak counts micro-batches in flight."""

    kind: str = "middle"
    at_rest: int = 1
    forward_peak: int = 1
    backward_peak: int = 1
    after_first_grad: int = 0
    input_grad_peak: int = 1
    held_for_weights: int = 1
    weight_grad_peak: int = 1
    forward_peak_in_block: bool = False
    backward_peak_in_block: bool = False


def _in_flight(table: list) -> int:
    return rank_peak({"params": 0}, (0, 0), 0, 0, table, lambda c: _Unit(), 0, pipelined=True).activations


@pytest.mark.parametrize("p,m", [(4, 8), (3, 7), (2, 2)])
def test_activations_follow_the_schedule(p, m):
    one_f_one_b = schedule_table("1f1b", p, m, communication=False)
    assert [_in_flight(one_f_one_b[r]) for r in range(p)] == [min(p - r, m) for r in range(p)]
    gpipe = schedule_table("gpipe", p, m, communication=False)
    assert [_in_flight(gpipe[r]) for r in range(p)] == [m] * p
    for name, v in (("zb_h1", 1), ("interleaved_1f1b", 2)):
        if name == "interleaved_1f1b" and m % p:
            continue
        table = schedule_table(name, p, m, v, communication=False)
        assert [_in_flight(table[r]) for r in range(p)] == simulate(table).peak_live


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_experts_collectives_are_counted(sp):
    """A tp rank's experts enter and leave tensor parallelism as the engine's do
    (``tensor_parallel.experts``): per MoE block, one collective for the attention's output and
    one for the experts' (an all-reduce each, or under sequence parallelism a reduce-scatter
    each, the experts' over the tokens they gathered: hidden states, routing weights and indices)."""
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    b, s, h, k = 2, 16, 64, 2
    run = profile_pass(config, "middle", 2, micro_batch=b, seq=s, dtype=torch.bfloat16, tp=2, sequence_parallel=sp)
    forward = [(op, size) for op, size, backward in run.comm if not backward]
    if not sp:
        assert forward.count(("all_reduce", b * s * h * 2)) == 2 * 2
        return
    assert forward.count(("reduce_scatter", b * s * h * 2)) == 2 * 2
    gathered = [size for op, size in forward if op == "all_gather"]
    # per block: the attention's entry (b x s x h), the experts' hidden states (b s x h), routing
    # weights (b s x k, float32 from the router's softmax) and expert indices (b s x k, int64); and
    # the last block's exit (b x s x h)
    assert sorted(gathered) == sorted([b * s * h * 2] * 5 + [b * s * k * 4] * 2 + [b * s * k * 8] * 2)


def test_per_token_block_inputs_under_sequence_parallel():
    """Gemma 4's per-layer inputs reach each block whole and are cut to the rank's part, after the
    first block has cut the hidden states (the planner's hooks in the engine's order): the profile
    runs, and sequence parallelism keeps less alive than plain tp."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from coverage_check import tiny_model

    config = tiny_model("gemma4_text").config
    runs = {sp: profile_pass(config, "first", 2, micro_batch=2, seq=8, dtype=torch.bfloat16, tp=2,
                             sequence_parallel=sp) for sp in (False, True)}
    assert 0 < runs[True].at_rest < runs[False].at_rest
