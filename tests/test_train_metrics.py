"""What a run logs besides the loss (issue #18): the loss per timestep bucket, each part's LR,
the data wait, memory, skipped steps and the training time (continued by a resume); a
checkpoint every so many minutes; and the run summary at the end and on a stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from impasto.config import build_config
from impasto.logging.progress import step_line
from impasto.runs import summarize_run
from impasto.train.methods import denoise, subset_mean, time_bucket_metrics
from impasto.train.step_metrics import IntervalMeter, group_lrs, subset_means
from impasto.train.trainer import Trainer, train


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_by_time_bucket_is_a_sum_and_count_per_bucket():
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0])
    fractions = torch.tensor([0.1, 0.3, 0.3, 0.999])
    metrics = time_bucket_metrics(losses, fractions, 4)
    assert {name: value.tolist() for name, value in metrics.items()} == {
        "loss_t0": [1.0, 1.0], "loss_t1": [5.0, 2.0], "loss_t2": [0.0, 0.0],
        "loss_t3": [4.0, 1.0],
    }  # fmt: skip
    assert subset_mean(losses, losses > 2).tolist() == [7.0, 2.0]
    # Summed over an interval, then sum / count; an empty bucket is left out.
    meter = IntervalMeter()
    meter.add_subsets(metrics)
    meter.add_subsets(time_bucket_metrics(torch.tensor([6.0]), torch.tensor([0.0]), 4))
    names = list(meter.subsets)
    flat = torch.cat([meter.subsets[name] for name in names]).tolist()
    assert subset_means(names, flat) == {"loss_t0": 3.5, "loss_t1": 2.5, "loss_t3": 4.0}


def test_one_bucket_is_the_loss(tiny_raw, monkeypatch):
    monkeypatch.setattr(denoise, "TIME_BUCKETS", 1)
    tiny_raw["train"]["max_steps"] = 2
    result = train(build_config(tiny_raw), resume=False)
    for record in records(result.run_dir):
        assert record["loss_t0"] == pytest.approx(record["loss"], rel=1e-6)


def test_a_run_logs_its_training_metrics(tiny_raw, capsys):
    tiny_raw["parts"] = {"unet": "lora", "text_encoder": "lora", "text_encoder_lr": 5e-4}
    tiny_raw["train"] |= {"max_steps": 4, "grad_accum_steps": 2}
    tiny_raw["log"]["every_steps"] = 2
    result = train(build_config(tiny_raw), resume=False)
    logged = records(result.run_dir)
    assert [r["step"] for r in logged] == [2, 4]
    # Without a progress bar, each logging step prints its line with the logged values.
    lines = [line for line in capsys.readouterr().out.splitlines() if "impasto: step " in line]
    assert len(lines) == len(logged)
    for line, record in zip(lines, logged, strict=True):
        assert line.startswith(f"impasto: step {record['step']}/4 loss {record['loss']:.4f} avg ")
        assert f" lr {record['lr']:.2e} grad {record['grad_norm']:.3g} " in line
        assert f" {record['samples_per_s']:.3g} img/s data " in line
    for record in logged:
        # CPU: FLOPs counted (2 micro-batches of the counted shape), no known peak: no MFU.
        assert record["tflops"] > 0 and "mfu" not in record
        assert record["lr/unet"] == pytest.approx(1e-3) and record["lr"] == record["lr/unet"]
        assert record["lr/text_encoder"] == pytest.approx(5e-4)
        assert 0 <= record["data_wait"] < 1 and record["steps_skipped"] == 0
        assert record["peak_rss_gib"] > 0.1  # torch and the tiny model
        # 2 steps x 2 micro-batches x 4 samples: 16 in the interval's buckets.
        buckets = [record[f"loss_t{b}"] for b in range(4) if f"loss_t{b}" in record]
        assert buckets and all(value > 0 for value in buckets)
    assert 0 < logged[0]["elapsed_s"] < logged[1]["elapsed_s"]


def test_the_line_a_logging_step_prints_without_a_bar():
    values = {"loss": 0.12345, "lr": 1.9e-3, "grad_norm": 0.41, "samples_per_s": 41.23}
    values |= {"data_wait": 0.021, "mfu": 0.3812, "peak_memory_gib": 21.34}
    assert step_line(250, 3000, values, 0.13012, 602.4) == (
        "impasto: step 250/3000 loss 0.1235 avg 0.1301 lr 1.90e-03 grad 0.41 41.2 img/s "
        "data 2% MFU 38.1% mem 21.3 GiB eta 0:10:02"
    )
    assert step_line(1, 10, {"loss": 1.0, "lr": 1e-4}, None, None) == (
        "impasto: step 1/10 loss 1.0000 lr 1.00e-04"
    )


def test_one_part_logs_no_per_part_lr():
    optimizer = torch.optim.SGD([{"params": [torch.zeros(1)], "name": "unet", "lr": 0.1}])
    assert group_lrs(optimizer) == {}


def test_training_time_continues_across_a_resume(tiny_raw):
    tiny_raw["train"]["max_steps"] = 2
    tiny_raw["checkpoint"]["every_steps"] = 2
    first = train(build_config(tiny_raw), resume=False)
    saved = json.loads((first.last_checkpoint / "state.json").read_text())
    assert "elapsed_s" not in saved["train"]  # the counters stay bitwise comparable
    elapsed = saved["run"]["elapsed_s"]
    assert elapsed >= records(first.run_dir)[-1]["elapsed_s"] > 0
    tiny_raw["train"]["max_steps"] = 3
    resumed = train(build_config(tiny_raw))
    assert records(resumed.run_dir)[-1]["elapsed_s"] > elapsed


def test_checkpoint_every_minutes_on_a_fake_clock(tiny_raw):
    tiny_raw["train"]["max_steps"] = 7
    tiny_raw["checkpoint"] = {"every_steps": 100, "every_minutes": 1.5, "keep_last": 10}
    trainer = Trainer(build_config(tiny_raw), resume=False)
    trainer.wall_clock = lambda: trainer.state.step * 40.0  # 40 s a step
    result = trainer.run()
    names = sorted(path.name for path in (result.run_dir / "checkpoints").iterdir())
    # 120 s after the start at step 3, 120 s after that at step 6; the final one at 7.
    assert names == ["step-00000003", "step-00000006", "step-00000007"]


def test_the_run_summary_is_printed_when_a_run_stops(tiny_raw, capsys):
    tiny_raw["data"]["validation_split"] = 0.25
    tiny_raw["eval"] = {"every_steps": 1, "timesteps": 2}
    trainer = Trainer(
        build_config(tiny_raw), resume=False, run_summary=lambda d: summarize_run(d).lines()
    )
    real_step = trainer.step

    def step_then_stop():
        values = real_step()
        trainer.stop.requested = trainer.state.step == 2  # as SIGTERM does
        return values

    trainer.step = step_then_stop
    result = trainer.run()
    out = capsys.readouterr().out
    assert result.interrupted and result.state.step == 2
    assert "impasto: stopped on request at step 2 in " in out
    summary = out[out.index(f"{result.run_dir}: ") :].splitlines()
    assert summary == summarize_run(result.run_dir).lines()  # what `impasto runs summary` says
    assert any(line.startswith("  best val/loss ") for line in summary)
    assert "  checkpoints: step-00000002" in summary
