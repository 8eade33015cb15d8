"""GRPO (train.objective grpo): advantages and the policy loss against hand computation, the replay file's contract,
and the loss contract through the real CLI: any split of the step gives the same weights (2 ranks under DDP and FSDP:
tests/train/test_distributed.py)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from grpo_files import grpo_args, tiny_lm, write_prompts, write_replay
from helpers import QUICKSTART, TINY, final_weights, rel_diff, run_cli, train_lines

from finetune.batch import Targets
from finetune.data.collate import collate
from finetune.errors import UserError
from finetune.objectives.grpo import GRPO
from finetune.recipe import DataConfig, GRPOConfig
from finetune.rl.advantages import group_advantages
from finetune.rl.replay import read_replay
from finetune.rl.rollout import Rollout, training_row
from finetune.train.step import forward_backward, read_step, step_counts

# --- advantages ------------------------------------------------------------------------------------------------


def test_group_advantages_use_bessel_and_1e4():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], 4, "group")
    std = math.sqrt(4 * 0.25 / 3)  # Bessel: n - 1
    assert adv.values[:4] == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1 + [-0.5 / (std + 1e-4),
                                           0.5 / (std + 1e-4)], rel=1e-12)
    assert adv.values[4:] == [0.0] * 4 and adv.zero_std == [False] * 4 + [True] * 4 and adv.zero_std_groups == 0.5


def test_batch_and_none_scaling():
    rewards = [1.0, 0.0, 3.0, 5.0]
    batch = group_advantages(rewards, 2, "batch")
    std = torch.tensor(rewards, dtype=torch.float64).std().item()  # torch's std is Bessel-corrected too
    assert batch.values == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -1 / (std + 1e-4),
                                          1 / (std + 1e-4)], rel=1e-12)
    assert group_advantages(rewards, 2, "none").values == [0.5, -0.5, -1.0, 1.0]


def test_unscored_completions_leave_the_baseline_and_get_0():
    adv = group_advantages([1.0, math.nan, 0.0, 2.0], 4, "none")
    assert adv.values == [0.0, 0.0, -1.0, 1.0]  # the mean of 1, 0, 2 is 1
    assert group_advantages([math.nan] * 2, 2, "group").values == [0.0, 0.0]


# --- rewards ------------------------------------------------------------------------------------------------------


def test_rollout_figures_give_mean_and_std_per_function_and_in_total():
    """Bessel's std, unscored (None: NaN) completions left out of their function's figures."""
    from finetune.rl.plan import rollout_figures

    rollouts = [Rollout(0, [5], [7, 2], {"a": a, "b": b}, total)
                for a, b, total in ((1.0, 0.0, 1.0), (0.0, math.nan, 0.0), (1.0, 2.0, 3.0), (0.0, 4.0, 4.0))]
    figures = rollout_figures(rollouts, [False, False, True, False], 0.5)
    assert figures["rewards/a"] == 0.5 and figures["rewards_std/a"] == pytest.approx(math.sqrt(1 / 3), rel=1e-12)
    assert figures["rewards/b"] == 2.0 and figures["rewards_std/b"] == pytest.approx(2.0, rel=1e-12)
    assert figures["reward"] == 2.0 and figures["reward_std"] == pytest.approx(math.sqrt(10 / 3), rel=1e-12)
    assert figures["truncated"] == 0.25 and figures["zero_std_groups"] == 0.5
    assert figures["completion_length"] == 2 and figures["completion_length_max"] == 2


# --- the policy loss against hand computation ---------------------------------------------------------------------


class _Policy(torch.nn.Module):
    """Stands in for the model with its loss: each scored token's log-probability is a parameter."""

    def __init__(self, logps: list[float]) -> None:
        super().__init__()
        self.logp = torch.nn.Parameter(torch.tensor(logps, dtype=torch.float64))

    def forward(self, targets: Targets, per_token: bool, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        assert per_token
        return self.logp * 1.0, targets.index


def _batch(lengths=(2, 3), rewards=(1.0, 0.0), prompt=(5, 6, 7), logprobs=None):
    adv = group_advantages(list(rewards), len(rewards), "group").values
    rows = [training_row(Rollout(0, list(prompt), list(range(10, 10 + n)), logprobs=lp), a, False, lp is not None)
            for n, a, lp in zip(lengths, adv, logprobs or [None] * len(lengths))]
    return collate(rows, DataConfig(packing=False), 0), adv


def _step(cfg: GRPOConfig, logps, ref=None, logprobs=None):
    batch, adv = _batch(logprobs=logprobs)
    objective, policy = GRPO(cfg), _Policy(logps)
    if ref is not None:
        objective._reference = lambda **kw: (torch.tensor(ref, dtype=torch.float64), None)
    world = __import__("finetune.dist", fromlist=["World"]).World()
    counts = step_counts(objective, [batch], world, torch.device("cpu"))[0]
    sums = forward_backward(policy, objective, [batch], counts, world, torch.device("cpu"))
    figures = read_step(objective, sums, torch.tensor(0.0), counts)
    return figures, policy.logp.grad, adv


LOGPS = [-1.0, -2.0, -0.5, -1.5, -3.0]  # completion 0: 2 tokens, completion 1: 3 tokens
REF = [-1.2, -1.9, -0.4, -1.0, -3.5]


@pytest.mark.parametrize("normalize", ["tokens", "sequences", "constant"])
@pytest.mark.parametrize("kl_gradient", ["exact", "k3"])
def test_policy_loss_and_gradient_by_hand(normalize, kl_gradient):
    beta = 0.04
    cfg = GRPOConfig(num_generations=2, beta=beta, normalize=normalize, kl_gradient=kl_gradient, max_new_tokens=8)
    figures, grad, adv = _step(cfg, LOGPS, REF)
    seq = [0, 0, 1, 1, 1]
    k3 = [math.exp(r - lp) - (r - lp) - 1 for r, lp in zip(REF, LOGPS)]
    per_token = [-adv[s] + beta * k for s, k in zip(seq, k3)]  # ratio 1 on-policy: -min(A, clip(1) A) = -A
    # d/dlogp: the policy term -A r gives -A; the KL term gives (logp - ref) [exact] or 1 - exp(ref - logp) [k3].
    dkl = [lp - r if kl_gradient == "exact" else 1 - math.exp(r - lp) for r, lp in zip(REF, LOGPS)]
    per_grad = [-adv[s] + beta * d for s, d in zip(seq, dkl)]
    weight = {"tokens": [1 / 5] * 5, "constant": [1 / 16] * 5,
              "sequences": [1 / (2 * 2)] * 2 + [1 / (2 * 3)] * 3}[normalize]
    # The step's loss is summed in float32 on the device (train/step.py): 1e-6.
    assert figures.loss == pytest.approx(sum(w * x for w, x in zip(weight, per_token)), rel=1e-6)
    assert grad.tolist() == pytest.approx([w * g for w, g in zip(weight, per_grad)], rel=1e-12)
    assert figures.metrics["kl"] == pytest.approx(sum(k3) / 5, rel=1e-12)
    assert figures.metrics["clip_ratio"] == 0.0


def test_clipping_uses_the_sampling_logprobs():
    """Ratios 1.5 and 0.5 against the sampling policy, epsilon 0.2: both clipped where the advantage pushes them
    further out, and the clipped tokens carry no gradient."""
    old = [[math.log(2 / 3) + x for x in (-1.0, -2.0)], [math.log(2) + x for x in (-0.5, -1.5, -3.0)]]
    cfg = GRPOConfig(num_generations=2, normalize="tokens")
    figures, grad, adv = _step(cfg, LOGPS, logprobs=old)
    assert adv[0] > 0 > adv[1]
    # completion 0: ratio 1.5 > 1.2 with A > 0 -> -1.2 A (clipped); completion 1: ratio 0.5 < 0.8 with A < 0 -> -0.8 A.
    expected = (2 * -1.2 * adv[0] + 3 * -0.8 * adv[1]) / 5
    assert figures.loss == pytest.approx(expected, rel=1e-9)
    assert figures.metrics["clip_ratio"] == 1.0 and grad.abs().max() == 0


# --- the entropy metric ------------------------------------------------------------------------------------------


def _tiny_policy():
    from finetune.model.with_loss import CausalLMWithLoss

    lm = tiny_lm().eval()
    return lm, CausalLMWithLoss(lm, "chunked", chunk_size=7, z_loss=0.0, softcap=None)  # several chunks per batch


def test_entropy_equals_full_logits_and_any_split():
    """The step's entropy metric (the mean over every scored completion token of the policy's entropy at
    grpo.temperature, summed in the chunked pass) equals it computed from the model's full logits, within 1e-5
    (fp32 model), under the splits 8 x 1, 1 x 8 and 2 x 4; a masked (truncated) completion counts no tokens."""
    lm, net = _tiny_policy()
    rng = random.Random(3)
    rollouts = [Rollout(g, [rng.randrange(3, 1000) for _ in range(3 + g)],
                        [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 9))]) for g in range(2) for _ in range(4)]
    rows = [training_row(r, 0.5, masked=i == 5) for i, r in enumerate(rollouts)]
    temperature = 0.7
    with torch.no_grad():
        naive = []
        for i, r in enumerate(rollouts):
            if i == 5:
                continue
            logits = lm(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0].double() / temperature
            logp = torch.log_softmax(logits[len(r.prompt_ids) - 1:-1], dim=-1)  # the positions scoring the completion
            naive += (-(logp.exp() * logp).sum(-1)).tolist()
    expected = sum(naive) / len(naive)
    objective = GRPO(GRPOConfig(num_generations=4, temperature=temperature))
    world = __import__("finetune.dist", fromlist=["World"]).World()
    got = []
    for micro in (8, 1, 2):
        batches = [collate(rows[i:i + micro], DataConfig(packing=False), 0) for i in range(0, 8, micro)]
        counts = step_counts(objective, batches, world, torch.device("cpu"))[0]
        sums = forward_backward(net, objective, batches, counts, world, torch.device("cpu"))
        got.append(read_step(objective, sums, torch.tensor(0.0), counts).metrics["entropy"])
        assert counts["tokens"] == len(naive)
    assert got == pytest.approx([expected] * 3, rel=1e-5, abs=0) and expected > 1.0, (got, expected)


