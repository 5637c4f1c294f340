"""A run that explains itself (issue #17): the start-up summary, the smoothed loss and the ETA
of the progress bar, and ``dataset.json`` (tag frequency) in every checkpoint."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from impasto.config import build_config
from impasto.data.census import tag_frequency
from impasto.data.folder import ImageRecord
from impasto.logging import progress as progress_module
from impasto.logging.progress import (
    RunClock,
    Schedule,
    Smoother,
    count_due,
    format_duration,
    remaining_seconds,
)
from impasto.train import train
from impasto.train.summary import summary_lines, validation_cost
from impasto.train.trainer import Trainer

# Two kohya folders: 3_cat (each image 3 times per epoch) and 1_dog; the captions are tags.
CAPTIONS = {
    "3_cat": ["cat, red, circle", "cat, Blue ,circle", "cat, red, square, red", "cat"],
    "1_dog": ["dog, red", "dog,, green", "dog", "dog, red"],
}
# kohya's ss_tag_frequency of these: each image once, parts stripped and lower-cased.
TAG_FREQUENCY = {
    "1_dog": {"dog": 4, "red": 2, "green": 1},
    "3_cat": {"cat": 4, "red": 3, "circle": 2, "blue": 1, "square": 1},
}


@pytest.fixture(scope="module")
def pets(demo_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``3_cat`` and ``1_dog``, four demo images each, with tag captions."""
    root = tmp_path_factory.mktemp("pets")
    images = sorted(demo_folder.glob("*.png"))
    for offset, (folder, captions) in enumerate(CAPTIONS.items()):
        (root / folder).mkdir()
        for number, caption in enumerate(captions):
            image = images[4 * offset + number]
            shutil.copyfile(image, root / folder / image.name)
            (root / folder / f"{image.stem}.txt").write_text(caption, encoding="utf-8")
    return root


