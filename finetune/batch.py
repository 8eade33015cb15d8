"""The micro-batch: what the collate functions make, the loop counts and moves, and the objectives and the model read.

One type with typed fields instead of a dict of string keys. The collate step (finetune/data/collate.py) fills the
tensors and the host counts; an objective's extra inputs ride in their own typed section (`pairs` for DPO, ORPO
and reward models, `rollouts` for GRPO), and an objective names the sections it needs (Objective.needs): a batch
without them is refused with one clear message where the step's micro-batches are made (MicroBatch.check_needs,
called by train/step.py's step_micro_batches), before any count or forward, rather than an error deep in a loss. The images
of rows that have them ride in `vision` (pixel values and the model's other image inputs), for the model call.

`MicroBatch.to(device)` is the one move to the device. What the model call needs is found on the CPU first,
while the labels and positions are still there: the target positions and their id range (`Targets`: the loss and
the per-token log-probabilities then make no host sync) and, for packed rows, the documents (`Documents`: their
boundaries, `cu_seqlens`, handed to every attention layer by the model call). On CUDA the copies come from pinned
memory without blocking, so a step can prepare its next micro-batches while the device works on this one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX


def to_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A CPU tensor on `device`: from pinned memory without blocking the host on CUDA, else a plain copy."""
    target = torch.device(device) if device is not None else tensor.device
    if target.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(target, non_blocking=True)
    return tensor.to(target)


# --- targets ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Targets:
    """The flat positions in [B*T] whose next token is a target (ascending, on the device: what the loss
    index_selects), how many there are, the smallest and largest target id (0, 0 when there are none) and, when
    found by find_targets, the target ids themselves in the same order (`ids`, on the device: the shifted labels'
    gather, done on the CPU)."""

    index: torch.Tensor
    count: int
    low: int
    high: int
    ids: torch.Tensor | None = None


def find_targets(labels: torch.Tensor, device: torch.device | str | None = None) -> Targets:
    """The Targets of UNSHIFTED labels [B, T] (or [T]) on the CPU: position t scores labels[..., t + 1]. Finding
    them on the device would be a dynamic shape (`nonzero`) and a read: two host syncs per micro-batch. In numpy
    (a few microseconds, where each small torch op costs several), and the positions and the ids go to the device
    as one tensor, one copy."""
    host = labels.reshape(-1, labels.shape[-1]).cpu()
    flat = host.numpy().reshape(-1)
    scored = flat[1:] != IGNORE_INDEX  # flat position k scores flat[k + 1] ...
    scored[host.shape[1] - 1::host.shape[1]] = False  # ... but a row's last position scores nothing
    index = scored.nonzero()[0]
    ids = flat[index + 1]
    low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    # One int64 tensor, the positions then the ids, sharing numpy's memory (no copy on the host); a subclass of the
    # labels' type stays one, as the torch ops here kept it before.
    both = torch.from_numpy(np.concatenate((index, ids)).astype(np.int64, copy=False))
    if type(host) is not torch.Tensor:
        both = both.as_subclass(type(host))
    both = to_device(both, device)
    return Targets(both[:index.size], int(index.size), low, high, both[index.size:])


# --- packed documents --------------------------------------------------------------------------------------------

def document_spans(position_ids: torch.Tensor, batch_size: int) -> list[list[tuple[int, int]]]:
    """[(start, end), ...] of the documents of each row: a document starts where a position does not follow
    the previous one (0 after 57, or 0 after 0). A host sync when position_ids are on a GPU."""
    position_ids = position_ids.expand(batch_size, -1)
    length = position_ids.shape[1]
    restarts = (position_ids[:, 1:] != position_ids[:, :-1] + 1).nonzero().tolist()
    starts: list[list[int]] = [[0] for _ in range(batch_size)]
    for row, col in restarts:
        starts[row].append(col + 1)
    return [list(zip(s, [*s[1:], length])) for s in starts]


def _spans(pos: np.ndarray) -> list[list[tuple[int, int]]]:
    """document_spans of host position_ids [b, S], in numpy (the same rule; each small torch op would cost several
    microseconds of host time per micro-batch)."""
    length = pos.shape[1]
    restarts = np.nonzero(pos[:, 1:] != pos[:, :-1] + 1)
    starts: list[list[int]] = [[0] for _ in range(pos.shape[0])]
    for row, col in zip(restarts[0].tolist(), restarts[1].tolist()):
        starts[row].append(col + 1)
    return [list(zip(s, [*s[1:], length])) for s in starts]


