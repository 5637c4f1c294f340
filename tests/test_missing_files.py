"""A file a setting names that is missing, a folder, unreadable, not safetensors, truncated or
corrupt is one line that says which, names the setting and the way out (issue #29)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from impasto.cli import main
from impasto.config import build_config
from impasto.data.prompts import read_prompts
from impasto.models.presets import build_tiny
from impasto.models.single_file import (
    CorruptSafetensorsError,
    NotSafetensorsError,
    TensorFile,
    TruncatedSafetensorsError,
    file_errors,
    save_single_file,
)
from impasto.models.vae_files import load_vae_file
from impasto.sampling.prompt_file import read_prompt_file
from impasto.train.trainer import train

RECOPY = "re-download or re-copy it"


def cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line ``impasto ARGV`` prints to stderr, exit status 2, without its prefix."""
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("impasto: error: "), err
    return err[0].removeprefix("impasto: error: ")


def train_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, raw: dict[str, Any]) -> str:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return cli_error(capsys, "train", str(config))


def safetensors_bytes(header: dict[str, Any], data: bytes) -> bytes:
    encoded = json.dumps(header).encode("utf-8")
    return struct.pack("<Q", len(encoded)) + encoded + data


F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
# name -> (file content, or None for no file, or "folder"; the line's words after "PATH: ")
MODEL_FILES: dict[str, tuple[bytes | str | None, str]] = {
    "missing": (None, "does not exist; put the file back there or point model.path at it"),
    "folder": (
        "folder",
        "is a folder, not a file; point model.path at an SDXL base single-file checkpoint "
        "(.safetensors)",
    ),
    "empty": (b"", f"not a safetensors file (the file is empty); {RECOPY}"),
    "json": (b"{}", f"not a safetensors file (2 bytes of text starting '{{}}'); {RECOPY}"),
    "html": (
        b"<!DOCTYPE html>\n<html><body>404 Not Found</body></html>\n",
        "not a safetensors file (56 bytes of text starting '<!DOCTYPE html> <html><body>404 Not "
        f"Foun...'); {RECOPY}",
    ),
    "truncated": (
        safetensors_bytes({"x": F32_4}, bytes(10)),
        f"truncated (its tensors end at byte 86, the file holds 80); {RECOPY}",
    ),
    "truncated header": (
        safetensors_bytes({"x": F32_4}, bytes(16))[:40],
        f"truncated (a 62-byte header, but only 32 bytes follow its length); {RECOPY}",
    ),
    "corrupt": (
        safetensors_bytes({"x": {**F32_4, "dtype": "F33"}}, bytes(16)),
        f"corrupt (tensor 'x' has an unknown dtype 'F33'); {RECOPY}",
    ),
}


def make(path: Path, content: bytes | str | None) -> Path:
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    return path


@pytest.mark.parametrize("case", sorted(MODEL_FILES))
def test_train_says_what_is_wrong_with_the_model_file(case, tiny_raw, tmp_path, capsys):
    content, words = MODEL_FILES[case]
    path = make(tmp_path / "base.safetensors", content)
    tiny_raw["model"] = {"path": str(path)}
    assert train_error(capsys, tmp_path, tiny_raw) == f"model.path {path}: {words}"


def test_an_unreadable_model_file_says_permission_denied(tiny_raw, tmp_path, capsys, monkeypatch):
    path = tmp_path / "base.safetensors"
    save_file({"x": torch.zeros(4)}, path)

    def denied(file, *args, **kwargs):  # root reads any file, so chmod 000 cannot show it
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(file_errors, "open", denied, raising=False)
    tiny_raw["model"] = {"path": str(path)}
    assert train_error(capsys, tmp_path, tiny_raw) == (
        f"model.path {path}: cannot read it (permission denied); check its permissions"
    )


def test_a_missing_diffusers_folder_and_a_file_for_a_folder(tiny_raw, tmp_path, capsys):
    folder = tmp_path / "sdxl-base"
    tiny_raw["model"] = {"path": str(folder)}
    assert train_error(capsys, tmp_path, tiny_raw) == (
        f"model.path {folder}: does not exist; put the folder back there or point model.path at it"
    )
    folder.write_text("not a folder")
    assert train_error(capsys, tmp_path, tiny_raw).startswith(
        f"model.path {folder}: is a file, not a folder; point model.path at a diffusers SDXL "
        "folder (model_index.json,"
    )


@pytest.mark.parametrize("name, kind", [("vae.safetensors", "file"), ("vae-folder", "folder")])
def test_a_missing_vae_names_model_vae(name, kind, tiny_raw, tmp_path, capsys):
    path = tmp_path / name
    tiny_raw["model"] = {"preset": "tiny", "vae": str(path)}
    assert train_error(capsys, tmp_path, tiny_raw) == (
        f"model.vae {path}: does not exist; put the {kind} back there or point model.vae at it"
    )


def test_a_truncated_vae_file_says_truncated(tiny_raw, tmp_path, capsys):
    path = make(tmp_path / "vae.safetensors", MODEL_FILES["truncated"][0])
    tiny_raw["model"] = {"preset": "tiny", "vae": str(path)}
    assert train_error(capsys, tmp_path, tiny_raw) == (
        f"model.vae {path}: truncated (its tensors end at byte 86, the file holds 80); {RECOPY}"
    )


