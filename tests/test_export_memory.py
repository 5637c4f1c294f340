"""Exports on a machine with little memory (issue #17): a single-file export never holds a cast
copy of the model, and a LoRA export never builds the model it adapts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file
from torch.profiler import ProfilerActivity, profile

from impasto.config import build_config
from impasto.export import ExportOptions, export_checkpoint
from impasto.models.single_file import load_single_file, save_single_file, sgm_state_dict
from impasto.train.trainer import train

KIB = 1 << 10


def peak_allocated_bytes(work: Callable[[], object]) -> int:
    """The most CPU tensor memory that ``work`` had allocated and not yet freed at any moment,
    from the allocator events of torch's profiler (views and copies alike are counted when
    their storage is allocated and freed, not when a Python name goes away)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    events = [event for event in prof.events() if event.self_cpu_memory_usage]
    live = peak = 0
    for event in sorted(events, key=lambda event: event.time_range.start):
        live += event.self_cpu_memory_usage  # + allocated by an op, - a free
        peak = max(peak, live)
    return peak


def test_fp16_single_file_export_casts_one_tensor_at_a_time(tiny, tmp_path):
    state = sgm_state_dict(tiny)
    fp16_sizes = [2 * t.numel() for t in state.values() if t.is_floating_point()]
    # What the key map itself builds (OpenCLIP's packed q/k/v, the transposed projection).
    key_map = peak_allocated_bytes(lambda: sgm_state_dict(tiny))
    budget = key_map + max(fp16_sizes) + 64 * KIB
    assert budget < sum(fp16_sizes) / 2  # a full fp16 copy of the model would not fit
    path = tmp_path / "model.safetensors"
    peak = peak_allocated_bytes(lambda: save_single_file(tiny, path, dtype=torch.float16))
    assert peak <= budget, f"{peak} bytes allocated at once, budget {budget}"
    loaded = load_single_file(path)
    expected = tiny.unet.state_dict()["conv_in.weight"].half().float()
    assert torch.equal(loaded.unet.state_dict()["conv_in.weight"], expected)


@pytest.mark.parametrize("fmt", ["lora-kohya", "lora-diffusers"])
def test_lora_export_never_builds_the_base_model(tiny_raw, tmp_path, monkeypatch, fmt):
    tiny_raw["train"] = {**tiny_raw["train"], "max_steps": 2, "output_dir": str(tmp_path / "r")}
    tiny_raw["checkpoint"]["every_steps"] = 2
    tiny_raw["parts"] = {"unet": "lora", "text_encoder": "lora", "text_encoder_2": "lora"}
    tiny_raw["lora"] = {"rank": 4}
    run = train(build_config(tiny_raw)).run_dir

    import impasto.checkpoint.trained as trained
    import impasto.models as models

    def refuse(*args, **kwargs):
        raise AssertionError("a LoRA export built or loaded the base model")

    monkeypatch.setattr(trained, "build_starting_backbone", refuse)
    monkeypatch.setattr(models, "load_components", refuse)
    materialized = []
    register_parameter = torch.nn.Module.register_parameter

    def spy(module: torch.nn.Module, name: str, param) -> None:
        register_parameter(module, name, param)
        if param is not None and not param.is_meta:
            materialized.append(f"{type(module).__name__}.{name}")

    monkeypatch.setattr(torch.nn.Module, "register_parameter", spy)
    out = tmp_path / ("lora.safetensors" if fmt == "lora-kohya" else "lora")
    path = export_checkpoint(run, fmt, out, ExportOptions("fp32"))
    assert materialized == []  # not one weight of any network was allocated
    names = {key.split(".")[0] for key in load_file(path)}
    if fmt == "lora-kohya":
        names = {name.split("_")[1] for name in names}  # lora_unet_…, lora_te1_…, lora_te2_…
        assert names == {"unet", "te1", "te2"}
    else:
        assert names == {"unet", "text_encoder", "text_encoder_2"}


def test_verbose_export_reports_time_and_peak_memory(tiny_raw, tmp_path, capsys):
    tiny_raw["train"] = {**tiny_raw["train"], "max_steps": 1, "output_dir": str(tmp_path / "r")}
    tiny_raw["checkpoint"]["every_steps"] = 1
    tiny_raw["parts"] = {"unet": "lora"}
    tiny_raw["lora"] = {"rank": 4}
    run = train(build_config(tiny_raw)).run_dir
    capsys.readouterr()
    options = ExportOptions("fp16", verbose=True)
    export_checkpoint(run, "lora-kohya", tmp_path / "lora.safetensors", options)
    report = capsys.readouterr().err.strip().splitlines()[-1]
    assert report.startswith("export: ") and " s, peak memory " in report, report
    peak_gib = float(report.split("peak memory ")[1].split(" GiB")[0])
    assert 0.05 < peak_gib < 64
