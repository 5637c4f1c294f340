"""Probing split across ranks (issue #32): each clip is decoded once to count its frames, by
one rank, and every rank ends with every clip's probe; rank 0 alone writes the probe index.

The split and the merge are tested in one process; one slow test launches two gloo ranks with
torchrun (this file is also their worker: ``python test_video_probe_ranks.py FOLDER OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

import impasto.data.video.share as share
from impasto.data.video.scan import ClipRecord, probe_clips
from impasto.data.video.share import (
    ProbeFailed,
    agreed_names,
    merge_probes,
    probe_results,
    probe_share,
)

NUM_CLIPS = 5


def write_clips(root: Path) -> Path:
    """Frame folders ``clip-0 .. clip-4`` of 3 + i flat frames (each count tells the clip
    apart), a broken video and a still image."""
    for clip in range(NUM_CLIPS):
        folder = root / f"clip-{clip}"
        folder.mkdir(parents=True)
        for index in range(3 + clip):
            Image.fromarray(np.full((8, 8, 3), 20 * index, np.uint8)).save(folder / f"{index}.png")
        (folder / "fps.txt").write_text("8")
    (root / "broken.mp4").write_bytes(b"no video here" * 8)
    Image.new("RGB", (8, 8)).save(root / "still.png")
    return root


def test_the_shares_of_the_ranks_are_disjoint_and_cover_every_clip() -> None:
    names = [f"clip-{i}" for i in range(7)]
    for world in (1, 2, 3, 8):
        shares = [probe_share(names, rank, world) for rank in range(world)]
        assert sorted(name for part in shares for name in part) == sorted(names)
        assert sum(len(part) for part in shares) == len(names)  # no clip probed twice
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced
    assert probe_share(names, 1, 3) == ["clip-1", "clip-4"]
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        probe_share(names, 2, 2)


def test_the_ranks_agree_on_the_union_of_what_each_found_missing() -> None:
    # Rank 1's copy of the index knew clip b; rank 0's did not: b is probed anyway, once.
    assert agreed_names([["a", "b", "c"], ["a", "c", "d"]]) == ["a", "b", "c", "d"]
    assert agreed_names([[], []]) == []


def test_split_probes_merged_equal_one_process_probing_everything(tmp_path: Path) -> None:
    root = write_clips(tmp_path / "clips")
    records = [ClipRecord(path, "") for path in sorted(root.iterdir())]
    names = [str(record.path) for record in records]
    by_name = dict(zip(names, records, strict=True))
    parts = [probe_results([by_name[n] for n in probe_share(names, r, 2)]) for r in range(2)]
    merged = merge_probes(parts)
    assert merged.keys() == set(names)
    whole, skipped = probe_clips(records)
    assert {str(record.path): info for record, info in whole} == {
        name: result for name, result in merged.items() if not isinstance(result, str)
    }
    assert {item.name: item.reason for item in skipped} == {
        name: result for name, result in merged.items() if isinstance(result, str)
    }
    assert merged[str(root / "clip-4")].num_frames == 7


def test_an_error_on_one_rank_is_raised_on_every_rank() -> None:
    with pytest.raises(RuntimeError, match="rank 1: PermissionError: denied"):
        merge_probes([{"a": "bad"}, ProbeFailed(1, "PermissionError: denied")])


def test_one_process_probes_everything_without_collectives(tmp_path: Path, monkeypatch) -> None:
    root = write_clips(tmp_path / "clips")
    records = [ClipRecord(root / f"clip-{i}", "") for i in range(NUM_CLIPS)]
    monkeypatch.setattr(share, "gather_to_all", lambda value: pytest.fail("no process group"))
    probed: list[str] = []
    real = share.probe_clip
    monkeypatch.setattr(share, "probe_clip", lambda s, n: probed.append(n) or real(s, n))
    results = share.probe_across_ranks([*records, records[1]])  # clip-1 listed twice
    assert [results[str(r.path)].num_frames for r in records] == [3, 4, 5, 6, 7]
    assert probed == [str(r.path) for r in records]  # each once


def test_a_rank_probes_its_share_of_what_any_rank_wanted(tmp_path: Path, monkeypatch) -> None:
    """Rank 0 of 2 found every clip in its copy of the index but clip-4; rank 1 (simulated)
    wanted clip-0 .. clip-3: rank 0 probes clip-4 and clip-1 and clip-3 of the agreed list,
    and ends with rank 1's results for the others."""
    root = write_clips(tmp_path / "clips")
    records = [ClipRecord(root / f"clip-{i}", "") for i in range(NUM_CLIPS)]
    names = [str(record.path) for record in records]
    probed: list[str] = []
    real = share.probe_clip
    monkeypatch.setattr(share, "probe_clip", lambda s, n: probed.append(n) or real(s, n))
    monkeypatch.setattr(share, "rank_in_group", lambda: (0, 2))
    other_rank = iter([names[:4], {names[0]: "rank 1's", names[2]: "rank 1's"}])
    monkeypatch.setattr(share, "gather_to_all", lambda value: [value, next(other_rank)])
    results = share.probe_across_ranks(records[4:], records)
    # The agreed list: clip-4 (rank 0's), then clip-0 .. clip-3: rank 0 takes every second.
    assert probed == [names[4], names[1], names[3]]
    assert [results[name] if isinstance(results[name], str) else results[name].num_frames
            for name in names] == ["rank 1's", 4, "rank 1's", 6, 7]  # fmt: skip


