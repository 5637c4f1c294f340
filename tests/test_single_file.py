"""SDXL single-file checkpoints: bit-exact round trips, the full SDXL key map, every refusal."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from impasto.models.io import load_diffusers, save_diffusers
from impasto.models.single_file import (
    build_components,
    configs_of,
    detect_checkpoint,
    load_single_file,
    save_single_file,
    sdxl_base_configs,
    sgm_state_dict,
    unet_module_to_sgm,
)

NETWORKS = ("unet", "vae", "text_encoder", "text_encoder_2")
# Tensors in Stability AI's sd_xl_base_1.0.safetensors: UNet 1680 + VAE 248 + CLIP-L 196 (+ its
# int64 position_ids) + OpenCLIP-G 389 (+ logit_scale) = 2515, the same as the enumeration below.
SDXL_BASE_NUM_TENSORS = 2515


def assert_same_networks(expected, actual) -> None:
    for name in NETWORKS:
        expected_state = getattr(expected, name).state_dict()
        actual_state = getattr(actual, name).state_dict()
        assert actual_state.keys() == expected_state.keys(), name
        for key, tensor in expected_state.items():
            assert torch.equal(actual_state[key], tensor), f"{name}.{key}"


@pytest.fixture(scope="module")
def tiny_file(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("single") / "tiny.safetensors"
    save_single_file(tiny, path, dtype=torch.float32)
    return path


# --- round trips --------------------------------------------------------------------------------


def test_round_trip_is_bit_exact(tiny, tiny_file: Path, tmp_path: Path) -> None:
    loaded = load_single_file(tiny_file)
    assert_same_networks(tiny, loaded)
    assert all(not getattr(loaded, name).training for name in NETWORKS)
    # Second hop: single file -> diffusers folder -> the same weights.
    save_diffusers(loaded, tmp_path / "diffusers")
    assert_same_networks(tiny, load_diffusers(tmp_path / "diffusers"))


def test_ckpt_loads_only_with_allow_pickle_and_equals_safetensors(
    tiny, tiny_file: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "tiny.ckpt"
    torch.save({"state_dict": load_file(tiny_file), "global_step": 7}, ckpt)
    with pytest.raises(ValueError, match="set model.allow_pickle: true") as refused:
        load_single_file(ckpt)
    assert "tiny.ckpt" in str(refused.value) and "\n" not in str(refused.value)
    loaded = load_single_file(ckpt, allow_pickle=True, configs=configs_of(tiny))
    assert_same_networks(load_single_file(tiny_file), loaded)


def test_fp16_export_dtypes_metadata_and_extra_keys(tiny, tmp_path: Path) -> None:
    path = tmp_path / "fp16.safetensors"
    metadata = {"modelspec.title": "tiny", "impasto.step": "12"}
    extra = {"v_pred": torch.tensor([]), "ztsnr": torch.tensor([])}
    save_single_file(tiny, path, dtype=torch.float16, extra_keys=extra, metadata=metadata)
    with safe_open(str(path), framework="pt") as handle:
        stored = {key: handle.get_tensor(key) for key in handle.keys()}
        stored_metadata = handle.metadata()
    floating = {key: t.dtype for key, t in stored.items() if t.is_floating_point()}
    assert set(floating.values()) == {torch.float16}
    position_ids = stored["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"]
    assert position_ids.dtype == torch.int64 and position_ids.tolist() == [list(range(77))]
    assert "v_pred" in stored and "ztsnr" in stored
    assert metadata.items() <= stored_metadata.items()
    loaded = load_single_file(path)  # the extra keys are ignored on load
    expected = tiny.unet.state_dict()["conv_in.weight"].half().float()
    assert torch.equal(loaded.unet.state_dict()["conv_in.weight"], expected)


def test_export_strips_torch_compile_prefix(tiny) -> None:
    compiled = dataclasses.replace(tiny, unet=torch.compile(tiny.unet))
    assert any("_orig_mod." in key for key in compiled.unet.state_dict())
    assert sgm_state_dict(compiled).keys() == sgm_state_dict(tiny).keys()


def test_export_rejects_bad_arguments(tiny, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="safetensors"):
        save_single_file(tiny, tmp_path / "model.ckpt")
    with pytest.raises(ValueError, match="dtype"):
        save_single_file(tiny, tmp_path / "m.safetensors", dtype=torch.float64)
    unet_key = "model.diffusion_model.out.2.bias"
    with pytest.raises(ValueError, match="overwrite"):
        save_single_file(tiny, tmp_path / "m.safetensors", extra_keys={unet_key: torch.zeros(4)})


# --- the full SDXL layout, on the meta device ---------------------------------------------------


def _linear(name: str, out_features: int, in_features: int, bias: bool = True) -> dict:
    shapes = {f"{name}.weight": (out_features, in_features)}
    return shapes | ({f"{name}.bias": (out_features,)} if bias else {})


def _conv(name: str, out_channels: int, in_channels: int, kernel: int) -> dict:
    return {
        f"{name}.weight": (out_channels, in_channels, kernel, kernel),
        f"{name}.bias": (out_channels,),
    }


def _norm(name: str, channels: int) -> dict:
    return {f"{name}.weight": (channels,), f"{name}.bias": (channels,)}


def _sgm_resblock(name: str, in_channels: int, out_channels: int, emb_channels: int) -> dict:
    """sgm.modules.diffusionmodules.openaimodel.ResBlock."""
    shapes = (
        _norm(f"{name}.in_layers.0", in_channels)
        | _conv(f"{name}.in_layers.2", out_channels, in_channels, 3)
        | _linear(f"{name}.emb_layers.1", out_channels, emb_channels)
        | _norm(f"{name}.out_layers.0", out_channels)
        | _conv(f"{name}.out_layers.3", out_channels, out_channels, 3)
    )
    if in_channels != out_channels:
        shapes |= _conv(f"{name}.skip_connection", out_channels, in_channels, 1)
    return shapes


def _sgm_spatial_transformer(name: str, channels: int, depth: int, context_dim: int) -> dict:
    """sgm.modules.attention.SpatialTransformer with use_linear=True and GEGLU feed-forward."""
    shapes = _norm(f"{name}.norm", channels) | _linear(f"{name}.proj_in", channels, channels)
    for index in range(depth):
        block = f"{name}.transformer_blocks.{index}"
        for attn, kv_dim in (("attn1", channels), ("attn2", context_dim)):
            shapes |= _linear(f"{block}.{attn}.to_q", channels, channels, bias=False)
            shapes |= _linear(f"{block}.{attn}.to_k", channels, kv_dim, bias=False)
            shapes |= _linear(f"{block}.{attn}.to_v", channels, kv_dim, bias=False)
            shapes |= _linear(f"{block}.{attn}.to_out.0", channels, channels)
        shapes |= _linear(f"{block}.ff.net.0.proj", 8 * channels, channels)
        shapes |= _linear(f"{block}.ff.net.2", channels, 4 * channels)
        for norm in ("norm1", "norm2", "norm3"):
            shapes |= _norm(f"{block}.{norm}", channels)
    return shapes | _linear(f"{name}.proj_out", channels, channels)


def _sgm_sdxl_unet() -> dict:
    """openaimodel.UNetModel of sd_xl_base.yaml: model_channels 320, channel_mult [1, 2, 4],
    num_res_blocks 2, transformer_depth [0, 2, 10], context_dim 2048, adm_in_channels 2816."""
    channels, depths, context_dim, emb = (320, 640, 1280), (0, 2, 10), 2048, 1280
    shapes = _linear("time_embed.0", emb, 320) | _linear("time_embed.2", emb, emb)
    shapes |= _linear("label_emb.0.0", emb, 2816) | _linear("label_emb.0.2", emb, emb)
    shapes |= _conv("input_blocks.0.0", 320, 4, 3)
    skip_channels, current, index = [320], 320, 1
    for level, (out_channels, depth) in enumerate(zip(channels, depths, strict=True)):
        for _ in range(2):
            shapes |= _sgm_resblock(f"input_blocks.{index}.0", current, out_channels, emb)
            if depth:
                name = f"input_blocks.{index}.1"
                shapes |= _sgm_spatial_transformer(name, out_channels, depth, context_dim)
            current = out_channels
            skip_channels.append(current)
            index += 1
        if level < 2:
            shapes |= _conv(f"input_blocks.{index}.0.op", current, current, 3)
            skip_channels.append(current)
            index += 1
    shapes |= _sgm_resblock("middle_block.0", 1280, 1280, emb)
    shapes |= _sgm_spatial_transformer("middle_block.1", 1280, 10, context_dim)
    shapes |= _sgm_resblock("middle_block.2", 1280, 1280, emb)
    index = 0
    for level in (2, 1, 0):
        out_channels, depth = channels[level], depths[level]
        for layer in range(3):
            in_channels = current + skip_channels.pop()
            shapes |= _sgm_resblock(f"output_blocks.{index}.0", in_channels, out_channels, emb)
            current, sub = out_channels, 1
            if depth:
                name = f"output_blocks.{index}.1"
                shapes |= _sgm_spatial_transformer(name, out_channels, depth, context_dim)
                sub = 2
            if level > 0 and layer == 2:
                shapes |= _conv(f"output_blocks.{index}.{sub}.conv", current, current, 3)
            index += 1
    shapes |= _norm("out.0", 320) | _conv("out.2", 4, 320, 3)
    return {f"model.diffusion_model.{key}": shape for key, shape in shapes.items()}


def _ldm_resnet(name: str, in_channels: int, out_channels: int) -> dict:
    shapes = (
        _norm(f"{name}.norm1", in_channels)
        | _conv(f"{name}.conv1", out_channels, in_channels, 3)
        | _norm(f"{name}.norm2", out_channels)
        | _conv(f"{name}.conv2", out_channels, out_channels, 3)
    )
    if in_channels != out_channels:
        shapes |= _conv(f"{name}.nin_shortcut", out_channels, in_channels, 1)
    return shapes


def _ldm_mid(name: str, channels: int) -> dict:
    shapes = _ldm_resnet(f"{name}.block_1", channels, channels)
    shapes |= _norm(f"{name}.attn_1.norm", channels)
    for proj in ("q", "k", "v", "proj_out"):
        shapes |= _conv(f"{name}.attn_1.{proj}", channels, channels, 1)
    return shapes | _ldm_resnet(f"{name}.block_2", channels, channels)


def _ldm_sdxl_vae() -> dict:
    """ldm AutoencoderKL: ch 128, ch_mult [1, 2, 4, 4], num_res_blocks 2, z_channels 4."""
    channels = (128, 256, 512, 512)
    shapes = _conv("encoder.conv_in", 128, 3, 3)
    current = 128
    for level, out_channels in enumerate(channels):
        for block in range(2):
            shapes |= _ldm_resnet(f"encoder.down.{level}.block.{block}", current, out_channels)
            current = out_channels
        if level < 3:
            shapes |= _conv(f"encoder.down.{level}.downsample.conv", current, current, 3)
    shapes |= _ldm_mid("encoder.mid", 512)
    shapes |= _norm("encoder.norm_out", 512) | _conv("encoder.conv_out", 8, 512, 3)
    shapes |= _conv("quant_conv", 8, 8, 1) | _conv("post_quant_conv", 4, 4, 1)
    shapes |= _conv("decoder.conv_in", 512, 4, 3) | _ldm_mid("decoder.mid", 512)
    current = 512
    for level in (3, 2, 1, 0):
        for block in range(3):
            name = f"decoder.up.{level}.block.{block}"
            shapes |= _ldm_resnet(name, current, channels[level])
            current = channels[level]
        if level > 0:
            shapes |= _conv(f"decoder.up.{level}.upsample.conv", current, current, 3)
    shapes |= _norm("decoder.norm_out", 128) | _conv("decoder.conv_out", 3, 128, 3)
    return {f"first_stage_model.{key}": shape for key, shape in shapes.items()}


def _hf_clip_l() -> dict:
    """transformers CLIPTextModel (ViT-L/14 text tower) as SGM's FrozenCLIPEmbedder holds it."""
    prefix = "conditioner.embedders.0.transformer.text_model"
    shapes = {
        f"{prefix}.embeddings.token_embedding.weight": (49408, 768),
        f"{prefix}.embeddings.position_embedding.weight": (77, 768),
        f"{prefix}.embeddings.position_ids": (1, 77),
    }
    for layer in range(12):
        name = f"{prefix}.encoder.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= _linear(f"{name}.self_attn.{proj}", 768, 768)
        shapes |= _norm(f"{name}.layer_norm1", 768) | _norm(f"{name}.layer_norm2", 768)
        shapes |= _linear(f"{name}.mlp.fc1", 3072, 768) | _linear(f"{name}.mlp.fc2", 768, 3072)
    return shapes | _norm(f"{prefix}.final_layer_norm", 768)


