"""Metrics sinks (JSONL, TensorBoard) and progress display."""

from impasto.logging.metrics import METRICS_FILE, MetricsLogger, truncate_jsonl

__all__ = ["METRICS_FILE", "MetricsLogger", "truncate_jsonl"]
