"""Rules for the optimization (batch, length, learning rate and its schedule, optimizer, objective) and for how
rows become batches (sequence length, packing, held-out data)."""

from __future__ import annotations

from finetune.convert.context import Conversion
from finetune.convert.rules_vision import is_vision, vision_data

_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw", "paged_adamw_32bit", "adamw_apex_fused")
_ADAMW_8BIT = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "bnb_adamw_8bit")
_LOW_BIT = ("adamw_torch_8bit", "adamw_torch_4bit", "adamw_torchao_8bit", "adamw_torchao_4bit")


def batch_rules(c: Conversion) -> None:
    """micro_batch_size, gradient_accumulation_steps, batch_size, num_epochs, max_steps, seed."""
    micro = c.integer("micro_batch_size", 1, minimum=1)
    c.carry("micro_batch_size", "train.micro_batch_size", micro, "Axolotl's default")
    steps = c.integer("gradient_accumulation_steps", None, minimum=1)
    batch = c.integer("batch_size", None, minimum=1)
    if steps is not None and batch is not None:
        c.refuse("batch_size", "give batch_size or gradient_accumulation_steps, not both (Axolotl refuses both)")
    elif batch is not None and micro:
        if batch // micro < 1:
            c.refuse("batch_size", f"{batch} is smaller than micro_batch_size {micro}")
        steps = batch // micro
    if batch is None:
        c.carry("gradient_accumulation_steps", "train.gradient_accumulation_steps", steps or 1, "Axolotl's default")
    else:
        c.put("train.gradient_accumulation_steps", steps or 1)
    epochs = c.number("num_epochs", 1.0)
    max_steps = c.integer("max_steps", None, minimum=1)
    if max_steps is not None:
        c.put("train.max_steps", max_steps)
        c.put("train.epochs", None)  # Hugging Face's max_steps runs that many steps, epochs or not
    elif epochs is not None:
        if epochs != int(epochs) or epochs < 1:
            c.refuse("num_epochs", f"{epochs}: finetune runs whole epochs; set max_steps for part of one")
        elif epochs != 1:
            c.put("train.epochs", int(epochs))
    c.carry("seed", "seed", c.integer("seed", 42, minimum=None), "Axolotl's default")


def lr_rules(c: Conversion) -> None:
    """learning_rate, lr_scheduler, cosine_min_lr_ratio, warmup_steps, warmup_ratio, weight_decay, max_grad_norm."""
    c.carry("learning_rate", "train.lr", c.number("learning_rate", 5e-5, text_ok=True), "Hugging Face's default")
    scheduler = c.text("lr_scheduler", "cosine")
    if scheduler in ("cosine", "linear", "constant_with_warmup"):
        if scheduler != "cosine":
            c.put("train.lr_scheduler", "linear" if scheduler == "linear" else "constant")
    elif scheduler == "constant":
        c.put("train.lr_scheduler", "constant")
    else:
        c.refuse("lr_scheduler", f"{scheduler!r} is not supported (cosine, linear, constant, constant_with_warmup)")
    ratio = c.number("cosine_min_lr_ratio")
    if ratio is not None and scheduler == "cosine":
        c.put("train.min_lr_ratio", ratio)
    elif ratio is not None:
        c.drop("cosine_min_lr_ratio", f"Axolotl reads it for lr_scheduler: cosine only, not {scheduler}")
    _warmup(c, scheduler)
    if c.has("weight_decay"):
        c.put("train.weight_decay", c.number("weight_decay"))
    if c.has("max_grad_norm"):
        norm = c.number("max_grad_norm")
        c.put("train.max_grad_norm", norm if norm else None)  # 0 turns clipping off in Hugging Face's trainer


def _warmup(c: Conversion, scheduler: str | None) -> None:
    """Axolotl's warmup: warmup_steps, else int(warmup_ratio x steps), else min(int(0.03 x steps), 100); a warmup of
    1 step becomes 2; Hugging Face's schedules start it at lr 0. Its `constant` schedule has no warmup at all."""
    steps, ratio = c.get("warmup_steps"), c.number("warmup_ratio")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
        c.refuse("warmup_steps", f"got {steps!r}; Axolotl expects a whole number of steps (warmup_ratio for a "
                                 "fraction)")
        return
    if steps is not None and ratio is not None:
        c.refuse("warmup_ratio", "give warmup_steps or warmup_ratio, not both (Axolotl refuses both)")
        return
    if scheduler == "constant":
        if steps or ratio:
            c.drop("warmup_steps" if steps else "warmup_ratio", "lr_scheduler: constant has no warmup in Hugging "
                                                                "Face's trainer")
        return
    if steps is not None:
        if steps:
            c.put("train.warmup_steps", steps)
    elif ratio is not None:
        if not 0 <= ratio < 1:
            c.refuse("warmup_ratio", f"{ratio}: a fraction of the steps, at least 0 and below 1")
            return
        if ratio:
            c.put("train.warmup_ratio", ratio)
    else:
        c.default("train.warmup_ratio", 0.03, "Axolotl's default warmup: 3% of the steps")
        c.default("train.warmup_max_steps", 100, "Axolotl's default warmup: at most 100 steps")
    if c.peek("train.warmup_steps") or c.peek("train.warmup_ratio"):
        c.default("train.warmup_from_zero", True, "Hugging Face's warmup shape: the first step at lr 0; a 1-step "
                                                   "warmup made 2")


