"""A FLUX LoRA export loads in ComfyUI (issue #33): every tensor of the file maps through
ComfyUI's FLUX LoRA key map (0 ignored), and the weights it patches equal the merged model's.

ComfyUI is not a dependency, so its key map is reimplemented here from Comfy-Org/ComfyUI
``comfy/lora.py`` (``model_lora_keys_unet``: for ``model_base.Flux``, ``transformer.<diffusers
name>`` → the target of ``comfy.utils.flux_to_diffusers``; ``model_lora_keys_clip``:
``text_encoder.text_model.encoder.layers.N.<layer>`` → CLIP-L) and ``comfy/utils.py``
(``flux_to_diffusers``: q, k, v of a double block are slices of ``img_attn.qkv`` /
``txt_attn.qkv``; a single block's q, k, v and ``proj_mlp`` are slices of ``linear1``).
LoRAAdapter.load's name pairs and calculate_weight's scale (alpha/rank, or 1 without an
``.alpha`` tensor) as in tests/test_export_lora.py.
"""

from __future__ import annotations

import copy

import peft
import torch
from safetensors.torch import load_file

from impasto.config.schema import LoraConfig
from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.components import build_tiny
from impasto.models.flux.lora import save_flux_lora
from impasto.models.parts import ADAPTER_NAME, merge_adapters, peft_config

Target = str | tuple[str, tuple[int, int, int]]  # an original key, or a slice (dim, start, size)

_DOUBLE = {  # flux_to_diffusers' block_map of a double block, weights only
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "norm1.linear.weight": "img_mod.lin.weight",
    "norm1_context.linear.weight": "txt_mod.lin.weight",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "ff.net.0.proj.weight": "img_mlp.0.weight",
    "ff.net.2.weight": "img_mlp.2.weight",
    "ff_context.net.0.proj.weight": "txt_mlp.0.weight",
    "ff_context.net.2.weight": "txt_mlp.2.weight",
}
_SINGLE = {"norm.linear.weight": "modulation.lin.weight", "proj_out.weight": "linear2.weight"}
_CLIP_LAYERS = (
    "mlp.fc1",
    "mlp.fc2",
    "self_attn.k_proj",
    "self_attn.q_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
)  # fmt: skip  (LORA_CLIP_MAP)
_UP_DOWN = (  # LoRAAdapter.load, in its order
    ("{}.lora_up.weight", "{}.lora_down.weight"),
    ("{}_lora.up.weight", "{}_lora.down.weight"),
    ("{}.lora_B.weight", "{}.lora_A.weight"),
    ("{}.lora.up.weight", "{}.lora.down.weight"),
    ("{}.lora_B", "{}.lora_A"),
)


def flux_to_diffusers(depth: int, depth_single: int, hidden: int) -> dict[str, Target]:
    """comfy.utils.flux_to_diffusers(…, output_prefix="diffusion_model."), block weights."""
    key_map: dict[str, Target] = {}
    for index in range(depth):
        source, target = f"transformer_blocks.{index}", f"diffusion_model.double_blocks.{index}"
        for stream, names in (("img", ("to_q", "to_k", "to_v")),
                              ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):  # fmt: skip
            for n, name in enumerate(names):
                qkv = f"{target}.{stream}_attn.qkv.weight"
                key_map[f"{source}.attn.{name}.weight"] = (qkv, (0, n * hidden, hidden))
        for name, original in _DOUBLE.items():
            key_map[f"{source}.{name}"] = f"{target}.{original}"
    for index in range(depth_single):
        source = f"single_transformer_blocks.{index}"
        target = f"diffusion_model.single_blocks.{index}"
        linear1 = f"{target}.linear1.weight"
        for n, name in enumerate(("to_q", "to_k", "to_v")):
            key_map[f"{source}.attn.{name}.weight"] = (linear1, (0, n * hidden, hidden))
        key_map[f"{source}.proj_mlp.weight"] = (linear1, (0, 3 * hidden, 4 * hidden))
        for name, original in _SINGLE.items():
            key_map[f"{source}.{name}"] = f"{target}.{original}"
    return key_map