# The keyword that carries a micro-batch's Documents through the model call to every attention layer (transformers
# forwards unknown keyword arguments to the attention function).
DOCUMENTS_KWARG = "finetune_documents"


@dataclass(eq=False)
class Documents:
    """One packed micro-batch's documents: each row's (start, end) spans on the host, and `cu_seqlens`, their
    cumulative lengths over the flattened rows (int32 [documents + 1], on the model's device). `kernel` is the
    run's packed-attention setting (auto, varlen, flex, sdpa) that the attention reads from here; `block_masks`
    keeps a flex BlockMask once the first layer built it; `sharded`, the context-parallel exchange."""

    spans: list[list[tuple[int, int]]]
    cu_seqlens: torch.Tensor
    max_length: int
    batch: int
    length: int
    kernel: str = "auto"
    block_masks: dict[Any, Any] = field(default_factory=dict)
    sharded: Any = None
    """Context parallelism (finetune/context_parallel): the rows are split across ranks, each holding `length` /
    N positions, and attention runs as sharded(attend, q, k, v) around an attention over whole rows (Ulysses's
    exchanges); None: each rank holds whole rows."""

    @staticmethod
    def of(position_ids: torch.Tensor, device: torch.device | str | None = None) -> Documents:
        """The documents of packed rows with these position_ids ([b, S] or [S], on the CPU: no host sync), their
        cu_seqlens copied to `device` (without blocking, from pinned memory, on CUDA)."""
        pos = position_ids if position_ids.ndim == 2 else position_ids[None]
        batch, length = pos.shape
        spans = _spans(pos.cpu().numpy())
        lengths = [end - start for row in spans for start, end in row]
        cu = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        return Documents(spans, to_device(torch.from_numpy(cu), device), max(lengths), batch, length)

    def model_kwargs(self, kernel: str = "auto") -> dict[str, Any]:
        """The model-call keyword arguments: transformers' own names for precomputed variable-length boundaries
        (cu_seq_lens_q/k, max_length_q/k) and the Documents themselves, with the run's kernel setting."""
        docs = self if kernel == self.kernel else dataclasses.replace(self, kernel=kernel)
        cu = self.cu_seqlens
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": self.max_length,
                "max_length_k": self.max_length, DOCUMENTS_KWARG: docs}


# --- the micro-batch -----------------------------------------------------------------------------------------------

@dataclass(eq=False)
class PairFields:
    """A preference micro-batch's pairs: each position's document (doc_index [b, L], -1 for padding; pair i's chosen
    document is 2i, its rejected 2i+1), how many pairs, the target tokens of the chosen documents (after the shift),
    the reference's log-probabilities [pairs, 2] (float64; zeros until they are computed) and each pair's margin
    [pairs] (float64, the rows' `margin` field, 0 where a row has none; None: no pair carries one)."""

    doc_index: torch.Tensor
    count: int
    chosen_tokens: int
    ref_logps: torch.Tensor
    margins: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PairFields:
        return dataclasses.replace(self, doc_index=to_device(self.doc_index, device),
                                   ref_logps=to_device(self.ref_logps, device),
                                   margins=None if self.margins is None else to_device(self.margins, device))


@dataclass(eq=False)
class RolloutFields:
    """An RL micro-batch's completions, one per row: each position's completion (seq_index [b, L], -1 for padding
    and fillers), each completion's advantage [n] (float64), the sampling policy's log-probability of each scored
    token at its scoring position (old_logps [b, L], float64; rows without them: NaN, the current policy's
    detached log-probability is used, ratio 1), and each completion's scored tokens (host ints)."""

    seq_index: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor
    scored: list[int]
    sampling_logps: torch.Tensor | None = None
    """The sampling engine's log-probability of each scored token (a replay file's `logprobs`; NaN: none), laid out
    as old_logps, for grpo.importance_correction."""

    @property
    def count(self) -> int:
        return len(self.scored)

    def to(self, device: torch.device | str) -> RolloutFields:
        return dataclasses.replace(self, seq_index=to_device(self.seq_index, device),
                                   advantages=to_device(self.advantages, device),
                                   old_logps=to_device(self.old_logps, device),
                                   sampling_logps=None if self.sampling_logps is None else
                                   to_device(self.sampling_logps, device))


