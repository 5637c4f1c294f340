"""A v-prediction (or zero-terminal-SNR) single file refuses an objective that trains otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from impasto.config import build_config
from impasto.models import load_model
from impasto.models.markers import check_objective_fits, marker_keys


def marked_file(path: Path, *markers: str) -> Path:
    save_file({"model.diffusion_model.x": torch.zeros(1)} | {m: torch.tensor([]) for m in markers},
              path)  # fmt: skip
    return path


def test_markers_are_read_from_the_header(tmp_path: Path):
    assert marker_keys(marked_file(tmp_path / "v.safetensors", "v_pred", "ztsnr")) == {
        "v_pred",
        "ztsnr",
    }
    assert marker_keys(marked_file(tmp_path / "eps.safetensors")) == set()
    assert marker_keys(tmp_path / "missing.safetensors") == set()
    assert marker_keys(tmp_path) == set()  # a diffusers folder


def test_an_epsilon_objective_on_a_v_pred_file_is_one_line(tmp_path: Path):
    path = marked_file(tmp_path / "noobai-vpred.safetensors", "v_pred", "ztsnr")
    raw = {"model": {"path": str(path)}, "data": {"path": "x"},
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1}}  # fmt: skip
    with pytest.raises(ValueError, match=r"is a v-prediction model .* v_prediction") as error:
        load_model(build_config(raw))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="objective.zero_terminal_snr: true"):
        check_objective_fits(path, "v_prediction", zero_terminal_snr=False)
    check_objective_fits(path, "v_prediction", zero_terminal_snr=True)  # fits: no error
    check_objective_fits(marked_file(tmp_path / "eps.safetensors"), "epsilon", False)
