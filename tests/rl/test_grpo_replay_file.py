"""GRPO's input files, line by line: every kind of bad line in a replay file (docs/rl.md, "The replay file") is an
error naming its exact file:LINE, and a prompt row the template or tokenizer refuses is a bad row that
`data.on_bad_row` stops on (naming file:line) or skips and counts. The reader in process for each kind; the real
CLI (`finetune train examples/yaml/grpo-replay.yaml`) for a few, checking exit 2 and no traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import TOKENIZER_DIR
from helpers import ROOT, TINY, run_cli

from finetune.data.sources import BadRow
from finetune.errors import UserError
from finetune.recipe import DatasetConfig
from finetune.rl.prompts import read_prompts
from finetune.rl.replay import read_replay

REPLAY_RECIPE = ROOT / "examples" / "yaml" / "grpo-replay.yaml"
G0 = {"group": 0, "prompt_ids": [5, 6], "completion_ids": [7, 2], "reward": 1.0}
G1 = {**G0, "group": 1}
LONE = "\ud800"  # half of a UTF-16 pair, as json.loads makes of the escape "\ud800": not Unicode text


def without(line: dict, *keys: str) -> dict:
    return {k: v for k, v in line.items() if k not in keys}


def write_lines(path: Path, lines: list[Any]) -> Path:
    """JSON lines (a str written verbatim; json.dumps writes NaN and Infinity as Python's json reads them)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


# --- the replay file: every bad-line kind, with its exact line ------------------------------------------------------

# (lines, the bad line's number, the message after "file:N: "). A good group first, so that no line number is 1 by
# accident; a blank line still counts as a line of the file.
BAD_LINES = {
    "not_json": ([G0, G0, "{not json"], 3, "not JSON (Expecting property name enclosed in double quotes)"),
    "not_an_object": ([G0, G0, "[1, 2]"], 3, "a rollout is a JSON object, not list"),
    "a_string": ([G0, G0, '"text"'], 3, "a rollout is a JSON object, not str"),
    "unknown_field": ([G0, G0, G1, {**G1, "advantage": 1}], 4, "unknown field(s) ['advantage']"),
    "missing_group": ([G0, G0, without(G1, "group")], 3, "`group` (a string or number naming the prompt's group) "
                      "is required"),
    "group_not_scalar": ([G0, G0, {**G1, "group": [1]}], 3, "`group` (a string or number"),
    "missing_prompt": ([G0, G0, G1, without(G1, "prompt_ids")], 4, "give prompt_ids, or prompt (text or messages)"),
    "empty_prompt_text": ([G0, G0, G1, {**without(G1, "prompt_ids"), "prompt": ""}], 4, "give prompt_ids, or prompt"),
    "prompt_messages_not_objects": ([G0, G0, {**without(G1, "prompt_ids"), "prompt": ["hi"]}], 3,
                                    "prompt messages are objects with a role and content"),
    "prompt_messages_without_role": ([G0, G0, {**without(G1, "prompt_ids"), "prompt": [{"content": "hi"}]}], 3,
                                     "message 0 has unknown role None; allowed: system, user, assistant, tool"),
    "prompt_unknown_role": ([G0, G0, {**without(G1, "prompt_ids"), "prompt": [{"role": "wizard", "content": "hi"}]}],
                            3, "message 0 has unknown role 'wizard'; allowed: system, user, assistant, tool "
                               "(datasets[].role_map names other roles)"),
    "nested_too_deep": ([G0, G0, "[" * 100_000 + "]" * 100_000], 3,
                        "JSON nested too deeply to read (past Python's recursion limit)"),
    "prompt_ids_not_ids": ([G0, G0, G1, {**G1, "prompt_ids": [5, "6"]}], 4, "prompt_ids must be a list of token ids"),
    "prompt_id_outside_vocabulary": ([G0, G0, G1, {**G1, "prompt_ids": [5, 1024]}], 4,
                                     "prompt_ids holds id 1024, outside the tokenizer's vocabulary of 1024"),
    "prompt_id_negative": ([G0, G0, {**G1, "prompt_ids": [-1]}], 3,
                           "prompt_ids holds id -1, outside the tokenizer's vocabulary of 1024"),
    "missing_completion": ([G0, G0, G1, without(G1, "completion_ids")], 4,
                           "give completion_ids, or completion (text)"),
    "completion_not_text": ([G0, G0, {**without(G1, "completion_ids"), "completion": 7}], 3,
                            "give completion_ids, or completion (text)"),
    "completion_id_outside_vocabulary": ([G0, G0, G1, {**G1, "completion_ids": [7, 5000]}], 4,
                                         "completion_ids holds id 5000, outside the tokenizer's vocabulary of 1024"),
    "empty_completion": ([G0, G0, G1, {**G1, "completion_ids": []}], 4, "the completion is empty"),
    "missing_reward": ([G0, G0, G1, without(G1, "reward")], 4,
                       "give `reward` (the total) or `rewards` (name -> value), one of them"),
    "reward_and_rewards": ([G0, G0, {**G1, "rewards": {"a": 1.0}}], 3, "give `reward` (the total) or `rewards`"),
    "reward_nan": ([G0, G0, G1, {**G1, "reward": float("nan")}], 4,
                   "reward 'reward' is nan; rewards are finite numbers or null"),
    "reward_infinite": ([G0, G0, {**G1, "reward": float("inf")}], 3, "reward 'reward' is inf"),
    "reward_text": ([G0, G0, {**G1, "reward": "1"}], 3, "reward 'reward' is '1'"),
    "rewards_value_infinite": ([G0, G0, G1, {**without(G1, "reward"), "rewards": {"a": 1.0, "b": float("-inf")}}], 4,
                               "reward 'b' is -inf; rewards are finite numbers or null"),
    "rewards_value_nan": ([G0, G0, {**without(G1, "reward"), "rewards": {"a": float("nan")}}], 3, "reward 'a' is nan"),
    "rewards_not_an_object": ([G0, G0, {**without(G1, "reward"), "rewards": [1.0]}], 3,
                              "rewards is an object of name -> value"),
    "logprobs_too_short": ([G0, G0, G1, {**G1, "logprobs": [-1.0]}], 4,
                           "logprobs must be 2 finite numbers <= 0, one per completion token"),
    "logprobs_too_long": ([G0, G0, {**G1, "logprobs": [-1.0, -1.0, -1.0]}], 3, "logprobs must be 2 finite numbers"),
    "logprobs_positive": ([G0, G0, {**G1, "logprobs": [-1.0, 0.5]}], 3, "logprobs must be 2 finite numbers <= 0"),
    "env_mask_too_short": ([G0, G0, G1, {**G1, "env_mask": [1]}], 4,
                           "env_mask has 1 entries for a completion of 2 tokens; one per completion token"),
    "env_mask_not_bits": ([G0, G0, {**G1, "env_mask": [1, 2]}], 3, "env_mask must be a list of 0 and 1"),
    "env_mask_booleans": ([G0, G0, {**G1, "env_mask": [True, False]}], 3, "env_mask must be a list of 0 and 1"),
    "env_mask_all_environment": ([G0, G0, G1, {**G1, "env_mask": [0, 0]}], 4,
                                 "env_mask marks no completion token as sampled by the policy: nothing to train"),
    "logprobs_null_where_sampled": ([G0, G0, {**G1, "env_mask": [0, 1], "logprobs": [-1.0, None]}], 3,
                                    "logprobs must be 2 finite numbers <= 0, one per completion token (null allowed "
                                    "where env_mask is 0)"),
    "group_too_small": ([G0, G0, "", G1, {**G1, "group": 2}, {**G1, "group": 2}], 4,
                        "group 1 has 1 completions; grpo.num_generations is 2"),
    "group_too_large": ([G0, G0, G1, G1, G1], 3, "group 1 has 3 completions; grpo.num_generations is 2"),
    "group_not_consecutive": ([G0, G0, G1, G1, G0, G0], 5,
                              "group 0 appears again after other groups; a group's lines are consecutive"),
    "prompt_text_lone_surrogate": ([G0, G0, G1, {**without(G1, "prompt_ids"), "prompt": f"a {LONE} b"}], 4,
                                   "the tokenizer cannot encode this row: the text holds a lone surrogate '\\ud800'"),
    "prompt_message_lone_surrogate": ([G0, G0, {**without(G1, "prompt_ids"),
                                                "prompt": [{"role": "user", "content": f"a {LONE}"}]}], 3,
                                      "the tokenizer cannot encode this row: the text holds a lone surrogate"),
    "completion_lone_surrogate": ([G0, G0, G1, {**without(G1, "completion_ids"), "completion": f"so {LONE}"}], 4,
                                  "the tokenizer cannot encode this row: the text holds a lone surrogate '\\ud800'"),
}


@pytest.mark.parametrize("kind", BAD_LINES)
def test_every_bad_line_names_its_file_and_line(tmp_path, tokenizer, kind):
    lines, number, message = BAD_LINES[kind]
    path = write_lines(tmp_path / "replay.jsonl", lines)
    with pytest.raises(UserError) as failed:
        read_replay(path, tokenizer, 2, {"a": 1.0, "b": 1.0})
    assert str(failed.value).startswith(f"{path}:{number}: {message}"), str(failed.value)
    str(failed.value).encode("utf-8")  # printable: a lone surrogate in the message would fail at print()


def test_a_template_that_refuses_the_prompt_names_the_line(tmp_path, tokenizer):
    import copy

    refusing = copy.deepcopy(tokenizer)
    refusing.chat_template = "{{ raise_exception('roles must alternate') }}"
    path = write_lines(tmp_path / "replay.jsonl", [G0, G0, {**without(G1, "prompt_ids"), "prompt": [
        {"role": "user", "content": "hi"}]}, G1])
    with pytest.raises(UserError) as failed:
        read_replay(path, refusing, 2, {})
    assert str(failed.value).startswith(f"{path}:3: the chat template cannot render the prompt (") \
        and "roles must alternate" in str(failed.value), str(failed.value)


def test_good_lines_around_blank_ones_read(tmp_path, tokenizer):
    """The control: the same good groups the bad cases start with read, blank lines skipped."""
    path = write_lines(tmp_path / "replay.jsonl", [G0, "", G0, G1, {**G1, "logprobs": [-0.5, -0.1]}])
    rollouts = read_replay(path, tokenizer, 2, {})
    assert [r.where for r in rollouts] == [f"{path}:{n}" for n in (1, 3, 4, 5)]
    assert rollouts[3].logprobs == [-0.5, -0.1] and rollouts[2].logprobs is None


def test_a_multi_turn_line_reads_its_env_mask_and_null_logprobs_where_the_environment_wrote(tmp_path, tokenizer):
    path = write_lines(tmp_path / "replay.jsonl", [
        G0, G0, {**G1, "completion_ids": [7, 8, 9, 2], "env_mask": [1, 0, 0, 1], "logprobs": [-1.0, None, None, -0.5]},
        {**G1, "completion_ids": [7, 2]}])
    rollouts = read_replay(path, tokenizer, 2, {})
    assert rollouts[2].env_mask == [1, 0, 0, 1] and rollouts[2].logprobs == [-1.0, 0.0, 0.0, -0.5]
    assert rollouts[2].env_tokens == 2 and rollouts[3].env_mask is None and rollouts[3].env_tokens == 0


def test_a_line_is_split_at_newlines_only(tmp_path, tokenizer):
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines, but text inside a JSON string: the line reads."""
    prompt = "a\u2028b\u2029c\x85d"
    line = json.dumps({**without(G1, "prompt_ids"), "prompt": prompt}, ensure_ascii=False)
    path = tmp_path / "replay.jsonl"
    path.write_text("\n".join([json.dumps(G0), json.dumps(G0), line, line]) + "\n", encoding="utf-8")
    rollouts = read_replay(path, tokenizer, 2, {})
    assert [r.where for r in rollouts] == [f"{path}:{n}" for n in (1, 2, 3, 4)]
    assert tokenizer.decode(rollouts[2].prompt_ids) == prompt


def test_a_rollout_longer_than_a_row_stops_the_run_or_its_group_is_skipped(tmp_path, tokenizer):
    """Checked as generated rows are: data.max_seq_len or the model's position limit, whichever is lower."""
    from types import SimpleNamespace

    from finetune.rl.replay import fitting, row_limit

    long = {**G1, "completion_ids": [7] * 300}
    rollouts = read_replay(write_lines(tmp_path / "replay.jsonl", [G0, G0, G1, long, G0 | {"group": 2}] * 1
                                       + [G0 | {"group": 2}]), tokenizer, 2, {})
    recipe = SimpleNamespace(data=SimpleNamespace(max_seq_len=256))
    limit = row_limit(recipe, SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024)))
    assert limit == (256, "data.max_seq_len")
    assert row_limit(recipe, SimpleNamespace(config=SimpleNamespace(max_position_embeddings=128)))[0] == 128
    with pytest.raises(UserError, match=r"replay.jsonl:4: the rollout is 302 tokens \(prompt 2 \+ completion 300\), "
                                        r"over data.max_seq_len \(256\)"):
        fitting(rollouts, limit, "error", 2)
    kept, skipped = fitting(rollouts, limit, "skip", 2)
    assert skipped == 2 and [r.group for r in kept] == [0, 0, 2, 2]


