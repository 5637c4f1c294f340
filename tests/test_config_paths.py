"""Relative paths of a config (issue #29): a config file's are relative to its folder, those of
``--set`` and of a mapping built in Python to the working directory; the loaded config holds
only absolute paths, so the run records where everything is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from impasto.config import ConfigError, build_config, config_diff, config_to_dict, load_config
from impasto.config.paths import resolve_path

FILE = {
    "model": {"path": "models/base.safetensors", "vae": "./models/../vae"},
    "lora": {"init_from": "loras/start.safetensors"},
    "parts": {"unet": "lora"},
    "data": {
        "sources": [
            {"path": "data/a"},
            {"path": "pipe:curl -s https://example.org/{0..3}.tar", "source": "webdataset"},
            {"path": "s3://bucket/shards/{0..9}.tar", "source": "webdataset"},
            {"path": "shards/{0..9}.tar", "source": "webdataset"},
        ],
        "index_dir": "index",
    },
    "cache": {"dir": "cache"},
    "train": {"max_steps": 1},
    "sample": {"prompts_file": "prompts.txt"},
    "eval": {"sets": [{"name": "held", "path": "held-out"}]},
    "reward": {
        "kind": "weighted",
        "terms": [{"kind": "aesthetic", "path": "clip", "head": "h.pth"}],
    },
}


def write(path: Path, raw: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def every_path(config) -> dict[str, str | None]:
    data = config_to_dict(config)
    return {
        "model.path": data["model"]["path"],
        "model.vae": data["model"]["vae"],
        "lora.init_from": data["lora"]["init_from"],
        "data.sources": [source["path"] for source in data["data"]["sources"]],
        "data.index_dir": data["data"]["index_dir"],
        "cache.dir": data["cache"]["dir"],
        "train.output_dir": data["train"]["output_dir"],
        "sample.prompts_file": data["sample"]["prompts_file"],
        "eval.sets": [eval_set["path"] for eval_set in data["eval"]["sets"]],
        "reward.terms": [(term["path"], term["head"]) for term in data["reward"]["terms"]],
    }


def test_a_files_paths_are_relative_to_its_folder_from_any_directory(tmp_path, monkeypatch):
    config_file = write(tmp_path / "project" / "configs" / "run.yaml", FILE)
    monkeypatch.chdir(tmp_path)  # elsewhere: the working directory does not matter
    here = tmp_path / "project" / "configs"
    assert every_path(load_config(config_file)) == {
        "model.path": f"{here}/models/base.safetensors",
        "model.vae": f"{here}/vae",  # normalised
        "lora.init_from": f"{here}/loras/start.safetensors",
        "data.sources": [
            f"{here}/data/a",
            "pipe:curl -s https://example.org/{0..3}.tar",  # URLs stay as they are
            "s3://bucket/shards/{0..9}.tar",
            f"{here}/shards/{{0..9}}.tar",  # a local brace pattern is a path
        ],
        "data.index_dir": f"{here}/index",
        "cache.dir": f"{here}/cache",
        "train.output_dir": f"{here}/runs/default",  # the default, as if written in the file
        "sample.prompts_file": f"{here}/prompts.txt",
        "eval.sets": [f"{here}/held-out"],
        "reward.terms": [(f"{here}/clip", f"{here}/h.pth")],
    }


def test_set_paths_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    config_file = write(tmp_path / "configs" / "run.yaml", FILE)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    config = load_config(
        config_file,
        [
            "data.index_dir=idx",
            "train.output_dir=runs/mine",
            "eval.sets=[{name: other, path: ../other}]",  # a whole list of sections
            "model={path: base.safetensors}",  # a whole section
        ],
    )
    paths = every_path(config)
    assert paths["data.index_dir"] == f"{work}/idx"
    assert paths["train.output_dir"] == f"{work}/runs/mine"
    assert paths["eval.sets"] == [f"{tmp_path}/other"]
    assert paths["model.path"] == f"{work}/base.safetensors"
    assert paths["cache.dir"] == f"{tmp_path}/configs/cache"  # the file's, untouched


def test_absolute_home_and_python_built_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": "~/images"},
        "train": {"max_steps": 1, "output_dir": "/abs/run"},
        "cache": {"dir": "rel/cache"},
    }
    config = build_config(raw)
    assert config.data.path == f"{tmp_path}/home/images"
    assert config.train.output_dir == "/abs/run"
    assert config.cache.dir == f"{tmp_path}/rel/cache"  # a mapping: the working directory
    assert build_config(raw, base="/srv/project").cache.dir == "/srv/project/rel/cache"
    assert build_config(config_to_dict(config)) == config  # resolving twice changes nothing


def test_an_empty_path_is_still_an_error(tmp_path, monkeypatch):
    config_file = write(tmp_path / "run.yaml", FILE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="data.index_dir: string should have at least 1"):
        load_config(config_file, ["data.index_dir=''"])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a/b", "/base/a/b"),
        ("../x", "/x"),
        ("/abs/./y", "/abs/y"),
        ("file:shard.tar", "file:shard.tar"),
        ("https://host/a.tar", "https://host/a.tar"),
        ("memory://x", "memory://x"),
    ],
)
def test_resolve_path(value: str, expected: str):
    assert resolve_path(value, Path("/base")) == expected


def test_shipped_configs_name_folders_beside_configs(monkeypatch, tmp_path):
    """configs/*.yaml are relative to configs/: run from anywhere, the demo still writes the
    repository's data/demo and runs/demo."""
    repo = Path(__file__).parents[1]
    monkeypatch.chdir(tmp_path)
    demo = load_config(repo / "configs" / "demo.yaml")
    assert demo.data.path == str(repo / "data" / "demo")
    assert demo.train.output_dir == str(repo / "runs" / "demo")
    draftp = load_config(repo / "configs" / "demo-draftp.yaml")
    assert draftp.model.path == str(repo / "runs" / "demo" / "checkpoints" / "step-00000500")
    assert draftp.data.prompts == str(repo / "configs" / "demo-draftp-prompts.txt")
    assert os.path.isfile(draftp.data.prompts)


def test_a_moved_folder_is_one_line_of_the_changes():
    old = {"data": {"path": "/a/project/data"}, "model": {"path": "/a/project/runs/base"},
           "optim": {"lr": 0.1}, "train": {"output_dir": "/a/project/runs/lora"}}  # fmt: skip
    new = {"data": {"path": "/b/moved/data"}, "model": {"path": "/b/moved/runs/base"},
           "optim": {"lr": 0.2}, "train": {"output_dir": "/b/moved/runs/lora"}}  # fmt: skip
    assert config_diff(old, new) == [
        "paths moved from /a/project to /b/moved (data.path, model.path, train.output_dir)",
        "optim.lr: 0.1 -> 0.2",
    ]
    assert config_diff({"data": {"path": "/a/x"}}, {"data": {"path": "/b/y"}}) == [
        "data.path: '/a/x' -> '/b/y'"  # no common tail: not a move
    ]
