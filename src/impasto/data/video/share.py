"""Probing split across the ranks of a run: each clip decoded once, by one rank.

Counting a clip's frames decodes all of it (:func:`~impasto.data.video.probe.probe_clip`). Every
rank of a run reads the same sources, so without a split a cold start on ``N`` ranks would
decode every clip ``N`` times. Instead the clips to probe are agreed on by all ranks (the
union of what each rank found missing from the probe index, in a fixed order), rank ``r``
probes the ``r``-th, ``(r + N)``-th, ... of them (:func:`probe_share`), and the results are
exchanged with ``torch.distributed.all_gather_object`` (:func:`merge_probes`), so every rank
ends with every clip's :class:`~impasto.data.video.probe.ClipInfo`. Outside a process group
(one process) the one rank probes everything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from impasto.data.video.frames import UnreadableClip
from impasto.data.video.probe import ClipInfo, probe_clip
from impasto.data.video.scan import ClipRecord
from impasto.distributed import gather_to_all

ProbeResult = ClipInfo | str
"""A clip's probe: its :class:`ClipInfo`, or why it does not decode (a bad-data reason)."""


@dataclass(frozen=True)
class ProbeFailed:
    """An error rank ``rank`` met while probing its share (anything but an unreadable clip:
    a permission error, a bug), as text, so that every rank can raise it."""

    rank: int
    message: str


def rank_in_group() -> tuple[int, int]:
    """``(rank, world_size)`` in the initialised process group, else ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agreed_names(parts: Iterable[Sequence[str]]) -> list[str]:
    """The names every rank asked for (``parts`` in rank order), each once, first come first:
    the same list on every rank whatever each one found in its copy of the probe index."""
    return list(dict.fromkeys(name for part in parts for name in part))


def probe_share(names: Sequence[str], rank: int, world: int) -> list[str]:
    """The names rank ``rank`` of ``world`` probes: every ``world``-th from its own; the
    shares of all ranks are disjoint and together are ``names``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    return list(names[rank::world])


def probe_results(records: Sequence[ClipRecord]) -> dict[str, ProbeResult]:
    """Each record probed once (by its name ``str(record.path)``, however often it is
    listed): its info, or the reason it does not decode."""
    results: dict[str, ProbeResult] = {}
    for record in records:
        name = str(record.path)
        if name in results:
            continue
        try:
            results[name] = probe_clip(record.source, name)
        except UnreadableClip as error:
            results[name] = error.reason
    return results


def merge_probes(parts: Iterable[dict[str, ProbeResult] | ProbeFailed]) -> dict[str, ProbeResult]:
    """The ranks' results (in rank order) as one dict; a :class:`ProbeFailed` is raised on
    every rank (as a ``RuntimeError`` naming the rank), so none goes on alone."""
    merged: dict[str, ProbeResult] = {}
    for part in parts:
        if isinstance(part, ProbeFailed):
            raise RuntimeError(f"data: probing clips failed on rank {part.rank}: {part.message}")
        merged.update(part)
    return merged


def probe_across_ranks(
    wanted: Sequence[ClipRecord], records: Sequence[ClipRecord] | None = None
) -> dict[str, ProbeResult]:
    """Every clip of ``wanted`` (what this rank lacks a probe of) probed once across the ranks
    (module docstring), the results on every rank. Every rank of a process group must call it;
    a rank probes the clips of its share from ``records`` (default ``wanted``), which must list
    them (the same sources on every rank), so that it can probe what another rank wanted."""
    rank, world = rank_in_group()
    if world == 1:
        return probe_results(wanted)
    by_name = {str(record.path): record for record in (records if records is not None else wanted)}
    names = agreed_names(gather_to_all(list(dict.fromkeys(str(r.path) for r in wanted))))
    mine = [by_name[name] for name in probe_share(names, rank, world) if name in by_name]
    try:
        result: dict[str, ProbeResult] | ProbeFailed = probe_results(mine)
    except Exception as error:  # raised on every rank by merge_probes, not here alone
        result = ProbeFailed(rank, f"{type(error).__name__}: {error}")
    return merge_probes(gather_to_all(result))