# --- through the CLI: exit 2, no traceback, file:line -----------------------------------------------------------

CLI_CASES = {
    "completion_id_outside_vocabulary": ([G0, G0, G0, G0, G1, G1, {**G1, "completion_ids": [7, 4096]}, G1], (), 7,
                                         "completion_ids holds id 4096, outside the tokenizer's vocabulary of 1024"),
    "group_not_consecutive": ([G0] * 4 + [G1] * 4 + [G0] * 4, (), 9, "group 0 appears again after other groups"),
    "completion_lone_surrogate": ([G0, G0, G0, {**without(G0, "completion_ids"), "completion": f"x {LONE}"}], (), 4,
                                  "the tokenizer cannot encode this row: the text holds a lone surrogate '\\ud800'"),
    "rollout_over_max_seq_len": ([G0] * 4 + [G1] * 3 + [{**G1, "completion_ids": [7] * 300}],
                                 ("grpo.max_new_tokens=512",), 8,
                                 "the rollout is 302 tokens (prompt 2 + completion 300), over data.max_seq_len (256)"),
    "completion_over_max_new_tokens": ([G0] * 4 + [G1] * 3 + [{**G1, "completion_ids": [7] * 20}],
                                       ("grpo.max_new_tokens=16",), 8,
                                       "the completion is 20 tokens, over grpo.max_new_tokens (16), which a generated "
                                       "one never passes"),
    "ratio_against_replay_without_logprobs": ([{**G0, "logprobs": [-1.0, -1.0]}] * 4 + [G1] * 4,
                                              ("grpo.ratio_against=replay",), 5,
                                              "grpo.ratio_against: replay needs `logprobs` on every line (4 lines "
                                              "have none)"),
}


