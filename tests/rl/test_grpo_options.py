"""GRPO options the other tests leave at their defaults: grpo.iterations > 1 (the importance ratio against the
sampling policy's log-probabilities, found by the policy scorer of rl/plan.py), epsilon_high (asymmetric clipping)
and top_p (generation honours it).

The iterations tests use benchmarks/grpo_vs_trl.py's seeded tiny Llama and its 16 replayed rollouts (one model
and one file for the module), through the trainer's own step functions and once through `finetune train`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, assert_resume_checks_reference_weights, run_cli, train_lines

from finetune.batch import Targets
from finetune.data.collate import collate
from finetune.objectives.grpo import GRPO
from finetune.recipe import DataConfig, GRPOConfig
from finetune.rl.rollout import Rollout, training_row
from finetune.train.step import clip_gradients, forward_backward, read_step, step_counts

spec = importlib.util.spec_from_file_location("grpo_vs_trl", ROOT / "benchmarks" / "grpo_vs_trl.py")
bench = sys.modules.setdefault("grpo_vs_trl", importlib.util.module_from_spec(spec))
if not hasattr(bench, "Case"):
    spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(work dir, the benchmark's policy, its 16 rollouts without logprobs)."""
    work = tmp_path_factory.mktemp("grpo-options")
    policy = bench.write_model(work / "policy", seed=0)
    return work, policy, bench.write_replay(work / "replay.jsonl")


