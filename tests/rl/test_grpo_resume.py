"""GRPO resumes exactly: a checkpoint taken between the iterations of one batch of rollouts records the batch (its
rows, with the sampling log-probabilities scored before the batch's first step, and generated rollouts), and
`resume: auto` from it gives the losses, gradient norms and weights of the uninterrupted run bit for bit, replayed
and generated; a replay file that moved (same content) continues the run, one whose content changed is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from grpo_files import grpo_args, write_prompts, write_replay
from helpers import QUICKSTART, TINY, final_weights, run_cli, train_lines

from finetune.run import checkpoint

# Two batches of two iterations each, a checkpoint after every step: step-1 and step-3 fall inside a batch's
# iterations, step-2 between batches. Dropout on, so that the RNG state must be restored too.
EVERY_STEP = ["grpo.iterations=2", "train.micro_batch_size=4", "train.gradient_accumulation_steps=2",
              "train.max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep_last=10",
              "model.config.attention_dropout=0.1"]


def replayed(replay: Path) -> list[str]:
    return [*grpo_args(replay, "grpo.beta=0.04"), *EVERY_STEP]


def generated(prompts: Path) -> list[str]:
    """The policy samples 4 completions of 2 prompts a step; the length reward tells them apart (the tiny model
    rarely ends a completion, but its tokens' texts differ in length), so every step has advantages to learn."""
    return [*TINY, "data.packing=false", "train.objective=grpo", f"datasets.0.path={prompts}",
            "datasets.0.format=prompt", "eval_datasets=[]", "grpo.num_generations=4", "grpo.max_new_tokens=6",
            "grpo.rewards=[{function: length, args: {target: 12, scale: 4}}]", "train.warmup_steps=0",
            "train.lr=1e-2", *EVERY_STEP]


def _train(run: Path, args: list[str], *extra: str) -> str:
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *args, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _resume_from(straight: Path, step: int, target: Path, args: list[str]) -> str:
    """`straight` as a run stopped right after its step-`step` checkpoint would have left it, resumed."""
    shutil.copytree(straight, target)
    shutil.rmtree(target / "final")
    for later in checkpoint.complete_checkpoints(target / "checkpoints"):
        if int(later.name.removeprefix(checkpoint.PREFIX)) > step:
            shutil.rmtree(later)
    out = _train(target, args, "resume=auto")
    assert f"resumed from {target / 'checkpoints' / f'step-{step}'} at step {step}" in out, out[-2000:]
    assert "not exact" not in out
    return out


FIGURES = ("step", "loss", "grad_norm", "kl", "clip_ratio", "entropy", "policy_logp", "reward", "completion_length")


def _assert_bitwise(a: Path, b: Path) -> None:
    la, lb = train_lines(a), train_lines(b)
    assert len(la) == len(lb) == 4
    assert [[x[k] for k in FIGURES] for x in la] == [[x[k] for k in FIGURES] for x in lb]
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def _recorded(run: Path) -> dict[int, bool]:
    return {step: (run / "checkpoints" / f"step-{step}" / checkpoint.ROLLOUTS).is_file() for step in range(1, 5)}


def test_replay_resume_inside_a_batchs_iterations_is_bitwise_identical(tmp_path):
    """Before the fix the resumed step 4 took its ratio against the policy after step 3 (ratio 1, nothing
    clipped) instead of the policy before step 3: another loss and other weights."""
    replay = write_replay(tmp_path / "r.jsonl")
    straight = tmp_path / "straight"
    _train(straight, replayed(replay))
    assert _recorded(straight) == {1: True, 2: False, 3: True, 4: False}
    state = checkpoint.rollout_state(straight / "checkpoints" / "step-3")
    assert state["batch"] == 1 and len(state["rows"]) == 8
    assert all(len(r["rollout"]["logprobs"]) == len(r["input_ids"]) - r["rollout"]["prompt_length"]
               for r in state["rows"])
    # grpo.reference auto without an adapter is loaded again from model.path on resume: its weights are recorded
    # (the same digest in every checkpoint: the reference never trains).
    digests = {json.loads((straight / "checkpoints" / f"step-{s}" / "trainer_state.json").read_text())
               ["reference_digest"] for s in range(1, 5)}
    assert len(digests) == 1 and len(next(iter(digests)) or "") == 64
    _resume_from(straight, 3, tmp_path / "resumed", replayed(replay))
    _assert_bitwise(straight, tmp_path / "resumed")


@pytest.mark.parametrize("step", [3, 2])
def test_generated_resume_is_bitwise_identical(tmp_path, step):
    """Generated rollouts. Inside a batch's iterations (step 3) the resume takes the batch's rollouts from the
    checkpoint: made again by the updated policy they would differ. Between batches (step 2) the next batch is
    generated after the resume exactly as without it: sampling is seeded by the run's seed and the batch."""
    prompts = write_prompts(tmp_path / "p.jsonl", 8, 1)
    straight = tmp_path / "straight"
    _train(straight, generated(prompts))
    assert _recorded(straight) == {1: True, 2: False, 3: True, 4: False}
    rows = checkpoint.rollout_state(straight / "checkpoints" / "step-3")["rows"]
    assert len({r["rollout"]["advantage"] for r in rows}) > 1  # something to learn from
    _resume_from(straight, step, tmp_path / "resumed", generated(prompts))
    _assert_bitwise(straight, tmp_path / "resumed")


def test_a_moved_replay_file_continues_and_a_changed_one_is_refused(tmp_path):
    """grpo.replay is identified by its content, as a dataset's path: the same file at another path resumes (and
    trains what the uninterrupted run trained); other content at that path is refused, naming the change."""
    replay = write_replay(tmp_path / "r.jsonl")
    args = [*grpo_args(replay), "checkpoint.every_steps=1", "checkpoint.keep_last=10"]
    straight = tmp_path / "straight"
    _train(straight, args)
    moved = tmp_path / "elsewhere" / "moved.jsonl"
    moved.parent.mkdir()
    replay.rename(moved)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-2")
    out = _train(resumed, [*args, f"grpo.replay={moved}"], "resume=auto")
    assert "resumed from" in out and "step-1" in out
    assert [x["loss"] for x in train_lines(resumed)] == [x["loss"] for x in train_lines(straight)]

    lines = moved.read_text().splitlines()
    moved.write_text("\n".join([*lines[:-1], json.dumps({**json.loads(lines[-1]), "reward": 0.25})]) + "\n")
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-2")
    r = run_cli("train", str(QUICKSTART), f"output_dir={resumed}", *args, f"grpo.replay={moved}", "resume=auto")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "resume refused" in r.stderr and f"grpo.replay: '{replay}' -> '{moved}'" in r.stderr
    assert "the training data or tokenizer content" in r.stderr


def test_the_rollouts_identity_is_content_not_paths(tmp_path):
    """rl/sources.py: the same replay file at another path has the same samples key; another byte in it, or another
    tokenizer (one added token), gives another key, so a resume refuses them."""
    from transformers import AutoTokenizer

    from finetune.recipe import load_recipe
    from finetune.rl.sources import rollout_samples

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "examples" / "tokenizer")
    replay = write_replay(tmp_path / "r.jsonl")
    copy = tmp_path / "elsewhere.jsonl"
    copy.write_bytes(replay.read_bytes())

    def key(path: Path, tok=tokenizer) -> str:
        return rollout_samples(load_recipe(QUICKSTART, grpo_args(path)), tok, lambda m: None).samples_key

    assert key(replay) == key(copy) and key(replay).startswith("rl:")
    copy.write_bytes(replay.read_bytes().replace(b'"reward": 1.0', b'"reward": 0.0', 1))
    assert key(copy) != key(replay)
    other = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "examples" / "tokenizer")
    other.add_tokens(["<extra>"])
    assert key(replay, other) != key(replay)


