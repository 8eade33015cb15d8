"""Axolotl's knowledge distillation (its KD plugin, axolotl.integrations.kd, read at commit 067b021c8) ->
train.objective: distill with the teacher's top-k log-probabilities stored in the datasets (distill.teacher_logprobs;
docs/distill.md).

What Axolotl trains with `kd_trainer` (AxolotlKDTrainer and its Liger top-k loss):

* each KD dataset row's `logprobs_field` (default "logprobs") holds the teacher's top-k log-probabilities per token,
  in either layout finetune reads (finetune/data/teacher_logprobs.py): `type: axolotl.integrations.kd.chat_template`
  (`load`: bare values and a `target_token_ids` field) or `...chat_template.load_legacy` ({"token": "token_id:N",
  "logprob": x} entries). Its loader renormalizes each token's top-k to sum to 1 and, when the dataset's generation
  `temperature` (1 when unset) differs from kd_temperature, rescales them to it (p^(T1/T2), renormalized);
* the loss is (kd_alpha x KD + kd_ce_alpha x CE) / the step's trained tokens, where KD sums, over the teacher's top-k
  entries only, the divergence of the student (logits / kd_temperature) from the teacher, kd_beta choosing it as
  TRL's generalized JSD does (0: forward KL(teacher || student), 1: reverse, between: beta KL(teacher || m) +
  (1 - beta) KL(student || m), m = beta teacher + (1 - beta) student): finetune's distill.beta exactly; CE is the
  student's cross-entropy at temperature 1, as sft_weight's. kd_normalize_topk renormalizes the STUDENT's top-k.
  Its logged loss multiplies KD by kd_temperature^2; its gradient does not;
* the loss's weights must lie in [0, 1] and kd_temperature be > 0: unset, or outside, its loss raises.

finetune's loss is (divergence + sft_weight x CE) / trained tokens: with sft_weight = kd_ce_alpha / kd_alpha it is
Axolotl's divided by kd_alpha. max_grad_norm and adam_eps are divided by kd_alpha too: clipping then acts on the
same gradients, and AdamW's step is unchanged when the gradient and eps are scaled together, so the steps are
Axolotl's. What still differs is approximated (the tail of the teacher's distribution, kd_beta > 0,
kd_normalize_topk) or said in a note (which position each stored entry scores).
"""

from __future__ import annotations

from typing import Any

from finetune.convert.context import Conversion
from finetune.convert.rules_vision import is_vision

# Axolotl's dataset types for stored log-probabilities: `load` (bare values plus target_token_ids) and
# `load_legacy` ({"token": "token_id:N", "logprob": x} entries); a type without a load_ function name means `load`.
KD_TYPES = ("axolotl.integrations.kd.chat_template", "axolotl.integrations.kd.chat_template.load",
            "axolotl.integrations.kd.chat_template.load_legacy")
_KD_KEYS = ("kd_ce_alpha", "kd_alpha", "kd_temperature", "kd_beta", "kd_normalize_topk")
_LOGPROBS_DEFAULT = "logprobs"  # Axolotl's ChatTemplateStrategyWithKD(logprobs_field=...)
_ADAM_EPS = 1e-8  # Hugging Face's adam_epsilon and finetune's train.adam_eps when unset
_MAX_GRAD_NORM = 1.0  # Hugging Face's max_grad_norm and finetune's train.max_grad_norm when unset


def is_kd_plugin(name: str) -> bool:
    """Whether a `plugins` entry is Axolotl's distillation plugin (axolotl.integrations.kd.KDPlugin)."""
    return ".kd." in f".{name}."


def kd_requested(c: Conversion) -> bool:
    """Whether the config asks for Axolotl's KD trainer (kd_trainer is a float in its schema: true, 1, ...)."""
    value = c.get("kd_trainer")
    return value is True or (isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0)


def distill_rules(c: Conversion) -> None:
    """kd_trainer, kd_alpha, kd_ce_alpha, kd_temperature, kd_beta, kd_normalize_topk -> train.objective: distill and
    the distill: section (the teacher's field comes from the datasets: kd_dataset)."""
    value = c.get("kd_trainer")
    if value is not None and not isinstance(value, (bool, int, float)):
        c.refuse("kd_trainer", f"got {value!r}; Axolotl expects true or false")
        return
    if not kd_requested(c):
        for key in _KD_KEYS:
            if c.has(key):
                c.drop(key, "read only with kd_trainer")
        return
    if not any(is_kd_plugin(p) for p in c.texts("plugins") or []):
        c.refuse("kd_trainer", "Axolotl reads the kd_ keys only with its distillation plugin (its schema has them "
                               "only then, so it ignores them): add axolotl.integrations.kd.KDPlugin to plugins, "
                               "or remove kd_trainer and the other kd_ keys")
    elif c.has("rl"):
        c.refuse("kd_trainer", "not with rl: one objective per run (train.objective distill, or dpo, orpo, grpo)")
    elif is_vision(c):
        c.refuse("kd_trainer", "distillation with images (processor_type) is not supported; finetune distills "
                               "text models")
    else:  # the other values are checked either way, so that every problem is listed at once
        c.put("train.objective", "distill")
    alpha = _required(c, "kd_alpha", "the weight of its KD loss, from 0 to 1", upper=1.0)
    ce = _required(c, "kd_ce_alpha", "the weight of its cross-entropy, from 0 to 1", upper=1.0)
    temperature = _required(c, "kd_temperature", "the temperature, above 0", upper=None)
    if temperature is not None:
        c.put("distill.temperature", temperature)
        if temperature != 1:
            c.note(f"kd_temperature {temperature:g}: Axolotl logs its KD term times kd_temperature^2 "
                   f"({temperature ** 2:g}), which its gradient does not include; finetune's logged loss has no "
                   "such factor")
    _beta(c)
    if c.boolean("kd_normalize_topk"):
        c.approximate("kd_normalize_topk", "the student's distribution is the whole vocabulary's (its mass outside "
                                           "the teacher's top-k one tail bucket); Axolotl renormalizes the "
                                           "student's top-k probabilities to sum to 1, so its mass outside them is "
                                           "not trained")
    if alpha == 0:
        c.refuse("kd_alpha", "0: Axolotl then computes no KD loss, only kd_ce_alpha x the cross-entropy: that is "
                             "SFT; remove kd_trainer, the kd_ keys and the KD dataset types")
    elif alpha is not None and ce is not None:
        if ce:
            c.put("distill.sft_weight", ce / alpha)
        c.approximate("kd_trainer", "finetune's teacher at each token is its stored top-k plus one tail bucket "
                                    "holding the rest of the mass (exact); Axolotl renormalizes the stored top-k to "
                                    "sum to 1 (its teacher has no mass outside them): the same only when the stored "
                                    "probabilities already sum to 1")
        c.note("kd_trainer: finetune scores the stored entry of token t against the student's prediction of token t, "
               "as vLLM's prompt log-probabilities mean it (the teacher's distribution for token t) and as Axolotl's "
               "trainer did before June 2025; Axolotl's current trainer scores entry t against the student's output "
               "at position t, its prediction of token t + 1")


