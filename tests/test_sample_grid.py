"""Labelled validation grids, validation prompt files and guidance rescale (issue #17)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import (
    rescale_noise_cfg,
)
from PIL import Image
from torch.testing import assert_close

import impasto
from impasto.config import build_config
from impasto.inference import model_sampling_options
from impasto.models.sdxl import SDXLBackbone
from impasto.sampling import generate, guided_output, rescale_cfg
from impasto.sampling.grid import (
    BACKGROUND,
    PADDING,
    PROMPT_LINES,
    CellLabel,
    fit_line,
    font_size,
    labelled_grid,
    load_font,
    to_pixels,
    upscale_nearest,
    wrap_lines,
)
from impasto.train.validation import validation_prompts, write_validation_grid

PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def _label_height(cell_width: int) -> tuple[int, int]:
    """(label, header) heights in pixels, as labelled_grid lays them out."""
    font, header = load_font(font_size(cell_width)), load_font(font_size(cell_width) * 3 // 2)
    line = sum(font.getmetrics()) + 2
    return (PROMPT_LINES + 1) * line + PADDING, sum(header.getmetrics()) + 2 * PADDING


def test_labelled_grid_enlarges_pads_and_labels_cells_of_different_sizes():
    generator = torch.Generator().manual_seed(0)
    images = [
        torch.rand(3, 64, 64, generator=generator),
        torch.rand(3, 32, 48, generator=generator),
    ]
    labels = [CellLabel("a red circle " * 6, 0), CellLabel("a blue square", 11)]
    grid = labelled_grid(images, labels, "run  step 200", num_columns=2)
    # 64 px wide x4 = 256, 48 px wide x6 = 288: every cell is the widest (288) by the tallest (256).
    label_height, header_height = _label_height(288)
    assert grid.image.size == (2 * (288 + PADDING) + PADDING,
                               header_height + PADDING + 256 + label_height + PADDING)  # fmt: skip
    pixels = np.asarray(grid.image)
    top = header_height + PADDING
    assert grid.boxes == [(4, top, 4 + 256, top + 256), (296, top, 296 + 288, top + 192)]
    for image, factor, (left, upper, right, lower) in zip(images, (4, 6), grid.boxes, strict=True):
        assert np.array_equal(
            pixels[upper:lower, left:right], upscale_nearest(to_pixels(image), factor)
        )
    # Below the shorter image, its cell is background; under each cell and in the header, text.
    assert (pixels[top + 192 : top + 256, 296 : 296 + 288] == BACKGROUND).all()
    for left, _, right, _ in grid.boxes:
        label = pixels[top + 256 : top + 256 + label_height, left:right]
        assert (label != BACKGROUND).any(axis=-1).sum() > 100  # glyphs, not a blank strip
    assert (pixels[:header_height] != BACKGROUND).any(axis=-1).sum() > 100


def test_long_prompts_wrap_then_end_in_an_ellipsis_within_the_cell():
    font = load_font(16)
    lines = wrap_lines("a red circle on a white background, " * 5, font, 256, max_lines=2)
    assert len(lines) == 2 and lines[1].endswith("...") and lines[0].startswith("a red circle")
    assert all(font.getlength(line) <= 256 for line in lines)
    assert wrap_lines("short", font, 256, 2) == ["short"]
    assert font.getlength(fit_line("x" * 500, font, 100)) <= 100


@pytest.fixture(scope="module")
def backbone(tiny):
    return SDXLBackbone(tiny)


def _config(tiny_raw, **sample):
    tiny_raw["sample"] = {"every_steps": 1, "num_steps": 2, "guidance_scale": 3.0, **sample}
    return build_config(tiny_raw)


def test_a_grid_without_prompt_file_or_rescale_is_the_one_batch_it_was(
    tiny_raw, backbone, tmp_path
):
    config = _config(tiny_raw, prompts=PROMPTS, images_per_prompt=2, seed=4)
    validation = write_validation_grid(config, backbone, tmp_path, step=7)
    # Before issue #17: one generate call, row j from seed + j, no guidance rescale argument.
    before = generate(
        backbone,
        [prompt for prompt in PROMPTS for _ in range(2)],
        negative_prompt="",
        num_steps=2,
        guidance_scale=3.0,
        sampler="euler",
        seed=4,
        height=64,
        width=64,
        **model_sampling_options(config),
    )
    assert torch.equal(validation.images, before)
    assert validation.prompts == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    with Image.open(validation.path) as png:  # TensorBoard's grid is the PNG's
        written = torch.from_numpy(np.asarray(png).copy()).permute(2, 0, 1)
    assert torch.equal((validation.grid * 255).round().byte(), written)


def test_a_validation_prompt_file_appends_prompts_with_their_options(tiny_raw, backbone, tmp_path):
    prompts_file = tmp_path / "validation.txt"
    prompts_file.write_text(
        "# two more\na green triangle --d 11 --w 32 --h 48\na yellow circle --n blurry\n"
    )
    config = _config(
        tiny_raw, prompts=PROMPTS[:1], prompts_file=str(prompts_file), images_per_prompt=2
    )
    validation = write_validation_grid(config, backbone, tmp_path, step=3)
    texts = [PROMPTS[0], "a green triangle", "a yellow circle"]
    assert validation.prompts == [text for text in texts for _ in range(2)]
    assert isinstance(validation.images, list)  # sizes differ: one tensor per image
    assert [tuple(image.shape) for image in validation.images] == [(3, 64, 64)] * 2 + [
        (3, 48, 32)
    ] * 2 + [(3, 64, 64)] * 2
    common = {"num_images_per_prompt": 2, "num_steps": 2, "guidance_scale": 3.0}
    common |= model_sampling_options(config)
    expected = [
        generate(backbone, texts[:1], seed=0, height=64, width=64, **common),
        generate(backbone, texts[1:2], seed=11, height=48, width=32, **common),  # its --d
        generate(backbone, texts[2:], seed=4, height=64, width=64, negative_prompt="blurry",
                 **common),  # prompt 2 of the grid: seed + 2 x 2
    ]  # fmt: skip
    # Prompts read once (by the trainer) serve every round, whatever the file becomes.
    prompts = validation_prompts(config.sample)
    prompts_file.unlink()
    again = write_validation_grid(config, backbone, tmp_path, step=4, prompts=prompts)
    assert all(torch.equal(a, b) for a, b in zip(again.images, validation.images, strict=True))
    for got, want in zip(
        validation.images, [row for batch in expected for row in batch], strict=True
    ):
        assert torch.equal(got, want)


def test_prompt_file_config_rules(tiny_raw, tmp_path):
    tiny_raw["sample"] = {"every_steps": 5}
    with pytest.raises(
        ValueError, match="every_steps is set but prompts is empty and prompts_file"
    ):
        build_config(tiny_raw)
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("a cat --s 1000\na dog --x 1\n")
    tiny_raw["sample"] = {"every_steps": 5, "prompts_file": str(prompts_file)}
    with pytest.raises(ValueError, match=f"sample.prompts_file: {prompts_file}:2: unknown option"):
        impasto.build_config(tiny_raw)
    prompts_file.write_text("a cat --s 1000\n")
    with pytest.raises(ValueError, match=":1: --s 1000: a sampler visits fewer timesteps"):
        impasto.build_config(tiny_raw)
    tiny_raw["sample"]["prompts_file"] = str(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="sample.prompts_file: .*missing.txt: does not exist"):
        impasto.build_config(tiny_raw)
    tiny_raw["sample"] = {"guidance_rescale": 1.5}
    with pytest.raises(ValueError, match="sample.guidance_rescale"):
        build_config(tiny_raw)


# --- guidance rescale -----------------------------------------------------------------------


@pytest.mark.parametrize("phi", [0.0, 0.3, 0.7, 1.0])
def test_rescale_cfg_equals_diffusers_rescale_noise_cfg(phi: float):
    generator = torch.Generator().manual_seed(1)
    uncond, cond = torch.randn(2, 3, 4, 8, 8, generator=generator, dtype=torch.float64)
    guided = uncond + 7.5 * (cond - uncond)
    expected = rescale_noise_cfg(guided.clone(), cond.clone(), guidance_rescale=phi)
    assert_close(rescale_cfg(guided, cond, phi), expected, rtol=1e-12, atol=1e-12)


def test_guided_output_rescales_the_models_own_output_only_when_phi_is_set(monkeypatch):
    def model(x, timestep, conditioning):  # [uncond; cond] rows with different spreads
        return torch.cat([x[:2] * 0.5, x[2:] * 2.0 + 1.0])

    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor(500.0)
    plain = guided_output(model, x, t, "c", "uc", 5.0)
    uncond, cond = x * 0.5, x * 2.0 + 1.0
    assert torch.equal(plain, uncond + 5.0 * (cond - uncond))
    rescaled = guided_output(model, x, t, "c", "uc", 5.0, rescale=0.7)
    assert_close(rescaled, rescale_noise_cfg(plain, cond, guidance_rescale=0.7))

    def no_rescale(*args):
        raise AssertionError("φ = 0 must not touch the output")

    monkeypatch.setattr("impasto.sampling.guidance.rescale_cfg", no_rescale)
    assert torch.equal(guided_output(model, x, t, "c", "uc", 5.0, rescale=0.0), plain)


@pytest.mark.parametrize(
    ("num_prompts", "per_prompt", "columns"),
    [(9, 1, 3), (9, 2, 6), (9, 4, 8), (9, 8, 8), (9, 12, 12), (1, 2, 2), (2, 1, 2), (30, 1, 6)],
)
def test_a_grid_holds_a_prompts_seeds_in_one_row_and_stays_about_square(
    num_prompts: int, per_prompt: int, columns: int
):
    from impasto.train.validation import grid_columns

    assert grid_columns(num_prompts, per_prompt) == columns
    assert columns % per_prompt == 0  # every row starts with a prompt's first image
