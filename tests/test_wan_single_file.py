"""``model.wan.transformer`` (issue #33): a Wan 2.1 transformer file in the original layout
(Wan-AI's / ComfyUI's names, with or without ComfyUI's ``model.diffusion_model.`` prefix,
fp16 as released) loads to the same weights as the diffusers folder; a file of another size is
one line (docs/wan.md)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.wan.components import build_tiny

TEXT_LENGTH = 16

# diffusers' WanTransformer3DModel names → Wan-AI's wan/modules/model.py names (ComfyUI's
# comfy/ldm/wan/model.py keeps them), written from Wan's module tree: the cross-attention norm
# is Wan's norm3 and diffusers' norm2
TOP = {
    "scale_shift_table": "head.modulation", "proj_out": "head.head",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "patch_embedding": "patch_embedding",
}  # fmt: skip
BLOCK = {
    "scale_shift_table": "modulation", "norm2": "norm3", "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
    **{f"attn{n}.{ours}": f"{attn}.{theirs}" for n, attn in ((1, "self_attn"), (2, "cross_attn"))
       for ours, theirs in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"),
                            ("norm_q", "norm_q"), ("norm_k", "norm_k"))},
}  # fmt: skip


def original_name(key: str) -> str:
    module, _, leaf = key.rpartition(".")
    if key == "scale_shift_table":
        return TOP[key]
    if key.startswith("blocks."):
        _, index, rest = key.split(".", 2)
        if rest == "scale_shift_table":
            return f"blocks.{index}.modulation"
        module = rest.rpartition(".")[0]
        return f"blocks.{index}.{BLOCK[module]}.{leaf}"
    return f"{TOP[module]}.{leaf}"


def model_raw(tiny_raw: dict, transformer: str) -> dict:
    options = {"text_length": TEXT_LENGTH, "transformer": transformer}
    tiny_raw["model"] = {"family": "wan", "preset": "tiny", "wan": options}
    tiny_raw["objective"] = {"prediction_type": "flow"}
    return tiny_raw


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_an_original_layout_file_loads_to_the_same_weights(tiny_raw, tmp_path, prefix):
    source = build_tiny(7, TEXT_LENGTH).transformer.state_dict()  # another seed than the preset
    original = {prefix + original_name(key): tensor.half() for key, tensor in source.items()}
    assert "blocks.0.self_attn.q.weight" in {key[len(prefix) :] for key in original}
    file = tmp_path / "wan2.1_t2v_tiny_fp16.safetensors"
    save_file(original, str(file))
    loaded = build_backbone(build_config(model_raw(tiny_raw, str(file)))).denoiser().state_dict()
    assert loaded.keys() == source.keys()
    for key, tensor in source.items():
        torch.testing.assert_close(loaded[key], tensor.half().float(), rtol=0, atol=0, msg=key)
    # diffusers' names load as they are
    save_file(source, str(tmp_path / "diffusers.safetensors"))
    raw = model_raw(tiny_raw, str(tmp_path / "diffusers.safetensors"))
    again = build_backbone(build_config(raw)).denoiser().state_dict()
    assert all(torch.equal(again[key], source[key]) for key in source)


def test_a_file_of_another_model_is_one_line(tiny_raw, tmp_path):
    source = build_tiny(0, TEXT_LENGTH).transformer.state_dict()
    wider = {original_name(k): torch.zeros(2, *t.shape[1:]) if k == "proj_out.weight" else t
             for k, t in source.items()}  # fmt: skip
    save_file(wider, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"proj_out.weight has shape \(2, 24\), the model's is"):
        build_backbone(build_config(model_raw(tiny_raw, str(tmp_path / "other.safetensors"))))
    fewer = {original_name(k): t for k, t in source.items() if not k.startswith("blocks.1.")}
    save_file(fewer, str(tmp_path / "fewer.safetensors"))
    with pytest.raises(ValueError, match=re.escape("tensors missing (e.g. blocks.1.")) as error:
        build_backbone(build_config(model_raw(tiny_raw, str(tmp_path / "fewer.safetensors"))))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"model.wan.transformer"):
        build_backbone(build_config(model_raw(tiny_raw, str(tmp_path / "none.safetensors"))))


def test_a_file_loads_into_a_transformer_built_on_the_meta_device(tmp_path):
    """The files-only build: the preset's architecture on the meta device takes the file's
    tensors (assigned, float32, nothing allocated before), and runs as the source does."""
    from impasto.models.single_file.load import parameters_on_meta
    from impasto.models.wan.components import TINY_TEXT_WIDTH
    from impasto.models.wan.single_file import load_transformer_file

    source = build_tiny(7, TEXT_LENGTH).transformer
    file = tmp_path / "wan2.1_t2v_tiny_fp16.safetensors"
    save_file({original_name(k): t.half() for k, t in source.state_dict().items()}, str(file))
    with parameters_on_meta():
        transformer = build_tiny(0, TEXT_LENGTH).transformer
    assert all(param.is_meta for param in transformer.parameters())
    load_transformer_file(file, transformer)
    assert [name for name, param in transformer.named_parameters() if param.is_meta] == []
    assert all(t.device.type == "cpu" for t in [*transformer.parameters(), *transformer.buffers()])
    loaded = transformer.state_dict()
    assert loaded.keys() == source.state_dict().keys()
    for key, tensor in source.state_dict().items():
        assert loaded[key].dtype == torch.float32, key
        torch.testing.assert_close(loaded[key], tensor.half().float(), rtol=0, atol=0, msg=key)
    assert all(param.requires_grad for param in transformer.parameters())
    source.load_state_dict({key: tensor.half().float() for key, tensor in loaded.items()})
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 2, 4, 4, generator=generator)
    text = torch.randn(1, TEXT_LENGTH, TINY_TEXT_WIDTH, generator=generator)
    inputs = {"hidden_states": latents, "timestep": torch.tensor([500]),
              "encoder_hidden_states": text, "return_dict": False}  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(transformer(**inputs)[0], source(**inputs)[0], rtol=0, atol=0)