def test_each_epoch_a_sample_is_loaded_by_one_rank_only() -> None:
    """Per-epoch decoding: rank r of a run loads only its share of every step's batches, so
    each clip sample is decoded by the rank that trains it; across ranks a sample of epoch 0
    is loaded once, except those that fill a bucket's short last batch (fewer than a batch)."""
    from impasto.data import training_sampler

    shapes = [(9 if index % 3 else 5, 32, 32) for index in range(23)]  # two frame buckets
    loaded = []
    for rank in range(2):
        sampler = training_sampler(23, 2, seed=0, bucket_of=shapes, rank=rank, world_size=2)
        mine = []
        for batch in sampler:
            if any(key.epoch > 0 for key in batch):
                break
            mine.extend(key.index for key in batch)
        loaded.append(mine)
    assert not set(loaded[0]) & set(loaded[1])  # no sample decoded on both ranks
    assert sorted(set(loaded[0]) | set(loaded[1])) == list(range(23))
    assert len(loaded[0]) + len(loaded[1]) - 23 <= 2  # the fill: < batch size per bucket


def run_rank(folder: Path, out: Path) -> None:
    """One rank of the torchrun launch: scan the folder twice (a cold then a warm index),
    recording the clips this rank probed and whether it wrote the index."""
    import torch.distributed as dist

    import impasto.data.video.index as index_module
    from impasto.data.video.records import clip_folder_scan

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    probed: list[list[str]] = []
    writes: list[int] = []
    real_probe, real_write = share.probe_clip, index_module._write

    def counting_probe(source, name=None, fps=None):
        probed[-1].append(Path(str(source)).name)
        return real_probe(source, name, fps)

    def counting_write(file, clips):
        writes.append(len(clips))
        real_write(file, clips)

    share.probe_clip, index_module._write = counting_probe, counting_write
    source = SimpleNamespace(path=str(folder))
    scans = []
    for _ in range(2):
        probed.append([])
        scans.append(clip_folder_scan(source, out / "index"))
    found = scans[0]
    result = {
        "probed": probed,
        "writes": writes,
        "frames": [
            [Path(r.image_path).name, r.clip and r.clip.info.num_frames] for r in found.records
        ],  # fmt: skip
        "again": [
            [Path(r.image_path).name, r.clip and r.clip.info.num_frames] for r in scans[1].records
        ],  # fmt: skip
        "skipped": [Path(item.name).name for item in found.skipped],
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_probe_each_clip_once_and_agree(tmp_path: Path) -> None:
    root = write_clips(tmp_path / "clips")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, str(root), str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]
    cold = [rank["probed"][0] for rank in ranks]
    clips = sorted([f"clip-{i}" for i in range(NUM_CLIPS)] + ["broken.mp4", "still.png"])
    assert sorted(cold[0] + cold[1]) == clips  # every clip decoded once, by one rank
    assert not set(cold[0]) & set(cold[1]) and all(cold)  # both ranks did a share
    assert [rank["probed"][1] for rank in ranks] == [["broken.mp4"], []]  # warm: only the bad
    assert ranks[0]["frames"] == ranks[1]["frames"] == ranks[0]["again"] == ranks[1]["again"]
    counts = dict(ranks[0]["frames"])
    assert [counts[f"clip-{i}"] for i in range(NUM_CLIPS)] == [3, 4, 5, 6, 7]
    assert counts["still.png"] is None
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == ["broken.mp4"]
    assert ranks[0]["writes"] == [NUM_CLIPS + 1] and ranks[1]["writes"] == []  # rank 0 alone
    [index] = (out / "index").glob("clips-*.json")
    assert len(json.loads(index.read_text())["clips"]) == NUM_CLIPS + 1  # 5 clips + the still


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), Path(sys.argv[2]))
