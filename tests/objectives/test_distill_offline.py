"""Offline distillation (distill.teacher_logprobs: FIELD; finetune/data/teacher_logprobs.py): a teacher's top-k stored
in the rows trains the same student as the same teacher's top-k online, packed or padded, in any split of the step;
the stored entries survive the token store, workers' arrays, cutting and packing in the order of the targets; and every
malformed entry is a bad row that names its row and position."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import QUICKSTART, ROOT, TINY, final_weights, rel_diff, run_cli, teacher_dir, train_lines

from finetune.data.sources import BadRow, RawRow
from finetune.data.teacher_logprobs import read_stored, trained_entries

K, TEMPERATURE, ROWS = 8, 2.0, 16
DATA = ROOT / "examples" / "data"


def _teacher_entries(model, ids: list[int]) -> list[list[dict]]:
    """vLLM's prompt log-probabilities, as Axolotl's first layout keeps them: for each token after the first, the
    teacher's top-K at TEMPERATURE of the position before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)[:-1]
    values, top = logp.topk(K, dim=-1)
    return [[{"token": f"token_id:{i}", "logprob": v} for i, v in zip(t.tolist(), x.tolist())]
            for t, x in zip(top, values)]


def _stored_copy(source, out, model, tokenizer, rows: int):
    """The first `rows` chat rows of `source` with their teacher's entries in the field "teacher"."""
    from finetune.data.samples import row_example
    from finetune.data.tokenize import tokenize_example
    from finetune.recipe import DatasetConfig

    cfg = DatasetConfig(path=str(source), format="chat")
    lines = source.read_text().splitlines()[:rows]
    with out.open("w") as f:
        for n, line in enumerate(lines):
            data = json.loads(line)
            sample = tokenize_example(row_example(RawRow(data, f"row {n}"), cfg), tokenizer)
            f.write(json.dumps({**data, "teacher": _teacher_entries(model, sample["input_ids"])}) + "\n")
    return out


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(the teacher's directory, train and eval files carrying its stored top-K)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path_factory.mktemp("offline")
    teacher = teacher_dir(base / "teacher")
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    with torch.no_grad():  # logits 40x a fresh model's: a peaked teacher, far from the near-uniform student
        model.model.norm.weight.mul_(40.0)
    model.save_pretrained(teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    train = _stored_copy(DATA / "quickstart_train.jsonl", base / "train.jsonl", model, tokenizer, ROWS)
    evals = _stored_copy(DATA / "quickstart_eval.jsonl", base / "eval.jsonl", model, tokenizer, 4)
    return teacher, train, evals


def _run(tmp_path, name: str, stored, offline: bool, *extra: str):
    teacher, train, evals = stored
    source = ["distill.teacher_logprobs=teacher"] if offline else [f"distill.teacher={teacher}"]
    run = tmp_path / name
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *TINY, "train.objective=distill", *source,
                f"distill.top_k={K}", f"distill.temperature={TEMPERATURE}", f"datasets.0.path={train}",
                f"eval_datasets.0.path={evals}", "train.max_steps=null", "train.epochs=1", "train.warmup_steps=0",
                *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.mark.parametrize("packing, online_split, offline_split", [("false", (8, 1), (2, 4)), ("true", (2, 1), (1, 2))])
def test_stored_top_k_trains_as_the_online_teacher_in_any_split(tmp_path, stored, packing, online_split,
                                                                offline_split):
    """16 rows, in two steps or more (8 rows, or 2 packed rows of 128 tokens): the online teacher in one micro-batch a step,
    the stored one in several. Each step's loss, agreement and teacher tail within 1e-5 relative, the final weights
    within 1e-5 per tensor."""
    data = [f"data.packing={packing}", "data.max_seq_len=128"]
    online = _run(tmp_path, "online", stored, False, *data, *_split(*online_split))
    offline = _run(tmp_path, "offline", stored, True, *data, *_split(*offline_split))
    want, got = train_lines(online), train_lines(offline)
    assert len(want) == len(got) >= 2
    for a, b in zip(got, want):
        for key in ("loss", "agreement", "teacher_tail"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
        assert a["tokens"] == b["tokens"] and b["teacher_tail"] > 1e-3
    ref = final_weights(online)
    for name, weight in final_weights(offline).items():
        assert rel_diff(weight, ref[name]) < 1e-5, name


def _split(micro: int, accumulation: int) -> tuple[str, str]:
    return f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accumulation}"


def test_a_top_k_over_what_is_stored_is_refused(tmp_path, stored):
    teacher, train, evals = stored
    r = run_cli("train", str(QUICKSTART), f"output_dir={tmp_path / 'r'}", *TINY, "train.objective=distill",
                "distill.teacher_logprobs=teacher", f"distill.top_k={K + 1}", f"datasets.0.path={train}",
                f"eval_datasets.0.path={evals}", "train.max_steps=1")
    assert r.returncode != 0
    assert f"distill.top_k: {K + 1}, but the datasets store {K} teacher log-probabilities per token" in r.stderr


# --- the stored entries through the data pipeline ---------------------------------------------------------------

def _sample(n: int, trained: list[int], k: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    labels = [t if t in trained else -100 for t in range(n)]
    ids = np.stack([rng.permutation(50)[:k] for _ in trained]).astype(np.int32)
    values = np.sort(np.log(rng.dirichlet(np.ones(k + 1), len(trained))[:, :k]), axis=1)[:, ::-1].astype(np.float32)
    return {"input_ids": list(range(n)), "labels": labels, "teacher_ids": ids, "teacher_logprobs": values}


def test_entries_survive_the_store_workers_cut_and_packing(tmp_path):
    from finetune.data.collate import collate
    from finetune.data.images import cut
    from finetune.data.pack import packed_row
    from finetune.data.shards import Part
    from finetune.data.stats import DataStats
    from finetune.data.store import Samples, SplitWriter
    from finetune.recipe import DataConfig

    samples = [_sample(9, [3, 4, 7], seed=1), _sample(6, [1, 2, 5], seed=2), _sample(5, [4], seed=3)]
    writer = SplitWriter(tmp_path, "train")
    writer.append(samples[0])
    Part.of(samples[1:], DataStats()).deliver(writer)  # a worker's arrays
    info = writer.close()
    assert info["teacher_k"] == 3
    back = Samples.open(tmp_path, "train", info["labels"], info)
    listed: list[dict] = []
    Part.of(samples, DataStats()).deliver(listed)
    for got in (list(back), listed):
        for a, b in zip(got, samples):
            for key in ("teacher_ids", "teacher_logprobs"):
                np.testing.assert_array_equal(a[key], b[key])
    short, _ = cut(samples[0], 5)  # keeps the trained tokens 3 and 4
    np.testing.assert_array_equal(short["teacher_ids"], samples[0]["teacher_ids"][:2])
    row = packed_row(back, [2, 0, 1], 64)
    batch = collate([row], DataConfig(packing=True, max_seq_len=64), 0)
    want = np.concatenate([samples[i]["teacher_ids"] for i in (2, 0, 1)])
    assert batch.targets == len(want)
    np.testing.assert_array_equal(batch.teacher.ids.numpy(), want)
    padded = collate([samples[1], samples[0]], DataConfig(packing=False), 0)
    np.testing.assert_array_equal(padded.teacher.logprobs.numpy(),
                                  np.concatenate([samples[1]["teacher_logprobs"], samples[0]["teacher_logprobs"]]))
    filler = collate([{**samples[0], "labels": [-100] * 9, "filler": True}], DataConfig(packing=False), 0)
    assert filler.teacher.ids.shape == (0, 3)


def _row(field, **extra) -> RawRow:
    return RawRow({"messages": [], "teacher": field, **extra}, "data.jsonl:7")


def _entries(*pairs) -> list[dict]:
    return [{"token": f"token_id:{i}", "logprob": v} for i, v in pairs]


def test_both_axolotl_layouts_read_the_same_and_align_with_the_end():
    first = read_stored("o", {"teacher": [None, _entries((5, -0.1), (3, -3.0)), _entries((2, -2.5), (9, -0.3))]},
                        "teacher")
    second = read_stored("o", {"teacher": [[], [-0.1, -3.0], [-2.5, -0.3]],
                               "target_token_ids": [[], [5, 3], [2, 9]]}, "teacher")
    labels = [-100, -100, 11, 12]  # four tokens, three positions: the first has none
    for stored in (first, second):
        got = trained_entries(stored, labels, 20, "o")
        assert got["teacher_ids"].tolist() == [[5, 3], [9, 2]]  # the second entry sorted: most likely first
        np.testing.assert_allclose(got["teacher_logprobs"], [[-0.1, -3.0], [-0.3, -2.5]], rtol=1e-6)


BAD = {
    "missing": (None, {}, "the field 'teacher' is missing"),
    "not_a_list": ("x", {}, "the field 'teacher' is a str"),
    "token_format": ([[{"token": "five", "logprob": -1.0}]], {}, "want \"token_id:N\""),
    "positive": ([_entries((1, 0.5))], {}, "a log-probability is 0.5"),
    "nan": ([_entries((1, float("nan")))], {}, "a log-probability is nan"),
    "second_without_ids": ([[-0.5]], {}, "'target_token_ids' field must list"),
    "second_ids_shape": ([[-0.5, -1.0]], {"target_token_ids": [[1]]}, "must be a list of 2 ints"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_fields_are_bad_rows(case):
    field, extra, message = BAD[case]
    data = {"teacher": field, **extra} if field is not None else dict(extra)
    with pytest.raises(BadRow, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        read_stored("data.jsonl:7", data, "teacher")
    assert "data.jsonl:7" in str(e.value)


ALIGN = {
    "too_long": ([_entries((1, -1.0))] * 5, [-100, 1, 2, 3], "has 5 positions but the row has 4 tokens"),
    "trained_without_entry": ([None, None, _entries((1, -1.0))], [-100, 5, 6], "token 1 of 3 is trained"),
    "sizes_differ": ([_entries((1, -1.0), (2, -2.0)), _entries((1, -1.0))], [-100, 5, 6], "has 1 entries"),
    "over_one": ([_entries((1, -0.1), (2, -0.2))], [-100, 5], "sum to 1.7"),
    "repeated_id": ([_entries((1, -1.0), (1, -2.0))], [-100, 5], "distinct token ids below 20"),
    "id_out_of_range": ([_entries((20, -1.0))], [-100, 5], "distinct token ids below 20"),
}


@pytest.mark.parametrize("case", list(ALIGN))
def test_entries_that_do_not_fit_the_tokens_are_bad_rows(case):
    field, labels, message = ALIGN[case]
    with pytest.raises(BadRow, match=message) as e:
        trained_entries(read_stored("data.jsonl:7", {"teacher": field}, "teacher"), labels, 20, "data.jsonl:7")
    assert "data.jsonl:7" in str(e.value)
