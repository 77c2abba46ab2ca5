"""Which causal-LM types of the installed transformers train under pipeline stages.

    python scripts/coverage.py [model_type ...]      # default: every causal-LM type

For each type: a tiny random-init model (hidden 32, 2 blocks, vocabulary 96) from the type's
default config, one step of two padded micro-batches through the real pipeline executor with
two stages (one process, ``interleaved_1f1b`` with 2 chunks, so stage 0 hands the hidden
states to stage 1 as between ranks), compared with the model's own forward and backward: the
loss and every gradient to 1e-5. Prints one line per type: ``pass``, ``refused: <reason>``
(Zero3D's message), ``MISMATCH`` (a bug), or ``skip`` when the tiny config does not build or
run in transformers itself. Other layouts (ZeRO-3, tp 2) can be added as columns.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallel3d.errors import ConfigError  # noqa: E402
from parallel3d.pipeline.executor import PipelineExecutor  # noqa: E402
from parallel3d.pipeline.stage import split_model  # noqa: E402

RTOL = 1e-5
MAX_PARAMS = 60_000_000
VOCAB, SEQ = 96, 8
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, n_embd=32, n_layer=2, n_head=4, n_positions=64)
DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "embedding_dropout",
            "residual_dropout", "dropout", "activation_dropout")


def tiny_model(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    defaults = AutoConfig.for_model(model_type)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in TINY.items() if hasattr(defaults, k)})
    for key in DROPOUTS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    with torch.device("meta"):  # a type that names its sizes differently keeps its full size
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"{size / 1e6:.0f}M parameters: the tiny config did not reach its sizes")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(2):
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        if i == 1:
            mask[1, -2:] = 0
            labels[1, -2:] = -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def check(model_type: str, group: dist.ProcessGroup) -> str:
    try:
        model = tiny_model(model_type)
        mbs = batches()
        want_loss = sum(model(**mb, use_cache=False).loss / len(mbs) for mb in mbs)
        want_loss.backward()
    except Exception as exc:  # noqa: BLE001 - the tiny config is not one transformers runs
        return f"skip (tiny config fails in transformers: {type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    want = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    model.zero_grad(set_to_none=True)
    try:
        pipe = split_model(tiny_model(model_type), 1, 0, virtual_stages=2)  # the same seed: the same weights
    except ConfigError as exc:
        return f"refused: {str(exc).split(': ', 1)[-1]}"
    try:
        loss = PipelineExecutor(pipe, group, "interleaved_1f1b").run(mbs)
    except Exception as exc:  # noqa: BLE001 - a bug of the split: report it and go on
        return f"ERROR ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
    if abs(loss.item() - want_loss.item()) > RTOL * abs(want_loss.item()):
        return f"MISMATCH (loss {loss.item():.6f}, want {want_loss.item():.6f})"
    for name, p in pipe.hf_named_parameters():
        got = torch.zeros_like(p) if p.grad is None else p.grad
        ref = want.get(name, torch.zeros_like(p))
        if (got - ref).norm() > RTOL * ref.norm().clamp_min(1e-30):
            return f"MISMATCH (gradient of {name})"
    return "pass"


def main(types: list[str]) -> None:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    counts: dict[str, int] = {}
    for model_type in types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        outcome = check(model_type, group)
        counts[outcome.split(" ")[0].rstrip(":")] = counts.get(outcome.split(" ")[0].rstrip(":"), 0) + 1
        print(f"{model_type:28s} {outcome}", flush=True)
    print("# " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
