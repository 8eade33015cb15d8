"""A converted recipe trains what Axolotl trains, on the quickstart tokenizer (examples/tokenizer):

- an alpaca row renders as Axolotl's prompter renders it (its exact strings), the prompt and the output tokenized
  apart, the output and the eos trained;
- a ShareGPT row ({from, value}, human/gpt, a system column) maps to the same messages and trained turns;
- warmup_ratio gives int(ratio x total steps) warmup steps, and the learning rate of every step is Hugging Face's
  (what Axolotl's trainer runs), Axolotl's 1 -> 2 rule and its default (3%, at most 100) included;
- per-epoch evals and checkpoints land at the steps Hugging Face's trainer (TrainerState.compute_steps and
  DefaultFlowCallback, transformers' own code) gives Axolotl's fractions.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import TOKENIZER_DIR

from finetune.convert import convert_axolotl
from finetune.data.batching import StepPlan
from finetune.data.samples import row_example
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.labels import IGNORE_INDEX
from finetune.recipe import Recipe, validate
from finetune.train.optim import lr_factor, warmup_steps

SYSTEM_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.")
SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
# Axolotl's prompts (src/axolotl/prompters.py, AlpacaPrompter), written out: (with input, without input).
PROMPTS = {
    "alpaca": (f"{SYSTEM_WITH_INPUT}\n\n### Instruction:\nAdd the numbers.\n\n### Input:\n2 3\n\n### Response:\n",
               f"{SYSTEM_NO_INPUT}\n\n### Instruction:\nAdd the numbers.\n\n### Response:\n"),
    "alpaca:chat": (f"SYSTEM: {SYSTEM_WITH_INPUT}\nUSER: Add the numbers.\n2 3\nASSISTANT:",
                    f"SYSTEM: {SYSTEM_NO_INPUT}\nUSER: Add the numbers.\nASSISTANT:"),
    "alpaca:chatml": (f"<|im_start|>system\n{SYSTEM_WITH_INPUT}<|im_end|>\n<|im_start|>user\nAdd the numbers.\n2 3"
                      "<|im_end|>\n<|im_start|>assistant\n",
                      f"<|im_start|>system\n{SYSTEM_NO_INPUT}<|im_end|>\n<|im_start|>user\nAdd the numbers.<|im_end|>\n"
                      "<|im_start|>assistant\n"),
    "alpaca:phi": (f"<|system|>\n{SYSTEM_WITH_INPUT}<|end|>\n<|user|>\nAdd the numbers.<|end|>2 3<|assistant|>",
                   f"<|system|>\n{SYSTEM_NO_INPUT}<|end|>\n<|user|>\nAdd the numbers.<|end|>\n<|assistant|>\n"),
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _recipe(tmp_path: Path, text: str) -> dict:
    config = tmp_path / "config.yml"
    config.write_text("base_model: org/model\n" + text, encoding="utf-8")
    recipe = yaml.safe_load(convert_axolotl(config).text)
    validate(recipe)
    return recipe


def _sample(tokenizer, recipe: dict, row: dict) -> dict:
    dataset = Recipe.model_validate(recipe).datasets[0]
    return tokenize_example(row_example(RawRow(row, "t.jsonl:1"), dataset), tokenizer)


@pytest.mark.parametrize("kind", PROMPTS)
@pytest.mark.parametrize("with_input", [True, False])
def test_an_alpaca_row_renders_as_axolotls_prompter(tmp_path, tokenizer, kind, with_input):
    recipe = _recipe(tmp_path, f"datasets:\n  - {{path: d.jsonl, type: '{kind}'}}\n")
    row = {"instruction": "Add the numbers.", "input": "2 3" if with_input else "", "output": "5, then 6."}
    sample = _sample(tokenizer, recipe, row)
    prompt = PROMPTS[kind][0 if with_input else 1]
    assert tokenizer.decode(sample["input_ids"]) == prompt + "5, then 6.<|im_end|>"  # the eos appended
    # The prompt and the output are tokenized apart, as Axolotl does: the ids are the prompt's, then the output's.
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert sample["input_ids"] == tokenizer(prompt)["input_ids"] + tokenizer("5, then 6.")["input_ids"] + [
        tokenizer.eos_token_id]
    assert sample["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt  # only the output and its eos are trained
    assert sample["labels"][n_prompt:] == sample["input_ids"][n_prompt:]


def test_alpaca_with_a_bos_adding_tokenizer_and_train_on_inputs(tmp_path, tokenizer):
    from tokenizers import processors

    bos_tok = copy.deepcopy(tokenizer)
    bos_tok.add_special_tokens({"bos_token": "<|endoftext|>"})
    bos = bos_tok.bos_token_id
    bos_tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    recipe = _recipe(tmp_path, "train_on_inputs: true\ndatasets:\n  - {path: d.jsonl, type: alpaca}\n")
    sample = _sample(bos_tok, recipe, {"instruction": "Add the numbers.", "output": "5"})
    # One bos, before the prompt; the output's own bos is stripped, as Axolotl's _tokenize(strip_bos_token) does.
    assert sample["input_ids"].count(bos) == 1 and sample["input_ids"][0] == bos
    assert bos_tok.decode(sample["input_ids"]) == "<|endoftext|>" + PROMPTS["alpaca"][1] + "5<|im_end|>"
    assert sample["labels"][1:] == sample["input_ids"][1:]  # train_on_inputs: the prompt too (the first: no target)


def test_a_sharegpt_row_maps_to_the_same_messages_and_trained_turns(tmp_path):
    recipe = _recipe(tmp_path, "datasets:\n  - path: d.jsonl\n    type: chat_template\n    field_messages: "
                               "conversations\n    message_property_mappings: {role: from, content: value}\n")
    dataset = Recipe.model_validate(recipe).datasets[0]
    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                             {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}],
           "system": "Be brief."}
    example = row_example(RawRow(row, "t.jsonl:1"), dataset)
    # Axolotl: the default role names (human -> user, gpt -> assistant), the row's `system` prepended as a system
    # turn (the conversation has none), the assistant turns trained (roles_to_train's default).
    assert example.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4"})
    assert example.trained == (False, False, True, False, True)
    # A conversation that has its system turn keeps it; the column is then not read (Axolotl's rule too).
    row = {"conversations": [{"from": "system", "value": "S"}, *row["conversations"][:2]], "system": "ignored"}
    assert [m["content"] for m in row_example(RawRow(row, "t.jsonl:2"), dataset).messages] == ["S", "Hi", "Hello!"]


def _hf_lrs(total: int, warmup: int, scheduler: str) -> list[float]:
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if scheduler == "cosine":
        schedule = get_cosine_schedule_with_warmup(optimizer, warmup, total)
    elif scheduler == "linear":
        schedule = get_linear_schedule_with_warmup(optimizer, warmup, total)
    else:
        schedule = get_constant_schedule_with_warmup(optimizer, warmup)
    lrs = []
    for _ in range(total):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    return lrs


def _axolotl_warmup(total: int, ratio: float | None) -> int:
    """Axolotl's rule (core/builders/base.py): int(ratio x total), else min(int(0.03 x total), 100); 1 -> 2."""
    steps = int(ratio * total) if ratio is not None else min(int(0.03 * total), 100)
    return 2 if steps == 1 else steps


