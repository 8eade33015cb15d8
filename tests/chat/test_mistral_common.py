"""tokenizer.backend: mistral_common (finetune/chat/mistral.py): conversations are encoded by Mistral's own library,
exactly as transformers' MistralCommonBackend.apply_chat_template encodes them, and the trained tokens are exactly
each trained assistant message's own encoding (its content or tool calls and the closing </s>), nothing else.

Every tokenizer file mistral-common ships is used (Tekken 2407 and 2409, SentencePiece v1, v2, v3, v7, v7m1): the
same files as the models' tekken.json / tokenizer.model.vN, offline.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import TOKENIZER_DIR, needs, tiny_recipe
from helpers import run_cli

from finetune.data.formats import Example
from finetune.data.sources import BadRow
from finetune.data.tokenize import tokenize_example
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import ModelConfig, TokenizerConfig, validate

# The files mistral-common ships (mistral_common/data/) and the names a model directory gives them.
FILES = {"tekken_240718.json": "tekken.json", "tekken_240911.json": "tekken.json",
         "tokenizer.model.v1": "tokenizer.model.v1",
         "mistral_instruct_tokenizer_240216.model.v2": "tokenizer.model.v2",
         "mistral_instruct_tokenizer_240323.model.v3": "tokenizer.model.v3",
         "mistral_instruct_tokenizer_241114.model.v7": "tokenizer.model.v7",
         "mistral_instruct_tokenizer_241114.model.v7m1": "tokenizer.model.v7m1"}

TOOLS = ({"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},)
CALL = {"id": "abcdefghi", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
CONVERSATIONS = {
    "multi_turn": ({"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Sky colour?"},
                   {"role": "assistant", "content": "Blue, </s> as text."}),
    "tool_call": ({"role": "user", "content": "1 + 2?"}, {"role": "assistant", "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "abcdefghi", "content": "3"},
                  {"role": "assistant", "content": "It is 3."}),
}


def tokenizer_dir(tmp_path: Path, file: str) -> Path:
    data = Path(needs("mistral_common").__file__).parent / "data"
    if file.endswith((".v1", ".v2", ".v3", ".v7", ".v7m1")):
        needs("sentencepiece")
    out = tmp_path / file.replace(".", "_")
    out.mkdir()
    shutil.copy(data / file, out / FILES[file])
    return out


def load(path: Path):
    return load_tokenizer(TokenizerConfig(path=str(path), backend="mistral_common"), ModelConfig(path=str(path)))


def own_tokens(tokenizer, messages, tools, index: int) -> list[int]:
    """Message `index` (an assistant one) encoded by itself, as mistral-common's instruct tokenizer encodes it."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    request = ChatCompletionRequest.from_openai(messages=[dict(m) for m in messages], tools=tools)
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return tokenizer.tokenizer.instruct_tokenizer.encode_assistant_message(request.messages[index], index < last_user)