def optimizer_rules(c: Conversion) -> None:
    """optimizer, adam_beta1, adam_beta2, adam_epsilon."""
    name = c.text("optimizer", "adamw_torch_fused")
    if name in _ADAMW_8BIT:
        c.put("train.optimizer", "adamw_8bit")
    elif name in _LOW_BIT:
        c.approximate("optimizer", f"{name} (torchao) becomes bitsandbytes' 8-bit AdamW (train.optimizer: adamw_8bit)")
        c.put("train.optimizer", "adamw_8bit")
    elif name not in _ADAMW:
        c.refuse("optimizer", f"{name!r} is not supported; finetune trains with AdamW (adamw_torch, adamw_torch_fused, "
                              "paged_adamw_32bit) or 8-bit AdamW (adamw_bnb_8bit, paged_adamw_8bit)")
    betas = (c.number("adam_beta1", 0.9), c.number("adam_beta2", 0.999))
    if betas != (0.9, 0.999):
        c.put("train.adam_betas", list(betas))
    if c.has("adam_epsilon"):
        c.put("train.adam_eps", c.number("adam_epsilon"))


def objective_rules(c: Conversion) -> None:
    """rl, rl_beta, dpo_beta, orpo_alpha, dpo_label_smoothing, dpo_loss_type."""
    rl = c.text("rl")
    beta = c.number("rl_beta", c.number("dpo_beta"))
    if c.get("reward_model") is True:
        _reward_model(c, rl)
    for key in ("num_labels", "center_rewards_coefficient"):
        if c.get("reward_model") is not True and c.has(key):
            c.drop(key, "read only with reward_model (other classification models are refused by model_type)")
    if rl != "grpo" and c.has("trl"):
        c.refuse("trl", "TRL trainer options are read with rl: grpo only (finetune's dpo: and orpo: sections)")
    if rl is None:
        for key in ("rl_beta", "dpo_beta", "orpo_alpha", "dpo_label_smoothing", "dpo_loss_type"):
            if c.has(key):
                c.drop(key, "read only with rl")
        return
    if rl in ("dpo", "ipo"):
        c.put("train.objective", "dpo")
        _dpo(c, rl, beta)
    elif rl == "orpo":
        c.put("train.objective", "orpo")
        beta = beta if beta is not None else c.number("orpo_alpha")
        if beta is not None:
            c.put("orpo.beta", beta)
    elif rl == "grpo":
        c.put("train.objective", "grpo")
        c.put("data.packing", False)
        grpo_rules(c, c.mapping("trl") or {})
    else:
        c.refuse("rl", f"{rl}: finetune trains SFT, DPO (rl: dpo, ipo), ORPO and GRPO; not {rl}")


def _reward_model(c: Conversion, rl: str | None) -> None:
    """reward_model: true -> train.objective: reward (its one-score head: num_labels 1)."""
    if rl is not None:
        c.refuse("reward_model", f"with rl: {rl}: a reward model trains by itself (its Bradley-Terry loss)")
    c.put("train.objective", "reward")
    labels = c.get("num_labels", 1)
    if labels != 1:
        c.refuse("num_labels", f"{labels!r}: a reward model has one score (num_labels: 1)")
    if c.number("center_rewards_coefficient"):
        c.put("reward.center_coefficient", c.number("center_rewards_coefficient"))


# trl: key -> grpo: key, for the values that carry over as they are.
_TRL_SAME = {"beta": "beta", "num_generations": "num_generations", "max_completion_length": "max_new_tokens",
             "temperature": "temperature", "top_p": "top_p", "epsilon": "epsilon", "epsilon_high": "epsilon_high",
             "num_iterations": "iterations", "mask_truncated_completions": "mask_truncated"}
# TRL's loss types whose normalizer is exact under any split -> grpo.normalize.
_LOSS_TYPES = {"dapo": "tokens", "grpo": "sequences", "dr_grpo": "constant"}
_TRL_OTHER = {"loss_type", "scale_rewards", "reward_funcs", "reward_weights", "use_vllm", "vllm_mode",
              "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_gpu_memory_utilization",
              "log_completions", "num_completions_to_print", "sync_ref_model"}