def _open_clip_g() -> dict:
    """open_clip ViT-bigG-14 text tower (SGM's FrozenOpenCLIPEmbedder2, visual tower deleted)."""
    width = 1280
    shapes = {
        "token_embedding.weight": (49408, width),
        "positional_embedding": (77, width),
        "text_projection": (width, 1280),
        "logit_scale": (),
    }
    shapes |= _norm("ln_final", width)
    for layer in range(32):
        name = f"transformer.resblocks.{layer}"
        shapes[f"{name}.attn.in_proj_weight"] = (3 * width, width)
        shapes[f"{name}.attn.in_proj_bias"] = (3 * width,)
        shapes |= _linear(f"{name}.attn.out_proj", width, width)
        shapes |= _norm(f"{name}.ln_1", width) | _norm(f"{name}.ln_2", width)
        shapes |= _linear(f"{name}.mlp.c_fc", 4 * width, width)
        shapes |= _linear(f"{name}.mlp.c_proj", width, 4 * width)
    return {f"conditioner.embedders.1.model.{key}": shape for key, shape in shapes.items()}


@pytest.fixture(scope="module")
def sdxl_meta():
    with torch.device("meta"):
        return build_components(sdxl_base_configs())


def test_full_sdxl_export_layout_matches_sgm(sdxl_meta) -> None:
    exported = {key: tuple(t.shape) for key, t in sgm_state_dict(sdxl_meta).items()}
    expected = _sgm_sdxl_unet() | _ldm_sdxl_vae() | _hf_clip_l() | _open_clip_g()
    assert sorted(exported.keys() - expected.keys()) == []
    assert sorted(expected.keys() - exported.keys()) == []
    assert {key: s for key, s in exported.items() if s != expected[key]} == {}
    assert len(exported) == SDXL_BASE_NUM_TENSORS
    assert detect_checkpoint(exported) == "sdxl-base"


