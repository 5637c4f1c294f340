"""Shared fixtures: a small generated image folder, a tiny-run config and the trained demo; how
the suite shares this machine's cores between its workers (pyproject.toml: ``-n auto``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

# torch's own choice for this machine (one thread per core), taken before a worker lowers it.
MACHINE_THREADS = torch.get_num_threads()
MAX_WORKERS = 4  # each worker holds torch and the tiny models (~1 GiB)
# The demo's tests train and judge with one thread on any machine, so the numbers in their
# comments hold whatever the core count (the order of floating-point sums depends on it).
DEMO_THREADS = 1

# The areas of `-m AREA` (pyproject.toml registers them), by test file.
AREAS = {
    "demo": ("test_demo.py", "test_draftp_demo.py"),
    "distributed": ("test_parallel.py", "test_distributed_order.py", "test_rank_split.py"),
}
# Files whose module fixtures train runs (6 to 45 s): their tests share one worker, which sets
# the fixture up once. Every other test goes to whichever worker is free.
ONE_WORKER = ("test_parallel.py", "test_vae.py", "test_docs_commands.py", "test_evaluation.py")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core, at most MAX_WORKERS."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def worker_threads() -> int:
    """A worker's share of the cores: each of 2 workers on 2 cores runs one thread, as each
    torch process does that a test launches (OMP_NUM_THREADS=1). Without workers (``-n 0``),
    the machine's count. Never more: torch's OpenMP threads wait for each other at every
    operation, and one that shares its core with another busy process stalls them all (the
    demo's step took 16 times as long beside one busy thread; benchmarks/RESULTS.md)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, MACHINE_THREADS // workers)


def pytest_configure(config: pytest.Config) -> None:
    """A worker's processes (the tests' own and those they launch) use its share of the cores:
    two workers with torch's default thread count each would run 4 threads on 2 cores."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(worker_threads())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test starts with its worker's thread count, so a test that changed it leaves no
    trace; the demo's tests (and the demo's training, a fixture of their first) with
    DEMO_THREADS."""
    torch.set_num_threads(DEMO_THREADS if item.get_closest_marker("demo") else worker_threads())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its area (``python -m pytest -m reliability`` runs one). With workers
    (``--dist loadgroup``), the demo's tests share one worker, which trains the demo once, as do
    the tests of each ONE_WORKER file; the demo starts first, then the other slow tests: the
    longest jobs first leave no long tail."""
    for item in items:
        path = Path(str(item.path))
        if "reliability" in path.parts:
            item.add_marker(pytest.mark.reliability)
        for area, files in AREAS.items():
            if path.name in files:
                item.add_marker(getattr(pytest.mark, area))
        if item.get_closest_marker("demo"):
            item.add_marker(pytest.mark.xdist_group("demo"))
        elif path.name in ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(path.stem))
    items.sort(
        key=lambda item: (not item.get_closest_marker("demo"), not item.get_closest_marker("slow"))
    )


@pytest.fixture(scope="module")
def tiny():
    """The tiny SDXL components (seed 0), shared by a module's tests; do not train them."""
    from impasto.models.presets import build_tiny

    return build_tiny(0)


@pytest.fixture(scope="session")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 generated demo images (64×64) with captions, shared by the whole session."""
    from impasto.data.demo import write_demo_dataset

    folder = tmp_path_factory.mktemp("data") / "demo"
    write_demo_dataset(folder, num_images=16, size=64, seed=0)
    return folder


@pytest.fixture
def tiny_raw(demo_folder: Path, tmp_path: Path) -> dict[str, Any]:
    """The raw mapping of a tiny CPU run; tests edit it, then call build_config."""
    return {
        "config_version": 1,
        "model": {"preset": "tiny"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 4},
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "train": {"output_dir": str(tmp_path / "run"), "seed": 0, "max_steps": 10},
        "checkpoint": {"every_steps": 5, "keep_last": 3},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``configs/demo.yaml`` trained as ``impasto train configs/demo.yaml`` does (~8 minutes
    with one thread), once per session: tests/test_demo.py judges it and tests/test_draftp_demo.py
    reward-tunes its step-500 checkpoint. Only the output and data folders move to a temporary
    directory."""
    import time

    from impasto.config import load_config
    from impasto.train.trainer import train

    out = tmp_path_factory.mktemp("demo")
    config = load_config(
        Path(__file__).parents[1] / "configs" / "demo.yaml",
        [
            f"train.output_dir={out / 'run'}",
            f"data.path={out / 'data'}",
            f"eval.sets=[{{name: demo-held-out, path: '{out / 'held-out'}'}}]",
            "log.progress_bar=false",
        ],
    )
    # every checkpoint is kept: configs/demo-draftp.yaml starts from the one at step 500
    assert config.checkpoint.keep_last * config.checkpoint.every_steps >= config.train.max_steps
    start = time.perf_counter()
    result = train(config)
    print(f"demo: trained {result.state.step} steps in {time.perf_counter() - start:.0f} s")
    assert result.state.step == config.train.max_steps
    return result.run_dir
