"""An SD3.5 LoRA export loads in ComfyUI (issue #33): every tensor of the file maps through
ComfyUI's SD3 LoRA key map (0 ignored), and the weights it patches equal the merged model's.

ComfyUI is not a dependency, so its key map is reimplemented here from Comfy-Org/ComfyUI
``comfy/lora.py`` (``model_lora_keys_unet``: for ``model_base.SD3``, ``transformer.<diffusers
name>`` → the target of ``comfy.utils.mmdit_to_diffusers``; ``model_lora_keys_clip``:
``text_encoder.text_model.encoder.layers.N.<layer>`` → CLIP-L and
``text_encoder_2.text_model.encoder.layers.N.<layer>`` → CLIP-G) and ``comfy/utils.py``
(``mmdit_to_diffusers`` with ``MMDIT_MAP_BASIC`` and ``MMDIT_MAP_BLOCK``: q, k, v of each
attention, attn2 included, are slices of one ``qkv``; the last block's text modulation is
stored (shift, scale), so its patch goes through ``swap_scale_shift``). ComfyUI reads the
architecture from the file as ``detect_unet_config`` does: depth = width / 64. LoRAAdapter.load's
name pairs and calculate_weight's scale (alpha/rank, or 1 without an ``.alpha`` tensor) as in
tests/test_flux_comfyui.py, whose loader this test shares.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import peft
import torch
from safetensors.torch import load_file
from test_flux_comfyui import comfy_load

from impasto.config.schema import LoraConfig
from impasto.models.parts import ADAPTER_NAME, merge_adapters, peft_config
from impasto.models.sd3.backbone import Sd3Backbone
from impasto.models.sd3.components import build_tiny
from impasto.models.sd3.lora import save_sd3_lora

# an original key; a slice (dim, start, size) of one; or one whose patch goes through a function
Target = str | tuple[str, tuple[int, int, int]] | tuple[str, None, Callable]

_BLOCK = {  # MMDIT_MAP_BLOCK, weights only: diffusers name → original name
    "norm1_context.linear.weight": "context_block.adaLN_modulation.1.weight",
    "attn.to_add_out.weight": "context_block.attn.proj.weight",
    "ff_context.net.0.proj.weight": "context_block.mlp.fc1.weight",
    "ff_context.net.2.weight": "context_block.mlp.fc2.weight",
    "attn.norm_added_q.weight": "context_block.attn.ln_q.weight",
    "attn.norm_added_k.weight": "context_block.attn.ln_k.weight",
    "norm1.linear.weight": "x_block.adaLN_modulation.1.weight",
    "attn.to_out.0.weight": "x_block.attn.proj.weight",
    "attn.norm_q.weight": "x_block.attn.ln_q.weight",
    "attn.norm_k.weight": "x_block.attn.ln_k.weight",
    "attn2.to_out.0.weight": "x_block.attn2.proj.weight",
    "attn2.norm_q.weight": "x_block.attn2.ln_q.weight",
    "attn2.norm_k.weight": "x_block.attn2.ln_k.weight",
    "ff.net.0.proj.weight": "x_block.mlp.fc1.weight",
    "ff.net.2.weight": "x_block.mlp.fc2.weight",
}
_QKV = (  # (diffusers attention, its q, k, v names, the original fused layer)
    ("attn", ("to_q", "to_k", "to_v"), "x_block.attn.qkv"),
    ("attn", ("add_q_proj", "add_k_proj", "add_v_proj"), "context_block.attn.qkv"),
    ("attn2", ("to_q", "to_k", "to_v"), "x_block.attn2.qkv"),
)
_CLIP_LAYERS = (
    "mlp.fc1",
    "mlp.fc2",
    "self_attn.k_proj",
    "self_attn.q_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
)  # fmt: skip  (LORA_CLIP_MAP)


def swap_scale_shift(weight: torch.Tensor) -> torch.Tensor:
    """comfy.utils.swap_scale_shift."""
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def mmdit_to_diffusers(depth: int, num_blocks: int) -> dict[str, Target]:
    """comfy.utils.mmdit_to_diffusers({"depth": depth, "num_blocks": num_blocks},
    output_prefix="diffusion_model."), block weights (MMDIT_MAP_BASIC adds no LoRA target)."""
    key_map: dict[str, Target] = {}
    offset = depth * 64
    for i in range(num_blocks):
        source, target = f"transformer_blocks.{i}", f"diffusion_model.joint_blocks.{i}"
        for attention, names, fused in _QKV:
            for n, name in enumerate(names):
                key = f"{source}.{attention}.{name}.weight"
                key_map[key] = (f"{target}.{fused}.weight", (0, n * offset, offset))
        for name, original in _BLOCK.items():
            key_map[f"{source}.{name}"] = f"{target}.{original}"
    last = f"transformer_blocks.{depth - 1}.norm1_context.linear.weight"
    original = f"diffusion_model.joint_blocks.{depth - 1}.context_block.adaLN_modulation.1.weight"
    key_map[last] = (original, None, swap_scale_shift)
    return key_map


def comfy_key_map(backbone: Sd3Backbone) -> dict[str, Target]:
    """LoRA key → target, as model_lora_keys_unet (SD3) + model_lora_keys_clip (clip_l,
    clip_g), for ComfyUI's reading of the transformer (depth = width / 64)."""
    transformer = backbone.components.transformer
    depth = transformer.pos_embed.proj.weight.shape[0] // 64  # detect_unet_config
    key_map = {
        f"transformer.{key[: -len('.weight')]}": target
        for key, target in mmdit_to_diffusers(depth, depth).items()
    }
    for part, name in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        layers = backbone.parts()[part].config.num_hidden_layers
        for b in range(layers):
            for c in _CLIP_LAYERS:
                target = f"{name}.transformer.text_model.encoder.layers.{b}.{c}.weight"
                key_map[f"{part}.text_model.encoder.layers.{b}.{c}"] = target
    return key_map


