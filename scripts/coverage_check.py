"""One causal-LM type under one layout on two ranks, against one process: the checks behind
``scripts/coverage.py``.

The model is a tiny random-init one built from the type's default config (hidden 32, four
blocks, vocabulary 96; sizes the type does not have are left alone; ``models/tiny_config.py`` says
how the rest follows) with dropout off and eager attention. Every rank first trains it itself (the oracle: two plain-SGD steps, each over
two padded micro-batches with ignored labels), then through ``parallel3d.initialize`` on the
layout, and compares each step's loss and every parameter's update (``engine.full_parameters``)
with the oracle's. Layouts, two ranks each:

* ``zero3``: ZeRO stage 3 over dp = 2 (each rank one of the two micro-batches);
* ``tp2``: tensor parallel over 2 ranks, both micro-batches by gradient accumulation;
* ``pp2``: two pipeline stages, 1F1B over the two micro-batches.

and the composed layouts, four ranks each (``--layouts`` of ``scripts/coverage.py``):

* ``pp2-tp2``: two pipeline stages of two tensor-parallel ranks, ZeRO-1, interleaved 1F1B
  where the model has a block per virtual stage, else 1F1B;
* ``pp2-dp2-z3``: two pipeline stages of two ZeRO-3 data-parallel ranks (one micro-batch each,
  ZB-H1: fewer micro-batches than stages);
* ``tp2-dp2-z3``: two tensor-parallel ranks in each of two ZeRO-3 data-parallel groups.

and beyond those (``--more``): ``tp2-sp``, tensor parallel with sequence parallelism on two
ranks, and ``cp2-ring``, context parallelism with ring attention over two ranks (ZeRO 0); on
four ``pp2-tp2-sp`` (the same with two 1F1B pipeline stages), ``pp2-dp2-z2`` (two pipeline stages
of two ZeRO-2 data-parallel ranks, 1F1B) and ``cp2-dp2-z3-ring`` (ring attention over two
context-parallel ranks in each of two ZeRO-3 data-parallel groups). Context parallelism refuses
padding masks, so its layouts and their oracle take the micro-batches without the mask (the
padded tokens' labels still ignored).

A data-parallel rank trains its share of the step's two micro-batches (dp 2: one each). A
resumed layout ``A>B`` (``--resume``) trains the first step under A with momentum SGD, saves a
checkpoint, and takes the second step in a fresh engine under B that loads it: the oracle is
then momentum SGD too, so the optimizer's state has to come through the checkpoint.

An outcome is ``pass``, ``refused: <Zero3D's reason>`` (a ``ConfigError`` from ``initialize``, or
from the run-time checks of a forward, as context parallelism's),
``fail: <what went wrong>`` (a mismatch or an error while training: a bug), or ``skip: <why>``
when the tiny config does not build or train in transformers itself.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import torch

from models.layer_configs import layer_count
from models.tiny_config import VOCAB, drop_off, text_part, tiny_config

SEQ, MICRO = 8, 2
STEPS, LR = 2, 0.5
RTOL = 1e-4
MAX_PARAMS = 60_000_000
LAYOUTS = ("zero3", "tp2", "pp2")  # two ranks each: the README's table
COMPOSED = ("pp2-tp2", "pp2-dp2-z3", "tp2-dp2-z3")  # four ranks each
# a checkpoint saved under the first layout resumed under the second, each axis changed
RESUMES = ("zero3>tp2", "tp2>pp2", "pp2>zero3")
COMPOSED_RESUMES = ("pp2-tp2>tp2-dp2-z3", "tp2-dp2-z3>pp2-dp2-z3", "pp2-dp2-z3>pp2-tp2")
MORE = ("tp2-sp", "cp2-ring")  # sequence parallelism, context parallelism
MORE_COMPOSED = ("pp2-tp2-sp", "pp2-dp2-z2", "cp2-dp2-z3-ring")  # also ZeRO-2 inside pipelines, ZeRO-3 with cp
MOMENTUM = 0.9  # resumed runs: the optimizer's state must come through the checkpoint too


@dataclass(frozen=True)
class Layout:
    world: int
    pp: int = 1
    tp: int = 1
    stage: int = 0
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    cp: int = 1
    method: str = "ulysses"

    @property
    def dp(self) -> int:
        return self.world // (self.pp * self.tp * self.cp)


SHAPES = {
    "zero3": Layout(2, stage=3), "tp2": Layout(2, tp=2), "pp2": Layout(2, pp=2),
    "pp2-tp2": Layout(4, pp=2, tp=2, stage=1, schedule="interleaved_1f1b"),
    "pp2-dp2-z3": Layout(4, pp=2, stage=3, schedule="zb_h1"),
    "tp2-dp2-z3": Layout(4, tp=2, stage=3),
    "tp2-sp": Layout(2, tp=2, sequence_parallel=True),
    "pp2-tp2-sp": Layout(4, pp=2, tp=2, stage=1, sequence_parallel=True),
    "pp2-dp2-z2": Layout(4, pp=2, stage=2),
    "cp2-ring": Layout(2, cp=2, method="ring"),
    "cp2-dp2-z3-ring": Layout(4, stage=3, cp=2, method="ring"),
}


def tiny_model(model_type: str, **from_config: Any) -> torch.nn.Module:
    """The type's tiny model (``models/tiny_config.py``); the same on every call (seed 0).
    ``from_config``: more arguments for ``from_config`` (the tests' ``experts_implementation``)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    drop_off(config)
    with torch.device("meta"):  # a type that names its sizes differently keeps its full size
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"{size / 1e6:.0f}M parameters: the tiny config did not reach its sizes")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", **from_config)


