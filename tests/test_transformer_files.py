"""The steps the transformer families share for single files and LoRA exports
(``impasto.models.transformer_single_file``, ``impasto.models.transformer_lora``), held on a
toy family that passes its names, map and wording in: wrapper prefixes, the one-line messages,
the loaded weights, and kohya's stacking of fused layers (exact per-part updates)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from impasto.models.transformer_lora import (
    OriginalLayer,
    TransformerLora,
    check_exported,
    exported_key,
    fold_scale,
    fuse_lora,
    lora_exports,
    to_kohya_layers,
)
from impasto.models.transformer_single_file import (
    TransformerFile,
    count_blocks,
    load_transformer_file,
    read_transformer_file,
    single_file_advice,
    strip_prefixes,
    swap_scale_shift,
)


def _toy_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    source = dict(state)
    out = {f"proj.{end}": swap_scale_shift(source.pop(f"orig.{end}")) for end in ("weight", "bias")}
    if source:
        raise ValueError(f"a tensor the toy does not have: {sorted(source)[0]!r}")
    return out


TOY = TransformerFile(
    setting="model.toy.transformer",
    name="TOY",
    release="TOY.1",
    article="a",
    original_key="orig.weight",
    diffusers_key="proj.weight",
    layouts=("orig ...", "proj ..."),
    folder_parts="vae/",
    from_original=_toy_from_original,
    transformer_only=True,
)


def test_prefixes_come_off_as_the_family_says():
    state = {"model.diffusion_model.a": 1, "model.diffusion_model.b": 2, "vae.c": 3}
    prefixes = ("model.diffusion_model.", "diffusion_model.")
    assert strip_prefixes(state, prefixes, transformer_only=True) == {"a": 1, "b": 2}
    assert strip_prefixes(state, prefixes, transformer_only=False) == {"a": 1, "b": 2, "vae.c": 3}
    nested = {"model.diffusion_model.diffusion_model.a": 1}
    assert strip_prefixes(nested, prefixes, transformer_only=False) == {"a": 1}  # each in turn
    assert strip_prefixes(nested, prefixes, transformer_only=True) == {"diffusion_model.a": 1}
    assert count_blocks({"blocks.0.x": 0, "blocks.4.y": 0, "other.9": 0}, "blocks") == 5


def test_an_original_file_loads_through_the_familys_map(tmp_path):
    linear = nn.Linear(3, 4)
    weight, bias = linear.weight.detach(), linear.bias.detach()
    original = {"orig.weight": swap_scale_shift(weight), "orig.bias": swap_scale_shift(bias)}
    path = tmp_path / "toy.safetensors"
    save_file({f"model.diffusion_model.{k}": v.half() for k, v in original.items()}, str(path))
    state = read_transformer_file(path, TOY)
    assert state["proj.weight"].dtype == torch.float32
    torch.testing.assert_close(state["proj.weight"], weight.half().float(), rtol=0, atol=0)
    target = nn.Module()
    target.proj = nn.Linear(3, 4)
    load_transformer_file(path, target, TOY)
    assert torch.equal(target.proj.bias, bias.half().float())


def test_problems_are_one_line_in_the_familys_words(tmp_path):
    broken, other = tmp_path / "broken.safetensors", tmp_path / "other.safetensors"
    save_file({"orig.weight": torch.zeros(4, 3)}, str(broken))
    save_file({"x.weight": torch.zeros(1)}, str(other))
    with pytest.raises(ValueError) as error:
        read_transformer_file(broken, TOY)
    assert str(error.value) == (
        f"model.toy.transformer {broken}: not a whole TOY transformer in the original layout "
        "(no 'orig.bias'); point it at a TOY.1 transformer file"
    )
    with pytest.raises(ValueError, match=r"neither a TOY transformer's original layout \(orig"):
        read_transformer_file(other, TOY)
    wide = tmp_path / "wide.safetensors"
    save_file({"proj.weight": torch.zeros(4, 5), "proj.bias": torch.zeros(4)}, str(wide))
    target = nn.Module()
    target.proj = nn.Linear(3, 4)
    with pytest.raises(ValueError) as error:
        load_transformer_file(wide, target, TOY)
    assert "('proj.weight' of shape (4, 5), not (4, 3)); use the TOY.1 folder" in str(error.value)
    assert single_file_advice(other, "model.path", TOY, None) == (
        f"model.path {other}: a single file, and not a TOY transformer; set model.path to a "
        "diffusers TOY.1 folder (vae/, transformer/, scheduler/)"
    )
    assert single_file_advice(wide, "model.path", TOY, ("TOY.1-x", "TOY.1-x")) == (
        f"model.path {wide}: a TOY.1-x transformer file, without the VAE and text encoders; set "
        "model.path to a diffusers TOY.1-x folder (vae/) and model.toy.transformer to this file"
    )


def test_fused_layers_stack_into_one_lora_with_each_parts_exact_update():
    """q and the 2×-wide mlp adapted, k not: up·down is each adapted part's B·A in its rows,
    zero in k's; alpha is k times the run's; a swapped layer's up rows swap."""
    generator = torch.Generator().manual_seed(0)
    rank, width, inputs = 2, 4, 5
    members, widths = ("q", "k", "mlp"), (1, 1, 2)
    factors = {
        name: (torch.randn(rank, inputs, generator=generator),
               torch.randn(width * size, rank, generator=generator))
        for name, size in (("q", 1), ("mlp", 2))
    }  # fmt: skip
    state = {f"blocks.0.{name}.lora_{ab}.weight": factors[name]["AB".index(ab)]
             for name in factors for ab in "AB"}  # fmt: skip
    state |= {f"blocks.0.mod.lora_{ab}.weight": factors["q"]["AB".index(ab)] for ab in "AB"}

    def locate(module: str) -> OriginalLayer:
        part = module.split(".", 2)[2]
        if part == "mod":
            return OriginalLayer("blocks.0.mod", part, swapped=True)
        return OriginalLayer("blocks.0.fused", part, members, widths)

    kohya = to_kohya_layers(state, 3.0, locate)
    down = kohya["lora_unet_blocks_0_fused.lora_down.weight"]
    up = kohya["lora_unet_blocks_0_fused.lora_up.weight"]
    assert up.shape == (4 * width, 2 * rank) and down.shape == (2 * rank, inputs)
    update = up @ down
    torch.testing.assert_close(update[:width], factors["q"][1] @ factors["q"][0])
    assert torch.equal(update[width : 2 * width], torch.zeros(width, inputs))
    torch.testing.assert_close(update[2 * width :], factors["mlp"][1] @ factors["mlp"][0])
    assert kohya["lora_unet_blocks_0_fused.alpha"].item() == 6.0
    swapped = kohya["lora_unet_blocks_0_mod.lora_up.weight"]
    assert torch.equal(swapped, torch.cat([factors["q"][1][2:], factors["q"][1][:2]]))
    assert kohya["lora_unet_blocks_0_mod.alpha"].item() == 3.0
    same = fuse_lora({"q": factors["q"]}, ("q", "k"), [width, width])
    assert torch.equal(same[1][width:], torch.zeros(width, rank))


