"""The base of every config section, and the number types every section's fields use.

pydantic's lax mode reads ``true`` as ``1`` and YAML lets ``.inf`` through, so ``max_steps:
true`` trained one step and ``lr: .inf`` an all-NaN model (issue #16). So every number field of
a section is an :data:`Int` or a :data:`Float`, never a bare ``int`` or ``float``, and numbers
are read as pydantic's lax mode reads them, except that a boolean is never a number:

- :data:`Int` takes ``4``, ``4.0`` or ``"4"``; not ``true``, ``4.5`` or ``"four"``;
- :data:`Float` takes ``1``, ``0.5`` or ``"1e-4"`` (PyYAML reads ``1e-4``, without a dot, as
  a string); not ``true``;
- every float of a section is finite: :class:`Section` sets ``allow_inf_nan=False``, so
  ``.inf``, ``-.inf`` and ``.nan`` are refused wherever a float is read.

Integers that reach torch or numpy have upper bounds: seeds fit numpy's 32-bit global seed
(:data:`SEED_MAX`), steps :data:`MAX_STEPS`, image sides :data:`MAX_RESOLUTION`, so that an
absurd value is one config line instead of an overflow traceback in the middle of a run.
``tests/reliability/test_bad_configs.py`` sends ``true`` and ``.inf`` to every number field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

SEED_MAX = 2**32 - 1  # numpy's global seed (np.random.seed) takes 32 bits; torch's takes 64
MAX_STEPS = 10**9  # steps, intervals and warm-ups: ~30 years at 1 step per second
MAX_RESOLUTION = 16384  # pixels per image side; SDXL trains at 1024
MAX_SAMPLER_STEPS = 1000  # steps of one sampling chain; SDXL's DDPM has 1000 timesteps
MAX_BATCH = 65536  # images per batch (data.batch_size, cache.batch_size)
MAX_WORKERS = 256  # data loader processes
MAX_REPEATS = 10_000  # times an image appears per epoch


def _not_a_bool(value: Any) -> Any:
    # bool is a subclass of int, and pydantic's lax mode reads true as 1.0.
    if isinstance(value, bool):
        raise PydanticCustomError("number_type", "Input should be a number, not true or false")
    return value


def _an_integer(value: Any) -> Any:
    value = _not_a_bool(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)  # exact, so that 1e30 meets the upper bound, not a parse error
    return value


def _multiple_of_8(value: int) -> int:
    if value % 8:
        raise ValueError(f"must be a multiple of 8 (the VAE downsamples by 8), got {value}")
    return value


Int = Annotated[int, BeforeValidator(_an_integer)]
"""An integer (``4``, ``4.0``, ``"4"``); never ``true`` / ``false`` or ``4.5``."""

Float = Annotated[float, BeforeValidator(_not_a_bool)]
"""A finite number (finiteness comes from :class:`Section`); never ``true`` / ``false``."""

Seed = Annotated[Int, Field(ge=0, le=SEED_MAX)]
"""A seed of torch's and numpy's generators: 0 .. 2**32 - 1."""


class _PathMark:
    """Marks the config fields that hold a path (:mod:`impasto.config.paths` resolves them)."""

    def __repr__(self) -> str:
        return "PATH_MARK"


PATH_MARK = _PathMark()

PathStr = Annotated[str, Field(min_length=1), PATH_MARK]
"""A file or folder path: an empty one would silently mean the working directory. A relative
one is made absolute when the config loads (:mod:`impasto.config.paths`)."""

Resolution = Annotated[Int, Field(ge=8, le=MAX_RESOLUTION), AfterValidator(_multiple_of_8)]
"""An image side in pixels: a multiple of 8 (the VAE's downsampling), at most 16384."""


class Section(BaseModel):
    """A config section: unknown keys are errors, values never change after loading, and
    floats are finite (``allow_inf_nan=False`` applies to every float field, nested ones too)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
