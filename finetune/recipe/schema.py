"""The recipe schema: one small pydantic model per section, every one strict (`extra="forbid"`).

A misspelt key is an error, never silently ignored. Attribute docstrings are the descriptions that
`finetune schema` and docs/recipe-reference.md show, so they are written for users.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from finetune.recipe.distill import DistillConfig
from finetune.recipe.model import AdapterConfig, ModelConfig, TokenizerConfig
from finetune.recipe.preference import DPOConfig, ORPOConfig, RewardModelConfig
from finetune.recipe.qat import QATConfig
from finetune.recipe.rl import GRPOConfig
from finetune.recipe.section import Section

# Rows per micro-batch and micro-batches per step: far beyond any real run (1e9 is a typo, not a plan).
MAX_BATCH = 65536
MAX_SEED = 2**32 - 1  # what numpy (and transformers' set_seed) take


class DatasetConfig(Section):
    """One dataset: a local file or a hub dataset, and how its rows become chat messages or text."""

    path: str = Field(min_length=1)
    """A local .jsonl/.json/.parquet/.csv file, or a hub dataset name."""
    format: Literal["alpaca", "chat", "completion", "preference", "prompt"] = "chat"
    """alpaca: instruction/input/output. chat: a messages list. completion: plain text. preference: prompt, chosen
    and rejected, as TRL lays them out (train.objective dpo, orpo or reward). prompt: a prompt (text or messages) and any
    other fields, which the reward functions receive (train.objective grpo)."""
    prompt_template: Literal["chat", "alpaca", "alpaca_chat", "alpaca_chatml", "alpaca_phi"] = "chat"
    """alpaca: how a row becomes text. chat: the tokenizer's chat template. alpaca: the Stanford Alpaca prompt
    ("Below is an instruction ... ### Instruction:\n...\n\n### Response:\n"), as Axolotl's `type: alpaca`
    renders it; alpaca_chat / alpaca_chatml / alpaca_phi: Axolotl's `alpaca:chat|chatml|phi` styles. With a
    prompt: the prompt and the output are tokenized separately (the tokenizer's bos before the prompt, its eos
    after the output), only the output and the eos are trained, and a `system` field is ignored."""
    split: str = "train"
    """Split of a hub dataset."""
    name: str | None = None
    """Configuration name of a hub dataset."""
    data_files: list[str] | None = Field(None, min_length=1)
    """A hub dataset: read only these files of it, paths inside its repository, as
    `datasets.load_dataset(path, data_files=...)` takes them (e.g. [pretrain/rp_sub.jsonl.zst]; Axolotl's
    data_files). Not for a local file, which is read whole."""
    messages_field: str = "messages"
    """chat: the field holding the list of {role, content}."""
    images_field: str = Field("images", min_length=1)
    """chat: the field holding the row's images (a list, or one image: paths, {bytes, path} objects as parquet and hub
    datasets keep them), taken in order by the image parts that name no image of their own (docs/vision.md). Images
    in a row of another format are a bad row."""
    text_field: str = "text"
    """completion: the field holding the text."""
    role_field: str = "role"
    """chat, preference: the field of a message holding its role (ShareGPT rows: from)."""
    content_field: str = "content"
    """chat, preference: the field of a message holding its text (ShareGPT rows: value)."""
    role_map: dict[str, Literal["system", "user", "assistant", "tool"]] = Field(default_factory=dict)
    """chat, preference: other names of the roles, e.g. {human: user, gpt: assistant, observation: tool} (ShareGPT).
    system, user, assistant and tool always mean themselves; any other role is a bad row."""
    system_field: str | None = None
    """chat, preference: a row field whose text becomes a leading system message when the conversation (a pair's
    prompt) has none (Axolotl reads `system` so; in a preference row an empty text adds none). null: no such field."""
    drop_system_message: bool = False
    """chat: leave out a conversation's leading system message (and system_field's), as if the row had none: the
    model learns to answer without it (Axolotl's drop_system_message). A row left without a message is a bad row."""
    prompt_field: str = "prompt"
    """preference: the field holding the prompt (a string, or a list of messages)."""
    chosen_field: str = "chosen"
    """preference: the field holding the preferred completion."""
    rejected_field: str = "rejected"
    """preference: the field holding the other completion."""
    train_on_inputs: bool = False
    """Also train on prompts (user/system turns, alpaca instruction, template headers): every token but those of
    messages marked `train: false`. Default: only the answers."""
    roles_to_train: list[Literal["system", "user", "assistant"]] = Field(default_factory=lambda: ["assistant"],
                                                                         min_length=1)
    """chat, alpaca: the roles whose turns are trained (a turn: its content and the end-of-turn token after it;
    assistant turns also what the template writes between the assistant header and the content). A message's own
    `train: true|false` field wins over its role. docs/chat-templates.md shows what is trained per model family."""
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
    padding_free: bool | Literal["auto"] = "auto"
    """Packing off: lay each micro-batch's samples end to end in one row, each attending only to itself (as packed
    documents do), instead of padding them to the longest: the same samples, tokens, targets and loss, without
    computing the padding. auto: on for train.objective sft where the model keeps packed documents apart (checked as
    for packing) and our attention attends per document; otherwise padded rows, and the run log says why. true: an
    error where it does not apply. false: padded rows. Eval batches stay padded."""
    num_proc: int | None = Field(None, ge=1)
    """Processes that tokenize (worker processes over chunks of the streamed rows); null: every core. The samples
    are the same for any number."""
    deduplicate: Literal["none", "exact"] = "none"
    """exact: a row whose example is the same as an earlier row's (the same messages, text, or prompt and completion,
    with its tools, images and trained turns: everything read from it but its file:line) is dropped, the first kept,
    and counted (`finetune preprocess`, the run's data line). Over all training datasets together, before
    val_fraction's split; eval_datasets on their own (an eval row equal to a training row stays). Rows are then read
    in the main process (workers still tokenize), which keeps about 100 bytes per distinct row (a 16-byte hash).
    Not with train.objective grpo (its prompts are read as they are). Axolotl's dataset_exact_deduplication."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed data row stops the run (error) or is skipped and counted (skip)."""
    max_row_bytes: int = Field(8 * 1024 * 1024, gt=0)
    """A row larger than this (default 8 MiB) is a bad row, rejected before it is parsed (a JSONL line's bytes; other
    formats: the UTF-8 bytes of the row's strings). One huge row would otherwise take gigabytes to parse and tokenize."""
    max_image_pixels: int | None = Field(50_000_000, gt=0)
    """An image whose width x height (its header, read before any pixel is decoded) is over this is a bad row: a PNG
    of a few KB can claim 20000 x 20000 (a decompression bomb: gigabytes decoded). 50 million: above the 24-50 MP of
    today's cameras at full size, ~150 MB as RGB for each image collate holds before the processor resizes it
    (PIL only warns from 89 million). null: no limit."""
    ignore_message_fields: list[str] = Field(default_factory=list)
    """chat, preference: message fields to leave out. Any field a message has besides those finetune reads is a
    bad row naming it (README, "Your own model and data"), so that no data is dropped unseen."""
    cache_dir: str | None = None
    """Where tokenized data is cached; null: $FINETUNE_CACHE_DIR, else ~/.cache/finetune/data. Deleting it is always safe."""
    streaming: bool = False
    """Stream the training datasets (a pre-training corpus): rows are read as training goes, each process its share,
    tokenized and packed a window of stream_buffer samples at a time, never preprocessed or cached; the run is
    train.max_steps long and reads the datasets again from their start when they end (train.objective sft; chat,
    alpaca or completion rows; eval_datasets are preprocessed as usual). A checkpoint records each process's place in
    the stream, so a resume continues bit for bit. Axolotl's pretraining_dataset and streaming (docs/design.md,
    "Streamed datasets")."""
    stream_buffer: int = Field(10_000, gt=0)
    """streaming: samples per window (per process): each window's samples are packed (or, unpacked, ordered) as an
    epoch of cached samples is, seeded, so the rows are shuffled within a window, not across windows. Axolotl's
    streaming_multipack_buffer_size (pretrain_multipack_buffer_size)."""


class TrainConfig(Section):
    """The optimization: batch geometry, length of training, optimizer and learning-rate schedule."""

    objective: Literal["sft", "dpo", "orpo", "reward", "grpo", "distill"] = "sft"
    """sft: supervised fine-tuning on target tokens. dpo / orpo: preference training on pairs (datasets with
    format: preference; settings in the dpo: / orpo: sections). reward: a reward model (a score head) trained on
    such pairs (the reward: section; docs/preference.md). grpo: online RL on rewards (the grpo: section;
    docs/rl.md). distill: a teacher's distributions at the tokens SFT trains (the distill: section)."""
    micro_batch_size: int = Field(4, gt=0, le=MAX_BATCH)
    """Rows per forward pass on one process (padded preference data: pairs, each two rows)."""
    gradient_accumulation_steps: int = Field(8, gt=0, le=MAX_BATCH)
    """Micro-batches per optimizer step on each process. A step larger than an epoch (more rows than the epoch
    has) is warned about at start: each epoch is then one short step."""
    epochs: int | None = Field(1, gt=0)
    """Passes over the data. max_steps, when set, stops earlier."""
    max_steps: int | None = Field(None, gt=0)
    """Stop after this many optimizer steps."""
    lr: float = Field(2.0e-4, gt=0)
    """Peak learning rate: finite, and a nonzero float32 (about 1.4e-45 to 3.4e38: updates are computed in the
    weights' precision)."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """cosine/linear decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup over this many steps: step k (from 0) runs at lr * (k + 1) / warmup_steps."""
    warmup_ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Warmup as a fraction of the run's optimizer steps: int(ratio x total steps) warmup steps (rounded down).
    Instead of warmup_steps, not with it."""
    warmup_max_steps: int | None = Field(None, gt=0)
    """With warmup_ratio: at most this many warmup steps (Axolotl's default warmup is ratio 0.03, at most 100)."""
    warmup_from_zero: bool = False
    """Warmup as Hugging Face's schedulers run it (and so Axolotl): step k (from 0) at lr x k / warmup steps, the
    first step at lr 0, and a 1-step warmup made 2 steps (Axolotl's rule; one step at lr 0 would be no warmup at
    all). false: step k at lr x (k + 1) / warmup steps. The steps after the warmup are the same either way."""
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
    compile: bool = False
    """Opt-in (on an H200, Llama-1B shape: +27% tokens/s, 8 s more on the first step): compile each decoder
    layer with torch.compile (regional compilation: one compilation serves every layer; parameter names and checkpoints are unchanged). Packed rows'
    attention stays outside the compiled code, which covers the norms, projections, RoPE and MLP. The first
    micro-batch compiles (seconds to minutes), and the first one whose row length differs compiles once more with
    symbolic sizes; after that no micro-batch recompiles. Refused with model.gradient_checkpointing under
    attn_implementation auto (nothing would be compiled). Training runs only (`finetune eval` and `verify` run
    uncompiled)."""
    trainable_parameters: list[str] | None = None
    """Full fine-tuning only: train just the parameters whose name (as in model.named_parameters(), e.g.
    model.layers.3.mlp.down_proj.weight) matches one of these regular expressions from its start (Python re.match);
    every other parameter is frozen. null: train every parameter."""

    @field_validator("trainable_parameters")
    @classmethod
    def _patterns_compile(cls, patterns: list[str] | None) -> list[str] | None:
        for pattern in patterns or []:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regular expression ({e})") from None
        return patterns


class LossConfig(Section):
    """How the cross-entropy is computed (all implementations give the same loss and gradient)."""

    impl: Literal["auto", "liger", "chunked", "torch"] = "auto"
    """auto: chunked, on every device (on an H100 it took 1.11x the naive loss's time with 0.151 of its memory;
    Liger 1.5x and 0.130, and Liger reads the device twice per micro-batch). liger: Liger-Kernel's fused kernel,
    on CUDA (or, as a testing mode, anywhere under Triton's interpreter: TRITON_INTERPRET=1, ~5x slower). torch:
    naive reference (builds all logits)."""
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
    every_epochs: float | None = Field(None, gt=0)
    """Evaluate every this fraction of an epoch instead (0.25: four times per epoch): every
    ceil(fraction x optimizer steps of the first epoch) steps. Not with every_steps."""
    at_start: bool = True
    """Evaluate before the first step."""
    micro_batch_size: int | None = Field(None, gt=0, le=MAX_BATCH)
    """Rows per eval forward; defaults to train.micro_batch_size."""
    early_stopping_patience: int | None = Field(None, gt=0)
    """End the run once this many evals in a row (every_steps / every_epochs; not the one at start) have not lowered
    the best eval_loss, as Hugging Face's EarlyStoppingCallback (Axolotl's early_stopping_patience). final/ holds the
    weights of the step it stopped at. Needs eval data and an eval cadence; not with train.objective grpo."""


class CheckpointConfig(Section):
    """Resumable checkpoints in output_dir/checkpoints."""

    every_steps: int | None = Field(None, gt=0)
    """Write a resumable checkpoint every N optimizer steps."""
    every_epochs: float | None = Field(None, gt=0)
    """Write one every this fraction of an epoch instead (1: at each epoch's end when epochs have equal steps):
    every ceil(fraction x optimizer steps of the first epoch) steps. Not with every_steps."""
    keep_last: int = Field(2, gt=0)
    """Keep this many newest checkpoints."""


class DistributedConfig(Section):
    """Data parallelism under torchrun (ignored in one process)."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data parallel with replicated (ddp) or sharded (fsdp, FSDP2) weights under torchrun."""
    cpu_offload: bool = False
    """fsdp: keep sharded parameters on the CPU."""
    context_parallel: int = Field(1, ge=1)
    """Context parallelism: each row (packed or padded) split across this many ranks of the torchrun world, the
    attention exchanged among them; world = data parallel x this. SFT, DPO, ORPO and distill (docs/design.md)."""
    context_parallel_method: Literal["ulysses", "ring"] = "ulysses"
    """How the attention of split rows is computed. ulysses: all-to-all to whole rows for 1/N of the heads and back
    (query heads must divide by N). ring: each rank keeps its queries and the key/value blocks go round the N ranks,
    merged by log-sum-exp, any head count (rows dealt in 2N load-balanced chunks; no attention dropout)."""


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
    """Run directory (relative to the current directory); each folder name in it at most 255 bytes."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed for initialization, shuffling and dropout."""
    model: ModelConfig = ModelConfig()
    """The model to fine-tune."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """The tokenizer (default: the model's)."""
    adapter: AdapterConfig = AdapterConfig()
    """Full fine-tuning or a LoRA/QLoRA adapter."""
    qat: QATConfig = QATConfig()
    """Quantization-aware training through torchao, and the quantized model in final/ (qat.weight_dtype null: off)."""
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
    dpo: DPOConfig = DPOConfig()
    """Direct preference optimization settings (train.objective: dpo)."""
    orpo: ORPOConfig = ORPOConfig()
    """Odds-ratio preference optimization settings (train.objective: orpo)."""
    reward: RewardModelConfig = RewardModelConfig()
    """Reward model settings (train.objective: reward)."""
    distill: DistillConfig = DistillConfig()
    """Distillation settings: the teacher, the divergence (train.objective: distill; docs/distill.md)."""
    grpo: GRPOConfig = GRPOConfig()
    """Group relative policy optimization settings (train.objective: grpo; docs/rl.md)."""
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
    allow_code: bool = False
    """Consent to run the code this recipe names (reward functions module.path:function): the same trust as running
    that Python yourself. Counts in the recipe file you run (not a repository's) or as --allow-code, never from a
    recipe this one extends (docs/rl.md, "Code in recipes")."""
    _code_origins: dict[str, Any] = PrivateAttr(default_factory=dict)  # the loader's: who wrote each code key

    @model_validator(mode="after")
    def _objective_defaults(self) -> Recipe:
        # A default the objective cannot use gives way to the one it can; only a value someone wrote is refused.
        if self.train.objective == "grpo" and "packing" not in self.data.model_fields_set:
            self.data.packing = False  # GRPO trains one completion per row
        return self

    @property
    def code_origins(self) -> dict[str, Any]:
        """Dotted key -> recipe.code.Origin of the keys that can name code (empty for a recipe built in code)."""
        return self._code_origins


# The recipe keys that hold lists of datasets (their paths are resolved and checked like any input path).
DATASET_LISTS = ("datasets", "eval_datasets")