def test_unet_module_names_to_sgm(sdxl_meta) -> None:
    config = sdxl_meta.unet.config
    cases = {
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": (
            "input_blocks.4.1.transformer_blocks.0.attn1.to_q"
        ),
        "down_blocks.0.downsamplers.0.conv": "input_blocks.3.0.op",
        "down_blocks.2.resnets.0.conv_shortcut": "input_blocks.7.0.skip_connection",
        "mid_block.resnets.1.conv1.weight": "middle_block.2.in_layers.2.weight",
        "mid_block.attentions.0.proj_in": "middle_block.1.proj_in",
        "up_blocks.0.upsamplers.0.conv": "output_blocks.2.2.conv",
        "up_blocks.1.attentions.2.transformer_blocks.1.attn2.to_k": (
            "output_blocks.5.1.transformer_blocks.1.attn2.to_k"
        ),
        "up_blocks.2.resnets.2.time_emb_proj": "output_blocks.8.0.emb_layers.1",
        "add_embedding.linear_2": "label_emb.0.2",
    }
    assert {name: unet_module_to_sgm(name, config) for name in cases} == cases
    for not_in_sdxl in ("encoder.conv_in", "down_blocks.0.attentions.0.proj_in"):
        with pytest.raises(ValueError, match="not a module"):
            unet_module_to_sgm(not_in_sdxl, config)


