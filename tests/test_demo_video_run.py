"""The video demo's acceptance (issue #32): ``configs/demo-video.yaml`` trains a tiny DiT from
scratch on this CPU, on demo clips and stills packed together, through the shipped tiny video
VAE, for two seeds, and the clips of each show the colour, the shape and the direction of
motion their prompts ask for (judged by :mod:`impasto.demo_score_video`, 72 clips each).

The two runs take about 18 minutes at once (one thread each, as ``impasto train`` runs them,
each in its own process), longer than the whole suite may: the README's test command leaves
them out (``-m "not demo_video"`` in pyproject.toml's ``addopts``) and CI runs them as a second
command (``.ci/run``): ``python -m pytest -m demo_video``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from impasto.config import load_config
from impasto.demo_score_video import VideoDemoScore, score_demo_video_checkpoint

# one worker trains both seeds (their two processes fill the machine's two cores)
pytestmark = [pytest.mark.slow, pytest.mark.demo_video, pytest.mark.xdist_group("demo_video")]

CONFIG = Path(__file__).parents[1] / "configs" / "demo-video.yaml"
SEEDS = (0, 1)
LIMIT_S = 3600  # a run that hangs fails the test instead of the CI job


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """``impasto train configs/demo-video.yaml --set train.seed=S`` for both seeds at once, one
    thread each; only the output and data folders move."""
    out = tmp_path_factory.mktemp("demo-video")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    started, processes = time.perf_counter(), {}
    for seed in SEEDS:
        command = [
            sys.executable, "-m", "impasto", "train", str(CONFIG),
            "--set", f"train.seed={seed}", "--set", f"train.output_dir={out / f'run-{seed}'}",
            "--set", f"data.path={out / f'data-{seed}'}", "--set", "log.progress_bar=false",
        ]  # fmt: skip
        log = (out / f"train-{seed}.log").open("w")
        processes[seed] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        codes = {seed: process.wait(timeout=LIMIT_S) for seed, process in processes.items()}
    finally:
        for process in processes.values():
            process.kill()  # a no-op for a finished one
    for seed, code in codes.items():
        assert code == 0, (out / f"train-{seed}.log").read_text()[-3000:]
    print(f"demo-video: seeds {SEEDS} trained at once in {time.perf_counter() - started:.0f} s")
    return {seed: out / f"run-{seed}" for seed in SEEDS}


@pytest.fixture(scope="module")
def scores(runs: dict[int, Path]) -> dict[int, VideoDemoScore]:
    return {
        seed: score_demo_video_checkpoint(run, clips_per_prompt=1) for seed, run in runs.items()
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_the_video_demo_draws_the_colour_shape_and_motion_it_is_told(scores, seed):
    score = scores[seed]
    print(f"demo-video seed {seed}: {score.as_dict()}")
    assert score.num_clips == 72
    # Measured (one thread each, beside another run on a 2-core CPU, 72 clips each): seed 0
    # colour 1.00, shape 0.90, direction 0.94; seed 1 colour 1.00, shape 0.96, direction 0.96
    # (docs/video.md). The bars:
    assert score.color_accuracy >= 0.90, score.color_confusions
    assert score.shape_accuracy >= 0.80, score.shape_confusions
    assert score.direction_accuracy >= 0.80, score.direction_confusions


def test_the_video_demo_wrote_clip_validation_grids(runs):
    run = runs[SEEDS[0]]
    config = load_config(run / "config.yaml")
    every, last = config.sample.every_steps, config.train.max_steps
    grids = sorted((run / "samples").glob("step-*.png"))
    assert [p.name for p in grids] == [f"step-{s:08d}.png" for s in range(every, last + 1, every)]
    previews = sorted((run / "samples" / f"step-{last:08d}").glob("*.webp"))
    assert len(previews) == len(config.sample.prompts)
