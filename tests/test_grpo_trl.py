"""GRPO's step one equals TRL 1.16.0's GRPOTrainer's (issue 31), with no TRL at run time.

TRL's step-one loss and pre-clip gradient norm were recorded by benchmarks/grpo_vs_trl.py (TRL 1.16.0, torch 2.13
CPU, transformers 5.23, float32) on its seeded tiny Llama and its 16 replayed rollouts; they are pinned below. Ours
is computed here on the same inputs, written again by the benchmark's own functions (their digests pinned too),
through the trainer's step functions, and once through `finetune train`, within 1e-5 relative (a loss that is 0
mathematically: 1e-5 absolute). docs/rl-trl-figures.md has the whole table.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

spec = importlib.util.spec_from_file_location("grpo_vs_trl", ROOT / "benchmarks" / "grpo_vs_trl.py")
bench = sys.modules["grpo_vs_trl"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
spec.loader.exec_module(bench)
Case = bench.Case

TOLERANCE = 1e-5
# The benchmark's inputs: sha256 of the policy's and the reference's tensors (bench.weights_digest) and of the
# replay file. Another digest means other inputs, and the pinned figures below say nothing about them.
POLICY = "6f90704c573b9439"
REFERENCE = "e6c2ab580f2c4dcc"
ROLLOUTS = "13fa752da9ef957b"

# Case -> (TRL's step-one loss, its pre-clip grad norm), printed by
#   python benchmarks/grpo_vs_trl.py --trl-path /tmp/trl_pkgs --json rows.json
# normalize tokens/sequences/constant = TRL's loss_type dapo/grpo/dr_grpo; beta 0.04 against the separate reference.
TRL = {
    Case("tokens", "group", 0.0, 16, 1): (-0.025845864787697792, 1.885980248451233),
    Case("sequences", "group", 0.0, 16, 1): (0.0, 2.4711389541625977),  # each group's advantages sum to 0
    Case("constant", "group", 0.0, 16, 1): (-0.013427734375, 0.9798256754875183),
    Case("tokens", "group", 0.04, 16, 1): (0.05189110338687897, 1.8638883829116821),
    Case("tokens", "group", 0.04, 4, 4): (0.05189110338687897, 1.8638883829116821),
    Case("tokens", "group", 0.04, 1, 16): (0.051891081035137177, 1.8638883829116821),
    Case("sequences", "batch", 0.04, 4, 4): (0.07871648669242859, 2.7578928470611572),
    Case("constant", "none", 0.04, 1, 16): (0.032085999846458435, 0.5247768759727478),
    # mask_truncated_completions: the truncated completions' tokens leave the loss, they still count as sequences
    Case("tokens", "group", 0.04, 4, 4, mask_truncated=True): (0.12146095931529999, 2.749990463256836),
    Case("sequences", "group", 0.04, 4, 4, mask_truncated=True): (-0.018572475761175156, 1.1003981828689575),
    # plain k3 (TRL's use_bias_correction_kl=False): the same loss, another KL gradient
    Case("tokens", "group", 0.04, 4, 4, kl_gradient="k3"): (0.05189110338687897, 1.962361454963684),
}
# TRL at temperature 0.7 (its log-probabilities are of logits / 0.7, the reference's too), tokens, beta 0.04, 16 x 1
TRL_TEMPERATURE_07 = (0.31140023469924927, 2.7497847080230713)
TRL_BNPO_4X4 = 2.0210530757904053  # TRL's bnpo (per-micro-batch token mean), beta 0.04, scale group, 4 x 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread, as the benchmark: the same reduction order, and a fair share of a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    work = tmp_path_factory.mktemp("grpo-vs-trl")
    policy, reference = bench.write_models(work)
    return work, policy, reference, bench.write_replay(work / "replay.jsonl")


def test_the_inputs_are_the_benchmarks(inputs):
    _, policy, reference, replay = inputs
    assert bench.weights_digest(policy)[:16] == POLICY
    assert bench.weights_digest(reference)[:16] == REFERENCE
    assert hashlib.sha256(replay.read_bytes()).hexdigest()[:16] == ROLLOUTS


@pytest.mark.parametrize("case", list(TRL), ids=lambda c: c.name)
def test_step_one_equals_trls(inputs, case):
    work, *files = inputs
    loss, grad_norm, _ = bench.ours_step(bench.write_recipe(case, work, *files))
    trl_loss, trl_grad_norm = TRL[case]
    assert bench.rel(loss, trl_loss) <= TOLERANCE, (loss, trl_loss)
    assert bench.rel(grad_norm, trl_grad_norm) <= TOLERANCE, (grad_norm, trl_grad_norm)


def test_the_cli_gives_trls_figures(inputs):
    """`finetune train` with train.max_steps 1: metrics.jsonl's loss and grad_norm are TRL's."""
    work, *files = inputs
    case = Case("tokens", "group", 0.04, 4, 4)
    (work / "cli").mkdir()
    recipe = bench.write_recipe(case, work / "cli", *files)
    done = run_cli("train", str(recipe))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in (work / "cli" / f"ours-{case.name}" / "metrics.jsonl").read_text().splitlines()]
    first = next(x for x in lines if "loss" in x)
    assert bench.rel(first["loss"], TRL[case][0]) <= TOLERANCE and first["kl"] > 1  # the reference is another model
    assert bench.rel(first["grad_norm"], TRL[case][1]) <= TOLERANCE


def test_the_pins_tell_conventions_apart(inputs):
    """What the pins would catch: our plain-k3 KL gradient against TRL's default (bias-corrected) moves the norm by
    5 %, and our tokens normalizer at 4 x 4 is not TRL's bnpo there (per-micro-batch means: 8 % on the norm)."""
    work, *files = inputs
    exact = Case("tokens", "group", 0.04, 4, 4)
    k3 = bench.ours_step(bench.write_recipe(Case("tokens", "group", 0.04, 4, 4, kl_gradient="k3"), work, *files))[1]
    assert bench.rel(k3, TRL[exact][1]) > 0.04
    tokens = bench.ours_step(bench.write_recipe(exact, work, *files))[1]
    assert bench.rel(tokens, TRL_BNPO_4X4) > 0.05


def test_temperature_scales_the_logprobs_as_trls(inputs):
    work, *files = inputs
    loss, grad_norm, _ = bench.ours_step(bench.write_recipe(Case("tokens", "group", 0.04, 16, 1, temperature=0.7),
                                                            work, *files))
    assert bench.rel(loss, TRL_TEMPERATURE_07[0]) <= TOLERANCE
    assert bench.rel(grad_norm, TRL_TEMPERATURE_07[1]) <= TOLERANCE
