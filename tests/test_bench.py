"""``impasto bench``: the report's FLOP count, rows and CLI (speed itself is measured in
benchmarks/RESULTS.md, never asserted in tests)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from impasto.bench import ImpastoStep, bench_config, run_bench, synthetic_batch
from impasto.cli import main
from impasto.models.presets import build_tiny


def test_flops_match_an_independent_count_and_rows_are_complete() -> None:
    report = run_bench("tiny", batch=2, steps=1, warmup=0, variants=["default", "fused"])
    unet = build_tiny(0).unet
    batch = synthetic_batch(unet.config, 2, 64)
    added = {"text_embeds": batch.pooled_prompt_embeds, "time_ids": torch.ones(2, 6)}
    with FlopCounterMode(display=False) as counter:
        out = unet(batch.latent_mean, torch.tensor([10, 900]), batch.prompt_embeds,
                   added_cond_kwargs=added).sample  # fmt: skip
        out.square().mean().backward()
    assert report["tflop_per_step"] * 1e12 == pytest.approx(counter.get_total_flops(), rel=1e-3)
    assert [row["name"] for row in report["rows"]] == ["diffusers", "default", "fused"]
    assert report["rows"][0]["vs_diffusers"] == 1.0
    for row in report["rows"]:
        assert row["step_ms"] > 0 and row["images_per_s"] == pytest.approx(2e3 / row["step_ms"])
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # CPU: ratios only


def test_the_impasto_step_trains_with_the_variant_settings() -> None:
    config = bench_config("tiny", 64, 2, "auto", "cpu", ["optim.lr=1e-3"], {"parts.unet": "lora"})
    step = ImpastoStep(config, torch.device("cpu"))
    step.prepare(synthetic_batch(step.unet.config, 2, 64))
    trained = {name: p.detach().clone() for name, p in step.unet.named_parameters()
               if p.requires_grad}  # fmt: skip
    frozen = {name: p.detach().clone() for name, p in step.unet.named_parameters()
              if not p.requires_grad}  # fmt: skip
    step()
    step()
    params = dict(step.unet.named_parameters())
    assert trained and all("lora" in name for name in trained)
    assert any(not torch.equal(params[name], value) for name, value in trained.items())
    assert all(torch.equal(params[name], value) for name, value in frozen.items())


def test_cli_json_and_errors(capsys) -> None:
    assert main(["bench", "--steps", "1", "--warmup", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny" and report["resolution"] == 64
    assert main(["bench", "--variants", "turbo"]) == 2
    assert "unknown variant 'turbo'" in capsys.readouterr().err