# --- the replay file ------------------------------------------------------------------------------------------------

GOOD = {"group": 0, "prompt_ids": [5, 6], "completion_ids": [7, 2], "reward": 1.0}


@pytest.mark.parametrize(("lines", "message"), [
    (["{not json"], "not JSON"),
    ([{**GOOD, "group": None}] * 2, None),  # null is a scalar group name: fine
    ([{k: v for k, v in GOOD.items() if k != "group"}], "`group`"),
    ([GOOD], "group 0 has 1 completions; grpo.num_generations is 2"),
    ([GOOD, GOOD, {**GOOD, "group": 1}, {**GOOD, "group": 1}, GOOD, GOOD], "appears again"),
    ([GOOD, {**GOOD, "completion_ids": [7, 5000]}], "id 5000, outside the tokenizer's vocabulary of 1024"),
    ([GOOD, {**GOOD, "reward": float("nan")}], "reward 'reward' is nan"),
    ([GOOD, {**GOOD, "rewards": {"a": 1}}], "give `reward` .* or `rewards`"),
    ([GOOD, {**GOOD, "logprobs": [-1.0]}], "logprobs must be 2 finite numbers"),
    ([GOOD, {**GOOD, "extra": 1}], r"unknown field\(s\) \['extra'\]"),
    ([GOOD, {**GOOD, "completion_ids": []}], "the completion is empty"),
])
def test_bad_replay_lines_name_file_and_line(tmp_path, tokenizer, lines, message):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    if message is None:
        assert len(read_replay(path, tokenizer, 2, {})) == 2
        return
    with pytest.raises(UserError, match=message) as e:
        read_replay(path, tokenizer, 2, {})
    assert f"{path}:" in str(e.value)