def _narrow_sdxl_configs():
    """SDXL base's block structure (depths 0/2/10, 12 + 32 text layers) at small widths."""
    base = sdxl_base_configs()
    text = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    return dataclasses.replace(
        base,
        unet=base.unet
        | {
            "block_out_channels": [32, 64, 128],
            "attention_head_dim": [1, 2, 4],
            "norm_num_groups": 8,
            "cross_attention_dim": 32 + 64,
            "addition_time_embed_dim": 8,
            "projection_class_embeddings_input_dim": 6 * 8 + 48,
        },
        vae=base.vae | {"block_out_channels": [8, 16, 32, 32], "norm_num_groups": 4},
        text_encoder=base.text_encoder | text,
        # A non-square text_projection: [48, 64] in transformers, [64, 48] in open_clip.
        text_encoder_2=base.text_encoder_2
        | text
        | {"hidden_size": 64, "intermediate_size": 128, "projection_dim": 48},
    )


def test_round_trip_with_sdxl_depths(tmp_path: Path) -> None:
    torch.manual_seed(0)
    narrow = build_components(_narrow_sdxl_configs())
    exported = sgm_state_dict(narrow)
    expected = _sgm_sdxl_unet() | _ldm_sdxl_vae() | _hf_clip_l() | _open_clip_g()
    assert exported.keys() == expected.keys()
    assert exported["conditioner.embedders.1.model.text_projection"].shape == (64, 48)
    path = tmp_path / "narrow.safetensors"
    save_single_file(narrow, path, dtype=torch.float32)
    assert_same_networks(narrow, load_single_file(path))


# --- refusals -----------------------------------------------------------------------------------


