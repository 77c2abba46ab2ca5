"""ZeRO memory sharding over one data-parallel process group (stages 0-3)."""

from zero.loss_scaler import DynamicLossScaler, LossScaler
from zero.optimizer import ZeroOptimizer, ZeroSettings

__all__ = ["DynamicLossScaler", "LossScaler", "ZeroOptimizer", "ZeroSettings"]
