"""Preemption as a cluster scheduler does it: SIGTERM (or SIGINT) to the whole process group,
data-loader workers included, at any moment. The trainer's main process owns shutdown: while
training it saves after the step and exits 130, and the resumed run equals the uninterrupted
one bit for bit (weights, optimizer, every RNG stream) with LoRA dropout and two workers;
during start-up it stops at once with one line and exit 130.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from harness import (
    final_state,
    finish,
    logged_steps,
    run,
    start,
    wait_for,
    write_config,
)
from helpers import assert_same

from impasto.checkpoint import latest_checkpoint

MAX_STEPS = 12


def raw_config(data: Path, run_dir: Path) -> dict[str, Any]:
    """16 images in batches of 2: 8 steps an epoch, so a stop at steps 1-7 is mid-epoch."""
    return {
        "model": {"preset": "tiny"},
        "data": {
            "path": str(data),
            "resolution": 64,
            "batch_size": 2,
            "num_workers": 2,
            "caption_dropout": 0.2,
        },  # fmt: skip
        "parts": {"unet": "lora", "text_encoder": "lora"},
        "lora": {"rank": 4, "dropout": 0.1},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(run_dir), "seed": 7, "max_steps": MAX_STEPS},
        "checkpoint": {"every_steps": 100, "keep_last": 2},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }


def make_config(tmp_path: Path, demo_folder: Path, name: str) -> tuple[Path, Path]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    return write_config(tmp_path / f"{name}.yaml", raw_config(demo_folder, run_dir)), run_dir


def group_gone(pgid: int, timeout: float = 15.0) -> bool:
    """Whether every process of the group (the workers too) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow  # a child run with loader workers, signalled, then resumed (30 s)
def test_sigterm_to_the_process_group_with_workers_saves_and_resumes_bitwise(tmp_path, demo_folder):
    config, straight_dir = make_config(tmp_path, demo_folder, "straight")
    assert run(config).returncode == 0
    config, run_dir = make_config(tmp_path, demo_folder, "preempted")
    process = start(config)
    wait_for(lambda: max(logged_steps(run_dir), default=0) >= 2, process)
    os.killpg(process.pid, signal.SIGTERM)  # as Slurm: the main process and its workers
    result = finish(process)
    assert result.returncode == 130, result.stderr
    assert "SIGTERM received; saving after this step" in result.stdout
    assert "Traceback" not in result.stderr and "worker" not in result.stderr, result.stderr
    assert group_gone(process.pid), "a data-loader worker outlived the trainer"
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    position = json.loads((checkpoint / "state.json").read_text())["data"]
    stopped_at = int(checkpoint.name.removeprefix("step-"))
    assert 2 <= stopped_at < 8  # mid-epoch
    assert (position["epoch"], position["batch_in_epoch"]) == (0, stopped_at)
    resumed = run(config)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoint}" in resumed.stdout
    assert_same(final_state(straight_dir), final_state(run_dir), "final state")
    losses = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    straight = [
        json.loads(line) for line in (straight_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["loss"] for r in losses] == [r["loss"] for r in straight]


@pytest.mark.slow  # two runs of a child process each
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_stops_with_one_line(tmp_path, demo_folder, signum):
    config, run_dir = make_config(tmp_path, demo_folder, "run")
    process = start(config)
    # The trainer holds the run directory's lock once it has started building the run.
    wait_for(lambda: (run_dir / ".impasto.lock").is_file(), process)
    os.killpg(process.pid, signum)
    result = finish(process)
    assert result.returncode == 130, (result.stdout, result.stderr)
    name = signal.Signals(signum).name
    assert result.stderr.strip().splitlines() == [
        f"impasto: {name} received during start-up; stopped before training (nothing new to "
        "save; run the same command again to continue)"
    ]
    assert logged_steps(run_dir) == []
    assert run(config).returncode == 0  # the next start trains the whole run
    assert logged_steps(run_dir) == list(range(1, MAX_STEPS + 1))
