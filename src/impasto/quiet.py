"""Silence two import-time messages of impasto's dependencies that tell a user nothing.

With torchao 0.18 installed (the ``quant`` extra), importing diffusers 0.42 logs, on every
command, that torchao registers Enum constants the deprecated way (torch's ``_pytree``) and
that torchao's old tensor classes are gone (diffusers' torchao quantizer, which impasto does
not use: its float8/int8 base goes through torchao directly). Filters drop exactly these
records; every other message of those loggers still shows.
"""

from __future__ import annotations

import logging

_NOISE = {
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
}


class _DropContaining(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_dependency_noise() -> None:
    """Install the filters (idempotent; loggers that do not exist yet are created empty)."""
    for name, text in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropContaining) for f in logger.filters):
            logger.addFilter(_DropContaining(text))