def micro_batches(step: int, padded: bool = True) -> list[dict[str, torch.Tensor]]:
    """The step's two micro-batches; the second right-padded with ignored labels (``padded`` False:
    the labels ignored, no mask). Without a key/value cache, which training does not use (a hybrid
    model's cache wants an attention layer among the first few)."""
    g = torch.Generator().manual_seed(5 + step)
    out = []
    for i in range(2):
        ids = torch.randint(3, VOCAB, (MICRO, SEQ), generator=g)
        mask, labels = torch.ones_like(ids), ids.clone()
        if i == 1:
            mask[1, -2:] = 0
            labels[1, -2:] = -100
        batch = {"input_ids": ids, "labels": labels, "use_cache": False}
        out.append(batch | {"attention_mask": mask} if padded else batch)
    return out


def oracle(model_type: str, momentum: float = 0.0,
           padded: bool = True) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single process: losses per step, and every parameter (by every name) before and after."""
    model = tiny_model(model_type)
    with torch.no_grad():  # a forward that draws random numbers in training agrees with no other run
        draws = [torch.manual_seed(seed) and model(**micro_batches(0)[0]).loss.item() for seed in (1, 2)]
    if draws[0] != draws[1]:
        raise ValueError("its training forward draws random numbers (dropout or routing noise that no config "
                         "switch turns off), so no two runs agree")
    torch.manual_seed(0)
    names = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    before = {n: p.detach().clone() for n, p in names.items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro_batches(step, padded):
            loss = model(**mb).loss  # called as the engine calls it
            (loss / 2).backward()
            total += loss.item() / 2
        if not torch.isfinite(torch.tensor(total)):
            raise ValueError("the loss is not finite")
        opt.step()
        losses.append(total)
    return losses, before, {n: p.detach().clone() for n, p in names.items()}


def engine_config(layout: str, blocks: int | None = None, momentum: float = 0.0) -> dict[str, Any]:
    """The engine's config for ``layout``; ``blocks``: the model's block count (interleaving needs
    one per virtual stage, else the layout runs 1F1B)."""
    shape = SHAPES[layout]
    gas = 2 // shape.dp
    config: dict[str, Any] = {
        "train_batch_size": MICRO * gas * shape.dp, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas, "gradient_clipping": 0.0, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": momentum}},
        "zero_optimization": {"stage": shape.stage, "stage3_param_persistence_threshold": 0},
    }
    if shape.tp > 1:
        config["tensor_parallel"] = {"size": shape.tp, "sequence_parallel": shape.sequence_parallel}
    if shape.cp > 1:
        config["context_parallel"] = {"size": shape.cp, "method": shape.method}
    if shape.pp > 1:
        config["pipeline"] = {"stages": shape.pp, "schedule": shape.schedule}
        if shape.schedule == "interleaved_1f1b":
            if blocks is not None and blocks >= 2 * shape.pp:
                config["pipeline"]["virtual_stages"] = 2
            else:
                config["pipeline"]["schedule"] = "1f1b"
    return config


def _what(exc: Exception) -> str:
    """An exception in one line; for transformers' empty ImportError, the backends it asked for."""
    text = str(exc).strip()
    if isinstance(exc, ImportError) and not text:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        backends = tb.tb_frame.f_locals.get("backends") if tb is not None else None
        text = f"needs {', '.join(backends)}, not installed" if backends else "a package it needs is not installed"
    if exc.__cause__ is not None and text.splitlines()[0].endswith(":"):  # a validator's: its cause says what
        text = f"{text.splitlines()[0]} {exc.__cause__}"
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"


def _reason(exc: Exception) -> str:
    """A ConfigError's message without the model class prefix (the table names the type)."""
    text = " ".join(str(exc).split())
    text = re.sub(r"^pipeline parallelism does not support \w+ \(model_type='[^']*'\): ", "", text)
    return re.sub(r"^\w+(ForCausalLM|LMHeadModel|Model)\w*( \(model_type[^)]*\))?:? ", "", text)


