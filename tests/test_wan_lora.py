"""The Wan 2.1 family through impasto's trainer (issue #33): a LoRA run on the tiny preset over
tiny demo clips, its adapters on the layers musubi-tuner / diffusion-pipe target, exported with
``impasto export --format lora-diffusers`` and loaded by ``WanPipeline.load_lora_weights`` to
the same samples as impasto's sampler, ``--format lora-comfyui`` mapped by ComfyUI's Wan key
map with 0 ignored tensors, ``impasto sample --frames`` writing clips, and the family's config
errors (docs/wan.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.wan.backbone import WanBackbone
from impasto.models.wan.components import build_tiny
from impasto.models.wan.files import wan_pipeline
from impasto.models.wan.sampling import generate_wan_latents
from impasto.train.checks import check_config

pytest.importorskip("av")

TEXT_LENGTH = 16
PROMPT = "a red circle moving left"
CALL = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 3,
        "guidance_scale": 3.0, "negative_prompt": "blurry"}  # fmt: skip

# musubi-tuner's and diffusion-pipe's Wan LoRA: every linear layer of the blocks
SCRIPT_LAYERS = {
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
    "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2",
}  # fmt: skip


def wan_raw(data: Path, run_dir: Path, **changes: Any) -> dict[str, Any]:
    raw = {
        "config_version": 1,
        "model": {"family": "wan", "preset": "tiny", "wan": {"text_length": TEXT_LENGTH}},
        "objective": {"prediction_type": "flow", "timestep_sampling": "logit_normal",
                      "flow_shift": 3.0},
        "data": {"path": str(data), "resolution": 32, "batch_size": 2,
                 "video": {"num_frames": 9}},
        "parts": {"transformer": "lora"},
        "lora": {"rank": 4, "alpha": 8, "targets": "attention_ff"},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "train": {"output_dir": str(run_dir), "seed": 0, "max_steps": 3},
        "checkpoint": {"every_steps": 3, "keep_last": 1},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }  # fmt: skip
    raw.update(changes)
    return raw


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from impasto.data.demo_video import write_demo_video_dataset

    root = tmp_path_factory.mktemp("wan-clips")
    write_demo_video_dataset(root, num_clips=4, size=32, frames=9, seed=0)
    return root


@pytest.fixture(scope="module")
def lora_run(clips, tmp_path_factory):
    from impasto.train.trainer import train

    run_dir = tmp_path_factory.mktemp("wan-run") / "run"
    return train(build_config(wan_raw(clips, run_dir)))


def test_lora_targets_are_the_training_scripts_layers():
    backbone = WanBackbone(build_tiny(0, TEXT_LENGTH))
    targets = backbone.adapter_targets("transformer", "attention_ff")
    script = [name for name, module in backbone.denoiser().named_modules()
              if isinstance(module, torch.nn.Linear)
              and any(name.endswith("." + layer) for layer in SCRIPT_LAYERS)]  # fmt: skip
    assert sorted(targets) == sorted(script) and len(targets) == 2 * 10
    attention = backbone.adapter_targets("transformer", "attention")
    assert len(attention) == 2 * 8 and not any("ffn" in name for name in attention)
    with pytest.raises(ValueError, match=r"^parts.text_encoder: umT5 trains frozen only"):
        backbone.adapter_targets("text_encoder", "attention")


def _sample_both(backbone, pipe) -> tuple[torch.Tensor, torch.Tensor]:
    ours = generate_wan_latents(
        backbone, [PROMPT], num_steps=3, guidance_scale=3.0, negative_prompt="blurry", seed=2,
        height=32, width=32, frames=5,
    )  # fmt: skip
    theirs = pipe(
        PROMPT, generator=[torch.Generator().manual_seed(2)], output_type="latent",
        max_sequence_length=TEXT_LENGTH, **CALL,
    ).frames  # fmt: skip
    return ours, theirs


@pytest.fixture(scope="module")
def merged(lora_run, tmp_path_factory) -> Path:
    """The run as a diffusers Wan folder, adapters merged (impasto export --merge)."""
    from impasto.export import ExportOptions, export_checkpoint

    out = tmp_path_factory.mktemp("wan-merged") / "merged"
    return export_checkpoint(lora_run.run_dir, "diffusers", out, ExportOptions("fp32", merge=True))


def test_lora_diffusers_export_loads_in_wan_pipeline_to_the_same_samples(lora_run, tmp_path):
    from impasto.checkpoint.trained import load_trained
    from impasto.cli import main

    _, backbone = load_trained(lora_run.last_checkpoint)
    out = tmp_path / "lora"
    assert main(["export", str(lora_run.run_dir), "--format", "lora-diffusers", "--out",
                 str(out), "--dtype", "fp32"]) == 0  # fmt: skip
    [weights] = out.glob("*.safetensors")
    keys = set(load_file(str(weights)))
    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in keys
    assert "transformer.blocks.1.ffn.net.2.lora_B.weight" in keys and len(keys) == 2 * 20

    base = build_tiny(0, TEXT_LENGTH)  # the run's starting model (model.init_seed 0)
    pipe = wan_pipeline(base)
    plain = pipe(PROMPT, generator=[torch.Generator().manual_seed(2)], output_type="latent",
                 max_sequence_length=TEXT_LENGTH, **CALL).frames  # fmt: skip
    pipe.load_lora_weights(str(out))
    assert any("lora_A" in name for name, _ in pipe.transformer.named_parameters())
    ours, theirs = _sample_both(backbone, pipe)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters trained and were loaded


# ComfyUI comfy/lora.py (Comfy-Org/ComfyUI), model_lora_keys_unet: a WAN21 model has no
# branch of its own; the generic map makes every weight "diffusion_model.<name>.weight" of the
# model reachable as "diffusion_model.<name>" and "lora_unet_<name with _>" (comfy/lora_convert.py
# converts no diffusers-layout Wan LoRA). LoRAAdapter.load pairs "<x>.lora_B.weight" with
# "<x>.lora_A.weight" (scale 1 without an "<x>.alpha" tensor). Wan's original names
# (comfy/ldm/wan/model.py): blocks.N.{self_attn,cross_attn}.{q,k,v,o}, blocks.N.ffn.{0,2}.
def comfy_wan_key_map(num_blocks: int) -> dict[str, str]:
    layers = [f"{attn}.{proj}" for attn in ("self_attn", "cross_attn") for proj in "qkvo"]
    layers += ["ffn.0", "ffn.2"]
    weights = [f"diffusion_model.blocks.{i}.{layer}.weight" for i in range(num_blocks)
               for layer in layers]  # fmt: skip
    key_map = {}
    for key in weights:
        name = key[len("diffusion_model.") : -len(".weight")]
        key_map["lora_unet_" + name.replace(".", "_")] = key
        key_map[f"diffusion_model.{name}"] = key
    return key_map


def comfy_patches(lora: dict[str, torch.Tensor], key_map: dict[str, str]):
    """``(patched weight key → (up·alpha/rank, down)), the tensors nothing read``, as
    LoRAAdapter.load reads "<x>.lora_up.weight" / "<x>.lora_down.weight" (kohya) or
    "<x>.lora_B.weight" / "<x>.lora_A.weight", scaled by "<x>.alpha" / rank where it is."""
    loaded, read = {}, set()
    for name, target in key_map.items():
        for up, down in ((f"{name}.lora_up.weight", f"{name}.lora_down.weight"),
                         (f"{name}.lora_B.weight", f"{name}.lora_A.weight")):  # fmt: skip
            if up in lora:
                alpha = f"{name}.alpha"
                scale = lora[alpha].item() / lora[down].shape[0] if alpha in lora else 1.0
                loaded[target] = (lora[up] * scale, lora[down])
                read |= {up, down, alpha} & set(lora)
                break
    return loaded, set(lora) - read


def assert_patches_merge(loaded, merged: Path) -> None:
    """ComfyUI's patches on the base weights equal the merged export's weights."""
    merged_weights = load_file(str(merged / "transformer" / "diffusion_pytorch_model.safetensors"))
    base = build_tiny(0, TEXT_LENGTH).transformer.state_dict()
    for target, (up, down) in loaded.items():
        block, index, rest = target[len("diffusion_model.") : -len(".weight")].split(".", 2)
        key = f"{block}.{index}.{DIFFUSERS_NAMES[rest]}.weight"
        torch.testing.assert_close(base[key] + up @ down, merged_weights[key], rtol=1e-5, atol=1e-6)


# diffusers' module → Wan's original (diffusers' scripts/convert_wan_to_diffusers.py)
DIFFUSERS_NAMES = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k",
                   "self_attn.v": "attn1.to_v", "self_attn.o": "attn1.to_out.0",
                   "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
                   "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0",
                   "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}  # fmt: skip


def test_lora_comfyui_export_maps_every_tensor_and_patches_the_merged_weights(
    lora_run, merged, tmp_path
):
    from impasto.cli import main

    file = tmp_path / "wan-lora.safetensors"
    assert main(["export", str(lora_run.run_dir), "--format", "lora-comfyui", "--out",
                 str(file), "--dtype", "fp32"]) == 0  # fmt: skip
    lora = load_file(str(file))
    loaded, ignored = comfy_patches(lora, comfy_wan_key_map(2))
    assert ignored == set() and len(loaded) == 2 * 10
    # the diffusers layout is WanPipeline's only: ComfyUI would ignore every tensor of it
    diffusers_dir = tmp_path / "diffusers"
    assert main(["export", str(lora_run.run_dir), "--format", "lora-diffusers", "--out",
                 str(diffusers_dir), "--dtype", "fp32"]) == 0  # fmt: skip
    diffusers_lora = load_file(str(next(diffusers_dir.glob("*.safetensors"))))
    assert comfy_patches(diffusers_lora, comfy_wan_key_map(2)) == ({}, set(diffusers_lora))
    assert_patches_merge(loaded, merged)

    # and WanPipeline.load_lora_weights converts the same file to the same samples
    from impasto.checkpoint.trained import load_trained

    _, backbone = load_trained(lora_run.last_checkpoint)
    pipe = wan_pipeline(build_tiny(0, TEXT_LENGTH))
    pipe.load_lora_weights(str(file))
    ours, theirs = _sample_both(backbone, pipe)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_lora_kohya_export_is_musubi_tuners_layout_for_comfyui_and_diffusers(
    lora_run, merged, tmp_path
):
    from safetensors import safe_open

    from impasto.checkpoint.trained import load_trained
    from impasto.cli import main

    file = tmp_path / "wan-kohya.safetensors"
    assert main(["export", str(lora_run.run_dir), "--format", "lora-kohya", "--out",
                 str(file), "--dtype", "fp32"]) == 0  # fmt: skip
    lora = load_file(str(file))
    name = "lora_unet_blocks_0_self_attn_q"
    assert {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"} <= set(lora)
    assert (
        "lora_unet_blocks_1_cross_attn_o.alpha" in lora and "lora_unet_blocks_1_ffn_2.alpha" in lora
    )
    assert len(lora) == 2 * 10 * 3 and lora[f"{name}.alpha"].item() == 8.0  # lora.alpha, rank 4
    assert lora[f"{name}.lora_down.weight"].shape == (4, 24)
    loaded, ignored = comfy_patches(lora, comfy_wan_key_map(2))
    assert ignored == set() and len(loaded) == 2 * 10
    assert_patches_merge(loaded, merged)  # so the alpha/rank = 2 scale was applied once
    with safe_open(str(file), "pt") as handle:
        header = handle.metadata()
    assert header["ss_network_module"] == "networks.lora_wan"
    assert header["impasto.lora_alpha_in_weights"] == "false"
    # diffusers' musubi-tuner converter (_convert_musubi_wan_lora_to_diffusers) reads it too
    _, backbone = load_trained(lora_run.last_checkpoint)
    pipe = wan_pipeline(build_tiny(0, TEXT_LENGTH))
    pipe.load_lora_weights(str(file))
    ours, theirs = _sample_both(backbone, pipe)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_kohya_names_refuse_what_is_not_a_blocks_plain_lora():
    from impasto.models.wan.lora import to_kohya

    down, up = torch.ones(2, 3), torch.ones(5, 2)
    keys = to_kohya({"blocks.3.ffn.net.0.proj.lora_A.weight": down,
                     "blocks.3.ffn.net.0.proj.lora_B.weight": up}, 4.0)  # fmt: skip
    assert set(keys) == {
        "lora_unet_blocks_3_ffn_0.lora_down.weight",
        "lora_unet_blocks_3_ffn_0.lora_up.weight",
        "lora_unet_blocks_3_ffn_0.alpha",
    }
    for key in ("proj_out.lora_A.weight", "blocks.0.attn1.to_q.lora_magnitude_vector",
                "blocks.0.norm2.lora_A.weight"):  # fmt: skip
        with pytest.raises(ValueError, match=r"^export: .* is not a plain LoRA weight"):
            to_kohya({key: down}, 4.0)


@pytest.mark.parametrize("fmt", ["lora-diffusers", "lora-comfyui", "lora-kohya"])
def test_lora_exports_refuse_another_part_or_none_in_one_line(clips, tmp_path, fmt):
    from impasto.models.wan.lora import LORA_EXPORTS

    config = build_config(wan_raw(clips, tmp_path / "run"))
    out = tmp_path / ("lora" if fmt == "lora-diffusers" else "lora.safetensors")
    weights = {"blocks.0.attn1.to_q.lora_A.weight": torch.ones(4, 24)}
    cases = [
        ({"transformer": weights, "text_encoder": weights},
         "export: parts.text_encoder takes no adapter in the wan family"),
        ({}, "export: the run trained no transformer adapter (parts.transformer)"),
        ({"transformer": {}}, "export: the run trained no transformer adapter (parts.transformer)"),
    ]  # fmt: skip
    for states, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            LORA_EXPORTS[fmt](config, states, out, torch.float32, {})
    assert not out.exists()


def _sample_grid(model: Path, out: Path) -> np.ndarray:
    from impasto.cli import main

    args = ["sample", str(model), "--prompt", PROMPT, "--frames", "5", "--steps", "2",
            "--size", "32", "--seed", "4", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert sorted(path.suffix for path in out.iterdir()) == [".mp4", ".png", ".webp"]
    with Image.open(next(out.glob("*.png"))) as grid:
        return np.asarray(grid)


def test_sample_frames_writes_clips_from_the_run_and_from_its_merged_folder(
    lora_run, merged, tmp_path
):
    from impasto.data.video.probe import probe_clip

    from_run = _sample_grid(lora_run.run_dir, tmp_path / "run")
    info = probe_clip(next((tmp_path / "run").glob("*.mp4")))
    assert (info.num_frames, info.height, info.width) == (5, 32, 32)
    # the merged diffusers folder opens as a WanPipeline folder and samples the same clip
    from_folder = _sample_grid(merged, tmp_path / "folder")
    assert from_run.shape == from_folder.shape
    assert np.abs(from_run.astype(int) - from_folder.astype(int)).max() <= 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"parts": {"transformer": "lora", "text_encoder": "lora"}},
            "parts.text_encoder: lora, but the wan family trains umT5 frozen only",
        ),
        (
            {"model": {"family": "wan", "preset": "tiny", "wan": {"text_length": 600}}},
            "model.wan.text_length",
        ),
        (
            {"model": {"family": "wan", "preset": "tiny", "wan": {"guidance": 2}}},
            "model.wan.guidance",
        ),
        ({"model": {"family": "wan", "preset": "7b"}}, "unknown preset '7b' of family wan"),
        ({"parts": {"unet": "lora"}}, "the wan family has no part 'unet'"),
    ],
)
def test_config_errors_are_one_line(clips, tmp_path, change, message):
    raw = wan_raw(clips, tmp_path / "run")
    raw.update(change)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        config = build_config(raw)
        check_config(config)
        build_backbone(config)
    assert "\n" not in str(error.value).strip()
