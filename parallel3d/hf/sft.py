"""TRL's ``SFTTrainer`` through Zero3D: the same mixin, nothing else.

``SFTTrainer`` computes its own loss (``compute_loss`` with TRL's fused LM head, entropy and
token accuracy) and calls ``Trainer.compute_loss``'s conventions for ``num_items_in_batch``;
``Zero3DTrainerMixin`` runs that loss through the engine's forward and backward. Pipeline
stages are refused (they train with the model's own loss); ZeRO stages and data parallelism
run as with the plain Trainer.
"""

from __future__ import annotations

from parallel3d.errors import ConfigError
from parallel3d.hf.trainer import Zero3DTrainerMixin

try:
    import trl
except ImportError as exc:  # TRL is optional: say how to get it
    raise ConfigError("parallel3d.hf.SFTTrainer needs TRL: pip install trl (the version tested is in "
                      "constraints.txt)") from exc


class SFTTrainer(Zero3DTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with ``zero3d_config=`` (see docs/hf_trainer.md)."""
