"""Preference training (train.objective dpo and orpo): the per-pair formulas on hand-computed values, exact
accumulation on the user's own first step (finetune verify), and real runs through the CLI."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import (
    QUICKSTART,
    ROOT,
    TINY,
    assert_resume_checks_reference_weights,
    eval_lines,
    example_after_quickstart,
    run_cli,
    train_lines,
)

from finetune.objectives.pair_losses import dpo_losses, orpo_log_odds, orpo_ratio_losses
from finetune.recipe import load_recipe

DATA = ROOT / "examples" / "data"
PREF = [f"datasets.0.path={DATA / 'quickstart_pref_train.jsonl'}", "datasets.0.format=preference",
        f"eval_datasets.0.path={DATA / 'quickstart_pref_eval.jsonl'}", "eval_datasets.0.format=preference"]


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


# beta 0.1; policy chosen -10, rejected -12; reference -11 both; 4 and 8 completion tokens: margin D = 2.
@pytest.mark.parametrize(("kind", "smoothing", "expected"), [
    ("sigmoid", 0.0, math.log1p(math.exp(-0.2))),  # -log sigmoid(0.2) = 0.5981388693815918
    ("sigmoid", 0.1, 0.6181388693815918),  # conservative DPO
    ("hinge", 0.0, 0.8),
    ("ipo", 0.0, (0.25 + 0.125 - 5.0) ** 2),  # ((1/4) - (-1/8) - 1/(2 x 0.1))^2 = 21.390625
])
def test_dpo_losses_on_hand_computed_values(kind, smoothing, expected):
    loss = dpo_losses(_t(-10), _t(-12), _t(-11), _t(-11), _t(4), _t(8), beta=0.1, kind=kind,
                      label_smoothing=smoothing)
    assert float(loss) == pytest.approx(expected, rel=1e-12)


def test_at_the_reference_the_losses_are_known_constants():
    same = _t(-7.5, -3.0)
    for kind, value in (("sigmoid", math.log(2)), ("hinge", 1.0), ("ipo", 1 / (4 * 0.1 ** 2))):
        losses = dpo_losses(same, same, same, same, _t(3, 4), _t(3, 4), beta=0.1, kind=kind)
        assert torch.allclose(losses, torch.full_like(losses, value))


def test_orpo_on_hand_computed_values():
    log_odds = orpo_log_odds(_t(-10.0), _t(-12.0), _t(4), _t(8))  # mean log-probs -2.5 and -1.5
    assert float(log_odds) == pytest.approx(-1.1668319751834157, rel=1e-12)
    assert float(orpo_ratio_losses(log_odds)) == pytest.approx(1.4378904510435508, rel=1e-12)
    certain = orpo_log_odds(_t(0.0), _t(-1.0), _t(3), _t(3))  # p = 1 rounds to a finite log odds
    assert torch.isfinite(certain).all()


def _recipe(*extra):
    return load_recipe(QUICKSTART, [*TINY, *PREF, "datasets.0.max_rows=96", "eval_datasets.0.max_rows=16",
                                    "data.packing_check=false", *extra])


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
@pytest.mark.parametrize("packing", [True, False])
def test_gradient_accumulation_and_ranks_are_exact(objective, packing):
    """The first step's gradient, split 2 ranks x 2 micro-batches x 3 rows, equals one batch of all its rows
    within verify's float32 tolerance (1e-5 relative); each micro-batch's own mean divided by their number (the
    naive scheme) does not."""
    from finetune.commands.verify import verify

    recipe = _recipe(f"train.objective={objective}", f"data.packing={packing}", "train.micro_batch_size=3",
                     "train.gradient_accumulation_steps=2", "dpo.loss=sigmoid")
    result = verify(recipe, world_size=2)
    assert result.unit == ("pairs" if objective == "dpo" else "chosen_tokens") and result.targets > 0
    assert result.passed and result.tolerance == 1e-5, result.groups
    if objective == "dpo" and not packing:
        # Padded, every micro-batch holds 3 pairs: then (and only then) the naive mean of means is exact too.
        assert result.naive_max < 1e-5
    else:  # packed rows hold varying numbers of pairs, and ORPO's cross-entropy is per token: the check has power
        assert result.naive_max > 1e-3, result.groups


@pytest.mark.parametrize("loss", ["ipo", "hinge"])
def test_other_dpo_losses_are_exact_too(loss):
    from finetune.commands.verify import verify

    recipe = _recipe("train.objective=dpo", f"dpo.loss={loss}", "train.micro_batch_size=2",
                     "train.gradient_accumulation_steps=3")
    assert verify(recipe, world_size=1).passed


def test_dpo_run_starts_at_log_2_learns_and_reuses_its_reference(tmp_path):
    args = ["train", str(QUICKSTART), *TINY, *PREF, "train.objective=dpo", "datasets.0.max_rows=200",
            "eval_datasets.0.max_rows=40", "train.max_steps=8", "train.warmup_steps=0", "train.lr=3e-3",
            "eval.at_start=true"]
    r = run_cli(*args, f"output_dir={tmp_path / 'a'}")
    assert r.returncode == 0, r.stderr[-3000:]
    computed = re.search(r"reference log-probabilities computed for (\d+) pairs", r.stdout)
    assert computed and 200 < int(computed.group(1)) <= 240  # pairs too long for max_seq_len 256 are dropped
    steps, evals = train_lines(tmp_path / "a"), eval_lines(tmp_path / "a")
    # The policy is the reference before the first update: every pair loss is log 2, every reward 0.
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(steps[0]["reward_margin"]) < 1e-5 and steps[0]["pairs"] > 0
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6) and 30 < evals[0]["eval_pairs"] <= 40
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] and evals[-1]["eval_reward_margin"] > 0
    # `finetune eval RUN` reloads the trained model and, as its reference, the initial one: the final eval again.
    evaluated = run_cli("eval", str(tmp_path / "a"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    loss = float(re.search(r"eval_loss ([0-9.]+)", evaluated.stdout).group(1))
    assert loss == pytest.approx(evals[-1]["eval_loss"], rel=1e-5) and "pairs" in evaluated.stdout
    again = run_cli(*args, f"output_dir={tmp_path / 'b'}")
    assert again.returncode == 0 and "reference log-probabilities reused from" in again.stdout
    assert train_lines(tmp_path / "b")[-1]["loss"] == steps[-1]["loss"]


def test_lora_dpo_uses_the_base_as_reference_and_orpo_needs_none(tmp_path):
    lora = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'lora'}", *TINY, *PREF, "train.objective=dpo",
                   "adapter.type=lora", "datasets.0.max_rows=64", "eval_datasets.0.max_rows=8", "train.max_steps=2")
    assert lora.returncode == 0, lora.stderr[-3000:]
    assert train_lines(tmp_path / "lora")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    orpo = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'orpo'}", *TINY, *PREF, "train.objective=orpo",
                   "datasets.0.max_rows=64", "eval_datasets.0.max_rows=8", "train.max_steps=3", "train.lr=3e-3")
    assert orpo.returncode == 0, orpo.stderr[-3000:]
    assert "reference log-probabilities" not in orpo.stdout
    lines = train_lines(tmp_path / "orpo")
    assert {"nll_loss", "or_loss", "log_odds", "chosen_tokens", "pairs"} <= set(lines[0])
    # The loss is the chosen tokens' cross-entropy plus beta x the odds-ratio term, both over the step.
    assert lines[0]["loss"] == pytest.approx(lines[0]["nll_loss"] + 0.1 * lines[0]["or_loss"], rel=1e-6)


def test_preference_recipes_are_checked(write_recipe):
    from finetune.errors import UserError

    for extra, message in ((["train.objective=dpo", "datasets.0.format=chat"], "use format: preference"),
                           ([*PREF], "preference data needs train.objective: dpo, orpo or reward"),
                           ([*PREF, "train.objective=dpo", "dpo.loss=ipo", "dpo.label_smoothing=0.1"],
                            "only for dpo.loss: sigmoid"),
                           ([*PREF, "train.objective=orpo", "loss.z_loss=0.1"], "loss.z_loss: not with")):
        with pytest.raises(UserError, match=message):
            load_recipe(QUICKSTART, extra)


def test_a_reference_replaced_at_its_path_is_computed_again(tmp_path):
    """dpo.reference: PATH is cached by the weights found there, not by the path: change one weight of the model
    at PATH and the reference log-probabilities are computed again (a stale reference would be reused)."""
    from safetensors.torch import load_file, save_file

    from finetune.data import build_samples
    from finetune.model.loading import load_model
    from finetune.model.tokenizer import load_tokenizer
    from finetune.objectives.reference import attach_reference_logps

    base = _recipe("train.objective=dpo", f"data.cache_dir={tmp_path / 'cache'}", "datasets.0.max_rows=8",
                   "eval_datasets.0.max_rows=4")
    tokenizer = load_tokenizer(base.tokenizer, base.model)
    ref_dir = tmp_path / "reference"
    load_model(base.model, base.adapter, tokenizer, 7, "cpu").save_pretrained(ref_dir)
    recipe = _recipe("train.objective=dpo", f"data.cache_dir={tmp_path / 'cache'}", "datasets.0.max_rows=8",
                     "eval_datasets.0.max_rows=4", f"dpo.reference={ref_dir}")
    samples = build_samples(recipe, tokenizer)[0]
    policy = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, "cpu")

    def attach() -> tuple[str, list]:
        said: list[str] = []
        attach_reference_logps(recipe, {"train": samples}, policy, tokenizer, "chunked", torch.device("cpu"),
                               samples_key="k" * 64, fresh_model=True, say=said.append)
        return said[0], [s["ref_logps"] for s in samples]

    first, logps = attach()
    again, same = attach()
    assert "computed" in first and "reused" in again and same == logps
    weights = load_file(str(ref_dir / "model.safetensors"))
    name = next(n for n in weights if "layers.0.mlp.down_proj" in n)
    weights[name][0, 0] += 0.5  # one weight of one layer
    save_file(weights, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    changed, new_logps = attach()
    assert "computed" in changed, changed
    assert new_logps != logps


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_a_pair_dropped_as_too_long_is_named_fresh_and_from_the_cache(truncation, tmp_path):
    """A pair that does not fit data.max_seq_len is named by its file:line, as a bad row is: in the stats, the run
    log's data lines and `finetune preprocess`, whether the samples were tokenized now or read from the cache."""
    import io
    import json

    from conftest import tiny_recipe
    from rich.console import Console

    from finetune import dist
    from finetune.data.report import preprocess
    from finetune.model.tokenizer import load_tokenizer
    from finetune.objectives.rows import DatasetRows
    from finetune.recipe import validate

    def pair(prompt: str, chosen: str) -> dict:
        return {"prompt": prompt, "chosen": chosen, "rejected": "no."}

    rows = [pair("Hi?", "Hello."), pair("Hi?", "Hello. " + "word " * 60),  # line 2: fits only if cut
            pair("word " * 80, "Yes."), pair("Bye?", "Bye.")]  # line 3: its prompt alone is over the limit
    data = tmp_path / "pref.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    raw = tiny_recipe(tmp_path / "out", data, fmt="preference")
    raw["train"]["objective"] = "dpo"
    raw["data"].update(max_seq_len=48, truncation=truncation, cache_dir=str(tmp_path / "cache"))
    recipe = validate(raw)
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    expected = [f"{data}:3: pair of "]
    if truncation == "drop":
        expected.insert(0, f"{data}:2: pair of ")
    for hit in (False, True):
        said: list[str] = []
        prepared = DatasetRows().samples(recipe, tokenizer, dist.World(), said.append)
        stats = prepared.train_stats
        assert prepared.hit is hit, prepared.note
        assert stats.dropped_too_long == len(expected) and stats.samples == 4 - len(expected)
        assert f"{len(expected)} dropped (too long)" in said[1]
        logged = [line for line in said if line.startswith("  dropped: ")]
        out = io.StringIO()
        preprocess(recipe, tokenizer, console=Console(file=out, width=200, soft_wrap=True))  # as the CLI prints
        reported = [line for line in out.getvalue().splitlines() if line.startswith("  dropped: ")]
        for lines in (logged, reported):
            assert [line[:len(x) + 11] for line, x in zip(lines, expected)] == [f"  dropped: {x}" for x in expected]
            assert len(lines) == len(expected) and "over data.max_seq_len 48" in lines[-1], lines
        assert logged == reported == [f"  dropped: {e}" for e in stats.dropped_examples]


