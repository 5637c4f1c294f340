"""DRaFT+ on the CPU demo, end to end (issue #15): ``configs/demo-draftp.yaml``, started from the
demo run's checkpoint at step 500 (of 3,000), raises the demo judge's reward on the 9
held-out validation prompts and the model-free demo accuracy of its samples; the KL term stays
bounded; a larger ``kl_coeff`` gains less.

The demo run is conftest.py's ``demo_run`` (trained once per session, shared with
tests/test_demo.py); the two 60-step DRaFT+ runs take ~2 minutes each: ``-m "not slow"`` skips
it. The numbers depend on the order of floating-point sums, so on the thread count: they were
measured with one thread, which the demo's tests use on any machine (conftest.py's DEMO_THREADS).
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
            "train.max_steps=60", "sample.every_steps=30", *QUIET,
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
    kls = [row["kl"] for row in rows(tuned[0.2]) if "kl" in row]
    print(f"draftp demo: held-out reward, kl 0.2: {leashed}; kl 5: {tight}; max KL {max(kls)}")
    assert len(leashed) == len(tight) == 3  # before the first step, at 30 and at 60
    assert leashed[0] == tight[0]  # the same base, the same validation noise
    gain = leashed[-1] - leashed[0]
    # Measured (1 thread): kl 0.2: -4.41 -> -3.36 -> -2.94 (gain 1.47); kl 5: -4.41 -> -4.07
    # -> -4.18 (0.23).
    assert gain >= 0.5
    assert tight[-1] - tight[0] < gain  # a tighter leash gains less
    assert max(kls) < 0.05  # measured: 0.025
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
