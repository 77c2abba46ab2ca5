"""Tiny random-init HF causal LMs, deterministic data and the single-process oracle.

The oracle for every parallel layout is one process running plain ``torch.optim.AdamW``
(and ``clip_grad_norm_``) over the same global batch in fp32: each micro-step's loss is the
mean over the data-parallel ranks' micro-batches (equal token counts, so this is the loss
of the concatenated global micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

transformers.logging.set_verbosity_error()

VOCAB = 128
SEQ = 16
MICRO = 2


def make_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random-init model; same ``seed`` gives the same weights on every rank."""
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        cfg.update(overrides)
        return LlamaForCausalLM(LlamaConfig(**cfg))
    if kind == "gpt2":
        cfg = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg.update(overrides)
        return _randomize_zero_init(GPT2LMHeadModel(GPT2Config(**cfg)))
    raise ValueError(f"unknown tiny model {kind!r}")


def _randomize_zero_init(model: torch.nn.Module) -> torch.nn.Module:
    """Give params that HF initializes to exactly zero (biases, norm shifts) random values.

    A relative error measured on a param that started at 0 only measures the size of a few
    Adam steps, which is ill-conditioned; generic values make the comparison meaningful.
    """
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.02)
    return model


def token_batches(steps: int, gas: int, dp: int, seed: int = 1) -> torch.Tensor:
    """Token ids shaped [steps, gas, dp, MICRO, SEQ]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, gas, dp, MICRO, SEQ), generator=g)


def rank_micro_batches(data: torch.Tensor, dp_rank: int) -> list[dict]:
    """The micro-batches one dp rank sees, in order, as model kwargs."""
    steps, gas = data.shape[:2]
    return [{"input_ids": data[s, a, dp_rank], "labels": data[s, a, dp_rank]} for s in range(steps) for a in range(gas)]


def train_micro_steps(engine, batches: list[dict], steps: int, gas: int) -> list[float]:
    """``steps`` steps through the DeepSpeed-style loop (forward, backward, step per micro-batch);
    each step's loss averaged over its micro-batches and the data-parallel ranks."""
    import torch.distributed

    losses = []
    for s in range(steps):
        total = torch.zeros(())
        for mb in batches[s * gas : (s + 1) * gas]:
            loss = engine(**mb).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.AVG)
        losses.append(total.item() / gas)
    return losses


def ds_config(stage: int, gas: int, dp: int, clip: float = 0.5, lr: float = 1e-3, **zero) -> dict:
    """A DeepSpeed-style config for the parity runs."""
    return {
        "train_batch_size": MICRO * gas * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}},
        "zero_optimization": {"stage": stage, **zero},
        "steps_per_print": 1000,
    }


def oracle_run(
    kind: str, data: torch.Tensor, clip: float = 0.5, lr: float = 1e-3, model: torch.nn.Module | None = None,
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    grad_norms: list[float] | None = None, position_ids: torch.Tensor | list[torch.Tensor | None] | None = None,
    prepare: Callable[[dict], dict] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process AdamW (or ``optimizer(params)``) over the global batch: per-step mean losses
    and final params. ``grad_norms``, if given, receives each step's total gradient norm;
    ``position_ids``, if given, go with every micro-batch (packed documents); a list gives the
    position ids of each micro-batch of a window in turn (None: the plain positions); ``prepare``,
    if given, turns each micro-batch's keyword arguments into the ones passed (padding masks)."""
    model = model if model is not None else make_model(kind)
    if optimizer is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    else:
        opt = optimizer(model.parameters())
    steps, gas, dp = data.shape[:3]
    losses = []
    for s in range(steps):
        total = 0.0
        for a in range(gas):
            positions = position_ids[a % len(position_ids)] if isinstance(position_ids, list) else position_ids
            extra = {} if positions is None else {"position_ids": positions, "use_cache": False}
            batches = [{"input_ids": data[s, a, r], "labels": data[s, a, r], **extra} for r in range(dp)]
            loss = sum(model(**(prepare(b) if prepare else b)).loss for b in batches) / dp
            (loss / gas).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        if grad_norms is not None:
            grad_norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        losses.append(total / gas)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def shift_invariant_entries(name: str, param: torch.Tensor) -> torch.Tensor | None:
    """Entries whose exact gradient is zero, so any two runs differ there by rounding noise.

    GPT-2's packed attention bias holds the key bias in its middle third: adding the same
    vector to every key shifts each query's scores by a constant, which softmax ignores, so
    its gradient is zero in exact arithmetic. In floating point it is rounding noise, and
    Adam normalizes noise into steps of about ``lr``: the two runs disagree there by design.
    """
    if name.endswith("attn.c_attn.bias"):
        third = param.numel() // 3
        mask = torch.zeros_like(param, dtype=torch.bool)
        mask[third : 2 * third] = True
        return mask
    return None


def max_rel_param_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest relative error ``||got - want|| / ||want||`` over params, and which param.

    The norm-wise measure is used because several params start at zero (biases, norms):
    against their largest entry, a rounding difference of 1e-8 after a few tiny Adam steps
    looks large while the model is the same. Shift-invariant entries are left out.
    """
    assert set(got) == set(want), set(got) ^ set(want)
    errs = {}
    for n, w in want.items():
        g = got[n]
        mask = shift_invariant_entries(n, w)
        if mask is not None:
            g, w = g[~mask], w[~mask]
        errs[n] = ((g - w).norm() / w.norm()).item()
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def update_mismatch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor],
                    steps: int, rtol: float) -> tuple[float, str, float]:
    """Compare every parameter's update with the oracle's, ``torch.allclose``-style but norm-wise.

    A parameter passes when ``||got - want|| <= rtol * ||want - start|| + steps * eps32 * ||want||``.
    The first term is measured against the update rather than the parameter: a parameter that a
    few steps barely move (an activation scalar, a norm) can have a wrong gradient that a
    parameter-relative error hides in its starting value. The second is what storing the
    parameter in fp32 adds each step (every element rounds by up to half an ulp): two runs that
    sum the same gradients in different orders differ by that much whatever the update.
    Returns the worst ratio of the two sides (<= 1 passes), its parameter and that parameter's
    error relative to its update.
    """
    assert set(got) == set(want), set(got) ^ set(want)
    eps = torch.finfo(torch.float32).eps
    ratios, rels = {}, {}
    for n in want:
        err, update = (got[n] - want[n]).norm().item(), (want[n] - start[n]).norm().item()
        ratios[n] = err / (rtol * update + steps * eps * want[n].norm().item())
        rels[n] = err / max(update, 1e-30)
    worst = max(ratios, key=ratios.get)
    return ratios[worst], worst, rels[worst]
