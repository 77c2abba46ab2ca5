"""The model of a job: an HF config (random init) or a local pretrained directory, built on meta.

Everything that can be checked without weights is checked in `hf_config`: unknown config
overrides (transformers would keep them silently), ``seq_len`` against the model's context.
"""

from __future__ import annotations

import difflib
import logging
import math
from pathlib import Path

import torch

from parallel3d.errors import ConfigError
from parallel3d.job.config import JobConfig
from parallel3d.build.remote_code import check_remote_code

logger = logging.getLogger(__name__)

PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a bad config: TypeError/ValueError, and huggingface_hub's strict
    dataclass validation (not a ValueError), e.g. heads that do not divide the hidden size."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (TypeError, ValueError)
    return (TypeError, ValueError, StrictDataclassError)


def _reason(exc: Exception) -> str:
    """The last line of a (possibly nested) validation message: the rule that was broken."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1].removeprefix("ValueError: ") if lines else type(exc).__name__


def hf_config(job: JobConfig):
    """The HF config of the job's model, with overrides applied and checked, without weights."""
    from transformers import AutoConfig

    m = job.model
    if m.path is not None:
        if not (Path(m.path) / "config.json").is_file():
            raise ConfigError(f'model.path: "{m.path}" is not a local model directory (no config.json)')
        trust = check_remote_code(m.path, m.trust_remote_code, "model.trust_remote_code")
        try:
            config = AutoConfig.from_pretrained(m.path, local_files_only=True, trust_remote_code=trust)
        except (OSError, *_config_errors()) as exc:
            raise ConfigError(f'model.path: "{m.path}" has a config transformers cannot read: {_reason(exc)}') from None
    else:
        default = AutoConfig.for_model(m.model_type)
        try:
            config = AutoConfig.for_model(m.model_type, **m.config)
        except _config_errors() as exc:
            raise ConfigError(f"model.config: transformers refuses these overrides for {m.model_type}: "
                              f"{_reason(exc)}") from None
        known = [*default.to_dict(), *getattr(default, "attribute_map", {})]
        for key in sorted(set(config.to_dict()) - set(default.to_dict())):
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean 'model.config.{near[0]}'?" if near else ""
            raise ConfigError(f"unknown config key 'model.config.{key}': {type(default).__name__} has no such field{hint}")
    max_pos = getattr(config, "max_position_embeddings", None)
    seq_len = job.data.seq_len
    if isinstance(max_pos, int) and seq_len > max_pos:
        where = "model.config.max_position_embeddings" if m.path is None else f"{m.path}/config.json"
        raise ConfigError(f"data.seq_len: {seq_len} is above the model's max_position_embeddings {max_pos} "
                          f"({where}); lower data.seq_len or raise max_position_embeddings")
    return config


def fit_to_tokenizer(job: JobConfig, config, tokenizer) -> None:
    """Vocabulary size and special token ids of ``config`` from the tokenizer (random init),
    or a check that a pretrained model's embedding covers the tokenizer."""
    n_tokens = len(tokenizer)
    if job.model.path is None:
        given = job.model.config.get("vocab_size")
        if given is None:
            config.vocab_size = n_tokens
        elif given < n_tokens:
            raise ConfigError(f"model.config.vocab_size: {given} is smaller than the tokenizer's {n_tokens} tokens")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if name not in job.model.config:
                setattr(config, name, getattr(tokenizer, name))
    elif config.vocab_size < n_tokens:
        raise ConfigError(f"model.path: the model's vocab_size {config.vocab_size} is smaller than the "
                          f"tokenizer's {n_tokens} tokens")


def check_dtype(job: JobConfig, precision: str) -> None:
    """model.dtype must be "auto" or the engine's working precision (fp32/bf16/fp16)."""
    engine_dtype = PRECISION_DTYPE[precision]
    if job.model.dtype not in ("auto", engine_dtype):
        raise ConfigError(f'model.dtype: "{job.model.dtype}" disagrees with the engine\'s working precision '
                          f"{engine_dtype} (engine bf16/fp16 sections); use \"auto\" or enable the matching "
                          "engine section")


def build_model(job: JobConfig, config, log: bool = True) -> torch.nn.Module:
    """The job's model, built on the meta device from ``config`` (no memory, no weights yet).

    ``parallel3d.initialize`` then fills in each rank's share: the values eager construction
    gives under the job's seed, or the weights in model.path (each rank reading only its
    slices).
    """
    from transformers import AutoModelForCausalLM

    m = job.model
    kwargs = {"attn_implementation": m.attn_implementation} if m.attn_implementation else {}
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code, **kwargs)
    except ValueError as exc:
        if "attn_implementation" in str(exc):
            raise ConfigError(f'model.attn_implementation: "{m.attn_implementation}" is not supported here: {exc}') from None
        raise ConfigError(f"model: transformers cannot build the model: {exc}") from None
    if log:
        n = sum(p.numel() for p in model.parameters())
        logger.info("model: %s, %.2fM parameters", type(model).__name__, n / 1e6)
    return model


def weights_note(path: str) -> str:
    """The log line saying where the weights of a job's ``model.path`` were read from."""
    from models.checkpoint_dir import scan_directory

    listing, stored = scan_directory(path)
    files = len({t.file for t in stored.values()})
    numel = sum(math.prod(t.shape) for t in stored.values())
    return (f"model: weights read from {Path(listing).resolve()} (model.path: {len(stored)} tensors, "
            f"{numel / 1e6:.2f}M values in {files} file{'s' if files != 1 else ''})")


def check_buildable(job: JobConfig, config) -> torch.nn.Module:
    """Build the model on the meta device (no memory, no weights) to surface errors before launch."""
    return build_model(job, config, log=False)
