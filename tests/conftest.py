"""Shared fixtures: a small generated image folder, a tiny-run config and the trained demo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# The areas of `-m AREA` (pyproject.toml registers them), by test file.
AREAS = {
    "demo": ("test_demo.py", "test_draftp_demo.py"),
    "distributed": ("test_parallel.py", "test_distributed_order.py", "test_rank_split.py"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its area: ``python -m pytest -m reliability`` runs one."""
    for item in items:
        path = Path(str(item.path))
        if "reliability" in path.parts:
            item.add_marker(pytest.mark.reliability)
        for area, files in AREAS.items():
            if path.name in files:
                item.add_marker(getattr(pytest.mark, area))


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
    """``configs/demo.yaml`` trained as ``impasto train configs/demo.yaml`` does (~8 minutes on
    2 cores), once per session: tests/test_demo.py judges it and tests/test_draftp_demo.py
    reward-tunes its checkpoint from half-way. Only the output and data folders move to a
    temporary directory, and every checkpoint is kept (which changes nothing trained)."""
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
            "checkpoint.keep_last=6",
        ],
    )
    assert config.train.max_steps == 6 * config.checkpoint.every_steps  # all six are kept
    start = time.perf_counter()
    result = train(config)
    print(f"demo: trained {result.state.step} steps in {time.perf_counter() - start:.0f} s")
    assert result.state.step == config.train.max_steps
    return result.run_dir
