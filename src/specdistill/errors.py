"""The error every layer raises for a bad config value (stages, methods, the engine client)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is unknown, missing, of the wrong type or out of range; the message names the key."""
