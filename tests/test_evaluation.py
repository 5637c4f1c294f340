"""The validation loss on held-out data (issue #18): a stable split, fixed times and noise, the
same numbers at every evaluation of the same weights, and a training run that trains exactly
as without it."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_same

from impasto.checkpoint import load_checkpoint
from impasto.config import build_config
from impasto.data.demo import write_demo_dataset
from impasto.data.folder import ImageRecord
from impasto.data.holdout import (
    demo_set_seed,
    eval_batches,
    generate_missing_demo_sets,
    is_held_out,
    split_held_out,
)
from impasto.data.pipeline import held_out_sets, prepare_run_data
from impasto.train.evaluation import EvalJob, metric_prefix, share
from impasto.train.summary import data_lines
from impasto.train.trainer import Trainer, train

STEPS = 4


def raw_config(data: Path, extra: Path, run_dir: Path, every: int) -> dict[str, Any]:
    """A tiny run that draws from every random stream: LoRA dropout (torch's global generator),
    caption dropout and tag shuffle (the data's), EMA; a quarter of the images held out."""
    return {
        "model": {"preset": "tiny"},
        "data": {
            "path": str(data), "resolution": 64, "batch_size": 3, "validation_split": 0.25,
            "caption_dropout": 0.2, "shuffle_tags": True,
        },
        "parts": {"unet": "lora", "text_encoder": "lora"},
        "lora": {"rank": 4, "dropout": 0.1},
        "ema": {"enabled": True, "decay": 0.9},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(run_dir), "seed": 5, "max_steps": STEPS},
        "checkpoint": {"every_steps": STEPS},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
        "eval": {
            "every_steps": every, "timesteps": 4, "batch_size": 2,
            "sets": [{"name": "extra", "path": str(extra)}],
        },
    }  # fmt: skip


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def extra_set(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("extra") / "extra"
    write_demo_dataset(folder, num_images=3, size=64, seed=11)
    return folder


@pytest.fixture(scope="module")
def runs(demo_folder, extra_set, tmp_path_factory) -> tuple[Path, Path]:
    """The same run without (``every`` 0) and with the validation loss every 2 steps."""
    root = tmp_path_factory.mktemp("eval-runs")
    plain = train(build_config(raw_config(demo_folder, extra_set, root / "plain", 0)))
    evaluated = train(build_config(raw_config(demo_folder, extra_set, root / "eval", 2)))
    return plain.run_dir, evaluated.run_dir


def test_a_run_with_evaluation_trains_exactly_as_without(runs):
    plain, evaluated = runs
    a, b = (
        load_checkpoint(plain / "checkpoints/step-00000004"),
        load_checkpoint(evaluated / "checkpoints/step-00000004"),
    )
    assert_same(a.tensors, b.tensors, "weights and EMA")
    assert_same(a.objects, b.objects, "optimizer and rng")
    a.state.pop("run"), b.state.pop("run")  # the config hashes differ (eval.every_steps)
    assert_same(a.state, b.state, "counters and data position")
    trained = [r["loss"] for r in records(plain)]
    assert trained == [r["loss"] for r in records(evaluated) if "loss" in r]
    assert len(trained) == STEPS


def test_the_validation_loss_is_logged_with_the_step_it_measures(runs):
    logged = {r["step"]: r for r in records(runs[1])}
    assert sorted(logged) == [0, 1, 2, 3, 4]  # step 0: the starting weights, before training
    for step in (0, 2, 4):
        assert {"val/loss", "val/extra/loss", "val/ema/loss", "val/ema/extra/loss"} <= set(
            logged[step]
        )
        per_stratum = [logged[step][f"val/loss_t{s}"] for s in range(4)]
        assert logged[step]["val/loss"] == pytest.approx(sum(per_stratum) / 4)
    assert "val/loss" not in logged[1] and "loss" in logged[2]  # one record per step
    assert logged[0]["val/loss"] == logged[0]["val/ema/loss"]  # the EMA starts at the weights
    assert logged[4]["val/loss"] < logged[0]["val/loss"]  # it learns what it never saw
    assert all(r["elapsed_s"] > 0 for r in logged.values())


def test_evaluating_a_checkpoint_twice_gives_the_logged_numbers_and_draws_nothing(
    runs, demo_folder, extra_set
):
    run_dir = runs[1]
    trainer = Trainer(build_config(raw_config(demo_folder, extra_set, run_dir, 2)), resume=True)
    try:
        assert trainer.state.step == STEPS
        streams = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
        position = trainer.data.stream.state_dict()
        first = trainer.evaluator.evaluate(trainer.setup.ema)
        second = trainer.evaluator.evaluate(trainer.setup.ema)
        assert torch.equal(torch.get_rng_state(), streams[0])
        assert random.getstate() == streams[1]
        assert np.array_equal(np.random.get_state()[1], streams[2])
        assert trainer.data.stream.state_dict() == position
    finally:
        trainer.close()
    assert first == second  # bit for bit
    logged = {r["step"]: r for r in records(run_dir)}[STEPS]
    assert first == {key: value for key, value in logged.items() if key.startswith("val/")}


def test_the_split_is_a_stable_hash_of_each_image():
    images = [ImageRecord(f"/data/{i:03d}.png", "a caption") for i in range(400)]
    identities = {str(r.image_path): Path(str(r.image_path)).name for r in images}
    with_repeats = [record for record in images for _ in range(2)]
    training, held_out = split_held_out(with_repeats, identities, 0.25, seed=0)
    names = {str(r.image_path) for r in held_out}
    assert 70 <= len(held_out) <= 130 and len(names) == len(held_out)  # each image once
    assert not names & {str(r.image_path) for r in training}  # never trained on
    assert len(training) == 2 * (400 - len(held_out))  # every repeat goes the same way
    # The same on every call, whatever the records' order; moved folders keep it (identities
    # are names inside the source); another eval.seed holds out other images.
    shuffled = list(reversed(with_repeats))
    assert split_held_out(shuffled, identities, 0.25, seed=0)[1] == held_out
    moved = [ImageRecord(f"/elsewhere/{i:03d}.png", "a caption") for i in range(400)]
    moved_ids = {str(r.image_path): Path(str(r.image_path)).name for r in moved}
    moved_names = [
        Path(str(r.image_path)).name for r in split_held_out(moved, moved_ids, 0.25, 0)[1]
    ]
    assert moved_names == [Path(str(r.image_path)).name for r in held_out]
    assert split_held_out(images, identities, 0.25, seed=1)[1] != held_out
    # A larger split holds out a superset, in the same order (by hash).
    more = split_held_out(images, identities, 0.5, seed=0)[1]
    assert [r for r in more if str(r.image_path) in names] == held_out
    assert is_held_out("x.png", 0, 1.0) and not is_held_out("x.png", 0, 0.0)


def test_a_run_holds_out_images_and_says_so(tiny_raw, extra_set):
    tiny_raw["data"]["validation_split"] = 0.25
    tiny_raw["eval"] = {"every_steps": 5, "sets": [{"name": "extra", "path": str(extra_set)}]}
    config = build_config(tiny_raw)
    data = prepare_run_data(config, None, None, True, None, "float32")
    held = {str(r.image_path) for r in data.held_out}
    assert held and not held & {str(r.image_path) for r in data.records}
    assert len(data.records) + len(held) == 16
    assert f"held out    {len(held)} images for validation (data.validation_split 0.25), " \
        "never trained on" in data_lines(config, data)  # fmt: skip
    assert [s.name for s in data.eval_sets] == [None, "extra"]
    assert [len(s.records) for s in data.eval_sets] == [len(held), 3]
    # The split's set reads its images without randomness: the same batch twice.
    first, second = data.eval_sets[0].batch(0), data.eval_sets[0].batch(0)
    assert torch.equal(first.pixel_values, second.pixel_values)
    assert first.captions == second.captions  # caption dropout / tag shuffle not applied


def test_held_out_sets_refuse_what_cannot_be_measured(tiny_raw, extra_set, tmp_path):
    tiny_raw["eval"] = {"every_steps": 5, "sets": [{"name": "ema", "path": str(extra_set)}]}
    with pytest.raises(ValueError, match="name 'ema' is taken"):
        held_out_sets(build_config(tiny_raw), [])
    tiny_raw["eval"]["sets"] = [{"name": "gone", "path": str(tmp_path / "missing")}]
    with pytest.raises(ValueError, match=r"^eval.sets gone \(.*missing\): image folder"):
        held_out_sets(build_config(tiny_raw), [])
    tiny_raw["eval"]["sets"] = []
    tiny_raw["data"]["validation_split"] = 0.001  # 16 images: none held out
    with pytest.raises(ValueError, match="no held-out image"):
        held_out_sets(build_config(tiny_raw), [])


def test_generate_demo_writes_a_missing_eval_set_from_another_seed(tiny_raw, tmp_path):
    held_out = tmp_path / "held-out"
    tiny_raw["data"] |= {"path": str(tmp_path / "demo"), "generate_demo": True}
    eval_set = {"name": "demo-held-out", "path": str(held_out)}
    tiny_raw["eval"] = {"every_steps": 5, "max_images": 5, "sets": [eval_set]}
    config = build_config(tiny_raw)
    generate_missing_demo_sets(config)
    assert len(list(held_out.glob("*.png"))) == 5
    assert demo_set_seed(0, "demo-held-out") != config.train.seed
    write_demo_dataset(tmp_path / "train", 5, 64, seed=config.train.seed)
    for name in ("img-00000.png", "img-00004.png"):
        assert (held_out / name).read_bytes() != (tmp_path / "train" / name).read_bytes()
    before = {path: path.stat().st_mtime_ns for path in held_out.iterdir()}
    generate_missing_demo_sets(config)  # it exists: left alone
    assert {path: path.stat().st_mtime_ns for path in held_out.iterdir()} == before


def test_eval_times_are_the_midpoints_of_equal_strata():
    from types import SimpleNamespace

    from impasto.config.schema import ObjectiveConfig
    from impasto.objectives.objective import Objective
    from impasto.train.methods.denoise import DenoiseMethod

    method = SimpleNamespace(objective=Objective.from_config(ObjectiveConfig()))
    times = DenoiseMethod.eval_times(method, 4)
    assert times.tolist() == [125, 375, 625, 875] and times.dtype == torch.int64
    flow = SimpleNamespace(objective=Objective.from_config(ObjectiveConfig(prediction_type="flow")))
    times = DenoiseMethod.eval_times(flow, 4)
    assert times.dtype == torch.float32
    torch.testing.assert_close(times, torch.tensor([0.1255, 0.3755, 0.6255, 0.8755]))


def test_every_rank_gets_the_same_number_of_batches():
    jobs = [EvalJob(0, number) for number in range(5)]
    shares = [share(jobs, rank, 2) for rank in range(2)]
    assert [len(s) for s in shares] == [3, 3]
    counted = [job for s in shares for job, counted in s if counted]
    assert sorted(counted, key=lambda job: job.batch) == jobs  # each once
    assert share(jobs[:1], 1, 2) == [(jobs[0], False)]  # a rank with none repeats one
    assert eval_batches([(64, 64), None, (48, 80), (64, 64)], 4, 8) == [[0, 3], [2]]
    assert eval_batches(None, 5, 2) == [[0, 1], [2, 3], [4]]
    assert [metric_prefix(n, e) for n, e in [(None, False), ("a", False), (None, True),
            ("a", True)]] == ["val", "val/a", "val/ema", "val/ema/a"]  # fmt: skip


@pytest.mark.slow  # torchrun with two CPU ranks (~1 min)
def test_two_fsdp_ranks_measure_what_one_process_measures(demo_folder, extra_set, tmp_path):
    """Each rank evaluates a share (7 batches: 4 and 3 plus a repeat, in lockstep for FSDP's
    sharded forwards); the gathered losses equal one process's."""
    import os
    import subprocess
    import sys

    import yaml

    def raw(run_dir: Path, strategy: str, batch_size: int) -> dict[str, Any]:
        config = raw_config(demo_folder, extra_set, run_dir, 2)
        config["parts"] = {"unet": "full"}
        config["train"] |= {"max_steps": 2, "mixed_precision": "fp32"}
        config["data"] |= {"batch_size": batch_size, "caption_dropout": 0.0, "shuffle_tags": False}
        config["eval"]["batch_size"] = 1
        return config | {"parallel": {"strategy": strategy}}

    one = train(build_config(raw(tmp_path / "one", "none", 4)))  # = 2 ranks x batch 2
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(raw(tmp_path / "fsdp", "fsdp", 2)), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "impasto", "train", str(path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("impasto: validation loss at step 2:") == 1  # rank 0 alone
    want = {r["step"]: r for r in records(one.run_dir)}
    got = {r["step"]: r for r in records(tmp_path / "fsdp")}
    for step in (0, 2):
        for key in ("val/loss", "val/loss_t3", "val/extra/loss", "val/ema/loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4), (step, key)