@pytest.mark.parametrize("ratio", [0.1, 0.29, 0.03, None])
@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant_with_warmup"])
def test_warmup_ratio_gives_int_ratio_x_total_steps_and_hugging_faces_learning_rates(tmp_path, ratio, scheduler):
    text = "datasets:\n  - {path: d.jsonl, type: alpaca}\n" + f"lr_scheduler: {scheduler}\n" + (
        f"warmup_ratio: {ratio}\n" if ratio is not None else "")
    train = Recipe.model_validate(_recipe(tmp_path, text)).train
    for total in (9, 10, 20, 40, 100, 1000, 5000):
        expected = _axolotl_warmup(total, ratio)
        assert warmup_steps(train, total) == expected, (ratio, total)
        if ratio is not None and expected != 2:
            assert warmup_steps(train, total) == int(ratio * total)  # the float64 product, floored (0.29 x 100: 28)
        ours = [lr_factor(step, total, train) for step in range(total)]
        assert ours == pytest.approx(_hf_lrs(total, expected, scheduler.removesuffix("_with_warmup")), abs=1e-12)


def _hf_steps(total: int, fraction: float) -> tuple[set[int], set[int]]:
    """(eval steps, save steps) of Hugging Face's trainer for `fraction` of `total` steps, eval_on_start as Axolotl
    sets it: TrainerState.compute_steps, then DefaultFlowCallback.on_step_end at every step."""
    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import DefaultFlowCallback
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    args = SimpleNamespace(logging_steps=None, eval_steps=fraction, save_steps=fraction, logging_first_step=False,
                           logging_strategy=IntervalStrategy.NO, eval_strategy=IntervalStrategy.STEPS,
                           save_strategy=SaveStrategy.STEPS, eval_delay=0)
    state = TrainerState(max_steps=total)
    state.compute_steps(args, total)
    evals, saves, flow = {0}, set(), DefaultFlowCallback()
    for step in range(1, total + 1):
        state.global_step = step
        control = flow.on_step_end(args, state, TrainerControl())
        if control.should_evaluate:
            evals.add(step)
        if control.should_save:
            saves.add(step)
    return evals, saves