def _compare(losses: list[float], want: list[float], got: dict[str, torch.Tensor], before: dict[str, torch.Tensor],
             after: dict[str, torch.Tensor]) -> str:
    for step, (a, b) in enumerate(zip(losses, want)):
        if not abs(a - b) <= RTOL * abs(b):
            return f"fail: loss of step {step} is {a:.6f}, one process {b:.6f}"
    # A parameter whose exact gradient is zero (a key bias: softmax ignores a shift shared by all
    # keys) moves by rounding noise only, which no two summation orders share: errors below a
    # millionth of the largest update are that noise, not a wrong gradient.
    floor = 1e-6 * max((after[n] - before[n]).norm().item() for n in after)
    for name, value in got.items():
        if name not in after:
            return f"fail: the engine names a parameter {name!r} the model does not have"
        err = (value - after[name]).norm().item()
        update = (after[name] - before[name]).norm().item()
        if err > RTOL * update + floor:
            return f"fail: update of {name} off by {err / max(update, 1e-30):.1e} of itself"
    return "pass"


def _blocks(model: torch.nn.Module) -> int | None:
    found = layer_count(text_part(model.config))
    return found[1] if found else None


_ORACLE: dict[tuple[str, float, bool], Any] = {}  # the last type's oracles (or exceptions), shared by its layouts


def _cached_oracle(model_type: str, momentum: float,
                   padded: bool = True) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    key = (model_type, momentum, padded)
    if key not in _ORACLE:
        for other in [k for k in _ORACLE if k[0] != model_type]:
            del _ORACLE[other]
        try:
            _ORACLE[key] = oracle(model_type, momentum, padded)
        except Exception as exc:  # noqa: BLE001 - kept to be raised again for every layout
            _ORACLE[key] = exc
    found = _ORACLE[key]
    if isinstance(found, Exception):
        raise found
    return found


class _Outcome(Exception):
    """Ends a check early with its outcome (a refusal or a failure)."""


def _engine(model_type: str, layout: str, meta: bool, momentum: float) -> Any:
    import parallel3d
    from parallel3d.errors import ConfigError

    try:
        if meta:
            with torch.device("meta"):
                model = tiny_model(model_type)
        else:
            model = tiny_model(model_type)
        engine, _, _, _ = parallel3d.initialize(model=model, config=engine_config(layout, _blocks(model), momentum))
    except ConfigError as exc:
        raise _Outcome(f"refused: {_reason(exc)}") from exc
    except Exception as exc:  # noqa: BLE001 - a bug: report it and go on
        raise _Outcome(f"fail: initialize raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}") from exc
    return engine


def _train(engine: Any, layout: str, steps: range) -> list[float]:
    shape = SHAPES[layout]
    dp_rank, gas = engine.mesh.local_rank("dp"), 2 // shape.dp
    mine = slice(dp_rank * gas, (dp_rank + 1) * gas)
    return [engine.train_batch(iter(copy.deepcopy(micro_batches(step, shape.cp == 1)[mine]))) for step in steps]


def check(model_type: str, layout: str, meta: bool = False, scratch: str | None = None) -> str:
    """This rank's outcome for ``model_type`` under ``layout`` (module docstring). The oracle is
    trained once per type: it is the same for every layout, and the engine runs on fresh copies.
    ``meta``: the engine's model is built on the meta device and ``initialize`` gives it its values
    (the oracle's eager initialization, bit for bit, or the updates differ). ``layout`` ``"A>B"``
    (:data:`RESUMES`): the first step under A with momentum SGD, a checkpoint saved under
    ``scratch`` (a directory every rank reaches), then a fresh engine under B loads it and takes
    the second step."""
    resume = ">" in layout
    momentum = MOMENTUM if resume else 0.0
    try:
        want, before, after = _cached_oracle(model_type, momentum, all(SHAPES[p].cp == 1 for p in layout.split(">")))
    except Exception as exc:  # noqa: BLE001 - the tiny config is not one transformers runs
        return f"skip: tiny config fails in transformers ({_what(exc)})"
    try:
        if not resume:
            engine = _engine(model_type, layout, meta, momentum)
            losses = _guarded(lambda: _train(engine, layout, range(STEPS)), "training")
        else:
            first, second = layout.split(">")
            engine = _engine(model_type, first, meta, momentum)
            path = f"{scratch}/{model_type}-{first}-{second}"
            losses = _guarded(lambda: _train(engine, first, range(1)), "training")
            _guarded(lambda: engine.save_checkpoint(path, tag="step1"), "save_checkpoint")
            engine = _engine(model_type, second, meta, momentum)
            _guarded(lambda: engine.load_checkpoint(path, tag="step1"), "load_checkpoint")
            losses += _guarded(lambda: _train(engine, second, range(1, STEPS)), "training after the load")
        got = _guarded(engine.full_parameters, "full_parameters")
    except _Outcome as outcome:
        return str(outcome)
    return _compare(losses, want, got, before, after)


def _guarded(call: Any, what: str) -> Any:
    from parallel3d.errors import ConfigError

    try:
        return call()
    except ConfigError as exc:  # refused at run time (context parallelism's checks of each forward)
        raise _Outcome(f"refused: {_reason(exc)}") from exc
    except Exception as exc:  # noqa: BLE001 - a bug: report it and go on
        raise _Outcome(f"fail: {what} raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}") from exc