def pets_raw(pets: Path, run_dir: Path, **sections: dict) -> dict:
    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": str(pets), "resolution": 64, "batch_size": 4},
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "train": {"output_dir": str(run_dir), "seed": 0, "max_steps": 6},
        "checkpoint": {"every_steps": 3, "keep_last": 3},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def test_smoother_is_tensorboards_debiased_average() -> None:
    smoother = Smoother(0.5)
    assert smoother.value is None
    # (1 - w) sum w^(n-i) v_i / (1 - w^n): 2; (0.5·2 + 4)/1.5; a NaN left out; (0.5 + 2 + 1)/1.75
    assert smoother.update(2.0) == 2.0
    assert smoother.update(4.0) == pytest.approx(10 / 3)
    assert smoother.update(math.nan) == pytest.approx(10 / 3)
    assert smoother.update(1.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Smoother(1.0)


def test_format_duration() -> None:
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(90061) == "25:01:01"


def trainer_schedule(every_sample: int, every_save: int, save_final: bool, total: int):
    """The trainer's own should_sample / should_save at each step of a run of ``total``."""
    fake = SimpleNamespace(
        config=SimpleNamespace(
            sample=SimpleNamespace(every_steps=every_sample),
            checkpoint=SimpleNamespace(every_steps=every_save, save_final=save_final),
        ),
        state=SimpleNamespace(step=0),
        data=SimpleNamespace(total_steps=total),
    )

    def due(step: int) -> tuple[bool, bool]:
        fake.state.step = step
        return Trainer.should_sample(fake), Trainer.should_save(fake)

    return due


@pytest.mark.parametrize("total", [1, 7, 30, 95, 100])
@pytest.mark.parametrize(
    ("every_sample", "every_save", "save_final"),
    [(10, 25, True), (0, 7, False), (3, 1, True), (40, 500, True), (10, 25, False)],
)
def test_counted_validations_and_saves_follow_the_trainers_schedule(
    total, every_sample, every_save, save_final
) -> None:
    due = trainer_schedule(every_sample, every_save, save_final, total)
    schedule = Schedule(total, every_sample, every_save, save_final)
    for step in range(total + 1):
        later = [due(s) for s in range(step + 1, total + 1)]
        assert schedule.validations_after(step) == sum(sample for sample, _ in later)
        assert schedule.saves_after(step) == sum(save for _, save in later)
    assert count_due(5, 5, 1, True) == 0


def test_eta_counts_steps_validations_and_saves() -> None:
    schedule = Schedule(total_steps=100, sample_every=10, save_every=25, save_final=True)
    # After step 37: 63 steps at 0.5 s, validations at 40..100 (7) at 4 s, saves at 50, 75, 100.
    assert remaining_seconds(37, schedule, 0.5, 4.0, 2.0) == 63 * 0.5 + 7 * 4.0 + 3 * 2.0
    odd = Schedule(total_steps=95, sample_every=10, save_every=25, save_final=False)
    # 40..90 and the last step (95): 7 validations; saves at 50 and 75 only (no final save).
    assert remaining_seconds(37, odd, 1.0, 1.0, 10.0) == 58 + 7 + 20
    assert remaining_seconds(95, odd, 1.0, 1.0, 10.0) == 0


def test_run_clock_keeps_validations_and_saves_out_of_the_step_time(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    schedule = Schedule(total_steps=20, sample_every=10, save_every=5, save_final=True)
    clock = RunClock(schedule, validation_steps=3.0, smoothing=0.5)
    assert clock.remaining(0) is None  # nothing timed yet
    clock.start_step()  # step 1: warm-up, 10 s
    now[0] = 10.0
    clock.start_step()  # step 2: 2 s of work, then a 3 s validation and a 1 s save
    now[0] = 12.0
    with clock.timing("validation"):
        now[0] = 15.0
    with clock.timing("save"):
        now[0] = 16.0
    assert clock.seconds_per_step() == 10.0  # only the warm-up step so far
    now[0] = 17.0  # and 1 s more of step 2 (logging, say): 3 s in all
    clock.start_step()
    now[0] = 21.0
    clock.start_step()  # step 3: 4 s
    assert clock.num_timed == 3
    step_s = (0.5 * 0.5 * 3 + 0.5 * 4) / (1 - 0.5**2)  # the warm-up left out
    assert clock.seconds_per_step() == pytest.approx(step_s)
    # 17 steps; validations at 10 and 20 (3 s each); saves at 5, 10, 15, 20 (1 s each).
    assert clock.remaining(3) == pytest.approx(17 * step_s + 2 * 3.0 + 4 * 1.0)
    before_measured = RunClock(schedule, validation_steps=3.0, smoothing=0.5)
    before_measured.add_step(2.0)
    # No validation timed: 3 training steps each; no save timed: 0.
    assert before_measured.remaining(3) == pytest.approx(17 * 2.0 + 2 * 3 * 2.0)


def test_validation_cost_counts_sampler_forwards(pets, tmp_path) -> None:
    raw = pets_raw(pets, tmp_path / "run", sample={"every_steps": 5, "prompts": ["a", "b"]})
    raw["sample"] |= {"num_steps": 6, "images_per_prompt": 2, "guidance_scale": 5.0}
    # 4 images x 6 steps x 2 branches (CFG) forwards; a step: 3 x 4 images.
    assert validation_cost(build_config(raw)) == 4 * 6 * 2 / (3 * 4)
    assert validation_cost(build_config(pets_raw(pets, tmp_path / "run"))) == 0


def test_tag_frequency_counts_each_image_once_per_group() -> None:
    records = [
        ImageRecord("a.png", "X, y"),
        ImageRecord("a.png", "X, y"),
        ImageRecord("b.png", "y"),
    ]
    groups = {"a.png": "one", "b.png": "two"}
    assert tag_frequency(records, groups) == {"one": {"x": 1, "y": 1}, "two": {"y": 1}}


def test_summary_counts_groups_repeats_buckets_and_trained_parameters(pets, tmp_path) -> None:
    raw = pets_raw(pets, tmp_path / "run", parts={"unet": "lora", "text_encoder": "full"})
    raw["data"] |= {"buckets": "generated", "bucket_step": 16}
    raw["train"] |= {"grad_accum_steps": 2, "max_steps": 3}
    trainer = Trainer(build_config(raw), resume=False)
    try:
        setup, group = trainer.setup, trainer.group
        lines = summary_lines(trainer.config, trainer.data, setup.trainable, group.device,
                              trainer.precision, group.world)  # fmt: skip
        unet, encoder = setup.trainable["unet"], setup.trainable["text_encoder"]
        adapter = sum(tensor.numel() for tensor in unet.state_dict().values())
        full = sum(p.numel() for p in encoder.module.parameters() if p.requires_grad)
    finally:
        trainer.close()
    text = "\n".join(lines)
    assert lines[0] == "impasto: the run"
    assert "  data        8 images, 16 examples per epoch (repeats counted)" in lines
    assert "    1_dog  4 images x 1 repeat = 4" in lines
    assert "    3_cat  4 images x 3 repeats = 12" in lines
    assert "  buckets     64x64: 16 (examples per epoch; buckets.txt)" in lines
    assert "  unusable    0 left out" in lines
    assert "  batch       4 x 2 accumulation x 1 rank = 8 images per step" in lines
    # 16 examples in 4 batches a epoch; 3 steps of 2 batches: 1.5 epochs of 2 steps.
    assert "  length      3 steps = 1.5 epochs of 2 steps" in lines
    assert adapter > 0 and full > 0
    trainable = f"unet (lora) {adapter:,}; text_encoder (full) {full:,}; total {adapter + full:,}"
    assert f"  trainable   {trainable}" in lines
    assert "cpu, fp32 (train.mixed_precision auto)" in text
    assert "objective   denoise: epsilon prediction, uniform timesteps" in text


def test_a_run_prints_its_summary_and_estimate_and_checkpoints_dataset_json(
    pets, tmp_path, capsys
) -> None:
    result = train(build_config(pets_raw(pets, tmp_path / "run")), resume=False)
    out = capsys.readouterr().out
    assert out.count("impasto: the run\n") == 1
    assert out.count(" s/step; estimated total ") == 1  # after the first timed steps
    assert "(incl. validation and checkpoints)" in out
    checkpoints = sorted((result.run_dir / "checkpoints").iterdir())
    assert [path.name for path in checkpoints] == ["step-00000003", "step-00000006"]
    # 16 examples a epoch in 4 steps: step 3 is inside epoch 0, step 6 inside epoch 1.
    for path, epoch in zip(checkpoints, (0, 1), strict=True):
        dataset = json.loads((path / "dataset.json").read_text(encoding="utf-8"))
        assert dataset == {
            "images": 16,
            "steps_per_epoch": 4,
            "epoch": epoch,
            "tag_frequency": TAG_FREQUENCY,
        }


@pytest.mark.slow
def test_a_sharded_checkpoint_holds_dataset_json_and_rank_0_alone_explains(pets, tmp_path):
    """Two ranks (ddp, gloo): the sharded checkpoint has ``dataset.json``; one summary."""
    raw = pets_raw(pets, tmp_path / "run", parallel={"strategy": "ddp"})
    raw["train"] |= {"max_steps": 2, "mixed_precision": "fp32"}
    raw["checkpoint"] |= {"every_steps": 2}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "impasto", "train", str(config)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("impasto: the run\n") == 1
    assert "  batch       4 x 1 accumulation x 2 ranks = 8 images per step" in done.stdout
    dataset = json.loads((tmp_path / "run/checkpoints/step-00000002/dataset.json").read_text())
    # 4 batches a epoch, 2 a step (one per rank): 2 steps per epoch; step 2 ends epoch 0.
    assert dataset == {
        "images": 16,
        "steps_per_epoch": 2,
        "epoch": 1,
        "tag_frequency": TAG_FREQUENCY,
    }
