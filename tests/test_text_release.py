"""Frozen text encoders released after caching (issue #33, :mod:`impasto.train.text_release`): a
tiny FLUX run with ``cache.text_embeddings: memory`` ends with CLIP-L and T5 on the meta device
and trains bitwise as the same run that keeps them; its validation samples come from the table;
a text it never encoded stops with one line; captions that change every epoch keep the
encoders; the released families and the bench estimate say what is let go."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from impasto.config import build_config
from impasto.data.captions import CaptionTools
from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.components import build_tiny
from impasto.models.flux.options import FluxOptions
from impasto.train import text_release
from impasto.train.text_release import (
    CachedText,
    dataset_captions,
    releasable_encoders,
    sampling_texts,
)

TEXT_LENGTH = 16
PROMPTS = ["a red circle", "a blue square"]


def flux_raw(demo_folder: Path, out: Path, **cache: Any) -> dict[str, Any]:
    return {
        "config_version": 1,
        "model": {"family": "flux", "preset": "tiny", "flux": {"text_length": TEXT_LENGTH}},
        "objective": {"prediction_type": "flow", "timestep_sampling": "logit_normal"},
        "parts": {"transformer": "lora"},
        "lora": {"rank": 4, "alpha": 8},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2,
                 "caption_dropout": 0.3},
        "cache": {"text_embeddings": "memory", **cache},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "train": {"output_dir": str(out), "seed": 0, "max_steps": 4},
        "checkpoint": {"every_steps": 4, "keep_last": 1},
        "sample": {"prompts": PROMPTS, "num_steps": 2, "every_steps": 4, "seed": 3,
                   "negative_prompt": "blurry"},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }  # fmt: skip


def run(raw: dict[str, Any]) -> tuple[Any, list[float]]:
    """The finished trainer and its loss trace."""
    from impasto.train.trainer import Trainer

    trainer = Trainer(build_config(raw), resume=False)
    trainer.run()
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    losses = [record["loss"] for record in records if "loss" in record]
    return trainer, losses + [record["val/loss"] for record in records if "val/loss" in record]


def grid(run_dir: Path) -> np.ndarray:
    """The validation grid's images and labels, below its title (the run's name)."""
    (path,) = sorted(run_dir.rglob("*.png"))
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)[40:]


@pytest.fixture(scope="module")
def runs(demo_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    """(released run, kept run): the same tiny FLUX run, the second without the release."""
    out = tmp_path_factory.mktemp("release")

    def with_eval(raw: dict[str, Any]) -> dict[str, Any]:
        raw["data"]["validation_split"] = 0.25  # the held-out captions are encoded too
        return raw | {"eval": {"every_steps": 2}}

    released = run(with_eval(flux_raw(demo_folder, out / "released")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("impasto.train.text_release.release_text_encoders", lambda *args: [])
        kept = run(with_eval(flux_raw(demo_folder, out / "kept")))
    return released, kept


def test_a_cached_run_releases_its_encoders_and_trains_bitwise_the_same(runs):
    (released, losses), (kept, kept_losses) = runs
    # bitwise: floats from the same JSON (the training losses, then the validation losses)
    assert len(losses) == 4 + 3 and losses[:4] == kept_losses[:4]
    assert losses[4:] == pytest.approx(kept_losses[4:], rel=1e-6)  # per caption, not batched
    components = released.setup.backbone.components
    for encoder in (components.text_encoder, components.text_encoder_2):
        assert {p.device.type for p in encoder.parameters()} == {"meta"}
    assert components.transformer.x_embedder.weight.device.type == "cpu"
    assert components.vae.encoder.conv_in.weight.device.type == "cpu"
    kept_parts = kept.setup.backbone.components
    assert kept_parts.text_encoder_2.shared.weight.device.type == "cpu"
    # every training caption, the empty one and the prompts (and negative) are in the table
    table = released.setup.backbone.text_table.table
    records = released.data.records
    held_out = released.data.held_out
    assert held_out and {"", "blurry", *PROMPTS, *(r.caption for r in records)} <= set(table)
    assert {r.caption for r in held_out} <= set(table)
    assert table is released.setup.method.memo.texts  # one copy of the encodings


def test_the_table_holds_what_the_encoders_computed(runs):
    (released, _), (kept, _) = runs
    backbone, reference = released.setup.backbone, kept.setup.backbone
    for text in ["", PROMPTS[0], released.data.records[0].caption]:
        with torch.no_grad():
            want = reference.encode_text([text])
        got = backbone.encode_text([text])
        assert torch.equal(got.prompt_embeds, want.prompt_embeds)
        assert torch.equal(got.pooled_prompt_embeds, want.pooled_prompt_embeds)


def test_validation_samples_come_from_the_table(runs):
    (released, _), (kept, _) = runs
    difference = np.abs(grid(released.run_dir) - grid(kept.run_dir))
    assert difference.max() <= 1  # float noise may cross a rounding boundary


def test_a_text_never_encoded_names_the_release(runs):
    (released, _), _ = runs
    backbone = released.setup.backbone
    copy = backbone.with_denoiser(backbone.denoiser())  # shares the table (a KL leash's base)
    assert copy.text_table is backbone.text_table
    with pytest.raises(ValueError, match=r"^text 'a green triangle' was not encoded before"):
        released.setup.backbone.sampling_condition(["a green triangle"], 64, 64)


@dataclass
class FakeDataset:
    records: list[Any]
    caption_tools: CaptionTools = field(default_factory=CaptionTools)
    caption_variants: int = 0
    caption_dropout: float = 0.0
    seed: int = 0


@dataclass
class Record:
    caption: str


def test_dataset_captions_follow_the_caption_tools():
    records = [Record("a, b, c"), Record("d")]
    plain = FakeDataset(records, CaptionTools(prefix="sks, "), caption_dropout=0.1)
    assert dataset_captions(plain) == ["", "sks, a, b, c", "sks, d"]
    shuffled = FakeDataset(records, CaptionTools(shuffle=True))
    assert dataset_captions(shuffled) is None  # new captions every epoch: encoders kept
    variants = FakeDataset(records, CaptionTools(shuffle=True), caption_variants=3)
    listed = dataset_captions(variants)
    tools = variants.caption_tools
    assert listed == [tools.variant(r.caption, 0, v, i) for i, r in enumerate(records)
                      for v in range(3)]  # fmt: skip


def test_shuffled_captions_in_memory_keep_the_encoders(demo_folder, tmp_path, capsys):
    raw = flux_raw(demo_folder, tmp_path / "run")
    raw["data"] |= {"shuffle_tags": True}
    raw["train"]["max_steps"] = 1
    raw["sample"]["every_steps"] = 0
    trainer, _ = run(raw)
    assert trainer.setup.backbone.components.text_encoder_2.shared.weight.device.type == "cpu"
    assert "text encoders kept: data.shuffle_tags" in capsys.readouterr().out


def test_sampling_texts_and_the_lookup():
    from impasto.sampling.prompt_file import PromptOptions, SamplePrompt

    prompts = [SamplePrompt("x", PromptOptions(negative_prompt="bad")), SamplePrompt("y")]
    assert sampling_texts(prompts, "ugly") == ["x", "y", "", "ugly", "bad"]
    row = torch.arange(3.0)
    lookup = CachedText({"x": _Row(row)}, lambda: torch.device("cpu"))
    assert torch.equal(lookup(["x", "x"]).value, torch.stack([row, row]))


@dataclass(frozen=True)
class _Row:
    value: torch.Tensor


def test_released_parts_per_family():
    flux = FluxBackbone(build_tiny(0, TEXT_LENGTH), FluxOptions(text_length=TEXT_LENGTH))
    assert list(releasable_encoders(flux, ["transformer"], True)) == [
        "text_encoder", "text_encoder_2",
    ]  # fmt: skip
    trained_clip = releasable_encoders(flux, ["transformer", "text_encoder"], True)
    assert list(trained_clip) == ["text_encoder_2"]
    assert releasable_encoders(flux, ["transformer"], False) == {}
    assert text_release.free([flux.components.text_encoder]) > 0
    assert all(p.is_meta for p in flux.components.text_encoder.parameters())


def encoder_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    return sum(p.numel() for p in module.parameters()) * dtype.itemsize


@pytest.mark.slow  # counts a full FLUX.1-dev step on the meta device (~35 s)
def test_the_flux_dev_estimate_leaves_out_the_released_text_encoders():
    from impasto.bench import format_report, run_bench
    from impasto.models.flux.components import full_clip, full_t5

    settings = ("parts.transformer=lora", "memory.frozen_dtype=bf16", "memory.vae_dtype=bf16")
    report = run_bench(
        "flux-dev", estimate=True, device="cpu", resolution=512, precision="bf16",
        overrides=settings,
    )  # fmt: skip
    with torch.device("meta"):
        t5, clip = full_t5(), full_clip()
    released = report["released_gib"]
    assert released["text_encoder_2"] * 2**30 == encoder_bytes(t5, torch.bfloat16)  # 8.87
    assert released["text_encoder"] * 2**30 == encoder_bytes(clip, torch.bfloat16)
    assert set(report["frozen_gib"]) == {"transformer", "vae"}
    frozen = report["memory_gib"]["frozen"]
    assert frozen == pytest.approx(sum(report["frozen_gib"].values()))
    assert 22 < frozen < 23  # the bf16 transformer and VAE; 31.4 GiB with the encoders
    text = format_report(report)
    assert "text encoders released once their embeddings are cached" in text
    assert "text_encoder_2 8.87 + text_encoder 0.23 GiB" in text


def test_a_trained_text_encoder_keeps_every_encoder_in_the_estimate():
    from impasto.bench import format_report, run_bench

    settings = ("parts.transformer=lora", "parts.text_encoder=lora")
    report = run_bench("flux-tiny", estimate=True, device="cpu", overrides=settings)
    assert report["released_gib"] == {}
    assert set(report["frozen_gib"]) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    assert "released" not in format_report(report)


@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_each_family_samples_from_the_table_once_released(family):
    from contextlib import nullcontext

    from impasto.models.backbone import build_backbone

    raw = {"config_version": 1, "model": {"family": family, "preset": "tiny",
           family: {"text_length": TEXT_LENGTH}}, "data": {"path": "synthetic"},
           "train": {"output_dir": "unused", "max_steps": 1}}  # fmt: skip
    backbone = build_backbone(build_config(raw))
    encoders = releasable_encoders(backbone, ["transformer"], True)
    assert encoders and "transformer" not in encoders
    prompts = [PROMPTS[1], "", PROMPTS[0]]
    with torch.no_grad():
        want = backbone.sampling_condition(prompts, 64, 64)
    table: dict[str, Any] = {}
    text_release.fill_table(table, backbone, prompts, nullcontext)
    backbone.text_table = CachedText(table, lambda: backbone.device)
    text_release.free(encoders.values())
    assert all(p.is_meta for module in encoders.values() for p in module.parameters())
    got = backbone.sampling_condition(prompts, 64, 64)
    for name, value in vars(want).items():
        torch.testing.assert_close(getattr(got, name), value, msg=name)


def test_a_disk_cached_run_releases_its_encoders_and_trains_the_same(demo_folder, tmp_path):
    def disk_run(name: str) -> tuple[Any, list[float]]:
        raw = flux_raw(demo_folder, tmp_path / name, text_embeddings="disk")
        raw["cache"]["dir"] = str(tmp_path / "cache")  # the second run reads the first's
        raw["train"]["max_steps"] = 2
        raw["sample"]["every_steps"] = 2
        return run(raw)

    released, losses = disk_run("released")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("impasto.train.text_release.release_text_encoders", lambda *args: [])
        kept, kept_losses = disk_run("kept")
    assert len(losses) == 2 and losses == kept_losses  # (no validation loss here)
    components = released.setup.backbone.components
    assert all(p.is_meta for p in components.text_encoder_2.parameters())
    # the captions stay on disk: the table holds the sampling texts and the empty caption
    assert set(released.setup.backbone.text_table.table) == {"", "blurry", *PROMPTS}
    assert np.abs(grid(released.run_dir) - grid(kept.run_dir)).max() <= 1
