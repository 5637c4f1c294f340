"""FLUX.1 through impasto's command line (issue #33), on the tiny preset: ``impasto sample`` and
the validation grid equal ``FluxPipeline`` (FLUX's own ladder and guidance embedding, through
the backbone's sampling hooks); ``impasto export --format lora-diffusers | lora-kohya`` writes
files that ``FluxPipeline.load_lora_weights`` and ComfyUI's key map load to the trained model;
an exported folder samples as ``FluxPipeline.from_pretrained`` does; a FLUX file is recognised,
dev or schnell, with one line saying what else it needs (docs/flux.md)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_flux_comfyui import comfy_apply, comfy_key_map, comfy_load, original_weights
from test_flux_single_file import to_original

from impasto.cli import main
from impasto.config import build_config
from impasto.models.flux import layout
from impasto.models.flux.components import build_tiny
from impasto.models.parts import merge_adapters
from impasto.sampling import generate_latents
from impasto.sampling.flow import flow_timesteps

TEXT_LENGTH = 16
PROMPTS = ["a red circle", "a blue square"]
GUIDANCE = 4.0  # the run's sample.guidance_scale: FLUX.1-dev's guidance embedding


@pytest.fixture(scope="module")
def flux_run(demo_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny FLUX LoRA run (transformer and CLIP-L, 3 steps) with validation prompts."""
    from impasto.train.trainer import train

    out = tmp_path_factory.mktemp("flux-cli")
    raw = {
        "config_version": 1,
        "model": {"family": "flux", "preset": "tiny", "flux": {"text_length": TEXT_LENGTH}},
        "objective": {"prediction_type": "flow", "timestep_sampling": "logit_normal"},
        "parts": {"transformer": "lora", "text_encoder": "lora"},
        "lora": {"rank": 4, "alpha": 8, "targets": "attention_ff"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "train": {"output_dir": str(out / "run"), "seed": 0, "max_steps": 3},
        "checkpoint": {"every_steps": 3, "keep_last": 1},
        "sample": {"prompts": PROMPTS, "num_steps": 3, "guidance_scale": GUIDANCE, "seed": 3},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }
    return train(build_config(raw)).run_dir


def pipeline(components) -> FluxPipeline:
    return FluxPipeline(
        scheduler=components.scheduler(), vae=components.vae,
        text_encoder=components.text_encoder, tokenizer=components.tokenizer,
        text_encoder_2=components.text_encoder_2, tokenizer_2=components.tokenizer_2,
        transformer=components.transformer,
    )  # fmt: skip


def pipe_images(pipe: FluxPipeline, prompts: list[str], seed: int, **call) -> torch.Tensor:
    """FluxPipeline's defaults (no true CFG), row j from seed + j, 3 steps at 64²."""
    call = {"height": 64, "width": 64, "num_inference_steps": 3, **call}
    generators = [torch.Generator().manual_seed(seed + j) for j in range(len(prompts))]
    return pipe(prompts, generator=generators, **call).images


def png_pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def assert_png_equals(path: Path, image: torch.Tensor) -> None:
    """The PNG is the image ``[3, H, W]`` in [0, 1], rounded (at most one level off where
    float noise crosses a rounding boundary)."""
    want = (image.permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.int16)
    difference = np.abs(png_pixels(path) - want)
    assert difference.max() <= 1 and (difference > 0).mean() < 0.01


def trained(run: Path):
    from impasto.checkpoint.trained import load_trained

    return load_trained(run)


def test_impasto_sample_and_the_validation_grid_equal_flux_pipeline(flux_run, tmp_path):
    from impasto.train.validation import (
        prompt_batches,
        sample_batches,
        sample_defaults,
        validation_prompts,
    )

    config, backbone = trained(flux_run)
    pipe = pipeline(backbone.components)  # the trained transformer and CLIP-L, adapters on
    common = {"guidance_scale": GUIDANCE, "max_sequence_length": TEXT_LENGTH}
    theirs = pipe_images(pipe, PROMPTS, 3, output_type="pt", **common)

    defaults = sample_defaults(config)
    batches = prompt_batches(validation_prompts(config.sample), defaults, 1)
    grid = torch.cat(sample_batches(config, backbone, batches))
    torch.testing.assert_close(grid, theirs, rtol=1e-4, atol=1e-4)

    # impasto sample RUN: the run's validation prompts, its guidance and seeds
    written = [Path(p) for p in sample_cli(flux_run, tmp_path / "out")]
    assert len(written) == 2
    for path, image in zip(sorted(written), theirs, strict=True):
        assert_png_equals(path, image)
    # --cfg sets the guidance embedding (FluxPipeline's guidance_scale), one forward per step
    sample_cli(flux_run, tmp_path / "cfg", "--prompt", "a green cube", "--cfg", "2", "--seed", "9")
    (image,) = pipe_images(pipe, ["a green cube"], 9, output_type="pt", guidance_scale=2.0,
                           max_sequence_length=TEXT_LENGTH)  # fmt: skip
    written = next((tmp_path / "cfg").glob("*.png"))
    assert_png_equals(written, image)
    assert "CFG scale: 1, Distilled CFG Scale: 2.0," in Image.open(written).text["parameters"]

    # the generic one-shift ladder is not FLUX's: the hook is what made these equal
    timesteps, _ = backbone.sampling_ladder(3, 64, 64)
    assert not torch.allclose(timesteps, flow_timesteps(3, config.objective.flow_shift)[0])


def sample_cli(checkpoint: Path, out: Path, *args: str) -> list[str]:
    """``impasto sample CHECKPOINT --out OUT ARGS``: the PNGs written."""
    assert main(["sample", str(checkpoint), "--out", str(out), *args]) == 0
    return sorted(str(p) for p in out.glob("*.png"))


def kohya_key_map(transformer, clip) -> dict[str, str]:
    """ComfyUI's kohya names for FLUX and CLIP-L (comfy/lora.py): ``model_lora_keys_unet``'s
    ``lora_unet_<name, dots as underscores>`` for every ``diffusion_model.*.weight`` of the
    model, and ``model_lora_keys_clip``'s ``lora_te1_text_model_encoder_layers_N_<layer>``."""
    key_map = {}
    for name in original_weights(transformer, clip):
        if name.startswith("diffusion_model."):
            key = name.removeprefix("diffusion_model.").removesuffix(".weight")
            key_map["lora_unet_" + key.replace(".", "_")] = name
        else:
            key = name.removeprefix("clip_l.transformer.").removesuffix(".weight")
            key_map["lora_te1_" + key.replace(".", "_")] = name
    return key_map


def test_lora_exports_load_in_flux_pipeline_and_comfyui(flux_run, tmp_path):
    config, backbone = trained(flux_run)
    diffusers_dir, kohya_file = tmp_path / "lora", tmp_path / "kohya.safetensors"
    for fmt, out in (("lora-diffusers", diffusers_dir), ("lora-kohya", kohya_file)):
        assert main(["export", str(flux_run), "--format", fmt, "--out", str(out),
                     "--dtype", "fp32"]) == 0  # fmt: skip
    ours = generate_latents(
        backbone, ["a red circle"], num_steps=3, seed=2, guidance_scale=3.5,
        prediction_type="flow", sampler="euler",
    )  # fmt: skip
    call = {"output_type": "latent", "max_sequence_length": TEXT_LENGTH}
    plain = pipe_images(pipeline(build_tiny(0, TEXT_LENGTH)), ["a red circle"], 2, **call)
    pipe = pipeline(build_tiny(0, TEXT_LENGTH))  # diffusers' own loader, the starting model
    pipe.load_lora_weights(str(diffusers_dir))
    theirs = pipe_images(pipe, ["a red circle"], 2, **call)
    torch.testing.assert_close(layout.pack_latents(ours), theirs, rtol=1e-4, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters trained and were loaded
    # diffusers' kohya converter reads the fused q, k, v back into the same updates B·A (its
    # single-block split is FLUX's width, 3072, so the tiny model's linear1 is left out)
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    kohya = {k: v for k, v in load_file(str(kohya_file)).items() if "linear1" not in k}
    converted = _convert_kohya_flux_lora_to_diffusers(kohya)
    exported = load_file(str(diffusers_dir / "pytorch_lora_weights.safetensors"))
    factors = {}  # module → (A, B); CLIP-L comes back in diffusers' older names
    down = re.compile(r"(.+?)(\.lora_A|\.lora_linear_layer\.down|_lora\.down)\.weight")
    for key, tensor in converted.items():
        match = down.fullmatch(key)
        if match is None:  # an up weight
            continue
        up = key.replace("lora_A", "lora_B").replace(".down.", ".up.")
        module = re.sub(r"self_attn\.to_(q|k|v|out)$", r"self_attn.\1_proj", match.group(1))
        factors[module] = (tensor, converted[up])
    assert len(factors) == 12 + 1 + 2 * 6  # a double block's 12, a single's proj_out; CLIP-L's
    for module, (lora_a, lora_b) in factors.items():
        want = exported[f"{module}.lora_B.weight"] @ exported[f"{module}.lora_A.weight"]
        torch.testing.assert_close(lora_b @ lora_a, want, rtol=1e-5, atol=1e-7, msg=module)

    # ComfyUI: every tensor of both files maps, and patches the base to the merged weights
    base = build_tiny(0, TEXT_LENGTH)
    before = original_weights(base.transformer, base.text_encoder)
    for part in backbone.parts().values():
        merge_adapters(part)
    merged = original_weights(backbone.components.transformer, backbone.components.text_encoder)
    key_maps = {
        diffusers_dir / "pytorch_lora_weights.safetensors": comfy_key_map(
            base.transformer, base.text_encoder
        ),
        kohya_file: kohya_key_map(base.transformer, base.text_encoder),
    }
    for file, key_map in key_maps.items():
        tensors = load_file(str(file))
        patches, ignored = comfy_load(tensors, key_map)
        assert ignored == set(), file.name
        patched = comfy_apply(before, patches)
        for name, weight in merged.items():
            torch.testing.assert_close(patched[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    kohya = load_file(str(kohya_file))
    # a double block's q, k, v adapters in one LoRA of 3× the rank, alpha 3× the run's
    assert kohya["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 3 * 4
    assert float(kohya["lora_unet_double_blocks_0_img_attn_qkv.alpha"]) == 3 * 8
    assert float(kohya["lora_unet_double_blocks_0_img_mlp_0.alpha"]) == 8
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha" in kohya

    for file in key_maps:  # the header every impasto LoRA export carries, with FLUX's values
        with safe_open(str(file), "pt") as handle:
            header = handle.metadata()
        assert header["ss_base_model_version"] == "flux1"
        assert header["modelspec.architecture"] == "flux-1-dev/lora"
        assert (header["ss_network_dim"], header["ss_network_alpha"]) == ("4", "8.0")
        assert header["ss_unet_lr"] == repr(config.optim.lr)
        assert header["impasto.prediction_type"] == "flow"
        assert header["ss_guidance_scale"] == "3.5"


def test_an_exported_folder_samples_as_flux_pipeline_from_pretrained(flux_run, tmp_path):
    folder = tmp_path / "merged"
    args = ["export", str(flux_run), "--format", "diffusers", "--merge", "--dtype", "fp32"]
    assert main([*args, "--out", str(folder)]) == 0
    sample_cli(folder, tmp_path / "out", "--prompt", "a red circle", "--steps", "3",
               "--cfg", "3.5", "--seed", "4")  # fmt: skip
    pipe = FluxPipeline.from_pretrained(str(folder), local_files_only=True)
    (image,) = pipe_images(pipe, ["a red circle"], 4, output_type="pt", guidance_scale=3.5)
    assert_png_equals(next((tmp_path / "out").glob("*.png")), image)
    # a folder downloaded from the hub has no impasto-model.json: its FluxPipeline index says
    (folder / "impasto-model.json").unlink()
    sample_cli(folder, tmp_path / "hub", "--prompt", "a red circle", "--steps", "3",
               "--cfg", "3.5", "--seed", "4", "--size", "64")  # fmt: skip
    assert_png_equals(next((tmp_path / "hub").glob("*.png")), image)


def test_a_flux_file_names_its_family_variant_and_what_else_it_needs(tiny_raw, tmp_path, capsys):
    from impasto.models.backbone import build_backbone
    from impasto.models.flux.single_file import transformer_variant
    from impasto.models.single_file import detect_checkpoint, load_single_file

    state = build_tiny(0, TEXT_LENGTH).transformer.state_dict()
    schnell = {k: v for k, v in state.items() if "guidance_embedder" not in k}
    files = {
        "flux1-dev.safetensors": (to_original(state, "model.diffusion_model."), "dev"),
        "flux1-schnell.safetensors": (to_original(schnell), "schnell"),
        "diffusers-dev.safetensors": (state, "dev"),
        "diffusers-schnell.safetensors": (schnell, "schnell"),
    }
    for name, (tensors, variant) in files.items():
        path = tmp_path / name
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
        assert detect_checkpoint(shapes) == "flux" and transformer_variant(shapes) == variant
        # as an SDXL checkpoint (model.path, impasto sample FILE): the family and the fix
        with pytest.raises(ValueError, match=re.escape(f"a FLUX.1-{variant} transformer")) as e:
            load_single_file(path)
        assert "model.family: flux" in str(e.value) and "\n" not in str(e.value)
        capsys.readouterr()
        assert main(["sample", str(path), "--out", str(tmp_path / "out"), "--prompt", "x"]) == 2
        assert f"a FLUX.1-{variant} transformer" in capsys.readouterr().err
        # as a flux model.path: what else the family needs, and where the file goes
        raw = {**tiny_raw, "model": {"family": "flux", "path": str(path)}}
        with pytest.raises(ValueError) as error:
            build_backbone(build_config(raw))
        message = str(error.value)
        assert f"a FLUX.1-{variant} transformer file, without the VAE and text encoders" in message
        assert "model.flux.transformer to this file" in message and "\n" not in message
    assert transformer_variant({"model.diffusion_model.joint_blocks.0.x": (1,)}) is None
    # a schnell file into the (dev) tiny preset's transformer: the variants, named
    schnell_file = str(tmp_path / "flux1-schnell.safetensors")
    model = {"family": "flux", "preset": "tiny", "flux": {"transformer": schnell_file}}
    raw = {**tiny_raw, "model": model}
    with pytest.raises(ValueError, match="a FLUX.1-schnell transformer, but model.path / model"):
        build_backbone(build_config(raw))


def test_the_flux_lora_preset_trains_and_exports_as_its_comments_say(tmp_path, monkeypatch):
    """configs/flux-lora.yaml: its --set lines point it at the user's folder, and its smoke
    test trains two steps on the tiny model (validation grid included), then its export
    commands run."""
    import json
    import os
    import shutil

    from test_presets import CONFIGS, commented_commands

    from impasto.config import load_config

    name = "flux-lora.yaml"
    user, smoke = commented_commands(CONFIGS / name)
    (train_args,) = [args for args in user if args[0] == "train"]
    overrides = [train_args[i + 1] for i, arg in enumerate(train_args) if arg == "--set"]
    config = load_config(CONFIGS / name, overrides)
    assert (config.model.family, config.model.path) == (
        "flux",
        os.path.abspath("models/FLUX.1-dev"),
    )
    assert (config.lora.rank, config.optim.lr, config.train.mixed_precision) == (16, 1e-4, "bf16")
    assert config.model.options["guidance"] == 1.0 and config.sample.guidance_scale == 3.5

    shutil.copytree(CONFIGS, tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    for args in smoke:
        assert main(args) == 0, args
    state = json.loads(
        (tmp_path / "runs/flux-lora/checkpoints/step-00000002/state.json").read_text()
    )
    assert state["train"]["step"] == 2
    assert (tmp_path / "runs/flux-lora/samples/step-00000002.png").is_file()
    for args in user:
        if args[0] == "export":
            assert main(args) == 0, args
    with safe_open("my-flux-lora.safetensors", "pt") as handle:
        keys = set(handle.keys())
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in keys
    assert Path("my-flux-lora/pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("targets", ["attention", "attention_ff_conv"])
def test_kohya_keys_of_every_target_preset_patch_comfyui_to_the_merged_weights(targets):
    """``attention``: a single block's linear1 holds q, k, v adapters and none for its MLP
    input (zero rows); ``attention_ff_conv``: the modulation layers too."""
    import copy

    import peft

    from impasto.config.schema import LoraConfig
    from impasto.models.flux.backbone import FluxBackbone
    from impasto.models.flux.lora import to_kohya_flux
    from impasto.models.parts import ADAPTER_NAME, peft_config

    backbone = FluxBackbone(build_tiny(0, TEXT_LENGTH))
    transformer, clip = backbone.components.transformer, backbone.components.text_encoder
    before = original_weights(copy.deepcopy(transformer), clip)
    key_map = kohya_key_map(transformer, clip)  # the model's names, before adapters wrap them
    lora = LoraConfig(rank=2, alpha=3, targets=targets)
    names = backbone.adapter_targets("transformer", targets)
    peft.inject_adapter_in_model(peft_config(lora, names), transformer, ADAPTER_NAME)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    state = peft.get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)
    kohya = to_kohya_flux(state, alpha=3.0)
    patches, ignored = comfy_load(kohya, key_map)
    assert ignored == set()
    patched = comfy_apply(before, patches)
    merge_adapters(transformer)
    for name, weight in original_weights(transformer, clip).items():
        torch.testing.assert_close(patched[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    up = kohya["lora_unet_single_blocks_0_linear1.lora_up.weight"]
    assert up.shape == (7 * 32, 2 * (3 if targets == "attention" else 4))
    assert ("lora_unet_double_blocks_0_img_mod_lin.alpha" in kohya) == (targets != "attention")
