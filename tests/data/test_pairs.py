"""Preference rows (format: preference): TRL's layout and the implicit-prompt form parsed into pairs, bad rows
named by file:line, and the pair budget of data.max_seq_len."""

from __future__ import annotations

import pytest

from finetune.data.pairs import fit_pair, to_pair
from finetune.data.sources import BadRow, RawRow

U, A = "user", "assistant"


def _row(**data):
    return RawRow(data, "prefs.jsonl:7")


def test_strings_become_a_user_prompt_and_assistant_completions():
    pair = to_pair(_row(prompt="2+2?", chosen="4", rejected="5"))
    assert pair.prompt == ({"role": U, "content": "2+2?"},)
    assert pair.chosen == ({"role": A, "content": "4"},) and pair.rejected == ({"role": A, "content": "5"},)
    side = pair.side(pair.chosen)
    assert side.messages == pair.prompt + pair.chosen and side.trained == (False, True)


def test_message_prompts_keep_earlier_assistant_turns_unscored():
    prompt = [{"role": "system", "content": "be brief"}, {"role": U, "content": "hi"}, {"role": A, "content": "hey"},
              {"role": U, "content": "2+2?"}]
    pair = to_pair(_row(prompt=prompt, chosen=[{"role": A, "content": "4"}], rejected=[{"role": A, "content": "5"}]))
    assert pair.side(pair.rejected).trained == (False, False, False, False, True)


def test_implicit_prompt_is_the_longest_common_prefix_of_messages():
    shared = [{"role": U, "content": "hi"}, {"role": A, "content": "hey"}, {"role": U, "content": "2+2?"}]
    pair = to_pair(_row(chosen=[*shared, {"role": A, "content": "4"}], rejected=[*shared, {"role": A, "content": "5"}]))
    assert pair.prompt == tuple(shared) and pair.chosen == ({"role": A, "content": "4"},)
    # One conversation a prefix of the other plus an extra turn: the prompt stops before the assistant turn.
    longer = to_pair(_row(chosen=[*shared, {"role": A, "content": "4"}],
                          rejected=[*shared, {"role": A, "content": "4"}, {"role": U, "content": "sure?"},
                                    {"role": A, "content": "no"}]))
    assert longer.prompt == tuple(shared) and len(longer.rejected) == 3


@pytest.mark.parametrize(("data", "message"), [
    ({"prompt": "x", "chosen": "a"}, "need 'chosen' and 'rejected'"),
    ({"prompt": "x", "chosen": "a", "rejected": "a"}, "are the same"),
    ({"prompt": "x", "chosen": 3, "rejected": "b"}, "'chosen' must be a string or a non-empty list"),
    ({"prompt": [{"role": U, "content": "x"}, {"role": A, "content": "y"}], "chosen": "a", "rejected": "b"},
     "prompt ends with an assistant message"),
    ({"prompt": "x", "chosen": [{"role": U, "content": "a"}], "rejected": "b"}, "must start with an assistant"),
    ({"chosen": "a b", "rejected": "a c"}, "give 'prompt'"),
    ({"chosen": [{"role": U, "content": "p"}], "rejected": [{"role": U, "content": "q"}]}, "share no prompt"),
    ({"prompt": "x", "chosen": [{"role": "bot", "content": "a"}], "rejected": "b"}, "needs a role"),
])
def test_bad_rows_name_their_origin(data, message):
    with pytest.raises(BadRow, match=message) as info:
        to_pair(_row(**data))
    assert str(info.value).startswith("prefs.jsonl:7: ")


def _side(prompt: int, completion: int) -> dict:
    ids = list(range(prompt + completion))
    return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}


def test_a_pair_fits_the_budget_from_its_longer_completion_and_never_into_a_prompt():
    chosen, rejected = _side(4, 3), _side(4, 9)
    assert fit_pair(chosen, rejected, None) == (chosen, rejected, 0)
    c, r, cut = fit_pair(chosen, rejected, 16)  # 20 tokens: 4 cut from the longer (rejected) completion
    assert (len(c["input_ids"]), len(r["input_ids"]), cut) == (7, 9, 4)
    c, r, cut = fit_pair(chosen, rejected, 10)  # both cut down to one scored token each
    assert (len(c["input_ids"]), len(r["input_ids"]), cut) == (5, 5, 10)
    assert fit_pair(chosen, rejected, 9) is None  # the prompts and one scored token each need 10
    assert fit_pair(_side(3, 0), rejected, None) is None  # nothing scored on one side


def test_preference_rows_through_field_names_and_role_names():
    from finetune.data.formats import MessageFields
    from finetune.data.pairs import PairFields

    fields = PairFields("conversation", "good", "bad", MessageFields("from", "value", (("human", "user"),)))
    row = _row(conversation=[{"from": "human", "value": "2+2?"}], good=[{"from": "assistant", "value": "4"}], bad="5")
    pair = to_pair(row, fields)
    assert pair.prompt == ({"role": "user", "content": "2+2?"},)
    assert pair.chosen == ({"role": "assistant", "content": "4"},) and pair.rejected[0]["content"] == "5"
    with pytest.raises(BadRow, match="preference rows need 'good' and 'bad'"):
        to_pair(_row(conversation="x", chosen="a", rejected="b"), fields)


