"""``impasto export RUN --format single-file`` of a Wan 2.1 run (issue #33): the trained
transformer as one file in Wan-AI's names, as ``wan2.1_t2v_1.3B_fp16.safetensors`` holds them
(no prefix, ``blocks.N.self_attn.q``, ``cross_attn``, ``norm3``, ``ffn.0``, ``head.head``,
``head.modulation`` ...). The file loads back through ``model.wan.transformer`` and through
diffusers' own ``WanTransformer3DModel.from_single_file`` (with the run's transformer config,
offline) to the trained weights, and ComfyUI's model detection (tests/comfyui_detection.py)
picks Wan 2.1 text-to-video from its names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from comfyui_detection import detect
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors import safe_open
from safetensors.torch import load_file
from test_wan_single_file import original_name

from impasto.cli import main
from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.wan.components import build_tiny
from impasto.models.wan.single_file import to_original

pytest.importorskip("av")

TEXT_LENGTH = 16


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Wan run over tiny demo clips that fully fine-tunes the transformer (2 steps)."""
    from impasto.data.demo_video import write_demo_video_dataset
    from impasto.train.trainer import train

    out = tmp_path_factory.mktemp("wan-full")
    write_demo_video_dataset(out / "clips", num_clips=4, size=32, frames=9, seed=0)
    raw = {
        "config_version": 1,
        "model": {"family": "wan", "preset": "tiny", "wan": {"text_length": TEXT_LENGTH}},
        "objective": {"prediction_type": "flow", "flow_shift": 3.0},
        "data": {"path": str(out / "clips"), "resolution": 32, "batch_size": 2,
                 "video": {"num_frames": 9}},
        "parts": {"transformer": "full"},
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "train": {"output_dir": str(out / "run"), "seed": 0, "max_steps": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 1},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }  # fmt: skip
    return train(build_config(raw)).run_dir


def export(run: Path, out: Path, dtype: str) -> dict[str, torch.Tensor]:
    assert main(["export", str(run), "--format", "single-file", "--dtype", dtype,
                 "--out", str(out)]) == 0  # fmt: skip
    return load_file(str(out))


def trained_transformer(run: Path) -> torch.nn.Module:
    from impasto.checkpoint.trained import load_trained

    _, backbone = load_trained(run)
    return backbone.denoiser()


def loaded_by_impasto(tiny_raw: dict, file: Path) -> dict[str, torch.Tensor]:
    """``model.wan.transformer: FILE`` over the tiny preset of another seed."""
    options = {"text_length": TEXT_LENGTH, "transformer": str(file)}
    tiny_raw["model"] = {"family": "wan", "preset": "tiny", "init_seed": 1, "wan": options}
    tiny_raw["objective"] = {"prediction_type": "flow"}
    return build_backbone(build_config(tiny_raw)).denoiser().state_dict()


def test_a_full_fine_tune_exports_wans_single_file(full_run, tiny_raw, tmp_path):
    transformer = trained_transformer(full_run)
    want = transformer.state_dict()
    assert not torch.equal(
        want["proj_out.weight"], build_tiny(0, TEXT_LENGTH).transformer.proj_out.weight
    )
    file = tmp_path / "wan2.1_t2v_tuned.safetensors"
    stored = export(full_run, file, "fp32")
    assert stored.keys() == {original_name(key) for key in want}  # Wan's module tree
    assert all(torch.equal(stored[original_name(key)], tensor) for key, tensor in want.items())
    with safe_open(str(file), "pt") as handle:
        assert handle.metadata() == {"impasto.family": "wan", "format": "pt"}
    got = loaded_by_impasto(tiny_raw, file)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], tensor) for key, tensor in want.items())
    transformer.save_config(tmp_path / "config")  # the run's transformer/config.json
    theirs = WanTransformer3DModel.from_single_file(
        str(file), config=str(tmp_path / "config"), torch_dtype=torch.float32
    ).state_dict()
    assert theirs.keys() == want.keys()
    assert all(torch.equal(theirs[key], tensor) for key, tensor in want.items())
    assert detect(stored) == ("WAN21_T2V", {
        "image_model": "wan2.1", "dim": want["scale_shift_table"].shape[-1],
        "out_dim": 16, "ffn_dim": want["blocks.0.ffn.net.0.proj.weight"].shape[0],
        "num_layers": 2, "in_dim": 16, "model_type": "t2v",
    })  # fmt: skip


def test_the_export_dtype_is_the_files(full_run, tiny_raw, tmp_path):
    want = trained_transformer(full_run).state_dict()
    file = tmp_path / "wan2.1_t2v_tuned_fp16.safetensors"
    stored = export(full_run, file, "fp16")
    assert {tensor.dtype for tensor in stored.values()} == {torch.float16}
    got = loaded_by_impasto(tiny_raw, file)
    assert all(torch.equal(got[key], t.half().float()) for key, t in want.items())


def test_the_writer_is_the_inverse_of_diffusers_converter():
    state = build_tiny(3, TEXT_LENGTH).transformer.state_dict()
    back = convert_wan_transformer_to_diffusers(to_original(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    image_to_video = {**state, "condition_embedder.image_embedder.norm1.weight": torch.ones(2)}
    with pytest.raises(ValueError, match="no place for: 'condition_embedder.image_embedder"):
        to_original(image_to_video)
