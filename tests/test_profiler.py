"""``log.profile`` (issue #18): a few toy steps traced on CPU into RUN/profile, and the table of
top ops printed at the end."""

from __future__ import annotations

from pathlib import Path

import torch

from impasto.config.schema import ProfileConfig
from impasto.logging.profiler import PROFILE_DIR, StepProfiler


def toy_steps(profiler: StepProfiler, num_steps: int) -> None:
    layer = torch.nn.Linear(32, 32)
    generator = torch.Generator().manual_seed(0)
    for _ in range(num_steps):
        x = torch.randn(8, 32, generator=generator, requires_grad=True)
        layer(x).square().mean().backward()
        profiler.step()


def traces(run_dir: Path) -> list[Path]:
    return sorted((run_dir / PROFILE_DIR).glob("*.pt.trace.json*"))


def test_the_window_is_traced_and_its_top_ops_printed(tmp_path, capsys) -> None:
    profiler = StepProfiler(ProfileConfig(wait=1, warmup=1, active=2), tmp_path, main=True)
    toy_steps(profiler, 6)  # steps 5 and 6 run after the window: not profiled
    assert profiler.stopped
    (trace,) = traces(tmp_path)
    assert '"aten::addmm"' in trace.read_text()
    profiler.close()
    out = capsys.readouterr().out
    assert "impasto: profile of steps 3-4 of this session" in out
    assert "aten::addmm" in out and "Self CPU" in out


def test_a_run_that_ends_before_the_window_records_nothing(tmp_path, capsys) -> None:
    profiler = StepProfiler(ProfileConfig(wait=2, warmup=1, active=2), tmp_path, main=True)
    toy_steps(profiler, 2)
    profiler.close()
    assert traces(tmp_path) == []
    assert "ended before step 4; nothing recorded" in capsys.readouterr().out


def test_no_profile_and_other_ranks_do_nothing(tmp_path, capsys) -> None:
    for profiler in (
        StepProfiler(None, tmp_path, main=True),
        StepProfiler(ProfileConfig(), tmp_path, main=False),
    ):
        assert profiler.profiler is None
        toy_steps(profiler, 6)
        assert profiler.table() is None
        profiler.close()
    assert not (tmp_path / PROFILE_DIR).exists()
    assert capsys.readouterr().out == ""
