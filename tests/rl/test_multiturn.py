"""Multi-turn rollouts (docs/rl.md, "Multi-turn rollouts"): the environment's tokens (env_mask 0) stay in the rows as
context but get no label, so no loss, no KL, no entropy, no gradient and no place in the step's counts; their
sampling log-probabilities are never read. The loss contract holds on a multi-turn replay file for every normalizer,
a short last step included (2 gloo ranks: tests/train/test_distributed.py's grpo case replays the same file)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from grpo_files import tiny_lm
from helpers import QUICKSTART, ROOT, TINY, final_weights, rel_diff, run_cli, train_lines

from finetune import dist
from finetune.data.collate import collate
from finetune.labels import IGNORE_INDEX
from finetune.model.with_loss import CausalLMWithLoss
from finetune.objectives.grpo import GRPO
from finetune.recipe import DataConfig, GRPOConfig
from finetune.rl.plan import policy_scorer, rollout_figures
from finetune.rl.rollout import Rollout, training_row
from finetune.train.step import forward_backward, step_counts

MULTITURN = ROOT / "examples" / "yaml" / "grpo-replay-multiturn.yaml"
REPLAY = ROOT / "examples" / "data" / "grpo_replay_multiturn.jsonl"
CPU = torch.device("cpu")


def rollouts(seed: int = 0, n: int = 4) -> list[Rollout]:
    """Completions of a policy turn, an environment's turn and a policy turn (one single-turn), random ids."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [rng.randrange(2, 6), rng.randrange(3, 7), rng.randrange(1, 4)] if i else [rng.randrange(2, 8)]
        completion = [rng.randrange(3, 1000) for _ in range(sum(turns))]
        mask = [m for k, length in enumerate(turns) for m in [1 - k % 2] * length] if i else None
        out.append(Rollout(0, [rng.randrange(3, 1000) for _ in range(3)], completion, env_mask=mask))
    return out


def test_the_environments_tokens_get_no_label_and_are_counted_apart():
    r = Rollout(0, [5, 6], [7, 8, 9, 10, 2], env_mask=[1, 0, 0, 1, 1])
    row = training_row(r, 0.5, masked=False)
    assert row["input_ids"] == [5, 6, 7, 8, 9, 10, 2]
    assert row["labels"] == [IGNORE_INDEX, IGNORE_INDEX, 7, IGNORE_INDEX, IGNORE_INDEX, 10, 2]
    assert training_row(r, 0.5, masked=True)["labels"] == [IGNORE_INDEX] * 7
    figures = rollout_figures([r, Rollout(0, [5], [7, 2])], [False, False], 0.0)
    assert figures["env_tokens"] == 1.0 and figures["completion_length"] == 3.5
    assert "env_tokens" not in rollout_figures([Rollout(0, [5], [7, 2])] * 2, [False, False], 0.0)


def _gradient(net, rows, cfg):
    """The model's gradient of GRPO's step over `rows` (one micro-batch), and the step's counts."""
    objective = GRPO(cfg)
    net.zero_grad(set_to_none=True)
    batch = collate(rows, DataConfig(packing=False), 0)
    counts = step_counts(objective, [batch], dist.World(), CPU)[0]
    forward_backward(net, objective, [batch], counts, dist.World(), CPU)
    return {n: p.grad.clone() for n, p in net.lm.named_parameters() if p.grad is not None}, counts


def test_only_the_policys_tokens_carry_loss_and_gradient():
    """The gradient equals the one computed from the model's full logits over the policy's tokens alone (on-policy,
    tokens normalizer), and differs from it taken over every completion token: the environment's tokens add nothing."""
    lm = tiny_lm()
    net = CausalLMWithLoss(lm, "chunked", chunk_size=5, z_loss=0.0, softcap=None)
    rs = rollouts()
    advantages = [0.7, -0.4, 1.1, -1.4]
    got, counts = _gradient(net, [training_row(r, a, False) for r, a in zip(rs, advantages)],
                            GRPOConfig(num_generations=4))
    assert counts["tokens"] == sum(len(r.completion_ids) - r.env_tokens for r in rs)

    def by_hand(env_too: bool) -> dict[str, torch.Tensor]:
        lm.zero_grad(set_to_none=True)
        terms, count = [], 0
        for r, a in zip(rs, advantages):
            logits = lm(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0].float()
            logp = torch.log_softmax(logits[len(r.prompt_ids) - 1:-1], dim=-1)
            logp = logp.gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            mine = torch.tensor(r.env_mask or [1] * len(r.completion_ids), dtype=torch.bool) | env_too
            terms.append((-a * torch.exp(logp - logp.detach()))[mine].sum())  # ratio 1: -min(rA, clip(r)A) = -rA
            count += int(mine.sum())
        (sum(terms) / count).backward()
        return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    want, wrong = by_hand(False), by_hand(True)
    for name, g in want.items():
        assert rel_diff(got[name], g) < 1e-5, name
    assert max(rel_diff(want[n], wrong[n]) for n in want) > 1e-2


