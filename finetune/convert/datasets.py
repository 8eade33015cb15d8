"""Axolotl dataset entries -> recipe datasets: the prompt type, the field and role mappings, what is trained.

`type: alpaca[:style]` is an alpaca dataset under Axolotl's prompt (prompt_template); `type: chat_template` a chat
dataset read through Axolotl's field and role mappings (its default role names human and gpt, and the `system`
column it prepends, written out); `type: chat_template.default` with rl a preference dataset; `completion` plain
text; Axolotl's distillation types (with kd_trainer) chat datasets whose rows hold the teacher's top-k
(rules_distill.py). Every key of an entry is in exactly one of keys.DATASET_* tables.
"""

from __future__ import annotations

import difflib
from typing import Any

from finetune.convert.context import Conversion, is_off
from finetune.convert.keys import DATASET_DROPPED, DATASET_MAPPED, DATASET_REFUSED
from finetune.convert.rules_distill import KD_TYPES, kd_dataset, kd_requested
from finetune.convert.rules_vision import is_vision, vision_dataset

_STYLES = {None: "alpaca", "instruct": "alpaca", "chat": "alpaca_chat", "chatml": "alpaca_chatml", "phi": "alpaca_phi"}
_ROLES = ("system", "user", "assistant")
# Axolotl's role names for chat_template datasets when `roles` is not given (besides the roles themselves).
_DEFAULT_ALIASES = {"human": "user", "gpt": "assistant"}
_REASONING = ("reasoning_content", "thinking")
# The kind of value each mapped entry key takes (Axolotl's schema).
_KINDS: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("path", "field_messages", "message_field_role", "message_field_content", "train_on_eos",
                     "train_on_eot", "field", "field_chosen", "field_rejected", "chat_template", "chat_template_jinja",
                     "message_field_training", "field_thinking", "template_thinking_key"), (str,)),
    "split": (str, int), "name": (str, int), "type": (str, dict), "message_property_mappings": (dict,),
    "roles": (dict,), "roles_to_train": (list,), "data_files": (str, list),
}


def dataset_rules(c: Conversion, key: str, target: str) -> list[tuple[Any, Any]]:
    """Convert the entries of `key` (datasets, test_datasets) into the recipe list `target`; returns, for each entry
    that renders with a chat template, its own (chat_template, chat_template_jinja) ((None, None): the top-level)."""
    entries = c.get(key)
    if entries is None:
        return []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        c.refuse(key, "a list of dataset entries (mappings) expected")
        return []
    out, templates = [], []
    for i, entry in enumerate(entries):
        converted, template = _entry(c, f"{key}.{i}", entry)
        if converted is not None:
            out.append(converted)
        if template is not None:
            templates.append(template)
    c.put(target, out)
    return templates