def test_a_missing_lora_init_from_names_it(tiny_raw, tmp_path, capsys):
    path = tmp_path / "start.safetensors"
    tiny_raw["parts"] = {"unet": "lora"}
    tiny_raw["lora"] = {"rank": 4, "init_from": str(path)}
    assert train_error(capsys, tmp_path, tiny_raw) == (
        f"lora.init_from {path}: does not exist; put the file back there or point "
        "lora.init_from at it"
    )


def test_a_missing_sample_prompts_file_names_it(tiny_raw, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    tiny_raw["sample"] = {"every_steps": 5, "prompts_file": str(path)}
    assert train_error(capsys, tmp_path, tiny_raw) == (
        f"sample.prompts_file: {path}: does not exist; check the path"
    )


def test_prompt_files_tell_missing_folder_and_unreadable_apart(tmp_path, monkeypatch):
    missing = tmp_path / "prompts.txt"
    with pytest.raises(ValueError) as error:
        read_prompt_file(missing, setting="--prompts-file")
    assert str(error.value) == (
        f"--prompts-file {missing}: does not exist; check the path given to --prompts-file"
    )
    with pytest.raises(ValueError, match=f"^--prompts-file {tmp_path}: is a folder, not a "):
        read_prompt_file(tmp_path, setting="--prompts-file")
    with pytest.raises(ValueError) as error:
        read_prompts(missing)
    assert str(error.value) == (
        f"data.prompts {missing}: does not exist; put the file back there or point data.prompts "
        "at it"
    )
    with pytest.raises(ValueError, match=f"^data.prompts {tmp_path}.txt: is a folder, not a"):
        read_prompts(make(tmp_path.with_suffix(".txt"), "folder"))
    missing.write_text("a cat\n", encoding="utf-8")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ValueError) as error:
        read_prompt_file(missing, setting="--prompts-file")
    assert str(error.value) == (
        f"--prompts-file {missing}: cannot read it (permission denied); check its permissions"
    )
    with pytest.raises(ValueError) as error:
        read_prompts(missing)
    assert str(error.value) == (
        f"data.prompts {missing}: cannot read it (permission denied); check its permissions"
    )


def test_load_vae_file_says_does_not_exist(tmp_path):
    with pytest.raises(ValueError, match=r"^vae: .*absent.safetensors does not exist; train one"):
        load_vae_file(tmp_path / "absent.safetensors")


