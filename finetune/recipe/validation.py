"""Validating a raw recipe dict: the schema's errors and the cross-key checks, collected and reported at once.

Each problem is one line naming the dotted key, what was given, what is allowed and, for an unknown key, the
closest known one.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from finetune import templates
from finetune.errors import UserError
from finetune.recipe import hints
from finetune.recipe.mistral import mistral_common_checks
from finetune.recipe.objective_checks import context_parallel_checks, distill_checks, grpo_checks
from finetune.recipe.qat import qat_checks
from finetune.recipe.rl import BUILT_IN_ARGS
from finetune.recipe.schema import DATASET_LISTS, Recipe
from finetune.recipe.streaming import streaming_checks

# A dataset path with one of these suffixes is a local file (anything else may be a hub dataset name).
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def local_data_path(path: str) -> Path | None:
    """The local file a dataset path names (a data-file suffix, or anything that exists), or None for a hub
    dataset name. The one rule the recipe check, the data reader and the cache key share."""
    local = Path(path).expanduser()
    return local if local.suffix.lower() in LOCAL_SUFFIXES or local.exists() else None


def data_file_not_found(path: str) -> str:
    return (f"data file not found: {path} (relative paths are looked up next to the recipe file, then in the "
            "current directory)")

def validate(raw: dict[str, Any], source: str = "recipe", check_inputs: bool = False,
             overrides: Sequence[str] = ()) -> Recipe:
    """Validate a raw dict into a Recipe, collecting every schema and cross-field error into one UserError.

    `check_inputs`: also require the local files it reads (data files, a resume checkpoint) to exist, as every
    CLI command does. Off for the recipe stored in a finished run, whose data may since have moved (`generate`
    and `merge` do not read it), and for library callers that only want the schema. A problem with a key one of
    `overrides` set (key=value on the command line) says so: the user looks for it there, not in the file.
    """
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise UserError(_error_block(source, _from_command_line(_describe_all(e.errors()), overrides))) from None
    problems = cross_checks(recipe) + (missing_inputs(recipe) if check_inputs else [])
    if problems:
        raise UserError(_error_block(source, _from_command_line(problems, overrides)))
    return recipe


def _from_command_line(lines: list[str], overrides: Sequence[str]) -> list[str]:
    """Each problem line whose key an override set (or is inside, or holds), marked with that override."""
    out = []
    for line in lines:
        key = line.split(":", 1)[0]
        item = next((o for o in overrides if (k := o.partition("=")[0].strip()) == key
                     or key.startswith(k + ".") or k.startswith(key + ".")), None)
        out.append(f"{line} (set on the command line: {item})" if item else line)
    return out


def _error_block(source: str, lines: list[str]) -> str:
    noun = "problem" if len(lines) == 1 else "problems"
    return f"{source}: {len(lines)} {noun} in the recipe:\n" + "\n".join(f"  - {line}" for line in lines)


def _describe_all(errors: list[dict[str, Any]], root: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """One line per key: a union (e.g. 'all-linear' or a list) fails once per member, joined here with 'or'.
    `root`: the model the errors' locations start from; `prefix`: the dotted key where it sits in the recipe."""
    by_key: dict[str, list[str]] = {}
    for err in errors:
        key, _, text = _describe(err, root).partition(": ")
        key = prefix + key
        by_key.setdefault(key, [])
        if text not in by_key[key]:
            by_key[key].append(text)
    lines = []
    for key, texts in by_key.items():
        first, rest = texts[0], [t.partition("; ")[2] or t for t in texts[1:]]
        lines.append(f"{key}: " + "; or ".join([first, *rest]))
    return lines


