"""The error of a config mistake, shared by the YAML reader and the schema's loader."""

from __future__ import annotations


class ConfigError(ValueError):
    """User-facing configuration problems; the message has one line per problem."""
