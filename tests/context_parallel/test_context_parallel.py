"""Context parallelism end to end (distributed.context_parallel; finetune/context_parallel/): each row split across
ranks trains as one process does (Mistral with a sliding window, Qwen2), packed (gradient checkpointing, LoRA) and
padded, a short last step included, alone (CP 2, FSDP2) and with data parallelism (DP 2 x CP 2, four gloo ranks,
DDP), packed documents checked isolated across the cut at start; DPO (packed), ORPO (padded, FSDP2) and distillation
(on-policy steps included) too: every step's loss and grad norm within 1e-5, the final weights within 1e-5 per
tensor. And the splitting itself: labels shifted once, on the whole rows (verl #6068), each target on
exactly one rank (no position split twice: Axolotl #3498), the documents those of the whole rows (TRL #6843)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    QUICKSTART,
    ROOT,
    TINY,
    assert_same_steps,
    final_weights,
    rel_diff,
    run_cli,
    run_ranks,
    teacher_dir,
    train_lines,
)

from finetune.batch import find_targets
from finetune.context_parallel.shard import ContextGroup, held_positions, shard_batch
from finetune.data import collate
from finetune.recipe import DataConfig

pytestmark = pytest.mark.dist
DATA = ROOT / "examples" / "data"

PACKED = [*TINY, "train.max_steps=3"]
# 10 padded rows in steps of 4: the last step has 2
SHORT = [*TINY, "datasets.0.max_rows=10", "data.packing=false", "train.max_steps=null", "train.epochs=1"]


def _torchrun(nproc: int, *args: str):
    return run_ranks(nproc, *args, env={"FINETUNE_DEVICE": "cpu"})


def _same(run, ref, weight_tolerance: float) -> None:
    """LoRA's B starts at 0, so AdamW's first steps move an entry by about lr * sign(g) whatever its size: one whose
    gradient is float noise shows the ranks' summation order in the weights (tests/train/test_distributed.py's
    tolerance for it, 5e-5)."""
    assert_same_steps(train_lines(run), train_lines(ref), equal=("tokens", "seq_tokens"))
    got, want = final_weights(run), final_weights(ref)
    assert set(got) == set(want)
    for name in want:
        assert rel_diff(got[name], want[name]) <= weight_tolerance, name


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, teacher):
    """The reference runs, in one process at 4 x 1, made when first asked for."""
    made: dict[str, object] = {}

    def run(case: str):
        if case not in made:
            ref = tmp_path_factory.mktemp(f"one-{case}")
            r = run_cli("train", str(QUICKSTART), f"output_dir={ref}", *_args(case, teacher), "train.micro_batch_size=4",
                        "train.gradient_accumulation_steps=1")
            assert r.returncode == 0, r.stderr[-3000:]
            made[case] = ref
        return made[case]

    return run


# Mistral with a sliding window shorter than the rows (the window is kept across the cut: each rank attends over whole
# rows), padded, a short last step; Qwen2 packed, with a LoRA adapter and gradient checkpointing.
# DPO packed (a pair's two sides and the rows' other pairs cut across the ranks: each side's log-probability summed
# over the group, its loss counted once); ORPO padded (its per-token NLL split as SFT's, its odds-ratio term whole).
PREFERENCE = [f"datasets.0.path={DATA / 'quickstart_pref_train.jsonl'}", "datasets.0.format=preference",
              "datasets.0.max_rows=40", "eval_datasets=[]"]
CASES = {"short": [*SHORT, "model.config.model_type=mistral", "model.config.sliding_window=16"],
         "lora": [*PACKED, "model.config.model_type=qwen2", "adapter.type=lora", "train.lr=1e-2",
                  "model.gradient_checkpointing=true"],
         "dpo": [*PACKED, *PREFERENCE, "train.objective=dpo"],
         "orpo": [*PACKED, *PREFERENCE, "train.objective=orpo", "data.packing=false"],
         # The ring: 3 query heads (Ulysses would refuse them on 2 ranks), one kv head, a sliding window, packed.
         "ring": [*PACKED, "model.config.model_type=mistral", "model.config.sliding_window=16",
                  "model.config.num_attention_heads=3", "model.config.num_key_value_heads=1", "model.config.head_dim=8",
                  "distributed.context_parallel_method=ring"],
         "distill": [*PACKED, "train.objective=distill", "distill.teacher={teacher}", "distill.lmbda=0.5",
                     "distill.max_new_tokens=6", "distill.sft_weight=0.5", "data.packing=false"]}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return teacher_dir(tmp_path_factory.mktemp("teacher"))


def _args(case: str, teacher) -> list[str]:
    return [arg.replace("{teacher}", str(teacher)) for arg in CASES[case]]


@pytest.mark.parametrize("case, nproc, micro, accumulation, strategy", [
    ("short", 2, 2, 2, "fsdp"),  # CP 2: one data-parallel rank, its 4 rows a step in 2 micro-batches
    ("lora", 4, 1, 2, "ddp"),  # DP 2 x CP 2
    ("dpo", 2, 1, 4, "ddp"),
    ("orpo", 2, 2, 2, "fsdp"),
    ("distill", 2, 2, 2, "ddp"),
    ("ring", 2, 1, 4, "fsdp"),
])
def test_context_parallel_trains_as_one_process(tmp_path, one_process, teacher, case, nproc, micro, accumulation,
                                               strategy):
    extra = _args(case, teacher)
    ref = one_process(case)
    run = tmp_path / "cp"
    r = _torchrun(nproc, "train", str(QUICKSTART), f"output_dir={run}", *extra, f"train.micro_batch_size={micro}",
                  f"train.gradient_accumulation_steps={accumulation}", "distributed.context_parallel=2",
                  f"distributed.strategy={strategy}")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert f"world size {nproc}" in r.stdout and "optimizer steps of 4 rows" in r.stdout
    if case in ("lora", "dpo", "ring"):  # packed rows: isolation across the cut checked at start
        assert "packing isolation check across 2 context-parallel ranks passed" in r.stdout
    _same(run, ref, 5e-5 if case == "lora" else 1e-5)


@pytest.mark.parametrize("method", ["ulysses", "ring"])
@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("ranks", [2, 3])
def test_each_target_is_scored_once_on_the_whole_rows(packing, ranks, method):
    """Over the ranks' shares: every target of the whole rows once, at the position before its token (the shift
    made on the whole rows, so a share's last position scores the next share's first label), the position ids and
    documents the whole rows'."""
    rows = [{"input_ids": list(range(100 + 7 * i, 107 + 7 * i + 3 * i)), "labels": [-100, *range(101, 106 + 3 * i),
                                                                                     -100, 200 + i][:7 + 3 * i]}
            for i in range(3)]
    if packing:
        from finetune.data.pack import packed_row

        rows = [packed_row(rows, [0, 1, 2], 64)]
    batch = collate(rows, DataConfig(packing=packing, max_seq_len=64), 0)
    whole = find_targets(batch.labels)
    got_ids, positions, seen = [], [], []
    for rank in range(ranks):
        context = ContextGroup(rank, ranks, None, method)
        part = shard_batch(batch, context, torch.device("cpu"))
        share = part.input_ids.shape[1]
        length = share * ranks
        held = held_positions(context, length)
        seen += held.tolist()
        index = part.target_positions.index
        got_ids += part.target_positions.ids.tolist()
        positions += [(int(i) // share, int(held[int(i) % share])) for i in index]
        assert part.documents.length == length and part.documents.sharded is not None
        width = batch.input_ids.shape[1]
        real = held[held < width]  # the rows' own positions (the rest: the padding to a multiple of the ranks)
        assert torch.equal(part.input_ids[:, :len(real)], batch.input_ids[:, real])
        if packing:  # position ids travel with their tokens
            assert torch.equal(part.position_ids[:, :len(real)], batch.position_ids[:, real])
        assert part.targets == part.target_positions.count
    assert sorted(seen) == list(range(length))  # each position on exactly one rank (Axolotl #3498)
    width = batch.labels.shape[1]
    want = [(int(i) // width, int(i) % width) for i in whole.index]
    assert sorted(positions) == sorted(want) and len(positions) == len(set(positions))
    order = sorted(range(len(positions)), key=lambda k: positions[k])
    assert [got_ids[k] for k in order] == whole.ids.tolist()  # each position scores the next token's label


def test_verify_checks_a_context_parallel_recipe_with_whole_rows():
    from finetune.commands.verify import verify
    from finetune.recipe import load_recipe

    said: list[str] = []
    recipe = load_recipe(QUICKSTART, [*PACKED, "distributed.context_parallel=2", "train.micro_batch_size=2",
                                      "train.gradient_accumulation_steps=2"])
    result = verify(recipe, world_size=2, say=said.append)
    assert result.passed and any("context_parallel 2: not simulated here" in s for s in said)
