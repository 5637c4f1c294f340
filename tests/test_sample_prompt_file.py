"""Prompt files with kohya's per-prompt options (``impasto.sampling.prompt_file``)."""

from __future__ import annotations

import pytest

from impasto.sampling.prompt_file import (
    PromptOptions,
    SamplePrompt,
    parse_prompt_line,
    parse_prompt_text,
    read_prompt_file,
)

WHERE = "prompts.txt:3"


def test_a_line_with_every_option_and_a_negative_with_spaces():
    line = "a red circle, sharp --n blurry, low quality, jpeg --w 96 --h 48 --s 12 --d 7 --l 4.5"
    assert parse_prompt_line(line, WHERE) == SamplePrompt(
        "a red circle, sharp",
        PromptOptions(
            negative_prompt="blurry, low quality, jpeg",
            width=96,
            height=48,
            num_steps=12,
            seed=7,
            guidance_scale=4.5,
        ),
        WHERE,
    )


def test_options_in_any_order_and_case_and_surrounding_spaces():
    prompt = parse_prompt_line("   a cat   --D 3 --N  a dog   --L 7  ", WHERE)
    assert prompt.text == "a cat"
    assert prompt.options == PromptOptions(negative_prompt="a dog", seed=3, guidance_scale=7.0)


def test_a_plain_line_sets_nothing_and_comments_and_blanks_are_skipped():
    text = "# validation prompts\n\n  \na blue square\n  # indented comment\na #1 hit --s 4\n"
    prompts = parse_prompt_text(text, "p.txt")
    assert prompts == [
        SamplePrompt("a blue square", PromptOptions(), "p.txt:4"),
        SamplePrompt("a #1 hit", PromptOptions(num_steps=4), "p.txt:6"),
    ]


def test_options_over_defaults_keep_what_the_line_leaves_out():
    defaults = PromptOptions("", 64, 64, 30, 0, 5.0)
    options = PromptOptions(negative_prompt="blurry", width=32, seed=9).over(defaults)
    assert options == PromptOptions("blurry", 32, 64, 30, 9, 5.0)
    assert PromptOptions().over(defaults) == defaults
    # an empty negative or a zero seed is a value, not "unset"
    assert PromptOptions(negative_prompt="", seed=0).over(PromptOptions("x", seed=4)).seed == 0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("a cat --x 3", "prompts.txt:3: unknown option --x; valid: --n, --w, --h, --s, --d, --l"),
        ("a cat --ss euler", "prompts.txt:3: unknown option --ss"),
        ("a cat --w 65", "prompts.txt:3: --w 65: must be a multiple of 8"),
        ("a cat --h 0", "prompts.txt:3: --h 0: must be between 8 and 16384"),
        ("a cat --w 20000", "--w 20000: must be between 8 and 16384"),
        ("a cat --w 6.4e1", "--w 6.4e1: must be an integer"),
        ("a cat --s 0", "--s 0: must be between 1 and 1000"),
        ("a cat --s many", "--s many: must be an integer"),
        ("a cat --d -1", "--d -1: must be between 0 and 4294967295"),
        ("a cat --l nan", "--l nan: must be a finite number >= 0"),
        ("a cat --l -2", "--l -2: must be a finite number >= 0"),
        ("a cat --l high", "--l high: must be a number"),
        ("a cat --n", "prompts.txt:3: option --n needs a value"),
        ("a cat --d 1 --d 2", "prompts.txt:3: option --d is given twice"),
        ("--n blurry", "prompts.txt:3: no prompt before the options"),
        ("a cat -- b", "prompts.txt:3: unknown option --b; valid"),  # " --" starts one
    ],
)
def test_bad_lines_are_one_line_errors_naming_file_and_line(line: str, message: str):
    with pytest.raises(ValueError) as error:
        parse_prompt_line(line, WHERE)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_read_prompt_file_names_the_line_and_refuses_empty_or_missing_files(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a cat\n# skip\na dog --q 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{path}:3: unknown option --q"):
        read_prompt_file(path)
    path.write_text("# only comments\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompt_file(path)
    with pytest.raises(ValueError, match="missing.txt: does not exist; check the path"):
        read_prompt_file(tmp_path / "missing.txt")
    path.write_bytes("un chat été".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_prompt_file(path)
    with pytest.raises(ValueError, match="is a folder"):
        read_prompt_file(tmp_path)
    path.write_text("ünïcode prompt --n ß\r\nsecond\r\n", encoding="utf-8")
    assert [p.text for p in read_prompt_file(path)] == ["ünïcode prompt", "second"]
