"""SD3.5 through impasto's command line (issue #33), on the tiny preset: ``impasto sample`` and
the validation grid equal ``StableDiffusion3Pipeline`` (SD3's own ladder, shift 3 from its
scheduler config, through the backbone's sampling hook); ``impasto export --format
lora-diffusers | lora-kohya`` writes files that ``StableDiffusion3Pipeline.load_lora_weights``
and ComfyUI's key maps load to the trained model; an exported folder, and one without impasto's
record (as downloaded), samples as ``StableDiffusion3Pipeline.from_pretrained`` does; an SD3
file is recognised, Large or Medium, with one line saying what else it needs (docs/sd3.md)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_flux_comfyui import comfy_load
from test_sd3_comfyui import comfy_apply, comfy_key_map, original_weights

from impasto.cli import main
from impasto.config import build_config
from impasto.config.schema import LoraConfig
from impasto.models.parts import ADAPTER_NAME, merge_adapters, peft_config
from impasto.models.sd3.backbone import Sd3Backbone
from impasto.models.sd3.components import build_tiny
from impasto.models.sd3.files import sd3_pipeline
from impasto.models.sd3.lora import to_kohya_sd3
from impasto.models.sd3.single_file import to_original, transformer_variant
from impasto.sampling.flow import flow_timesteps

TEXT_LENGTH = 16
PROMPTS = ["a red circle", "a blue square"]
GUIDANCE = 4.0


@pytest.fixture(scope="module")
def sd3_run(demo_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3 LoRA run (transformer, CLIP-L and CLIP-G, 3 steps) with validation prompts,
    at SD3's shift and loss form."""
    from impasto.train.trainer import train

    out = tmp_path_factory.mktemp("sd3-cli")
    raw = {
        "config_version": 1,
        "model": {"family": "sd3", "preset": "tiny", "sd3": {"text_length": TEXT_LENGTH}},
        "objective": {
            "prediction_type": "flow",
            "timestep_sampling": "logit_normal",
            "flow_shift": 3.0,
            "precondition_outputs": True,
        },  # fmt: skip
        "parts": {"transformer": "lora", "text_encoder": "lora", "text_encoder_2": "lora"},
        "lora": {"rank": 4, "alpha": 8, "targets": "attention_ff_conv"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "train": {"output_dir": str(out / "run"), "seed": 0, "max_steps": 3},
        "checkpoint": {"every_steps": 3, "keep_last": 1},
        "sample": {"prompts": PROMPTS, "num_steps": 3, "guidance_scale": GUIDANCE, "seed": 3},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }
    return train(build_config(raw)).run_dir


def pipe_images(pipe, prompts: list[str], seed: int, **call) -> torch.Tensor:
    """StableDiffusion3Pipeline, row j from seed + j, 3 steps at 64²."""
    call = {"height": 64, "width": 64, "num_inference_steps": 3, **call}
    generators = [torch.Generator().manual_seed(seed + j) for j in range(len(prompts))]
    return pipe(prompts, generator=generators, **call).images


def assert_png_equals(path: Path, image: torch.Tensor) -> None:
    """The PNG is the image ``[3, H, W]`` in [0, 1], rounded (at most one level off)."""
    want = (image.permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.int16)
    got = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
    difference = np.abs(got - want)
    assert difference.max() <= 1 and (difference > 0).mean() < 0.01


def sample_cli(checkpoint: Path, out: Path, *args: str) -> list[str]:
    assert main(["sample", str(checkpoint), "--out", str(out), *args]) == 0
    return sorted(str(p) for p in out.glob("*.png"))


def trained(run: Path):
    from impasto.checkpoint.trained import load_trained

    return load_trained(run)


def test_impasto_sample_and_the_validation_grid_equal_the_sd3_pipeline(sd3_run, tmp_path):
    from impasto.train.validation import (
        prompt_batches,
        sample_batches,
        sample_defaults,
        validation_prompts,
    )

    config, backbone = trained(sd3_run)
    pipe = sd3_pipeline(backbone.components)  # the trained networks, adapters on
    common = {"guidance_scale": GUIDANCE, "max_sequence_length": TEXT_LENGTH}
    theirs = pipe_images(pipe, PROMPTS, 3, output_type="pt", **common)
    defaults = sample_defaults(config)
    batches = prompt_batches(validation_prompts(config.sample), defaults, 1)
    grid = torch.cat(sample_batches(config, backbone, batches))
    torch.testing.assert_close(grid, theirs, rtol=1e-4, atol=1e-4)

    written = [Path(p) for p in sample_cli(sd3_run, tmp_path / "out")]
    for path, image in zip(written, theirs, strict=True):
        assert_png_equals(path, image)
    text = Image.open(written[0]).text["parameters"]
    assert f"CFG scale: {GUIDANCE}," in text  # classifier-free guidance, not an embedded one

    # the ladder is the scheduler's shift-3 ladder (FlowMatchEulerDiscreteScheduler: n times
    # evenly spaced from 1 to the shifted 1/T, each shifted by 3), not the generic unshifted one
    def shift(sigma):
        return 3 * sigma / (1 + 2 * sigma)

    timesteps, _ = backbone.sampling_ladder(3, 64, 64)
    want = shift(torch.linspace(1.0, shift(torch.tensor(1e-3)).item(), 3)) * 1000
    torch.testing.assert_close(timesteps, want)
    assert timesteps[1] == pytest.approx(751.12, abs=0.01)
    assert not torch.allclose(timesteps, flow_timesteps(3, 1.0)[0])


def kohya_key_map(transformer, clips) -> dict[str, str]:
    """ComfyUI's kohya names for SD3 (comfy/lora.py ``model_lora_keys_unet``: ``lora_unet_``
    + every ``diffusion_model.*.weight`` of the model, dots as underscores) and its CLIPs
    (``model_lora_keys_clip``: ``lora_te1_`` CLIP-L, ``lora_te2_`` CLIP-G, SDXL's names)."""
    key_map = {}
    for name in original_weights(transformer, clips):
        key = name.removesuffix(".weight")
        if name.startswith("diffusion_model."):
            key_map["lora_unet_" + key.removeprefix("diffusion_model.").replace(".", "_")] = name
        else:
            clip, _, rest = key.partition(".transformer.")
            prefix = "lora_te1_" if clip == "clip_l" else "lora_te2_"
            key_map[prefix + rest.replace(".", "_")] = name
    return key_map


def test_lora_exports_load_in_the_sd3_pipeline_and_comfyui(sd3_run, tmp_path):
    config, backbone = trained(sd3_run)
    diffusers_dir, kohya_file = tmp_path / "lora", tmp_path / "kohya.safetensors"
    for fmt, out in (("lora-diffusers", diffusers_dir), ("lora-kohya", kohya_file)):
        assert main(["export", str(sd3_run), "--format", fmt, "--out", str(out),
                     "--dtype", "fp32"]) == 0  # fmt: skip
    call = {"output_type": "latent", "max_sequence_length": TEXT_LENGTH, "guidance_scale": 3.0}
    ours = pipe_images(sd3_pipeline(backbone.components), ["a red circle"], 2, **call)
    plain = pipe_images(sd3_pipeline(build_tiny(0, TEXT_LENGTH)), ["a red circle"], 2, **call)
    pipe = sd3_pipeline(build_tiny(0, TEXT_LENGTH))  # diffusers' own loader, the start model
    pipe.load_lora_weights(str(diffusers_dir))
    theirs = pipe_images(pipe, ["a red circle"], 2, **call)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters trained and were loaded

    base = build_tiny(0, TEXT_LENGTH)
    clips = (base.text_encoder, base.text_encoder_2)
    before = original_weights(base.transformer, clips)
    for part in backbone.parts().values():
        merge_adapters(part)
    parts = backbone.components
    merged = original_weights(parts.transformer, (parts.text_encoder, parts.text_encoder_2))
    key_maps = {
        diffusers_dir / "pytorch_lora_weights.safetensors": comfy_key_map(Sd3Backbone(base)),
        kohya_file: kohya_key_map(base.transformer, clips),
    }
    for file, key_map in key_maps.items():
        tensors = load_file(str(file))
        patches, ignored = comfy_load(tensors, key_map)
        assert ignored == set(), file.name
        patched = comfy_apply(before, patches)
        for name, weight in merged.items():
            torch.testing.assert_close(patched[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    kohya = load_file(str(kohya_file))
    # an attention's q, k, v adapters in one LoRA of 3× the rank, alpha 3× the run's
    assert kohya["lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight"].shape[0] == 3 * 4
    assert float(kohya["lora_unet_joint_blocks_0_x_block_attn_qkv.alpha"]) == 3 * 8
    assert "lora_unet_joint_blocks_0_x_block_attn2_qkv.alpha" in kohya  # Medium's attn2
    assert float(kohya["lora_unet_joint_blocks_0_x_block_mlp_fc1.alpha"]) == 8
    assert "lora_unet_joint_blocks_1_context_block_adaLN_modulation_1.alpha" in kohya
    assert "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.alpha" in kohya
    for file in key_maps:  # the header every impasto LoRA export carries, with SD3.5's values
        with safe_open(str(file), "pt") as handle:
            header = handle.metadata()
        assert header["modelspec.architecture"] == "stable-diffusion-3-5-medium/lora"
        assert header["ss_network_module"] == "networks.lora_sd3"
        assert (header["ss_network_dim"], header["ss_network_alpha"]) == ("4", "8.0")
        assert header["impasto.prediction_type"] == "flow"
        assert header["ss_discrete_flow_shift"] == "3.0"


@pytest.mark.parametrize("targets", ["attention", "attention_ff_conv"])
def test_kohya_keys_patch_comfyui_to_the_merged_weights(targets):
    """q, k, v adapters fused per attention (attn2 included); with ``attention_ff_conv`` the
    last block's text modulation, whose rows the original layout stores swapped."""
    backbone = Sd3Backbone(build_tiny(0, TEXT_LENGTH))
    components = backbone.components
    transformer, clips = components.transformer, (components.text_encoder,
                                                  components.text_encoder_2)  # fmt: skip
    before = original_weights(copy.deepcopy(transformer), clips)
    key_map = kohya_key_map(transformer, clips)
    lora = LoraConfig(rank=2, alpha=3, targets=targets)
    names = backbone.adapter_targets("transformer", targets)
    peft.inject_adapter_in_model(peft_config(lora, names), transformer, ADAPTER_NAME)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    state = peft.get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)
    kohya = to_kohya_sd3(state, alpha=3.0, depth=2)
    patches, ignored = comfy_load(kohya, key_map)
    assert ignored == set() and len(kohya) == 3 * len(patches)
    patched = comfy_apply(before, patches)
    merge_adapters(transformer)
    changed = 0
    for name, weight in original_weights(transformer, clips).items():
        torch.testing.assert_close(patched[name], weight, rtol=1e-5, atol=1e-6, msg=name)
        changed += not torch.equal(weight, before[name])
    assert changed == len(patches)
    swapped = "lora_unet_joint_blocks_1_context_block_adaLN_modulation_1.alpha"
    assert (swapped in kohya) == (targets != "attention")


def test_an_exported_and_a_downloaded_folder_sample_as_the_sd3_pipeline(sd3_run, tmp_path):
    folder = tmp_path / "merged"
    args = ["export", str(sd3_run), "--format", "diffusers", "--merge", "--dtype", "fp32"]
    assert main([*args, "--out", str(folder)]) == 0
    options = ("--prompt", "a red circle", "--steps", "3", "--cfg", "3.5", "--seed", "4")
    sample_cli(folder, tmp_path / "out", *options, "--size", "64")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(folder), local_files_only=True)
    (image,) = pipe_images(pipe, ["a red circle"], 4, output_type="pt", guidance_scale=3.5)
    assert_png_equals(next((tmp_path / "out").glob("*.png")), image)
    # a folder downloaded from the hub has no impasto-model.json: its pipeline index says
    (folder / "impasto-model.json").unlink(missing_ok=True)
    sample_cli(folder, tmp_path / "hub", *options, "--size", "64")
    assert_png_equals(next((tmp_path / "hub").glob("*.png")), image)


def test_an_sd3_file_names_its_release_and_what_else_it_needs(tiny_raw, tmp_path, capsys):
    from impasto.models.backbone import build_backbone
    from impasto.models.single_file import detect_checkpoint, load_single_file

    state = build_tiny(0, TEXT_LENGTH).transformer.state_dict()
    large = {k: v for k, v in state.items() if ".attn2." not in k}  # no second attention
    large = {k.replace("transformer_blocks.1.", f"transformer_blocks.{37}."): v
             for k, v in large.items()}  # fmt: skip
    large |= {k.replace("transformer_blocks.0.", f"transformer_blocks.{i}."): v
              for i in range(1, 37) for k, v in large.items()
              if k.startswith("transformer_blocks.0.")}  # fmt: skip
    files = {
        "sd3.5_medium.safetensors": (to_original(state, "model.diffusion_model."), "medium"),
        "diffusers-medium.safetensors": (state, "medium"),
        "sd3.5_large.safetensors": (to_original(large), "large"),
        "diffusers-large.safetensors": (large, "large"),
    }
    release = {"medium": "SD3.5 Medium", "large": "SD3.5 Large"}
    for name, (tensors, variant) in files.items():
        path = tmp_path / name
        save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(path))
        shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
        assert detect_checkpoint(shapes) == "sd3" and transformer_variant(shapes) == variant
        with pytest.raises(ValueError, match=re.escape(f"an {release[variant]} transformer")) as e:
            load_single_file(path)  # as an SDXL checkpoint (model.path, impasto sample FILE)
        assert "model.family: sd3" in str(e.value) and "\n" not in str(e.value)
        capsys.readouterr()
        assert main(["sample", str(path), "--out", str(tmp_path / "out"), "--prompt", "x"]) == 2
        assert f"an {release[variant]} transformer" in capsys.readouterr().err
        raw = {**tiny_raw, "model": {"family": "sd3", "path": str(path)}}
        with pytest.raises(ValueError) as error:  # as an sd3 model.path
            build_backbone(build_config(raw))
        message = str(error.value)
        assert f"an {release[variant]} transformer file, without the VAE and text" in message
        assert "model.sd3.transformer to this file" in message and "\n" not in message
    assert transformer_variant({"double_blocks.0.x": (1,), "img_in.weight": (1,)}) is None


