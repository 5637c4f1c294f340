"""Reading finished (or running) runs back: ``impasto runs list | summary | plot``.

Everything here reads what a run wrote and changes nothing: ``config.yaml`` (the resolved
config), ``metrics.jsonl`` (one record per logged step), the checkpoints' ``state.json``, the
sample grids and the bad-data report ``bad-data.tsv``. The numbers a summary shows are those of
``metrics.jsonl``, the newest checkpoint and the report, so they equal what the run logged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impasto.checkpoint.state import STATE_FILE, list_checkpoints
from impasto.config.load import read_yaml
from impasto.data.skips import BAD_DATA_FILE, BadDataCounts, count_bad_data
from impasto.logging.metrics import METRICS_FILE
from impasto.train.run_lock import is_locked

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
SAMPLES = "samples"
# The metrics a plot draws, each on its own axes, in this order (those a run logged).
PLOTTED = ("loss", "val/loss", "lr")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``RUN/metrics.jsonl`` in order; a line torn by a crash is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def is_run(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (
        (path / METRICS_FILE).is_file() or (path / CHECKPOINTS).is_dir()
    )


def find_runs(root: Path, depth: int = 3) -> list[Path]:
    """The run directories at or under ``root`` (``depth`` levels at most), sorted."""
    root = Path(root)
    if is_run(root):
        return [root]
    if depth == 0 or not root.is_dir():
        return []
    found = []
    for child in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if child.name.startswith("previous-"):
            continue  # an archived earlier run lives inside its run's folder
        found.extend(find_runs(child, depth - 1))
    return found


def _config(run_dir: Path) -> dict[str, Any]:
    try:
        config = read_yaml(run_dir / CONFIG_FILE)
    except (ValueError, OSError):
        return {}
    return config if isinstance(config, dict) else {}


def _state(checkpoint: Path) -> dict[str, Any]:
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


@dataclass(frozen=True)
class RunSummary:
    """What a run did, from its files."""

    run_dir: Path
    status: str  # running | finished | stopped | not started
    step: int  # of the newest checkpoint (what a resume continues from)
    logged_step: int  # of the last metrics record
    total_steps: int | None  # train.max_steps (None: the run is bounded by epochs)
    images: int | None  # samples trained on, at the newest checkpoint
    elapsed_s: float | None  # training time, from the last record's elapsed_s
    images_per_s: float | None  # mean over the logged steps
    mfu: float | None  # mean over the logged steps that report it
    loss: float | None  # the last logged training loss
    best_val: tuple[float, int] | None  # (lowest val_key, its step)
    val_key: str = "val/loss"  # val/loss, or the first named set's val/NAME/loss
    checkpoints: list[Path] = field(default_factory=list)
    grids: list[Path] = field(default_factory=list)
    bad_data: BadDataCounts = BadDataCounts()  # the rows of bad-data.tsv, by kind

    def lines(self) -> list[str]:
        total = f"/{self.total_steps}" if self.total_steps else ""
        lines = [f"{self.run_dir}: {self.status}, step {self.step}{total}"]
        figures = []
        if self.images is not None:
            figures.append(f"{self.images} images")
        if self.elapsed_s is not None:
            figures.append(f"{_duration(self.elapsed_s)} training")
        if self.images_per_s is not None:
            figures.append(f"{self.images_per_s:.3g} img/s")
        if self.mfu is not None:
            figures.append(f"MFU {self.mfu:.1%}")
        if figures:
            lines.append("  " + ", ".join(figures))
        if self.loss is not None:
            lines.append(f"  last loss {self.loss:.4g} (step {self.logged_step})")
        if self.best_val is not None:
            value, step = self.best_val
            lines.append(f"  best {self.val_key} {value:.4g} at step {step}")
        if self.checkpoints:
            names = ", ".join(path.name for path in self.checkpoints)
            lines.append(f"  checkpoints: {names}")
        if self.grids:
            lines.append(f"  samples: {len(self.grids)} grids, newest {self.grids[-1]}")
        if self.bad_data.num_left_out or self.bad_data.num_reencoded:
            report = self.run_dir / BAD_DATA_FILE
            lines.append(f"  bad data: {bad_data_text(self.bad_data)}; see {report}")
        return lines


def bad_data_text(counts: BadDataCounts) -> str:
    """``2 items left out, 1 text embedding re-encoded (damaged in the cache)``."""
    parts = []
    if counts.num_left_out:
        parts.append(f"{_count(counts.num_left_out, 'item')} left out")
    if counts.num_reencoded:
        embeddings = _count(counts.num_reencoded, "text embedding")
        parts.append(f"{embeddings} re-encoded (damaged in the cache)")
    return ", ".join(parts)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def run_status(run_dir: Path, step: int, total_steps: int | None) -> str:
    if is_locked(run_dir):
        return "running"
    if step == 0:
        return "not started"
    if total_steps is not None and step >= total_steps:
        return "finished"
    return "stopped"


def summarize_run(run_dir: str | Path) -> RunSummary:
    """The :class:`RunSummary` of the run in ``run_dir``; a one-line error if it is none."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ValueError(f"{run_dir}: does not exist; check the run directory's path")
    if not is_run(run_dir):
        raise ValueError(
            f"{run_dir}: not an impasto run (no {CONFIG_FILE} with {METRICS_FILE} or "
            f"{CHECKPOINTS}/); `impasto runs list DIR` finds the runs under a folder"
        )
    records = read_metrics(run_dir)
    checkpoints = list_checkpoints(run_dir / CHECKPOINTS)
    state = _state(checkpoints[-1]).get("train", {}) if checkpoints else {}
    step = int(state.get("step", 0))
    train = _config(run_dir).get("train") or {}
    total = train.get("max_steps") if isinstance(train.get("max_steps"), int) else None
    last = records[-1] if records else {}
    val_key = validation_key(records)
    validation = [(r[val_key], r["step"]) for r in records if _finite([r.get(val_key)])]
    throughput = _finite([r.get("samples_per_s") for r in records])
    mfu = _finite([r.get("mfu") for r in records])
    grids = sorted((run_dir / SAMPLES).glob("step-*.png")) if (run_dir / SAMPLES).is_dir() else []
    return RunSummary(
        run_dir=run_dir,
        status=run_status(run_dir, step, total),
        step=step,
        logged_step=int(last.get("step", 0)),
        total_steps=total,
        images=int(state["samples_seen"]) if "samples_seen" in state else None,
        elapsed_s=last.get("elapsed_s") if _finite([last.get("elapsed_s")]) else None,
        images_per_s=sum(throughput) / len(throughput) if throughput else None,
        mfu=sum(mfu) / len(mfu) if mfu else None,
        loss=last.get("loss") if _finite([last.get("loss")]) else None,
        best_val=min(validation) if validation else None,
        val_key=val_key,
        checkpoints=checkpoints,
        grids=grids,
        bad_data=count_bad_data(run_dir / BAD_DATA_FILE),
    )