def grpo_rules(c: Conversion, trl: dict) -> None:
    """Axolotl's trl: block (TRL's GRPOConfig) -> the grpo: section."""
    for key in sorted(set(trl) - set(_TRL_SAME) - _TRL_OTHER):
        c.refuse(f"trl.{key}", "not supported by finetune's GRPO (docs/rl.md)")
    for key, ours in _TRL_SAME.items():
        if trl.get(key) is not None:
            c.put(f"grpo.{ours}", trl[key])
    loss = trl.get("loss_type", "dapo")  # TRL 1.x's default
    if loss == "bnpo":
        c.approximate("trl.loss_type", "bnpo normalizes each micro-batch by its own tokens (its update depends on "
                                       "the split); normalize: tokens is the same over the whole step")
        loss = "dapo"
    if loss not in _LOSS_TYPES:
        c.refuse("trl.loss_type", f"{loss!r}: finetune's GRPO offers dapo, grpo and dr_grpo (grpo.normalize)")
    else:
        c.put("grpo.normalize", _LOSS_TYPES[loss])
    scale = trl.get("scale_rewards", True)
    c.put("grpo.scale_rewards", {True: "group", False: "none"}.get(scale, scale))
    funcs, weights = trl.get("reward_funcs") or [], trl.get("reward_weights") or []
    if weights and len(weights) != len(funcs):
        c.refuse("trl.reward_weights", f"{len(weights)} weights for {len(funcs)} reward_funcs")
    c.put("grpo.rewards", [{"function": _function(f), **({"weight": w} if weights else {})}
                           for f, w in zip(funcs, weights or [1.0] * len(funcs))])
    if trl.get("use_vllm"):
        c.note("trl.use_vllm: finetune generates with transformers' generate (the generation seam, docs/rl.md)")


def _function(name: str) -> str:
    """Axolotl's `module.function` (a file next to the config) as finetune's `module:function`."""
    module, _, function = str(name).rpartition(".")
    return f"{module}:{function}" if module else name


def _dpo(c: Conversion, rl: str, beta: float | None) -> None:
    if beta is not None:
        c.put("dpo.beta", beta)
    losses = c.texts("dpo_loss_type") or ["ipo" if rl == "ipo" else "sigmoid"]
    if len(losses) != 1 or losses[0] not in ("sigmoid", "ipo", "hinge"):
        c.refuse("dpo_loss_type", f"{losses}: one of sigmoid, ipo, hinge")
    elif losses[0] != "sigmoid":
        c.put("dpo.loss", losses[0])
    smoothing = c.number("dpo_label_smoothing")
    if smoothing:
        c.put("dpo.label_smoothing", smoothing)


def _lengths(c: Conversion) -> None:
    c.carry("sequence_len", "data.max_seq_len", c.integer("sequence_len", 512, minimum=1), "Axolotl's default")
    c.carry("sample_packing", "data.packing", bool(c.boolean("sample_packing", False)), "Axolotl's default")
    strategy = c.text("excess_length_strategy", "drop")
    if strategy == "truncate":
        c.put("data.truncation", "truncate")
    elif strategy == "drop":
        c.default("data.truncation", "drop", "Axolotl drops samples longer than sequence_len")
    else:
        c.refuse("excess_length_strategy", f"{strategy!r}: finetune drops or truncates over-long samples")


def data_rules(c: Conversion) -> None:
    """sequence_len, sample_packing, excess_length_strategy, curriculum_sampling, group_by_length, val_set_size,
    dataset_exact_deduplication."""
    if is_vision(c):
        vision_data(c)
    else:
        _lengths(c)
    if c.boolean("curriculum_sampling"):
        c.put("data.shuffle", False)
    if c.boolean("group_by_length"):
        c.approximate("group_by_length", "data.group_by_length sorts by length within each step only (the step's "
                                         "gradient is unchanged); Hugging Face groups the whole epoch by length")
        c.put("data.group_by_length", True)
    size = c.number("val_set_size", 0.0)
    if size and c.has("test_datasets"):
        c.refuse("val_set_size", "give val_set_size or test_datasets, not both")
    elif size and 0 < size < 1:
        c.put("data.val_fraction", size)
    elif size:
        c.refuse("val_set_size", f"{size}: a number of rows is not supported; give a fraction below 1")
    if c.boolean("dataset_exact_deduplication"):
        c.put("data.deduplicate", "exact")
        if c.peek("train.objective") in ("dpo", "orpo") and c.has("test_datasets"):
            c.approximate("dataset_exact_deduplication", "eval rows equal to training rows stay in eval (Axolotl's "
                          "preference path drops them from eval; each split is deduplicated on its own either way)")