def _entry(c: Conversion, where: str, entry: dict[str, Any]) -> tuple[dict[str, Any] | None, tuple | None]:
    known = {*DATASET_MAPPED, *DATASET_DROPPED, *DATASET_REFUSED}
    for name, value in entry.items():
        if name not in known:
            guess = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            c.refuse(f"{where}.{name}", "not an Axolotl dataset key (Axolotl ignores it silently)"
                     + (f"; did you mean '{guess[0]}'?" if guess else "; remove it"))
        elif name in DATASET_REFUSED and not is_off(value):
            c.refuse(f"{where}.{name}", DATASET_REFUSED[name])
        elif name in DATASET_DROPPED and value is not None:
            c.drop(f"{where}.{name}", DATASET_DROPPED[name])
    wrong = [name for name, kinds in _KINDS.items() if entry.get(name) is not None and
             (isinstance(entry[name], bool) or not isinstance(entry[name], kinds) or not _strings_inside(entry[name]))]
    for name in wrong:
        c.refuse(f"{where}.{name}", f"got {entry[name]!r}; Axolotl expects "
                                    f"{' or '.join('a mapping' if k is dict else 'a list' if k is list else 'a string' if k is str else 'a number' for k in _KINDS[name])}"
                                    " (of strings)" * (dict in _KINDS[name] or list in _KINDS[name]))
    path = entry.get("path")
    if wrong or not isinstance(path, str) or not path:
        c.refuse(f"{where}.path", "required: a hub dataset name or a local file")
        return None, None
    out: dict[str, Any] = {"path": path}
    for name, ours in (("split", "split"), ("name", "name")):
        if entry.get(name) is not None:
            out[ours] = str(entry[name])
    files = entry.get("data_files")
    if files:
        out["data_files"] = [str(f) for f in ([files] if isinstance(files, str) else files)]
    kind = entry.get("type")
    kd = kind in KD_TYPES
    if not kd:
        for name in ("logprobs_field", "temperature"):
            if entry.get(name) is not None:
                c.drop(f"{where}.{name}", "read only by Axolotl's distillation dataset types "
                                          "(axolotl.integrations.kd.chat_template)")
    if c.peek("train.objective") == "grpo":  # Axolotl's GRPO datasets name a Python transform finetune cannot run
        c.note(f"{where}.type: {kind} is not run: finetune reads the rows as they are (format: prompt): each needs a "
               "`prompt` (text or messages) and the fields your rewards read; a row without one stops the run")
        return {**out, "format": "prompt"}, None
    if not isinstance(kind, str):
        what = "a custom prompt type (a mapping)" if isinstance(kind, dict) else "already tokenized rows (no type)"
        c.refuse(f"{where}.type", f"{what} is not supported; use alpaca, chat_template or completion")
        return None, None
    if is_vision(c) and kind != "chat_template":
        c.refuse(f"{where}.type", f"{kind}: Axolotl's multimodal collator reads every row as chat messages whatever "
                                  "its type; finetune converts vision-language datasets of type chat_template")
        return None, None
    if kd or kd_requested(c):
        return _distill(c, where, entry, out, kind)
    base, _, style = kind.partition(":")
    if base == "alpaca":
        return _alpaca(c, where, entry, out, style or None), None
    template = (entry.get("chat_template"), entry.get("chat_template_jinja"))
    if kind == "chat_template" and is_vision(c):
        return vision_dataset(c, where, entry, out), template
    if kind == "chat_template":
        return _chat(c, where, entry, out), template
    if kind == "chat_template.default" and c.peek("train.objective") in ("dpo", "orpo"):
        return _preference(c, where, entry, out), template
    if kind == "completion":
        return _completion(c, where, entry, out), None
    if kind == "bradley_terry.chat_template" and c.peek("train.objective") == "reward":
        return _bradley_terry(out), template
    why = "a preference type: needs rl (dpo, ipo, orpo)" if kind.startswith("chat_template.") else "not supported"
    c.refuse(f"{where}.type", f"{kind}: {why}; finetune converts alpaca[:instruct|chat|chatml|phi], chat_template, "
                              "chat_template.default (with rl), bradley_terry.chat_template (with reward_model) and "
                              "completion")
    return None, None


def _distill(c: Conversion, where: str, entry: dict, out: dict, kind: str) -> tuple[dict | None, tuple | None]:
    """A dataset of a kd_trainer run: a chat dataset whose rows hold the teacher's top-k (rules_distill.py)."""
    if not kd_requested(c):
        c.refuse(f"{where}.type", f"{kind}: a distillation type, read only with kd_trainer (and Axolotl's KD plugin)")
        return None, None
    if kind not in KD_TYPES:
        c.refuse(f"{where}.type", f"{kind}: with kd_trainer every dataset holds the teacher's log-probabilities "
                                  "(Axolotl's KD trainer needs them in every batch): type "
                                  "axolotl.integrations.kd.chat_template or its .load_legacy")
        return None, None
    kd_dataset(c, where, entry)
    return _chat(c, where, entry, out), (entry.get("chat_template"), entry.get("chat_template_jinja"))


def _alpaca(c: Conversion, where: str, entry: dict, out: dict, style: str | None) -> dict | None:
    if style not in _STYLES:
        c.refuse(f"{where}.type", f"alpaca:{style}: Axolotl's alpaca styles are instruct, chat, chatml, phi")
        return None
    _unused(c, where, entry, ("field_messages", "message_property_mappings", "roles", "roles_to_train"))
    out.update(format="alpaca", prompt_template=_STYLES[style])
    if c.boolean("train_on_inputs"):
        out["train_on_inputs"] = True
    return out


def _completion(c: Conversion, where: str, entry: dict, out: dict) -> dict:
    out["format"] = "completion"
    if entry.get("field") not in (None, "text"):
        out["text_field"] = str(entry["field"])
    c.approximate(f"{where}.type", "completion: a text longer than sequence_len is dropped or truncated "
                                   "(data.truncation); Axolotl cuts it into sequence_len pieces, each a sample")
    return out