# --- the completion boundary (dpo.completion_end, orpo.completion_end) -----------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from helpers import ROOT
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "examples" / "tokenizer")


def _scored(side: dict, tokenizer) -> str:
    return "".join(tokenizer.decode([t]) for t in side["labels"] if t != -100)


def test_the_completion_ends_at_the_marker_or_at_the_end_of_the_rendering(tokenizer):
    """marker scores the content and <|im_end|> (as SFT); template also the newline ChatML writes after it (TRL's
    DPOTrainer); template+eos then one more <|im_end|> (TRL's ORPOTrainer). The prompt is never scored, and the
    sequences differ only by that appended eos."""
    from finetune.data.pairs import tokenize_pair

    pair = to_pair(_row(prompt=[{"role": U, "content": "What is 2 * 5?"}], chosen="10", rejected="Sure: 10"))
    marker, template, with_eos = (tokenize_pair(pair, tokenizer, end=end)
                                  for end in ("marker", "template", "template+eos"))
    assert [_scored(s, tokenizer) for s in marker] == ["10<|im_end|>", "Sure: 10<|im_end|>"]
    assert [_scored(s, tokenizer) for s in template] == ["10<|im_end|>\n", "Sure: 10<|im_end|>\n"]
    assert [_scored(s, tokenizer) for s in with_eos] == ["10<|im_end|>\n<|im_end|>", "Sure: 10<|im_end|>\n<|im_end|>"]
    for m, t, e in zip(marker, template, with_eos):
        assert m["input_ids"] == t["input_ids"] == e["input_ids"][:-1] and e["input_ids"][-1] == tokenizer.eos_token_id
        prompt = m["labels"].index(next(x for x in m["labels"] if x != -100))
        assert t["labels"][:prompt] == e["labels"][:prompt] == [-100] * prompt


def test_a_multi_turn_completion_is_scored_whole_to_the_end_with_template(tokenizer):
    """Two assistant messages in a completion: marker scores each turn, template everything after the prompt
    (the second turn's header too, as TRL scores every token after its prompt)."""
    from finetune.data.pairs import tokenize_pair

    turns = [{"role": A, "content": "10"}, {"role": A, "content": "ten"}]
    pair = to_pair(_row(prompt="2*5?", chosen=turns, rejected="12"))
    marker, template = (tokenize_pair(pair, tokenizer, end=end)[0] for end in ("marker", "template"))
    assert _scored(marker, tokenizer) == "10<|im_end|>ten<|im_end|>"
    assert _scored(template, tokenizer) == "10<|im_end|>\n<|im_start|>assistant\nten<|im_end|>\n"


def test_the_boundary_is_the_objectives_and_in_the_data_cache_key(tokenizer):
    """completion_end follows train.objective (ORPO's template is template+eos), and a recipe whose boundary is
    not the default's tokenizes into another cache entry (the default's key is unchanged)."""
    from helpers import QUICKSTART

    from finetune.data.cache import cache_inputs, cache_key
    from finetune.data.pairs import completion_end
    from finetune.recipe import load_recipe

    def recipe(*extra):
        return load_recipe(QUICKSTART, ["datasets.0.format=preference", "eval_datasets.0.format=preference", *extra])

    assert completion_end(recipe("train.objective=dpo")) == "marker"
    assert completion_end(recipe("train.objective=dpo", "dpo.completion_end=template")) == "template"
    assert completion_end(recipe("train.objective=orpo", "orpo.completion_end=template")) == "template+eos"
    assert completion_end(recipe("train.objective=orpo", "dpo.completion_end=template")) == "marker"
    default = cache_inputs(recipe("train.objective=dpo"), tokenizer)
    assert "pair_completion_end" not in default
    other = cache_inputs(recipe("train.objective=dpo", "dpo.completion_end=template"), tokenizer)
    assert cache_key(other) != cache_key(default) and other["pair_completion_end"] == "template"


def test_the_shipped_pairs_regenerate_and_the_format_pairs_differ_only_in_format(tmp_path):
    """scripts/make_preference_data.py writes the committed pair files byte for byte; in the format pairs (the
    quickstart-dpo example) the rejected answer is the chosen one, right, in a broken format."""
    import importlib.util
    import json

    from helpers import ROOT

    spec = importlib.util.spec_from_file_location("make_preference_data", ROOT / "scripts" / "make_preference_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out-dir", str(tmp_path)])
    data = ROOT / "examples" / "data"
    names = ["quickstart_pref_train.jsonl", "quickstart_pref_eval.jsonl", "quickstart_format_pref_train.jsonl",
             "quickstart_format_pref_eval.jsonl"]
    for name in names:
        assert (tmp_path / name).read_bytes() == (data / name).read_bytes(), name
    rows = [json.loads(x) for x in (data / names[2]).read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 480
    for row in rows:
        chosen, rejected = row["chosen"][-1]["content"], row["rejected"][-1]["content"]
        assert chosen in rejected and chosen != rejected
