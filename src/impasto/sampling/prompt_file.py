"""Prompt files for sampling: one prompt per line, with kohya sd-scripts' per-prompt options.

The format of kohya's ``--sample_prompts`` ``.txt`` files (``library/train_util.py``,
``line_to_prompt_dict``), so a file written for kohya works here::

    # validation prompts
    a red circle on a white background --n blurry, low quality --d 7
    a blue square --w 64 --h 32 --s 20 --l 4.5

Each line is stripped; blank lines and lines starting with ``#`` are skipped. A line is split at
every ``" --"``: the first piece is the prompt, each other piece an option, its name up to the
first space (any case) and its value the rest (so a negative prompt may hold spaces):

======  ===================  =====================================================
option  sets                 value
======  ===================  =====================================================
``n``   negative prompt      any text
``w``   width                pixels, a multiple of 8, 8 to 16384
``h``   height               pixels, a multiple of 8, 8 to 16384
``s``   sampler steps        1 to 1000
``d``   seed                 0 to 2**32 − 1 (image i of the prompt uses seed + i)
``l``   guidance scale       a finite number >= 0
======  ===================  =====================================================

Unlike kohya, which skips what it cannot read, an unknown option, a missing or bad value or an
option given twice is a one-line ``ValueError`` naming ``FILE:LINE``. Options a line leaves out
take the defaults of whoever samples (``impasto sample``'s flags, the run's ``sample`` section).
Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

MAX_SIDE = 16384  # pixels per image side, as the config's Resolution
SIDE_MULTIPLE = 8  # SDXL's VAE downsamples by 8
MAX_STEPS = 1000  # sampler steps, as the config's MAX_SAMPLER_STEPS
SEED_MAX = 2**32 - 1  # as the config's seeds
OPTION_SEPARATOR = " --"
COMMENT = "#"


@dataclass(frozen=True)
class PromptOptions:
    """What one prompt may set for itself (kohya's options); None takes the default."""

    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    num_steps: int | None = None
    seed: int | None = None
    guidance_scale: float | None = None

    def over(self, defaults: PromptOptions) -> PromptOptions:
        """These options where set, else those of ``defaults``."""
        mine = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(
            defaults, **{name: value for name, value in mine.items() if value is not None}
        )


@dataclass(frozen=True)
class SamplePrompt:
    """A prompt to sample, its own options, and where it was written (``FILE:LINE``; None for
    a prompt given on the command line or in the config's ``sample.prompts``)."""

    text: str
    options: PromptOptions = PromptOptions()
    where: str | None = None


def _side(value: str) -> int:
    side = _integer(value, 8, MAX_SIDE)
    if side % SIDE_MULTIPLE:
        raise ValueError(f"must be a multiple of {SIDE_MULTIPLE} (the VAE downsamples by 8)")
    return side


def _integer(value: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError("must be an integer") from None
    if not low <= number <= high:
        raise ValueError(f"must be between {low} and {high}")
    return number


def _steps(value: str) -> int:
    return _integer(value, 1, MAX_STEPS)


def _seed(value: str) -> int:
    return _integer(value, 0, SEED_MAX)


def _scale(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError("must be a number") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError("must be a finite number >= 0")
    return number


def _text(value: str) -> str:
    return value


# option name → (the PromptOptions field it sets, the parser of its value)
PROMPT_OPTIONS: dict[str, tuple[str, Callable[[str], object]]] = {
    "n": ("negative_prompt", _text),
    "w": ("width", _side),
    "h": ("height", _side),
    "s": ("num_steps", _steps),
    "d": ("seed", _seed),
    "l": ("guidance_scale", _scale),
}


def _valid_options() -> str:
    return ", ".join(f"--{name}" for name in PROMPT_OPTIONS)


def parse_prompt_line(line: str, where: str) -> SamplePrompt | None:
    """The prompt of one prompt-file line, or None for a blank or ``#`` comment line.

    ``where`` (``FILE:LINE``) starts every error message.
    """
    line = line.strip()
    if not line or line.startswith(COMMENT):
        return None
    text, *pieces = line.split(OPTION_SEPARATOR)
    text = text.strip()
    if not text or text.startswith("--"):
        raise ValueError(f"{where}: no prompt before the options; write the prompt first")
    values: dict[str, object] = {}
    for piece in pieces:
        name, _, value = piece.strip().partition(" ")
        name, value = name.lower(), value.strip()
        if name not in PROMPT_OPTIONS:
            raise ValueError(
                f"{where}: unknown option --{name}; valid: {_valid_options()} "
                "(options start with ' --' after the prompt)"
            )
        field, parse = PROMPT_OPTIONS[name]
        if field in values:
            raise ValueError(f"{where}: option --{name} is given twice; keep one")
        if not value:
            raise ValueError(f"{where}: option --{name} needs a value, e.g. --{name} VALUE")
        try:
            values[field] = parse(value)
        except ValueError as error:
            raise ValueError(f"{where}: --{name} {value}: {error}") from None
    return SamplePrompt(text, PromptOptions(**values), where)


def parse_prompt_text(text: str, name: str) -> list[SamplePrompt]:
    """The prompts of a prompt file's ``text``; ``name`` (the file) starts error messages."""
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        prompt = parse_prompt_line(line, f"{name}:{number}")
        if prompt is not None:
            prompts.append(prompt)
    return prompts


def _missing_way_out(setting: str | None) -> str:
    if setting is None:
        return "check the path"
    if setting.startswith("--"):  # a command-line option: most likely a typo
        return f"check the path given to {setting}"
    return f"put the file back there or point {setting} at it"


def read_prompt_file(path: str | Path, setting: str | None = None) -> list[SamplePrompt]:
    """The prompts of the UTF-8 prompt file ``path``: at least one, or a one-line error.

    ``setting``: the option or config setting that named the file (``--prompts-file``,
    ``sample.prompts_file``); it then starts every error (``SETTING PATH: ...``) and names the
    way out. Without it errors start with the path, for the caller to prefix."""
    path = Path(path)
    name = f"{setting} {path}" if setting else str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"{name}: does not exist; {_missing_way_out(setting)}") from None
    except IsADirectoryError:
        raise ValueError(
            f"{name}: is a folder, not a prompt file; give a text file with one prompt per line"
        ) from None
    except PermissionError:
        raise ValueError(
            f"{name}: cannot read it (permission denied); check its permissions"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not UTF-8 text; save it as UTF-8") from None
    except OSError as error:
        raise ValueError(f"{name}: cannot read it ({error.strerror or error})") from None
    prompts = parse_prompt_text(text, name)
    if not prompts:
        raise ValueError(f"{name}: holds no prompt; write one per line ('#' starts a comment)")
    return prompts


def listed_prompts(prompts: Sequence[str], prompts_file: str | Path | None) -> list[SamplePrompt]:
    """``prompts``, then the lines of ``prompts_file`` (a run's ``sample.prompts`` and
    ``sample.prompts_file``: its validation grid, and ``impasto sample RUN`` without a
    prompt)."""
    found = [SamplePrompt(text) for text in prompts]
    if prompts_file is not None:
        found += read_prompt_file(prompts_file)
    return found


def grid_seeded(
    prompts: Sequence[SamplePrompt], seed: int, images_per_prompt: int
) -> list[SamplePrompt]:
    """``prompts`` with the seeds of a validation grid: prompt p's first image has seed
    ``seed + p·images_per_prompt`` unless its line sets one (``--d``). The grid and
    ``impasto sample RUN`` without a prompt both seed this way, so they draw the same images."""
    return [
        prompt
        if prompt.options.seed is not None
        else replace(prompt, options=replace(prompt.options, seed=seed + index * images_per_prompt))
        for index, prompt in enumerate(prompts)
    ]
