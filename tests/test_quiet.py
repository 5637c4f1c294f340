"""impasto drops two import-time messages of its dependencies (torchao's Enum registration
through torch's pytree, diffusers' stale torchao tensor classes) and nothing else."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from impasto.quiet import _NOISE, _DropContaining, quiet_dependency_noise


def test_importing_the_models_prints_nothing_on_stderr():
    code = "import impasto.models, diffusers.quantizers.torchao.torchao_quantizer"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_only_the_named_messages_are_dropped():
    quiet_dependency_noise()
    quiet_dependency_noise()  # idempotent: one filter per logger
    for name, text in _NOISE.items():
        logger, kept = logging.getLogger(name), _Keep()
        assert sum(isinstance(f, _DropContaining) for f in logger.filters) == 1
        logger.addHandler(kept)  # torch's loggers do not propagate to the root
        try:
            logger.warning("%s: %s", "class", text)
            logger.warning("something else went wrong")
        finally:
            logger.removeHandler(kept)
        assert kept.messages == ["something else went wrong"]
