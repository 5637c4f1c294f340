"""Exact resume of the whole run state (issue #13): a run stopped mid-epoch and resumed equals
the uninterrupted run bit for bit: weights, optimizer, EMA, counters, data position and every
RNG stream, also where randomness comes from torch's global generator (LoRA dropout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from impasto.checkpoint import load_checkpoint
from impasto.config import build_config
from impasto.train.trainer import train


def _raw(data: Path, run_dir: Path, max_steps: int) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny"},
        "data": {"path": str(data), "resolution": 64, "batch_size": 4, "caption_dropout": 0.2},
        "parts": {"unet": "lora", "text_encoder": "lora"},
        "lora": {"rank": 4, "dropout": 0.1},
        "ema": {"enabled": True, "decay": 0.9},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(run_dir), "seed": 3, "max_steps": max_steps},
        "checkpoint": {"every_steps": 5, "keep_last": 2},
        "log": {"every_steps": 2, "tensorboard": False, "progress_bar": False},
    }


def test_lora_dropout_run_resumed_mid_epoch_is_bitwise_identical(tmp_path, demo_folder):
    straight = train(build_config(_raw(demo_folder, tmp_path / "straight", 10)))
    run_dir = tmp_path / "resumed"
    first = train(build_config(_raw(demo_folder, run_dir, 5)))
    # 16 images in batches of 4: step 5 stops one batch into the second epoch.
    assert (
        json.loads((first.last_checkpoint / "state.json").read_text())["data"]["batch_in_epoch"]
        == 1
    )
    resumed = train(build_config(_raw(demo_folder, run_dir, 10)))
    a, b = load_checkpoint(straight.last_checkpoint), load_checkpoint(resumed.last_checkpoint)
    assert set(a.tensors) == {"unet", "text_encoder", "ema"}
    assert set(a.objects) == {"optimizer", "rng"}
    assert_same(a.tensors, b.tensors, "weights")
    assert_same(a.objects, b.objects, "optimizer and rng")
    run_a, run_b = a.state.pop("run"), b.state.pop("run")  # the config hashes name two folders
    assert run_a["lr"] == run_b["lr"]
    assert_same(a.state, b.state, "state.json")
    # The same loss at every logged step (the short run also logged its last step, 5).
    losses = _losses(straight.run_dir)
    assert losses == {step: loss for step, loss in _losses(run_dir).items() if step != 5}


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def test_checkpoint_from_before_the_stateful_format_resumes(tmp_path, demo_folder):
    """Format 1 kept the data position in the train counters and the EMA's update count in
    ema.pt: such a checkpoint loads (migrated) and continues exactly."""
    straight = train(build_config(_raw(demo_folder, tmp_path / "straight", 10)))
    run_dir = tmp_path / "old"
    first = train(build_config(_raw(demo_folder, run_dir, 5)))
    checkpoint = first.last_checkpoint
    state = json.loads((checkpoint / "state.json").read_text())
    data, ema_state, run = state.pop("data"), state.pop("ema_state"), state.pop("run")
    state.pop("format"), state.pop("lr_schedule")
    state["train"] |= {"epoch": data["epoch"], "batch_in_epoch": data["batch_in_epoch"]}
    state |= {"config_hash": run["config_hash"], "impasto_version": "0.1.0", "lr": run["lr"]}
    (checkpoint / "state.json").write_text(json.dumps(state))
    torch.save(ema_state, checkpoint / "ema.pt")
    resumed = train(build_config(_raw(demo_folder, run_dir, 10)))
    a, b = load_checkpoint(straight.last_checkpoint), load_checkpoint(resumed.last_checkpoint)
    assert_same(a.tensors, b.tensors, "weights")
    assert_same(a.objects, b.objects, "optimizer and rng")


def test_a_checkpoint_missing_run_state_is_one_line_error(tmp_path, demo_folder):
    run_dir = tmp_path / "run"
    first = train(build_config(_raw(demo_folder, run_dir, 5)))
    (first.last_checkpoint / "optimizer.pt").unlink()
    # A checkpoint's state.json lists its files: a missing one makes it damaged, and with no
    # earlier checkpoint to fall back to, resuming stops rather than silently starting over.
    with pytest.raises(ValueError, match="no complete checkpoint left .* --no-resume"):
        train(build_config(_raw(demo_folder, run_dir, 10)))
    aside = run_dir / "checkpoints" / "damaged-step-00000005"
    state_file = aside / "state.json"
    state = json.loads(state_file.read_text())
    del state["files"]  # as written before checkpoints listed their files
    state_file.write_text(json.dumps(state))
    aside.rename(first.last_checkpoint)
    with pytest.raises(ValueError, match="no 'optimizer' state .* use --no-resume"):
        train(build_config(_raw(demo_folder, run_dir, 10)))


def test_resuming_with_other_adapters_is_a_one_line_error(tmp_path, demo_folder):
    run_dir = tmp_path / "run"
    train(build_config(_raw(demo_folder, run_dir, 5)))
    raw = _raw(demo_folder, run_dir, 10)
    raw["lora"]["targets"] = "attention_ff"  # more adapted layers than the checkpoint holds
    with pytest.raises(ValueError, match=r"step-00000005: unet weights do not match the model"):
        train(build_config(raw))
