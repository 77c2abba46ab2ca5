"""Errors raised on invalid user input."""


class ConfigError(ValueError):
    """An invalid configuration value, key, model or argument.

    Raised on every rank before any collective starts, with one message that names the
    key, the value and the rule it breaks.
    """
