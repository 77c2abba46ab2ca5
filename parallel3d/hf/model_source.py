"""``Trainer(model="path/to/model", ...)``: the model started on the meta device.

transformers' Trainer (and TRL's, given a name) loads the whole model on every process before
anything is sharded, which is what a model no rank can hold cannot survive (host RAM at init is
one of the Trainer/DeepSpeed seam's known failures). Given a directory instead of a model, the
Zero3D Trainer builds the model on the meta device (no memory) and hands the directory to
``parallel3d.initialize(pretrained=...)``, where each rank reads only the slices it keeps
(parallel3d/build/meta_init.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.build.remote_code import check_remote_code


def meta_model(path: str | os.PathLike, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of the local Hugging Face directory ``path``, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"model={str(path)!r}: not a local Hugging Face model directory (no config.json); give "
                          "the directory a from_pretrained() would read, or a model object")
    trust = check_remote_code(directory, trust_remote_code, "trust_remote_code")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=trust)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust, dtype=torch.float32)
    except (OSError, TypeError, ValueError) as exc:
        raise ConfigError(f"model={str(path)!r}: transformers cannot build a causal LM from it: {exc}") from None
