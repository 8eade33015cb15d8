"""Chat templates shipped with finetune, by name: `tokenizer.chat_template: chatml` needs no network.

Each file is the model vendor's official template (taken from TRL 1.16.0's wheel, which stores the templates the
models ship; qwen2_vl.jinja from the model's own chat_template.json), except chatml.jinja, the plain ChatML form
written for this project; README.md here says where each comes from and under which licence. A leaf: it imports nothing from the package.
"""

from __future__ import annotations

import difflib
from pathlib import Path

_DIR = Path(__file__).resolve().parent

# name -> what it is (docs/recipe-reference.md and `finetune convert axolotl` show these).
TEMPLATES = {
    "chatml": "ChatML (<|im_start|>role ... <|im_end|>), no system prompt added",
    "gemma": "Gemma and Gemma 2 (google/gemma-2-*-it)",
    "gemma3": "Gemma 3 (google/gemma-3-*-it)",
    "gemma4": "Gemma 4 (google/gemma-4-E2B-it, current revision)",
    "llama3": "Llama 3 (meta-llama/Meta-Llama-3-8B-Instruct; no date header, unlike 3.1 and later)",
    "qwen2_5": "Qwen2.5 (Qwen/Qwen2.5-7B-Instruct)",
    "qwen3": "Qwen3 (Qwen/Qwen3-*)",
    "qwen3_5": "Qwen3.5 (Qwen/Qwen3.5-4B and larger: thinking on by default)",
    "qwen2_vl": "Qwen2-VL and Qwen2.5-VL (Qwen/Qwen2-VL-*-Instruct): ChatML with image parts",
}


def looks_like_name(value: str) -> bool:
    """A template name rather than Jinja text: one word of letters, digits, '_', '-' or '.'."""
    return bool(value) and all(c.isalnum() or c in "_-." for c in value)


def chat_template(name: str) -> str:
    """The text of the shipped template `name` (a KeyError for an unknown name: check with unknown_name first)."""
    if name not in TEMPLATES:
        raise KeyError(name)
    return (_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def unknown_name(name: str) -> str | None:
    """Why `name` is no shipped template (with the closest name), or None when it is one."""
    if name in TEMPLATES:
        return None
    guess = difflib.get_close_matches(name, list(TEMPLATES), n=1, cutoff=0.6)
    hint = f"did you mean '{guess[0]}'?" if guess else f"shipped templates: {', '.join(TEMPLATES)}"
    return f"{name!r} is no chat template shipped with finetune (nor Jinja text); {hint}"


def resolve(value: str | None) -> str | None:
    """tokenizer.chat_template as the tokenizer takes it: a name's text, Jinja text as is, None as is."""
    return chat_template(value) if value is not None and looks_like_name(value) else value
