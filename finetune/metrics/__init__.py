"""Metrics: where each step's record goes (sinks.py, trackers.py) and the step measurements (measures.py).

A plain re-export. Reading a run's metrics.jsonl back is the run directory's job (finetune/run/directory.py).
"""

from finetune.metrics.measures import (
    PEAK_BF16_FLOPS,
    Stopwatch,
    WeightSamples,
    flops_per_token,
    mfu,
    model_depth_width,
    peak_flops,
    peak_memory_mb,
    update_ratio,
    update_sums,
    weight_sample,
)
from finetune.metrics.sinks import (
    INSTALL_HINT,
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    Sink,
    format_window,
    open_sinks,
    scalars,
    warn,
    window_loss,
)

__all__ = [
    "INSTALL_HINT", "PEAK_BF16_FLOPS", "ConsoleSink", "JsonlSink", "MetricsLogger", "Sink", "Stopwatch", "WeightSamples",
    "flops_per_token", "format_window", "mfu", "model_depth_width", "open_sinks", "peak_flops", "peak_memory_mb", "scalars",
    "update_ratio", "update_sums", "warn", "weight_sample", "window_loss",
]