TOY_LORA = TransformerLora(
    family="toy", parts=("transformer", "text_encoder_2"), pipeline="ToyPipeline",
    header=lambda config, metadata: metadata,
)  # fmt: skip


def test_lora_checks_scale_and_names_as_the_family_says():
    """A family without kohya names gets lora-diffusers only; a foreign part and a run with no
    adapter are one line in its words; alpha/rank goes into lora_B only; every CLIP encoder's
    keys get the text_model. level (CLIP-G's too), the transformer's stay as they are."""
    assert set(lora_exports(TOY_LORA)) == {"lora-diffusers"}
    with_kohya = TransformerLora("toy", ("transformer",), "ToyPipeline", TOY_LORA.header,
                                 kohya=lambda config, state, alpha: {})  # fmt: skip
    assert set(lora_exports(with_kohya)) == {"lora-diffusers", "lora-kohya"}
    weights = {"blocks.0.q.lora_A.weight": torch.ones(2, 3)}
    with pytest.raises(
        ValueError, match=r"^export: parts.unet takes no adapter in the toy family$"
    ):
        check_exported({"transformer": weights, "unet": weights}, TOY_LORA)
    message = (r"^export: the run trained no transformer or text_encoder_2 adapter "
               r"\(parts.transformer, parts.text_encoder_2\)$")  # fmt: skip
    for states in ({}, {"transformer": {}}):
        with pytest.raises(ValueError, match=message):
            check_exported(states, TOY_LORA)
    check_exported({"text_encoder_2": weights}, TOY_LORA)  # one part with an adapter is enough

    state = {"q.lora_A.weight": torch.full((2, 3), 3.0), "q.lora_B.weight": torch.ones(4, 2)}
    scaled = fold_scale(state, 0.5)
    assert torch.equal(scaled["q.lora_A.weight"], state["q.lora_A.weight"])
    assert torch.equal(scaled["q.lora_B.weight"], torch.full((4, 2), 0.5))
    layer = "encoder.layers.0.self_attn.q_proj.lora_A.weight"
    assert exported_key("text_encoder", layer) == f"text_model.{layer}"
    assert exported_key("text_encoder_2", layer) == f"text_model.{layer}"
    assert exported_key("text_encoder_2", f"text_model.{layer}") == f"text_model.{layer}"
    assert exported_key("transformer", "blocks.0.q.lora_A.weight") == "blocks.0.q.lora_A.weight"