def test_the_sd35_lora_preset_trains_and_exports_as_its_comments_say(tmp_path, monkeypatch):
    """configs/sd35-lora.yaml: its --set lines point it at the user's folder, its objective is
    the script's (shift 3, x0 loss), and its smoke test trains two steps on the tiny model
    (validation grid included), then its export commands run."""
    import json
    import os
    import shutil

    from test_presets import CONFIGS, commented_commands

    from impasto.config import load_config

    name = "sd35-lora.yaml"
    user, smoke = commented_commands(CONFIGS / name)
    (train_args,) = [args for args in user if args[0] == "train"]
    overrides = [train_args[i + 1] for i, arg in enumerate(train_args) if arg == "--set"]
    config = load_config(CONFIGS / name, overrides)
    assert (config.model.family, config.model.path) == (
        "sd3",
        os.path.abspath("models/stable-diffusion-3.5-large"),
    )
    assert (config.lora.rank, config.optim.lr, config.train.mixed_precision) == (16, 1e-4, "bf16")
    assert (config.objective.flow_shift, config.objective.precondition_outputs) == (3.0, True)
    assert config.memory.gradient_checkpointing == "all" and config.data.resolution == 1024

    shutil.copytree(CONFIGS, tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    for args in smoke:
        assert main(args) == 0, args
    state = json.loads(
        (tmp_path / "runs/sd35-lora/checkpoints/step-00000002/state.json").read_text()
    )
    assert state["train"]["step"] == 2
    assert (tmp_path / "runs/sd35-lora/samples/step-00000002.png").is_file()
    for args in user:
        if args[0] == "export":
            assert main(args) == 0, args
    with safe_open("my-sd35-lora.safetensors", "pt") as handle:
        keys = set(handle.keys())
    assert "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight" in keys
    assert Path("my-sd35-lora/pytorch_lora_weights.safetensors").is_file()
