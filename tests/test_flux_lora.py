"""The FLUX family through impasto's trainer (issue #33): a LoRA run on the tiny preset, its
adapters on the layers diffusers' FLUX script targets, exported in diffusers' LoRA layout and
loaded by ``FluxPipeline.load_lora_weights`` to the same samples as impasto's sampler; and the
family's config errors (docs/flux.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from safetensors import safe_open

from impasto.config import build_config
from impasto.export import ExportOptions, export_checkpoint
from impasto.models.backbone import build_backbone
from impasto.models.flux import layout
from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.components import build_tiny
from impasto.models.flux.lora import save_flux_lora
from impasto.models.flux.sampling import generate_flux_latents
from impasto.train.checks import check_config

TEXT_LENGTH = 16

# diffusers' train_dreambooth_lora_flux.py default --lora_layers (peft matches them in every
# block that has them: the single blocks' attn.to_q/k/v too)
DIFFUSERS_SCRIPT_LAYERS = {
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
    "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
    "ff_context.net.0.proj", "ff_context.net.2",
}  # fmt: skip


def flux_raw(tiny_raw: dict, **changes) -> dict:
    tiny_raw["model"] = {"family": "flux", "preset": "tiny", "flux": {"text_length": TEXT_LENGTH}}
    tiny_raw["objective"] = {"prediction_type": "flow", "timestep_sampling": "logit_normal"}
    tiny_raw["data"]["batch_size"] = 2
    tiny_raw["optim"]["lr"] = 1e-2
    tiny_raw["train"]["max_steps"] = 3
    tiny_raw["checkpoint"]["every_steps"] = 3
    tiny_raw.update(changes)
    return tiny_raw


def test_lora_targets_are_the_diffusers_scripts_layers_and_the_single_blocks_mlp():
    backbone = FluxBackbone(build_tiny(0, TEXT_LENGTH))
    targets = backbone.adapter_targets("transformer", "attention_ff")
    script = [name for name, module in backbone.denoiser().named_modules()
              if isinstance(module, torch.nn.Linear)
              and any(name.endswith("." + layer) for layer in DIFFUSERS_SCRIPT_LAYERS)]  # fmt: skip
    assert set(script) < set(targets)
    assert set(targets) - set(script) == {
        "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out",
    }  # fmt: skip
    attention = backbone.adapter_targets("transformer", "attention")
    assert set(attention) < set(targets) and not any("ff" in name for name in attention)
    # the top-level proj_out (the output layer) is not a block's and takes no adapter
    assert "proj_out" not in targets and "single_transformer_blocks.0.proj_out" in targets
    with_norms = backbone.adapter_targets("transformer", "attention_ff_conv")
    assert set(with_norms) - set(targets) == {
        "transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
        "single_transformer_blocks.0.norm.linear",
    }  # fmt: skip
    clip = backbone.adapter_targets("text_encoder", "attention")
    assert len(clip) == 2 * 4 and all(name.endswith(("q_proj", "k_proj", "v_proj", "out_proj"))
                                      for name in clip)  # fmt: skip


def test_a_lora_run_exports_what_flux_pipeline_samples_alike(tiny_raw, tmp_path):
    from impasto.checkpoint.trained import load_trained
    from impasto.train.trainer import train

    raw = flux_raw(
        tiny_raw,
        parts={"transformer": "lora", "text_encoder": "lora"},
        lora={"rank": 4, "alpha": 8, "targets": "attention_ff"},
    )
    result = train(build_config(raw))
    _, backbone = load_trained(result.last_checkpoint)
    weights = save_flux_lora(backbone, tmp_path / "lora")
    with safe_open(str(weights), "pt") as file:
        keys = set(file.keys())
    assert {key.split(".")[0] for key in keys} == {"transformer", "text_encoder"}
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in keys

    ours = generate_flux_latents(backbone, ["a red circle"], num_steps=3, seed=2)
    base = build_tiny(0, TEXT_LENGTH)  # the run's starting model (model.init_seed 0)
    pipe = FluxPipeline(
        scheduler=base.scheduler(), vae=base.vae, text_encoder=base.text_encoder,
        tokenizer=base.tokenizer, text_encoder_2=base.text_encoder_2,
        tokenizer_2=base.tokenizer_2, transformer=base.transformer,
    )  # fmt: skip
    call = {
        "height": 64, "width": 64, "num_inference_steps": 3, "output_type": "latent",
        "max_sequence_length": TEXT_LENGTH,
    }  # fmt: skip
    plain = pipe("a red circle", generator=[torch.Generator().manual_seed(2)], **call).images
    pipe.load_lora_weights(str(tmp_path / "lora"))
    for module in (pipe.transformer, pipe.text_encoder):  # both parts' adapters were loaded
        assert any("lora_A" in name for name, _ in module.named_parameters())
    theirs = pipe("a red circle", generator=[torch.Generator().manual_seed(2)], **call).images
    torch.testing.assert_close(layout.pack_latents(ours), theirs, rtol=1e-4, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters trained and were loaded

    # the merged model as a diffusers folder: FluxPipeline.from_pretrained samples alike
    merged = export_checkpoint(
        result.run_dir, "diffusers", tmp_path / "merged", ExportOptions("fp32", merge=True)
    )
    folder_pipe = FluxPipeline.from_pretrained(str(merged), local_files_only=True)
    from_folder = folder_pipe(
        "a red circle", generator=[torch.Generator().manual_seed(2)], **call
    ).images
    torch.testing.assert_close(from_folder, theirs, rtol=1e-4, atol=1e-4)
    # and model.path reads it back: the merged weights
    model = {"family": "flux", "path": str(merged), "flux": {"text_length": TEXT_LENGTH}}
    loaded = build_backbone(build_config({**raw, "model": model}))
    want = folder_pipe.transformer.state_dict()
    got = loaded.denoiser().state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"parts": {"text_encoder_2": "lora"}},
            "parts.text_encoder_2: lora, but the flux family trains T5 frozen only",
        ),
        (
            {"model": {"family": "flux", "preset": "tiny", "flux": {"guidance_scale": 2}}},
            "model.flux.guidance_scale",
        ),
        (
            {"model": {"family": "flux", "preset": "tiny", "flux": {"text_length": 600}}},
            "model.flux.text_length",
        ),
        ({"model": {"family": "flux", "preset": "big"}}, "unknown preset 'big' of family flux"),
        ({"parts": {"unet": "lora"}}, "the flux family has no part 'unet'"),
    ],
)
def test_config_errors_are_one_line(tiny_raw, change, message):
    raw = flux_raw(tiny_raw)
    raw.update(change)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        config = build_config(raw)
        check_config(config)
        build_backbone(config)
    assert "\n" not in str(error.value).strip()


def test_a_missing_folder_part_is_one_line(tmp_path):
    from impasto.models.flux.files import load_flux_folder

    (tmp_path / "transformer").mkdir()
    with pytest.raises(
        ValueError, match=r"no transformer/config.json; expected a diffusers FLUX.1"
    ):
        load_flux_folder(tmp_path, TEXT_LENGTH)
    (tmp_path / "flux1-dev.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"a single file, and not a FLUX transformer; set model"):
        load_flux_folder(tmp_path / "flux1-dev.safetensors", TEXT_LENGTH)


def test_nothing_outside_the_models_package_names_the_flux_family():
    """Only src/impasto/models/ knows the family (the DiT family's rule, issue #31)."""
    import impasto

    root = Path(impasto.__file__).parent
    named = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if "models" not in path.relative_to(root).parts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bflux\b", line, re.IGNORECASE)
    ]
    assert named == []