# TensorFile: the kind of problem is the exception's class, its first words say it too.
HEADERS: dict[str, tuple[bytes, type[Exception], str]] = {
    "empty": (b"", NotSafetensorsError, "not a safetensors file (the file is empty)"),
    "json": (b'{"a": 1}\n', NotSafetensorsError, "not a safetensors file (9 bytes of text"),
    "zip": (b"PK\x03\x04" + bytes(60), NotSafetensorsError, "not a safetensors file (a zip"),
    "pickle": (b"\x80\x02" + bytes(60), NotSafetensorsError, "not a safetensors file (a Python"),
    "binary": (bytes(range(200, 256)), NotSafetensorsError, "not a safetensors file (its first"),
    "cut data": (MODEL_FILES["truncated"][0], TruncatedSafetensorsError, "truncated (its"),
    "cut header": (MODEL_FILES["truncated header"][0], TruncatedSafetensorsError, "truncated (a"),
    "bad JSON": (
        struct.pack("<Q", 8) + b'{"x": 1,',
        CorruptSafetensorsError,
        "corrupt (the header is not valid JSON",
    ),
    "bad dtype": (MODEL_FILES["corrupt"][0], CorruptSafetensorsError, "corrupt (tensor 'x' has"),
    "bad shape": (
        safetensors_bytes({"x": {**F32_4, "shape": [5]}}, bytes(16)),
        CorruptSafetensorsError,
        "corrupt (tensor 'x': byte offsets that do not fit its shape)",
    ),
    "overlap": (
        safetensors_bytes({"x": F32_4, "y": {**F32_4, "data_offsets": [8, 24]}}, bytes(24)),
        CorruptSafetensorsError,
        "corrupt (tensors 'x' and 'y' overlap)",
    ),
    "bad metadata": (
        safetensors_bytes({"__metadata__": {"a": 1}, "x": F32_4}, bytes(16)),
        CorruptSafetensorsError,
        "corrupt (__metadata__ is not a map of strings)",
    ),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_tensor_file_raises_one_error_class_per_kind_of_problem(case, tmp_path):
    content, error_class, words = HEADERS[case]
    path = make(tmp_path / "x.safetensors", content)
    with pytest.raises(error_class) as error:
        TensorFile(path)
    assert str(error.value).startswith(words), str(error.value)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


def test_tensor_file_reads_a_valid_file_and_says_when_it_shrinks(tmp_path):
    path = tmp_path / "x.safetensors"
    x = torch.arange(8192.0)  # past the reader's buffer, so the cut is seen
    save_file({"x": x, "y": torch.ones(2, dtype=torch.float16)}, path)
    with TensorFile(path) as handle:
        assert torch.equal(handle.read("x"), x)
        path.write_bytes(path.read_bytes()[:-2])  # cut while open: y, the last, loses a byte
        with pytest.raises(TruncatedSafetensorsError, match="y: the file ended early"):
            handle.read("y")


# Export of a trained run whose starting files were moved away.


@pytest.fixture(scope="module")
def run_from_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 1-step LoRA run trained from a tiny single file with a tiny VAE folder as model.vae."""
    from impasto.data.demo import write_demo_dataset

    root = tmp_path_factory.mktemp("run-from-files")
    tiny = build_tiny(0)
    save_single_file(tiny, root / "base.safetensors", dtype=torch.float32)
    tiny.vae.save_pretrained(root / "vae")
    write_demo_dataset(root / "data", num_images=4, size=64, seed=0)
    raw = {
        "model": {"path": str(root / "base.safetensors"), "vae": str(root / "vae")},
        "data": {"path": str(root / "data"), "resolution": 64, "batch_size": 4},
        "parts": {"unet": "lora"},
        "lora": {"rank": 4},
        "train": {"output_dir": str(root / "run"), "seed": 0, "max_steps": 1},
        "checkpoint": {"every_steps": 1},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }
    run = train(build_config(raw)).run_dir
    checkpoint = next((run / "checkpoints").iterdir())
    return {"run": run, "checkpoint": checkpoint, "model.path": root / "base.safetensors",
            "model.vae": root / "vae"}  # fmt: skip


@contextmanager
def moved_away(path: Path) -> Iterator[None]:
    hidden = path.with_name(f"{path.name}.moved")
    path.rename(hidden)
    try:
        yield
    finally:
        hidden.rename(path)


EXPORTS = {  # format -> the settings whose files it needs
    "lora-kohya": ("model.path",),
    "single-file": ("model.path", "model.vae"),
    "diffusers": ("model.path", "model.vae"),
}


@pytest.mark.parametrize("fmt", sorted(EXPORTS))
def test_export_of_a_run_whose_base_files_were_moved(fmt, run_from_files, tmp_path, capsys):
    out = tmp_path / ("out.safetensors" if fmt != "diffusers" else "out")
    argv = ["export", str(run_from_files["run"]), "--format", fmt, "--out", str(out), "--merge"]
    for setting in EXPORTS[fmt]:
        path = run_from_files[setting]
        kind = "file" if path.suffix else "folder"
        with moved_away(path):
            assert cli_error(capsys, *argv) == (
                f"{setting} {path}: does not exist; the export rebuilds the model of "
                f"{run_from_files['checkpoint']} from it: put the {kind} back there (a symlink "
                "will do)"
            )
    assert not out.exists()


def test_export_merge_lora_that_does_not_exist_is_found_first(run_from_files, tmp_path, capsys):
    lora = tmp_path / "style.safetensors"
    argv = ["export", str(run_from_files["run"]), "--format", "single-file", "--merge"]
    argv += ["--out", str(tmp_path / "out.safetensors"), "--merge-lora", str(lora)]
    with moved_away(run_from_files["model.path"]):  # the LoRA is checked before the model
        assert cli_error(capsys, *argv) == (
            f"--merge-lora {lora}: does not exist; check the path given to --merge-lora"
        )
    lora.write_text("<html>Rate limited</html>")
    assert cli_error(capsys, *argv) == (
        f"--merge-lora {lora}: not a safetensors file (25 bytes of text starting "
        f"'<html>Rate limited</html>'); {RECOPY}"
    )


def test_export_of_a_run_whose_base_file_was_cut_says_truncated(run_from_files, tmp_path, capsys):
    base = run_from_files["model.path"]
    out = tmp_path / "out.safetensors"
    argv = ["export", str(run_from_files["run"]), "--format", "single-file", "--merge"]
    with moved_away(base):
        shutil.copyfile(base.with_name(f"{base.name}.moved"), base)
        with open(base, "r+b") as handle:
            handle.truncate(base.stat().st_size - 1000)
        message = cli_error(capsys, *argv, "--out", str(out))
        base.unlink()
    assert message.startswith(f"model.path {base}: truncated (its tensors end at byte ")
    assert message.endswith(RECOPY)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sample", "{missing}", "--prompt", "x", "--out", "o"],
         "{missing}: does not exist; check the path given to impasto sample"),
        (["export", "{missing}", "--format", "lora-kohya", "--out", "o.safetensors"],
         "{missing}: does not exist; check the path of the run or checkpoint"),
        (["runs", "summary", "{missing}"],
         "{missing}: does not exist; check the run directory's path"),
        (["runs", "list", "{missing}"],
         "{missing}: does not exist; name the folder that holds the runs"),
    ],
)  # fmt: skip
def test_a_run_that_does_not_exist_is_called_missing(argv, message, tmp_path, capsys):
    missing = str(tmp_path / "runs" / "gone")
    assert main([arg.format(missing=missing) for arg in argv]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"impasto: error: {message.format(missing=missing)}"
    ]
