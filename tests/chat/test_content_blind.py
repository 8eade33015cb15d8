"""content_blind: the static proof that a chat template writes plain messages' contents only verbatim, so that a
row's rendering is the sentinel rendering of its roles with each sentinel replaced by the content.

Small templates pin each rule (allowed: verbatim output, `+`/`~` chains in the output, type and truth tests in
conditions, field reads, indexing, slicing, iteration; refused: filters, methods, comparisons, assignments,
macros, capturing blocks, whole-message uses, impure globals, and the ways around them). On the official
templates of tests/chat_families.py, every family's verdict is pinned, and every family judged content-blind is
checked empirically: its rendering of adversarial contents (whitespace at the ends, think tags, the template's
own special tokens, Jinja syntax, unicode, a long text) equals the substituted sentinel rendering, for random
role sequences the template accepts, with and without the generation prompt.
"""

from __future__ import annotations

import random

import pytest
from chat_families import FAMILIES, FAMILY, FRAGMENTS, USER_ONLY, Family, random_conversation

from finetune.chat.content_blind import content_blind

CHATML = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + BODY + '<|im_end|>\n' }}" \
         "{% endfor %}"


def chatml(body: str) -> str:
    return CHATML.replace("BODY", body)


def loop(body: str, over: str = "messages") -> str:
    return "{% for m in " + over + " %}" + body + "{% endfor %}"


