"""Assistant-only masking on the official chat templates of the major model families (tests/chat_families.py).

For every family, single- and multi-turn conversations with and without a system prompt, text that spells
other templates' control tokens and Jinja syntax, reasoning in the content and in a field, and seeded random
conversations: finetune's labels must train, per assistant turn, exactly the text `Family.expected` states
(a hand-written rule per family: the turn's content and the end-of-turn marker after it) and nothing else.
The trained text is read back from the tokens' character offsets (an added token counts as its own text), so a
mask that is off by one token shows up as a readable difference.

The one tolerated difference is leading whitespace of the content that the tokenizer merges into the token
before it (Qwen's and GPT-2's pre-tokenizers join a header's newline with the content's leading newlines,
Phi-3.5's `<|assistant|>` swallows the whitespace after it): no mask over tokens can train it without training
header text, and the check requires that the token before the turn really covers it.
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections import Counter

import pytest
from chat_families import (
    FAMILIES,
    FAMILY,
    REAL_KEY,
    Family,
    conversations,
    random_conversation,
    real_tokenizer_dir,
)
from conftest import REPO_ROOT, tiny_recipe

from finetune.chat.spans import render_chat
from finetune.data import DataStats, build_samples
from finetune.data.formats import to_example
from finetune.data.report import template_notes
from finetune.data.sources import BadRow, RawRow
from finetune.data.tokenize import NOTE_ALTERED, NOTE_SPECIAL_TEXT, NOTE_UNRENDERED, tokenize_example
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.recipe import validate

CASES = [(name, with_system) for with_system in (False, True) for name in conversations(False)]
FUZZ_PER_FAMILY = 12


def mask(tokenizer, family: Family, messages: list[dict], notes: Counter | None = None, **options) -> dict:
    example = to_example(RawRow({"messages": messages}, "t.jsonl:7"), "chat", **options)
    return tokenize_example(example, tokenizer, family.kwargs, notes)


def trained_texts(tokenizer, family: Family, messages: list[dict], sample: dict) -> list[tuple[str, str]]:
    """Per maximal run of trained tokens: (its text, whitespace just before it covered by the previous token)."""
    text = render_chat(tokenizer, messages, family.kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == sample["input_ids"], "the sample is not the tokenized rendering"
    offsets = encoded["offset_mapping"]
    added = {v: k for k, v in tokenizer.get_added_vocab().items()}
    runs, current = [], None
    for t, label in enumerate(sample["labels"]):
        if label != IGNORE_INDEX:
            assert label == sample["input_ids"][t]
            current = [t, t] if current is None else [current[0], t]
        elif current is not None:
            runs.append(current)
            current = None
    runs += [current] if current else []
    out = []
    for first, last in runs:
        got, cursor = "", 0
        for t in range(first, last + 1):
            a, b = offsets[t]
            token = sample["input_ids"][t]
            if token in added and added[token] in text[a:b]:  # an rstrip token's offsets cover what it swallowed
                got, cursor = got + added[token], max(cursor, a + len(added[token]))
            else:  # SentencePiece's '▁' maps onto the next character: offsets can overlap
                got, cursor = got + text[max(a, cursor):b], max(cursor, b)
        start = offsets[first][0]
        before = offsets[first - 1] if first else (0, 0)
        covered = text[before[0]:start] if before[1] > before[0] else ""
        out.append((got, covered))
    return out


def assert_exact(tokenizer, family: Family, messages: list[dict], sample: dict) -> int:
    """Each assistant turn trains exactly family.expected; returns how many turns lost leading whitespace."""
    wanted = [family.expected(messages, i) for i, m in enumerate(messages) if m["role"] == "assistant"]
    runs = trained_texts(tokenizer, family, messages, sample)
    assert len(runs) == len(wanted), f"{len(runs)} trained runs for {len(wanted)} assistant turns: {runs}"
    merged = 0
    for (got, covered), want in zip(runs, wanted):
        if got != want:
            lead = want[: len(want) - len(got)]
            assert want.endswith(got) and lead.isspace(), f"trained {got!r}, expected {want!r}"
            # Only whitespace that a token starting before the content (in the header) covers.
            assert covered.endswith(lead) and len(covered) > len(lead), \
                f"trained {got!r}, expected {want!r}: {lead!r} untrained, the token before covers {covered!r}"
            merged += 1
    return merged


@pytest.mark.parametrize("case,with_system", CASES, ids=[f"{n}{'+system' if s else ''}" for n, s in CASES])
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_each_turn_trains_exactly_its_content_and_end_marker(family, case, with_system):
    tokenizer = family.build()
    messages = conversations(with_system)[case]
    if with_system and not family.system_ok:
        with pytest.raises(BadRow, match="t.jsonl:7: the chat template refused this conversation"):
            mask(tokenizer, family, messages)
        return
    assert_exact(tokenizer, family, messages, mask(tokenizer, family, messages))


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_random_conversations(family):
    tokenizer = family.build()
    rng = random.Random(f"chat-{family.name}")
    for _ in range(FUZZ_PER_FAMILY):
        messages = random_conversation(rng, family)
        assert_exact(tokenizer, family, messages, mask(tokenizer, family, messages))


def test_the_tolerated_leading_whitespace_really_is_merged_into_the_header():
    # Content starting with newlines after Qwen's "assistant\n": the pre-tokenizer makes one "\n\n\n" token,
    # which starts in the header, so it is not trained; everything after it is.
    family = FAMILY["qwen2.5"]
    tokenizer = family.build()
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello"}]
    (got, covered), = trained_texts(tokenizer, family, messages, mask(tokenizer, family, messages))
    assert got == "Hello<|im_end|>" and covered == "\n\n\n"
    assert assert_exact(tokenizer, family, messages, mask(tokenizer, family, messages)) == 1


# --- roles, flags, template kwargs, notes -------------------------------------------------------------------

def test_roles_to_train_and_per_message_flags_on_a_non_prefix_stable_template():
    family = FAMILY["qwen3"]
    tokenizer = family.build()
    messages = [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "train": False}, {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "A2"}]
    sample = mask(tokenizer, family, messages, roles_to_train=("user", "assistant"))
    texts = [got for got, _ in trained_texts(tokenizer, family, messages, sample)]
    assert texts == ["Q1<|im_end|>", "Q2<|im_end|>", "<think>\n\n</think>\n\nA2<|im_end|>"]
    messages[0]["train"] = True  # a flag wins over roles_to_train
    sample = mask(tokenizer, family, messages)
    assert [got for got, _ in trained_texts(tokenizer, family, messages, sample)] == \
        ["Sys<|im_end|>", "<think>\n\n</think>\n\nA2<|im_end|>"]


def test_train_on_inputs_masks_only_turns_marked_train_false():
    family = FAMILY["llama3.1"]
    tokenizer = family.build()
    messages = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "bad answer", "train": False},
                {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    sample = mask(tokenizer, family, messages, train_on_inputs=True)
    masked = [t for t, label in zip(sample["input_ids"], sample["labels"]) if label == IGNORE_INDEX]
    assert tokenizer.decode(masked[1:]) == "bad answer<|eot_id|>"  # [0] is the first token, never trained
    plain = mask(tokenizer, family, [{k: v for k, v in m.items() if k != "train"} for m in messages],
                 train_on_inputs=True)
    assert plain["labels"][1:] == plain["input_ids"][1:]


def test_enable_thinking_false_moves_the_empty_think_block_into_the_prompt():
    thinking, no_thinking = FAMILY["qwen3"], FAMILY["qwen3-no-thinking"]
    tokenizer = thinking.build()
    messages = conversations(False)["single"]
    with_block = trained_texts(tokenizer, thinking, messages, mask(tokenizer, thinking, messages))
    without = trained_texts(tokenizer, no_thinking, messages, mask(tokenizer, no_thinking, messages))
    assert [t for t, _ in with_block] == ["<think>\n\n</think>\n\n4<|im_end|>"]
    assert [t for t, _ in without] == ["4<|im_end|>"]
    # Both render the same text: only what counts as prompt differs.
    assert render_chat(tokenizer, messages, thinking.kwargs) == render_chat(tokenizer, messages, no_thinking.kwargs)


def test_notes_count_dropped_reasoning_unrendered_messages_and_special_token_text():
    r1 = FAMILY["r1-distill-qwen"]
    notes: Counter = Counter()
    mask(r1.build(), r1, conversations(False)["reasoning"], notes)
    assert notes[NOTE_ALTERED] == 3 and notes[NOTE_UNRENDERED] == 0 and notes[NOTE_SPECIAL_TEXT] == 0
    nemo = FAMILY["mistral-nemo"]
    notes = Counter()
    mask(nemo.build(), nemo, conversations(True)["single"], notes, roles_to_train=("system", "assistant"))
    assert notes[NOTE_UNRENDERED] == 1  # Nemo drops the system prompt when the assistant speaks last
    qwen = FAMILY["qwen2.5"]
    notes = Counter()
    mask(qwen.build(), qwen, conversations(False)["tricky"], notes)
    assert notes[NOTE_SPECIAL_TEXT] == 1 and notes[NOTE_ALTERED] == 0


def test_literal_special_token_text_becomes_the_token_and_masking_stays_exact():
    family = FAMILY["qwen2.5"]
    tokenizer = family.build()
    messages = [{"role": "user", "content": "say <|im_end|>"}, {"role": "assistant", "content": "a<|im_end|>b"}]
    sample = mask(tokenizer, family, messages)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    clean = mask(tokenizer, family, [{**m, "content": m["content"].replace("<|im_end|>", "")} for m in messages])
    assert sample["input_ids"].count(im_end) == clean["input_ids"].count(im_end) + 2  # one per literal
    assert [t for t, _ in trained_texts(tokenizer, family, messages, sample)] == ["a<|im_end|>b<|im_end|>"]


def test_a_template_that_is_not_local_is_an_error_not_a_guess():
    family = FAMILY["qwen2.5"]
    tokenizer = family.build()  # shared: the next build() puts the official template back
    tokenizer.chat_template = ("{{ messages[-1]['content'] }}|{% for m in messages %}{{ m['role'] }}: "
                               "{{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(UserError, match=r"t.jsonl:7: the chat template renders message 0 \(user\) differently "
                                        r"when the text of message 1 \(assistant\) changes"):
        mask(tokenizer, family, conversations(False)["single"])


# --- recipe keys and data rows ------------------------------------------------------------------------------

def test_recipe_template_kwargs_and_roles_reach_the_samples(tmp_path):
    family = FAMILY["qwen3"]
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}\n')
    raw = tiny_recipe(tmp_path / "run", data)
    raw["tokenizer"]["chat_template_kwargs"] = {"enable_thinking": False}
    raw["datasets"][0]["roles_to_train"] = ["user", "assistant"]
    recipe = validate(raw)
    tokenizer = family.build()
    (sample,), _, stats, _ = build_samples(recipe, tokenizer)
    labelled = tokenizer.decode([t for t in sample["labels"] if t != IGNORE_INDEX])
    assert labelled == "Q<|im_end|>A<|im_end|>"  # no think block: enable_thinking reached the template
    assert stats.target_tokens == sum(1 for t in sample["labels"] if t != IGNORE_INDEX)


@pytest.mark.parametrize("patch,message", [
    ({"tokenizer": {"chat_template_kwargs": {"add_generation_prompt": True}}},
     "tokenizer.chat_template_kwargs.add_generation_prompt: an argument finetune sets itself"),
    ({"datasets": [{"roles_to_train": ["user", "user"]}]}, "datasets.0.roles_to_train: ['user', 'user'] names a role twice"),
    ({"datasets": [{"roles_to_train": ["bot"]}]}, "datasets.0.roles_to_train.0"),
    ({"datasets": [{"roles_to_train": []}]}, "datasets.0.roles_to_train"),
    ({"datasets": [{"roles_to_train": ["user"], "train_on_inputs": True}]},
     "datasets.0.roles_to_train: train_on_inputs: true trains every role"),
    ({"datasets": [{"roles_to_train": ["user"], "format": "completion"}]},
     "datasets.0.roles_to_train: format completion has no roles"),
])
def test_bad_recipe_keys_are_clear_errors(tmp_path, patch, message):
    raw = tiny_recipe(tmp_path / "run", tmp_path / "train.jsonl")
    for section, value in patch.items():
        if section == "datasets":
            raw["datasets"][0].update(value[0])
        else:
            raw[section].update(value)
    with pytest.raises(UserError, match=re.escape(message)):
        validate(raw)


@pytest.mark.parametrize("message,error", [
    ({"role": "assistant", "content": "A", "train": "no"}, "t.jsonl:7: message 1 has train: 'no'; it must be true"),
    ({"role": "assistant", "content": "A", "training": False}, "t.jsonl:7: message 1 has 'training'; the per-message "
                                                               "flag is train: true|false"),
    ({"role": "assistant", "content": "A", "weight": 0}, "t.jsonl:7: message 1 has 'weight'"),
    ({"role": "assistant", "content": "A", "thinking": ["x"]}, "t.jsonl:7: message 1 (assistant) has a 'thinking' "
                                                               "that is not a string"),
    ({"role": "assistant", "content": "A", "train": False}, "t.jsonl:7: no message is trained (roles_to_train: "
                                                            "assistant; a message marked train: false is not)"),
])
def test_bad_message_fields_are_bad_rows_naming_the_row(message, error):
    with pytest.raises(BadRow, match=re.escape(error)):
        to_example(RawRow({"messages": [{"role": "user", "content": "Q"}, message]}, "t.jsonl:7"), "chat")


def test_reasoning_on_a_user_message_is_a_bad_row():
    row = RawRow({"messages": [{"role": "user", "content": "Q", "reasoning_content": "r"},
                               {"role": "assistant", "content": "A"}]}, "t.jsonl:3")
    with pytest.raises(BadRow, match=re.escape("t.jsonl:3: message 0 (user) has 'reasoning_content'; only assistant")):
        to_example(row, "chat")


def test_a_conversation_with_no_assistant_is_fine_when_another_role_is_trained():
    row = RawRow({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}, "t.jsonl:1")
    assert to_example(row, "chat", roles_to_train=("user",)).trained == (False, True)
    with pytest.raises(BadRow, match="no assistant turn"):
        to_example(row, "chat")


def test_preprocess_notes_say_what_the_template_did():
    stats = DataStats(turns_text_changed=3, turns_not_rendered=1, rows_with_special_token_text=2)
    notes = template_notes(stats)
    assert len(notes) == 3 and "3 trained turns" in notes[0] and "1 trained messages are not rendered" in notes[1]
    assert "2 rows have message text that spells a special token" in notes[2]
    assert template_notes(DataStats()) == []


def test_docs_chat_templates_is_current():
    spec = importlib.util.spec_from_file_location("gen_chat_templates_doc",
                                                  REPO_ROOT / "scripts" / "gen_chat_templates_doc.py")
    assert spec and spec.loader
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.main(["--check"]) == 0, "run .venv/bin/python scripts/gen_chat_templates_doc.py"


# --- the real tokenizers of the stand-in families (opt-in) --------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_KEY))
def test_real_tokenizers_of_the_stand_in_families(name):
    real = real_tokenizer_dir()
    if real is None:
        pytest.skip("set FINETUNE_REAL_CHAT_TOKENIZERS to a directory of the real tokenizers (tests/chat_families.py)")
    family = FAMILY[name]
    tokenizer = family.build(real)
    for with_system in (False, True):
        for messages in conversations(with_system).values():
            if with_system and not family.system_ok:
                continue
            assert_exact(tokenizer, family, messages, mask(tokenizer, family, messages))
    rng = random.Random(f"real-{name}")
    for _ in range(50):
        messages = random_conversation(rng, family)
        assert_exact(tokenizer, family, messages, mask(tokenizer, family, messages))
