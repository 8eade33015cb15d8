"""Reward models (train.objective: reward): the Bradley-Terry loss on hand-computed scores, each sequence's score
read at its own last token in packed and padded rows (never a pad token), exact accumulation (finetune verify, and
a short last micro-batch), and a real run through the CLI: train, eval, the saved model in transformers, LoRA and
merge, and the model as a GRPO reward."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from helpers import QUICKSTART, ROOT, TINY, eval_lines, example_after_quickstart, run_cli, train_lines

from finetune.batch import MicroBatch
from finetune.data.collate import collate
from finetune.data.pack import packed_row
from finetune.data.pairs import pair_sample
from finetune.model.with_score import SequenceScorer, last_positions
from finetune.objectives.pair_losses import bradley_terry_losses
from finetune.objectives.reward import Reward, pair_scores
from finetune.recipe import DataConfig, load_recipe

DATA = ROOT / "examples" / "data"
PREF = [f"datasets.0.path={DATA / 'quickstart_pref_train.jsonl'}", "datasets.0.format=preference",
        f"eval_datasets.0.path={DATA / 'quickstart_pref_eval.jsonl'}", "eval_datasets.0.format=preference",
        "train.objective=reward"]


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


# --- the loss ----------------------------------------------------------------------------------------------------

def test_bradley_terry_on_hand_computed_scores():
    """-log sigmoid(r_c - r_r - margin) + c (r_c + r_r)^2, per pair."""
    plain = bradley_terry_losses(_t(1.5, -0.5), _t(0.5, 0.5))
    assert plain.tolist() == pytest.approx([math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0))], rel=1e-12)
    margin = bradley_terry_losses(_t(1.5), _t(0.5), _t(0.25))  # -log sigmoid(0.75)
    assert float(margin) == pytest.approx(0.38687100611489994, rel=1e-12)
    centered = bradley_terry_losses(_t(1.5), _t(0.5), _t(0.25), center_coefficient=0.01)  # + 0.01 x 2^2
    assert float(centered) == pytest.approx(0.38687100611489994 + 0.04, rel=1e-12)
    assert float(bradley_terry_losses(_t(0.3), _t(0.3))) == pytest.approx(math.log(2), rel=1e-12)


# --- which token is scored -----------------------------------------------------------------------------------------

PAD = 999  # a token id no sequence below holds: any score of it would be a pad position's


def _pairs(seed: int = 0, n: int = 5, end_with: int | None = None) -> list[dict]:
    """n pair samples of random ids 3..500, sides of 2 to 12 tokens, each side's last token scored; `end_with`:
    every side's last token."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        sides = []
        for _side in range(2):
            ids = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 13))]
            if end_with is not None:
                ids[-1] = end_with
            sides.append({"input_ids": ids, "labels": [-100] * (len(ids) - 1) + [ids[-1]]})
        samples.append(pair_sample(*sides))
    return samples


def _batches(samples: list[dict], pad: int) -> dict[str, MicroBatch]:
    """The same pairs collated padded (two rows each) and packed (two rows of whole pairs)."""
    half = (len(samples) + 1) // 2
    rows = [packed_row(samples, range(0, half), 256), packed_row(samples, range(half, len(samples)), 256)]
    return {"padded": collate(samples, DataConfig(packing=False), pad),
            "packed": collate(rows, DataConfig(packing=True, max_seq_len=256), pad)}


def _last_ids(samples: list[dict]) -> list[int]:
    return [s["input_ids"][sum(s["docs"][:k + 1]) - 1] for s in samples for k in range(2)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_each_sequence_is_scored_at_its_own_last_token_never_a_pad(layout):
    """A stand-in model whose score is the token id at the position read: every side's own last token comes back,
    chosen then rejected per pair, and never the pad id that fills the rest of the rows."""
    samples = _pairs()
    batch = _batches(samples, PAD)[layout]
    assert (batch.input_ids == PAD).any()  # there is padding to be wrong about

    def read_id(input_ids, ends, **ignored):
        return input_ids.reshape(-1).index_select(0, ends).float()

    chosen, rejected = pair_scores(read_id, batch, torch.device("cpu"))
    got = torch.stack([chosen, rejected], 1).reshape(-1).long().tolist()
    assert got == _last_ids(samples) and PAD not in got


def test_last_positions_skip_padding_anywhere():
    doc_index = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [2, 2, 3, 3, 3, 3, -1]])
    assert last_positions(doc_index, 4).tolist() == [2, 4, 8, 12]
    assert last_positions(torch.full((2, 3), -1), 0).tolist() == []  # a filler: nothing read


