"""Bad configs exit with code 2 and one line per mistake naming its key (issue #16).

A corpus of bad configs, generated from tables and from the schema itself (every float field
gets ``.inf``, ``-.inf``, ``.nan`` and a boolean; every integer field a boolean, a fraction, a
huge and a negative value), goes through the real command line in-process: ``impasto train
CONFIG --print-config`` with the mistake in the file or in a ``--set`` override. Each must exit
with code 2, print nothing on stdout and, on stderr, exactly one ``impasto: error:`` line per
mistake containing the expected fragment (which starts with the dotted key), and no traceback.
``--print-config`` builds no model, but runs :func:`impasto.train.checks.check_config` (the
folder and registry-name cases below prove it). The good configs at the end (the shipped ones,
the documentation's examples, anchors and merge keys, limits at their bounds) still load.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import time
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

import impasto
from impasto.cli import main
from impasto.config import Config, build_config, config_to_yaml
from impasto.config.data import SourceConfig, SubfolderConfig
from impasto.config.draftp import RewardConfig
from impasto.config.section import MAX_RESOLUTION, SEED_MAX
from impasto.config.yaml_reader import MAX_DEPTH, MAX_VALUES, parse_yaml

ROOT = Path(__file__).parents[2]
FILE = "<an existing file>"  # replaced by the path of a file in the test's folder
HUGE = 10**30
Wrap = Callable[[Any], Any]


@dataclass(frozen=True)
class Bad:
    """One bad config: ``values`` (dotted key → value) edited into the base config, written to
    the file or given as ``--set`` overrides, or ``text``, the whole file; ``expected`` holds
    one item per error line: a fragment, or fragments that must all be in that line."""

    id: str
    expected: tuple[str | tuple[str, ...], ...]
    values: tuple[tuple[str, Any], ...] = ()
    via: str = "file"  # or "set"
    text: str | bytes | None = None
    sets: tuple[str, ...] = ()


def base_raw(root: Path) -> dict[str, Any]:
    """A tiny run; only its structure and names are checked, so the data folder need not exist."""
    return {
        "config_version": 1,
        "model": {"preset": "tiny"},
        "data": {"path": str(root / "images"), "resolution": 64, "batch_size": 2},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(root / "run"), "max_steps": 3},
        "log": {"tensorboard": False, "progress_bar": False},
    }


# --- the schema's number fields --------------------------------------------------------------


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _required(model: type[BaseModel]) -> dict[str, Any]:
    """Values for the required keys of a section inside a list or dict (all are strings)."""
    return {name: "x" for name, info in model.model_fields.items() if info.is_required()}


def schema_leaves(
    annotation: Any, key: str, top: str, wrap: Wrap | None, seen: tuple[type, ...]
) -> Iterator[tuple[str, Any, str, Wrap]]:
    """``(dotted key, int | float | section, top, wrap)`` for every number inside
    ``annotation`` and every section inside a list or dict: ``wrap(value)`` is what to set at
    the dotted key ``top`` (the field itself, or the list or dict holding it) so that the value
    at ``key`` is ``value``. New fields are found here without touching this file."""
    annotation = _unwrap(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    outer = wrap or (lambda value: value)
    if origin in (typing.Union, types.UnionType):
        for member in args:
            if member is not type(None):
                yield from schema_leaves(member, key, top, wrap, seen)
    elif annotation in (int, float):
        yield key, annotation, top, outer
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if seen.count(annotation) >= 2:  # reward.terms.0 holds RewardConfig once more
            return
        required = _required(annotation)
        if wrap is not None:
            yield key, annotation, top, lambda value: outer({**required, **value})
        for name, info in annotation.model_fields.items():
            field = info.alias or name
            if wrap is None:  # still a dotted key
                child_top, child_wrap = f"{top}.{field}", None
            else:

                def child_wrap(value, outer=outer, required=required, field=field):
                    return outer({**required, field: value})

                child_top = top
            yield from schema_leaves(
                info.annotation, f"{key}.{field}", child_top, child_wrap, (*seen, annotation)
            )
    elif origin is list:
        yield from schema_leaves(args[0], f"{key}.0", top, lambda v: outer([v]), seen)
    elif origin is tuple and Ellipsis not in args:
        # The other items hold a valid value: 0.5 for a float (optim.betas), 64 for an int
        # (data.demo_sizes: sides that are multiples of 8).
        fillers = [64 if _unwrap(item) is int else 0.5 for item in args]
        for index, item in enumerate(args):

            def in_tuple(value, index=index):  # noqa: B008 (bound per item)
                return outer([value if i == index else fill for i, fill in enumerate(fillers)])

            yield from schema_leaves(item, f"{key}.{index}", top, in_tuple, seen)
    elif origin is dict:
        yield from schema_leaves(args[1], f"{key}.cats", top, lambda v: outer({"cats": v}), seen)


def _schema() -> list[tuple[str, Any, str, Wrap]]:
    found = []
    for name, info in Config.model_fields.items():
        if name != "config_version":  # checked by the migrations first; cases below
            found += schema_leaves(info.annotation, name, name, None, (Config,))
    return found


SCHEMA = _schema()
NUMBERS = [(key, kind, top, wrap) for key, kind, top, wrap in SCHEMA if kind in (int, float)]
CONTAINED = [(key, kind, top, wrap) for key, kind, top, wrap in SCHEMA if kind not in (int, float)]


def number_cases() -> list[Bad]:
    cases = []
    for index, (key, kind, top, wrap) in enumerate(NUMBERS):
        via = ("file", "set")[index % 2]
        bad = [(True, f"{key}: input should be a number, not true or false")]
        if kind is float:
            finite = f"{key}: input should be a finite number"
            bad += [(float("inf"), finite), (float("-inf"), finite), (float("nan"), finite)]
            bad += [(False, f"{key}: input should be a number, not true or false")]
        else:
            bad += [
                (2.5, f"{key}: input should be a valid integer, got 2.5"),
                (HUGE, f"{key}: input should be less than or equal to"),
                (-1, f"{key}: input should be greater than"),
            ]
        for value, expected in bad:
            case_id = f"{key}={value}"
            cases.append(Bad(case_id, (expected,), ((top, wrap(value)),), via=via))
    return cases


# --- hand-written tables -------------------------------------------------------------------

DEVICE_FIX = "use auto, cpu, cuda, cuda:N"
BAD_DEVICES = [
    "cdua", "cuda:x", "gpu", "cuda:", "CUDA", "cuda:0:1", "cuda0", " cpu", "tpu", "cuda:-1",
    "mps:0", "", "cuda\n",
]  # fmt: skip

# (dotted key, value, expected fragment)
WRONG_VALUES: list[tuple[str, Any, str]] = [
    ("optim", 5, "optim: must be a section of keys, got 5"),
    ("data", [1, 2], "data: must be a section of keys, got [1, 2]"),
    ("data.sources", "x", "data.sources: input should be a valid list"),
    ("data.subfolders", ["a"], "data.subfolders: input should be a valid dictionary"),
    ("optim.name", ["adamw"], "optim.name: input should be a valid string"),
    ("optim.lr", "fast", "optim.lr: input should be a valid number"),
    ("optim.lr", 10**400, "optim.lr: input should be a valid number"),
    ("optim.betas", [0.9], "optim.betas: too few items, item 1 is missing"),
    ("optim.betas", [0.9, 0.99, 0.999], "optim.betas: tuple should have at most 2 items"),
    ("optim.betas", 0.9, "optim.betas: input should be a valid tuple"),
    ("optim.betas", [0.9, 1.5], "optim.betas: each beta must be in [0, 1)"),
    ("train.max_steps", "ten", "train.max_steps: input should be a valid integer"),
    ("train.max_steps", 0, "train.max_steps: input should be greater than or equal to 1"),
    ("train.seed", "1e30", "train.seed: input should be a valid integer"),
    ("train.seed", 1e30, "train.seed: input should be less than or equal to 4294967295"),
    ("train.seed", SEED_MAX + 1, "train.seed: input should be less than or equal to"),
    ("sample.seed", 2**63, "sample.seed: input should be less than or equal to"),
    ("model.init_seed", -5, "model.init_seed: input should be greater than or equal to 0"),
    ("data.random_flip", "maybe", "data.random_flip: input should be a valid boolean"),
    ("data.caption_prefix", None, "data.caption_prefix: input should be a valid string"),
    ("data.crop", "top", "data.crop: input should be 'center' or 'random'"),
    ("model.preset", 5, "model.preset: input should be a valid string"),
    ("sample.prompts", "a cat", "sample.prompts: input should be a valid tuple"),
    ("memory.gradient_checkpointing", ["mid", 5], "memory.gradient_checkpointing: "),
    ("memory.gradient_checkpointing", ["mid", "top"], "unknown UNet block 'top'"),
    ("memory.gradient_checkpointing", 5, "memory.gradient_checkpointing: "),
    ("ema.device", "gpu", "ema.device: input should be 'cpu' or 'same'"),
    ("reward.options", [1], "reward.options: input should be a valid dictionary"),
    ("reward.options", {"a": float("inf")}, "reward.options: option a should be a finite"),
    ("reward.options", {"a": {"b": [float("nan")]}}, "reward.options: option a.b.0 should be"),
    ("train.output_dir", "", "train.output_dir: string should have at least 1 character"),
    ("data.path", "", "data.path: string should have at least 1 character"),
    ("cache.dir", "", "cache.dir: string should have at least 1 character"),
    ("model.path", "", "model.path: string should have at least 1 character"),
    ("data.resolution", 100, "data.resolution: must be a multiple of 8"),
    ("data.resolution", MAX_RESOLUTION + 8, "data.resolution: input should be less than"),
    ("data.resolution", 1e9, "data.resolution: input should be less than or equal to 16384"),
    ("sample.resolution", 12, "sample.resolution: must be a multiple of 8"),
    ("sample.guidance_rescale", 1.5, "sample.guidance_rescale: input should be less than or eq"),
    (
        "sample.prompts_file",
        "/nonexistent/p.txt",
        "sample.prompts_file: /nonexistent/p.txt: does not exist",
    ),
    ("draftp.resolution", 100, "draftp.resolution: must be a multiple of 8"),
    ("data.batch_size", 10_000_000, "data.batch_size: input should be less than or equal to"),
    ("data.batch_size", "yes", "data.batch_size: input should be a valid integer"),
    ("data.num_workers", 100_000, "data.num_workers: input should be less than or equal to"),
    ("lora.rank", 10**6, "lora.rank: input should be less than or equal to 4096"),
    ("sample.images_per_prompt", 10**6, "sample.images_per_prompt: input should be less than"),
    ("objective.num_train_timesteps", 10**9, "objective.num_train_timesteps: input should be"),
    ("parallel.timeout_s", 10**12, "parallel.timeout_s: input should be less than or equal"),
    ("checkpoint.keep_last", 0, "checkpoint.keep_last: input should be greater than or equal"),
    ("log.every", 5, "log.every: unknown key; did you mean 'every_steps'?"),
    ("trian", {"max_steps": 5}, "trian: unknown key; did you mean 'train'?"),
    ("config_version", True, "config_version: must be a positive integer, got True"),
    ("config_version", 1.5, "config_version: must be a positive integer, got 1.5"),
    ("config_version", float("inf"), "config_version: must be a positive integer, got inf"),
    ("config_version", HUGE, "config_version: 1000000000000000000000000000000 is newer"),
    ("config_version", 0, "config_version: must be a positive integer, got 0"),
]

# Unknown keys inside lists and dicts of sections: (dotted key, value, expected fragment).
SOURCE_KEYS = ", ".join(SourceConfig.model_fields)
REWARD_KEYS = ", ".join(RewardConfig.model_fields)
SUBFOLDER_KEYS = ", ".join(SubfolderConfig.model_fields)
NESTED_UNKNOWN: list[tuple[str, Any, str]] = [
    (
        "data.sources",
        [{"path": "x", "typo": 1}],
        f"data.sources.0.typo: unknown key; valid keys: {SOURCE_KEYS}",
    ),
    ("data.sources", [{"path": "x", "repeat": 2}], "data.sources.0.repeat: unknown key; did you "),
    (
        "data.sources",
        [{"path": "a"}, {"path": "b", "lossweight": 1}],
        "data.sources.1.lossweight: unknown key; did you mean 'loss_weight'?",
    ),
    (
        "data.sources",
        [{"path": "a", "subfolders": {"cats": {"zzz": 1}}}],
        f"data.sources.0.subfolders.cats.zzz: unknown key; valid keys: {SUBFOLDER_KEYS}",
    ),
    (
        "data.subfolders",
        {"10_cats": {"repeat": 2}},
        "data.subfolders.10_cats.repeat: unknown key; did you mean 'repeats'?",
    ),
    (
        "data.subfolders",
        {"my-dogs": {"xyz": 2}},
        f"data.subfolders.my-dogs.xyz: unknown key; valid keys: {SUBFOLDER_KEYS}",
    ),
    (
        "reward",
        {"kind": "weighted", "terms": [{"kind": "demo", "zzz": 1}]},
        f"reward.terms.0.zzz: unknown key; valid keys: {REWARD_KEYS}",
    ),
    (
        "reward",
        {"kind": "weighted", "terms": [{"kind": "weighted", "terms": [{"kidn": "demo"}]}]},
        "reward.terms.0.terms.0.kidn: unknown key; did you mean 'kind'?",
    ),
]


def container_cases() -> list[Bad]:
    """An unknown key in every section that sits in a list or dict of the schema."""
    cases = []
    for key, section, top, wrap in CONTAINED:
        expected = f"{key}.zzz: unknown key; valid keys: {', '.join(section.model_fields)}"
        cases.append(Bad(f"unknown-in-{key}", (expected,), ((top, wrap({"zzz": 1})),)))
    return cases


def yaml_cases() -> list[Bad]:
    bomb = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"b{i}: &b{i} [{', '.join(['*a' if i == 0 else f'*b{i - 1}'] * 9)}]\n" for i in range(9)
    )
    alias_depth = "l0: &l0 " + "[" * 40 + "]" * 40 + "\n" + "l1: &l1 " + "[" * 40 + "*l0" + "]" * 40
    block = "".join(f"{'  ' * level}k{level}:\n" for level in range(200)) + "  " * 200 + "v: 1\n"
    base = "model: {preset: tiny}\ndata: {path: x}\ntrain:\n  max_steps: 3\n"
    return [
        Bad("dup-top", (("train: duplicate key at line 5", "(first at line 3)"),),
            text=base + "train: {}\n"),
        Bad("dup-nested", ("optim.lr: duplicate key at line 7 of",),
            text=base + "optim:\n  lr: 1.0e-4\n  lr: 2.0e-4\n"),
        Bad("dup-list-item", ("data.sources.0.path: duplicate key at line 1",),
            text="data: {sources: [{path: a, path: b}]}\n"),
        Bad("dup-set", ("optim.lr: duplicate key at line 1 of --set optim",),
            sets=("optim={lr: 1, lr: 2}",)),
        Bad("alias-bomb", (f"aliases expand to over {MAX_VALUES} values",), text=bomb),
        Bad("alias-bomb-set", (f"--set data.path: aliases expand to over {MAX_VALUES}",),
            sets=("data.path=" + bomb.replace("\n", ", ").join("{}"),)),
        Bad("alias-cycle", ("a.0: alias inside its own anchor",), text="a: &a [*a]\n"),
        Bad("alias-depth", (f"aliases nest deeper than {MAX_DEPTH} levels",), text=alias_depth),
        Bad("deep-brackets", (f"nesting deeper than {MAX_DEPTH} levels at line 1",),
            text="a: " + "[" * 10_000),
        Bad("deep-braces", (f"nesting deeper than {MAX_DEPTH} levels",), text="{a: " * 10_000),
        Bad("deep-block", (f"nesting deeper than {MAX_DEPTH} levels",), text=block),
        Bad("deep-set", (f"--set data.path: nesting deeper than {MAX_DEPTH}",),
            sets=("data.path=" + "[" * 10_000,)),
        Bad("latin-1", ("not UTF-8 text (line 5); save it as UTF-8",),
            text=(base + "sample: {prompts: [un chat été]}\n").encode("latin-1")),
        Bad("utf-16", ("not UTF-8 text (line 1); save it as UTF-8",),
            text=base.encode("utf-16")),
        Bad("nul-char", ("unacceptable character #x0000 at line 5; remove it",),
            text=base + "a: b\x00\n"),
        Bad("long-int", ("an integer of 5000 digits at line 5",),
            text=base + "sample: {seed: " + "9" * 5000 + "}\n"),
        Bad("python-tag", ("could not determine a constructor",),
            text=base + "x: !!python/object/apply:os.system [echo hi]\n"),
        Bad("two-documents", ("but found another document at line 5",), text=base + "---\na: 1\n"),
        Bad("top-list", ("the top level must be a mapping of sections, got list",),
            text="- model\n"),
        Bad("syntax", (("at line 3", "fix the YAML syntax"),),
            text="model:\n  preset: tiny\n data: [\n"),
        Bad("empty-file", ("config.yaml is empty: a config needs model, data and train",), text=""),
        Bad("comments-only", ("config.yaml is empty: a config needs",), text="# model: ...\n\n"),
    ]  # fmt: skip


def misc_cases() -> list[Bad]:
    cases = [
        Bad(f"device-{device!r}", (("train.device: unknown device, got", DEVICE_FIX),),
            (("train.device", device),), via=("file", "set")[i % 2])
        for i, device in enumerate(BAD_DEVICES)
    ]  # fmt: skip
    cases += [
        Bad(f"{key}={value!r}"[:80], (fragment,), ((key, value),), via=("file", "set")[i % 2])
        for i, (key, value, fragment) in enumerate(WRONG_VALUES + NESTED_UNKNOWN)
    ]
    folder = "is an existing file, not a folder"
    cases += [
        Bad("output-dir-file", (f"train.output_dir: {folder}",), (("train.output_dir", FILE),)),
        Bad("cache-dir-file", (f"cache.dir: {folder}",), (("cache.dir", FILE),)),
        Bad("index-dir-file", (f"data.index_dir: {folder}",), (("data.index_dir", FILE),)),
        Bad("output-dir-in-file", (("train.output_dir: ", "is a file, not a folder"),),
            (("train.output_dir", FILE + "/run"),)),
        Bad("output-dir-nul", ("train.output_dir: a path cannot contain a NUL character",),
            (("train.output_dir", "runs/a\x00b"),)),
        Bad("two-folders", (f"train.output_dir: {folder}", f"cache.dir: {folder}"),
            (("train.output_dir", FILE), ("cache.dir", FILE))),
        Bad("optimizer-name", ("optim.name: unknown optimizer 'sgdx'",), (("optim.name", "sgdx"),)),
        Bad("compile-backend", ("memory.compile_backend: unknown backend 'inductr'; valid: ",),
            (("memory.compile", "blocks"), ("memory.compile_backend", "inductr"))),
        Bad("several", ("optim.lr: input should be a finite", "train.max_steps: input should be a "
            "number, not true", "train.device: unknown device", "optim.lrr: unknown key"),
            (("optim.lr", float("nan")), ("train.max_steps", True), ("train.device", "gpu"),
             ("optim.lrr", 1))),
        Bad("sample-steps-over-T", ("sample.num_steps: a sampler visits fewer timesteps than "
            "objective.num_train_timesteps (100), got 100",),
            (("objective.num_train_timesteps", 100), ("sample.every_steps", 5),
             ("sample.prompts", ["a cat"]), ("sample.num_steps", 100))),
        Bad("draftp-steps-over-T", ("draftp.num_steps: a sampler visits fewer timesteps",),
            (("objective.num_train_timesteps", 10), ("objective.method", "draftp"),
             ("data.path", None), ("data.prompts", "prompts.txt"))),
        Bad("two-bad-prompts", ("sample.prompts.0: input should be a valid string, got 1",
            "sample.prompts.1: input should be a valid string, got 2"),
            (("sample.prompts", [1, 2]),)),
        Bad("prompts-file-bad-line", (("sample.prompts_file: ", "a-file.txt:1: unknown option "
            "--folder"),), (("sample.prompts_file", FILE),)),
        Bad("set-no-equals", ("--set 'optim.lr': expected KEY=VALUE",), sets=("optim.lr",)),
        Bad("set-no-key", ("expected KEY=VALUE",), sets=("=5",)),
        Bad("set-empty-part", ("--set a..b: empty part in the dotted key",), sets=("a..b=1",)),
        Bad("set-into-value", ("--set optim.lr.x: optim.lr is a value, not a section",),
            sets=("optim.lr.x=1",)),
        Bad("set-into-list", ("--set data.sources.0.path: data.sources is a list; set it whole",),
            sets=("data.sources=[{path: a}]", "data.sources.0.path=b")),
        Bad("set-syntax", (("--set optim.lr: ", "fix the YAML syntax"),), sets=("optim.lr=[",)),
        Bad("set-inf", ("optim.lr: input should be a finite number, got inf",),
            sets=("optim.lr=.inf",)),
        Bad("set-inf-text", ("optim.lr: input should be a finite number, got 'inf'",),
            sets=("optim.lr='inf'",)),
        Bad("set-huge-float", ("optim.eps: input should be a finite number",),
            sets=("optim.eps=1.0e999",)),
    ]  # fmt: skip
    return cases


CORPUS = number_cases() + container_cases() + yaml_cases() + misc_cases()


# --- running a case through the CLI ----------------------------------------------------------


def _placed(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _flow(value: Any) -> str:
    """``value`` as one line of YAML, for ``--set KEY=VALUE``."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9)
    return text.removesuffix("\n...\n").strip()