def comfy_key_map(transformer, clip) -> dict[str, Target]:
    """LoRA key → target, as model_lora_keys_unet (Flux) + model_lora_keys_clip (clip_l)."""
    config = transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    flux_map = flux_to_diffusers(config.num_layers, config.num_single_layers, hidden)
    key_map = {f"transformer.{k[: -len('.weight')]}": t for k, t in flux_map.items()}
    for b in range(clip.config.num_hidden_layers):
        for c in _CLIP_LAYERS:
            target = f"clip_l.transformer.text_model.encoder.layers.{b}.{c}.weight"
            key_map[f"text_encoder.text_model.encoder.layers.{b}.{c}"] = target
    return key_map


def original_weights(transformer, clip) -> dict[str, torch.Tensor]:
    """The networks' weights under ComfyUI's names (sliced targets assembled in order)."""
    config = transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    state = transformer.state_dict()
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out = {}
    for key, target in flux_to_diffusers(config.num_layers, config.num_single_layers,
                                         hidden).items():  # fmt: skip
        if isinstance(target, str):
            out[target] = state[key]
        else:
            pieces.setdefault(target[0], []).append((target[1][1], state[key]))
    for name, slices in pieces.items():
        out[name] = torch.cat([tensor for _, tensor in sorted(slices, key=lambda s: s[0])])
    for key, tensor in clip.state_dict().items():
        out[f"clip_l.transformer.text_model.{key}"] = tensor
    return out


def comfy_load(lora: dict, key_map: dict) -> tuple[dict, set[str]]:
    """comfy.lora.load_lora for plain LoRA: patches by target, and the keys not loaded."""
    patches, loaded = {}, set()
    for x, target in key_map.items():
        alpha = lora.get(f"{x}.alpha")
        if alpha is not None:
            loaded.add(f"{x}.alpha")
        for up, down in _UP_DOWN:
            if up.format(x) in lora:
                patches[x] = (target, lora[up.format(x)], lora[down.format(x)], alpha)
                loaded |= {up.format(x), down.format(x)}
                break
    return patches, set(lora) - loaded


def comfy_apply(weights: dict, patches: dict) -> dict[str, torch.Tensor]:
    """calculate_weight at strength 1 on each (slice of a) target: W + (alpha/rank or 1)·B·A."""
    patched = {name: tensor.clone() for name, tensor in weights.items()}
    for target, up, down, alpha in patches.values():
        scale = 1.0 if alpha is None else float(alpha) / down.shape[0]
        name, where = (target, None) if isinstance(target, str) else target
        weight = patched[name] if where is None else patched[name].narrow(*where)
        weight += scale * (up.float() @ down.float())
    return patched


def test_a_flux_lora_loads_in_comfyui_to_the_merged_weights(tmp_path):
    backbone = FluxBackbone(build_tiny(0, 16))
    lora = LoraConfig(rank=4, alpha=8, targets="attention_ff_conv")
    generator = torch.Generator().manual_seed(0)
    targets = {part: backbone.adapter_targets(part, lora.targets)
               for part in ("transformer", "text_encoder")}  # fmt: skip
    for part, names in targets.items():
        module = backbone.parts()[part]
        peft.inject_adapter_in_model(peft_config(lora, names), module, ADAPTER_NAME)
        with torch.no_grad():  # trained-looking adapters: lora_B starts at zero
            for name, parameter in module.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    file = save_flux_lora(backbone, tmp_path / "lora")
    tensors = load_file(str(file))
    transformer, clip = backbone.components.transformer, backbone.components.text_encoder

    base = {part: copy.deepcopy(backbone.parts()[part]) for part in ("transformer", "text_encoder")}
    for module in base.values():  # the base model: adapters off (dropped)
        for name, child in list(module.named_modules()):
            if isinstance(child, peft.tuners.lora.LoraLayer):
                parent, _, attribute = name.rpartition(".")
                setattr(module.get_submodule(parent), attribute, child.get_base_layer())
    patches, ignored = comfy_load(tensors, comfy_key_map(transformer, clip))
    assert ignored == set()
    adapted = sum(len(names) for names in targets.values())
    assert len(patches) == adapted and len(tensors) == 2 * adapted
    before = original_weights(base["transformer"], base["text_encoder"])
    patched = comfy_apply(before, patches)

    for module in (transformer, clip):
        merge_adapters(module)
    merged = original_weights(transformer, clip)
    assert patched.keys() == merged.keys()
    changed = 0
    for name, weight in merged.items():
        torch.testing.assert_close(patched[name], weight, msg=name, rtol=1e-5, atol=1e-6)
        changed += not torch.equal(weight, before[name])
    assert changed >= adapted // 2  # the LoRA moved the weights it targets (q, k, v share one)