@pytest.mark.parametrize("kind", CLI_CASES)
def test_bad_replay_lines_through_the_cli(tmp_path, kind):
    lines, extra, number, message = CLI_CASES[kind]
    replay = write_lines(tmp_path / "replay.jsonl", lines)
    r = run_cli("train", str(REPLAY_RECIPE), f"output_dir={tmp_path / 'run'}", *TINY, f"grpo.replay={replay}",
                "train.micro_batch_size=4", "train.gradient_accumulation_steps=1", *extra)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert f"error: {replay}:{number}: {message}" in r.stderr, r.stderr[-3000:]


# --- prompt rows (format: prompt): template and tokenizer failures are bad rows ------------------------------------

PROMPT_ROWS = [{"prompt": "What is 2 + 2?", "answer": "4"},
               {"prompt": f"half a pair: {LONE}", "answer": "?"},
               {"prompt": [{"role": "user", "content": f"again {LONE}"}], "answer": "?"},
               {"prompt": [{"role": "user", "content": "What is 3 + 3?"}], "answer": "6"}]


def _prompts(tmp_path: Path, tokenizer: Any, rows: list[Any], on_bad_row: str, **kwargs: Any):
    path = write_lines(tmp_path / "prompts.jsonl", rows)
    return path, read_prompts([DatasetConfig(path=str(path), format="prompt")], tokenizer, None, on_bad_row, None,
                              **kwargs)