def validation_key(records: list[dict[str, Any]]) -> str:
    """``val/loss`` (the held-out split), else the first named set's ``val/NAME/loss``."""
    keys = {key for record in records for key in record}
    if "val/loss" in keys:
        return "val/loss"
    named = sorted(k for k in keys if k.startswith("val/") and k.endswith("/loss"))
    named = [k for k in named if not k.startswith("val/ema/")]
    return named[0] if named else "val/loss"


def list_runs(root: str | Path) -> list[str]:
    """One line per run under ``root``: its folder, status and step."""
    if not Path(root).exists():
        raise ValueError(f"{root}: does not exist; name the folder that holds the runs")
    runs = find_runs(Path(root))
    if not runs:
        raise ValueError(f"{root}: no impasto runs in it (a run folder holds {CONFIG_FILE})")
    lines = []
    for run_dir in runs:
        summary = summarize_run(run_dir)
        total = f"/{summary.total_steps}" if summary.total_steps else ""
        loss = f"  loss {summary.loss:.4g}" if summary.loss is not None else ""
        lines.append(f"{run_dir}  {summary.status}  step {summary.step}{total}{loss}")
    return lines


def plot_series(run_dirs: list[Path]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """metric → run label → (steps, values): what :func:`plot_runs` draws, for each metric in
    :data:`PLOTTED` that at least one run logged."""
    series: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    labels = _labels(run_dirs)
    for run_dir, label in zip(run_dirs, labels, strict=True):
        records = read_metrics(run_dir)
        for metric in PLOTTED:
            key = validation_key(records) if metric == "val/loss" else metric
            points = [(r["step"], float(r[key])) for r in records if _finite([r.get(key)])]
            if points:
                steps, values = zip(*points, strict=True)
                series.setdefault(metric, {})[label] = (list(steps), list(values))
    return series


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run's shortest distinguishing name: its folder, or more of its path when two
    folders share a name."""
    names = [path.name for path in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(path) for path in run_dirs]


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Draw the loss, validation loss and lr of ``run_dirs`` on shared step axes into ``out``
    (a PNG), one panel per metric, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise ValueError(
            "impasto runs plot draws with matplotlib: pip install matplotlib (or, in the "
            "impasto checkout, pip install -e '.[plot]')"
        ) from None
    paths = [Path(run_dir) for run_dir in run_dirs]
    for path in paths:
        if not path.exists():
            raise ValueError(f"{path}: does not exist; check the run directory's path")
        if not is_run(path):
            raise ValueError(f"{path}: not an impasto run (no {CONFIG_FILE} and {METRICS_FILE})")
    series = plot_series(paths)
    if not series:
        raise ValueError(f"{', '.join(map(str, paths))}: no metrics logged yet; nothing to plot")
    figure, axes = pyplot.subplots(len(series), 1, figsize=(8, 2.8 * len(series)), sharex=True)
    axes = [axes] if len(series) == 1 else list(axes)
    for axis, (metric, runs) in zip(axes, series.items(), strict=True):
        for label, (steps, values) in runs.items():
            axis.plot(steps, values, label=label, linewidth=1.2)
        axis.set_ylabel(metric)
        axis.grid(alpha=0.3)
        if metric == "lr":
            axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if len(runs) > 1 or metric == next(iter(series)):
            axis.legend(fontsize="small")
    axes[-1].set_xlabel("step")
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    pyplot.close(figure)
    return out
