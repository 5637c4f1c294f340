"""Configuration: schema, YAML loading, dotted overrides, migrations, hashing."""

from impasto.config.load import (
    ConfigError,
    build_config,
    config_diff,
    config_hash,
    config_to_dict,
    config_to_yaml,
    load_config,
)
from impasto.config.schema import CONFIG_VERSION, Config

__all__ = [
    "CONFIG_VERSION",
    "Config",
    "ConfigError",
    "build_config",
    "config_diff",
    "config_hash",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
]
