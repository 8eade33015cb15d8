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
