"""Metrics sinks (JSONL, TensorBoard, wandb), progress display, FLOPs and MFU, the profiler."""

from impasto.logging.flops import FlopMeter, peak_tflops, tflops_and_mfu
from impasto.logging.metrics import METRICS_FILE, MetricsLogger, truncate_jsonl
from impasto.logging.profiler import StepProfiler
from impasto.logging.system import peak_memory

__all__ = [
    "METRICS_FILE",
    "FlopMeter",
    "MetricsLogger",
    "StepProfiler",
    "peak_memory",
    "peak_tflops",
    "tflops_and_mfu",
    "truncate_jsonl",
]