def test_a_prompt_the_tokenizer_cannot_encode_is_a_bad_row(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    with pytest.raises(BadRow) as failed:
        _prompts(tmp_path, tokenizer, PROMPT_ROWS, "error")
    message = str(failed.value)
    assert message.startswith(f"{path}:2: the tokenizer cannot encode this row: the text holds a lone surrogate "
                              "'\\ud800'"), message
    assert message.endswith("Fix the row, or set data.on_bad_row: skip to skip bad rows (they are counted).")
    _, (prompts, skipped) = _prompts(tmp_path, tokenizer, PROMPT_ROWS, "skip")
    assert skipped == 2 and [p.where for p in prompts] == [f"{path}:1", f"{path}:4"]
    assert [p.fields["answer"] for p in prompts] == ["4", "6"]


def test_a_prompt_the_template_refuses_is_a_bad_row(tmp_path, tokenizer):
    import copy

    refusing = copy.deepcopy(tokenizer)
    refusing.chat_template = "{{ raise_exception('roles must alternate') }}"
    path = tmp_path / "prompts.jsonl"
    with pytest.raises(BadRow, match=f"^{path}:4: the chat template cannot render the prompt "):
        _prompts(tmp_path, refusing, [PROMPT_ROWS[0], PROMPT_ROWS[0], PROMPT_ROWS[0], PROMPT_ROWS[3]], "error")


def test_a_prompt_row_over_max_row_bytes_is_a_bad_row(tmp_path, tokenizer):
    rows = [PROMPT_ROWS[0], {"prompt": "x" * 2000, "answer": "?"}, PROMPT_ROWS[3]]
    path = tmp_path / "prompts.jsonl"
    with pytest.raises(BadRow, match=f"^{path}:2: the row is 2,029 bytes, over data.max_row_bytes \\(1,000\\)"):
        _prompts(tmp_path, tokenizer, rows, "error", max_row_bytes=1000)
    _, (prompts, skipped) = _prompts(tmp_path, tokenizer, rows, "skip", max_row_bytes=1000)
    assert skipped == 1 and len(prompts) == 2
    _, (prompts, skipped) = _prompts(tmp_path, tokenizer, rows, "skip")  # the default limit, 8 MiB
    assert skipped == 0 and len(prompts) == 3


def test_a_prompt_message_of_an_unknown_role_is_a_bad_row_as_in_sft(tmp_path, tokenizer):
    """One rule for messages (data/messages.py): an unknown role stops or is skipped; role_map names other roles."""
    rows = [PROMPT_ROWS[3], {"prompt": [{"role": "wizard", "content": "hi"}], "answer": "1"}, PROMPT_ROWS[3]]
    path = tmp_path / "prompts.jsonl"
    with pytest.raises(BadRow, match=f"^{path}:2: message 0 has unknown role 'wizard'; allowed: system, user, "
                                     r"assistant, tool \(datasets\[\].role_map names other roles\)"):
        _prompts(tmp_path, tokenizer, rows, "error")
    _, (prompts, skipped) = _prompts(tmp_path, tokenizer, rows, "skip")
    assert skipped == 1 and len(prompts) == 2
    write_lines(path, rows)
    mapped, _ = read_prompts([DatasetConfig(path=str(path), format="prompt", role_map={"wizard": "user"})],
                             tokenizer, None, "error", None)
    from finetune.rl.prompts import prompt_ids

    assert len(mapped) == 3 and mapped[1].prompt_ids == prompt_ids([{"role": "user", "content": "hi"}], tokenizer,
                                                                    None, "x")
