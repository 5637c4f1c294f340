"""The DiT demo: ``configs/demo-dit.yaml`` trains a tiny DiT from scratch on this CPU, on demo
images of three aspect ratios packed into 512-token sequences, and its samples draw what the
prompt asks (issue #31; judged as tests/test_demo.py judges the UNet demo)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from impasto.config import load_config
from impasto.data.demo import DEMO_COLORS, DEMO_SHAPES
from impasto.demo_score import score_demo_checkpoint
from impasto.train.trainer import train

pytestmark = pytest.mark.slow  # trains the DiT demo (~8 minutes)


@pytest.fixture(scope="module")
def demo_dit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``configs/demo-dit.yaml`` as ``impasto train`` runs it; only its folders move."""
    out = tmp_path_factory.mktemp("demo-dit")
    config = load_config(
        Path(__file__).parents[1] / "configs" / "demo-dit.yaml",
        [f"train.output_dir={out / 'run'}", f"data.path={out / 'data'}"],
    )
    start = time.perf_counter()
    result = train(config)
    print(f"demo-dit: trained {result.state.step} steps in {time.perf_counter() - start:.0f} s")
    return result.run_dir


def test_the_dit_demo_draws_what_it_is_told(demo_dit_run):
    score = score_demo_checkpoint(demo_dit_run, images_per_prompt=4)
    assert score.num_images == 4 * len(DEMO_COLORS) * len(DEMO_SHAPES)
    print(f"demo-dit: {score.as_dict()}")
    # Measured (72 images each, two seeds at once, one thread each): seed 0 colour 0.986, shape
    # 0.917; seed 1 colour 1.000, shape 0.944 (docs/dit.md). The bars: colour >= 0.95,
    # shape >= 0.90.
    assert score.color_accuracy >= 0.95
    assert score.shape_accuracy >= 0.90


def test_the_dit_demo_mixed_three_bucket_shapes(demo_dit_run):
    rows = [row.split() for row in (demo_dit_run / "buckets.txt").read_text().splitlines()]
    counts = {" ".join(row[:3]): row[-1] for row in rows if row[1:2] == ["x"]}
    assert counts == {"48 x 80": "512", "64 x 64": "512", "80 x 48": "512"}
