"""YAML → validated :class:`Config`, dotted overrides, migrations and the config hash.

Every user mistake becomes one :class:`ConfigError` line naming the dotted key and the fix, and
every mistake of a config is reported at once; the CLI prints each line and exits with code 2.
Validation here is structural; :func:`impasto.train.checks.check_config` checks the registry names.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from impasto.config.schema import CONFIG_VERSION, Config


class ConfigError(ValueError):
    """User-facing configuration problems; the message has one line per problem."""


# config_version N → N+1. Each migration takes and returns the raw mapping.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: {problem}{where}; fix the YAML syntax") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {_kind(raw)}")
    return raw


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b=c`` in place; the value is parsed as YAML (so ``1e-4``, ``true``, ``[1, 2]``)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. optim.lr=1e-4")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"--set {key}: cannot parse value {text!r} as YAML") from None
    parts = key.strip().split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            raise ConfigError(f"--set {key}: {prefix} is a value, not a section")
        node = child
    node[parts[-1]] = value


def migrate(raw: dict[str, Any]) -> dict[str, Any]:
    version = raw.get("config_version", CONFIG_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ConfigError(f"config_version: must be a positive integer, got {version!r}")
    if version > CONFIG_VERSION:
        raise ConfigError(
            f"config_version: {version} is newer than this impasto supports ({CONFIG_VERSION}); "
            "upgrade impasto"
        )
    while version < CONFIG_VERSION:
        raw = MIGRATIONS[version](raw)
        version += 1
    raw["config_version"] = CONFIG_VERSION
    return raw


def build_config(raw: dict[str, Any]) -> Config:
    raw = migrate(dict(raw))
    try:
        return Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError("\n".join(_describe_all(error))) from None


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    raw = read_yaml(path)
    for assignment in overrides:
        apply_override(raw, assignment)
    return build_config(raw)


def config_to_dict(config: Config) -> dict[str, Any]:
    return config.model_dump(mode="json", by_alias=True)


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def config_hash(config: Config) -> str:
    """A content hash of the resolved config: sha256 of its canonical JSON, 16 hex digits."""
    canonical = json.dumps(config_to_dict(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, as ``key: old -> new`` lines."""
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return lines


def _describe_all(error: ValidationError) -> list[str]:
    """One line per wrong key. A value that fits no member of a union (``"none" | list``) gets
    one error per member from pydantic; only the first is kept, as it names the key."""
    lines, seen = [], set()
    for details in error.errors():
        key = tuple(part for part in details["loc"] if not _is_union_member(part))
        if key not in seen:
            seen.add(key)
            lines.append(_describe(details))
    return lines


def _is_union_member(part: str | int) -> bool:
    # pydantic names a union member by its type, e.g. "literal['none','all']" or "list[str]";
    # config keys are identifiers and list positions are ints.
    return isinstance(part, str) and not part.isidentifier()


def _describe(details: ErrorDetails) -> str:
    """One validation error as ``dotted.path: message, got value``."""
    loc = [str(part) for part in details["loc"] if not _is_union_member(part)]
    path = ".".join(loc) or "config"
    kind, message, value = details["type"], details["msg"], details.get("input")
    if kind == "extra_forbidden":
        section_keys = _keys_at(Config, loc[:-1])
        hint = difflib.get_close_matches(loc[-1], section_keys, n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"valid keys: {', '.join(section_keys)}"
        return f"{path}: unknown key; {fix}"
    if kind == "missing":
        return f"{path}: required key is missing; add it to the config"
    message = message.removeprefix("Value error, ")
    if kind in ("value_error", "assertion_error") or isinstance(value, dict):
        return f"{path}: {message}"
    return f"{path}: {message[0].lower()}{message[1:]}, got {value!r}"


def _keys_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _kind(value: object) -> str:
    return type(value).__name__