def test_the_environments_sampling_logprobs_are_never_read():
    """ratio_against: replay with each completion token's sampling log-probability: changing those of the
    environment's tokens leaves the gradient bit for bit; changing one of the policy's changes it."""
    lm = tiny_lm()
    net = CausalLMWithLoss(lm, "chunked", chunk_size=5, z_loss=0.0, softcap=None)
    rs = rollouts(1)
    cfg = GRPOConfig(num_generations=4, ratio_against="replay", epsilon=0.2)

    def grads(env_value: float, policy_shift: float) -> dict[str, torch.Tensor]:
        for r in rs:
            mask = r.env_mask or [1] * len(r.completion_ids)
            r.logprobs = [(-1.5 + policy_shift if k == 0 else -1.5) if m else env_value for k, m in enumerate(mask)]
        return _gradient(net, [training_row(r, a, False, True) for r, a in zip(rs, [0.7, -0.4, 1.1, -1.4])], cfg)[0]

    base = grads(-2.0, 0.0)
    assert all(torch.equal(base[n], g) for n, g in grads(-77.0, 0.0).items())
    assert any(not torch.equal(base[n], g) for n, g in grads(-2.0, 0.3).items())


def test_the_sampling_policys_logprobs_are_laid_out_per_completion_token():
    """iterations > 1 take the ratio against the policy's log-probabilities scored before the batch's first step:
    one per completion token, the environment's positions left at 0.0 (never read), the policy's equal to the
    model's own."""
    lm = tiny_lm().eval()
    net = CausalLMWithLoss(lm, "chunked", chunk_size=5, z_loss=0.0, softcap=None)
    recipe = __import__("finetune.recipe", fromlist=["load_recipe"]).load_recipe(QUICKSTART, TINY)
    rs = rollouts(2)
    rows = [training_row(r, 0.5, False) for r in rs]
    scored = policy_scorer(net, recipe, 0, CPU)(rows)
    for r, values in zip(rs, scored):
        assert len(values) == len(r.completion_ids)
        with torch.no_grad():
            logits = lm(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0].double()
        logp = torch.log_softmax(logits[len(r.prompt_ids) - 1:-1], -1).gather(1, torch.tensor(r.completion_ids)[:, None])
        for k, (mine, v) in enumerate(zip(r.env_mask or [1] * len(values), values)):
            assert (v == pytest.approx(float(logp[k]), abs=1e-5)) if mine else v == 0.0


@pytest.mark.parametrize("normalize", ["tokens", "sequences", "constant"])
def test_the_loss_contract_holds_on_a_multi_turn_replay(normalize):
    """finetune verify on the example's first multi-turn step: 2 simulated ranks x 2 micro-batches against one
    batch, within 1e-5, for each normalizer."""
    from finetune.commands.verify import verify
    from finetune.recipe import load_recipe

    recipe = load_recipe(MULTITURN, [*TINY, f"grpo.normalize={normalize}", "grpo.beta=0.04",
                                     "train.micro_batch_size=2", "train.gradient_accumulation_steps=4"])
    result = verify(recipe, world_size=2)
    assert result.passed and result.tolerance == 1e-5, result.groups


def test_splits_train_the_same_weights_with_a_short_last_step(tmp_path):
    """40 multi-turn completions in steps of 16 (the last one short: 8): 16 x 1, 1 x 16 and 4 x 4 train the same
    weights, each tensor within 1e-5."""
    replay = tmp_path / "r.jsonl"
    replay.write_text("".join(line + "\n" for line in REPLAY.read_text().splitlines()[:40]))
    weights = []
    for micro, accum in ((16, 1), (1, 16), (4, 4)):
        run = tmp_path / f"m{micro}"
        r = run_cli("train", str(MULTITURN), f"output_dir={run}", *TINY, f"grpo.replay={replay}", "grpo.beta=0.04",
                    f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accum}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(train_lines(run)) == 3
        weights.append(final_weights(run))
    for name, ref in weights[0].items():
        assert rel_diff(weights[1][name], ref) < 1e-5 and rel_diff(weights[2][name], ref) < 1e-5, name
    assert json.loads(REPLAY.read_text().splitlines()[1]).get("env_mask")  # the file is multi-turn
