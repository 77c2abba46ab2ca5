"""The exported ``config.json`` and ``generation_config.json``: special token ids that match the tokenizer.

A job that trains its own tokenizer (no ``tokenizer.path``, and a ``model.path`` without one)
packs its documents with that tokenizer's end-of-text between them, so the model learns to
end a text with the tokenizer's ids. A model config can still hold other ids: a pretrained
``model.path`` keeps its own (Llama's ``eos_token_id: 2``, which the trained tokenizer calls
``"``), and so do configs of older runs. ``generate`` stops on ``generation_config``'s
``eos_token_id``, so export writes the tokenizer's bos/eos/pad ids into both files, except the
ones the job set itself in ``model.config``.

``generation_config.json`` is the model directory's own when the job started from a
``model.path`` that has one (its sampling settings carry over), else one made from the config,
as ``save_pretrained`` of a model writes it. Which job wrote the checkpoint is read from the
run's ``job.yaml`` (``<run>/checkpoints/<tag>``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from parallel3d.build.remote_code import check_remote_code

logger = logging.getLogger(__name__)

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def run_job(tag_dir: Path) -> tuple[Path, dict] | None:
    """The run directory and ``job.yaml`` of the ``zero3d train`` run that wrote ``tag_dir``, if any."""
    for run_dir in (tag_dir.parent.parent, tag_dir.parent):
        path = run_dir / "job.yaml"
        if path.is_file():
            try:
                job = yaml.safe_load(path.read_text())
            except (yaml.YAMLError, UnicodeDecodeError) as exc:
                logger.warning("%s is not readable YAML (%s): special token ids are kept as the config has them",
                               path, exc)
                return None
            return (run_dir, job) if isinstance(job, dict) else None
    return None


def trained_tokenizer(job: dict) -> bool:
    """Whether ``job`` trained its tokenizer (prepare's rule: no tokenizer.path and none in model.path)."""
    from parallel3d.job.tokenizer import has_tokenizer

    model_path = (job.get("model") or {}).get("path")
    if (job.get("tokenizer") or {}).get("path") is not None:
        return False
    return not (model_path is not None and Path(model_path).is_dir() and has_tokenizer(model_path))


def tokenizer_ids(tokenizer_dir: Path, trust_remote_code: bool = False) -> dict[str, int]:
    """bos/eos/pad ids of the tokenizer saved in ``tokenizer_dir`` (the ones it defines); a directory
    whose tokenizer names its own code is refused unless ``trust_remote_code`` (``--trust-remote-code``)."""
    from transformers import AutoTokenizer

    trust = check_remote_code(tokenizer_dir, trust_remote_code, "--trust-remote-code")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True, trust_remote_code=trust)
    return {name: getattr(tok, name) for name in TOKEN_IDS if getattr(tok, name, None) is not None}


def _generation_config(config: Any, job: dict | None):
    """The model directory's own generation config when the job read one, else one from ``config``."""
    from transformers import GenerationConfig

    model_path = ((job or {}).get("model") or {}).get("path")
    if model_path is not None and (Path(model_path) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(model_path, local_files_only=True)
    return GenerationConfig.from_model_config(config)


def save_model_configs(config: Any, out: Path, tag_dir: Path, tokenizer_dir: Path | None,
                       trust_remote_code: bool = False) -> dict[str, int]:
    """Write ``config.json`` and ``generation_config.json`` into ``out``; returns the ids taken from
    the tokenizer (empty when the job did not train the tokenizer that is exported with the model).
    ``trust_remote_code`` is export's ``--trust-remote-code``, passed to the tokenizer's loader."""
    found = run_job(tag_dir)
    run_dir, job = found if found is not None else (None, None)
    ids: dict[str, int] = {}
    own_tokenizer = (run_dir is not None and tokenizer_dir is not None
                     and tokenizer_dir.resolve() == (run_dir / "tokenizer").resolve())
    if job is not None and own_tokenizer and trained_tokenizer(job):
        explicit = (job.get("model") or {}).get("config") or {}
        ids = {k: v for k, v in tokenizer_ids(tokenizer_dir, trust_remote_code).items() if k not in explicit}
        changed = {k: (getattr(config, k, None), v) for k, v in ids.items() if getattr(config, k, None) != v}
        if changed:
            logger.info("special token ids from the tokenizer the job trained: %s",
                        ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        for name, value in ids.items():
            setattr(config, name, value)
    config.save_pretrained(out)
    generation = _generation_config(config, job)
    for name, value in ids.items():
        setattr(generation, name, value)
    generation.save_pretrained(out)
    return ids
