"""Everything before the engine exists, checked in an order that fails fast and clearly.

`prepare` runs in the `zero3d train` process before it launches workers (so bad input stops
with one message and no worker noise) and again in each worker, where the tokenizer and the
packed data are cache hits. Order: engine config (batch sizes for this world), model config
and seq_len, dtype, resume checkpoint, data files and text column, tokenizer, packing, sizes.
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel3d.config.config import Zero3DConfig, load_config
from parallel3d.errors import ConfigError
from parallel3d.job import model as model_lib
from parallel3d.job.checkpoints import check_resume_model, find_resume
from parallel3d.job.config import JobConfig, engine_dict
from parallel3d.job.chat import chat_template_problem, chat_texts
from parallel3d.job.data import iter_texts, load_documents, pack_documents
from parallel3d.job.sampler import BlockSampler
from parallel3d.job.resume_batch import check_resume_batch
from parallel3d.job.schedule import resumed_schedule
from parallel3d.build.meta_init import pretrained_source
from parallel3d.job.tokenizer import builtin_tokenizer, has_tokenizer, local_tokenizer, with_chat_template
from models.packed_attention import packing_problem

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    job: JobConfig
    world_size: int
    engine_config: dict
    """The engine config as given to initialize (scheduler "auto" step counts filled in)."""
    resolved: Zero3DConfig
    hf_config: Any
    tokenizer: Any
    blocks: dict
    """{"train": Dataset, "validation": Dataset | None} of packed input_ids."""
    stats: dict
    total_steps: int
    steps_per_epoch: int
    resume_from: Path | None
    info: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.resolved.data_parallel_size

    @property
    def tokens_per_step(self) -> int:
        return self.resolved.train_batch_size * self.job.data.seq_len


def _resolve_engine(data: dict, world_size: int) -> Zero3DConfig:
    try:
        return load_config(data, world_size)
    except ConfigError as exc:
        raise ConfigError(f"engine: {exc}") from None


def _tokenizer(job: JobConfig, docs: dict, identity: dict):
    if job.tokenizer.path is not None:
        tok = local_tokenizer(job.tokenizer.path, trust_remote_code=job.tokenizer.trust_remote_code)
    elif job.model.path is not None and has_tokenizer(job.model.path):
        tok = local_tokenizer(job.model.path, "model.path", job.tokenizer.trust_remote_code)
    else:
        texts = chat_texts(docs["train"]) if job.data.format == "chat" else iter_texts(docs["train"], docs["column"])
        tok = builtin_tokenizer(texts, identity, job.tokenizer.vocab_size, job.tokenizer.max_train_chars)
    if job.tokenizer.chat_template is not None:
        tok = with_chat_template(tok, job.tokenizer.chat_template)
    if job.data.format == "chat" and (problem := chat_template_problem(tok)) is not None:
        raise ConfigError(f'data.format "chat": {problem}')
    return tok


def _check_packing(job: JobConfig, model, micro: int) -> None:
    """Chat data is packed with documents kept apart; refuse a model whose attention would not."""
    if job.data.format != "chat":
        return
    problem = packing_problem(model, model.config._attn_implementation, micro)
    if problem is not None:
        raise ConfigError(f'data.format "chat" packs conversations into blocks, each attending only to itself: '
                          f"{problem} (model.attn_implementation)")


def _make_output_dir(out: Path) -> None:
    """Create train.output_dir and write a file into it, so a bad one stops here (last, once the rest is valid)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".zero3d-probe"):
            pass
    except FileExistsError:
        raise ConfigError(f"train.output_dir: {out} is a file, not a directory") from None
    except OSError as exc:
        raise ConfigError(f"train.output_dir: {out} cannot be created or written: {exc.strerror or exc}") from None


def prepare(job: JobConfig, world_size: int) -> Prepared:
    """Validate the job for ``world_size`` processes and build its tokenizer and packed data."""
    resolved = _resolve_engine(engine_dict(job), world_size)
    model_lib.check_dtype(job, resolved.precision)
    hf_config = model_lib.hf_config(job)
    resume_from = find_resume(job)
    check_resume_batch(job.engine, resolved, resume_from)
    docs, identity = load_documents(job)
    tokenizer = _tokenizer(job, docs, identity)
    model_lib.fit_to_tokenizer(job, hf_config, tokenizer)
    model = model_lib.check_buildable(job, hf_config)
    _check_packing(job, model, resolved.train_micro_batch_size_per_gpu)
    if job.model.path is not None:
        pretrained_source(job.model.path, model)  # the safetensors headers against the model, before any worker
    if resume_from is not None:
        check_resume_model(resume_from, model)
    blocks, stats = pack_documents(docs, identity, tokenizer, job)
    dp, micro, gas = resolved.data_parallel_size, resolved.train_micro_batch_size_per_gpu, resolved.gradient_accumulation_steps
    sampler = BlockSampler(len(blocks["train"]), micro, dp, 0, gas, job.train.seed)
    if job.train.max_steps is not None:
        total = job.train.max_steps
    else:
        total = max(1, math.ceil(job.train.epochs * sampler.steps_per_epoch))
    val = blocks["validation"]
    if val is not None and len(val) < dp * micro:
        raise ConfigError(f"data: the validation split packs into {len(val)} blocks of {job.data.seq_len} tokens, "
                          f"fewer than one evaluation batch (train_micro_batch_size_per_gpu {micro} x data-parallel "
                          f"size {dp}); raise data.validation_fraction or set it to 0")
    final_engine = engine_dict(job, total)
    final_engine, schedule_note = resumed_schedule(job.engine, final_engine, resume_from, total)
    resolved = _resolve_engine(final_engine, world_size)
    _make_output_dir(Path(job.train.output_dir))
    info = {"parameters": None, "train_blocks": len(blocks["train"]),
            "validation_blocks": len(val) if val is not None else 0, "steps_per_epoch": sampler.steps_per_epoch,
            "schedule_note": schedule_note}
    return Prepared(job, world_size, final_engine, resolved, hf_config, tokenizer, blocks, stats, total,
                    sampler.steps_per_epoch, resume_from, info)


def describe(p: Prepared) -> str:
    """One paragraph about the prepared job, for the log."""
    s, d = p.stats["train"], p.job.data
    val = p.stats.get("validation")
    val_text = f", validation {val['blocks']} blocks" if val else ", no validation"
    chat = (f" (chat: whole conversations, {s['cut_to_seq_len']} cut to seq_len, "
            f"{s.get('dropped_without_trained_labels', 0)} dropped with no assistant token left, "
            "labels on the assistant's turns)"
            if "cut_to_seq_len" in s else "")
    return (f"data: {s['documents']} documents, {s['tokens']:,} tokens -> {s['blocks']} blocks of {d.seq_len}{chat}"
            f"{val_text}; tokenizer: {len(p.tokenizer)} tokens; world {p.world_size} (dp {p.dp}), "
            f"global batch {p.resolved.train_batch_size} blocks = {p.tokens_per_step:,} tokens/step; "
            f"{p.total_steps} steps ({p.total_steps / p.steps_per_epoch:.2f} epochs of {p.steps_per_epoch} steps)")