@pytest.fixture(scope="module")
def scorer():
    """A tiny random-init LlamaForSequenceClassification (one label, pad id 0) loaded as a reward run loads it: our
    packed attention, in a SequenceScorer."""
    from conftest import TINY_MODEL_CONFIG

    from finetune.model.loading import load_model
    from finetune.model.tokenizer import load_tokenizer
    from finetune.recipe import AdapterConfig, ModelConfig, TokenizerConfig

    tokenizer = load_tokenizer(TokenizerConfig(path=str(ROOT / "examples" / "tokenizer")), ModelConfig())
    cfg = ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG))
    lm = load_model(cfg, AdapterConfig(), tokenizer, 0, score_head=True).eval()
    assert type(lm).__name__ == "LlamaForSequenceClassification" and lm.config.pad_token_id == tokenizer.pad_token_id
    return SequenceScorer(lm)


def _alone(net: SequenceScorer, ids: list[int]) -> float:
    """A sequence scored by itself, no padding: the head at its last hidden state."""
    backbone, head = net._layers
    hidden = backbone(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state
    return float(head(hidden[0, -1]))


@torch.no_grad()
def test_packed_and_padded_rows_score_each_sequence_as_alone(scorer):
    """The real model: packed rows and padded rows give every side the score it has alone (1e-5), and the
    objective's loss term is the Bradley-Terry sum of those scores."""
    samples = _pairs(seed=1, n=6)
    alone = [_alone(scorer, s["input_ids"][a:b]) for s in samples
             for a, b in ((0, s["docs"][0]), (s["docs"][0], sum(s["docs"])))]
    for layout, batch in _batches(samples, 0).items():
        chosen, rejected = pair_scores(scorer, batch, torch.device("cpu"))
        got = torch.stack([chosen, rejected], 1).reshape(-1)
        assert torch.allclose(got, torch.tensor(alone), rtol=1e-5, atol=1e-6), (layout, got, alone)
        result = Reward(center_coefficient=0.01).forward(scorer, batch, torch.device("cpu"))
        expected = bradley_terry_losses(chosen.double(), rejected.double(), center_coefficient=0.01).sum()
        assert float(result.terms["pairs"]) == pytest.approx(float(expected), rel=1e-6)
        assert float(result.metrics["reward_accuracy"]) == float((chosen > rejected).sum())


@torch.no_grad()
def test_a_sequence_ending_in_the_pad_id_is_still_read_at_its_end(scorer):
    """transformers #35352: its own forward reads "the rightmost token that is not the pad id", so a sequence whose
    last token is the pad id (a pad that is also the eos) is scored one token early there. Ours reads each side's
    last token from the batch's documents, in padded and packed rows."""
    pad = scorer.lm.config.pad_token_id
    samples = _pairs(seed=2, n=3, end_with=pad)
    ids = samples[0]["input_ids"][:samples[0]["docs"][0]]
    true = _alone(scorer, ids)
    theirs = float(scorer.lm(input_ids=torch.tensor([ids]), use_cache=False).logits)
    assert abs(theirs - true) > 1e-4  # transformers' own pooling read another token
    for batch in _batches(samples, pad).values():
        assert float(pair_scores(scorer, batch, torch.device("cpu"))[0][0]) == pytest.approx(true, rel=1e-5)


# --- margins through the data cache --------------------------------------------------------------------------------

@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_rows_margin_reaches_its_pair_through_the_cache(num_proc, tmp_path):
    """A row's `margin` rides with its pair sample through tokenization (in one process and in workers), the token
    store and collation; a row without one has none (0 in the batch); a margin that is not a number is a bad row."""
    from finetune.data.cache import prepare
    from finetune.errors import UserError
    from finetune.model.tokenizer import load_tokenizer

    rows = [json.loads(x) for x in (DATA / "quickstart_pref_train.jsonl").read_text().splitlines()[:300]]
    margins = [None if i % 4 == 3 else 0.25 * i for i in range(len(rows))]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r if m is None else {**r, "margin": m}) + "\n" for r, m in zip(rows, margins)))
    recipe = _recipe(f"datasets.0.path={path}", "datasets.0.max_rows=null", "data.max_seq_len=2048",
                     f"data.num_proc={num_proc}", f"data.cache_dir={tmp_path / 'cache'}", "data.shuffle=false",
                     "data.deduplicate=none")
    tokenizer = load_tokenizer(recipe.tokenizer, recipe.model)
    for _ in range(2):  # written, then read back from the cache
        train = prepare(recipe, tokenizer).train
        assert len(train) == len(rows) and [s.get("margin") for s in train] == margins
    batch = collate(list(train[:4]), DataConfig(packing=False), 0)
    assert batch.pairs.margins.tolist() == [0.0, 0.25, 0.5, 0.0]
    path.write_text(json.dumps({**rows[0], "margin": "high"}) + "\n")
    with pytest.raises(UserError, match="pairs.jsonl:1: 'margin' must be a finite number"):
        prepare(_recipe(f"datasets.0.path={path}", f"data.cache_dir={tmp_path / 'cache'}"), tokenizer)


