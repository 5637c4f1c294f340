"""kill -9 at many moments of a run (steps, checkpoint writes, renames, prunes, cache fills, and
random times), each followed by a resume: the finished run equals the uninterrupted one bit for
bit (weights, EMA, optimizer, counters, data position and every RNG stream), and at every
moment in between the newest checkpoint loads.

The named moments come from ``IMPASTO_FAULT`` (:mod:`impasto.faults`): a timer rarely lands
inside a checkpoint write. One test injects one fault of each kind, the other 20; both start
child processes for a minute or more, so both are marked slow.
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from harness import (
    assert_one_line_error,
    final_state,
    finish,
    logged_steps,
    run,
    start,
    wait_for,
    write_config,
)
from helpers import assert_same

from impasto.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

MAX_STEPS = 60


def raw_config(data: Path, run_dir: Path) -> dict[str, Any]:
    """A tiny LoRA run whose randomness also comes from torch's global generator (LoRA
    dropout, caption dropout), with an EMA, a disk cache and frequent checkpoints."""
    return {
        "model": {"preset": "tiny"},
        "data": {
            "path": str(data),
            "resolution": 64,
            "batch_size": 4,
            "caption_dropout": 0.2,
            "max_bad_fraction": 0.2,
        },  # fmt: skip
        "cache": {
            "latents": "disk",
            "text_embeddings": "disk",
            "dir": str(run_dir / "cache"),
            "batch_size": 4,
        },  # fmt: skip
        "parts": {"unet": "lora"},
        "lora": {"rank": 4, "dropout": 0.1},
        "ema": {"enabled": True, "decay": 0.9},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(run_dir), "seed": 5, "max_steps": MAX_STEPS},
        "checkpoint": {"every_steps": 2, "keep_last": 2},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }


@pytest.fixture(scope="module")
def data_with_bad_items(tmp_path_factory, demo_folder) -> Path:
    """The 16 demo images, one truncated image and one image whose caption is not UTF-8: the
    unusable items and their counters must resume exactly too."""
    folder = tmp_path_factory.mktemp("data") / "images"
    shutil.copytree(demo_folder, folder)
    first = sorted(folder.glob("*.png"))[0]
    (folder / "truncated.png").write_bytes(first.read_bytes()[:200])
    (folder / "truncated.txt").write_text("a red square", encoding="utf-8")
    shutil.copyfile(first, folder / "latin1.png")
    (folder / "latin1.txt").write_bytes("une pomme rôtie".encode("latin-1"))
    return folder


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_with_bad_items) -> dict[str, Any]:
    """The uninterrupted run's final state (a child process, like the interrupted ones)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_dir.mkdir()
    config = write_config(run_dir.parent / "config.yaml", raw_config(data_with_bad_items, run_dir))
    result = run(config)
    assert result.returncode == 0, result.stderr
    state = final_state(run_dir)
    assert state["state"]["train"]["images_bad"] == 2, state["state"]["train"]
    return state


def kill_at(config: Path, run_dir: Path, fault: str) -> int:
    """Run until the fault kills the process; returns its exit code (-9 when it did).
    ``during:S``: kill -9 from outside S seconds into the training steps."""
    if fault.startswith("during:"):
        newest = latest_checkpoint(run_dir / "checkpoints")
        resumed_at = int(newest.name.removeprefix("step-")) if newest else 0
        process = start(config)
        wait_for(lambda: max(logged_steps(run_dir), default=0) > resumed_at, process)
        time.sleep(float(fault.removeprefix("during:")))
        process.send_signal(signal.SIGKILL)
        return finish(process).returncode
    result = run(config, fault=fault)
    assert result.returncode in (0, -signal.SIGKILL), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode


def check_loadable(run_dir: Path) -> None:
    """What a kill may leave: the newest complete checkpoint loads; no half-deleted one."""
    root = run_dir / "checkpoints"
    newest = latest_checkpoint(root)
    if newest is not None:
        load_checkpoint(newest)
    for path in list_checkpoints(root):
        assert (path / "state.json").is_file(), path


def interrupt_and_finish(tmp_path: Path, demo_folder: Path, faults: list[str]) -> tuple[int, Path]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = write_config(tmp_path / "config.yaml", raw_config(demo_folder, run_dir))
    killed = 0
    for fault in faults:
        killed += kill_at(config, run_dir, fault) == -signal.SIGKILL
        check_loadable(run_dir)
    result = run(config)
    assert result.returncode == 0, result.stderr
    leftovers = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert all(name.startswith("step-") for name in leftovers), leftovers
    return killed, run_dir


# The cache faults first (a later start finds the cache full), then each kind of moment.
FAST_FAULTS = ["cache.shard:1", "step:3", "checkpoint.file:2", "checkpoint.commit:1",
               "checkpoint.prune:1"]  # fmt: skip


@pytest.mark.slow  # seven runs of a child process (~50 s)
def test_kill_at_each_kind_of_moment_then_resume_is_bitwise(
    tmp_path, data_with_bad_items, straight
):
    killed, run_dir = interrupt_and_finish(tmp_path, data_with_bad_items, FAST_FAULTS)
    assert killed == len(FAST_FAULTS)
    assert_same(straight, final_state(run_dir), "final state")


@pytest.mark.slow
def test_kill_at_20_moments_then_resume_is_bitwise(tmp_path, data_with_bad_items, straight):
    moments = random.Random(16)
    faults = [
        "cache.shard:1", "cache.shard:2", "step:1", "checkpoint.file:1", "checkpoint.commit:1",
        "step:2", "checkpoint.file:3", "checkpoint.prune:1", "step:4", "checkpoint.commit:2",
        "checkpoint.file:4", "checkpoint.prune:2", "step:3", "checkpoint.file:2",
    ]  # fmt: skip
    faults += [f"during:{moments.uniform(0.0, 0.5):.2f}" for _ in range(6)]
    later = faults[2:]
    moments.shuffle(later)
    faults = faults[:2] + later  # the cache faults stay first
    killed, run_dir = interrupt_and_finish(tmp_path, data_with_bad_items, faults)
    assert killed == len(faults) == 20
    assert_same(straight, final_state(run_dir), "final state")


# A full disk at a write between two saves (the bad-data report, the metrics), then inside a
# save (the third checkpoint file of a session): each stops the run with one line.
FULL_DISK_FAULTS = ["enospc@bad_data.write:1", "enospc@metrics.write:7", "enospc@checkpoint.file:9"]


@pytest.mark.slow  # four runs of a child process (~30 s)
def test_a_full_disk_at_each_kind_of_write_is_one_line_then_resume_is_bitwise(
    tmp_path, data_with_bad_items, straight
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = write_config(tmp_path / "config.yaml", raw_config(data_with_bad_items, run_dir))
    for fault in FULL_DISK_FAULTS:
        result = run(config, fault=fault)
        line = assert_one_line_error(result, "not enough disk space", "run the same command again")
        # Last, and nothing after it: no writer thread's or exit-time traceback.
        assert result.stderr.strip().splitlines()[-1] == line, result.stderr
        assert "Exception" not in result.stderr, result.stderr
        newest = latest_checkpoint(run_dir / "checkpoints")
        assert (f"checkpoint {newest.name} is intact" if newest else "no checkpoint yet") in line
        check_loadable(run_dir)
    result = run(config)
    assert result.returncode == 0, result.stderr
    assert_same(straight, final_state(run_dir), "final state")
