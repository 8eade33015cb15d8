"""When Axolotl evaluates and checkpoints, as finetune cadences; and the run's output, logging and parallelism.

Axolotl turns `saves_per_epoch: n` into a fraction of the run, f = 1 / (n x num_epochs), used only when f < 1, and
Hugging Face's trainer saves every ceil(f x total steps) steps. With equal epochs that is every ceil(steps per epoch
/ n) steps: finetune's `every_epochs: 1/n`. With max_steps, the total is max_steps, known here: every_steps. Without
a cadence Axolotl checkpoints at each epoch's end (keeping 4) and evaluates only when asked (then also at step 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from finetune.convert.context import Conversion
from finetune.convert.reading import read_side_file
from finetune.convert.rules_distill import is_kd_plugin, kd_requested

_KNOWN_PLUGINS = {
    "cut_cross_entropy": "a fused cross-entropy: finetune's loss is fused too (the same math)",
    "liger": "Liger kernels: the same math",
    "kernels": "kernels: the same math (its quantizing options are keys of their own)",
    "expert_parallel": "expert parallelism: how the work is split (the same math)",
    "swanlab": "SwanLab experiment tracking",
    "lm_eval": "lm-eval benchmarks after training: nothing that is trained",
}


def cadence_rules(c: Conversion, has_eval_data: bool) -> None:
    """saves_per_epoch, save_steps, save_strategy, save_total_limit, evals_per_epoch, eval_steps, eval_strategy,
    eval_batch_size, early_stopping_patience."""
    epochs = c.number("num_epochs", 1.0) or 1.0
    save_steps = c.get("save_steps") or None  # 0 is unset, as in Axolotl
    n = c.integer("saves_per_epoch")  # 0 or unset: none
    if n and 1.0 / (n * epochs) < 1.0:
        save_steps = 1.0 / (n * epochs)  # Axolotl's normalize_config
    else:  # 1 over 1 epoch: Axolotl keeps its default, a save at each epoch's end (below), as if it were unset
        n = None
    strategy = c.text("save_strategy")
    if strategy == "best":
        c.refuse("save_strategy", "best: keeping the best checkpoint is not supported")
    elif save_steps is not None:
        _every(c, "checkpoint", "save_steps", save_steps, n, epochs)
    elif strategy not in (None, "epoch", "no", "steps"):
        c.refuse("save_strategy", f"{strategy!r}: Axolotl expects no, steps, epoch or best")
    elif strategy != "no" and (epochs > 1 or c.has("max_steps")) and not c.peek("data.streaming"):
        c.put("checkpoint.every_epochs", 1)  # Axolotl's default: at each epoch's end (a stream has none)
    c.carry("save_total_limit", "checkpoint.keep_last", c.integer("save_total_limit", 4) or 4, "Axolotl's default")
    if c.has("eval_batch_size"):
        c.put("eval.micro_batch_size", c.integer("eval_batch_size", minimum=1))
    _eval_cadence(c, has_eval_data, epochs)
    if c.integer("early_stopping_patience"):
        c.put("eval.early_stopping_patience", c.integer("early_stopping_patience", minimum=1))
        c.approximate("early_stopping_patience", "final/ holds the weights of the step the run stopped at; Axolotl "
                                                 "(load_best_model_at_end) loads its best-eval checkpoint back")


def _eval_cadence(c: Conversion, has_eval_data: bool, epochs: float) -> None:
    eval_steps = c.get("eval_steps") or None
    n = c.integer("evals_per_epoch")
    if n and has_eval_data and 1.0 / (n * epochs) < 1.0:
        eval_steps = 1.0 / (n * epochs)
    else:
        n = None
    strategy = c.text("eval_strategy")
    if not has_eval_data:
        return
    if eval_steps is not None:  # Axolotl: eval_steps wins over eval_strategy
        _every(c, "eval", "eval_steps", eval_steps, n, epochs)
    elif strategy == "epoch":
        c.put("eval.every_epochs", 1)
    elif strategy == "steps":
        c.put("eval.every_steps", c.integer("logging_steps", 500, minimum=1))  # Hugging Face's fallback
    elif strategy not in (None, "no"):
        c.refuse("eval_strategy", f"{strategy!r}: Axolotl expects no, steps or epoch")
    else:
        c.default("eval.at_start", False, "Axolotl evaluates only with evals_per_epoch, eval_steps or eval_strategy; "
                                          "finetune's one eval at the end changes nothing that is trained")


def _every(c: Conversion, section: str, key: str, value: Any, per_epoch: int | None, epochs: float) -> None:
    """A step count, or a fraction of the run's steps, as the section's cadence."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        c.refuse(key, f"got {value!r}; Axolotl expects a number of steps, or a fraction of the run below 1")
    elif value >= 1:
        if value != int(value):
            c.refuse(key, f"{value}: a number of steps is a whole number")
        else:
            c.put(f"{section}.every_steps", int(value))
    elif c.has("max_steps"):
        c.put(f"{section}.every_steps", math.ceil(c.get("max_steps") * value))  # Hugging Face's rounding
    else:
        fraction = 1.0 / per_epoch if per_epoch else value * epochs
        c.put(f"{section}.every_epochs", int(fraction) if fraction == int(fraction) else fraction)


