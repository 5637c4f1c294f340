"""The SD3.5 family through impasto's trainer (issue #33): a LoRA run on the tiny preset, its
adapters on the layers diffusers' SD3 script targets, exported in diffusers' LoRA layout and
loaded by ``StableDiffusion3Pipeline.load_lora_weights`` to the same samples as impasto's
sampler; the merged export as a diffusers folder; and the family's config errors
(docs/sd3.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from safetensors import safe_open

from impasto.config import build_config
from impasto.export import ExportOptions, export_checkpoint
from impasto.models.backbone import build_backbone
from impasto.models.sd3.backbone import Sd3Backbone
from impasto.models.sd3.components import build_tiny
from impasto.models.sd3.files import sd3_pipeline
from impasto.models.sd3.lora import save_sd3_lora
from impasto.models.sd3.sampling import generate_sd3_latents
from impasto.train.checks import check_config

TEXT_LENGTH = 16

# diffusers' train_dreambooth_lora_sd3.py default --lora_layers (peft matches them as name
# suffixes: attn.to_q, not attn2.to_q)
DIFFUSERS_SCRIPT_LAYERS = {
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
    "attn.to_out.0", "attn.to_q", "attn.to_v",
}  # fmt: skip


def sd3_raw(tiny_raw: dict, **changes) -> dict:
    tiny_raw["model"] = {"family": "sd3", "preset": "tiny", "sd3": {"text_length": TEXT_LENGTH}}
    tiny_raw["objective"] = {
        "prediction_type": "flow", "timestep_sampling": "logit_normal", "flow_shift": 3.0,
    }  # fmt: skip
    tiny_raw["data"]["batch_size"] = 2
    tiny_raw["optim"]["lr"] = 1e-2
    tiny_raw["train"]["max_steps"] = 3
    tiny_raw["checkpoint"]["every_steps"] = 3
    tiny_raw.update(changes)
    return tiny_raw


def test_lora_targets_are_the_diffusers_scripts_layers_and_the_second_attention():
    backbone = Sd3Backbone(build_tiny(0, TEXT_LENGTH))
    attention = backbone.adapter_targets("transformer", "attention")
    script = [name for name, module in backbone.denoiser().named_modules()
              if isinstance(module, torch.nn.Linear)
              and any(name.endswith("." + layer) for layer in DIFFUSERS_SCRIPT_LAYERS)]  # fmt: skip
    assert set(script) < set(attention)
    assert set(attention) - set(script) == {
        f"transformer_blocks.0.attn2.{name}" for name in ("to_q", "to_k", "to_v", "to_out.0")
    }
    # the last block keeps no text output: no to_add_out, no ff_context
    assert "transformer_blocks.1.attn.to_add_out" not in attention
    with_ff = backbone.adapter_targets("transformer", "attention_ff")
    assert set(with_ff) - set(attention) == {
        "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff.net.2",
        "transformer_blocks.0.ff_context.net.0.proj", "transformer_blocks.0.ff_context.net.2",
        "transformer_blocks.1.ff.net.0.proj", "transformer_blocks.1.ff.net.2",
    }  # fmt: skip
    with_norms = backbone.adapter_targets("transformer", "attention_ff_conv")
    assert set(with_norms) - set(with_ff) == {
        f"transformer_blocks.{i}.{name}" for i in (0, 1)
        for name in ("norm1.linear", "norm1_context.linear")
    }  # fmt: skip
    assert "proj_out" not in with_norms and "context_embedder" not in with_norms
    for part, layers in (("text_encoder", 2), ("text_encoder_2", 3)):
        clip = backbone.adapter_targets(part, "attention")
        assert len(clip) == layers * 4
    with pytest.raises(ValueError, match="parts.text_encoder_3: T5 trains frozen only"):
        backbone.adapter_targets("text_encoder_3", "attention")


def test_a_lora_run_exports_what_the_pipeline_samples_alike(tiny_raw, tmp_path):
    from impasto.checkpoint.trained import load_trained
    from impasto.train.trainer import train

    raw = sd3_raw(
        tiny_raw,
        parts={"transformer": "lora", "text_encoder": "lora", "text_encoder_2": "lora"},
        lora={"rank": 4, "alpha": 8, "targets": "attention_ff"},
    )
    result = train(build_config(raw))
    _, backbone = load_trained(result.last_checkpoint)
    weights = save_sd3_lora(backbone, tmp_path / "lora")
    with safe_open(str(weights), "pt") as file:
        keys = set(file.keys())
    assert {key.split(".")[0] for key in keys} == {"transformer", "text_encoder", "text_encoder_2"}
    assert "transformer.transformer_blocks.0.attn2.to_q.lora_A.weight" in keys
    assert "text_encoder_2.text_model.encoder.layers.2.self_attn.q_proj.lora_B.weight" in keys

    call = {"num_steps": 3, "guidance_scale": 2.0, "seed": 2}
    ours = generate_sd3_latents(backbone, ["a red circle"], **call)
    pipe = sd3_pipeline(build_tiny(0, TEXT_LENGTH))  # the run's starting model (init_seed 0)
    pipe_call = {
        "height": 64, "width": 64, "num_inference_steps": 3, "guidance_scale": 2.0,
        "output_type": "latent", "max_sequence_length": TEXT_LENGTH,
    }  # fmt: skip
    plain = pipe("a red circle", generator=[torch.Generator().manual_seed(2)], **pipe_call).images
    pipe.load_lora_weights(str(tmp_path / "lora"))
    for module in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2):
        assert any("lora_A" in name for name, _ in module.named_parameters())
    theirs = pipe("a red circle", generator=[torch.Generator().manual_seed(2)], **pipe_call).images
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters trained and were loaded

    # the merged model as a diffusers folder: StableDiffusion3Pipeline samples alike
    merged = export_checkpoint(
        result.run_dir, "diffusers", tmp_path / "merged", ExportOptions("fp32", merge=True)
    )
    folder_pipe = StableDiffusion3Pipeline.from_pretrained(str(merged), local_files_only=True)
    folder_pipe.set_progress_bar_config(disable=True)
    from_folder = folder_pipe(
        "a red circle", generator=[torch.Generator().manual_seed(2)], **pipe_call
    ).images
    torch.testing.assert_close(from_folder, theirs, rtol=1e-4, atol=1e-4)
    # and model.path reads it back: the merged weights
    model = {"family": "sd3", "path": str(merged), "sd3": {"text_length": TEXT_LENGTH}}
    loaded = build_backbone(build_config({**raw, "model": model}))
    for name in ("transformer", "text_encoder_2"):
        want = getattr(folder_pipe, name).state_dict()
        got = loaded.parts()[name].state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _clip_g_outputs(encoder: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """What SD3 reads of CLIP-G: the penultimate hidden states and the pooled projection."""
    with torch.no_grad():
        output = encoder(ids, output_hidden_states=True)
    return [output.hidden_states[-2], output.text_embeds]


def test_a_clip_g_lora_loads_in_the_pipeline_to_the_trained_encoder(tiny_raw, tmp_path):
    """A LoRA on CLIP-G alone (parts.text_encoder_2), from save_sd3_lora and from
    ``--format lora-diffusers``: ``StableDiffusion3Pipeline.load_lora_weights`` reads its keys
    under ``text_encoder_2.text_model.`` (the level CLIPTextModelWithProjection keeps, which
    diffusers strips only from a model without it) into an encoder whose outputs are the
    trained one's."""
    from impasto.checkpoint.trained import load_trained
    from impasto.cli import main
    from impasto.train.trainer import train

    raw = sd3_raw(tiny_raw, parts={"text_encoder_2": "lora"},
                  lora={"rank": 4, "alpha": 8, "targets": "attention"})  # fmt: skip
    raw["train"]["max_steps"] = 1
    result = train(build_config(raw))
    _, backbone = load_trained(result.last_checkpoint)
    trained = backbone.parts()["text_encoder_2"].eval()
    cli_out = tmp_path / "cli"
    assert main(["export", str(result.run_dir), "--format", "lora-diffusers", "--out",
                 str(cli_out), "--dtype", "fp32"]) == 0  # fmt: skip
    files = {"save_sd3_lora": save_sd3_lora(backbone, tmp_path / "python"),
             "lora-diffusers": next(cli_out.glob("*.safetensors"))}  # fmt: skip
    pipe = sd3_pipeline(build_tiny(0, TEXT_LENGTH))  # the run's starting model (init_seed 0)
    ids = pipe.tokenizer_2(["a red circle"], padding="max_length", max_length=77,
                           return_tensors="pt").input_ids  # fmt: skip
    plain = _clip_g_outputs(pipe.text_encoder_2, ids)
    ours = _clip_g_outputs(trained, ids)
    for source, weights in files.items():
        with safe_open(str(weights), "pt") as file:
            keys = set(file.keys())
        assert len(keys) == 3 * 4 * 2, source  # 3 layers, q/k/v/out, A and B
        assert all(key.startswith("text_encoder_2.text_model.encoder.layers.") for key in keys)
        pipe = sd3_pipeline(build_tiny(0, TEXT_LENGTH))
        pipe.load_lora_weights(str(weights.parent))
        theirs = _clip_g_outputs(pipe.text_encoder_2, ids)
        for want, got, base in zip(ours, theirs, plain, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=source)
            assert (got - base).abs().max() > 1e-4, source  # the adapter trained and loaded