@pytest.mark.parametrize("packing", [True, False])
def test_orpo_over_the_whole_chosen_sequence_is_exact_too(packing):
    """orpo.nll: sequence (TRL's ORPOTrainer: the prompt's tokens in the cross-entropy) normalized by the step's
    chosen-sequence tokens: any split gives one batch's gradient, and that count is the chosen sides' tokens but
    their first, more than the completions' alone."""
    from finetune.commands.verify import verify

    recipe = _recipe("train.objective=orpo", "orpo.nll=sequence", "orpo.completion_end=template",
                     f"data.packing={packing}", "train.micro_batch_size=3", "train.gradient_accumulation_steps=2")
    completion = verify(_recipe("train.objective=orpo", f"data.packing={packing}", "train.micro_batch_size=3",
                                "train.gradient_accumulation_steps=2"), world_size=2)
    result = verify(recipe, world_size=2)
    assert result.unit == "chosen_tokens" and result.passed and result.tolerance == 1e-5, result.groups
    assert result.targets > 2 * completion.targets  # the prompts are most of each side here


def test_a_resume_refuses_a_dpo_reference_whose_weights_changed(tmp_path):
    """dpo.reference: PATH is recorded by its weights' digest in each checkpoint (as grpo.reference's): one weight
    changed at the path between the run and its resume -> exit 2 naming dpo.reference, nothing trained (the
    reference log-probabilities would silently be those of other weights); the same weights at another path
    resume."""
    import json

    from finetune.model.digest import weights_digest
    from finetune.model.loading import load_model
    from finetune.model.tokenizer import load_tokenizer

    base = _recipe("train.objective=dpo")
    reference = tmp_path / "reference"
    model = load_model(base.model, base.adapter, load_tokenizer(base.tokenizer, base.model), 7, "cpu")
    model.save_pretrained(reference)
    run = tmp_path / "run"
    args = ["train", str(QUICKSTART), *TINY, *PREF, "train.objective=dpo", "datasets.0.max_rows=32",
            "eval_datasets.0.max_rows=4", "train.micro_batch_size=4", "train.max_steps=2", "checkpoint.every_steps=1",
            f"output_dir={run}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert run_cli(*args, f"dpo.reference={reference}").returncode == 0
    state = json.loads((run / "checkpoints" / "step-1" / "trainer_state.json").read_text())
    assert state["reference_digest"] == weights_digest(model)
    assert_resume_checks_reference_weights(args, run, reference, "dpo.reference", tmp_path / "reference-moved")


def test_dpo_auto_without_an_adapter_gives_checkpoints_the_digest_of_model_path(tmp_path):
    """dpo.reference: auto without an adapter is the model at model.path as loaded; a resume (the policy from its
    checkpoint) loads it from there again, so its digest goes into each checkpoint: the same weights give the same
    digest on resume, one weight changed at model.path another (check_resume_recipe then refuses, naming model.path:
    tests/run/test_checkpoint.py). With an adapter the reference is the frozen base, which frozen_digest records."""
    from safetensors.torch import load_file, save_file

    from finetune.data import build_samples
    from finetune.model.digest import weights_digest
    from finetune.model.loading import load_model
    from finetune.model.tokenizer import load_tokenizer
    from finetune.objectives.reference import attach_reference_logps

    keys = ("train.objective=dpo", f"data.cache_dir={tmp_path / 'cache'}", "datasets.0.max_rows=8",
            "eval_datasets.0.max_rows=4")
    base = _recipe(*keys)
    tokenizer = load_tokenizer(base.tokenizer, base.model)
    start = tmp_path / "start"
    load_model(base.model, base.adapter, tokenizer, 7, "cpu").save_pretrained(start)
    recipe = _recipe(*keys, f"model.path={start}", "model.init=pretrained", "model.config=null")
    samples = build_samples(recipe, tokenizer)[0]

    def digest(recipe, fresh: bool) -> str | None:
        policy = load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, "cpu")
        return attach_reference_logps(recipe, {"train": samples}, policy, tokenizer, "chunked", torch.device("cpu"),
                                      samples_key="k" * 64, fresh_model=fresh, say=lambda _: None)

    first = digest(recipe, fresh=True)
    assert first == weights_digest(load_model(recipe.model, recipe.adapter, tokenizer, recipe.seed, "cpu"))
    assert digest(recipe, fresh=False) == first
    weights = load_file(str(start / "model.safetensors"))
    weights[sorted(weights)[0]].view(-1)[0] += 1e-3
    save_file(weights, str(start / "model.safetensors"), metadata={"format": "pt"})
    assert digest(recipe, fresh=False) not in (None, first)
    assert digest(_recipe(*keys, "adapter.type=lora"), fresh=True) is None


@pytest.mark.slow
def test_the_dpo_example_learns_past_0_9_after_the_quickstart(tmp_path):
    """examples/yaml/quickstart-dpo.yaml's two commands (the quickstart's SFT, then DPO from its model): eval
    reward accuracy starts at 0 (the policy is the reference) and ends at >= 0.9 (README: 1.00 from step 5)."""
    evals = eval_lines(example_after_quickstart("quickstart-dpo", tmp_path))
    assert evals[0]["eval_reward_accuracy"] < 0.5 and evals[0]["eval_pairs"] == 100
    assert evals[-1]["eval_reward_accuracy"] >= 0.9, evals