def run_rules(c: Conversion) -> None:
    """output_dir, resume_from_checkpoint, auto_resume_from_checkpoints, logging and tracker keys."""
    c.carry("output_dir", "output_dir", c.text("output_dir", "./model-out"), "Axolotl's default")
    if c.has("resume_from_checkpoint"):
        c.refuse("resume_from_checkpoint", "an Axolotl (Hugging Face Trainer) checkpoint cannot be resumed by "
                                           "finetune; start from its weights with base_model instead")
    if c.boolean("auto_resume_from_checkpoints"):
        c.put("resume", "auto")
    if c.has("logging_steps"):
        c.put("logging.every_steps", c.integer("logging_steps", minimum=1))
    if c.boolean("use_tensorboard"):
        c.put("logging.tensorboard", True)
    if c.boolean("use_wandb") or c.has("wandb_project"):
        c.put("logging.wandb", True)
        if c.has("wandb_project"):
            c.put("logging.wandb_project", c.text("wandb_project"))
    if c.boolean("use_mlflow") or c.has("mlflow_experiment_name"):
        c.put("logging.mlflow", True)
        if c.has("mlflow_experiment_name"):
            c.put("logging.mlflow_experiment", c.text("mlflow_experiment_name"))


def parallel_rules(c: Conversion, base: Path) -> None:
    """deepspeed, fsdp, fsdp_config, context_parallel_size -> distributed; plugins (the distillation plugin:
    rules_distill.py)."""
    if c.has("deepspeed"):
        _deepspeed(c, base)
    for key in ("context_parallel_size", "sequence_parallel_degree"):
        size = c.integer(key, minimum=1)
        if size is not None and size > 1:
            c.put("distributed.context_parallel", size)
            c.put("distributed.context_parallel_method", "ring")  # Axolotl's is ring attention (ring-flash-attn)
            break
    fsdp, fsdp_config = c.get("fsdp"), c.mapping("fsdp_config")
    if fsdp or fsdp_config:
        c.put("distributed.strategy", "fsdp")
        offload = (fsdp_config or {}).get("offload_params") or (isinstance(fsdp, list) and "offload" in fsdp)
        if offload:
            c.put("distributed.cpu_offload", True)
    for plugin in c.texts("plugins") or []:
        if is_kd_plugin(plugin):  # with kd_trainer it is what the distill: section converts (rules_distill.py)
            if not kd_requested(c):
                c.drop(f"plugins: {plugin}", "Axolotl's distillation plugin without kd_trainer: nothing it does is "
                                             "trained")
            continue
        name = next((k for k in _KNOWN_PLUGINS if f".{k}." in f".{plugin}."), None)
        if name is None:
            c.refuse("plugins", f"{plugin}: this plugin changes what is trained (or finetune does not know it)")
        else:
            c.drop(f"plugins: {plugin}", _KNOWN_PLUGINS[name])


def _deepspeed(c: Conversion, base: Path) -> None:
    """ZeRO 1/2: data parallel (ddp); ZeRO 3: sharded (fsdp); offload: cpu_offload. The stage is read from the
    JSON (a mapping, or a file next to the config or in the current directory), else from the file's name."""
    value = c.get("deepspeed")
    settings = value if isinstance(value, dict) else _json_file(str(value), base)
    zero = (settings or {}).get("zero_optimization") or {}
    name = str(value).lower() if not isinstance(value, dict) else ""
    stage = zero.get("stage") if zero else (3 if "zero3" in name else 2 if "zero2" in name else
                                            1 if "zero1" in name else None)
    if stage is None:
        c.refuse("deepspeed", f"{value!r}: cannot tell the ZeRO stage; give the JSON file (or a name with zero1/2/3)")
        return
    c.put("distributed.strategy", "fsdp" if stage == 3 else "ddp")
    offload = zero.get("offload_param") or zero.get("offload_optimizer") or "offload" in name
    if offload and stage == 3:
        c.put("distributed.cpu_offload", True)
    if c.peek("adapter.type") is None and c.peek("model.dtype") in ("bfloat16", "float16"):
        c.approximate("deepspeed", f"the weights train in {c.peek('model.dtype')} (DeepSpeed keeps float32 master "
                                   "weights for 16-bit full fine-tuning)")


def _json_file(path: str, base: Path) -> dict | None:
    # Only the ZeRO stage and offload are read from it (nothing is copied into the recipe), so any folder will do;
    # read_side_file still keeps a device or a huge file from being read whole.
    for candidate in (base / path, Path(path)):
        try:
            data = json.loads(read_side_file(candidate))
        except ValueError:  # json's errors are ValueErrors too
            continue
        return data if isinstance(data, dict) else None
    return None
