"""Cross-key checks of the objectives that need more than their own section: GRPO (prompts, rewards, rollouts),
distillation (a teacher) and what context parallelism serves. recipe/validation.py collects them."""

from __future__ import annotations

from finetune.recipe.schema import DATASET_LISTS, Recipe


def grpo_checks(recipe: Recipe) -> list[str]:
    """GRPO trains on its rollouts: one completion per padded row, from a replay file (generation: see docs/rl.md)."""
    if recipe.train.objective != "grpo":
        return []
    problems = []
    for key in DATASET_LISTS:
        for i, ds in enumerate(getattr(recipe, key)):
            if ds.format != "prompt":
                problems.append(f"{key}.{i}.format: train.objective grpo generates from prompts; use format: prompt "
                                f"(a prompt, text or messages, and the fields its rewards read), not {ds.format}")
    if not recipe.grpo.replay and not recipe.grpo.rewards and not recipe.grpo.environment:
        problems.append("grpo.rewards: generating rollouts needs at least one reward function (or an environment "
                        "whose get_reward() gives one; docs/rl.md)")
    if not recipe.grpo.replay and recipe.distributed.strategy == "fsdp":
        problems.append("distributed.strategy: GRPO's generation runs on each rank's own prompts; with fsdp the "
                        "ranks' generate calls would have to stay in step: use ddp, or grpo.replay")
    g = recipe.grpo
    if g.importance_correction != "none" and g.ratio_against == "replay":
        problems.append("grpo.importance_correction: weighs the engine's log-probabilities against the trainer's, and "
                        "ratio_against: replay already takes the engine's as the ratio's denominator: use "
                        "ratio_against: policy")
    if g.importance_min is not None and g.importance_max is not None and g.importance_min >= g.importance_max:
        problems.append(f"grpo.importance_min {g.importance_min} must be below importance_max {g.importance_max}")
    if recipe.grpo.ratio_against == "replay" and not recipe.grpo.replay:
        problems.append("grpo.ratio_against: replay takes the replay file's logprobs; set grpo.replay, or use policy")
    if recipe.grpo.replay and recipe.grpo.multi_turn:
        problems.append("grpo.tools / grpo.environment: they act in generated rollouts; a replay file's are recorded "
                        "already (its lines carry env_mask): remove them, or grpo.replay")
    if recipe.grpo.replay and (recipe.datasets or recipe.eval_datasets):
        problems.append("datasets: grpo.replay trains on the file's rollouts only; remove datasets and eval_datasets")
    if recipe.data.packing:
        problems.append("data.packing: true is written in the recipe (or one it extends), and GRPO trains one "
                        "completion per row; set data.packing: false (or leave it out: false is GRPO's default)")
    if recipe.loss.z_loss:
        problems.append("loss.z_loss: not with train.objective grpo (it adds to token losses)")
    if recipe.eval.early_stopping_patience:
        problems.append("eval.early_stopping_patience: GRPO's evals give a mean reward, not an eval loss")
    if recipe.data.deduplicate != "none":
        problems.append("data.deduplicate: not with train.objective grpo (its prompt datasets are read as they are); "
                        "remove duplicate prompts from the data")
    return problems


def distill_checks(recipe: Recipe) -> list[str]:
    """Distillation needs a teacher, and the teacher's logits where the z-loss would add to the student's."""
    if recipe.train.objective != "distill":
        return []
    problems = []
    d = recipe.distill
    if not d.teacher and not d.teacher_logprobs:
        problems.append("distill.teacher: train.objective distill needs a teacher (a model directory or hub id with "
                        "the student's tokenizer), or distill.teacher_logprobs (its top-k stored in the datasets)")
    if d.teacher and d.teacher_logprobs:
        problems.append("distill.teacher_logprobs: one teacher: a model (distill.teacher) or its log-probabilities "
                        "stored in the datasets (this key), not both")
    if d.teacher_4bit and not d.teacher:
        problems.append("distill.teacher_4bit: quantizes a teacher model (distill.teacher); there is none to load")
    sampled = "distill.lmbda" if d.lmbda > 0 else "distill.seq_kd" if d.seq_kd else None
    if sampled and d.teacher_logprobs:
        problems.append(f"{sampled}: sampled completions need the teacher itself (distill.teacher): stored "
                        "log-probabilities have no entries for other tokens than the data's")
    if sampled and recipe.distributed.strategy == "fsdp":
        problems.append(f"distributed.strategy: {sampled} samples completions on every rank; with fsdp the ranks' "
                        f"generate calls would have to stay in step: use ddp, or turn {sampled} off")
    if sampled and recipe.data.packing:
        problems.append(f"{sampled}: its steps replace each row by a completion of its prompt, one completion per "
                        "row; set data.packing: false")
    if d.teacher_logprobs and any(c.format == "preference" for c in [*recipe.datasets, *recipe.eval_datasets]):
        problems.append("distill.teacher_logprobs: preference datasets have no stored teacher; use chat, alpaca or "
                        "completion rows")
    if recipe.loss.z_loss:
        problems.append("loss.z_loss: not with train.objective distill (it adds to token losses)")
    if recipe.loss.impl == "liger":
        problems.append("loss.impl: liger has no distillation kernel here; use chunked (the default auto)")
    return problems


def context_parallel_checks(recipe: Recipe) -> list[str]:
    """What context parallelism serves for now: SFT, DPO, ORPO and distillation on text (their proofs: tests/context_parallel/)."""
    if recipe.distributed.context_parallel == 1:
        return []
    objective = recipe.train.objective
    if objective not in ("sft", "dpo", "orpo", "distill"):
        return [f"distributed.context_parallel: train.objective {objective} is not split across ranks yet (its "
                "rows' rollouts or scores would have to be); sft, dpo, orpo and distill are"]
    if objective == "orpo" and recipe.orpo.nll == "sequence":
        return ["distributed.context_parallel: not with orpo.nll: sequence yet (it rescores the whole rows after "
                "they are split); orpo.nll: completion is split across ranks"]
    return []
