"""DRaFT+ on the CPU demo, end to end (issue #15): ``configs/demo-draftp.yaml``, started from the
demo run's checkpoint at step 500 (of 3,000), raises the demo judge's reward on the 9
held-out validation prompts (8 images each) and the model-free demo accuracy of its samples;
the KL term stays bounded; a larger ``kl_coeff`` gains less and strays less.

The demo run is conftest.py's ``demo_run`` (trained once per session, shared with
tests/test_demo.py); the two 60-step DRaFT+ runs take ~2 minutes each: ``-m "not slow"`` skips
it. The numbers depend on the order of floating-point sums, so on the thread count: they were
measured with one thread, which the demo's tests use on any machine (conftest.py's DEMO_THREADS).
The bars hold for every training seed measured: a held-out reward of 72 images, not the 18 of
the config's grid (at 18 images one base rose 0.62 at step 30 and kept 0.12 at step 60).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from impasto.config import load_config
from impasto.demo_score import score_demo_checkpoint
from impasto.train.trainer import TrainResult, train

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).parents[1] / "configs"
QUIET = ["log.progress_bar=false", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def base(demo_run) -> Path:
    """The demo's checkpoint at step 500: room to improve, as from a shorter run (from step
    1,000 the held-out reward rose and fell back: benchmarks/RESULTS.md, 2026-11-27)."""
    return demo_run / "checkpoints" / "step-00000500"


def reward_tune(base: Path, out: Path, kl_coeff: float) -> TrainResult:
    config = load_config(
        CONFIGS / "demo-draftp.yaml",
        [
            f"model.path={base}", f"train.output_dir={out}", f"draftp.kl_coeff={kl_coeff}",
            "train.max_steps=60", "sample.every_steps=60", "sample.images_per_prompt=8",
            *QUIET,
        ],
    )  # fmt: skip
    return train(config)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def held_out_rewards(run: Path) -> list[float]:
    return [row["val/reward"] for row in rows(run) if "val/reward" in row]


@pytest.fixture(scope="module")
def tuned(base, tmp_path_factory) -> dict[float, Path]:
    out = tmp_path_factory.mktemp("draftp-runs")
    return {kl: reward_tune(base, out / f"kl-{kl}", kl).run_dir for kl in (0.2, 5.0)}


def test_draftp_raises_the_held_out_reward_within_a_kl_leash(tuned):
    leashed, tight = held_out_rewards(tuned[0.2]), held_out_rewards(tuned[5.0])
    kls = {kl: [row["kl"] for row in rows(run) if "kl" in row] for kl, run in tuned.items()}
    print(f"draftp demo: held-out reward, kl 0.2: {leashed}; kl 5: {tight}; KL {kls}")
    assert len(leashed) == len(tight) == 2  # before the first step and after the last
    assert leashed[0] == tight[0]  # the same base, the same validation noise
    gain = leashed[-1] - leashed[0]
    # Measured (1 thread, training seeds 0, 1, 2 on one base): kl 0.2 gains 0.68, 0.97, 0.88
    # (-4.01 -> -3.34, -3.04, -3.14); kl 5 (seed 0) 0.13; KL logged every 5 steps at most
    # 0.044-0.052, its mean 0.026 at kl 0.2 and 0.015 at kl 5.
    assert gain >= 0.35
    assert tight[-1] - tight[0] < gain  # a tighter leash gains less
    assert max(kls[0.2]) < 0.1
    assert sum(kls[5.0]) < sum(kls[0.2])  # and strays less
    diversity = [row["val/diversity"] for row in rows(tuned[0.2]) if "val/diversity" in row]
    assert min(diversity) > 0.5 * diversity[0]  # no collapse to one image per prompt


def test_draftp_raises_the_demo_accuracy(base, tuned):
    before = score_demo_checkpoint(base, images_per_prompt=4)
    after = score_demo_checkpoint(tuned[0.2], images_per_prompt=4)
    print(f"draftp demo: accuracy before {before.as_dict()}, after {after.as_dict()}")
    # Measured (1 thread): colour 0.681 -> 0.806, shape 0.514 -> 0.583 (72 images each).
    assert after.color_accuracy > before.color_accuracy
    assert after.color_accuracy + after.shape_accuracy > (
        before.color_accuracy + before.shape_accuracy
    )
    summary = json.loads((tuned[0.2] / "draftp-summary.json").read_text())
    assert summary["validation"][-1]["reward"] > summary["validation"][0]["reward"]