def test_restore_takes_back_the_batch_or_says_the_resume_is_not_exact(tmp_path):
    """RolloutPlan.restore: a checkpoint inside a batch's iterations with its record gives the batch back as
    recorded; one without (an older finetune) is resumed with a warning; a record of another batch is refused;
    between batches nothing is taken back."""
    from finetune.errors import UserError
    from finetune.recipe import load_recipe
    from finetune.rl.plan import replay_plan
    from finetune.rl.rollout import Rollout

    recipe = load_recipe(QUICKSTART, grpo_args(tmp_path / "r.jsonl", *EVERY_STEP))
    rollouts = [Rollout(g, [5, 6], [7, 2], reward=float(i % 2)) for g in range(4) for i in range(4)]
    plan = replay_plan(rollouts, recipe, 1, {2}, score=lambda rows: [[-1.0, -2.0]] * len(rows))
    _, rows = plan.step(2)
    assert plan.resume_state(2) is None and plan.resume_state(3)["batch"] == 1
    state = json.loads(json.dumps(plan.resume_state(3)))  # as written and read back
    assert state["rows"] == rows and rows[0]["rollout"]["logprobs"] == [-1.0, -2.0]

    fresh = replay_plan(rollouts, recipe, 1, {2}, score=lambda rows: [[-9.0, -9.0]] * len(rows))
    assert fresh.restore(state, 3, "ckpt") is None and fresh.step(3)[1] == rows  # not scored again
    assert fresh.restore(None, 2, "ckpt") is None
    assert "not exact" in replay_plan(rollouts, recipe, 1, {2}).restore(None, 3, "ckpt")
    with pytest.raises(UserError, match=r"records rollouts of batch 1 \(format 1\), not of batch 0 at step 1"):
        replay_plan(rollouts, recipe, 1, {2}).restore(state, 1, "ckpt")
