"""The micro-batch type (finetune/batch.py): what an objective declares it needs is checked where a step's
micro-batches are made, and `MicroBatch.to(device)` moves every tensor, keeps the counts host integers, and copies
from pinned memory without blocking only to a CUDA device."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import tiny_recipe

from finetune.batch import SECTIONS, Documents, MicroBatch, PairFields, RolloutFields, Targets
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.objectives.preference import DPO
from finetune.objectives.sft import SFT
from finetune.recipe import validate
from finetune.train.step import step_micro_batches

CPU = torch.device("cpu")


def _recipe(tmp_path, packing: bool = False):
    raw = tiny_recipe(tmp_path / "out", tmp_path / "train.jsonl")
    raw["data"]["packing"] = packing
    return validate(raw)


def _sample(n: int, prompt: int = 2) -> dict:
    ids = list(range(3, 3 + n))
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def _pair(chosen: int, rejected: int) -> dict:
    c, r = _sample(chosen), _sample(rejected)
    return {"input_ids": c["input_ids"] + r["input_ids"], "labels": c["labels"] + r["labels"],
            "docs": [chosen, rejected]}


# --- Objective.needs ------------------------------------------------------------------------------------------

def test_sections_are_the_optional_typed_fields_of_a_micro_batch():
    defaults = {f.name: f.default for f in dataclasses.fields(MicroBatch)}
    assert set(SECTIONS) == {"pairs", "rollouts", "teacher"} and all(defaults[name] is None for name in SECTIONS)


def test_an_objective_meeting_batches_without_what_it_needs_is_refused_before_any_forward(tmp_path):
    """DPO declares needs ("pairs",): SFT rows cut into a step's micro-batches are refused there, with the key and
    the fix, not by a lookup inside its loss."""
    recipe = _recipe(tmp_path)
    dpo = DPO(beta=0.1, kind="sigmoid", label_smoothing=0.0)
    rows = [_sample(6), _sample(9)]
    with pytest.raises(UserError) as caught:
        step_micro_batches(dpo, rows, recipe, 0, 1, 0, CPU)
    message = str(caught.value)
    assert message.startswith("train.objective: dpo needs micro-batches with pairs")
    assert "format: preference" in message and "set train.objective" in message
    # The same rows suit SFT, which needs no section; preference rows suit DPO.
    assert [b.targets for b in step_micro_batches(SFT(), rows, recipe, 0, 1, 0, CPU)] == [4 + 7]
    (batch,) = step_micro_batches(dpo, [_pair(5, 7), _pair(4, 4)], recipe, 0, 1, 0, CPU)
    assert batch.pairs is not None and batch.pairs.count == 2 and batch.device == CPU


def test_a_need_that_names_no_section_is_the_objectives_own_bug(tmp_path):
    class Typo(SFT):
        name, needs = "typo", ("pair",)

    with pytest.raises(ValueError, match=r"the typo objective needs 'pair': not a section of MicroBatch "
                                         r"\(pairs, rollouts, teacher\)"):
        step_micro_batches(Typo(), [_sample(6)], _recipe(tmp_path), 0, 1, 0, CPU)


def test_reading_an_undeclared_section_says_to_declare_it(tmp_path):
    (batch,) = step_micro_batches(SFT(), [_sample(6)], _recipe(tmp_path), 0, 1, 0, CPU)
    with pytest.raises(ValueError, match="declare it in the objective's `needs`"):
        batch.require("pairs", "sft")


# --- MicroBatch.to(device) ------------------------------------------------------------------------------------

def _walk(value: Any, path: str = "batch"):
    """Every (path, leaf) reachable through the batch's dataclasses, lists and dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}[{key!r}]")
    else:
        yield path, value


def _full_batch(packed: bool) -> MicroBatch:
    """A micro-batch with every section filled: padded (attention mask) or packed (position ids), pairs and
    rollouts."""
    ids = torch.arange(3, 15).reshape(2, 6)
    labels = ids.clone()
    labels[:, :2] = IGNORE_INDEX
    batch = MicroBatch(ids, labels, targets=8, seq_tokens=12, padded_tokens=12,
                       pairs=PairFields(torch.tensor([[0] * 6, [1] * 6]), 1, 4, torch.zeros(1, 2, dtype=torch.float64)),
                       rollouts=RolloutFields(torch.tensor([[0] * 6, [1] * 6]), torch.tensor([0.5, -0.5],
                                              dtype=torch.float64), torch.full((2, 6), float("nan"),
                                              dtype=torch.float64), [4, 4]))
    if packed:
        batch.position_ids = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    else:
        batch.attention_mask = torch.ones_like(ids)
    return batch


