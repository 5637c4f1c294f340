"""The demo-image classifier used to judge samples: right on ground truth, fails on junk."""

from __future__ import annotations

import numpy as np
import torch

from impasto.data.demo import DemoSpec, demo_spec, render_demo_image
from impasto.data.demo_eval import parse_demo_caption, read_demo_image
from impasto.models.vae_files import load_demo_vae


def test_reads_ground_truth_images_exactly():
    specs = [demo_spec(i, seed=7, size=64) for i in range(126)]
    readings = [read_demo_image(np.asarray(render_demo_image(s, 64))) for s in specs]
    assert [(r.color, r.shape) for r in readings] == [(s.color, s.shape) for s in specs]


def test_fill_ratios_match_geometry():
    big = {
        shape: DemoSpec("blue", shape, "white", (8, 8, 48))
        for shape in ("circle", "square", "triangle")
    }
    fill = {
        shape: read_demo_image(np.asarray(render_demo_image(s, 64))).fill_ratio
        for shape, s in big.items()
    }
    # Exact areas are 1, π/4 and 1/2 of the box; the robust 1-99 % box trims rims and the apex.
    assert fill["square"] == 1.0
    assert np.pi / 4 - 0.01 < fill["circle"] < 0.86
    assert 0.5 < fill["triangle"] < 0.65


def test_reads_demo_vae_reconstructions():
    # What the shipped VAE decodes is what a generator can draw at best: soft corners and edges.
    specs = [demo_spec(i, seed=3, size=64) for i in range(126)]
    pixels = torch.stack(
        [torch.from_numpy(np.asarray(render_demo_image(s, 64))).permute(2, 0, 1) for s in specs]
    )
    vae = load_demo_vae()
    with torch.no_grad():
        latents = vae.encode(pixels.float() / 127.5 - 1).latent_dist.mean
        decoded = vae.decode(latents).sample.clamp(-1, 1)
    images = ((decoded + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    readings = [read_demo_image(image) for image in images]
    colors = sum(r.color == s.color for r, s in zip(readings, specs, strict=True))
    shapes = sum(r.shape == s.shape for r, s in zip(readings, specs, strict=True))
    assert colors >= 125 and shapes >= 123  # measured: 125 and 126


def test_blank_image_is_no_shape():
    blank = np.full((64, 64, 3), 255, dtype=np.uint8)
    assert read_demo_image(blank).color is None and read_demo_image(blank).shape is None


def test_parse_caption():
    assert parse_demo_caption("a red circle on a white background") == ("red", "circle")
