"""Rules for the tokenizer's vocabulary (special_tokens, tokens) and its chat template (chat_template and the
datasets' own, chat_template_jinja, chat_template_kwargs)."""

from __future__ import annotations

import difflib
from pathlib import Path

from finetune.convert.context import Conversion
from finetune.convert.keys import CHAT_TEMPLATES

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def token_rules(c: Conversion) -> None:
    """special_tokens -> tokenizer.special_tokens (+ added_special_tokens); tokens -> tokenizer.added_tokens."""
    special = c.mapping("special_tokens") or {}
    for name, value in special.items():
        if name in _SPECIAL and value is not None:
            c.put(f"tokenizer.special_tokens.{name}", str(value))
        elif name == "additional_special_tokens" and value:
            c.put("tokenizer.added_special_tokens", [str(v) for v in value])
        elif name not in (*_SPECIAL, "additional_special_tokens"):
            c.refuse(f"special_tokens.{name}", f"Axolotl's special tokens are {', '.join(_SPECIAL)} and "
                                               "additional_special_tokens")
    tokens = c.get("tokens")
    if isinstance(tokens, dict):
        c.refuse("tokens", "a mapping: Axolotl expects a list of tokens (and rejects this config itself)")
    elif tokens:
        c.put("tokenizer.added_tokens", c.texts("tokens"))


def chat_template_rules(c: Conversion, asked: list[tuple[str | None, str | None]], base: Path) -> None:
    """The one chat template of the recipe: the one every rendering dataset uses (its own, or the top-level one).

    `asked`: (chat_template, chat_template_jinja) of each dataset that renders with a chat template, (None, None)
    for one that names none. Without such datasets Axolotl only writes the template into the saved tokenizer."""
    top = (c.text("chat_template"), c.text("chat_template_jinja"))
    used = list(dict.fromkeys(top if a == (None, None) else a for a in asked)) or [top]
    if len(used) > 1:
        c.refuse("chat_template", f"the datasets use different chat templates ({', '.join(str(u[0]) for u in used)}); "
                                  "finetune renders every dataset with one tokenizer.chat_template")
        return
    name, jinja = used[0]
    renders = bool(asked)
    if c.has("chat_template_kwargs"):
        c.put("tokenizer.chat_template_kwargs", c.mapping("chat_template_kwargs"))
    if name in (None, "jinja") and jinja:
        c.put("tokenizer.chat_template", _jinja_text(jinja, base))
    elif name in (None, "tokenizer_default"):
        return
    elif name.startswith("tokenizer_default_fallback_"):
        fallback = CHAT_TEMPLATES.get(name.removeprefix("tokenizer_default_fallback_"))
        c.note(f"chat_template {name}: the tokenizer's own template" + (f"; a tokenizer without one needs "
               f"tokenizer.chat_template: {fallback}" if fallback else ""))
    elif name in CHAT_TEMPLATES and CHAT_TEMPLATES[name]:
        c.put("tokenizer.chat_template", CHAT_TEMPLATES[name])
    elif name in CHAT_TEMPLATES and renders:
        c.approximate("chat_template", f"{name}: the tokenizer's own template (finetune ships no {name} template; "
                                       "set tokenizer.chat_template to the Jinja text to use Axolotl's)")
    elif name in CHAT_TEMPLATES:
        c.drop("chat_template", f"{name}: no dataset here renders with a chat template (Axolotl only saves it "
                                "with the tokenizer)")
    else:
        guess = difflib.get_close_matches(name, [*CHAT_TEMPLATES, "tokenizer_default", "jinja"], n=1)
        c.refuse("chat_template", f"{name!r} is no Axolotl chat template" + (f"; did you mean '{guess[0]}'?" if guess
                                                                            else ""))


def _jinja_text(jinja: str, base: Path) -> str:
    """chat_template_jinja: the template itself, or a file holding it (next to the config, or as given)."""
    if "{" in jinja:
        return jinja
    for candidate in (base / jinja, Path(jinja)):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    return jinja  # recipe validation says what is wrong with it