def _finetune_steps(recipe: dict, steps_per_epoch: int) -> tuple[set[int], set[int]]:
    """(eval steps, checkpoint or final-save steps) as finetune's trainer takes them for this recipe."""
    parsed = Recipe.model_validate(recipe)
    samples = [{"input_ids": [1, 2], "labels": [IGNORE_INDEX, 2]}] * steps_per_epoch  # 1 row per step
    plan = StepPlan(samples, parsed, world_size=1)
    every_eval = plan.cadence(parsed.eval.every_steps, parsed.eval.every_epochs)
    every_save = plan.cadence(parsed.checkpoint.every_steps, parsed.checkpoint.every_epochs)
    evals = {0} if parsed.eval.at_start else set()
    evals |= {s for s in range(1, plan.total) if every_eval and s % every_eval == 0} | {plan.total}
    saves = {s for s in range(1, plan.total + 1) if every_save and s % every_save == 0} | {plan.total}  # + final/
    return evals, saves


@pytest.mark.parametrize("per_epoch", [2, 3, 4])
@pytest.mark.parametrize("epochs", [1, 2, 3])
def test_per_epoch_evals_and_checkpoints_land_at_axolotls_steps(tmp_path, per_epoch, epochs):
    recipe = _recipe(tmp_path, f"datasets:\n  - {{path: d.jsonl, type: alpaca}}\nval_set_size: 0.1\nnum_epochs: "
                               f"{epochs}\nevals_per_epoch: {per_epoch}\nsaves_per_epoch: {per_epoch}\n")
    recipe["train"].update(micro_batch_size=1, gradient_accumulation_steps=1)
    recipe["data"].update(packing=False, val_fraction=0.0)  # the held-out rows are the data loader's business
    fraction = 1.0 / (per_epoch * epochs)  # Axolotl's normalize_config
    for steps_per_epoch in (7, 12, 25, 100, 101):
        total = steps_per_epoch * epochs
        assert _finetune_steps(recipe, steps_per_epoch) == _hf_steps(total, fraction), (steps_per_epoch, total)


def test_one_eval_per_epoch_of_one_epoch_means_no_eval_and_a_checkpoint_at_the_end(tmp_path):
    recipe = _recipe(tmp_path, "datasets:\n  - {path: d.jsonl, type: alpaca}\nval_set_size: 0.1\nevals_per_epoch: 1\n"
                               "saves_per_epoch: 1\n")
    assert recipe["eval"] == {"at_start": False}  # Axolotl sets no eval cadence: it never evaluates
    assert "every_epochs" not in recipe["checkpoint"]  # its one epoch-end save is finetune's final/



def test_the_cadence_arithmetic_agrees_with_hugging_faces_rounding():
    """Axolotl: every ceil(total x 1.0 / (n x epochs)) steps (floating point, as Hugging Face computes it); finetune:
    every ceil(1.0 / n x steps of an epoch) steps (StepPlan.cadence). The same for every n, epochs, epoch length."""
    import math

    from finetune.data.batching import StepPlan as Plan

    for per_epoch in range(1, 11):
        for epochs in range(1, 5):
            if per_epoch * epochs == 1:
                continue  # Axolotl sets no cadence then (test above)
            for steps in range(1, 501):
                plan = SimpleNamespace(steps_in_epoch=lambda _e, s=steps: s)
                ours = Plan.cadence(plan, None, 1.0 / per_epoch)
                assert ours == max(1, math.ceil(steps * epochs * (1.0 / (per_epoch * epochs)))), (per_epoch, epochs)
