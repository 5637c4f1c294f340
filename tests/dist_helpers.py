"""Helpers of the tests that train on several processes (tests/test_parallel.py,
tests/test_tensor_parallel.py): torchrun launches of tests/dist_train.py, and comparisons of
runs read the way ``impasto export`` reads them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from impasto.checkpoint.trained import load_trained
from impasto.config import build_config
from impasto.train import train

HERE = Path(__file__).parent
WORKER = HERE / "dist_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(*args: str, timeout: int = 240, **popen: Any) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.run(
        command, env=popen.pop("env", ENV), capture_output=True, text=True, timeout=timeout
    )


def losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def trained_weights(run: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """Every trained part's weights as one flat dict, read the way ``impasto export`` reads
    them (whole tensors in this one process, from shards of any number of ranks)."""
    config, backbone = load_trained(run, ema=ema)
    parts = backbone.parts()
    names = [name for name in parts if config.parts.mode(name) != "frozen"]
    return {
        f"{name}.{key}": value for name in names for key, value in parts[name].state_dict().items()
    }


def assert_same_training(run: Path, reference: Path, ema: bool = False) -> None:
    torch.testing.assert_close(losses(run), losses(reference), rtol=1e-5, atol=1e-6)
    got, want = trained_weights(run, ema), trained_weights(reference, ema)
    assert got.keys() == want.keys()
    # Adam divides by √v: a weight whose gradients are ~0 moves by O(lr) on float-order noise,
    # so a few of 10^5 elements differ by ~2e-5 (lr 1e-3 × 5 steps moves them up to 5e-3).
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def in_process(*configs: tuple[dict[str, Any], bool]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for raw, resume in configs:
            train(build_config(raw), resume=resume)
    finally:
        torch.set_num_threads(threads)


def launch_plan(tmp: Path, plan: list[tuple[dict[str, Any], bool]], *args: str,
                nproc: int = 2) -> None:  # fmt: skip
    plan_file = tmp / f"plan-{len(list(tmp.glob('plan-*')))}.json"
    plan_file.write_text(json.dumps([{"config": c, "resume": r} for c, r in plan]))
    done = torchrun(
        "--standalone", "--nproc-per-node", str(nproc), *args, str(WORKER), str(plan_file)
    )
    output = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode == 0, first_failure(done.stderr) + output


def first_failure(stderr: str) -> str:
    """impasto's own error lines and the traceback of the first rank that printed one: when one
    rank fails, the others' tracebacks (a closed connection) follow and fill the output's tail."""
    lines = [line for line in stderr.splitlines() if "impasto:" in line]
    match = re.search(r"\[rank(\d+)\]: Traceback", stderr)
    if match is not None:
        prefix = f"[rank{match.group(1)}]:"
        lines += [line for line in stderr.splitlines() if line.startswith(prefix)][-40:]
    return "\n".join(lines) + "\n...\n" if lines else ""
