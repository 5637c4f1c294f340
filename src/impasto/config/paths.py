"""Relative paths of a config, made absolute once, when the config is loaded (issue #29).

A path written in a config file is relative to the folder of that file, as in most tools that
read a config file (a config moved together with its data keeps working, from any directory);
a path given on the command line (``--set data.path=...``) or in a mapping built in Python is
relative to the working directory, as every other command-line path is. ``~`` is the home folder.
The run then records only absolute paths (``RUN/config.yaml``), so ``impasto sample``,
``export``, ``runs`` and a resume work from any directory.

The fields that hold paths are the config's :data:`~impasto.config.section.PathStr` fields;
:func:`resolve_paths` finds them from the schema, so a new path field needs nothing here.
URLs (``s3://...``, ``pipe:...``, ``file:...``) are left as they are.
"""

from __future__ import annotations

import os
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from impasto.config.section import PATH_MARK

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")  # a scheme of 2+ characters: s3://, pipe:, file:


def resolve_path(value: str, base: Path) -> str:
    """``value`` as an absolute, normalised path: ``~`` expanded, a relative one joined to
    ``base``; a URL unchanged. An empty ``value`` is the caller's to refuse."""
    if URL.match(value):
        return value
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def resolve_paths(raw: Any, model: type[BaseModel], base: Path) -> Any:
    """A copy of the raw mapping ``raw`` of section ``model`` with every path field's string
    resolved against ``base`` (:func:`resolve_path`); what does not fit the schema is left for
    validation to report."""
    if not isinstance(raw, dict):
        return raw
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    resolved = dict(raw)
    for key, value in raw.items():
        field = fields.get(key)
        if field is not None:
            resolved[key] = _resolve_value(value, field.annotation, field.metadata, base)
    return resolved


def resolve_override(parts: list[str], value: Any, model: type[BaseModel], base: Path) -> Any:
    """``value`` as set at the dotted key ``parts`` of section ``model`` (a ``--set``), its
    paths resolved against ``base``."""
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    nested = resolve_paths(nested, model, base)
    for part in parts:
        nested = nested[part]
    return nested


def _resolve_value(value: Any, annotation: Any, metadata: list[Any], base: Path) -> Any:
    if isinstance(value, str) and value and _is_path(annotation, metadata):  # "": an error
        return resolve_path(value, base)
    section = _section_of(annotation)
    if section is not None and isinstance(value, dict):
        return resolve_paths(value, section, base)
    item = _item_section(annotation)
    if item is not None and isinstance(value, list):
        return [resolve_paths(entry, item, base) for entry in value]
    if item is not None and isinstance(value, dict):  # dict[str, Section]
        return {key: resolve_paths(entry, item, base) for key, entry in value.items()}
    return value


def _is_path(annotation: Any, metadata: list[Any]) -> bool:
    if PATH_MARK in metadata:
        return True
    return any(PATH_MARK in getattr(member, "__metadata__", ()) for member in _members(annotation))


def _members(annotation: Any) -> tuple[Any, ...]:
    """``annotation`` itself, or the members of a union (``PathStr | None``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _section_of(annotation: Any) -> type[BaseModel] | None:
    for member in _members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _item_section(annotation: Any) -> type[BaseModel] | None:
    """The section of ``list[Section]`` or ``dict[str, Section]`` items."""
    for member in _members(annotation):
        args = typing.get_args(member)
        if typing.get_origin(member) in (list, dict) and args:
            section = _section_of(args[-1])
            if section is not None:
                return section
    return None