def _recipe(work: Path, policy: Path, replay: Path, name: str, **grpo: object) -> Path:
    """The benchmark's recipe (normalize tokens, scale group, beta 0, micro 16 x accumulation 1), with `grpo`'s
    keys; a larger lr so that one step moves the ratio past the clip range."""
    (work / name).mkdir()
    path = bench.write_recipe(bench.Case(), work / name, policy, policy, replay)
    recipe = yaml.safe_load(path.read_text())
    recipe["output_dir"] = str(work / name / "run")
    recipe["grpo"] |= grpo
    recipe["train"] |= {"lr": 0.05, "max_steps": 4}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _logps(lm: torch.nn.Module, row: dict) -> list[float]:
    """The policy's log-probability of each completion token of a training row, straight from its logits."""
    ids = torch.tensor([row["input_ids"]])
    start = row["rollout"]["prompt_length"]
    with torch.no_grad():
        logits = lm(input_ids=ids).logits[0, start - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(1, ids[0, start:, None])[:, 0].tolist()


def _figures(parts, rows: list[dict], recipe) -> object:
    from finetune import dist

    world, device = dist.World(), torch.device("cpu")
    micro = [collate(rows, recipe.data, parts.tokenizer.pad_token_id)]
    counts = step_counts(parts.objective, micro, world, device)[0]
    sums = forward_backward(parts.net, parts.objective, micro, counts, world, device)
    norm = clip_gradients([p for p in parts.lm.parameters() if p.requires_grad], math.inf)
    return read_step(parts.objective, sums, norm, counts)


@pytest.mark.parametrize("file_logprobs", [False, True], ids=["no-logprobs", "logprobs-in-file"])
def test_second_iteration_takes_the_ratio_against_the_sampling_policy(inputs, file_logprobs):
    """iterations 2: both optimizer steps train on the same batch; the ratio's denominator is the policy's own
    log-probabilities before the batch's first update (ratio_against: policy, the default; a file's `logprobs`,
    here off by N(0, 0.1), are ignored). Step one: ratio 1, nothing clipped. Step two: loss, clip fractions and
    the policy's log-probabilities equal the hand computation from the updated policy against the first one."""
    from finetune import dist
    from finetune.recipe import load_recipe
    from finetune.train.parts import load_parts, plan_for

    work, policy, replay = inputs
    if file_logprobs:
        replay = bench.replay_with_logprobs(replay, policy, 0.1)
    epsilon, epsilon_high = 0.05, 0.08
    recipe = load_recipe(_recipe(work, policy, replay, f"it2-{file_logprobs}", iterations=2, epsilon=epsilon,
                                 epsilon_high=epsilon_high))
    torch.manual_seed(0)
    parts = load_parts(recipe, dist.World(), torch.device("cpu"), lambda m: None, splits=("train",))
    plan = plan_for(recipe, parts, dist.World())
    parts.net.train()
    rows = plan.step(0)[1]
    before = [_logps(parts.lm, row) for row in rows]
    for row, want in zip(rows, before):  # the scorer's denominators: the policy's, not the file's
        assert row["rollout"]["logprobs"] == pytest.approx(want, abs=1e-5)
    first = _figures(parts, rows, recipe)
    assert first.metrics["clip_ratio"] == 0.0
    with torch.no_grad():  # one plain gradient step stands in for the optimizer
        for p in parts.lm.parameters():
            p -= 0.5 * p.grad
            p.grad = None
    again = plan.step(1)[1]
    assert again is rows  # the same batch, its denominators untouched
    second = _figures(parts, rows, recipe)

    low, high = 1 - epsilon, 1 + epsilon_high
    total, n, clipped_low, clipped_high, logp_sum = 0.0, 0, 0, 0, 0.0
    for row, old in zip(rows, before):
        a = row["rollout"]["advantage"]
        for new, o in zip(_logps(parts.lm, row), old):
            r = math.exp(new - o)
            total += -min(r * a, min(max(r, low), high) * a)
            clipped_low += r < low and a < 0
            clipped_high += r > high and a > 0
            logp_sum, n = logp_sum + new, n + 1
    assert clipped_low > 0 and clipped_high > 0  # the step moved the ratio out of the range both ways
    assert second.loss == pytest.approx(total / n, rel=1e-5)
    assert second.metrics["clip_ratio_low"] == pytest.approx(clipped_low / n, abs=1e-12)
    assert second.metrics["clip_ratio_high"] == pytest.approx(clipped_high / n, abs=1e-12)
    assert second.metrics["policy_logp"] == pytest.approx(logp_sum / n, rel=1e-5)


def test_each_batch_starts_on_policy_through_the_loop(inputs):
    """`finetune train`, iterations 2 over 2 batches of 8: the first step of each batch has ratio exactly 1
    (nothing clipped), the second clips. The second batch's denominators are the policy after the first batch's
    last update: scored before it, its first step's ratio would not be 1."""
    work, policy, replay = inputs
    recipe = _recipe(work, policy, replay, "loop", iterations=2, epsilon=0.02)
    spec_ = yaml.safe_load(recipe.read_text())
    spec_["train"] |= {"micro_batch_size": 4, "gradient_accumulation_steps": 2}
    recipe.write_text(yaml.safe_dump(spec_, sort_keys=False))
    done = run_cli("train", str(recipe))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = train_lines(Path(spec_["output_dir"]))
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert [x["clip_ratio"] == 0 for x in lines] == [True, False, True, False], [x["clip_ratio"] for x in lines]
    assert lines[0]["tokens"] == lines[1]["tokens"] and lines[2]["tokens"] == lines[3]["tokens"]  # a batch twice


# --- epsilon_high: asymmetric clipping by hand ----------------------------------------------------------------


class _Policy(torch.nn.Module):
    """Stands in for the model with its loss: each scored token's log-probability is a parameter."""

    def __init__(self, logps: list[float]) -> None:
        super().__init__()
        self.logp = torch.nn.Parameter(torch.tensor(logps, dtype=torch.float64))

    def forward(self, targets: Targets, per_token: bool, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logp * 1.0, targets.index


# Completion 0 (advantage > 0) then completion 1 (advantage < 0): each token's ratio to its sampling log-prob.
RATIOS = [1.1, 1.25, 1.35, 0.75, 0.85, 1.5]
LOGPS = [-1.0, -2.0, -0.5, -1.5, -3.0, -0.7]


def _step(cfg: GRPOConfig, rows: list[dict]) -> tuple:
    """One step of the trainer's own GRPO objective on `rows` (padded, one micro-batch, one process) with the
    _Policy of LOGPS: its figures and the policy, whose logp holds the gradient."""
    batch = collate(rows, DataConfig(packing=False), 0)
    policy, objective = _Policy(LOGPS), GRPO(cfg)
    world = __import__("finetune.dist", fromlist=["World"]).World()
    counts = step_counts(objective, [batch], world, torch.device("cpu"))[0]
    figures = read_step(objective, forward_backward(policy, objective, [batch], counts, world, torch.device("cpu")),
                        torch.tensor(0.0), counts)
    return figures, policy


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_epsilon_high_clips_only_above(epsilon_high):
    """epsilon 0.2. Symmetric (epsilon_high null): completion 0's ratios 1.25 and 1.35 are clipped at 1.2. With
    epsilon_high 0.28 (DAPO's): 1.25 is not, 1.35 is, at 1.28. Completion 1 (A < 0): 0.75 is clipped at 0.8 both
    times; 0.85 is inside; 1.5 is not clipped (min(r A, clip(r) A) = r A when A < 0 and r is high). A clipped
    token has no gradient; another's is -r A / tokens."""
    cfg = GRPOConfig(num_generations=2, normalize="tokens", epsilon=0.2, epsilon_high=epsilon_high)
    old = [lp - math.log(r) for lp, r in zip(LOGPS, RATIOS)]
    adv = [1.0, -1.0]  # group advantages of rewards (1, 0) are +-1/(std + 1e-4); used as the rows carry them
    rows = [training_row(Rollout(0, [5, 6, 7], list(range(10, 13)), logprobs=old[3 * i:3 * i + 3]), adv[i], False,
                         True) for i in range(2)]
    figures, policy = _step(cfg, rows)
    high = 1 + (0.2 if epsilon_high is None else epsilon_high)
    a = [1.0] * 3 + [-1.0] * 3
    terms = [-min(r * x, min(max(r, 0.8), high) * x) for r, x in zip(RATIOS, a)]
    clipped = [(r > high and x > 0) or (r < 0.8 and x < 0) for r, x in zip(RATIOS, a)]
    assert clipped == ([False, True, True] if epsilon_high is None else [False, False, True]) + [True, False, False]
    assert figures.loss == pytest.approx(sum(terms) / 6, rel=1e-6)
    assert policy.logp.grad.tolist() == pytest.approx([0.0 if c else -r * x / 6 for r, x, c in
                                                       zip(RATIOS, a, clipped)], rel=1e-9, abs=1e-12)
    assert figures.metrics["clip_ratio_high"] == pytest.approx(sum(clipped[:3]) / 6, abs=1e-12)
    assert figures.metrics["clip_ratio_low"] == pytest.approx(1 / 6, abs=1e-12)


# --- the engine's log-probabilities against the trainer's: importance correction ------------------------------

# The engine's log-probability of each token = the trainer's minus a known mismatch (the trainer is on-policy here:
# its own log-probabilities are the ratio's denominator, ratio 1); completion 0's log-ratios sum to 1.3, 1's to -0.9.
MISMATCH = [0.1, 1.5, -0.3, -0.2, -0.2, -0.5]


def _corrected_step(**grpo: object):
    cfg = GRPOConfig(num_generations=2, normalize="tokens", **grpo)
    engine = [lp - d for lp, d in zip(LOGPS, MISMATCH)]
    rows = [training_row(Rollout(0, [5, 6, 7], list(range(10, 13)), logprobs=engine[3 * i:3 * i + 3]), adv, False)
            for i, adv in enumerate([1.0, -1.0])]
    figures, policy = _step(cfg, rows)
    return figures, policy.logp.grad.tolist()


def _by_hand(weights: list[float]) -> tuple[float, list[float]]:
    """Loss and gradient of -A * w * ratio, ratio = exp(logp - logp.detach()) = 1, over 6 tokens."""
    a = [1.0] * 3 + [-1.0] * 3
    return sum(-x * w for x, w in zip(a, weights)) / 6, [-x * w / 6 for x, w in zip(a, weights)]


@pytest.mark.parametrize("correction, level, weights", [
    # tis, per token, capped at 3: exp(0.1), exp(1.5) = 4.48 -> 3, ...
    ("tis", "token", [math.exp(0.1), 3.0, math.exp(-0.3), math.exp(-0.2), math.exp(-0.2), math.exp(-0.5)]),
    # mis per sequence: completion 0's exp(1.3) = 3.67 > 3 -> every token 0; completion 1's exp(-0.9) kept
    ("mis", "sequence", [0.0] * 3 + [math.exp(-0.9)] * 3),
    ("tis", "sequence", [3.0] * 3 + [math.exp(-0.9)] * 3),
    ("mis", "token", [math.exp(0.1), 0.0, math.exp(-0.3), math.exp(-0.2), math.exp(-0.2), math.exp(-0.5)]),
])
def test_the_importance_correction_weighs_each_token_as_its_formula_says(correction, level, weights):
    """TRL's vllm_importance_sampling_correction, its four modes, checked against the formula by hand (cap 3)."""
    figures, grad = _corrected_step(importance_correction=correction, importance_level=level)
    loss, want = _by_hand(weights)
    assert figures.loss == pytest.approx(loss, rel=1e-9)
    assert grad == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert figures.metrics["logprob_mismatch"] == pytest.approx(sum(map(abs, MISMATCH)) / 6, rel=1e-9)
    assert figures.metrics["importance_weight"] == pytest.approx(sum(weights) / 6, rel=1e-9)
    assert figures.metrics["importance_masked"] == pytest.approx(
        sum(w == 0.0 for w in weights) / 6 if correction == "mis" else 0.0)


def test_without_a_mismatch_the_correction_changes_nothing():
    """Engine and trainer agree: every mode gives the uncorrected step, bit for bit."""
    global MISMATCH
    saved, MISMATCH = MISMATCH, [0.0] * 6
    try:
        plain = _corrected_step()
        for correction in ("tis", "mis"):
            for level in ("token", "sequence"):
                figures, grad = _corrected_step(importance_correction=correction, importance_level=level)
                assert figures.loss == plain[0].loss and grad == plain[1]
    finally:
        MISMATCH = saved


def test_the_correction_needs_the_trainers_own_ratio():
    from finetune.errors import UserError
    from finetune.recipe import load_recipe

    base = ["train.objective=grpo", "datasets=[]", "eval_datasets=[]", "data.packing=false",
            f"grpo.replay={ROOT / 'examples' / 'data' / 'grpo_replay.jsonl'}", "grpo.num_generations=4"]
    with pytest.raises(UserError, match="ratio_against: replay already takes the engine's"):
        load_recipe(ROOT / "examples" / "yaml" / "quickstart.yaml", [*base, "grpo.importance_correction=tis",
                                                                     "grpo.ratio_against=replay"])
    with pytest.raises(UserError, match="importance_min 4.0 must be below importance_max 3.0"):
        load_recipe(ROOT / "examples" / "yaml" / "quickstart.yaml", [*base, "grpo.importance_correction=mis",
                                                                     "grpo.importance_min=4"])


# --- top_p: generation honours it -----------------------------------------------------------------------------


def test_a_tiny_top_p_samples_the_greedy_completion(inputs):
    """top_p 1e-6 keeps only the most likely token, so sampling (at temperature 1.5, with any seed) is greedy
    decoding; at top_p 1 the same seeds sample other completions (the setting reaches generate)."""
    from transformers import AutoModelForCausalLM

    from finetune.rl.generation import HFGenerator

    _, policy, _ = inputs
    lm = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    prompts = [[5, 17, 300, 42], [9, 8, 7]] * 2
    tokenizer = type("Tok", (), {"pad_token_id": 0})()

    def generate(top_p: float, greedy: bool, seed: int) -> list[list[int]]:
        cfg = GRPOConfig(num_generations=2, max_new_tokens=10, temperature=1.5, top_p=top_p)
        torch.manual_seed(seed)
        return HFGenerator(lm, tokenizer, cfg, {2}, torch.device("cpu"), 4).generate(prompts, greedy=greedy)

    greedy = generate(1.0, True, 0)
    assert all(len(c) == 10 or c[-1] == 2 for c in greedy)
    for seed in (0, 1, 2):
        assert generate(1e-6, False, seed) == greedy
    assert any(generate(1.0, False, seed) != greedy for seed in (0, 1, 2))


# --- grpo.reference: PATH is identified by its weights ---------------------------------------------------------


def test_a_resume_refuses_a_reference_whose_weights_changed(inputs):
    """The run records its reference's weights digest (objectives/reference.py weights_digest) in each
    checkpoint. A resume from step 1 with one weight changed at the same path is refused (exit 2) naming
    grpo.reference, nothing trained; with the reference moved to another path, its weights the same, it
    continues."""
    from transformers import AutoModelForCausalLM

    from finetune.model.digest import weights_digest

    work, policy, replay = inputs
    reference = bench.write_model(work / "reference", seed=1, base=policy)
    recipe = _recipe(work, policy, replay, "resume", beta=0.04, reference=str(reference))
    spec_ = yaml.safe_load(recipe.read_text())
    spec_["train"] |= {"micro_batch_size": 8, "max_steps": 2, "lr": 1e-3}
    spec_["checkpoint"] = {"every_steps": 1}
    recipe.write_text(yaml.safe_dump(spec_, sort_keys=False))
    run = Path(spec_["output_dir"])
    assert run_cli("train", str(recipe)).returncode == 0
    state = json.loads((run / "checkpoints" / "step-1" / "trainer_state.json").read_text())
    assert state["reference_digest"] == weights_digest(AutoModelForCausalLM.from_pretrained(reference))
    assert_resume_checks_reference_weights(["train", str(recipe)], run, reference, "grpo.reference",
                                           work / "reference-moved")


def test_an_uncorrected_run_says_once_when_the_engine_disagrees(tmp_path):
    """A replay whose log-probabilities are far from the trainer's, no correction: logprob_mismatch in every step
    line, one console warning naming grpo.importance_correction."""
    from grpo_files import grpo_args, write_replay

    replay = write_replay(tmp_path / "r.jsonl")
    lines = [json.loads(x) for x in replay.read_text().splitlines()]
    replay.write_text("".join(json.dumps({**x, "logprobs": [-0.01] * len(x["completion_ids"])}) + "\n"
                              for x in lines))
    run = tmp_path / "run"
    r = run_cli("train", str(ROOT / "examples" / "yaml" / "quickstart.yaml"), f"output_dir={run}",
                *grpo_args(replay, "train.micro_batch_size=4", "train.gradient_accumulation_steps=1",
                           "train.epochs=null", "train.max_steps=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    steps = train_lines(run)
    assert len(steps) == 2 and all(x["logprob_mismatch"] > 1.0 for x in steps)  # ~6.9 nats: a random model
    assert r.stdout.count("grpo.importance_correction: mis (or tis) corrects it") == 1
