"""Zero3D's front door: ``initialize(model, config)`` -> a ZeRO / 3D-parallel training engine."""

from parallel3d.errors import ConfigError
from parallel3d.initialize import initialize

__all__ = ["ConfigError", "initialize"]
