"""Atomic checkpoint writer: complete or absent, retention, damaged files."""

from __future__ import annotations

import pytest
import torch

from impasto.checkpoint import (
    CheckpointData,
    DamagedCheckpoint,
    DiskFullError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_leftovers,
    save_checkpoint,
)
from impasto.checkpoint import state as state_module


def _data(value: float) -> CheckpointData:
    return CheckpointData(
        tensors={"model": {"w": torch.full((3,), value)}},
        objects={
            "optimizer": {"state": {0: {"exp_avg": torch.ones(2) * value}}, "param_groups": []}
        },
        state={"step": value},
        texts={"config.yaml": "a: 1\n"},
    )


def test_round_trip_and_retention(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, _data(float(step)), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    loaded = load_checkpoint(latest_checkpoint(tmp_path))
    assert torch.equal(loaded.tensors["model"]["w"], torch.full((3,), 5.0))
    assert torch.equal(loaded.objects["optimizer"]["state"][0]["exp_avg"], torch.full((2,), 5.0))
    assert loaded.state == {"step": 5.0} and loaded.texts["config.yaml"] == "a: 1\n"


def test_failure_mid_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, _data(1.0), keep_last=1)

    def broken_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state_module.torch, "save", broken_save)
    with pytest.raises(DiskFullError, match="not enough disk space .* step-00000001 is intact"):
        save_checkpoint(tmp_path, 2, _data(2.0), keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]  # no partial left behind
    assert load_checkpoint(latest_checkpoint(tmp_path)).state == {"step": 1.0}


def test_partial_directory_from_a_kill_is_ignored_and_cleaned(tmp_path):
    save_checkpoint(tmp_path, 3, _data(3.0), keep_last=3)
    partial = tmp_path / ".tmp-step-00000004-999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 10)
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    save_checkpoint(tmp_path, 4, _data(4.0), keep_last=3)
    assert partial.exists()  # a save leaves others' files alone (the run lock makes it ours)
    assert remove_leftovers(tmp_path) == [partial]  # what a run does when it starts
    assert not partial.exists()


def test_truncated_file_gives_one_line_error(tmp_path):
    path = save_checkpoint(tmp_path, 1, _data(1.0), keep_last=1)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])
    with pytest.raises(
        DamagedCheckpoint, match=r"model.safetensors is damaged \(truncated: 20 bytes, .*delete"
    ) as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)
