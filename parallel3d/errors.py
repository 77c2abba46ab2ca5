"""Errors raised on invalid user input."""


class ConfigError(ValueError):
    """An invalid configuration value, key, model or argument.

    Raised on every rank before any collective starts, with one message that names the
    key, the value and the rule it breaks.
    """


class UsageError(RuntimeError):
    """The engine's API called out of its order (a step without a backward, say).

    Not a config problem: the message says which call was expected instead.
    """


class CollectiveError(RuntimeError):
    """A collective that timed out or lost a peer, explained: which operation on which group,
    and which ranks did not arrive (parallel3d/runtime/watchdog.py)."""


class UntestedOptimizerError(ConfigError, AssertionError):
    """An optimizer whose update is not known to be elementwise, on sharded parameters, without
    ``zero_allow_untested_optimizer``. Also an AssertionError, the type DeepSpeed raises for the
    same refusal, so code written for DeepSpeed that catches it keeps working."""


class NoModelError(ConfigError, AssertionError):
    """``initialize`` without a ``torch.nn.Module``. Also an AssertionError, the type
    ``deepspeed.initialize`` raises for a missing model."""


class NoSyncStageError(ConfigError, AssertionError):
    """``engine.no_sync()`` at ZeRO stage 2 or 3. Also an AssertionError, the type DeepSpeed raises
    for it."""