@pytest.mark.parametrize("packed", [False, True])
def test_to_moves_every_tensor_and_keeps_counts_on_the_host(packed):
    """To the meta device (a device that is not the CPU, present on every machine): every tensor anywhere in the
    moved batch is there, and every count is a plain int, known without a read."""
    batch = _full_batch(packed)
    moved = batch.to("meta")
    assert moved.device == torch.device("meta") and batch.device is None  # a new batch; the old one is unchanged
    leaves = list(_walk(moved))
    tensors = {path: t for path, t in leaves if isinstance(t, torch.Tensor)}
    assert {path: t.device.type for path, t in tensors.items() if t.device.type != "meta"} == {}
    expected = {"batch.input_ids", "batch.labels", "batch.pairs.doc_index", "batch.pairs.ref_logps",
                "batch.rollouts.seq_index", "batch.rollouts.advantages", "batch.rollouts.old_logps",
                "batch.target_positions.index", "batch.target_positions.ids"}
    expected |= {"batch.position_ids", "batch.documents.cu_seqlens"} if packed else {"batch.attention_mask"}
    assert set(tensors) == expected
    assert isinstance(moved.target_positions, Targets) and (moved.documents is not None) == packed
    counts = {"targets": 8, "seq_tokens": 12, "padded_tokens": 12}
    assert {k: getattr(moved, k) for k in counts} == counts and all(type(getattr(moved, k)) is int for k in counts)
    assert type(moved.pairs.count) is int and type(moved.pairs.chosen_tokens) is int
    assert moved.rollouts.scored == [4, 4] and all(type(n) is int for n in moved.rollouts.scored)
    target = moved.target_positions
    assert (target.count, target.low, target.high) == (8, 5, 14) and all(
        type(v) is int for v in (target.count, target.low, target.high))
    if packed:
        docs = moved.documents
        assert isinstance(docs, Documents) and docs.spans == [[(0, 3), (3, 6)], [(0, 6)]] and docs.max_length == 6
    assert moved.to("meta") is moved  # already there: no second copy


class _Spy(torch.Tensor):
    """A CPU tensor that records how it is copied (pin_memory, to(..., non_blocking)), standing in for the copy so
    that the CUDA path can be followed on a machine without CUDA."""

    calls: list[tuple[str, str, bool]] = []

    def pin_memory(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        _Spy.calls.append(("pin", "", False))
        return self

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = args[0] if args else kwargs.get("device")
        _Spy.calls.append(("to", str(device), bool(kwargs.get("non_blocking", False))))
        return self


@pytest.mark.parametrize("device", ["cuda", "cpu", "meta"])
def test_pinned_non_blocking_copies_only_to_cuda(device, monkeypatch):
    batch = _full_batch(packed=False)
    batch.position_ids = torch.arange(6).expand(2, 6).clone()  # moved too (with the mask: not packed, no Documents)
    spied = {f.name: getattr(batch, f.name).as_subclass(_Spy)
             for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)}
    pairs, rollouts = batch.pairs, batch.rollouts
    batch = dataclasses.replace(
        batch, **spied, pairs=PairFields(pairs.doc_index.as_subclass(_Spy), 1, 4, pairs.ref_logps.as_subclass(_Spy)),
        rollouts=RolloutFields(*(t.as_subclass(_Spy) for t in (rollouts.seq_index, rollouts.advantages,
                                                               rollouts.old_logps)), rollouts.scored))
    monkeypatch.setattr(_Spy, "calls", [])
    batch.to(device)
    copies = [c for c in _Spy.calls if c[0] == "to"]
    pins = [c for c in _Spy.calls if c[0] == "pin"]
    # input_ids, labels, attention_mask, position_ids, the pairs' two tensors, the rollouts' three and the target
    # positions.
    assert len(copies) == 10 and {c[1] for c in copies} == {device}
    if device == "cuda":
        assert len(pins) == 10 and all(non_blocking for _, _, non_blocking in copies)
    else:
        assert pins == [] and not any(non_blocking for _, _, non_blocking in copies)
