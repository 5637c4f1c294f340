"""``benchmarks/gpu/run.sh``, the GPU campaign's one command (issue #19), checked on this CPU:
``DRY_RUN=1`` runs every stage with the tiny model, so a session with the lent GPU spends its
device time measuring, not debugging the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import report  # noqa: E402  (benchmarks/gpu/report.py)


def test_the_report_tables_every_row_and_a_variant_that_did_not_fit():
    bench = {
        "model": "sdxl", "resolution": 1024, "batch": 4, "precision": "bf16",
        "device": "NVIDIA H100 80GB HBM3", "tflop_per_image": 7.2, "rounds": 2, "steps": 10,
        "rows": [
            {"name": "diffusers", "step_ms": 900.0, "rounds_ms": [899.0, 901.0],
             "images_per_s": 4.44, "tflops": 32.0, "mfu": 0.0323, "peak_memory_gib": 61.2,
             "vs_diffusers": 1.0, "error": None},
            {"name": "fused", "step_ms": None, "images_per_s": None, "tflops": None,
             "mfu": None, "peak_memory_gib": None, "vs_diffusers": None,
             "error": "out of memory"},
        ],
    }  # fmt: skip
    text = report.markdown(
        {"stages": {"sdxl-1024": {"exit": 0, "seconds": 312}}, "sdxl-1024": bench}
    )
    assert "| sdxl-1024 | 0 | 312 |" in text
    assert "| diffusers | 900.0 | 899.0, 901.0 | 4.44 | 32.0 | 3.2% | 61.20 | 1.000 |" in text
    assert "| fused | out of memory |" in text


@pytest.mark.slow
def test_every_stage_runs_in_a_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = os.environ | {"DRY_RUN": "1", "PYTHON": sys.executable, "OUT": str(out)}
    env |= {"WORK": str(work), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/run.sh"), "all"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    stages = ["env", "ceilings", "tests", "sdxl-512", "sdxl-1024", "sdxl-1024-compile",
              "sdxl-1024-memory", "fsdp", "draftp", "cache", "train-cached", "dit-tiny",
              "dit-xl", "dit-video", "flux-lora"]  # fmt: skip
    assert list(results["stages"]) == stages
    assert all(results["stages"][stage]["exit"] == 0 for stage in stages)
    assert results["ceilings"]["copy"]["gbps"] > 0
    # a dry run selects the CUDA tests, which skip on a CPU
    summary = results["tests"]["summary"]
    assert " skipped" in summary and "failed" not in summary and results["tests"]["exit"] == 0
    names = [row["name"] for row in results["sdxl-512"]["rows"]]
    assert names == ["diffusers", "default", "lora_r32"]
    assert [row["name"] for row in results["sdxl-1024-compile"]["rows"]] == ["diffusers", "compile"]
    assert results["fsdp"]["strategy"] == "fsdp" and results["fsdp"]["world"] == 1
    steps = results["draftp"]["steps"]
    assert [step["step"] for step in steps] == [1, 2, 3]
    assert all(step["step_time"] > 0 and "reward" in step and "kl" in step for step in steps)
    assert results["cache"]["images"] == 8 and results["cache"]["images_per_s"] > 0
    trained = results["train-cached"]
    assert trained["steps"] == 4 and trained["step_time"] > 0 and 0 <= trained["data_wait"] < 1
    for stage in ("dit-tiny", "dit-xl"):  # dit-tiny in both: 3 images of 64² in a dry run
        dit = results[stage]
        assert dit["model"] == "dit-tiny" and dit["image_tokens"] == 46
        assert [(row["layout"], row["sequence_tokens"]) for row in dit["rows"]] == [
            ("padded", 128), ("packed", 128)
        ]  # fmt: skip
        assert len(dit["ratios"][0]["rounds"]) == 2  # at least 2 interleaved rounds
    video = results["dit-video"]  # the 7B's layout: one clip, packed alone (9 frames at 64²)
    assert video["model"] == "dit-video-tiny" and video["clips"]
    assert [(s["frames"], s["tokens"]) for s in video["shapes"]] == [(9, 48)]
    rows = [(row["variant"], row["layout"], row["sequence_tokens"]) for row in video["rows"]]
    assert rows == [("adafactor", "packed", 128)] and video["ratios"] == []
    flux = results["flux-lora"]  # FLUX.1-dev's stage: one square image, LoRA on a float8 base
    assert flux["model"] == "flux-tiny" and flux["image_tokens"] == 16
    assert [(row["variant"], row["layout"]) for row in flux["rows"]] == [("default", "packed")]
    assert set(flux["released_gib"]) == {"text_encoder", "text_encoder_2"}
    text = (out / "results.md").read_text()
    assert "## flux-lora" in text
    assert "## dit-video" in text and "| seed: NeMo DiT 7B | 8k | TP=2 SP | 10052 | 519 |" in text
    assert "## sdxl-1024-memory" in text and "## draftp at 64²" in text
    assert "## dit-xl" in text and "default: padded / packed step time" in text
    assert sorted(path.name for path in out.iterdir()) == ["log.txt", "results.json", "results.md"]


def test_the_report_tables_the_packed_against_padded_bench():
    bench = {
        "model": "dit-xl", "resolution": 256, "precision": "bf16", "device": "NVIDIA H100",
        "images": 48, "image_tokens": 11776, "flops_per_token": 3.4e9,
        "trained_parameters": 940_502_032, "rounds": 2, "steps": 10,
        "rows": [
            {"variant": "default", "layout": "padded", "sequence_tokens": 12288, "fill": 0.958,
             "step_ms": 110.0, "rounds_ms": [109.0, 111.0], "tokens_per_s": 107054.5,
             "tflops": 364.0, "mfu": 0.368, "peak_memory_gib": 40.5, "vs_padded": 1.0},
            {"variant": "default", "layout": "packed", "sequence_tokens": 11776, "fill": 1.0,
             "step_ms": None, "error": "out of memory"},
        ],
        "ratios": [{"variant": "default", "median": 1.04, "min": 1.03, "max": 1.05,
                    "rounds": [1.03, 1.05]}],
    }  # fmt: skip
    text = report.markdown({"stages": {"dit-xl": {"exit": 0, "seconds": 150}}, "dit-xl": bench})
    assert "| dit-xl | 0 | 150 |" in text and "3.4 GFLOP per image token" in text
    row = "| default | padded | 12288 | 95.8% | 110.0 | 109.0, 111.0 | 107054 | 364.0 | 36.8% |"
    assert row + " 40.50 | 1.000 |" in text
    assert "| default | packed | 11776 | 100.0% | out of memory |" in text
    assert "default: padded / packed step time 1.040 (median of 2 rounds, 1.030-1.050)" in text


def test_past_its_deadline_no_stage_starts_and_the_report_says_so(tmp_path):
    """``DEADLINE_S``: a stage that would start after it is skipped (a command killed at the
    device's 10-minute limit would bring back nothing of the stage it was in); the report
    names it, and the earlier stages' results, written after each one, stay."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = os.environ | {"DRY_RUN": "1", "PYTHON": sys.executable, "OUT": str(out)}
    env |= {"WORK": str(work), "OMP_NUM_THREADS": "1", "DEADLINE_S": "0"}
    work.mkdir()
    (work / "env.status.json").write_text('{"stage": "env", "exit": 0, "seconds": 3}')
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/run.sh"), "env", "ceilings"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "stage ceilings not started" in done.stdout
    stages = json.loads((out / "results.json").read_text())["stages"]
    assert stages == {
        "env": {"stage": "env", "exit": 0, "seconds": 3},  # an earlier call's: kept
        "ceilings": {"stage": "ceilings", "exit": "not started", "seconds": 0},
    }
    assert "| ceilings | not started | 0 |" in (out / "results.md").read_text()


def test_the_video_stage_is_tabled_per_gpu_beside_the_seeds_7b():
    bench = {
        "model": "dit-7b-video", "resolution": 256, "precision": "bf16", "device": "NVIDIA H100",
        "clips": True, "images": 1, "image_tokens": 8192, "flops_per_token": 35.2e9,
        "shapes": [{"frames": 125, "height": 256, "width": 256, "images": 1, "tokens": 8192}],
        "sequence_tokens": {"packed": 8192, "padded": 8192}, "trained_parameters": 7.61e9,
        "rounds": 2, "steps": 10,
        "rows": [
            {"variant": "adafactor", "layout": "packed", "sequence_tokens": 8192, "fill": 1.0,
             "step_ms": 1000.0, "rounds_ms": [999.0, 1001.0], "tokens_per_s": 8192.0,
             "tflops": 288.4, "mfu": 0.2915, "peak_memory_gib": 61.0, "vs_padded": None},
        ],
        "ratios": [],
    }  # fmt: skip
    text = report.markdown({"stages": {"dit-video": {"exit": 0, "seconds": 300}},
                            "dit-video": bench})  # fmt: skip
    assert "1 sample (1 × 125 frames of 256x256), 8192 sample tokens" in text
    assert "35.2 GFLOP per sample token" in text
    assert "| dit-7b-video, 1 GPU | 8192 | adafactor, packed | 8192 | 288.4 | 29.1% |" in text
    assert "| seed: NeMo DiT 7B | 8k | TP=2 SP | 10052 | 519 | 52.5% |" in text
    assert "| seed: NeMo DiT 7B | 8k | baseline, no optimization | - | OOM | - |" in text
