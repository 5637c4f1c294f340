"""The golden trace: fixed tiny runs whose every loss and final weights must never change.

Issue #13 rebuilds the trainer's joints (backbone protocol, method registry, Stateful
checkpoints) without changing a single number it computes. Each case below trains 8 steps on
CPU with one thread and compares every step's loss (bit for bit, as JSON floats) and a SHA-256
of the final checkpoint's tensors with ``tests/golden/trace.json``.

A change that is *meant* to change the numbers regenerates the file with
``IMPASTO_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_trace.py`` and says why in its
commit. Bitwise holds for one machine kind: the file records the torch version and the CPU's
vector capability it was made with, and there the comparison is bit for bit (one thread, so
no reduction order depends on the core count). Another torch build or vector width (AVX2 vs
AVX-512 kernels) rounds differently in the last bits; there the losses and each weight file's
sum of |w| must agree to 1e-4 relative, which still catches any change of what is computed.
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


def machine() -> dict[str, str]:
    """What the bitwise values depend on besides the code."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


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


def weights_abs_sums(checkpoint: Path) -> dict[str, float]:
    """Each weights file's sum of |w| (float64): the cross-machine comparison."""
    sums = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors = load_file(file)
        sums[file.stem] = sum(float(t.double().abs().sum()) for t in tensors.values())
    return sums


def run_case(name: str, data: Path, run_dir: Path) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(build_config(_raw(data, run_dir, CASES[name])), resume=False)
    finally:
        torch.set_num_threads(threads)
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    checkpoint = result.last_checkpoint
    return {
        "losses": losses,
        "weights": weights_digest(checkpoint),
        "weight_abs_sums": weights_abs_sums(checkpoint),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_trace(name, mixed_folder, tmp_path):
    trace = run_case(name, mixed_folder, tmp_path / "run")
    assert len(trace["losses"]) == NUM_STEPS
    stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if UPDATE:
        stored[name] = trace
        stored["machine"] = machine()
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    assert name in stored, f"no golden trace for {name}; run with IMPASTO_UPDATE_GOLDEN=1"
    assert_matches(trace, stored[name], bitwise=stored["machine"] == machine())


def assert_matches(trace: dict[str, Any], golden: dict[str, Any], bitwise: bool) -> None:
    if bitwise:
        assert trace["losses"] == golden["losses"]
        assert trace["weights"] == golden["weights"]
        return
    assert trace["losses"] == pytest.approx(golden["losses"], rel=1e-4)
    assert trace["weight_abs_sums"] == pytest.approx(golden["weight_abs_sums"], rel=1e-4)


def test_another_machine_compares_to_tolerance(monkeypatch):
    """Off the recorded machine kind the comparison is to 1e-4, and still fails on a change."""
    golden = json.loads(GOLDEN.read_text())["eps"]
    assert_matches(golden, golden, bitwise=False)
    changed = {**golden, "losses": [loss * 1.001 for loss in golden["losses"]]}
    with pytest.raises(AssertionError):
        assert_matches(changed, golden, bitwise=False)
