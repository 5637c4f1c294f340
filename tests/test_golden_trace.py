"""The golden trace: fixed tiny runs whose every loss and final weights must never change.

Issue #13 rebuilds the trainer's joints (backbone protocol, method registry, Stateful
checkpoints) without changing a single number it computes. Each case below trains 8 steps on
CPU with one thread and compares every step's loss (bit for bit, as JSON floats) and a SHA-256
of the final checkpoint's tensors with ``tests/golden/trace.json``.

A change that is *meant* to change the numbers regenerates the file with
``IMPASTO_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_trace.py`` and says why in its
commit. Values are bitwise within one machine kind (x86-64, this torch build); another CPU or
torch version may differ in the last bits, which is why the thread count is fixed here.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from impasto.config import build_config
from impasto.data.demo import write_demo_dataset
from impasto.train import train

GOLDEN = Path(__file__).parent / "golden" / "trace.json"
UPDATE = os.environ.get("IMPASTO_UPDATE_GOLDEN") == "1"
NUM_STEPS = 8

# name → overrides of the base run (section → keys).
CASES: dict[str, dict[str, dict[str, Any]]] = {
    "eps": {},
    "v_ztsnr_min_snr": {
        "objective": {
            "prediction_type": "v_prediction",
            "zero_terminal_snr": True,
            "loss_weighting": "min_snr",
        },
    },
    "flow": {
        "objective": {"prediction_type": "flow", "timestep_sampling": "logit_normal"},
        "sample": {"sampler": "euler"},
    },
    "lora": {
        "parts": {"unet": "lora", "text_encoder": "lora"},
        "lora": {"rank": 4, "dropout": 0.1},
        "data": {"caption_dropout": 0.2, "shuffle_tags": True},
    },
    "buckets_disk_cache": {
        "data": {"buckets": "generated", "bucket_step": 16, "random_flip": True},
        "cache": {"latents": "disk", "text_embeddings": "disk", "dtype": "float32"},
    },
    "accum_ema": {
        "train": {"grad_accum_steps": 2},
        "ema": {"enabled": True, "decay": 0.9, "warmup": "power"},
        "optim": {"lr_schedule": "cosine", "warmup_steps": 2},
    },
}


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory) -> Path:
    """12 demo images at three aspect ratios (for the bucketed case; square ones for the rest)."""
    folder = tmp_path_factory.mktemp("golden") / "data"
    write_demo_dataset(folder, num_images=12, size=64, seed=0)
    sizes = [(64, 64), (48, 80), (80, 48)]
    for i, path in enumerate(sorted(folder.glob("*.png"))):
        height, width = sizes[i % len(sizes)]
        with Image.open(path) as image:
            image.resize((width, height)).save(path)
    return folder


def _raw(data: Path, run_dir: Path, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"preset": "tiny"},
        "data": {"path": str(data), "resolution": 64, "batch_size": 3},
        "optim": {"lr": 1e-3, "weight_decay": 0.01},
        "train": {"output_dir": str(run_dir), "seed": 7, "max_steps": NUM_STEPS},
        "checkpoint": {"every_steps": NUM_STEPS, "keep_last": 1},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return raw


def weights_digest(checkpoint: Path) -> str:
    """SHA-256 over every tensor (name, dtype, shape, bytes) of a checkpoint's safetensors."""
    digest = hashlib.sha256()
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors = load_file(file)
        for name in sorted(tensors):
            tensor = tensors[name].contiguous()
            digest.update(f"{file.stem}/{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_case(name: str, data: Path, run_dir: Path) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(build_config(_raw(data, run_dir, CASES[name])), resume=False)
    finally:
        torch.set_num_threads(threads)
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    return {"losses": losses, "weights": weights_digest(result.last_checkpoint)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_trace(name, mixed_folder, tmp_path):
    trace = run_case(name, mixed_folder, tmp_path / "run")
    assert len(trace["losses"]) == NUM_STEPS
    stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if UPDATE:
        stored[name] = trace
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    assert name in stored, f"no golden trace for {name}; run with IMPASTO_UPDATE_GOLDEN=1"
    assert trace["losses"] == stored[name]["losses"]
    assert trace["weights"] == stored[name]["weights"]