def test_replay_renders_prompts_and_tokenizes_text(tmp_path, tokenizer):
    path = tmp_path / "r.jsonl"
    line = {"group": "a", "prompt": [{"role": "user", "content": "hi"}], "completion": "hello",
            "rewards": {"x": 1.0, "y": None}}
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "rewards": {"x": None, "y": None}}) + "\n")
    first, second = read_replay(path, tokenizer, 2, {"x": 2.0, "y": 1.0})
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert first.prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert first.completion_ids == tokenizer("hello", add_special_tokens=False)["input_ids"]
    assert first.reward == 2.0 and math.isnan(second.reward)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "examples" / "tokenizer")


# --- the loss contract through the CLI ---------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", ["tokens", "sequences", "constant"])
def test_first_step_is_exact_under_any_split(tmp_path, normalize):
    """finetune verify on the first replayed step: 2 simulated ranks x 2 micro-batches x 2 completions against
    one batch of 8, within 1e-5. Per-micro-batch token means (the naive scheme, TRL's bnpo) are off; per-sequence
    and constant normalizers have equal micro-batches here, so their per-micro-batch means happen to be exact."""
    from finetune.commands.verify import verify
    from finetune.recipe import load_recipe

    replay = write_replay(tmp_path / "r.jsonl")
    recipe = load_recipe(QUICKSTART, grpo_args(replay, f"grpo.normalize={normalize}", "grpo.beta=0.04",
                                               "grpo.scale_rewards=batch", "train.micro_batch_size=2",
                                               "train.gradient_accumulation_steps=2"))
    result = verify(recipe, world_size=2)
    assert result.passed and result.tolerance == 1e-5, result.groups
    assert (result.naive_max > 1e-3) == (normalize == "tokens"), result.groups


