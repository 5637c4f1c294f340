"""Validation grids during training and ``impasto sample`` from a checkpoint."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import impasto
from impasto.cli import main
from impasto.config import build_config
from impasto.train.trainer import train

PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory, demo_folder):
    run_dir = tmp_path_factory.mktemp("sampled") / "run"
    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": str(demo_folder), "batch_size": 4, "caption_dropout": 0.2},
        "train": {"output_dir": str(run_dir), "max_steps": 4},
        "checkpoint": {"every_steps": 4},
        "sample": {"every_steps": 2, "prompts": PROMPTS, "images_per_prompt": 2, "num_steps": 4},
        "log": {"progress_bar": False},
    }
    train(build_config(raw))
    return run_dir


def test_validation_grids_are_written_to_disk_and_tensorboard(sampled_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grids = sorted(p.name for p in (sampled_run / "samples").iterdir())
    assert grids == ["step-00000002.png", "step-00000004.png"]
    with Image.open(sampled_run / "samples" / grids[-1]) as grid:
        # 2 prompts x 2 images of 64 px enlarged 4x to 256, 4 px apart and around; labels and
        # a header make it taller than wide.
        assert grid.width == 2 * (256 + 4) + 4 and grid.height > grid.width
        size = grid.size
    events = EventAccumulator(str(sampled_run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    logged = events.Images("samples")
    assert [e.step for e in logged] == [2, 4]
    assert (logged[-1].width, logged[-1].height) == size  # TensorBoard gets the labelled grid


def test_sample_command_reproduces_images_for_a_seed(sampled_run, tmp_path, capsys):
    args = [
        "sample",
        str(sampled_run),
        "--prompt",
        PROMPTS[0],
        "--negative",
        "a green triangle",
        "--num",
        "2",
        "--seed",
        "3",
        "--steps",
        "4",
        "--cfg",
        "4",
    ]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b"), "--num", "1"]) == 0
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    digest = hashlib.sha256(PROMPTS[0].encode()).hexdigest()[:8]
    assert names == [
        f"00000-a-red-circle-on-a-white-background-{digest}-seed3.png",
        f"00001-a-red-circle-on-a-white-background-{digest}-seed4.png",
    ]
    first = np.asarray(Image.open(tmp_path / "a" / names[0]))
    again = np.asarray(Image.open(tmp_path / "b" / names[0]))
    other = np.asarray(Image.open(tmp_path / "a" / names[1]))
    assert first.shape == (64, 64, 3)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    parameters = Image.open(tmp_path / "a" / names[0]).text["parameters"]
    assert "Seed: 3" in parameters and "Negative prompt: a green triangle" in parameters


def test_sample_never_overwrites_and_tells_similar_prompts_apart(sampled_run, tmp_path, capsys):
    long = "a red circle on a white background, " * 2  # the slug keeps 60 characters
    prompts = [f"{long}small", f"{long}large", "a red circle!", "A red circle?"]
    args = ["sample", str(sampled_run), "--steps", "2", "--out", str(tmp_path)]
    for prompt in prompts:
        args += ["--prompt", prompt]
    assert main(args) == 0
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(first) == 4  # four prompts, four files, though two pairs share their slugs
    assert main(args) == 0  # the same command again: new files, the first run's kept
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(files) == 8 and all(files[name] == data for name, data in first.items())
    assert sorted(name[:5] for name in files) == [f"{i:05d}" for i in range(8)]
    printed = capsys.readouterr().out.split()
    assert [Path(line).name for line in printed[4:]] == sorted(set(files) - set(first))


def test_sample_command_rejects_a_folder_without_checkpoints(tmp_path, capsys):
    assert main(["sample", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "o")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


def test_sample_config_requires_prompts(tiny_raw):
    tiny_raw["sample"] = {"every_steps": 10}
    with pytest.raises(ValueError, match="sample: every_steps is set but prompts is empty"):
        build_config(tiny_raw)
    tiny_raw["sample"] = {"sampler": "heun"}
    with pytest.raises(ValueError, match="sample.sampler: unknown name 'heun'"):
        impasto.build_config(tiny_raw)


def test_sample_with_no_prompt_draws_the_runs_validation_grid(sampled_run, tmp_path, capsys):
    """`impasto sample RUN` alone draws the grid's prompts with its seeds, sampler, steps and
    guidance: the same images as the grid of the same checkpoint (issue #30)."""
    from impasto.checkpoint.trained import load_trained
    from impasto.sampling.grid import to_pixels
    from impasto.train.validation import render_validation_grid

    assert main(["sample", str(sampled_run), "--out", str(tmp_path)]) == 0
    written = [Path(line) for line in capsys.readouterr().out.split()]
    seeds = [int(path.stem.rsplit("seed", 1)[1]) for path in written]
    assert seeds == [0, 1, 2, 3]  # prompt p's image i: seed + 2p + i, as in the grid
    config, backbone = load_trained(sampled_run)
    grid = render_validation_grid(config, backbone, tmp_path, 4)
    assert grid.prompts == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    for path, image in zip(written, grid.images, strict=True):
        with Image.open(path) as sampled:
            difference = np.abs(np.asarray(sampled, np.int16) - to_pixels(image).astype(np.int16))
        assert difference.max() <= 2, path  # the grid samples 2 prompts per batch, sample 1
    assert main(["sample", str(sampled_run), "--out", str(tmp_path / "one"), "--num", "1"]) == 0
    assert [p.name.rsplit("seed", 1)[1] for p in sorted((tmp_path / "one").iterdir())] == [
        "0.png", "2.png"
    ]  # fmt: skip


def test_sample_with_no_prompt_of_a_run_without_prompts_is_one_line(tiny_raw, tmp_path, capsys):
    run = train(build_config(tiny_raw | {"train": tiny_raw["train"] | {"max_steps": 1}}))
    assert main(["sample", str(run.run_dir), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"impasto: error: no prompt to sample: {run.run_dir} names no validation prompts "
        "(sample.prompts); give --prompt TEXT or --prompts-file FILE"
    ]