def _describe(err: dict[str, Any], root: type[BaseModel] = Recipe) -> str:
    """One line for one pydantic error: dotted key, what was given, what is allowed."""
    loc = [str(p) for p in err["loc"]]
    # Union types add their member names to the location (e.g. 'literal[...]'); they are noise to users.
    loc = [p for p in loc if not (p.startswith(("literal[", "list[", "tuple[")) or p in ("str", "int", "float"))]
    key = ".".join(loc)
    given = err.get("input")
    if err["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1], root)
        known = list(parent.model_fields) if parent else []
        if root is not Recipe:  # a sub-schema's keys (a built-in reward's args): its own keys only
            guess = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
            return f"{key}: unknown key; " + (f"did you mean '{guess[0]}'?" if guess else f"known keys here: "
                                                                                         f"{', '.join(known)}")
        here = ".".join("[]" if p.isdigit() else p for p in loc[:-1]).replace(".[]", "[]")
        return f"{key}: unknown key; {hints.suggest(loc[-1], here, known)}"
    if err["type"] == "missing":
        return f"{key}: required, but missing"
    if err["type"] == "finite_number":  # YAML reads 1e400 as infinity: say so, the user wrote no "inf"
        try:
            infinite = math.isinf(float(given))
        except (TypeError, ValueError):
            infinite = False
        beyond = " (YAML reads a number beyond 1.8e308, such as 1e400, as infinity)" if infinite else ""
        return f"{key}: got {given if isinstance(given, float) else json.dumps(given)}; must be a finite number{beyond}"
    allowed = err.get("ctx", {}).get("expected")
    shown = json.dumps(given) if isinstance(given, (str, int, float, bool)) or given is None else repr(given)
    if allowed:
        return f"{key}: got {shown}; allowed: {allowed}"
    if err["type"] == "value_error":  # our own validators' words, without pydantic's "Value error, " in front
        return f"{key}: got {shown}; {err['ctx']['error']}"
    return f"{key}: got {shown}; {err['msg'][0].lower()}{err['msg'][1:]}"


def _section_at(loc: list[str], root: type[BaseModel] = Recipe) -> type[BaseModel] | None:
    """The schema class at a dotted location (list indices skipped), for 'did you mean' suggestions."""
    cls: Any = root
    for part in loc:
        if part.isdigit():
            continue
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return None
        annotation = field.annotation
        inner = getattr(annotation, "__args__", None)
        cls = inner[0] if inner and isinstance(inner[0], type) else annotation
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def cross_checks(recipe: Recipe) -> list[str]:
    """Checks that involve several keys. Returns every problem found (empty when the recipe is coherent)."""
    problems = []
    m, d, t = recipe.model, recipe.data, recipe.train
    if m.init == "pretrained" and not m.path:
        problems.append("model.path: required for init: pretrained (or set model.init: random with model.config)")
    if m.init == "random" and m.path:
        problems.append("model.path: set, but model.init is random, which ignores it (random weights from "
                        "model.config; init: random may come from a recipe this one extends, such as the "
                        "quickstart); to train the model at model.path, set model.init: pretrained")
    elif m.init == "random" and not m.config:
        problems.append("model.config: init: random needs a config (e.g. {model_type: llama, ...})")
    if not recipe.tokenizer.path and not m.path:
        problems.append("tokenizer.path: required when model.path is not set")
    if d.packing and d.max_seq_len is None:
        problems.append("data.max_seq_len: packing needs a row length; set data.max_seq_len or data.packing: false")
    if t.epochs is None and t.max_steps is None:
        problems.append("train.epochs / train.max_steps: both are null; set at least one")
    if not recipe.datasets and not (t.objective == "grpo" and recipe.grpo.replay):
        problems.append("datasets: at least one training dataset is required")
    if recipe.adapter.type == "qlora" and m.dtype == "float16":
        problems.append("model.dtype: qlora computes in float32 or bfloat16; float16 is not supported")
    if m.config_overrides and m.init == "random":
        problems.append("model.config_overrides: only with init: pretrained; with init: random, model.config is the "
                        "whole config: write the keys there")
    if m.gguf_file and m.init == "random":
        problems.append("model.gguf_file: only meaningful with init: pretrained")
    problems += _number_checks(recipe)
    if t.warmup_ratio is not None and t.warmup_steps:
        problems.append("train.warmup_ratio / train.warmup_steps: give one of them, not both")
    if recipe.eval.early_stopping_patience and not (
            (recipe.eval_datasets or d.val_fraction) and (recipe.eval.every_steps or recipe.eval.every_epochs)):
        problems.append("eval.early_stopping_patience: needs evals during training: eval data (eval_datasets or "
                        "data.val_fraction) and eval.every_steps or every_epochs")
    if t.warmup_max_steps is not None and t.warmup_ratio is None:
        problems.append("train.warmup_max_steps: caps train.warmup_ratio's warmup; without a ratio, set warmup_steps")
    for section in ("eval", "checkpoint"):
        cfg = getattr(recipe, section)
        if cfg.every_steps is not None and cfg.every_epochs is not None:
            problems.append(f"{section}.every_steps / {section}.every_epochs: give one of them, not both")
    problems += _objective_checks(recipe)
    if t.trainable_parameters is not None and recipe.adapter.type != "none":
        problems.append("train.trainable_parameters: only for full fine-tuning (adapter.type: none); with an "
                        "adapter, choose what trains with adapter.target_modules and adapter.modules_to_save")
    return (problems + _chat_checks(recipe) + mistral_common_checks(recipe) + qat_checks(recipe)
            + streaming_checks(recipe))


def _reward_args_checks(recipe: Recipe) -> list[str]:
    """A built-in reward's args, checked as recipe keys are: a misspelt one would train with the default."""
    problems = []
    for i, reward in enumerate(recipe.grpo.rewards):
        model = BUILT_IN_ARGS.get(reward.function)
        if model is None:
            continue
        try:
            model.model_validate(reward.args)
        except ValidationError as e:
            problems += _describe_all(e.errors(), model, f"grpo.rewards.{i}.args.")
    return problems


# File systems hold names of at most this many bytes (NAME_MAX on Linux and macOS; NTFS: 255 characters).
NAME_MAX = 255


def _number_checks(recipe: Recipe) -> list[str]:
    """Values the schema's types allow but the run cannot use: a learning rate that is zero or infinite as a
    float32, an output_dir whose folder names the file system cannot hold."""
    problems = []
    lr = recipe.train.lr
    try:
        as_float32 = struct.unpack("<f", struct.pack("<f", lr))[0]
    except OverflowError:  # beyond float32's largest number
        as_float32 = math.inf
    if as_float32 in (0.0, math.inf):
        problems.append(f"train.lr: got {lr!r}, which is {'infinite' if lr > 1 else 'zero'} as a float32 (the "
                        "precision the update is computed in); use one float32 holds (1.4e-45 to 3.4e38), e.g. 2e-4")
    for name in Path(recipe.output_dir).expanduser().parts:
        size = len(name.encode("utf-8", "surrogatepass"))
        if size > NAME_MAX:
            problems.append(f"output_dir: a folder name of {size} bytes ({name[:20]}...); file systems take at most "
                            f"{NAME_MAX} bytes per name: use a shorter one")
    return problems + _output_dir_place(recipe.output_dir)


def _output_dir_place(output_dir: str) -> list[str]:
    """A file system's root or the user's home is nobody's run directory: a run writes recipe.yaml, metrics.jsonl,
    checkpoints/ and final/ into it, and --overwrite would later remove them from there."""
    try:
        place = Path(output_dir).expanduser().resolve()
        home = Path.home().resolve()
    except (OSError, RuntimeError):  # no home to find (an odd environment): nothing to compare with
        return []
    what = "the file system's root" if place == Path(place.anchor) else "your home folder" if place == home else None
    if what is None:
        return []
    return [f"output_dir: {output_dir} is {what} ({place}); a run writes recipe.yaml, metrics.jsonl, checkpoints/ "
            "and final/ into its output_dir: give it a folder of its own, e.g. runs/NAME"]


def _objective_checks(recipe: Recipe) -> list[str]:
    """Preference objectives train on preference data and nothing else, and the other way round."""
    problems = []
    preference = recipe.train.objective in ("dpo", "orpo", "reward")
    for key in DATASET_LISTS:
        for i, ds in enumerate(getattr(recipe, key)):
            if ds.format == "prompt" and recipe.train.objective != "grpo":
                problems.append(f"{key}.{i}.format: prompt data is for train.objective: grpo")
                continue
            if recipe.train.objective == "grpo":
                continue  # grpo_checks (recipe/objective_checks.py)
            if preference and ds.format != "preference":
                problems.append(f"{key}.{i}.format: train.objective {recipe.train.objective} trains on pairs; "
                                f"use format: preference (prompt, chosen, rejected), not {ds.format}")
            elif not preference and ds.format == "preference":
                problems.append(f"{key}.{i}.format: preference data needs train.objective: dpo, orpo or reward")
            if ds.format == "preference" and ds.train_on_inputs:
                problems.append(f"{key}.{i}.train_on_inputs: preference pairs score their completions only")
    if preference and recipe.loss.z_loss:
        problems.append(f"loss.z_loss: not with train.objective {recipe.train.objective} (it adds to token losses)")
    problems += grpo_checks(recipe) + distill_checks(recipe) + context_parallel_checks(recipe)
    problems += _reward_args_checks(recipe) if recipe.train.objective == "grpo" else []
    if recipe.dpo.label_smoothing and recipe.dpo.loss != "sigmoid":
        problems.append(f"dpo.label_smoothing: only for dpo.loss: sigmoid, not {recipe.dpo.loss}")
    return problems + _reward_model_checks(recipe)


def _reward_model_checks(recipe: Recipe) -> list[str]:
    """A reward model's settings only with train.objective reward, and no token loss's settings with it."""
    if recipe.train.objective != "reward":
        return [] if not recipe.reward.center_coefficient else [
            f"reward.center_coefficient: only for train.objective: reward, not {recipe.train.objective}"]
    if recipe.loss.impl == "liger":
        return ["loss.impl: liger computes token losses; a reward model scores sequences (no token loss): leave "
                "loss.impl at auto"]
    return []


# apply_chat_template's own arguments, which finetune sets itself: a template variable must not shadow them.
_TEMPLATE_ARGUMENTS = ("conversation", "messages", "chat_template", "add_generation_prompt", "continue_final_message",
                       "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def _chat_checks(recipe: Recipe) -> list[str]:
    """tokenizer.chat_template_kwargs and each dataset's roles_to_train."""
    problems = [f"tokenizer.chat_template_kwargs.{key}: an argument finetune sets itself, not a template variable"
                for key in recipe.tokenizer.chat_template_kwargs if key in _TEMPLATE_ARGUMENTS]
    template = recipe.tokenizer.chat_template
    if template is not None and templates.looks_like_name(template) and templates.unknown_name(template):
        problems.append(f"tokenizer.chat_template: {templates.unknown_name(template)}")
    for key in DATASET_LISTS:
        for i, ds in enumerate(getattr(recipe, key)):
            problems += _field_checks(f"{key}.{i}", ds)
            roles = ds.roles_to_train
            if len(set(roles)) != len(roles):
                problems.append(f"{key}.{i}.roles_to_train: {roles} names a role twice")
            if roles == ["assistant"]:
                continue
            if ds.format == "completion":
                problems.append(f"{key}.{i}.roles_to_train: format completion has no roles (every token is trained)")
            elif ds.format == "preference":
                problems.append(f"{key}.{i}.roles_to_train: format preference scores its completions' assistant turns")
            elif ds.train_on_inputs:
                problems.append(f"{key}.{i}.roles_to_train: train_on_inputs: true trains every role; drop one of "
                                "the two keys")
    return problems


def _field_checks(where: str, ds: Any) -> list[str]:
    """A dataset's field and role mappings and its prompt template fit its format."""
    problems = []
    if ds.prompt_template != "chat" and ds.format != "alpaca":
        problems.append(f"{where}.prompt_template: {ds.prompt_template} renders alpaca rows; format is {ds.format}")
    elif ds.prompt_template != "chat" and ds.roles_to_train != ["assistant"]:
        problems.append(f"{where}.roles_to_train: with prompt_template {ds.prompt_template} the output is trained; "
                        "train_on_inputs: true trains the prompt too")
    formats = {"role_field": ("chat", "preference"), "content_field": ("chat", "preference"),
               "role_map": ("chat", "preference"), "system_field": ("chat", "preference"),
               "drop_system_message": ("chat",),
               "prompt_field": ("preference",),
               "chosen_field": ("preference",), "rejected_field": ("preference",)}
    for name, allowed in formats.items():
        default = type(ds).model_fields[name].get_default(call_default_factory=True)
        if ds.format not in allowed and getattr(ds, name) != default:
            problems.append(f"{where}.{name}: only for format {' or '.join(allowed)}, not {ds.format}")
    if ds.data_files is not None and local_data_path(ds.path) is not None:
        problems.append(f"{where}.data_files: only for a hub dataset; {ds.path} is a local file, read whole")
    for name in ds.role_map:
        if name in ("system", "user", "assistant"):
            problems.append(f"{where}.role_map.{name}: system, user and assistant always mean themselves; map "
                            "other names onto them")
    return problems


def missing_inputs(recipe: Recipe) -> list[str]:
    """The local files the recipe names that do not exist: a resume checkpoint, data files (a path with a data
    file suffix; anything else may be a hub dataset). Caught at load time, not after the model has loaded."""
    problems = []
    if recipe.resume not in (None, "auto") and not Path(recipe.resume).expanduser().exists():
        problems.append(f"resume: checkpoint {recipe.resume!r} does not exist (use auto, null or a checkpoint path)")
    if recipe.train.objective == "grpo" and recipe.grpo.replay and not Path(recipe.grpo.replay).is_file():
        problems.append(f"grpo.replay: {recipe.grpo.replay} is not a file")
    for key in DATASET_LISTS:
        for i, ds in enumerate(getattr(recipe, key)):
            local = local_data_path(ds.path)
            if local is not None and not local.exists():  # a directory is told apart when the data is read
                problems.append(f"{key}.{i}.path: {data_file_not_found(ds.path)}")
    for i, reward in enumerate(recipe.grpo.rewards if recipe.train.objective == "grpo" else []):
        where = reward.args.get("path") if reward.function == "reward_model" else None
        if isinstance(where, str) and where and not Path(where).expanduser().exists():
            problems.append(f"grpo.rewards.{i}.args.path: {where} does not exist (a reward model run or model "
                            "directory; a relative path is looked up next to the recipe file, then in the current "
                            f"directory, {Path.cwd()})")
    return problems + _missing_models(recipe)


# A hub id: a name, or an owner and a name (huggingface_hub's rule, simplified: no path has two slashes).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _missing_models(recipe: Recipe) -> list[str]:
    """A model or tokenizer path that can only be local (absolute, ./, ../, ~, or not a hub id) and does not exist:
    said now, naming it, rather than after the hub has been asked for it as a repository id."""
    t, g, d = recipe.train.objective, recipe.grpo, recipe.dpo
    paths = [("model.path", recipe.model.path if recipe.model.init == "pretrained" else None),
             ("tokenizer.path", recipe.tokenizer.path),
             ("grpo.reference", g.reference if t == "grpo" and g.beta > 0 and g.reference != "auto" else None),
             ("dpo.reference", d.reference if t == "dpo" and d.reference != "auto" else None),
             ("distill.teacher", recipe.distill.teacher if t == "distill" else None)]
    problems = []
    for key, value in paths:
        if not value or "://" in value or Path(value).expanduser().exists():
            continue
        if value.startswith(("/", "./", "../", "~")) or not _HUB_ID.fullmatch(value):
            problems.append(f"{key}: {value} does not exist (a local path: a relative one is looked up next to the "
                            f"recipe file, then in the current directory, {Path.cwd()}); a hub model is named "
                            "ORG/NAME")
    return problems


