"""LoRA exports that every client reads (issue #17): diffusers and ComfyUI load every tensor of a
``lora-diffusers`` file at the trained strength, and both LoRA formats carry kohya's metadata."""

from __future__ import annotations

import json
import time

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_inputs import tiny_unet_output

from impasto.checkpoint.trained import load_trained
from impasto.config import build_config
from impasto.export import ExportOptions, export_checkpoint
from impasto.models.io import to_pipeline
from impasto.models.parts import merge_adapters
from impasto.models.presets import build_tiny
from impasto.train.trainer import train

PARTS = {"unet": "lora", "text_encoder": "lora", "text_encoder_2": "lora"}


def _run(tiny_raw, tmp_path, name, **sections):
    tiny_raw["train"] = {**tiny_raw["train"], "max_steps": 2, "output_dir": str(tmp_path / name)}
    tiny_raw["checkpoint"]["every_steps"] = 2
    tiny_raw["optim"]["lr"] = 1e-2
    for section, values in sections.items():
        tiny_raw[section] = values
    return train(build_config(tiny_raw)).run_dir


def _merged(run):
    _, trained = load_trained(run)
    for part in PARTS:
        merge_adapters(getattr(trained.components, part))
    return trained.components


def _prompt_embeds(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        embeds = pipe.encode_prompt("a red circle", do_classifier_free_guidance=False)
    return embeds[0], embeds[2]  # per-token and pooled


# --- ComfyUI's LoRA key map, reimplemented ------------------------------------------------------
# From Comfy-Org/ComfyUI comfy/lora.py (model_lora_keys_unet, model_lora_keys_clip, load_lora),
# comfy/utils.py (unet_to_diffusers and its UNET_MAP_* tables) and comfy/weight_adapter/lora.py
# (LoRAAdapter.load: the up/down name pairs; calculate_weight: scale alpha/rank, or 1 without
# an alpha). Targets are kept as (impasto part, diffusers/transformers weight name) so that the
# patches can be applied to the tiny model's own state dicts.

_RESNET = {  # SGM ResBlock name -> diffusers name (UNET_MAP_RESNET, weights only)
    "in_layers.2.weight": "conv1.weight",
    "emb_layers.1.weight": "time_emb_proj.weight",
    "out_layers.3.weight": "conv2.weight",
    "skip_connection.weight": "conv_shortcut.weight",
    "in_layers.0.weight": "norm1.weight",
    "out_layers.0.weight": "norm2.weight",
}
_ATTENTIONS = ("proj_in.weight", "proj_out.weight", "norm.weight")
_TRANSFORMER_BLOCKS = (
    *(f"norm{i}.weight" for i in (1, 2, 3)),
    *(f"attn{a}.to_{p}.weight" for a in (1, 2) for p in ("q", "k", "v", "out.0")),
    "ff.net.0.proj.weight",
    "ff.net.2.weight",
)
_BASIC = {
    "add_embedding.linear_1.weight": "label_emb.0.0.weight",
    "add_embedding.linear_2.weight": "label_emb.0.2.weight",
    "conv_in.weight": "input_blocks.0.0.weight",
    "conv_norm_out.weight": "out.0.weight",
    "conv_out.weight": "out.2.weight",
    "time_embedding.linear_1.weight": "time_embed.0.weight",
    "time_embedding.linear_2.weight": "time_embed.2.weight",
}
_CLIP_LAYERS = {  # LORA_CLIP_MAP
    "mlp.fc1": "mlp_fc1",
    "mlp.fc2": "mlp_fc2",
    "self_attn.k_proj": "self_attn_k_proj",
    "self_attn.q_proj": "self_attn_q_proj",
    "self_attn.v_proj": "self_attn_v_proj",
    "self_attn.out_proj": "self_attn_out_proj",
}
_UP_DOWN = (  # LoRAAdapter.load, in its order
    ("{}.lora_up.weight", "{}.lora_down.weight"),
    ("{}_lora.up.weight", "{}_lora.down.weight"),
    ("{}.lora_B.weight", "{}.lora_A.weight"),
    ("{}.lora.up.weight", "{}.lora.down.weight"),
    ("{}.lora_B", "{}.lora_A"),
    ("{}.lora_linear_layer.up.weight", "{}.lora_linear_layer.down.weight"),
    ("{}.lora_B.default.weight", "{}.lora_A.default.weight"),
)


def _comfy_unet_config(unet_config) -> dict:
    """ComfyUI's unet_config of a diffusers SDXL-style UNet (model detection's fields)."""
    num_blocks = len(unet_config["block_out_channels"])
    layers, depth = unet_config["layers_per_block"], unet_config["transformer_layers_per_block"]
    down = [depth if "CrossAttn" in kind else 0 for kind in unet_config["down_block_types"]]
    up = [depth if "CrossAttn" in kind else 0 for kind in unet_config["up_block_types"]]
    return {
        "num_res_blocks": [layers] * num_blocks,
        "channel_mult": list(range(num_blocks)),
        "transformer_depth": [d for d in down for _ in range(layers)],
        "transformer_depth_output": [d for d in reversed(up) for _ in range(layers + 1)],
        "transformer_depth_middle": depth,
    }


def _unet_to_diffusers(unet_config: dict) -> dict[str, str]:
    """comfy.utils.unet_to_diffusers, weights only: diffusers name -> SGM name."""
    num_res_blocks = unet_config["num_res_blocks"]
    transformer_depth = unet_config["transformer_depth"][:]
    transformer_depth_output = unet_config["transformer_depth_output"][:]
    num_blocks = len(unet_config["channel_mult"])
    mapping = {}
    for x in range(num_blocks):
        n = 1 + (num_res_blocks[x] + 1) * x
        for i in range(num_res_blocks[x]):
            for b, d in _RESNET.items():
                mapping[f"down_blocks.{x}.resnets.{i}.{d}"] = f"input_blocks.{n}.0.{b}"
            num_transformers = transformer_depth.pop(0)
            if num_transformers > 0:
                for b in _ATTENTIONS:
                    mapping[f"down_blocks.{x}.attentions.{i}.{b}"] = f"input_blocks.{n}.1.{b}"
                for t in range(num_transformers):
                    for b in _TRANSFORMER_BLOCKS:
                        mapping[f"down_blocks.{x}.attentions.{i}.transformer_blocks.{t}.{b}"] = (
                            f"input_blocks.{n}.1.transformer_blocks.{t}.{b}"
                        )
            n += 1
        mapping[f"down_blocks.{x}.downsamplers.0.conv.weight"] = f"input_blocks.{n}.0.op.weight"
    for b in _ATTENTIONS:
        mapping[f"mid_block.attentions.0.{b}"] = f"middle_block.1.{b}"
    for t in range(unet_config["transformer_depth_middle"]):
        for b in _TRANSFORMER_BLOCKS:
            mapping[f"mid_block.attentions.0.transformer_blocks.{t}.{b}"] = (
                f"middle_block.1.transformer_blocks.{t}.{b}"
            )
    for i, n in enumerate([0, 2]):
        for b, d in _RESNET.items():
            mapping[f"mid_block.resnets.{i}.{d}"] = f"middle_block.{n}.{b}"
    num_res_blocks = list(reversed(num_res_blocks))
    for x in range(num_blocks):
        n = (num_res_blocks[x] + 1) * x
        length = num_res_blocks[x] + 1
        for i in range(length):
            c = 0
            for b, d in _RESNET.items():
                mapping[f"up_blocks.{x}.resnets.{i}.{d}"] = f"output_blocks.{n}.0.{b}"
            c += 1
            num_transformers = transformer_depth_output.pop()
            if num_transformers > 0:
                c += 1
                for b in _ATTENTIONS:
                    mapping[f"up_blocks.{x}.attentions.{i}.{b}"] = f"output_blocks.{n}.1.{b}"
                for t in range(num_transformers):
                    for b in _TRANSFORMER_BLOCKS:
                        mapping[f"up_blocks.{x}.attentions.{i}.transformer_blocks.{t}.{b}"] = (
                            f"output_blocks.{n}.1.transformer_blocks.{t}.{b}"
                        )
            if i == length - 1:
                mapping[f"up_blocks.{x}.upsamplers.0.conv.weight"] = (
                    f"output_blocks.{n}.{c}.conv.weight"
                )
            n += 1
    mapping.update(_BASIC)
    return mapping


def _comfy_key_map(models) -> dict[str, tuple[str, str]]:
    """LoRA key -> (part, weight name), as model_lora_keys_unet + model_lora_keys_clip for SDXL."""
    key_map = {}
    diffusers_to_sgm = _unet_to_diffusers(_comfy_unet_config(models.unet.config))
    unet_weights = models.unet.state_dict()
    for k, sgm in diffusers_to_sgm.items():
        if k not in unet_weights:  # e.g. conv_shortcut of a block that has none
            continue
        target = ("unet", k)
        key_map[f"lora_unet_{sgm[: -len('.weight')].replace('.', '_')}"] = target
        key_map[f"diffusion_model.{sgm[: -len('.weight')]}"] = target
        key_lora = k[: -len(".weight")].replace(".", "_")
        key_map[f"lora_unet_{key_lora}"] = target
        key_map[f"lycoris_{key_lora}"] = target
        for prefix in ("", "unet."):
            diffusers_lora_key = prefix + k[: -len(".weight")].replace(".to_", ".processor.to_")
            if diffusers_lora_key.endswith(".to_out.0"):
                diffusers_lora_key = diffusers_lora_key[:-2]
            key_map[diffusers_lora_key] = target
    # ComfyUI's SDXL CLIP: clip_l.transformer.text_model.* (CLIP-L), clip_g.… (OpenCLIP-G).
    encoders = (("clip_l", "text_encoder", "te1"), ("clip_g", "text_encoder_2", "te2"))
    for comfy_name, part, _ in encoders:
        for key in getattr(models, part).state_dict():
            name = key if key.startswith("text_model.") else f"text_model.{key}"
            if name.endswith(".weight"):
                comfy_key = f"{comfy_name}.transformer.{name[: -len('.weight')]}"
                key_map[f"text_encoders.{comfy_key}"] = (part, key)
    for _, part, short in encoders:
        module = getattr(models, part)
        flat = not hasattr(module, "text_model")  # transformers 5 flattens CLIPTextModel
        for b in range(module.config.num_hidden_layers):
            for c, kohya in _CLIP_LAYERS.items():
                target = (part, f"{'' if flat else 'text_model.'}encoder.layers.{b}.{c}.weight")
                key_map[f"lora_{short}_text_model_encoder_layers_{b}_{kohya}"] = target
                key_map[f"{part}.text_model.encoder.layers.{b}.{c}"] = target
    return key_map


def _comfy_load(lora: dict, key_map: dict) -> tuple[dict, set[str]]:
    """comfy.lora.load_lora for plain LoRA: the patches by target, and the keys not loaded."""
    patches, loaded = {}, set()
    for x, target in key_map.items():
        alpha = lora.get(f"{x}.alpha")
        if alpha is not None:
            loaded.add(f"{x}.alpha")
        for up, down in _UP_DOWN:
            if up.format(x) in lora:
                patches[target] = (lora[up.format(x)], lora[down.format(x)], alpha)
                loaded |= {up.format(x), down.format(x)}
                break
    return patches, set(lora) - loaded


def _comfy_apply(models, patches: dict) -> dict[tuple[str, str], torch.Tensor]:
    """LoRAAdapter.calculate_weight at strength 1: W + (alpha/rank or 1)·up·down."""
    patched = {}
    for (part, key), (up, down, alpha) in patches.items():
        weight = getattr(models, part).state_dict()[key]
        scale = 1.0 if alpha is None else float(alpha) / down.shape[0]
        delta = (up.flatten(1).float() @ down.flatten(1).float()).reshape(weight.shape)
        patched[(part, key)] = weight + scale * delta
    return patched


# --- the tests ----------------------------------------------------------------------------------


def test_lora_diffusers_loads_at_full_strength_in_diffusers_and_comfyui(tiny_raw, tmp_path):
    lora = {"rank": 4, "alpha": 2.0, "targets": "attention_ff_conv"}  # scale alpha/rank = 0.5
    run = _run(tiny_raw, tmp_path, "lora", parts=PARTS, lora=lora)
    out = export_checkpoint(run, "lora-diffusers", tmp_path / "lora", ExportOptions("fp32"))
    assert out.name == "pytorch_lora_weights.safetensors"
    tensors = load_file(out)
    merged = _merged(run)
    base = build_tiny(0)
    assert not torch.allclose(tiny_unet_output(merged.unet), tiny_unet_output(base.unet))

    # diffusers: a fresh base pipeline + load_lora_weights is the trained model.
    pipe = to_pipeline(build_tiny(0))
    pipe.load_lora_weights(tmp_path / "lora")
    torch.testing.assert_close(tiny_unet_output(pipe.unet), tiny_unet_output(merged.unet))
    for loaded, expected in zip(
        _prompt_embeds(pipe), _prompt_embeds(to_pipeline(merged)), strict=True
    ):
        torch.testing.assert_close(loaded, expected)

    # ComfyUI: every tensor maps (none dropped), and the patched weights are the merged ones.
    patches, dropped = _comfy_load(tensors, _comfy_key_map(base))
    assert dropped == set()
    adapted = {
        part: get_peft_model_state_dict(getattr(load_trained(run)[1].components, part))
        for part in PARTS
    }
    num_layers = sum(key.endswith("lora_A.weight") for s in adapted.values() for key in s)
    assert len(patches) == num_layers == len(tensors) // 2
    assert {part for part, _ in patches} == set(PARTS)
    for (part, key), weight in _comfy_apply(base, patches).items():
        expected = getattr(merged, part).state_dict()[key]
        torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6, msg=f"{part} {key}")