BLIND = {
    "chatml": chatml("message['content']"),
    "chatml-attr": chatml("message.content"),
    "tilde-chain": loop("{{ '<' ~ m.role ~ '>' ~ m.content ~ '\n' }}"),
    "plain-output": loop("<{{ m.role }}>{{ m.content }}"),
    "type-test": loop("{% if m.content is string %}{{ m.content }}{% else %}{{ raise_exception('no') }}{% endif %}"),
    "not-type-test": loop("{% if m.content is not string %}x{% endif %}{{ m.content }}"),
    "defined-none": loop("{% if m.content is defined and m.content is not none %}{{ m.content }}{% endif %}"),
    "truthiness": loop("{% if m.content and not m.role == 'x' %}{{ '\n' + m.content }}{% endif %}"),
    "first-role": "{% if messages[0]['role'] == 'system' %}S{% endif %}" + loop("{{ m.content }}"),
    "set-slice": "{% set loop_messages = messages[1:] %}" + loop("{{ m.content }}", "loop_messages"),
    "set-message": "{% set first = messages[0] %}{{ first.role + first.content }}",
    "reversed": loop("{{ m.content }}", "messages[::-1]"),
    "index-expr": loop("{{ messages[loop.index0 - 1].role }}{{ messages[loop.index0].content }}"),
    "range-index": "{% for i in range(messages|length) %}{{ messages[i]['content'] }}{% endfor %}",
    "first-last": "{{ (messages|first).content }}{{ (messages|last)['role'] }}",
    "get-field": loop("{{ m.get('role') }}{{ m.get('content') }}{{ m.get('name', 'none') }}"),
    "tool-calls": loop("{% for c in m.tool_calls %}{{ c.function | tojson }}{% endfor %}{{ m.content }}"),
    "namespace": "{% set ns = namespace(n=0) %}" + loop("{% set ns.n = ns.n + 1 %}{{ m.content }}"),
    "message-tests": "{% if messages[0] is defined and messages[0] is mapping %}{{ messages|length }}{% endif %}",
    "generation": loop("{% generation %}{{ m.content }}{% endgeneration %}"),
    "loop-attrs": loop("{% if not loop.first %}\n{% endif %}{{ m.content }}{% if loop.last %}.{% endif %}"),
    "no-content": "{{ messages|length }}",
}
NOT_BLIND = {
    "trim": chatml("message.content | trim"),
    "strip": chatml("message['content'].strip()"),
    "in-test": loop("{% if '</think>' in m.content %}T{% endif %}{{ m.content }}"),
    "set-content": loop("{% set c = m.content %}{{ c }}"),
    "tojson": "{{ messages | tojson }}",
    "whole-message": loop("{{ m }}"),
    "message-key": "{% set key = 'content' %}" + loop("{{ m[key] }}"),
    "macro-arg": "{% macro show(x) %}{{ x.content }}{% endmacro %}" + loop("{{ show(m) }}"),
    "strftime": "{{ strftime_now('%d') }}" + loop("{{ m.content }}"),
    "slice-trim": loop("{{ m.content | trim }}", "messages[1:]"),
    "length": loop("{{ m.content | length }}"),
    "compare": loop("{% if m.content == 'x' %}x{% endif %}{{ m.content }}"),
    "filter-in-test": loop("{% if m.content | length > 3 %}x{% endif %}"),
    "type-test-set": loop("{% set s = m.content is string %}{{ s }}"),
    "cond-expr-output": loop("{{ m.content if m.role == 'user' else '' }}"),
    "chain-filtered": loop("{{ ('<' + m.content) | upper }}"),
    "chain-in-set": loop("{% set t = '<' + m.content %}{{ t }}"),
    "mod-format": loop("{{ '%s' % m.content }}"),
    "slice-content": loop("{{ m.content[:2] }}"),
    "attr-filter": loop("{{ m | attr('content') }}"),
    "items": loop("{% for k, v in m.items() %}{{ v }}{% endfor %}"),
    "items-by-key": loop("{% for k, v in m['items']() %}{{ v }}{% endfor %}"),
    "items-filter": loop("{% for k, v in m | items %}{{ v }}{% endfor %}"),
    "map-attribute": "{{ messages | map(attribute='content') | join }}",
    "iterate-message": "{% for k in messages[0] %}{{ k }}{% endfor %}",
    "get-dynamic": "{% set k = 'content' %}" + loop("{{ m.get(k) }}"),
    "get-trim": loop("{{ m.get('content') | trim }}"),
    "namespace-content": "{% set ns = namespace(x='') %}" + loop("{% set ns.x = m.content %}") + "{{ ns.x|trim }}",
    "namespace-message": "{% set ns = namespace() %}{% set ns.m = messages[0] %}{{ ns.m.content|trim }}",
    "namespace-init": "{% set ns = namespace(m=messages) %}",
    "previtem": loop("{% if loop.previtem %}{{ loop.previtem.content | trim }}{% endif %}"),
    "loop-variable": loop("{% set l = loop %}{{ l.previtem }}"),
    "set-block": loop("{% set t %}{{ m.content }}{% endset %}{{ t | trim }}"),
    "filter-block": loop("{% filter upper %}{{ m.content }}{% endfilter %}"),
    "macro-global": "{% macro f() %}{{ messages[0].content }}{% endmacro %}{{ f() | trim }}",
    "call-block": "{% macro w() %}{{ caller() | trim }}{% endmacro %}"
                  + loop("{% call w() %}{{ m.content }}{% endcall %}"),
    "first-tojson": "{{ messages | last | tojson }}",
    "message-concat": loop("{{ 'x' ~ m }}"),
    "message-compare": loop("{% if m == messages[0] %}x{% endif %}"),
    "selectattr": "{% set u = messages | selectattr('role', 'equalto', 'user') | list %}{{ u | length }}",
    "list-method": "{{ messages.copy() | tojson }}",
    "list-method-key": "{{ messages['copy']() | tojson }}",
    "tuple-target": "{% set a, b = messages %}{{ a }}",
    "random-filter": "{{ (messages | random).role }}",
    "lipsum": "{{ lipsum(1) }}",
    "random-global": "{{ random }}",
    "parse-error": "{% for m in messages %}{{ m.content }",
    "dict-call": loop("{{ dict(m) | tojson }}"),
    "autoescape": "{% autoescape true %}" + loop("{{ m.content }}") + "{% endautoescape %}",
    "content-dict-type": loop("{{ m.content.text }}"),
}


@pytest.mark.parametrize("name", sorted(BLIND))
def test_blind(name: str) -> None:
    assert content_blind(BLIND[name]) is True


@pytest.mark.parametrize("name", sorted(NOT_BLIND))
def test_not_blind(name: str) -> None:
    assert content_blind(NOT_BLIND[name]) is False