def _required(c: Conversion, key: str, what: str, upper: float | None) -> float | None:
    """A number Axolotl's KD loss needs (it raises on None or out of range): the value, or None after a refusal."""
    value = c.get(key)
    if value is None:
        c.refuse(key, f"required with kd_trainer: {what} (Axolotl's KD loss fails without it)")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        c.refuse(key, f"got {value!r}; Axolotl expects a number ({what})")
        return None
    if value < 0 or (upper is not None and value > upper) or (upper is None and value <= 0):
        c.refuse(key, f"{value}: Axolotl expects {what} (its KD loss raises otherwise)")
        return None
    return float(value)


def _beta(c: Conversion) -> None:
    value = c.get("kd_beta")
    if value is None:  # KDArgs' default, 0.0
        c.default("distill.beta", 0.0, "Axolotl's default kd_beta: the forward KL(teacher || student)")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        c.refuse("kd_beta", f"got {value!r}; Axolotl expects a number from 0 (forward KL) to 1 (reverse KL)")
        return
    c.put("distill.beta", float(value))
    if value:
        c.approximate("kd_beta", f"{value}: the divergence's student side counts the student's mass outside the "
                                 "teacher's top-k (one tail bucket against the teacher's rest); Axolotl sums the "
                                 "reverse KL and JSD terms over the top-k entries only")


def kd_dataset(c: Conversion, where: str, entry: dict[str, Any]) -> None:
    """A KD dataset's logprobs_field -> distill.teacher_logprobs (every KD dataset must agree); its generation
    temperature must be kd_temperature (finetune takes the stored values as the teacher at distill.temperature)."""
    field = entry.get("logprobs_field")
    if field is not None and (not isinstance(field, str) or not field):
        c.refuse(f"{where}.logprobs_field", f"got {field!r}; Axolotl expects the name of the rows' field")
        return
    field = field or _LOGPROBS_DEFAULT
    current = c.peek("distill.teacher_logprobs")
    if current is None:
        c.put("distill.teacher_logprobs", field)
    elif field != current:
        c.refuse(f"{where}.logprobs_field", f"{field!r}: finetune reads the teacher from one field in every dataset "
                                            f"(distill.teacher_logprobs: {current!r}); rename it in the data")
    generation = entry.get("temperature")
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, (int, float))):
        c.refuse(f"{where}.temperature", f"got {generation!r}; Axolotl expects a number")
        return
    wanted = c.peek("distill.temperature")
    t1 = float(generation or 1.0)  # Axolotl: the dataset's temperature if set (and not 0), else 1.0
    if wanted is not None and t1 != wanted:
        made = f"{t1:g}" if generation else "1 (the dataset sets no temperature)"
        c.refuse(f"{where}.temperature", f"the log-probabilities were made at temperature {made} and "
                 f"kd_temperature is {wanted:g}: Axolotl rescales them to kd_temperature (p^(T1/T2), renormalized over "
                 "the top-k); finetune takes the stored values as the teacher at distill.temperature, as they are: "
                 "store them at kd_temperature, or set kd_temperature to the generation's")


def distill_scale(c: Conversion) -> None:
    """After the optimizer rules: max_grad_norm and adam_eps divided by kd_alpha (the loss is Axolotl's / kd_alpha)."""
    alpha = c.get("kd_alpha")
    if c.peek("train.objective") != "distill" or isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not 0 < alpha < 1:
        return
    norm = c.peek("train.max_grad_norm", _MAX_GRAD_NORM)
    if norm is not None:  # None: clipping off (max_grad_norm: 0)
        c.put("train.max_grad_norm", norm / alpha)
    c.put("train.adam_eps", c.peek("train.adam_eps", _ADAM_EPS) / alpha)
    c.note(f"kd_alpha {alpha:g}: finetune's loss is (divergence + distill.sft_weight x cross-entropy) per trained "
           "token, Axolotl's kd_alpha times that (kd_alpha x KD + kd_ce_alpha x CE); train.max_grad_norm and "
           "train.adam_eps are divided by kd_alpha, so that clipping and AdamW's steps are Axolotl's (AdamW's step "
           "does not change when the gradient and eps are scaled together); the logged loss is 1/kd_alpha times "
           "Axolotl's")
