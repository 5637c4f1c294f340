"""``impasto bench``: the report's FLOP count, rows and CLI (speed itself is measured in
benchmarks/RESULTS.md, never asserted in tests); ``--parallel`` on 2 CPU processes (gloo)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from impasto.bench import format_report, run_bench
from impasto.bench.parallel import ParallelRequest, bench_rank
from impasto.bench.step import ImpastoStep, bench_config, synthetic_batch
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


def test_a_variant_that_runs_out_of_memory_is_reported_and_the_rest_measured(monkeypatch):
    import impasto.bench as bench

    class FitsNot(ImpastoStep):
        def __init__(self, config, device, group=None) -> None:
            if config.memory.fused_backward:  # the "fused" variant
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            super().__init__(config, device, group)

    monkeypatch.setattr(bench, "ImpastoStep", FitsNot)
    report = run_bench("tiny", batch=2, steps=1, warmup=0, rounds=2, variants=["fused", "lora"])
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ["diffusers", "fused", "lora"]
    assert rows["fused"]["error"] == "out of memory" and rows["fused"]["step_ms"] is None
    assert rows["lora"]["error"] is None and rows["lora"]["step_ms"] > 0
    assert "fused          out of memory" in format_report(report)


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


def test_json_file_holds_the_report_the_table_prints(capsys, tmp_path, monkeypatch) -> None:
    """``--json-file``: the JSON in a file and the table on screen, from one run (run.sh keeps
    both without a second process); a path it could not write is refused before timing."""
    args = ["bench", "--steps", "1", "--warmup", "0", "--variants", "default", "lora_r32"]
    assert main([*args, "--json-file", str(tmp_path / "bench.json")]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [row["name"] for row in report["rows"]] == ["diffusers", "default", "lora_r32"]
    assert capsys.readouterr().out.strip() == format_report(report)

    timed = []
    monkeypatch.setattr("impasto.bench.run_bench", lambda **kwargs: timed.append(kwargs))
    for path, problem in [
        (tmp_path / "missing" / "bench.json", "does not exist; create it first"),
        (tmp_path, "is a folder"),
    ]:
        assert main([*args, "--json-file", str(path)]) == 2
        assert problem in capsys.readouterr().err
    assert timed == []


def test_a_parallel_rank_reports_baseline_and_scaling_in_one_process() -> None:
    """:func:`bench_rank` outside torchrun: a group of one (so the test needs no launch)."""
    report = bench_rank(ParallelRequest("fsdp", "tiny", 64, 2, 2, 0, 1, "auto", "cpu"))
    assert (report["strategy"], report["world"]) == ("fsdp", 1)
    assert report["threads"] == torch.get_num_threads()  # one rank: left as it was
    (row,) = report["rows"]
    assert row["name"] == "default" and row["peak_memory_gib"] is None
    assert row["baseline_min_ms"] <= row["baseline_step_ms"] <= row["baseline_max_ms"]
    assert row["min_ms"] <= row["step_ms"] <= row["max_ms"]
    assert row["samples_per_s"] == pytest.approx(2e3 / row["step_ms"])
    assert row["speedup"] == pytest.approx(row["samples_per_s"] / row["baseline_samples_per_s"])
    assert row["efficiency"] == pytest.approx(row["speedup"])  # world 1
    assert "strategy fsdp, world 1" in format_report(report)


@pytest.mark.slow  # a launch of 2 processes: 15-60 s on 2 cores
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cli_parallel_launches_two_cpu_ranks(strategy: str) -> None:
    command = [sys.executable, "-m", "impasto", "bench", "--model", "tiny", "--parallel",
               strategy, "--nproc", "2", "--steps", "2", "--warmup", "1"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    header = re.search(r"strategy (\w+), world (\d+)", done.stdout)
    assert header and header.groups() == (strategy, "2"), done.stdout
    number = r"\s+([\d.]+)"
    rows = {
        match[1]: [float(value) for value in match.groups()[1:]]
        for match in re.finditer(rf"^default\s+(\S+ ×\d+){number * 6}%", done.stdout, re.M)
    }
    base, parallel = rows["none ×1"], rows[f"{strategy} ×2"]
    step_ms, low, high, samples_per_s, speedup, efficiency = parallel
    assert base[3] > 0 and samples_per_s > 0 and speedup > 0 and efficiency > 0
    assert low <= step_ms <= high
    assert samples_per_s == pytest.approx(2 * 2 * 1e3 / step_ms, rel=0.01)  # batch 2 × world 2
    assert speedup == pytest.approx(samples_per_s / base[3], rel=0.01)
    assert efficiency == pytest.approx(100 * speedup / 2, abs=0.1)


def test_cli_parallel_errors(capsys, monkeypatch) -> None:
    assert main(["bench", "--parallel", "zero"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown --parallel 'zero'; valid: ddp, fsdp" in err
    assert main(["bench", "--parallel", "ddp", "--nproc", "0"]) == 2
    assert "--nproc 0; use 1 or more" in capsys.readouterr().err
    assert main(["bench", "--set", "parallel.strategy=ddp"]) == 2
    assert "choose the strategy with --parallel" in capsys.readouterr().err
    assert main(["bench", "--parallel", "ddp", "--variants", "fused"]) == 2
    assert "memory.fused_backward steps each weight" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["bench", "--parallel", "ddp", "--nproc", "4"]) == 2
    assert "--nproc 4 but torchrun started 2 processes" in capsys.readouterr().err