def test_cached_latents_and_text_train_as_the_uncached_run(tiny_raw, tmp_path):
    """The disk caches of latents and of the joint text tokens (77 CLIP + T5 tokens, the pooled
    vector) feed each step what it computes without them: the same losses and gradient norms,
    step by step (to float32 rounding: the cache stores the encodings, not the pixels)."""
    import copy
    import json

    from impasto.train.trainer import train

    logs = []
    for cache in ("none", "disk"):
        raw = sd3_raw(
            copy.deepcopy(tiny_raw),
            parts={"transformer": "lora"},
            lora={"rank": 4, "alpha": 4, "targets": "attention"},
            cache={"latents": cache, "text_embeddings": cache, "dir": str(tmp_path / "cache")},
            data={**tiny_raw["data"], "batch_size": 2, "crop": "center"},
        )
        raw["train"]["output_dir"] = str(tmp_path / f"run-{cache}")
        run = train(build_config(raw)).run_dir
        lines = (run / "metrics.jsonl").read_text().splitlines()
        logs.append([json.loads(line) for line in lines if '"loss"' in line])
    assert [row["step"] for row in logs[0]] == [row["step"] for row in logs[1]] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        plain = torch.tensor([row[key] for row in logs[0]])
        cached = torch.tensor([row[key] for row in logs[1]])
        torch.testing.assert_close(cached, plain, rtol=1e-4, atol=1e-6, msg=key)
    assert any((tmp_path / "cache").rglob("*.safetensors"))  # the second run read the cache


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"parts": {"text_encoder_3": "lora"}},
            "parts.text_encoder_3: lora, but the sd3 family trains T5 frozen only",
        ),
        (
            {"model": {"family": "sd3", "preset": "tiny", "sd3": {"shift": 2}}},
            "model.sd3.shift",
        ),
        (
            {"model": {"family": "sd3", "preset": "tiny", "sd3": {"text_length": 600}}},
            "model.sd3.text_length",
        ),
        ({"model": {"family": "sd3", "preset": "big"}}, "unknown preset 'big' of family sd3"),
        ({"parts": {"unet": "lora"}}, "the sd3 family has no part 'unet'"),
    ],
)
def test_config_errors_are_one_line(tiny_raw, change, message):
    raw = sd3_raw(tiny_raw)
    raw.update(change)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        config = build_config(raw)
        check_config(config)
        build_backbone(config)
    assert "\n" not in str(error.value).strip()


def test_a_missing_folder_part_is_one_line(tmp_path):
    from impasto.models.sd3.files import load_sd3_folder

    (tmp_path / "transformer").mkdir()
    with pytest.raises(ValueError, match=r"no transformer/config.json; expected a diffusers SD3.5"):
        load_sd3_folder(tmp_path, TEXT_LENGTH)
    (tmp_path / "sd3.5_large.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"a single file; set model.path to a diffusers SD3.5"):
        load_sd3_folder(tmp_path / "sd3.5_large.safetensors", TEXT_LENGTH)


def test_nothing_outside_the_models_package_names_the_sd3_family():
    """Only src/impasto/models/ knows the family (the DiT family's rule, issue #31): no family
    value ``"sd3"``, no ``Sd3…`` class, no import of ``models.sd3`` elsewhere (SD3 the paper,
    whose rectified-flow convention the objectives follow, is named freely)."""
    import impasto

    root = Path(impasto.__file__).parent
    named = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if "models" not in path.relative_to(root).parts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"[\"']sd3[\"']|\bSd3\w*|models\.sd3\b", line)
    ]
    assert named == []