def _chat(c: Conversion, where: str, entry: dict, out: dict) -> dict:
    out["format"] = "chat"
    if entry.get("field_messages") not in (None, "messages"):
        out["messages_field"] = str(entry["field_messages"])
    _message_fields(c, where, entry, out, aliases=_DEFAULT_ALIASES)
    out["system_field"] = "system"  # Axolotl prepends a row's `system` when the conversation has no system turn
    if entry.get("drop_system_message") is True:
        out["drop_system_message"] = True
    roles = entry.get("roles_to_train")
    if roles is not None:
        if not isinstance(roles, list) or not roles or any(r not in _ROLES for r in roles):
            c.refuse(f"{where}.roles_to_train", f"{roles!r}: a non-empty list of system, user, assistant")
        elif roles != ["assistant"]:
            out["roles_to_train"] = list(dict.fromkeys(roles))
    if c.boolean("train_on_inputs"):
        out.pop("roles_to_train", None)
        out["roles_to_train"] = list(_ROLES)  # Axolotl trains every turn's content and end, not the headers
    for name in ("train_on_eos", "train_on_eot"):
        if entry.get(name) not in (None, "turn"):
            c.approximate(f"{where}.{name}", f"{entry[name]}: finetune trains the end-of-turn marker of each "
                                             "trained turn (Axolotl's turn)")
    if entry.get("message_field_training") not in (None, "train"):
        c.refuse(f"{where}.message_field_training", f"{entry['message_field_training']!r}: finetune reads a "
                 "message's flag from its `train` field; rename it in the data")
    for name in ("field_thinking", "template_thinking_key"):
        if entry.get(name) not in (None, *_REASONING):
            c.refuse(f"{where}.{name}", f"{entry[name]!r}: finetune reads reasoning from {' or '.join(_REASONING)}")
    return out


def _preference(c: Conversion, where: str, entry: dict, out: dict) -> dict:
    out["format"] = "preference"
    for axolotl, ours, default in (("field_messages", "prompt_field", "messages"), ("field_chosen", "chosen_field",
                                   "chosen"), ("field_rejected", "rejected_field", "rejected")):
        value = entry.get(axolotl) or default
        if value != ours.removesuffix("_field"):
            out[ours] = str(value)
    _message_fields(c, where, entry, out, aliases={})
    c.note(f"{where}: a chosen or rejected list is read as the completion's messages (Axolotl keeps only the last); "
           "a list holding more than assistant turns is a bad row here, not silently cut")
    return out


def _bradley_terry(out: dict) -> dict:
    """Axolotl's reward-model pairs: a row's `system` (when not empty), its `input` as the user turn, and its `chosen`
    and `rejected` answers."""
    return {**out, "format": "preference", "prompt_field": "input", "system_field": "system"}


def _message_fields(c: Conversion, where: str, entry: dict, out: dict, aliases: dict[str, str]) -> None:
    """message_property_mappings (or message_field_role/content) and roles -> role_field, content_field, role_map."""
    mapping = dict(entry.get("message_property_mappings") or {})
    for old, part in (("message_field_role", "role"), ("message_field_content", "content")):
        if entry.get(old) is not None:
            mapping.setdefault(part, entry[old])
    for part in ("role", "content"):
        if mapping.get(part, part) != part:
            out[f"{part}_field"] = str(mapping[part])
    extra = sorted(set(mapping) - {"role", "content"})
    if extra:
        c.refuse(f"{where}.message_property_mappings", f"{extra}: finetune maps a message's role and content only")
    roles = entry.get("roles")
    table = dict(aliases) if roles is None else {}
    if roles is not None:
        if not isinstance(roles, dict) or not all(isinstance(v, list) for v in roles.values()):
            c.refuse(f"{where}.roles", "a mapping of role -> list of names expected")
            return
        for target, names in roles.items():
            for name in names:
                if target not in _ROLES:
                    if target != name or target != "tool":
                        c.refuse(f"{where}.roles", f"{target}: finetune's roles are {', '.join(_ROLES)}")
                elif name != target:
                    table[str(name)] = target
    if table:
        out["role_map"] = table


def _strings_inside(value: Any) -> bool:
    """A mapping's values and a list's items are strings, or lists of strings (roles: {user: [human]})."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if items is None:
        return True
    return all(isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)) for v in items)


def _unused(c: Conversion, where: str, entry: dict, names: tuple[str, ...]) -> None:
    for name in names:
        if entry.get(name) is not None:
            c.drop(f"{where}.{name}", f"Axolotl reads it for chat_template datasets only, not {entry.get('type')}")
