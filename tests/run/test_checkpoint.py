"""Checkpoint state round-trip, in process: what `save` writes, `load` restores exactly (weights, optimizer,
scheduler, RNG, trainer state), and `check_resume_recipe` tells a resumable recipe from a changed one."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_recipe

from finetune.errors import UserError
from finetune.recipe import validate
from finetune.run import checkpoint


def _training(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)  # frozen weights are not checkpointed (an adapter's base)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler) -> None:
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def test_save_then_load_restores_everything(tmp_path):
    recipe = validate(tiny_recipe(tmp_path / "run", tmp_path / "train.jsonl"))
    model, optimizer, scheduler = _training(0)
    for _ in range(3):
        _step(model, optimizer, scheduler)
    state = checkpoint.trainer_state(recipe, step=3, epoch=0, samples_key="abc", global_batch=2, world_size=1,
                                     tokens_seen=123, samples_seen=6)
    path = checkpoint.save(tmp_path, 3, model, optimizer, scheduler, state, keep_last=2)
    after_torch, after_python = torch.rand(3), random.random()  # what the RNGs give next, after the save

    fresh, fresh_optimizer, fresh_scheduler = _training(1)  # other weights, no optimizer state
    frozen_before = fresh[0].weight.clone()
    loaded = checkpoint.load(path, fresh, fresh_optimizer, fresh_scheduler)
    assert loaded == state
    assert torch.equal(torch.rand(3), after_torch) and random.random() == after_python  # RNG restored exactly
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, dict(fresh.named_parameters())[name]), name
    assert torch.equal(fresh[0].weight, frozen_before)  # not in the checkpoint: untouched
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():  # a real resume rebuilds the frozen base as it was (seeded): do the same here
        fresh[0].weight.copy_(model[0].weight)
    for m, o, s in ((model, optimizer, scheduler), (fresh, fresh_optimizer, fresh_scheduler)):
        torch.manual_seed(7)  # the same batch for both: one more step lands them on the same weights
        _step(m, o, s)
    assert all(torch.equal(a, b) for a, b in zip(model[1].parameters(), fresh[1].parameters()))


def test_resume_check_allows_a_new_split_and_refuses_a_changed_training(tmp_path):
    raw = tiny_recipe(tmp_path / "run", tmp_path / "train.jsonl")
    recipe = validate(raw)
    state = checkpoint.trainer_state(recipe, step=3, epoch=0, samples_key="abc", global_batch=2, world_size=1,
                                     tokens_seen=0, samples_seen=0)
    checkpoint.check_resume_recipe(recipe, state, 2, "abc")
    split = validate({**raw, "train": {**raw["train"], "micro_batch_size": 1, "gradient_accumulation_steps": 2}})
    checkpoint.check_resume_recipe(split, state, 2, "abc")  # same global batch, split differently
    harmless = validate({**raw, "logging": {"every_steps": 5}, "output_dir": str(tmp_path / "elsewhere")})
    checkpoint.check_resume_recipe(harmless, state, 2, "abc")
    changed = validate({**raw, "train": {**raw["train"], "lr": 0.5}})
    with pytest.raises(UserError, match=r"train\.lr: 0\.001 -> 0\.5"):
        checkpoint.check_resume_recipe(changed, state, 2, "abc")
    with pytest.raises(UserError, match="global batch"):
        checkpoint.check_resume_recipe(recipe, state, 4, "abc")
    with pytest.raises(UserError, match="training data or tokenizer content"):
        checkpoint.check_resume_recipe(recipe, state, 2, "other")


def test_a_key_the_checkpoint_predates_counts_as_its_default(tmp_path):
    """A checkpoint written before train.warmup_ratio existed resumes under a recipe that leaves it at its default,
    and is refused under one that sets it."""
    raw = tiny_recipe(tmp_path / "run", tmp_path / "train.jsonl")
    recipe = validate(raw)
    state = checkpoint.trainer_state(recipe, step=3, epoch=0, samples_key="abc", global_batch=2, world_size=1,
                                     tokens_seen=0, samples_seen=0)
    del state["training_keys"]["train.warmup_ratio"]
    checkpoint.check_resume_recipe(recipe, state, 2, "abc")
    with pytest.raises(UserError, match=r"train\.warmup_ratio: None -> 0\.1"):
        checkpoint.check_resume_recipe(validate({**raw, "train": {**raw["train"], "warmup_ratio": 0.1}}), state, 2,
                                       "abc")


def test_the_frozen_weights_must_be_those_the_run_started_from(tmp_path):
    """frozen_digest (model/digest.py): recorded only when something is frozen; a resume over other frozen weights is
    refused naming model.path; a checkpoint written before it was recorded resumes as before."""
    recipe = validate(tiny_recipe(tmp_path / "run", tmp_path / "train.jsonl"))
    kwargs = {"step": 3, "epoch": 0, "samples_key": "abc", "global_batch": 2, "world_size": 1, "tokens_seen": 0,
              "samples_seen": 0}
    assert "frozen_digest" not in checkpoint.trainer_state(recipe, **kwargs)
    state = checkpoint.trainer_state(recipe, **kwargs, frozen="f" * 64)
    assert state["frozen_digest"] == "f" * 64
    checkpoint.check_resume_recipe(recipe, state, 2, "abc", frozen="f" * 64)
    with pytest.raises(UserError, match=r"the frozen weights loaded from model\.path .*ffffffffffffffff\.\.\. when the "
                                        r"run started, 0000000000000000\.\.\. now"):
        checkpoint.check_resume_recipe(recipe, state, 2, "abc", frozen="0" * 64)
    older = checkpoint.trainer_state(recipe, **kwargs)
    checkpoint.check_resume_recipe(recipe, older, 2, "abc", frozen="0" * 64)


def test_model_path_may_move_when_what_a_resume_takes_from_it_has_not(tmp_path):
    """model.path may change on resume when the config (config_digest), the frozen weights and the tokenizer (from
    tokenizer.path, or by content through the samples' key) are those the run started from; never with
    trust_remote_code, nor from a checkpoint that recorded no config digest."""
    raw = tiny_recipe(tmp_path / "run", tmp_path / "train.jsonl")
    raw["model"] = {**raw["model"], "path": str(tmp_path / "old"), "init": "pretrained", "config": None}

    def recipe(path: str, **model: object):
        return validate({**raw, "model": {**raw["model"], "path": path, **model}})

    kwargs = {"step": 3, "epoch": 0, "samples_key": "abc", "global_batch": 2, "world_size": 1, "tokens_seen": 0,
              "samples_seen": 0}
    state = checkpoint.trainer_state(recipe(str(tmp_path / "old")), **kwargs, frozen="f" * 64, config="c" * 64)
    assert state["config_digest"] == "c" * 64
    moved = recipe(str(tmp_path / "new"))
    checkpoint.check_resume_recipe(moved, state, 2, "abc", frozen="f" * 64, config="c" * 64)
    refused = r"model\.path: '.*old' -> '.*new'"
    for frozen, config, samples_key in (("f" * 64, "d" * 64, "abc"), ("0" * 64, "c" * 64, "abc"),
                                        ("f" * 64, None, "abc")):
        with pytest.raises(UserError, match=refused):
            checkpoint.check_resume_recipe(moved, state, 2, samples_key, frozen=frozen, config=config)
    # The tokenizer from tokenizer.path: the samples' key need not vouch for it; from model.path, it must.
    checkpoint.check_resume_recipe(moved, state, 2, None, frozen="f" * 64, config="c" * 64)
    raw["tokenizer"] = {**raw["tokenizer"], "path": None}
    state = checkpoint.trainer_state(recipe(str(tmp_path / "old")), **kwargs, frozen="f" * 64, config="c" * 64)
    checkpoint.check_resume_recipe(recipe(str(tmp_path / "new")), state, 2, "abc", frozen="f" * 64, config="c" * 64)
    with pytest.raises(UserError, match=refused):
        checkpoint.check_resume_recipe(recipe(str(tmp_path / "new")), state, 2, None, frozen="f" * 64,
                                       config="c" * 64)
    with pytest.raises(UserError, match=refused):
        checkpoint.check_resume_recipe(recipe(str(tmp_path / "new"), trust_remote_code=True), state, 2, "abc",
                                       frozen="f" * 64, config="c" * 64)
    older = checkpoint.trainer_state(recipe(str(tmp_path / "old")), **kwargs, frozen="f" * 64)
    with pytest.raises(UserError, match=refused):
        checkpoint.check_resume_recipe(moved, older, 2, "abc", frozen="f" * 64, config="c" * 64)


def test_a_changed_auto_reference_is_named_by_model_path(tmp_path):
    raw = tiny_recipe(tmp_path / "run", tmp_path / "train.jsonl")
    raw["datasets"][0]["format"] = "preference"
    recipe = validate({**raw, "train": {**raw["train"], "objective": "dpo"}})
    state = checkpoint.trainer_state(recipe, step=3, epoch=0, samples_key="abc", global_batch=2, world_size=1,
                                     tokens_seen=0, samples_seen=0, reference="a" * 64)
    checkpoint.check_resume_recipe(recipe, state, 2, "abc", reference="a" * 64)
    with pytest.raises(UserError, match=r"the reference model at model\.path .* \(dpo\.reference: auto\): sha256 "
                                        r"aaaaaaaaaaaaaaaa\.\.\. when the run started, bbbbbbbbbbbbbbbb\.\.\. now"):
        checkpoint.check_resume_recipe(recipe, state, 2, "abc", reference="b" * 64)
