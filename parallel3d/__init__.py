"""Zero3D's front door: ``initialize(model, config)`` -> a ZeRO / 3D-parallel training engine."""

from parallel3d.errors import ConfigError, UsageError
from parallel3d.compat.gathered import GatheredParameters
from parallel3d.initialize import initialize
from parallel3d.compat.param_access import (
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_set_full_fp32_param,
    safe_set_full_grad, safe_set_full_optimizer_state)

__all__ = ["ConfigError", "UsageError", "GatheredParameters", "initialize", "safe_get_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
           "safe_set_full_optimizer_state"]