def _write(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    save_file({key: torch.zeros(shape) for key, shape in shapes.items()}, str(path))
    return path


SYNTHETIC_HEADERS = {
    "sd15.safetensors": (
        {
            "cond_stage_model.transformer.text_model.final_layer_norm.weight": (768,),
            "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (
                320,
                768,
            ),
            "first_stage_model.encoder.conv_in.weight": (128, 3, 3, 3),
        },
        "sd1",
        "Stable Diffusion 1.x",
    ),
    "sd21.safetensors": (
        {
            "cond_stage_model.model.ln_final.weight": (1024,),
            "model.diffusion_model.input_blocks.0.0.weight": (320, 4, 3, 3),
        },
        "sd2",
        "Stable Diffusion 2.x",
    ),
    "sd2-unet-only.safetensors": (
        {
            "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (
                320,
                1024,
            )
        },
        "sd2",
        "Stable Diffusion 2.x",
    ),
    "refiner.safetensors": (
        {
            "conditioner.embedders.0.model.ln_final.weight": (1280,),
            "model.diffusion_model.label_emb.0.0.weight": (1536, 2560),
            "first_stage_model.decoder.conv_in.weight": (512, 4, 3, 3),
        },
        "sdxl-refiner",
        "SDXL refiner",
    ),
    "sd3.safetensors": (
        {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": (4, 2)},
        "sd3",
        "Stable Diffusion 3",
    ),
    "flux1.safetensors": (
        {"double_blocks.0.img_attn.norm.key_norm.scale": (128,)},
        "flux",
        "Flux",
    ),
    "vae-only.safetensors": (
        {"encoder.conv_in.weight": (128, 3, 3, 3)},
        "unknown",
        "not a Stable Diffusion checkpoint",
    ),
}


@pytest.mark.parametrize("name", sorted(SYNTHETIC_HEADERS))
def test_other_model_families_are_refused(name: str, tmp_path: Path) -> None:
    shapes, kind, words = SYNTHETIC_HEADERS[name]
    assert detect_checkpoint(shapes) == kind
    with pytest.raises(ValueError, match=words) as refused:
        load_single_file(_write(tmp_path / name, shapes))
    message = str(refused.value)
    assert name in message and "\n" not in message
    if kind != "unknown":
        assert "impasto trains SDXL base" in message


def test_unreadable_files_are_refused(tiny_file: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(tiny_file.read_bytes()[:-1000])
    not_safetensors = tmp_path / "notes.safetensors"
    not_safetensors.write_text("this is not a checkpoint\n")
    cases = {
        truncated: "truncated",
        not_safetensors: "not a safetensors file",
        tmp_path / "absent.safetensors": "does not exist",
        tmp_path: "is a folder, not a file",
        tmp_path / "model.gguf": "unsupported file type",
    }
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    for path, words in cases.items():
        with pytest.raises(ValueError, match=words) as refused:
            load_single_file(path)
        assert str(path) in str(refused.value) and "\n" not in str(refused.value)


def _rewrite(source: Path, target: Path, edit) -> Path:
    with safe_open(str(source), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(source)
    edit(tensors)
    save_file(tensors, str(target), metadata=metadata)
    return target


def test_incomplete_checkpoints_are_refused(tiny_file: Path, tmp_path: Path) -> None:
    def drop_vae(tensors: dict) -> None:
        for key in [k for k in tensors if k.startswith("first_stage_model.")]:
            del tensors[key]

    def drop_clip_g(tensors: dict) -> None:
        for key in [k for k in tensors if k.startswith("conditioner.embedders.1.")]:
            del tensors[key]

    unet_key = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight"

    def drop_tensor(tensors: dict) -> None:
        del tensors[unet_key]

    def reshape_tensor(tensors: dict) -> None:
        tensors[unet_key] = torch.zeros(3, 3)

    cases = {
        "no-vae": (drop_vae, "has no VAE"),
        "no-clip-g": (drop_clip_g, "has no text encoder 2"),
        "missing": (drop_tensor, f"missing tensor {unet_key}"),
        "reshaped": (reshape_tensor, rf"tensor {unet_key} has shape \[3, 3\]"),
    }
    for name, (edit, words) in cases.items():
        path = _rewrite(tiny_file, tmp_path / f"{name}.safetensors", edit)
        with pytest.raises(ValueError, match=words) as refused:
            load_single_file(path)
        assert path.name in str(refused.value) and "\n" not in str(refused.value)


def test_sdxl_shaped_file_without_metadata_is_checked_against_sdxl(
    tiny_file: Path, tmp_path: Path
) -> None:
    # A tiny file stripped of impasto's metadata is taken for SDXL base and fails the shape check.
    stripped = tmp_path / "no-metadata.safetensors"
    save_file(load_file(tiny_file), str(stripped))
    with pytest.raises(ValueError, match="not an SDXL base checkpoint"):
        load_single_file(stripped)
