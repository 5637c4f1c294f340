"""Full-model exports one network at a time (issue #17): bit for bit the whole-model export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import impasto.export.sdxl as sdxl_export
from impasto.config import build_config
from impasto.export import ExportOptions, export_checkpoint
from impasto.models.io import save_diffusers
from impasto.models.presets import build_tiny
from impasto.models.single_file import save_single_file
from impasto.train.trainer import train

RUNS = {
    "full": {"parts": {"unet": "full", "text_encoder_2": "full"}},
    "lora": {
        "parts": {"unet": "lora", "text_encoder": "lora", "text_encoder_2": "lora"},
        "lora": {"rank": 4, "alpha": 2.0},
    },
    "dora": {"parts": {"unet": "lora"}, "lora": {"kind": "dora", "rank": 4}},
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model as a single file and as a diffusers folder, to train runs from."""
    root = tmp_path_factory.mktemp("bases")
    tiny = build_tiny(0)
    save_single_file(tiny, root / "tiny.safetensors", dtype=torch.float32)
    save_diffusers(tiny, root / "tiny-diffusers")
    return {"single-file": root / "tiny.safetensors", "diffusers": root / "tiny-diffusers"}


def _run(tiny_raw, tmp_path, base: Path, kind: str) -> Path:
    tiny_raw["model"] = {"path": str(base)}
    tiny_raw["train"] = {**tiny_raw["train"], "max_steps": 2, "output_dir": str(tmp_path / kind)}
    tiny_raw["checkpoint"]["every_steps"] = 2
    tiny_raw["optim"]["lr"] = 1e-2
    tiny_raw.update(RUNS[kind])
    return train(build_config(tiny_raw)).run_dir


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()  # noqa: SIM118


def _assert_same_file(a: Path, b: Path) -> None:
    (tensors_a, metadata_a), (tensors_b, metadata_b) = _read(a), _read(b)
    assert metadata_a == metadata_b
    assert tensors_a.keys() == tensors_b.keys()
    for key, tensor in tensors_a.items():
        assert tensor.dtype == tensors_b[key].dtype and torch.equal(tensor, tensors_b[key]), key


def _whole_model(monkeypatch) -> None:
    monkeypatch.setattr(sdxl_export, "loads_by_network", lambda *args: False)


def _by_network_only(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the export rebuilt the whole model")

    monkeypatch.setattr(sdxl_export, "load_trained", refuse)


@pytest.mark.parametrize("base", ["single-file", "diffusers"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_single_file_export_by_network_equals_whole_model(
    tiny_raw, tmp_path, bases, monkeypatch, base, kind
):
    run = _run(tiny_raw, tmp_path, bases[base], kind)
    options = ExportOptions("fp16", merge=kind != "full")
    with monkeypatch.context() as patch:
        _by_network_only(patch)
        by_network = export_checkpoint(run, "single-file", tmp_path / "a.safetensors", options)
    with monkeypatch.context() as patch:
        _whole_model(patch)
        whole = export_checkpoint(run, "single-file", tmp_path / "b.safetensors", options)
    _assert_same_file(by_network, whole)


def test_diffusers_export_by_network_equals_whole_model(tiny_raw, tmp_path, bases, monkeypatch):
    run = _run(tiny_raw, tmp_path, bases["diffusers"], "dora")
    options = ExportOptions("fp32", merge=True)
    with monkeypatch.context() as patch:
        _by_network_only(patch)
        export_checkpoint(run, "diffusers", tmp_path / "a", options)
    with monkeypatch.context() as patch:
        _whole_model(patch)
        export_checkpoint(run, "diffusers", tmp_path / "b", options)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.*"))
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.*"))
    for name in files:
        a, b = tmp_path / "a" / name, tmp_path / "b" / name
        if name.suffix == ".safetensors":
            _assert_same_file(a, b)
        else:
            assert a.read_bytes() == b.read_bytes(), name
