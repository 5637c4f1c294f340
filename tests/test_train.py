"""End-to-end tiny runs on CPU: learning, exact resume, crash safety, CLI, graceful stop."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from impasto.checkpoint import stateful as state_module
from impasto.cli import main
from impasto.config import build_config
from impasto.train.methods.denoise import DenoiseMethod
from impasto.train.trainer import train


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:08d}" / "unet.safetensors")


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different[:5]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, demo_folder) -> Path:
    """10 uninterrupted steps; the reference for the resume tests."""
    raw = _raw(demo_folder, tmp_path_factory.mktemp("straight") / "run")
    result = train(build_config(raw))
    assert result.state.step == 10 and not result.interrupted
    return result.run_dir


def _raw(demo_folder: Path, run_dir: Path, **train) -> dict:
    return {
        "model": {"preset": "tiny"},
        "data": {
            "path": str(demo_folder),
            "resolution": 64,
            "batch_size": 4,
            "crop": "random",
            "random_flip": True,
        },
        "optim": {"lr": 1e-3, "weight_decay": 0.01, "lr_schedule": "constant", "warmup_steps": 2},
        "train": {"output_dir": str(run_dir), "seed": 0, "max_steps": 10, **train},
        "checkpoint": {"every_steps": 5, "keep_last": 3},
        "log": {"every_steps": 1, "tensorboard": True, "progress_bar": False},
    }


def test_tiny_run_lowers_the_loss(tmp_path, demo_folder):
    raw = _raw(demo_folder, tmp_path / "run", max_steps=30)
    raw["data"].update(crop="center", random_flip=False)
    raw["optim"].update(lr_schedule="constant", warmup_steps=0)
    raw["checkpoint"]["every_steps"] = 30
    result = train(build_config(raw))
    losses = _losses(result.run_dir)
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    assert (result.run_dir / "tensorboard").is_dir()
    config_text = (result.run_dir / "config.yaml").read_text()
    assert config_text.startswith("# config_hash: ")
    state = json.loads((result.last_checkpoint / "state.json").read_text())
    assert config_text.split()[2] == state["run"]["config_hash"]


def test_resume_is_bitwise_identical(tmp_path, demo_folder, straight_run):
    raw = _raw(demo_folder, tmp_path / "run")
    first = train(build_config({**raw, "train": {**raw["train"], "max_steps": 5}}))
    assert first.state.step == 5
    second = train(build_config(raw))
    assert second.state.step == 10
    _assert_same_weights(_weights(straight_run, 10), _weights(second.run_dir, 10))
    assert _losses(straight_run) == _losses(second.run_dir)


def test_memory_cache_resumes_bitwise_and_matches_fresh_encodings(tmp_path, demo_folder):
    raw = _raw(demo_folder, tmp_path / "cached", max_steps=6)
    raw["data"].update(crop="center", random_flip=False, caption_dropout=0.3)
    raw["checkpoint"]["every_steps"] = 3
    uncached = train(build_config(copy.deepcopy(raw)))
    raw["cache"] = {"latents": "memory", "text_embeddings": "memory"}
    raw["train"]["output_dir"] = str(tmp_path / "straight")
    straight = train(build_config(raw))
    raw["train"]["output_dir"] = str(tmp_path / "resumed")
    train(build_config({**raw, "train": {**raw["train"], "max_steps": 3}}))
    resumed = train(build_config(raw))  # starts with an empty memo
    _assert_same_weights(_weights(straight.run_dir, 6), _weights(resumed.run_dir, 6))
    assert _losses(straight.run_dir) == _losses(resumed.run_dir)
    # Encoding one item at a time changes float rounding only (~1e-6): the same first loss.
    # (Later losses drift apart: AdamW's first steps amplify rounding differences.)
    assert _losses(straight.run_dir)[0] == pytest.approx(_losses(uncached.run_dir)[0], rel=1e-5)


def test_encoding_memo_equals_batch_encoding_and_encodes_each_item_once(demo_folder):
    from impasto.data import build_dataloader, scan_image_folder
    from impasto.models import build_tiny, encode_prompts
    from impasto.models.sdxl import SDXLBackbone
    from impasto.train.memo import EncodingMemo

    records = scan_image_folder(demo_folder)
    loader, _ = build_dataloader(records, 64, "center", False, 8, seed=0, caption_dropout=0.5)
    batch = next(iter(loader))
    models, memo = build_tiny(0), EncodingMemo(latents=True, text_embeddings=True)
    backbone = SDXLBackbone(models)
    with torch.no_grad():
        mean, std = memo.posterior(backbone, batch)
        prompts = memo.text(backbone, batch.captions, contextlib.nullcontext)
        posterior = models.vae.encode(batch.pixel_values).latent_dist
        reference = encode_prompts(models, batch.captions)
    torch.testing.assert_close(mean, posterior.mean, rtol=0, atol=1e-5)
    torch.testing.assert_close(std, posterior.std, rtol=0, atol=1e-5)
    torch.testing.assert_close(prompts.prompt_embeds, reference.prompt_embeds, rtol=0, atol=1e-5)
    torch.testing.assert_close(prompts.pooled_prompt_embeds, reference.pooled_prompt_embeds)
    assert len(memo._posteriors) == len(set(batch.indices.tolist()))
    assert len(memo._texts) == len(set(batch.captions))
    memo._texts = {  # served from RAM
        key: replace(text, prompt_embeds=text.prompt_embeds + 1)
        for key, text in memo._texts.items()
    }
    again = memo.text(backbone, batch.captions, contextlib.nullcontext)
    torch.testing.assert_close(again.prompt_embeds, prompts.prompt_embeds + 1)


def test_failed_checkpoint_write_keeps_previous_and_resumes_exactly(
    tmp_path, demo_folder, straight_run, monkeypatch
):
    raw = _raw(demo_folder, tmp_path / "run")
    real_save = state_module.save_checkpoint

    def failing_save(root, step, data, keep_last):
        if step == 10:
            data.objects["rng"] = lambda: None  # unpicklable: torch.save fails mid-checkpoint
        return real_save(root, step, data, keep_last)

    monkeypatch.setattr(state_module, "save_checkpoint", failing_save)
    with pytest.raises((AttributeError, TypeError, RuntimeError)):  # pickling a lambda
        train(build_config(raw))
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step-00000005"]
    monkeypatch.undo()
    resumed = train(build_config(raw))
    assert resumed.state.step == 10
    _assert_same_weights(_weights(straight_run, 10), _weights(resumed.run_dir, 10))
    assert _losses(straight_run) == _losses(resumed.run_dir)  # steps 6..9 were logged twice


def test_sigterm_saves_after_the_step_and_resume_matches(
    tmp_path, demo_folder, straight_run, monkeypatch
):
    raw = _raw(demo_folder, tmp_path / "run")
    real_step = DenoiseMethod.step
    calls = []

    def step_then_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(DenoiseMethod, "step", step_then_signal)
    stopped = train(build_config(raw))
    assert stopped.interrupted and stopped.state.step == 3
    assert stopped.last_checkpoint.name == "step-00000003"
    monkeypatch.undo()
    resumed = train(build_config(raw))
    _assert_same_weights(_weights(straight_run, 10), _weights(resumed.run_dir, 10))


def test_cli_train_resumes_and_no_resume_archives(tmp_path, demo_folder, capsys):
    raw = _raw(demo_folder, tmp_path / "run", max_steps=2)
    raw["checkpoint"]["every_steps"] = 1
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path)]) == 0
    assert main(["train", str(path), "--set", "train.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "train.max_steps: 2 -> 3" in out
    assert len(_losses(tmp_path / "run")) == 3
    assert main(["train", str(path), "--no-resume"]) == 0
    archived = list((tmp_path / "run").glob("previous-*/checkpoints/step-00000003"))
    assert len(archived) == 1
    archive = archived[0].parents[1]
    moved = "checkpoints, metrics.jsonl, tensorboard, config.yaml"
    assert f"the earlier run ({moved}) is in {archive}" in capsys.readouterr().out
    assert "max_steps: 3" in (archive / "config.yaml").read_text()  # the earlier run's config
    assert len(_losses(tmp_path / "run")) == 2
    assert main(["train", str(path), "--no-resume"]) == 0  # again within the same second
    assert len(list((tmp_path / "run").glob("previous-*/checkpoints"))) == 2


def test_unreadable_images_are_skipped_and_counted(tmp_path, demo_folder):
    folder = tmp_path / "data"
    folder.mkdir()
    for source in sorted(demo_folder.iterdir()):
        (folder / source.name).write_bytes(source.read_bytes())
    broken = sorted(folder.glob("*.png"))[0]
    broken.write_bytes(broken.read_bytes()[:100])
    raw = _raw(folder, tmp_path / "run", max_steps=4)
    raw["data"]["max_bad_fraction"] = 0.5
    result = train(build_config(raw))
    assert result.state.step == 4 and result.state.images_bad == 1
    lines = (result.run_dir / "bad-data.tsv").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{broken}\tunreadable image")
    raw = copy.deepcopy(raw)
    raw["data"]["max_bad_fraction"] = 0.0
    raw["train"].update(output_dir=str(tmp_path / "run2"), max_steps=6)
    with pytest.raises(
        ValueError,
        match=r"data: 1 of 16 images unusable; allowed: 0% \(data.max_bad_fraction\); see ",
    ):
        train(build_config(raw))


def test_epochs_accumulation_and_lr_schedule(tmp_path, demo_folder):
    raw = _raw(demo_folder, tmp_path / "run", max_steps=None, max_epochs=3, grad_accum_steps=2)
    raw["optim"].update(lr_schedule="linear", warmup_steps=1, lr=1e-3)
    result = train(build_config(raw))
    # 16 images / batch 4 = 4 micro-batches per epoch; 3 epochs / accumulation 2 = 6 steps.
    assert result.state.step == 6 and result.state.samples_seen == 48
    position = json.loads((result.last_checkpoint / "state.json").read_text())["data"]
    assert (position["epoch"], position["batch_in_epoch"]) == (3, 0)
    records = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    expected = [1e-3 * m for m in (0.5, 1.0, 0.8, 0.6, 0.4, 0.2)]  # warmup 1, linear over 5
    assert [r["lr"] for r in records] == pytest.approx(expected)


def test_tensorboard_scalars_match_jsonl_after_resume(tmp_path, demo_folder, straight_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(straight_run / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in scalars] == list(range(1, 11))
    assert [v for _, v in scalars] == pytest.approx(_losses(straight_run), rel=1e-6)


def test_bf16_autocast_path_runs_on_cpu(tmp_path, demo_folder, straight_run):
    raw = _raw(demo_folder, tmp_path / "run", max_steps=3, mixed_precision="bf16")
    result = train(build_config(raw))
    bf16, fp32 = _losses(result.run_dir), _losses(straight_run)[:3]
    assert bf16 != fp32  # autocast really ran in bf16 ...
    assert bf16 == pytest.approx(fp32, rel=0.05)  # ... and computed the same loss


def test_nonfinite_gradients_skip_steps_then_stop(tmp_path, demo_folder, monkeypatch):
    raw = _raw(demo_folder, tmp_path / "run", max_steps=6, max_nonfinite_steps=2)
    raw["checkpoint"]["every_steps"] = 2
    real_step = DenoiseMethod.step
    calls = []

    def poisoned(*args, **kwargs):
        out = real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3 or len(calls) >= 5:  # step 3 once, then steps 5 and 6 in a row
            return replace(out, loss=out.loss * float("nan"))
        return out

    monkeypatch.setattr(DenoiseMethod, "step", poisoned)
    with pytest.raises(FloatingPointError, match="2 non-finite steps in a row"):
        train(build_config(raw))
    kept = _weights(tmp_path / "run", 4)
    assert all(torch.isfinite(t).all() for t in kept.values())
    assert (
        json.loads((tmp_path / "run/checkpoints/step-00000004/state.json").read_text())["train"][
            "steps_skipped"
        ]
        == 1
    )


def test_train_under_torchrun_needs_a_parallel_strategy(tmp_path, demo_folder, monkeypatch):
    """Without parallel.strategy every rank would train its own copy into one run directory."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="parallel.strategy is none, but torchrun started 2"):
        train(build_config(_raw(demo_folder, tmp_path / "run")))
    assert not (tmp_path / "run").exists()  # refused before anything was written
