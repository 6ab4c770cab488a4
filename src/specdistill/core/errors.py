"""Errors shared across layers: a bad config value (stages, methods, the engine client), bad distillation data."""

from __future__ import annotations


class DataError(ValueError):
    """Distillation data is missing, malformed or misconfigured (the data layer's modules share it)."""


class ConfigError(ValueError):
    """A config value is unknown, missing, of the wrong type or out of range; the message names the key."""
