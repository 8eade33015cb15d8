"""Rules for the tokenizer's vocabulary (special_tokens, tokens) and its chat template (chat_template and the
datasets' own, chat_template_jinja, chat_template_kwargs)."""

from __future__ import annotations

import difflib
from pathlib import Path

from finetune.convert.context import Conversion
from finetune.convert.keys import CHAT_TEMPLATES
from finetune.convert.reading import read_side_file

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def token_rules(c: Conversion) -> None:
    """special_tokens -> tokenizer.special_tokens (+ added_special_tokens); tokens -> tokenizer.added_tokens;
    tokenizer_use_mistral_common -> tokenizer.backend: mistral_common."""
    if c.get("tokenizer_use_mistral_common") is True and c.get("processor_type"):
        c.refuse("tokenizer_use_mistral_common", "with processor_type: images through mistral-common's own image "
                                                 "encoder are not supported (its text-only models are)")
    elif c.get("tokenizer_use_mistral_common") is True:
        c.put("tokenizer.backend", "mistral_common")
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
        text = _jinja_text(c, jinja, base)
        if text is not None:
            c.put("tokenizer.chat_template", text)
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


def _jinja_text(c: Conversion, jinja: str, base: Path) -> str | None:
    """chat_template_jinja: the template itself, or a file holding it, relative to the config's folder.

    The file's text goes into the recipe, which is shared: only a file inside the config's folder (symbolic links
    resolved) is read, unless --allow-template-path; then also one anywhere, relative to the config's folder or
    to the current directory. Only text is read (read_side_file). None, with a problem recorded, when refused."""
    if "{" in jinja:
        return jinja  # Jinja text: every template has {{ ... }} or {% ... %}
    folder = base.expanduser().resolve()
    candidates = [folder / Path(jinja).expanduser()]
    if c.allow_template_path:
        candidates.append(Path(jinja).expanduser())
    file = next((f for f in candidates if f.exists()), candidates[0])
    if not c.allow_template_path and not file.resolve().is_relative_to(folder):
        c.refuse("chat_template_jinja", f"{jinja}: a file outside the config's folder ({folder}); its text would be "
                                        "copied into the recipe, so only files inside that folder are read. Copy the "
                                        "template next to the config, or pass --allow-template-path")
        return None
    try:
        return read_side_file(file)
    except ValueError as e:
        where = "" if str(file) == jinja else f" ({file})"
        c.refuse("chat_template_jinja", f"{jinja}{where}: {e}; chat_template_jinja takes Jinja text or a template "
                                        "file")
        return None