# --- the official templates ----------------------------------------------------------------------------------

# The pinned verdicts: the chatml-style families write contents verbatim; the rest trim, split, store or compare
# them (or write today's date: strftime_now).
BLIND_FAMILIES = {"qwen2.5", "smollm2", "phi3.5", "phi4"}
KNOWN = {"llama3.1", "llama3.2", "qwen2.5", "qwen3", "qwen3-no-thinking", "qwen3-0.6b-older", "qwen3-2507", "gemma2",
         "gemma3", "phi3.5", "phi4", "mistral-nemo", "mistral-small-3.2", "smollm2", "gpt-oss", "r1-distill-qwen"}

ADVERSARIAL = ["  both ends  ", "\n\nnewlines\n\n", "</think>", "<think>x</think>", "<think>\nr\n</think>\n\nA",
               "{{ messages }}", "{% if x %}y{% endif %}", "{%- raw -%}x", "émoji 🙂 中文 \u200b", "x" * 5000, " ",
               "\t", "\\n", "'q' \"dq\"", "system", "assistant\n", *USER_ONLY]
ROLES = ["system", "user", "assistant"]
SENTINEL = "\x00"


def template_of(family: Family) -> str:
    return family.build().chat_template


def render(tokenizer, family: Family, messages: list[dict[str, str]], generation: bool) -> str | None:
    """The rendering, or None where the template refuses the conversation."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                             **family.kwargs)
    except Exception:
        return None


def role_sequences(rng: random.Random, family: Family) -> list[list[str]]:
    """Alternations with an optional system message (1-6 messages), the families' own random conversations'
    roles, and random sequences of the three roles."""
    out = []
    for n in range(1, 7):
        for head in ([], ["system"]):
            out.append((head + ["user", "assistant"] * 3)[:n])
    out += [[m["role"] for m in random_conversation(rng, family)] for _ in range(20)]
    out += [[rng.choice(ROLES) for _ in range(rng.randint(1, 6))] for _ in range(20)]
    return out


def contents(rng: random.Random, tokenizer) -> str:
    specials = sorted(tokenizer.get_added_vocab())
    pool = ADVERSARIAL + specials + FRAGMENTS
    text = "".join(rng.choices(pool, k=rng.randint(1, 4)))
    assert SENTINEL not in text
    return text


def substitution_mismatches(family: Family, seed: int = 0) -> tuple[int, int]:
    """(conversations compared, how many renderings differ from their substituted sentinel rendering)."""
    tokenizer = family.build()
    rng = random.Random(seed)
    compared = differ = 0
    for roles in role_sequences(rng, family):
        texts = [contents(rng, tokenizer) for _ in roles]
        sentinels = [f"{SENTINEL}S{i}{SENTINEL}" for i in range(len(roles))]
        for generation in (False, True):
            real = render(tokenizer, family, [{"role": r, "content": t} for r, t in zip(roles, texts)], generation)
            kept = render(tokenizer, family, [{"role": r, "content": s} for r, s in zip(roles, sentinels)],
                          generation)
            assert (real is None) == (kept is None), (family.name, roles)  # refused for the roles alone
            if kept is None:
                continue
            for sentinel, text in zip(sentinels, texts):
                kept = kept.replace(sentinel, text)
            compared += 1
            differ += kept != real
    return compared, differ


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_verdict(family: Family) -> None:
    verdict = content_blind(template_of(family))
    print(f"{family.name}: content_blind={verdict}")
    if family.name in KNOWN:
        assert verdict == (family.name in BLIND_FAMILIES)
    if verdict:
        compared, differ = substitution_mismatches(family)
        assert compared >= 40 and differ == 0


def test_chatml_families_are_blind() -> None:
    assert content_blind(template_of(FAMILY["qwen2.5"])) and content_blind(template_of(FAMILY["smollm2"]))


def test_check_detects_a_template_that_is_not_blind() -> None:
    """The empirical check is not vacuous: Gemma 2 trims contents, and substitution gets those rows wrong."""
    compared, differ = substitution_mismatches(FAMILY["gemma2"])
    assert compared and differ