def test_lora_diffusers_holds_dora_for_diffusers(tiny_raw, tmp_path):
    lora = {"kind": "dora", "rank": 4, "alpha": 8.0}
    run = _run(tiny_raw, tmp_path, "dora", parts=PARTS, lora=lora)
    export_checkpoint(run, "lora-diffusers", tmp_path / "dora", ExportOptions("fp32"))
    pipe = to_pipeline(build_tiny(0))
    pipe.load_lora_weights(tmp_path / "dora")
    merged = _merged(run)
    torch.testing.assert_close(tiny_unet_output(pipe.unet), tiny_unet_output(merged.unet))
    for loaded, expected in zip(
        _prompt_embeds(pipe), _prompt_embeds(to_pipeline(merged)), strict=True
    ):
        torch.testing.assert_close(loaded, expected)


TAGS = {"demo": {"red": 5, "circle": 8}, "extra/blue": {"square": 3}}


def _metadata(path) -> dict[str, str]:
    with safe_open(path, framework="pt") as handle:
        return handle.metadata()


@pytest.mark.parametrize("fmt", ["lora-kohya", "lora-diffusers"])
def test_lora_files_carry_kohya_training_metadata(tiny_raw, tmp_path, fmt):
    before = time.time()
    run = _run(tiny_raw, tmp_path, "lora", parts=PARTS, lora={"rank": 4, "alpha": 2.0})
    checkpoint = run / "checkpoints" / "step-00000002"
    dataset = {"images": 48, "steps_per_epoch": 12, "epoch": 3, "tag_frequency": TAGS}
    (checkpoint / "dataset.json").write_text(json.dumps(dataset | {"future_key": [1, 2]}))
    target = tmp_path / ("my-lora.safetensors" if fmt == "lora-kohya" else "my-lora")
    metadata = _metadata(export_checkpoint(run, fmt, target))

    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    assert metadata["ss_v2"] == "False"
    assert metadata["ss_sd_model_name"] == "tiny"
    assert metadata["ss_network_module"] == "networks.lora"
    assert (metadata["ss_network_dim"], metadata["ss_network_alpha"]) == ("4", "2.0")
    assert (metadata["ss_steps"], metadata["ss_max_train_steps"]) == ("2", "2")
    assert (metadata["ss_epoch"], metadata["ss_num_train_images"]) == ("3", "48")
    assert metadata["ss_num_epochs"] == "1"  # ceil(max_steps / steps_per_epoch)
    assert metadata["ss_resolution"] == "(64, 64)"
    assert json.loads(metadata["ss_tag_frequency"]) == TAGS
    assert metadata["ss_learning_rate"] == metadata["ss_unet_lr"] == "0.01"
    assert metadata["ss_text_encoder_lr"] == "0.01"
    assert (metadata["ss_optimizer"], metadata["ss_lr_scheduler"]) == ("adamw", "constant")
    assert metadata["ss_seed"] == "0"
    assert metadata["ss_output_name"] == "my-lora"
    assert before - 5 <= float(metadata["ss_training_started_at"]) <= time.time()
    assert metadata["ss_training_comment"].startswith("trained with impasto")
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert metadata["impasto.prediction_type"] == "epsilon"


def test_metadata_without_dataset_json_leaves_out_what_it_cannot_know(tiny_raw, tmp_path):
    run = _run(tiny_raw, tmp_path, "lora", parts={"unet": "lora"}, lora={"rank": 4})
    (run / "checkpoints" / "step-00000002" / "dataset.json").unlink(missing_ok=True)  # older run
    metadata = _metadata(export_checkpoint(run, "lora-kohya", tmp_path / "lora.safetensors"))
    assert metadata["ss_epoch"] == "0"  # the data position in state.json: no epoch completed
    assert metadata["ss_network_alpha"] == "4.0"  # alpha defaults to the rank
    assert "ss_text_encoder_lr" not in metadata  # no text encoder trained
    for key in ("ss_num_train_images", "ss_tag_frequency", "ss_num_epochs"):
        assert key not in metadata, key
