"""Every ``impasto`` command shown in the README, the docs and the presets' comments stays true.

Each command in a code block or code span is checked against the real argument parser: a
synopsis (``impasto sample RUN --prompt TEXT [--num N]``) names a real subcommand and only real
options; a concrete command (no placeholders) parses as written. Then the concrete ones run in a
short form against two tiny runs made once (one full fine-tune, one LoRA): ``train`` commands
resolve their config with ``--print-config``, ``data demo`` writes four images, ``sample``
draws with two sampler steps, ``export``, ``inspect`` and ``doctor`` run as written.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from impasto.cli import build_parser, main

ROOT = Path(__file__).parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"^(?:\$ )?(?:(?:torchrun|python)\b.*?-m )?(impasto [a-z].*)$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:[.=][A-Za-z0-9_.]*)?$|[\[\]|…]|\.\.\.")
# Files the documented commands name that no test machine has: parse only.
EXTERNAL = re.compile(r"^(?:models/|/models|my-run\.yaml|run\.yaml|sdxl-ft|data/my-)")


@dataclass(frozen=True)
class Shown:
    where: str  # file:line
    argv: tuple[str, ...]
    inline: bool  # a code span in prose: a mention, checked as a synopsis

    @property
    def synopsis(self) -> bool:
        return self.inline or any(PLACEHOLDER.search(arg) for arg in self.argv)


def _commands_in(text: str) -> list[tuple[int, str]]:
    """``(line, command)`` for each line of ``text`` that holds an impasto command; backslash
    continuations joined and shell comments dropped."""
    found, pending, start, extra = [], "", 0, 0
    for number, line in enumerate(text.splitlines(), 1):
        line = line.lstrip("#").strip() if line.lstrip().startswith("#") else line.strip()
        if not pending:
            start = number
        line = pending + " " + line if pending else line
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        line = line.split(" # ")[0].split("  #")[0].strip()
        match = COMMAND.search(line)
        if match:
            found.append((start, match.group(1)))
        elif line.startswith("[") and found and found[-1][0] == start - 1 - extra:
            found[-1] = (found[-1][0], f"{found[-1][1]} {line}")  # a synopsis goes on
            extra += 1
            continue
        extra = 0
    return found


def shown_commands() -> list[Shown]:
    shown = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        fenced_lines = set()
        for block in FENCE.finditer(text):
            first = text[: block.start(1)].count("\n") + 1
            lines = block.group(1).count("\n") + 1
            fenced_lines.update(range(first, first + lines))
            for line, command in _commands_in(block.group(1)):
                shown.append(Shown(f"{path.name}:{first + line - 1}", _split(command), False))
        for number, line in enumerate(text.splitlines(), 1):
            if number in fenced_lines:
                continue
            for span in SPAN.findall(line):
                if span.startswith("impasto ") or " -m impasto " in span:
                    command = span[span.index("impasto ") :]
                    shown.append(Shown(f"{path.name}:{number}", _split(command), True))
    for path in CONFIGS:
        comment = "\n".join(
            line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")
        )
        for line, command in _commands_in(comment):
            shown.append(Shown(f"configs/{path.name}:{line}", _split(command), False))
    return shown


def _split(command: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(command))[1:]
    except ValueError:  # an unbalanced quote in a synopsis
        return tuple(command.split())[1:]


SHOWN = shown_commands()


def _subparser(argv: tuple[str, ...]) -> tuple[argparse.ArgumentParser, int]:
    """The (sub)parser the leading words of ``argv`` select, and how many words they are."""
    parser, used = build_parser(), 0
    while used < len(argv):
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or argv[used] not in actions[0].choices:
            break
        parser, used = actions[0].choices[argv[used]], used + 1
    return parser, used


def test_the_docs_show_many_commands():
    concrete = [s for s in SHOWN if not s.synopsis]
    assert len(SHOWN) > 60 and len(concrete) > 25, (len(SHOWN), len(concrete))


@pytest.mark.parametrize("shown", SHOWN, ids=lambda s: s.where)
def test_every_shown_command_names_real_options(shown: Shown):
    parser, used = _subparser(shown.argv)
    assert used >= 1, f"{shown.where}: no such command: impasto {' '.join(shown.argv[:2])}"
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert not actions, f"{shown.where}: impasto {' '.join(shown.argv[:used])} needs a subcommand"
    options = {flag for action in parser._actions for flag in action.option_strings}
    flags = {flag for arg in shown.argv for flag in re.findall(r"(?:^|\[)(--[a-z][a-z0-9-]*)", arg)}
    unknown = sorted(flags - options)
    assert not unknown, f"{shown.where}: impasto {' '.join(shown.argv[:used])} has no {unknown}"
    if not shown.synopsis:
        try:
            build_parser().parse_args(list(shown.argv))
        except SystemExit:
            pytest.fail(f"{shown.where}: does not parse: impasto {' '.join(shown.argv)}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with the demo data, a full fine-tune run at runs/demo, a LoRA run at
    runs/sdxl-lora and a DiT run at runs/demo-dit (one step each, tiny models), as the
    documented commands expect. Each run writes its own demo data (the DiT's: three aspect
    ratios): a demo folder serves only the settings it was written for."""
    root = tmp_path_factory.mktemp("docs")
    common = ["--set", "data.generate_demo=true",
              "--set", "train.max_steps=1", "--set", "sample.every_steps=0",
              "--set", "log.tensorboard=false", "--set", "log.progress_bar=false"]  # fmt: skip
    runs = {
        "demo": [
            str(ROOT / "configs/demo.yaml"), "--set", "data.path=data/demo",
            "--set", "cache.latents=none", "--set", "cache.text_embeddings=none",
        ],
        "sdxl-lora": [
            str(ROOT / "configs/sdxl-lora.yaml"), "--set", "data.path=data/demo-lora",
            "--set", "model.preset=tiny", "--set", "data.resolution=64",
        ],
        "demo-dit": [  # the DiT family's commands
            str(ROOT / "configs/demo-dit.yaml"), "--set", "data.path=data/demo-mixed",
        ],
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for name, args in runs.items():
            assert main(["train", *args, *common, "--set", f"train.output_dir=runs/{name}"]) == 0
    # The other runs the docs name are one of these two: a LoRA run, or a full fine-tune.
    named = {arg.split("/")[1] for s in SHOWN for arg in s.argv if arg.startswith("runs/")}
    for name in named - set(runs):
        adapters = "lora" in name or "dreambooth" in name
        (root / "runs" / name).symlink_to(root / "runs" / ("sdxl-lora" if adapters else "demo"))
    return root


def _short_form(argv: tuple[str, ...]) -> list[str] | None:
    """``argv`` as the test runs it, or None when it only parses (a placeholder file, a GPU job,
    a long training)."""
    argv = list(argv)
    if any(EXTERNAL.match(arg) for arg in argv):
        return None
    command = argv[0]
    if command == "train":
        return [*argv, "--print-config"]
    if command == "data" and argv[1] == "demo":
        out = argv[2]
        return ["data", "demo", f"short/{out}", "--num-images", "4", "--size", "32"]
    if command == "sample":
        return [*argv, "--steps", "2", "--num", "1"]
    if command in ("export", "inspect", "doctor"):
        return argv
    return None  # bench, cache, train-vae: timed or long; their options are checked above


RUNNABLE = [s for s in SHOWN if not s.synopsis and _short_form(s.argv) is not None]


@pytest.mark.parametrize("shown", RUNNABLE, ids=lambda s: s.where)
def test_every_concrete_command_runs_in_a_short_form(shown: Shown, workdir: Path, monkeypatch):
    monkeypatch.chdir(workdir)
    argv = _short_form(shown.argv)
    if argv[0] in ("train", "inspect"):  # configs are named relative to the repository
        argv = [str(ROOT / arg) if arg.startswith("configs/") else arg for arg in argv]
    assert main(argv) == 0, f"{shown.where}: impasto {' '.join(argv)}"
