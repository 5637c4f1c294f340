"""``impasto sample`` follows the run: its ``sample`` section gives every default (issue #17),
a flag overrides it, and a prompt file's line overrides both for its prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from impasto.cli import main
from impasto.config import build_config
from impasto.train.trainer import train

PROMPT = "a red circle on a white background"
RUN_SAMPLE = {
    "num_steps": 3,
    "guidance_scale": 2.5,
    "guidance_rescale": 0.5,
    "sampler": "ddim",
    "negative_prompt": "blurry",
    "resolution": 32,
    "seed": 5,
    "spacing": "trailing",
}
# The same values as flags, and the command line's defaults before issue #17.
AS_FLAGS = "--steps 3 --cfg 2.5 --guidance-rescale 0.5 --sampler ddim --negative blurry --size 32 "
AS_FLAGS = (AS_FLAGS + "--seed 5 --spacing trailing").split()
OLD_DEFAULTS = "--steps 30 --cfg 5.0 --guidance-rescale 0 --sampler euler --size 64 --seed 0 "
OLD_DEFAULTS = [*(OLD_DEFAULTS + "--spacing leading").split(), "--negative", ""]


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_folder) -> Path:
    run_dir = tmp_path_factory.mktemp("defaults") / "run"
    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": str(demo_folder), "batch_size": 4},
        "optim": {"lr": 1e-2},
        "train": {"output_dir": str(run_dir), "max_steps": 2},
        "checkpoint": {"every_steps": 2},
        "sample": RUN_SAMPLE,
        "log": {"progress_bar": False, "tensorboard": False},
    }
    train(build_config(raw))
    return run_dir


def _sample(run: Path, out: Path, *flags: str) -> list[tuple[str, np.ndarray, str]]:
    """(file name, pixels, parameters text) of each image written, in order."""
    assert main(["sample", str(run), *flags, "--out", str(out)]) == 0
    images = []
    for path in sorted(out.iterdir()):
        with Image.open(path) as image:
            images.append((path.name, np.asarray(image), image.text["parameters"]))
    return images


def test_sample_defaults_equal_the_runs(run, tmp_path):
    ((name, pixels, parameters),) = _sample(run, tmp_path / "a", "--prompt", PROMPT)
    ((name_b, pixels_b, parameters_b),) = _sample(
        run, tmp_path / "b", "--prompt", PROMPT, *AS_FLAGS
    )
    assert name == name_b and name.endswith("-seed5.png")
    assert pixels.shape == (32, 32, 3) and np.array_equal(pixels, pixels_b)
    assert (
        parameters
        == parameters_b
        == (
            f"{PROMPT}\nNegative prompt: blurry\nSteps: 3, Sampler: ddim, CFG scale: 2.5, "
            "Guidance rescale: 0.5, Seed: 5, Size: 32x32"
        )
    )
    ((_, old, _),) = _sample(run, tmp_path / "old", "--prompt", PROMPT, *OLD_DEFAULTS)
    assert old.shape == (64, 64, 3)
    # One flag overrides its default only; the result differs from the run's.
    ((_, other, text),) = _sample(run, tmp_path / "c", "--prompt", PROMPT, "--cfg", "6")
    assert other.shape == (32, 32, 3) and not np.array_equal(other, pixels)
    assert "Steps: 3, Sampler: ddim, CFG scale: 6.0, Guidance rescale: 0.5, Seed: 5" in text


def test_guidance_rescale_zero_is_plain_cfg_and_changes_the_image_otherwise(run, tmp_path):
    flags = ["--prompt", PROMPT, "--cfg", "7"]
    ((_, half, _),) = _sample(run, tmp_path / "half", *flags)  # the run's 0.5
    ((_, off, text),) = _sample(run, tmp_path / "off", *flags, "--guidance-rescale", "0")
    assert "Guidance rescale: 0.0" in text and not np.array_equal(half, off)
    assert main(["sample", str(run), *flags, "--guidance-rescale", "1.5", "--out", "x"]) == 2


def test_a_prompts_file_sets_options_per_line(run, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        f"# per-prompt options\n{PROMPT} --s 2 --d 9 --w 48 --h 16 --n a blue square --l 4\n\n"
        "a blue square\n",
        encoding="utf-8",
    )
    images = _sample(run, tmp_path / "out", "--prompt", "first", "--prompts-file", str(prompts))
    assert [name[:6] for name, _, _ in images] == ["00000-", "00001-", "00002-"]
    first, line_2, line_4 = images
    assert "first\nNegative prompt: blurry\nSteps: 3," in first[2]  # the run's defaults
    assert line_2[1].shape == (16, 48, 3) and line_2[0].endswith("-seed9.png")
    assert line_2[2] == (
        f"{PROMPT}\nNegative prompt: a blue square\nSteps: 2, Sampler: ddim, CFG scale: 4.0, "
        "Guidance rescale: 0.5, Seed: 9, Size: 48x16"
    )
    assert line_4[1].shape == (32, 32, 3) and "Seed: 5, Size: 32x32" in line_4[2]
    # A line's options give the image its flags give.
    square = tmp_path / "square.txt"
    square.write_text(f"{PROMPT} --s 2 --d 9 --w 48 --h 48 --n a blue square --l 4\n")
    ((_, from_line, _),) = _sample(run, tmp_path / "line", "--prompts-file", str(square))
    flags = ["--steps", "2", "--seed", "9", "--size", "48", "--negative", "a blue square"]
    ((_, from_flags, _),) = _sample(
        run, tmp_path / "flags", "--prompt", PROMPT, *flags, "--cfg", "4"
    )
    assert from_line.shape == (48, 48, 3) and np.array_equal(from_line, from_flags)


def test_prompt_mistakes_are_one_line_before_the_model_loads(run, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["sample", str(run), "--out", out]) == 2
    assert (
        f"no prompt to sample: {run} names no validation prompts (sample.prompts); give "
        "--prompt TEXT or --prompts-file FILE" in capsys.readouterr().err
    )
    bad = tmp_path / "bad.txt"
    bad.write_text("a cat\na dog --steps 4\n", encoding="utf-8")
    assert main(["sample", str(run), "--prompts-file", str(bad), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"impasto: error: --prompts-file {bad}:2: unknown option --steps; valid: --n, --w"
    )
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_batches_give_the_same_images_and_captions_sit_beside_them(run, tmp_path):
    flags = ["--prompt", PROMPT, "--num", "3", "--steps", "2"]
    one_by_one = _sample(run, tmp_path / "single", *flags)
    out = tmp_path / "batched"
    captioned = ["--batch-size", "2", "--captions", "--out", str(out)]
    assert main(["sample", str(run), *flags, *captioned]) == 0
    assert main(["sample", str(run), *flags, "--batch-size", "2", "--out", str(out)]) == 0
    pngs = sorted(out.glob("*.png"))
    captions = sorted(out.glob("*.txt"))
    assert [p.stem for p in captions] == [p.stem for p in pngs[:3]]  # the first command's
    assert {p.read_text(encoding="utf-8") for p in captions} == {PROMPT + "\n"}
    for (name, pixels, parameters), path in zip(one_by_one, pngs[:3], strict=True):
        with Image.open(path) as image:
            assert path.name == name and np.array_equal(np.asarray(image), pixels)
            assert image.text["parameters"] == parameters
    assert main(["sample", str(run), *flags, "--batch-size", "0", "--out", str(out)]) == 2
