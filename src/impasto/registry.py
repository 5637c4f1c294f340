"""Registries: one dict per axis (model family, training method, ...) mapping a config name to
code, and the decorator that fills one. An unknown name is a one-line error listing the valid
ones (STYLE: registries, not if/elif chains over names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def registrar(registry: dict[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """``register = registrar(REGISTRY, "model family")``; then ``@register("name")``."""

    def register(name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in registry:
                raise ValueError(f"{kind} {name!r} is registered twice")
            registry[name] = entry
            return entry

        return add

    return register


def lookup(registry: dict[str, T], name: str, key: str, kind: str) -> T:
    """``registry[name]``, or ``ValueError("key: unknown kind 'name'; valid: ...")``."""
    if name not in registry:
        valid = ", ".join(sorted(registry))
        raise ValueError(f"{key}: unknown {kind} {name!r}; valid: {valid}")
    return registry[name]