def original_weights(transformer, clips) -> dict[str, torch.Tensor]:
    """The networks' targeted weights under ComfyUI's names (sliced targets assembled in
    order; functions applied to the weight as ComfyUI's loader does to the whole tensor)."""
    depth = transformer.pos_embed.proj.weight.shape[0] // 64
    state = transformer.state_dict()
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out = {}
    for key, target in mmdit_to_diffusers(depth, depth).items():
        if key not in state:  # the last block has no text output
            continue
        if isinstance(target, str):
            out[target] = state[key]
        elif target[1] is None:
            out[target[0]] = target[2](state[key])
        else:
            pieces.setdefault(target[0], []).append((target[1][1], state[key]))
    for name, slices in pieces.items():
        out[name] = torch.cat([tensor for _, tensor in sorted(slices, key=lambda s: s[0])])
    for name, clip in zip(("clip_l", "clip_g"), clips, strict=True):
        for key, tensor in clip.state_dict().items():
            out[f"{name}.transformer.{key}"] = tensor
    return out


def comfy_apply(weights: dict, patches: dict) -> dict[str, torch.Tensor]:
    """calculate_weight at strength 1 on each (slice of a) target: W + f((alpha/rank or 1)·B·A)."""
    patched = {name: tensor.clone() for name, tensor in weights.items()}
    for target, up, down, alpha in patches.values():
        scale = 1.0 if alpha is None else float(alpha) / down.shape[0]
        function, where = (lambda diff: diff), None
        name = target
        if not isinstance(target, str):
            name, where = target[0], target[1]
            if len(target) > 2:
                function = target[2]
        weight = patched[name] if where is None else patched[name].narrow(*where)
        weight += function(scale * (up.float() @ down.float()))
    return patched


def test_an_sd3_lora_loads_in_comfyui_to_the_merged_weights(tmp_path):
    backbone = Sd3Backbone(build_tiny(0, 16))
    lora = LoraConfig(rank=4, alpha=8, targets="attention_ff_conv")
    generator = torch.Generator().manual_seed(0)
    parts = ("transformer", "text_encoder", "text_encoder_2")
    targets = {part: backbone.adapter_targets(part, lora.targets) for part in parts}
    # the last block's text modulation (stored (shift, scale) by ComfyUI) is a target too
    assert "transformer_blocks.1.norm1_context.linear" in targets["transformer"]
    for part, names in targets.items():
        module = backbone.parts()[part]
        peft.inject_adapter_in_model(peft_config(lora, names), module, ADAPTER_NAME)
        with torch.no_grad():  # trained-looking adapters: lora_B starts at zero
            for name, parameter in module.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    file = save_sd3_lora(backbone, tmp_path / "lora")
    tensors = load_file(str(file))

    base = {part: copy.deepcopy(backbone.parts()[part]) for part in parts}
    for module in base.values():  # the base model: adapters off (dropped)
        for name, child in list(module.named_modules()):
            if isinstance(child, peft.tuners.lora.LoraLayer):
                parent, _, attribute = name.rpartition(".")
                setattr(module.get_submodule(parent), attribute, child.get_base_layer())
    patches, ignored = comfy_load(tensors, comfy_key_map(backbone))
    assert ignored == set()
    adapted = sum(len(names) for names in targets.values())
    assert len(patches) == adapted and len(tensors) == 2 * adapted
    before = original_weights(base["transformer"], (base["text_encoder"], base["text_encoder_2"]))
    patched = comfy_apply(before, patches)

    for part in parts:
        merge_adapters(backbone.parts()[part])
    components = backbone.components
    merged = original_weights(
        components.transformer, (components.text_encoder, components.text_encoder_2)
    )
    assert patched.keys() == merged.keys()
    changed = 0
    for name, weight in merged.items():
        torch.testing.assert_close(patched[name], weight, msg=name, rtol=1e-5, atol=1e-6)
        changed += not torch.equal(weight, before[name])
    assert changed >= adapted // 2  # the LoRA moved the weights it targets (q, k, v share one)
    swapped = "diffusion_model.joint_blocks.1.context_block.adaLN_modulation.1.weight"
    assert not torch.equal(merged[swapped], before[swapped])
