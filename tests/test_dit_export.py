"""A DiT run exports as a folder (``impasto export --format folder``) that samples exactly as
the run does and trains on from ``model.path`` (issue #31)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from impasto.cli import main
from impasto.config import build_config
from impasto.export import ExportOptions, export_checkpoint
from impasto.models import build_backbone
from impasto.sample_source import open_model
from impasto.train.trainer import train

PROMPT = "a red circle on a white background"
FLAGS = ["--prompt", PROMPT, "--steps", "3", "--cfg", "3", "--seed", "1"]


def _sample(model: Path | str, out: Path, *flags: str) -> np.ndarray:
    assert main(["sample", str(model), *flags, "--out", str(out)]) == 0
    (path,) = out.iterdir()
    with Image.open(path) as image:
        return np.asarray(image)


def _dit_raw(tiny_raw, **parts):
    tiny_raw["model"] = {"family": "dit", "preset": "tiny", "dit": {"block": "cross"}}
    tiny_raw["objective"] = {"prediction_type": "flow", "flow_shift": 2.0}
    tiny_raw["train"]["max_steps"] = 2
    tiny_raw["checkpoint"]["every_steps"] = 2
    tiny_raw["optim"]["lr"] = 1e-2  # weights that moved: a wrong load would show
    tiny_raw["parts"] = parts
    return tiny_raw


def test_an_exported_dit_samples_as_its_run_and_trains_on(tiny_raw, tmp_path, capsys):
    run = train(build_config(_dit_raw(tiny_raw))).run_dir
    assert main(["export", str(run), "--format", "folder", "--out", str(tmp_path / "dit"),
                 "--dtype", "fp32"]) == 0  # fmt: skip
    folder = tmp_path / "dit"
    model = open_model(folder)
    assert model.objective.prediction_type == "flow" and model.objective.flow_shift == 2.0
    assert (model.height, model.width) == (64, 64)
    expected = _sample(run, tmp_path / "from-run", *FLAGS)
    assert np.array_equal(_sample(folder, tmp_path / "from-folder", *FLAGS), expected)
    # model.path continues from the folder: the same weights as the run's last checkpoint
    again = build_config({**tiny_raw, "model": {"family": "dit", "path": str(folder)}})
    weights = build_backbone(again).denoiser().state_dict()
    trained = open_model(run).backbone.denoiser().state_dict()
    assert all(torch.equal(weights[key], trained[key]) for key in trained)
    # a format SDXL has is not the DiT's
    assert main(["export", str(run), "--format", "diffusers", "--out", str(tmp_path / "x")]) == 2
    assert (
        "unknown format 'diffusers' for model.family 'dit'; valid: folder"
        in capsys.readouterr().err
    )


def test_a_dit_lora_run_exports_merged_only(tiny_raw, tmp_path):
    raw = _dit_raw(tiny_raw, transformer="lora")
    raw["lora"] = {"rank": 4, "targets": "attention_ff"}
    run = train(build_config(raw)).run_dir
    fp32 = ExportOptions(dtype="fp32")
    with pytest.raises(ValueError, match=r"trained lora adapters \(transformer\); add --merge"):
        export_checkpoint(run, "folder", tmp_path / "plain", fp32)
    merged = export_checkpoint(
        run, "folder", tmp_path / "merged", ExportOptions("fp32", merge=True)
    )
    expected = _sample(run, tmp_path / "from-run", *FLAGS).astype(int)
    got = _sample(merged, tmp_path / "from-merged", *FLAGS).astype(int)
    assert np.abs(got - expected).max() <= 1  # merging rounds the weights, not the pictures
