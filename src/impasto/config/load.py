"""YAML → validated :class:`Config`, dotted overrides, migrations and the config hash.

Every user mistake becomes one :class:`ConfigError` line naming the dotted key and the fix, and
every mistake of a config is reported at once; the CLI prints each line and exits with code 2.
Validation here is structural; :func:`impasto.train.checks.check_config` checks the registry names.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from impasto.config.errors import ConfigError
from impasto.config.paths import resolve_override, resolve_paths
from impasto.config.schema import CONFIG_VERSION, Config
from impasto.config.yaml_reader import parse_yaml

# config_version N → N+1. Each migration takes and returns the raw mapping.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
MAX_SHOWN = 80  # characters of a wrong value shown in a message


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a config file: UTF-8 YAML, checked by :func:`parse_yaml`."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, not a config file; name the YAML file")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(
            f"{path}: cannot read it ({error.strerror}); check its permissions"
        ) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (line {line}); save it as UTF-8") from None
    raw = parse_yaml(text, str(path))
    if raw is None:
        raise ConfigError(
            f"{path} is empty: a config needs model, data and train sections; start from one of "
            "the presets in configs/ (e.g. configs/demo.yaml)"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {_kind(raw)}")
    return raw


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b=c`` in place; the value is parsed as YAML (so ``1e-4``, ``true``, ``[1, 2]``)
    and its paths are relative to the working directory, as on any command line."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. optim.lr=1e-4")
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"--set {key}: empty part in the dotted key; write e.g. optim.lr=1e-4")
    value = resolve_override(parts, parse_yaml(text, f"--set {key}", key), Config, Path.cwd())
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            if isinstance(child, list):
                raise ConfigError(f"--set {key}: {prefix} is a list; set it whole: {prefix}=[...]")
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


def build_config(raw: dict[str, Any], base: str | Path | None = None) -> Config:
    """The validated :class:`Config` of a raw mapping, its relative paths (those of the
    defaults too, such as ``train.output_dir``) made absolute against ``base`` (default: the
    working directory; :mod:`impasto.config.paths`)."""
    raw = migrate(dict(raw))
    try:
        config = Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError("\n".join(_describe_all(error))) from None
    base = Path.cwd() if base is None else Path(base).absolute()
    dumped = config_to_dict(config)
    resolved = resolve_paths(dumped, Config, base)
    return config if resolved == dumped else Config.model_validate(resolved)


# Keys that name the same thing two ways: setting one with --set drops the other from the file,
# so `--set model.path=sdxl.safetensors` works on a config that names a preset (and back).
ALTERNATIVES = {"model.path": "model.preset", "model.preset": "model.path"}


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """The config of a YAML file with ``a.b=c`` overrides applied; the file's relative paths
    are relative to its folder, those of the overrides to the working directory."""
    raw = read_yaml(path)
    for assignment in overrides:
        apply_override(raw, assignment)
        key = assignment.partition("=")[0].strip()
        if key in ALTERNATIVES and raw["model"][key.split(".")[1]] is not None:
            raw["model"].pop(ALTERNATIVES[key].split(".")[1], None)
    return build_config(raw, base=Path(path).absolute().parent)


def config_to_dict(config: Config) -> dict[str, Any]:
    return config.model_dump(mode="json", by_alias=True)


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def config_hash(config: Config) -> str:
    """A content hash of the resolved config: sha256 of its canonical JSON, 16 hex digits."""
    canonical = json.dumps(config_to_dict(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ, as ``key: old -> new`` lines; absolute paths that all
    changed by one move of a folder (a project moved with its config) are one line."""
    changes = _changes(old, new, "")
    moves = {key: _moved_root(a, b) for key, a, b in changes}
    roots = {root for root in moves.values() if root is not None}
    if len(roots) != 1:
        return [f"{key}: {a!r} -> {b!r}" for key, a, b in changes]
    (old_root, new_root), keys = roots.pop(), [key for key, root in moves.items() if root]
    rest = [f"{key}: {a!r} -> {b!r}" for key, a, b in changes if moves[key] is None]
    return [f"paths moved from {old_root} to {new_root} ({', '.join(keys)})", *rest]