# --- exact accumulation ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def margin_pairs(tmp_path_factory):
    """96 quickstart pairs, each with a margin field (0, 0.5, 1.0 in turn)."""
    rows = [json.loads(x) for x in (DATA / "quickstart_pref_train.jsonl").read_text().splitlines()[:96]]
    path = tmp_path_factory.mktemp("margins") / "pairs.jsonl"
    path.write_text("".join(json.dumps({**r, "margin": 0.5 * (i % 3)}) + "\n" for i, r in enumerate(rows)))
    return path


def _recipe(*extra):
    return load_recipe(QUICKSTART, [*TINY, *PREF, "datasets.0.max_rows=96", "eval_datasets.0.max_rows=16",
                                    "data.packing_check=false", *extra])


@pytest.mark.parametrize("packing", [True, False])
def test_gradient_accumulation_and_ranks_are_exact(packing, margin_pairs):
    """The first step's gradient, split 2 ranks x 2 micro-batches x 3 rows, with margins and centering, equals one
    batch of all its pairs within verify's float32 tolerance; packed rows hold varying numbers of pairs, so the
    naive mean of micro-batch means does not."""
    from finetune.commands.verify import verify

    recipe = _recipe(f"datasets.0.path={margin_pairs}", f"data.packing={packing}", "train.micro_batch_size=3",
                     "train.gradient_accumulation_steps=2", "reward.center_coefficient=0.01")
    result = verify(recipe, world_size=2)
    assert result.unit == "pairs" and result.targets > 0
    assert result.passed and result.tolerance == 1e-5, result.groups
    if packing:
        assert result.naive_max > 1e-3, result.groups


def test_a_short_last_micro_batch_is_exact(margin_pairs):
    """7 pairs as micro-batches of 3, 3 and 1 give one batch's gradient: each over the step's 7 pairs."""
    from finetune import dist
    from finetune.train.parts import load_parts
    from finetune.train.step import forward_backward, step_counts

    recipe = _recipe(f"datasets.0.path={margin_pairs}", "data.packing=false", "reward.center_coefficient=0.01")
    world, device = dist.World(), torch.device("cpu")
    parts = load_parts(recipe, world, device, lambda m: None, splits=("train",))
    rows = list(parts.train[:7])
    assert any("margin" in r and r["margin"] for r in rows)

    def gradient(chunks: list[list[dict]]) -> torch.Tensor:
        parts.lm.zero_grad(set_to_none=True)
        micro = [collate(c, recipe.data, parts.tokenizer.pad_token_id).to(device) for c in chunks]
        counts = step_counts(parts.objective, micro, world, device)[0]
        assert counts["pairs"] == 7
        forward_backward(parts.net, parts.objective, micro, counts, world, device)
        return torch.cat([p.grad.reshape(-1) for p in parts.lm.parameters() if p.grad is not None])

    parts.lm.eval()
    whole, split = gradient([rows]), gradient([rows[:3], rows[3:6], rows[6:]])
    assert float((split - whole).abs().max() / whole.abs().max()) < 1e-5


# --- through the CLI -----------------------------------------------------------------------------------------------

def _score(path, prompt: str, completion: str) -> float:
    from finetune.rl.rewards import BUILT_INS

    return BUILT_INS["reward_model"]([prompt], [completion], path=str(path))[0]


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("reward") / "run"
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *TINY, *PREF, "datasets.0.max_rows=64",
                "eval_datasets.0.max_rows=16", "train.max_steps=4", "train.lr=3e-3", "eval.at_start=true",
                "eval.every_steps=4", "reward.center_coefficient=0.01")
    assert r.returncode == 0, r.stderr[-3000:]
    return run, r


