"""The Hugging Face Trainer (and TRL) path into Zero3D: ``parallel3d.hf.Trainer``.

See docs/hf_trainer.md. ``Zero3DTrainerMixin`` turns any ``transformers.Trainer`` subclass into
one that trains through ``parallel3d.initialize``; ``SFTTrainer`` is TRL's with it mixed in
(imported only when asked for, since TRL is optional).
"""

from parallel3d.hf.trainer import Trainer, Zero3DTrainerMixin

__all__ = ["SFTTrainer", "Trainer", "Zero3DTrainerMixin"]


def __getattr__(name: str):
    if name == "SFTTrainer":
        from parallel3d.hf.sft import SFTTrainer

        return SFTTrainer
    raise AttributeError(f"module 'parallel3d.hf' has no attribute {name!r}")