def _weights_after(tmp_path: Path, name: str, replay: Path, micro: int, accum: int, *extra: str) -> dict:
    run = tmp_path / name
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *grpo_args(replay, "grpo.beta=0.04", *extra),
                f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accum}")
    assert r.returncode == 0, r.stderr[-3000:]
    return final_weights(run), train_lines(run)


def test_splits_give_the_same_weights_and_step_one_is_on_policy(tmp_path):
    """8 x 1, 1 x 8 and 2 x 4 train the same weights over 2 steps (fp32, each tensor within 1e-5 relative, as the SFT tests). At step one the policy is
    the reference and the sampling policy: KL and clip fraction exactly 0. Batch 1 with accumulation moves the
    weights (the advantage is computed before the split)."""
    replay = write_replay(tmp_path / "r.jsonl")
    (w8, lines8), (w1, lines1), (w2, _) = (_weights_after(tmp_path, f"m{m}", replay, m, a)
                                           for m, a in ((8, 1), (1, 8), (2, 4)))
    for name, ref in w8.items():
        assert rel_diff(w1[name], ref) < 1e-5 and rel_diff(w2[name], ref) < 1e-5, name
    first = lines1[0]
    assert first["kl"] == 0.0 and first["clip_ratio"] == 0.0 and first["update_ratio"] > 0
    assert lines8[0]["loss"] == pytest.approx(first["loss"], rel=1e-5) and len(lines8) == 2
    rewards = [json.loads(x)["reward"] for x in replay.read_text().splitlines()]
    for line, batch in zip(lines1, (rewards[:8], rewards[8:])):  # group 3's rewards are all 1.0: no advantage
        groups = [batch[:4], batch[4:]]
        assert line["zero_std_groups"] == sum(len(set(g)) == 1 for g in groups) / 2
        assert line["reward"] == pytest.approx(sum(batch) / 8)
    assert lines1[1]["zero_std_groups"] >= 0.5


def test_a_bad_replay_line_exits_2_naming_it(tmp_path):
    replay = write_replay(tmp_path / "r.jsonl")
    lines = replay.read_text().splitlines()
    lines[5] = lines[5].replace('"group": 1', '"group": 9')
    replay.write_text("\n".join(lines) + "\n")
    r = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *grpo_args(replay))
    assert r.returncode == 2 and f"{replay}:5" in r.stderr + r.stdout, r.stderr[-2000:]


# --- generated rollouts ----------------------------------------------------------------------------------------------


def test_generated_rollouts_train_and_eval_reports_the_mean_reward(tmp_path):
    """The policy generates each step's rollouts (after the previous update), the reward functions score them,
    and the held-out prompts' greedy mean reward is logged at every eval."""
    train, held_out = write_prompts(tmp_path / "p.jsonl", 32, 1), write_prompts(tmp_path / "e.jsonl", 8, 2)
    run = tmp_path / "run"
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *TINY, "data.packing=false", "train.objective=grpo",
                f"datasets.0.path={train}", "datasets.0.format=prompt", f"eval_datasets.0.path={held_out}",
                "eval_datasets.0.format=prompt", "grpo.num_generations=4", "grpo.max_new_tokens=6",
                "grpo.rewards=[{function: length, args: {target: 3, scale: 1}}, {function: exact_answer}]",
                "train.micro_batch_size=4", "train.gradient_accumulation_steps=2", "train.max_steps=2",
                "train.warmup_steps=0", "eval.at_start=true", "eval.every_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [x for x in lines if "loss" in x], [x for x in lines if "eval_reward" in x]
    assert [e["step"] for e in evals] == [0, 1, 2] and all(e["eval_prompts"] == 8 for e in evals)
    for line in steps:
        assert 1 <= line["completion_length"] <= line["completion_length_max"] <= 6
        assert line["samples"] == 8 * line["step"] and line["generation_tokens_per_s"] > 0
        assert {"rewards/length", "rewards/exact_answer", "rewards_std/length", "zero_std_groups", "kl", "tokens",
                "entropy"} <= set(line)
        assert line["reward"] == pytest.approx(line["rewards/length"] + line["rewards/exact_answer"])
    assert "prompts: 32 (0 bad rows skipped), 8 held out" in r.stdout