def test_a_reward_run_trains_evaluates_and_saves_a_transformers_classifier(reward_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    run, r = reward_run
    assert "loss: bradley-terry on a score head" in r.stdout
    steps, evals = train_lines(run), eval_lines(run)
    assert {"reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected", "pairs"} <= set(steps[0])
    assert 0.6 < evals[0]["eval_loss"] < 0.8 and evals[0]["eval_pairs"] > 10  # about log 2 at a fresh head
    # `finetune eval RUN`: the final eval again, with the pairwise accuracy.
    evaluated = run_cli("eval", str(run))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    loss = float(re.search(r"eval_loss ([0-9.]+)", evaluated.stdout).group(1))
    accuracy = float(re.search(r"reward_accuracy ([0-9.]+)", evaluated.stdout).group(1))
    assert loss == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)
    assert accuracy == pytest.approx(evals[-1]["eval_reward_accuracy"], abs=1e-9)
    # final/ is a standard LlamaForSequenceClassification; its score of a conversation is the reward's.
    model = AutoModelForSequenceClassification.from_pretrained(run / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    chat = [{"role": "user", "content": "What is 2 * 5?"}, {"role": "assistant", "content": "10"}]
    ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        theirs = float(model(**ids).logits)
    assert _score(run, "What is 2 * 5?", "10") == pytest.approx(theirs, rel=1e-5)
    refused = run_cli("generate", str(run), "--prompt", "hi")
    assert refused.returncode == 2 and "a reward model" in refused.stderr


def test_a_lora_reward_model_trains_its_head_and_merges(tmp_path):
    run = tmp_path / "lora"
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *TINY, *PREF, "adapter.type=lora",
                "datasets.0.max_rows=32", "eval_datasets.0.max_rows=8", "train.max_steps=2", "train.lr=1e-2")
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((run / "final" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    merged = run_cli("merge", str(run))
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert json.loads((run / "merged" / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"]
    assert _score(run / "merged", "What is 3 * 11?", "33") == pytest.approx(_score(run, "What is 3 * 11?", "33"),
                                                                              rel=1e-5)


def test_a_reward_model_scores_grpo_completions(reward_run, tmp_path):
    """grpo.rewards: [{function: reward_model, args: {path: RUN}}] trains a step, its rewards the model's scores."""
    from grpo_files import write_prompts

    run, _ = reward_run
    prompts = write_prompts(tmp_path / "p.jsonl", 4, 1)
    r = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'grpo'}", *TINY, "data.packing=false",
                "train.objective=grpo", f"datasets.0.path={prompts}", "datasets.0.format=prompt", "eval_datasets=[]",
                "grpo.num_generations=2", "grpo.max_new_tokens=3",
                f"grpo.rewards=[{{function: reward_model, args: {{path: '{run}'}}}}]", "train.micro_batch_size=2",
                "train.gradient_accumulation_steps=2", "train.max_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    line = train_lines(tmp_path / "grpo")[0]
    assert math.isfinite(line["reward"]) and line["reward"] != 0.0


def test_reward_recipes_are_checked():
    from finetune.errors import UserError

    with pytest.raises(UserError, match="datasets.0.format: train.objective reward trains on pairs"):
        load_recipe(QUICKSTART, ["train.objective=reward"])
    with pytest.raises(UserError, match="reward.center_coefficient: only for train.objective: reward"):
        load_recipe(QUICKSTART, ["reward.center_coefficient=0.1"])
    with pytest.raises(UserError, match="loss.impl: liger computes token losses"):
        load_recipe(QUICKSTART, [*PREF, "loss.impl=liger"])
    with pytest.raises(UserError, match="grpo.rewards.0.args.path: required, but missing"):
        load_recipe(QUICKSTART, ["train.objective=grpo", "datasets.0.format=prompt", "data.packing=false",
                                 "grpo.rewards=[{function: reward_model}]"])


@pytest.mark.slow
def test_the_reward_example_ranks_past_0_85_after_the_quickstart(tmp_path):
    """examples/yaml/quickstart-reward.yaml after the quickstart's SFT: eval reward accuracy >= 0.85 at the end
    (README: 0.90 after its 30 steps), the final model a sequence classifier."""
    run = example_after_quickstart("quickstart-reward", tmp_path)
    evals = eval_lines(run)
    assert evals[-1]["eval_reward_accuracy"] >= 0.85 and evals[-1]["eval_pairs"] == 100, evals
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