def _substitute(value: Any, file: Path) -> Any:
    return value.replace(FILE, str(file)) if isinstance(value, str) else value


def run_case(case: Bad, folder: Path) -> tuple[int, float]:
    """Exit code and seconds of ``impasto train CONFIG --print-config`` (capsys holds the
    streams)."""
    file = folder / "a-file.txt"
    file.write_text("not a folder --folder\n")  # as a prompt file: an unknown option
    path = folder / "config.yaml"
    sets = list(case.sets)
    if case.text is not None:
        path.write_bytes(case.text if isinstance(case.text, bytes) else case.text.encode())
    else:
        raw = base_raw(folder)
        for key, value in case.values:
            value = _substitute(value, file)
            if case.via == "set":
                sets.append(f"{key}={_flow(value)}")
            else:
                _placed(raw, key, value)
        path.write_text(yaml.safe_dump(raw))
    argv = ["train", str(path), "--print-config"]
    for assignment in sets:
        argv += ["--set", assignment]
    start = time.perf_counter()
    code = main(argv)
    return code, time.perf_counter() - start


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every case (a folder per case would take longer than the cases); a
    good config is checked first, so that the registries (torch, the models, torch.compile's
    backends) are imported before the cases are timed."""
    folder = tmp_path_factory.mktemp("bad-configs")
    impasto.build_config({**base_raw(folder), "memory": {"compile": "blocks"}})  # + torch._dynamo
    return folder


@pytest.mark.parametrize("case", CORPUS, ids=[case.id for case in CORPUS])
def test_bad_config_exits_2_with_one_line_per_mistake(case: Bad, folder: Path, capsys):
    code, seconds = run_case(case, folder)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2, err
    assert out == "", out
    assert "Traceback" not in err, err
    assert all(line.startswith("impasto: error: ") for line in lines), err
    assert len(lines) == len(case.expected), err
    unmatched = list(lines)
    for expected in case.expected:
        fragments = (expected,) if isinstance(expected, str) else expected
        line = next((line for line in unmatched if all(f in line for f in fragments)), None)
        assert line is not None, (fragments, err)
        unmatched.remove(line)
    assert seconds < 1.0, seconds


def test_corpus_is_large_and_covers_every_category():
    assert len(CORPUS) >= 100, len(CORPUS)
    ids = " ".join(case.id for case in CORPUS)
    needles = ("=inf", "=nan", "=-inf", "=True", "=2.5", f"={HUGE}", "=-1", "device-",
               "dir-file", "dup-", "alias-bomb", "deep-", "latin-1", "unknown-in-")  # fmt: skip
    for needle in needles:
        assert needle in ids, needle


def test_every_number_field_of_the_schema_is_covered():
    keys = {key for key, *_ in NUMBERS}
    # a sample across sections, lists, dicts and tuples; the walk finds them all
    for key in ("optim.lr", "optim.betas.0", "objective.timestep_bias.multiplier",
                "data.sources.0.loss_weight", "data.subfolders.cats.weight",
                "data.sources.0.subfolders.cats.repeats", "reward.terms.0.weight",
                "draftp.kl_coeff", "sample.guidance_scale", "objective.noise_offset",
                "train.seed", "lora.rank", "parallel.timeout_s"):  # fmt: skip
        assert key in keys, key
    assert len(keys) >= 80, len(keys)


def test_every_list_and_dict_of_sections_is_covered():
    keys = {key for key, *_ in CONTAINED}
    expected = {"data.sources.0", "data.subfolders.cats", "data.sources.0.subfolders.cats"}
    assert expected | {"reward.terms.0"} <= keys, keys


def test_alias_bomb_and_deep_nesting_are_refused_fast(folder: Path, capsys):
    for case in CORPUS:
        if case.id.startswith(("alias-", "deep-")):
            code, seconds = run_case(case, folder)
            assert code == 2 and seconds < 0.5, (case.id, seconds)
    capsys.readouterr()


# --- good configs: the strictness breaks nothing ---------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_their_resolved_form_loads_again(path: Path):
    config = impasto.load_config(path)
    # a run's config.yaml (and a checkpoint's) is the resolved form; it must reload as strictly
    assert impasto.build_config(parse_yaml(config_to_yaml(config), path.name)) == config


def _doc_snippets() -> list[tuple[str, str]]:
    """Every ```yaml block of the README and docs/, split at ``# or`` (alternatives)."""
    snippets = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, block in enumerate(re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S)):
            for part, text in enumerate(re.split(r"^# or.*$", block, flags=re.M)):
                snippets.append((f"{doc.name}-{number}-{part}", text))
    return snippets


def _merged(base: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    raw = copy.deepcopy(base)
    for section, values in doc.items():
        if section == "data" and {"path", "sources", "prompts"} & set(values):
            raw["data"].pop("path")
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            raw[section].update(values)
        else:
            raw[section] = values
    if not (raw["train"].get("max_steps") or raw["train"].get("max_epochs")):
        raw["train"]["max_steps"] = 3  # the README's block lists the defaults (both null)
    return raw


@pytest.mark.parametrize("name,text", _doc_snippets(), ids=[name for name, _ in _doc_snippets()])
def test_documented_examples_load(name: str, text: str, tmp_path: Path):
    doc = parse_yaml(text, name)
    config = impasto.build_config(_merged(base_raw(tmp_path), doc))
    assert isinstance(config, Config)


GOOD_YAML = """
model: {preset: tiny}
data:
  sources:
    - &style {source: folder, path: data/style, repeats: 2}
    - {<<: *style, path: data/other}
  resolution: 16384
  batch_size: 4.0
  num_workers: 256
optim: {lr: 1e-4, betas: [0.9, 0.99]}
train: {max_steps: 3, seed: 4294967295, device: cuda:3}
lora: {rank: 4096}
sample:
  prompts: &prompts [un chat été, "a dog"]
"""


def test_anchors_merge_keys_and_limits_at_their_bounds_load(tmp_path: Path):
    path = tmp_path / "good.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_YAML.encode())  # with a UTF-8 byte-order mark
    config = impasto.load_config(path, ["train.output_dir=" + str(tmp_path / "run")])
    expected = [str(tmp_path / "data/style"), str(tmp_path / "data/other")]  # beside the file
    assert [source.path for source in config.data.sources] == expected
    assert [source.repeats for source in config.data.sources] == [2, 2]
    assert config.optim.lr == pytest.approx(1e-4)  # PyYAML reads 1e-4 as a string
    assert config.data.batch_size == 4 and isinstance(config.data.batch_size, int)
    assert config.train.seed == SEED_MAX and config.lora.rank == 4096
    assert config.sample.prompts == ("un chat été", "a dog")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:15", "mps"])
def test_valid_devices_load(device: str, tmp_path: Path):
    raw = base_raw(tmp_path)
    raw["train"]["device"] = device
    assert build_config(raw).train.device == device


def test_output_dir_that_is_a_folder_or_missing_loads(tmp_path: Path):
    raw = base_raw(tmp_path)
    (tmp_path / "run").mkdir()
    raw["cache"] = {"dir": str(tmp_path / "new" / "cache")}
    assert impasto.build_config(raw).train.output_dir == str(tmp_path / "run")


def test_an_output_dir_the_run_cannot_create_is_one_line_naming_the_key(tmp_path: Path, capsys):
    """A read-only mount (a tmpfs; needs root, as in CI's container) and a folder this user may
    not write to (os.access says no; root may write anywhere, so it is simulated)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(base_raw(tmp_path)), encoding="utf-8")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode:
        pytest.skip("cannot mount a tmpfs here (not root); the os.access case below runs")
    try:
        assert main(["train", str(config), "--set", f"train.output_dir={read_only}/run"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"impasto: error: train.output_dir: cannot create {read_only}/run: read-only file "
            f"system ({read_only}); choose a folder you can write to"
        ]
    finally:
        subprocess.run(["umount", str(read_only)], check=False)


def test_an_output_dir_without_write_permission_is_one_line(tmp_path: Path, capsys, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(base_raw(tmp_path)), encoding="utf-8")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode)
    )
    assert main(["train", str(config), "--set", f"train.output_dir={locked}/run"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"impasto: error: train.output_dir: cannot create {locked}/run: permission denied "
        f"({locked}); choose a folder you can write to"
    ]
    assert main(["train", str(config), "--set", f"train.output_dir={locked}"]) == 2
    assert "train.output_dir: cannot write to" in capsys.readouterr().err


def test_an_output_dir_on_a_pseudo_filesystem_is_one_line(tmp_path: Path, capsys):
    """/proc takes no new folder, not even from root: the run's mkdir names the key."""
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(base_raw(tmp_path)), encoding="utf-8")
    assert main(["train", str(config), "--set", "train.output_dir=/proc/impasto/run"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "impasto: error: train.output_dir: cannot create /proc/impasto/run (No such file or "
        "directory: /proc/impasto); choose a folder you can write to"
    ]