def _changes(old: dict[str, Any], new: dict[str, Any], prefix: str) -> list[tuple[str, Any, Any]]:
    found = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _changes(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append((f"{prefix}{key}", a, b))
    return found


def _moved_root(old: Any, new: Any) -> tuple[str, str] | None:
    """``(old folder, new folder)`` when the absolute paths ``old`` and ``new`` differ only
    in the folder before a common tail (``/a/data/x`` -> ``/b/data/x``: ``/a``, ``/b``)."""
    if not (isinstance(old, str) and isinstance(new, str)):
        return None
    a, b = Path(old), Path(new)
    if not (a.is_absolute() and b.is_absolute()):
        return None
    common = 0  # the number of trailing parts the two share
    while (
        common < min(len(a.parts), len(b.parts)) - 1
        and a.parts[-1 - common] == b.parts[-1 - common]
    ):
        common += 1
    if not common:
        return None
    return str(Path(*a.parts[:-common])), str(Path(*b.parts[:-common]))


def _describe_all(error: ValidationError) -> list[str]:
    """One line per wrong key. A value that fits no member of a union (``"none" | list``) gets
    errors from each member from pydantic; only the first is kept, as it names the key."""
    lines, seen = [], set()
    for details in error.errors():
        loc = details["loc"]
        members = [index for index, part in enumerate(loc) if _is_union_member(part)]
        key = loc[: members[0]] if members else loc
        if key not in seen:
            seen.add(key)
            lines.append(_describe(details))
    return lines


def _is_union_member(part: str | int) -> bool:
    # pydantic names a union member by its type, e.g. "literal['none','all']" or "list[str]";
    # config keys are names (dict keys such as subfolder "10_cats" too) and list positions ints.
    return isinstance(part, str) and "[" in part


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
    if kind == "missing" and loc[-1].isdigit():  # a tuple too short, e.g. optim.betas: [0.9]
        parent = ".".join(loc[:-1])
        return f"{parent}: too few items, item {loc[-1]} is missing; list every item"
    if kind == "missing":
        return f"{path}: required key is missing; add it to the config"
    if kind == "model_type":  # "a valid dictionary or instance of OptimConfig"
        return f"{path}: must be a section of keys, got {_shown(value)}"
    message = message.removeprefix("Value error, ")
    if kind in ("value_error", "assertion_error"):
        return f"{path}: {message}"
    message = message.split(", got ")[0]  # "... integer, got a number with a fractional part"
    shown = "a mapping" if isinstance(value, dict) else _shown(value)
    return f"{path}: {message[0].lower()}{message[1:]}, got {shown}"


def _shown(value: object) -> str:
    """``repr(value)``, cut to :data:`MAX_SHOWN` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int of over 4300 digits has no repr
        return "a huge integer"
    return text if len(text) <= MAX_SHOWN else f"{text[: MAX_SHOWN - 3]}..."


def _keys_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The keys of the section at ``loc``: through sections, list items (``data.sources.0``),
    dict values (``data.subfolders.NAME``) and optional or union members."""
    annotation: Any = model
    for part in loc:
        annotation = _child_type(annotation, part)
        if annotation is None:
            return []
    found = _section_in(annotation)
    return [info.alias or name for name, info in found.model_fields.items()] if found else []


def _child_type(annotation: Any, part: str) -> Any:
    """The type of ``part`` (a key, dict key or list index) inside a value of ``annotation``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if _is_section(annotation):
        fields = {info.alias or name: info for name, info in annotation.model_fields.items()}
        return fields[part].annotation if part in fields else None
    if origin in (list, tuple) and args and part.isdigit():
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    children = (_child_type(member, part) for member in _union_members(annotation))
    return next((child for child in children if child is not None), None)


def _section_in(annotation: Any) -> type[BaseModel] | None:
    """``annotation`` if it is a section, else its first member that is (``X | None``)."""
    if _is_section(annotation):
        return annotation
    return next(filter(None, map(_section_in, _union_members(annotation))), None)


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _union_members(annotation: Any) -> tuple[Any, ...]:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else ()


def _kind(value: object) -> str:
    return type(value).__name__
