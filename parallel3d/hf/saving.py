"""Where the Zero3D Trainer writes: checkpoints for resuming, and a gathered HF model directory.

* ``checkpoint-N/zero3d/`` (``save_steps``): the engine's mesh-free checkpoint
  (parallel3d/checkpoint/checkpoint.py): weights, optimizer states, LR schedule and counters under
  Hugging Face names and full shapes, loadable on any layout or world size. The Trainer's own
  files (``trainer_state.json``, RNG states) sit beside it, so ``resume_from_checkpoint``
  and ``save_total_limit`` work as they do. No model files are gathered at every save (as
  with DeepSpeed ZeRO-3); ``zero3d export checkpoint-N/zero3d OUT`` writes them when wanted.
* ``save_model(DIR)``: a ``from_pretrained`` directory, streamed from a scratch checkpoint by
  ``zero3d export`` (parallel3d/export/export.py) on rank 0, so no rank ever holds the whole model; the
  weights are the fp32 masters cast to the working precision. The tokenizer and
  ``training_args.bin`` are written as the Trainer writes them.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch.distributed as dist

from parallel3d.engine.engine import Engine
from parallel3d.export.export import WEIGHT_SUFFIXES, export_checkpoint

logger = logging.getLogger(__name__)

ENGINE_DIR = "zero3d"
"""The engine's checkpoint inside a Trainer ``checkpoint-N`` directory."""
SCRATCH = ".zero3d-save"
"""A save_model's scratch checkpoint and export, inside the output directory, removed afterwards."""


def engine_dir(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / ENGINE_DIR


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def export_model(engine: Engine, output_dir: str | Path, is_writer: bool) -> None:
    """Write ``output_dir`` as a Hugging Face model directory from the engine (collective)."""
    out = Path(output_dir)
    scratch = out / SCRATCH
    if is_writer:
        shutil.rmtree(scratch, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    tag = engine.save_checkpoint(str(scratch / "checkpoint"), tag="model")
    if is_writer:
        try:
            exported = export_checkpoint(scratch / "checkpoint" / tag, scratch / "export",
                                         dtype=engine.config.precision)
            for old in out.iterdir():  # weights of an earlier save (its shard count may differ)
                if old.is_file() and old.name.endswith(WEIGHT_SUFFIXES):
                    old.unlink()
            for written in exported.iterdir():
                shutil.move(str(written), out / written.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        logger.info("saved the model (%s) to %s", engine.config.precision, out)
    _barrier()