def test_generation_cuts_after_the_first_end_token():
    from finetune.rl.generation import cut_at_end

    assert cut_at_end([5, 6, 2, 0, 0], [0, 2]) == [5, 6, 2] and cut_at_end([5, 6, 7], [0, 2]) == [5, 6, 7]


def test_a_raising_reward_names_the_prompt_row_through_the_cli(tmp_path):
    """Generated rollouts: the error (exit 2, no traceback) names the function and the prompt row's file:line."""
    (tmp_path / "boom_rewards.py").write_text(
        "def explode(prompts, completions, explode, **kw):\n"
        "    return [1 / 0 if e else 0.0 for e in explode]\n")
    prompts = write_prompts(tmp_path / "p.jsonl", 4, 1)
    rows = prompts.read_text().splitlines()
    rows[1] = json.dumps({**json.loads(rows[1]), "explode": True})
    prompts.write_text("\n".join(rows) + "\n")
    r = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *TINY, "data.packing=false",
                "train.objective=grpo", f"datasets.0.path={prompts}", "datasets.0.format=prompt", "eval_datasets=[]",
                "data.shuffle=false", "grpo.num_generations=2", "grpo.max_new_tokens=2",
                "grpo.rewards=[{function: 'boom_rewards:explode'}]", "train.micro_batch_size=2",
                "train.gradient_accumulation_steps=2", "train.max_steps=1", "--allow-code",
                env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"reward function 'explode' raised ZeroDivisionError: division by zero (on a completion of " \
           f"{prompts}:2: " in r.stderr, r.stderr[-2000:]


def test_training_tokens_per_s_leaves_out_generation(tmp_path, monkeypatch):
    """Generation made slow on purpose (2 s a batch, injected into our generator): the step's training time
    (seq_tokens / tokens_per_s) leaves it out, and generation_s and rollout_s (the whole making of the batch) count
    it."""
    import time

    from rich.console import Console

    from finetune.recipe import load_recipe
    from finetune.rl.generation import HFGenerator
    from finetune.train.loop import train

    real = HFGenerator.generate

    def slow(self, prompts, greedy=False, **kwargs):
        time.sleep(2.0)
        return real(self, prompts, greedy, **kwargs)

    monkeypatch.setattr(HFGenerator, "generate", slow)
    prompts = write_prompts(tmp_path / "p.jsonl", 8, 1)
    recipe = load_recipe(QUICKSTART, [f"output_dir={tmp_path / 'run'}", *TINY, "data.packing=false",
                                      "train.objective=grpo", f"datasets.0.path={prompts}", "datasets.0.format=prompt",
                                      "eval_datasets=[]", "grpo.num_generations=4", "grpo.max_new_tokens=4",
                                      "train.micro_batch_size=4", "train.gradient_accumulation_steps=1",
                                      "train.max_steps=2", "grpo.rewards=[{function: length}]"])
    train(recipe, console=Console(quiet=True))
    for line in train_lines(tmp_path / "run"):
        training = line["seq_tokens"] / line["tokens_per_s"]
        assert line["generation_s"] >= 2.0 and line["rollout_s"] >= line["generation_s"] + line["reward_s"]
        assert training < 2.0, line  # before: the lap held the generation, >= 2 s
        assert line["generation_tokens_per_s"] == pytest.approx(line["completion_length"] * 4 / line["generation_s"])


def test_a_step_without_advantage_is_reported(tmp_path):
    """Every group's rewards equal: the console says the step has nothing to learn, and the metrics line (the
    console's and metrics.jsonl's) says every group had zero advantage."""
    replay = write_replay(tmp_path / "r.jsonl", groups=2)
    lines = [json.loads(x) for x in replay.read_text().splitlines()]
    replay.write_text("".join(json.dumps({**x, "reward": float(x["group"])}) + "\n" for x in lines))
    run = tmp_path / "run"
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *grpo_args(replay), "train.micro_batch_size=4",
                "train.gradient_accumulation_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 1: the rewards are equal within every group (no advantage): nothing to learn from its rollouts" \
        in r.stdout, r.stdout[-2000:]
    assert "reward 0.500  zero_std_groups 1.00" in r.stdout
    (line,) = train_lines(run)
    assert line["zero_std_groups"] == 1.0 and line["reward_std"] > 0  # equal within groups, not across them
