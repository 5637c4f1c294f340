"""The demo: ``configs/demo.yaml`` trains on this CPU and its samples draw what the prompt asks.

Trains the demo config as ``impasto train configs/demo.yaml`` does (the ``demo_run`` fixture of
conftest.py, shared with the DRaFT+ demo test), then judges samples of every (colour, shape)
prompt with :mod:`impasto.demo_score`: a model-free measurement (foreground hue for the colour,
fill ratio of the bounding box for the shape). Takes most of the suite's time (~8 minutes).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from PIL import Image

from impasto.cli import main
from impasto.config import load_config
from impasto.data.demo import DEMO_COLORS, DEMO_SHAPES
from impasto.demo_score import score_demo_checkpoint
from impasto.sampling.grid import CellLabel, labelled_grid

DIGEST = hashlib.sha256(b"a purple triangle on a gray background").hexdigest()[:8]


pytestmark = pytest.mark.slow  # trains the demo config (~8 min): `-m "not slow"` skips it


def test_demo_samples_follow_the_prompt(demo_run):
    score = score_demo_checkpoint(demo_run, images_per_prompt=4)
    assert score.num_images == 4 * len(DEMO_COLORS) * len(DEMO_SHAPES) >= 2 * 12
    print(f"demo: {score.as_dict()}")
    # Measured: here (one thread) 1.000 / 1.000; `impasto train` with 2 threads on seeds 0, 1, 2
    # (docs/demo.md) colour 1.000 / 1.000 / 0.972, shape 1.000 each (72 images). The bars sit
    # at least two images below the worst of them.
    assert score.color_accuracy >= 0.94
    assert score.shape_accuracy >= 0.94


def test_demo_logs_a_falling_validation_loss(demo_run):
    """The demo measures the validation loss on held-out demo images (another seed) at step 0
    and every 250 steps; it falls far from the random start and ends near its lowest."""
    records = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    key = "val/demo-held-out/loss"
    losses = {r["step"]: r[key] for r in records if key in r}
    config = load_config(demo_run / "config.yaml")
    every, last = config.eval.every_steps, config.train.max_steps
    assert sorted(losses) == list(range(0, last + 1, every))
    print(f"demo: validation loss {losses[0]:.4g} -> {losses[last]:.4g}")
    assert losses[last] < 0.3 * losses[0]
    assert losses[last] <= 1.05 * min(losses.values())


def test_impasto_sample_reproduces_the_demo_image(demo_run, tmp_path):
    args = ["sample", str(demo_run), "--prompt", "a purple triangle on a gray background"]
    args += ["--seed", "7", "--num", "2"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    first = sorted((tmp_path / "a").glob("*.png"))
    second = sorted((tmp_path / "b").glob("*.png"))
    assert [p.name for p in first] == [
        f"00000-a-purple-triangle-on-a-gray-background-{DIGEST}-seed7.png",
        f"00001-a-purple-triangle-on-a-gray-background-{DIGEST}-seed8.png",
    ]
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    assert first[0].read_bytes() != first[1].read_bytes()  # seeds 7 and 8 differ


def test_demo_wrote_validation_grids(demo_run):
    config = load_config(demo_run / "config.yaml")
    every, last = config.sample.every_steps, config.train.max_steps
    grids = sorted((demo_run / "samples").glob("step-*.png"))
    assert [p.name for p in grids] == [
        f"step-{step:08d}.png" for step in range(every, last + 1, every)
    ]
    with Image.open(grids[-1]) as grid:
        size = grid.size
    # 9 prompts in a labelled 3x3 grid of 64 px samples, each enlarged to a 256 px cell
    labels = [
        CellLabel(prompt, config.sample.seed + i) for i, prompt in enumerate(config.sample.prompts)
    ]
    expected = labelled_grid([torch.zeros(3, 64, 64)] * 9, labels, f"demo  step {last}", 3)
    assert size == expected.image.size and size[0] == 4 + 3 * (256 + 4)
