"""Runs of ``impasto train`` in child processes, as a scheduler and a user see them: started,
killed (``kill -9``, SIGTERM to the process group), resumed, and compared bit for bit.

Every child runs with one thread per library (``OMP_NUM_THREADS=1``): several torch processes
on two cores thrash, and bitwise equality between an interrupted run and the uninterrupted one
needs the same thread count in both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from impasto.checkpoint import latest_checkpoint, load_checkpoint

CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


def child_env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("IMPASTO_FAULT", "IMPASTO_DEBUG")}
    env |= CHILD_ENV
    if fault is not None:
        env["IMPASTO_FAULT"] = fault
    return env


def write_config(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def start(config: Path, *args: str, fault: str | None = None) -> subprocess.Popen:
    """``impasto train CONFIG ARGS`` in a new session (its own process group, as a Slurm job
    step is), with text pipes."""
    return subprocess.Popen(
        [sys.executable, "-m", "impasto", "train", str(config), *args],
        env=child_env(fault),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, timeout: float = 240) -> Finished:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"the run hung; stdout:\n{stdout}\nstderr:\n{stderr}") from None
    return Finished(process.returncode, stdout, stderr)


def run(config: Path, *args: str, fault: str | None = None, timeout: float = 240) -> Finished:
    return finish(start(config, *args, fault=fault), timeout)


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, timeout: float = 120):
    """Poll ``condition`` until it holds; fails if the process ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"the run ended first ({process.returncode}):\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.05)


def logged_steps(run_dir: Path) -> list[int]:
    """The steps ``metrics.jsonl`` holds (complete lines only)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return steps


def final_state(run_dir: Path) -> dict[str, Any]:
    """The newest checkpoint's whole content, the run-identity record left out."""
    data = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    state = dict(data.state)
    state.pop("run", None)  # the config hash covers output_dir, which differs between runs
    return {"tensors": data.tensors, "objects": data.objects, "state": state}


def assert_one_line_error(result: Finished, *needles: str) -> str:
    """Exit 2, exactly one ``impasto: error:`` line naming each needle, and no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("impasto: error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]