@dataclass(eq=False)
class StoredTeacherFields:
    """Offline distillation's teacher at a micro-batch's targets, in their order (data/teacher_logprobs.py): its top-k
    ids [targets, k] (int64) and log-probabilities [targets, k] (float32), each row in descending order."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    def to(self, device: torch.device | str) -> StoredTeacherFields:
        return dataclasses.replace(self, ids=to_device(self.ids, device), logprobs=to_device(self.logprobs, device))


@dataclass(eq=False)
class VisionFields:
    """A micro-batch's images, as its model takes them (finetune/data/pixels.py): `inputs` are the model's own keyword
    tensors (Qwen2-VL: pixel_values, image_grid_thw and mm_token_type_ids), `images` how many images the rows hold."""

    inputs: dict[str, torch.Tensor]
    images: int

    def to(self, device: torch.device | str) -> VisionFields:
        return dataclasses.replace(self, inputs={k: to_device(v, device) for k, v in self.inputs.items()})


@dataclass(eq=False)
class MicroBatch:
    """One micro-batch. Packed rows carry `position_ids` (restarting at 0 per document) and no attention mask;
    padded rows carry an `attention_mask`. Counts are host integers, known before any forward:
    `targets` (tokens with a loss after the shift: what N_step sums), `seq_tokens` (real input tokens; 0 for a
    filler) and `padded_tokens` (tokens computed). After `to(device)`: `device`, `target_positions` and, for packed
    rows, `documents`."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    targets: int
    seq_tokens: int
    padded_tokens: int
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    filler: bool = False
    pairs: PairFields | None = None
    rollouts: RolloutFields | None = None
    vision: VisionFields | None = None
    teacher: StoredTeacherFields | None = None
    device: torch.device | None = None
    target_positions: Targets | None = None
    documents: Documents | None = None
    context: Any = None
    """The context-parallel group its rows are split across (context_parallel.shard.ContextGroup: this micro-batch
    is this rank's share of them); None: whole rows."""

    @property
    def packed(self) -> bool:
        return self.position_ids is not None and self.attention_mask is None

    def to(self, device: torch.device | str) -> MicroBatch:
        """This micro-batch on `device` with its targets (and packed documents) found on the CPU; itself when it is
        there already."""
        device = torch.device(device)
        if self.device == device:
            return self
        moved = {name: to_device(value, device) if isinstance(value, torch.Tensor) else value
                 for name in ("input_ids", "labels", "position_ids", "attention_mask")
                 for value in [getattr(self, name)]}
        return dataclasses.replace(
            self, **moved, pairs=self.pairs.to(device) if self.pairs is not None else None,
            rollouts=self.rollouts.to(device) if self.rollouts is not None else None,
            vision=self.vision.to(device) if self.vision is not None else None,
            teacher=self.teacher.to(device) if self.teacher is not None else None, device=device,
            target_positions=find_targets(self.labels, device),
            documents=Documents.of(self.position_ids, device) if self.packed else None)

    def model_inputs(self) -> dict[str, Any]:
        """The keyword arguments of CausalLMWithLoss for this (moved) micro-batch."""
        assert self.device is not None, "call .to(device) first"
        inputs = {"input_ids": self.input_ids, "labels": self.labels, "targets": self.target_positions}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        if self.documents is not None:
            inputs["documents"] = self.documents
        if self.vision is not None:
            inputs["vision"] = self.vision
        return inputs

    def check_needs(self, needs: tuple[str, ...], objective: str) -> None:
        """Refuse a micro-batch without a section the objective declares (Objective.needs): one clear error before
        any count or forward, where the step's micro-batches are made (train.step.step_micro_batches)."""
        unknown = [name for name in needs if name not in SECTIONS]
        if unknown:  # a typo in an objective's declaration: its own bug, said at its first micro-batch
            raise ValueError(f"the {objective} objective needs {', '.join(map(repr, unknown))}: not a section of "
                             f"MicroBatch ({', '.join(SECTIONS)})")
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise UserError(f"train.objective: {objective} needs micro-batches with {' and '.join(missing)} (made "
                            f"from {'; '.join(SECTIONS[name] for name in missing)}), and these rows were collated "
                            "without them: give the objective that data, or set train.objective to the objective "
                            "of this data")

    def require(self, section: str, objective: str) -> Any:
        """The typed section an objective reads (`pairs`, ...): checked against Objective.needs when the step's
        micro-batches are made, so None here is an objective reading what it did not declare."""
        value = getattr(self, section)
        if value is None:
            raise ValueError(f"the {objective} objective reads {section!r}, which this micro-batch lacks: declare it "
                             "in the objective's `needs` so that it is checked when the micro-batches are made")
        return value


# The typed sections an objective may need (Objective.needs), and the rows that make each.
SECTIONS = {"pairs": "datasets of format: preference", "rollouts": "the rollouts of train.objective: grpo",
            "teacher": "rows with a stored teacher: distill.teacher_logprobs"}