@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_trained_tokens_are_exactly_the_assistant_turns(tmp_path, file, name):
    tokenizer = load(tokenizer_dir(tmp_path, file))
    assert type(tokenizer).__name__ == "MistralCommonBackend"
    messages = CONVERSATIONS[name]
    tools = list(TOOLS) if name == "tool_call" else None
    if tools and file == "tokenizer.model.v1":  # V1 has no tool tokens: the library refuses, the row is bad
        with pytest.raises(BadRow, match="Tools not implemented for tokenizer V1"):
            tokenize_example(Example(origin="row:1", messages=messages, tools=tuple(tools)), tokenizer)
        return
    sample = tokenize_example(Example(origin="row:1", messages=messages, tools=tools and tuple(tools)), tokenizer)
    ids, labels = sample["input_ids"], sample["labels"]
    # The ids are the library's own encoding of the conversation (what the model was trained on).
    assert ids == tokenizer.apply_chat_template([dict(m) for m in messages], tools=tools, return_dict=False)
    trained = [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert all(label in (IGNORE_INDEX, t) for t, label in zip(ids, labels))
    expected = [t for i, m in enumerate(messages) if m["role"] == "assistant"
                for t in own_tokens(tokenizer, messages, tools, i)]
    assert trained == expected
    assert trained.count(tokenizer.eos_token_id) == sum(m["role"] == "assistant" for m in messages)
    if name == "multi_turn":  # the content as written, each turn closed by </s>; the text "</s>" stays text
        text = tokenizer.decode(trained, skip_special_tokens=False).replace("▁", " ")
        assert text.replace(" ", "") == "Hello!</s>Blue,</s>astext.</s>"


def test_train_flags_and_train_on_inputs(tmp_path):
    tokenizer = load(tokenizer_dir(tmp_path, "tekken_240911.json"))
    messages = CONVERSATIONS["multi_turn"]
    first = own_tokens(tokenizer, messages, None, 2)
    last = own_tokens(tokenizer, messages, None, 4)
    flags = (False, False, False, False, True)  # the first assistant turn marked train: false
    sample = tokenize_example(Example(origin="r:1", messages=messages, trained=flags), tokenizer)
    assert [t for t, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE_INDEX] == last
    # train_on_inputs: every token but the first and the train: false turn (formats.py marks every other message).
    flags = (True, True, False, True, True)
    sample = tokenize_example(Example(origin="r:1", messages=messages, trained=flags, train_on_inputs=True),
                              tokenizer)
    ids, labels = sample["input_ids"], sample["labels"]
    start = next(k for k in range(len(ids)) if ids[k:k + len(first)] == first)
    untrained = [k for k, label in enumerate(labels) if label == IGNORE_INDEX]
    assert untrained == [0, *range(start, start + len(first))]


@pytest.mark.parametrize("messages, flags, says", [
    (({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}),
     (), "merges consecutive assistant messages"),
    (({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}), (True, True),
     r"message 0 \(user\) is to be trained"),
    (({"role": "user", "content": "a"},), (), "mistral-common refused this conversation"),
])
def test_rows_that_cannot_be_masked_exactly_are_bad_rows(tmp_path, messages, flags, says):
    tokenizer = load(tokenizer_dir(tmp_path, "tekken_240911.json"))
    with pytest.raises(BadRow, match=says):
        tokenize_example(Example(origin="r:7", messages=messages, trained=flags), tokenizer, notes=Counter())


def test_tool_calls_before_the_last_user_message_are_counted_unrendered(tmp_path):
    """mistral-common V2 leaves out tool calls (and their results) before the last user message: such a trained turn
    is counted as the chat-template path counts a turn the template leaves out."""
    tokenizer = load(tokenizer_dir(tmp_path, "mistral_instruct_tokenizer_240216.model.v2"))
    messages = (*CONVERSATIONS["tool_call"], {"role": "user", "content": "And 2 + 2?"},
                {"role": "assistant", "content": "4"})
    notes = Counter()
    sample = tokenize_example(Example(origin="r:1", messages=messages, tools=TOOLS), tokenizer, notes=notes)
    assert notes["turns_not_rendered"] == 1
    trained = [t for t, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE_INDEX]
    assert own_tokens(tokenizer, messages, list(TOOLS), 1) == []
    assert trained == own_tokens(tokenizer, messages, list(TOOLS), 3) + own_tokens(tokenizer, messages, None, 5)


def test_the_hf_backend_ignores_a_tekken_file_beside_tokenizer_json(tmp_path):
    data = Path(needs("mistral_common").__file__).parent / "data"
    both = tmp_path / "both"
    shutil.copytree(TOKENIZER_DIR, both)
    shutil.copy(data / "tekken_240911.json", both / "tekken.json")
    tokenizer = load_tokenizer(TokenizerConfig(path=str(both)), ModelConfig(path=str(both)))
    assert type(tokenizer).__name__ != "MistralCommonBackend"


@pytest.mark.parametrize("tokenizer_keys, extra, says", [
    ({"chat_template": "chatml"}, {}, "tokenizer.chat_template: not with tokenizer.backend: mistral_common"),
    ({"added_tokens": ["<x>"]}, {}, "tokenizer.added_tokens: not with tokenizer.backend: mistral_common"),
    ({}, {"train": {"objective": "dpo", "max_steps": 1}}, "train.objective: dpo is not supported"),
    ({}, {"roles": ["assistant", "user"]}, "only assistant turns can be trained"),
])
def test_recipe_checks(tmp_path, tokenizer_keys, extra, says):
    recipe = tiny_recipe(tmp_path / "run")
    recipe["tokenizer"].update(backend="mistral_common", **tokenizer_keys)
    if "roles" in extra:
        recipe["datasets"][0]["roles_to_train"] = extra["roles"]
    if "train" in extra:
        recipe["train"].update(extra["train"])
        recipe["datasets"][0]["format"] = "preference"
    with pytest.raises(UserError, match=says):
        validate(recipe)


def test_train_a_tiny_mistral_with_its_own_tokenizer(tmp_path):
    """The CLI end to end: a random tiny Mistral over the Tekken vocabulary trains on chat rows encoded by
    mistral-common; the run directory's tokenizer is mistral-common's file, and `finetune generate` prompts the
    run with the ids mistral-common builds ([INST] ... [/INST] as control tokens, never re-tokenized text)."""
    tok = tokenizer_dir(tmp_path, "tekken_240911.json")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": list(m)}) + "\n" for m in CONVERSATIONS.values() for _ in range(4)))
    recipe = tiny_recipe(tmp_path / "run", data)
    recipe["model"]["config"].update(model_type="mistral", vocab_size=131072)
    recipe["tokenizer"] = {"path": str(tok), "backend": "mistral_common"}
    recipe["train"]["max_steps"] = 2
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    done = run_cli("train", str(tmp_path / "recipe.yaml"))
    assert done.returncode == 0, done.stderr[-3000:]
    final = tmp_path / "run" / "final"
    assert (final / "tekken.json").read_bytes() == (tok / "tekken.json").read_bytes()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 2 and all(0 < v < 20 for v in losses)
    answer = run_cli("generate", str(tmp_path / "run"), "--prompt", "Hi", "--max-new-tokens", "3")
    assert answer.returncode == 0, answer.stderr[-3000:]
    from finetune.commands.generate import GenerationOptions, _prompt

    tokenizer = load_tokenizer(TokenizerConfig(path=str(final), backend="mistral_common"), ModelConfig(), True)
    text, inputs = _prompt(tokenizer, [{"role": "user", "content": "Hi"}], GenerationOptions())
    assert inputs["input_ids"][0].tolist() == [1, 3, 37133, 4] and text == "<s>[INST]Hi[/INST]"
