"""A reward model's step one equals TRL 1.16.0's RewardTrainer's (issue 46), with no TRL at run time.

TRL's step-one loss and pre-clip gradient norm were recorded by benchmarks/reward_vs_trl.py (TRL 1.16.0, torch 2.13
CPU, transformers 5.23, float32) on its seeded tiny LlamaForSequenceClassification and 16 quickstart pairs (with and
without a margin field): micro 16 x accumulation 1 and 4 x 4, reward centering off and at 0.01, and ours in packed
rows against TRL's padded batch. Ours is computed here on the same inputs, written again by the benchmark's own
functions (their digests pinned too), through the trainer's step functions, within 1e-5 relative; once through
`finetune train`. Where TRL is at hand (installed, or /tmp/trl_pkgs), the whole gradient is compared too, by the
benchmark in its own process. docs/preference.md, "Reward models", has the table.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from helpers import ROOT, TEST_ENV, first_cli_step, load_benchmark, trl_or_skip

bench = load_benchmark("reward_vs_trl")
pytestmark = pytest.mark.usefixtures("single_thread")
Case = bench.Case

TOLERANCE = 1e-5
# The benchmark's inputs: sha256 of the reward model's tensors and of the two pairs files.
MODEL = "61771e44a66b9fb6"
PAIRS = "76a834fd34c31643"
MARGINS = "2201f74c85a955c0"

# Case name -> (TRL's step-one loss, its pre-clip grad norm), as printed by
#   python benchmarks/reward_vs_trl.py --trl-path /tmp/trl_pkgs --pins
TRL = {
    "reward-16x1": (0.8021983504295349, 7.202670097351074),
    "reward-4x4": (0.8021979928016663, 7.2026686668396),
    "reward-16x1-center0.01": (1.204817533493042, 10.785208702087402),
    "reward-4x4-center0.01": (1.204817295074463, 10.785207748413086),
    "reward-16x1-margin": (0.9739983081817627, 8.00727653503418),
    "reward-4x4-center0.01-margin": (1.3766170740127563, 11.360745429992676),
    "reward-packed-center0.01-margin": (1.3766175508499146, 11.360746383666992),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("reward-vs-trl")
    return work, bench.write_reward_model(work), *bench.write_pairs(work)


def test_the_inputs_are_the_benchmarks(inputs):
    _, model, pairs, margins = inputs
    assert bench.weights_digest(model)[:16] == MODEL
    assert hashlib.sha256(pairs.read_bytes()).hexdigest()[:16] == PAIRS
    assert hashlib.sha256(margins.read_bytes()).hexdigest()[:16] == MARGINS


def test_every_case_is_pinned():
    assert {c.name for c in bench.CASES} == set(TRL) and len(TRL) == 7


@pytest.mark.parametrize("case", bench.CASES, ids=lambda c: c.name)
def test_step_one_equals_trls(inputs, case):
    loss, grad_norm, _ = bench.ours_step(bench.write_recipe(case, *inputs))
    trl_loss, trl_grad_norm = TRL[case.name]
    assert bench.rel(loss, trl_loss) <= TOLERANCE, (loss, trl_loss)
    assert bench.rel(grad_norm, trl_grad_norm) <= TOLERANCE, (grad_norm, trl_grad_norm)


def test_the_pins_tell_settings_apart(inputs):
    """What the pins would catch: the margin and the centering each move the loss by far more than the tolerance."""
    plain = bench.ours_step(bench.write_recipe(Case(), *inputs))[0]
    assert bench.rel(plain, TRL["reward-16x1-margin"][0]) > 0.1
    assert bench.rel(plain, TRL["reward-16x1-center0.01"][0]) > 0.1


def test_the_cli_gives_trls_figures(inputs):
    """`finetune train` with train.max_steps 1: metrics.jsonl's loss and grad_norm are TRL's."""
    work, *files = inputs
    case = Case(4, 4, bench.CENTER, margin=True)
    first = first_cli_step(bench, case, work, files)
    assert bench.rel(first["loss"], TRL[case.name][0]) <= TOLERANCE and first["pairs"] == 16
    assert bench.rel(first["grad_norm"], TRL[case.name][1]) <= TOLERANCE


def test_the_whole_gradient_equals_trls(tmp_path):
    """With TRL at hand: the benchmark itself, ours and TRL's RewardTrainer side by side, every parameter's gradient
    (||ours - TRL|| / ||TRL||) within 1e-5, split 4 x 4 and packed."""
    trl_path = trl_or_skip()
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reward_vs_trl.py"), "--trl-path", trl_path,
                           "--work", str(tmp_path / "work"), "--cli", "--json", str(out), "--cases",
                           "reward-4x4-center0.01-margin", "reward-packed-center0.01-margin"],
                          cwd=ROOT, capture_output=True, text=True, env=TEST_ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2
    for row in rows:
        assert max(row["loss_rel"], row["grad_norm_rel"], row["grad_rel"]) <= TOLERANCE, row
