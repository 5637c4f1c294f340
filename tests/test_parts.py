"""What trains (issue #5): LoRA-family adapters through peft, text encoders, per-part LRs."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file
from tiny_inputs import tiny_batch, tiny_unet_output

from impasto.checkpoint.trained import load_trained
from impasto.config import build_config
from impasto.models.parts import prepare_parts
from impasto.models.presets import build_tiny
from impasto.models.sdxl import PART_NAMES, SDXLBackbone
from impasto.objectives.objective import Objective
from impasto.train.methods.denoise import denoising_loss
from impasto.train.trainer import Trainer, train


def _config(tiny_raw, **sections):
    for name, values in sections.items():
        tiny_raw[name] = values
    return build_config(tiny_raw)


@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr"])
def test_adapters_start_as_the_identity_and_only_they_train(tiny_raw, kind):
    config = _config(tiny_raw, parts={"unet": "lora"}, lora={"kind": kind, "rank": 4})
    models = build_tiny(0)
    before = tiny_unet_output(models.unet)
    base = {name: p.clone() for name, p in models.unet.named_parameters()}
    parts = prepare_parts(config, SDXLBackbone(models))
    # The adapted model starts as the base.
    torch.testing.assert_close(tiny_unet_output(models.unet), before)
    trainable = [name for name, p in models.unet.named_parameters() if p.requires_grad]
    assert trainable and all(".default" in name for name in trainable)
    assert list(parts) == ["unet"] and parts["unet"].mode == kind
    # Every attention projection got one adapter; nothing else did.
    targets = SDXLBackbone(build_tiny(0)).adapter_targets("unet", "attention")
    assert targets and all(t.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v", "0") for t in targets)
    adapted = {
        name.split(".base_layer")[0]
        for name, _ in models.unet.named_modules()
        if name.endswith(".base_layer")
    }
    assert adapted == set(targets)
    # Base weights are the originals (under base_layer once wrapped).
    for name, param in models.unet.named_parameters():
        original = name.replace(".base_layer", "")
        if original in base:
            assert torch.equal(param, base[original]), name


def test_text_encoder_full_finetune_trains_every_parameter_sdxl_reads(tiny_raw):
    config = _config(
        tiny_raw,
        parts={"unet": "frozen", "text_encoder": "full", "text_encoder_2": "full"},
    )
    models = build_tiny(0)
    parts = prepare_parts(config, SDXLBackbone(models))
    assert list(parts) == ["text_encoder", "text_encoder_2"]
    last = len(models.text_encoder.encoder.layers) - 1
    frozen = [n for n, p in models.text_encoder.named_parameters() if not p.requires_grad]
    assert frozen and all(
        n.startswith((f"encoder.layers.{last}.", "final_layer_norm.")) for n in frozen
    )
    objective = Objective.from_config(config.objective)
    out = denoising_loss(
        SDXLBackbone(models),
        objective,
        tiny_batch(),
        torch.Generator().manual_seed(1),
        nullcontext,
        train_text=True,
    )
    out.loss.backward()
    # DDP without find_unused_parameters needs a gradient on every trainable parameter.
    missing = [
        f"{name}.{param_name}"
        for name, part in parts.items()
        for param_name, param in part.module.named_parameters()
        if param.requires_grad and param.grad is None
    ]
    assert missing == []
    assert all(p.grad is None for p in models.unet.parameters())


def test_lora_on_all_parts_with_their_own_learning_rates(tiny_raw):
    config = _config(
        tiny_raw,
        parts={
            "unet": "lora",
            "text_encoder": "lora",
            "text_encoder_2": "lora",
            "text_encoder_lr": 1e-5,
            "text_encoder_2_lr": 2e-5,
        },
        lora={"rank": 4, "targets": "attention_ff"},
        train={**tiny_raw["train"], "max_steps": 2},
    )
    trainer = Trainer(config, resume=False)
    lrs = {group["name"]: group["lr"] for group in trainer.setup.optimizer.param_groups}
    assert lrs == {"unet": config.optim.lr, "text_encoder": 1e-5, "text_encoder_2": 2e-5}
    last = len(trainer.setup.backbone.components.text_encoder.encoder.layers) - 1
    te1_adapted = [
        n
        for n, _ in trainer.setup.backbone.components.text_encoder.named_modules()
        if n.endswith("base_layer")
    ]
    assert te1_adapted and not any(f"layers.{last}." in n for n in te1_adapted)
    assert any(n.endswith("fc1.base_layer") for n in te1_adapted)  # attention_ff reaches the MLP


def test_lora_run_resumes_exactly_and_reloads_for_sampling(tiny_raw, tmp_path):
    sections = {"parts": {"unet": "lora"}, "lora": {"rank": 4}, "optim": {"lr": 1e-2}}
    tiny_raw["checkpoint"]["every_steps"] = 2
    config = _config(tiny_raw, **sections, train={**tiny_raw["train"], "max_steps": 4})
    straight = train(config)
    weights = load_file(straight.last_checkpoint / "unet.safetensors")
    assert weights and all("lora_" in key for key in weights)  # only the adapter is stored
    assert straight.last_checkpoint.stat().st_size < 10**9

    # Stop after 2 steps, then resume to 4 in a fresh process-like Trainer.
    tiny_raw["train"]["output_dir"] = str(tmp_path / "resumed")
    first = _config(tiny_raw, **sections, train={**tiny_raw["train"], "max_steps": 2})
    train(first)
    resumed = train(_config(tiny_raw, **sections, train={**tiny_raw["train"], "max_steps": 4}))
    again = load_file(resumed.last_checkpoint / "unet.safetensors")
    assert weights.keys() == again.keys()
    for key in weights:
        assert torch.equal(weights[key], again[key]), key
    assert any(weights[key].abs().sum() > 0 for key in weights if "lora_B" in key)  # it trained

    _, reloaded = load_trained(straight.run_dir)

    reloaded = reloaded.components
    models = build_tiny(0)
    parts = prepare_parts(config, SDXLBackbone(models))
    parts["unet"].load_state_dict(weights)
    torch.testing.assert_close(tiny_unet_output(reloaded.unet), tiny_unet_output(models.unet))
    assert not torch.allclose(tiny_unet_output(reloaded.unet), tiny_unet_output(build_tiny(0).unet))


def test_bad_parts_configs_are_one_line_errors(tiny_raw):
    with pytest.raises(ValueError, match="every part is frozen"):
        _config(tiny_raw, parts={"unet": "frozen"})
    with pytest.raises(ValueError, match="cache.text_embeddings: 'memory' reuses embeddings"):
        _config(tiny_raw, parts={"text_encoder": "lora"}, cache={"text_embeddings": "memory"})
    with pytest.raises(ValueError, match="kind"):
        _config(tiny_raw, lora={"kind": "ia3"})
    assert PART_NAMES == ("unet", "text_encoder", "text_encoder_2")
