"""A reward model as training, evaluation and `verify` run it: the decoder backbone, then the sequence
classification head (`score`, one output) read at each sequence's own last token.

The model is transformers' XForSequenceClassification (num_labels 1), so what a run saves is the standard class that
transformers and TRL load. Its own forward is not used: it finds a row's last token as the rightmost one that is not
the pad id, which reads the wrong token where the pad is the eos a sequence ends with (transformers #35352), and a
packed row holds several sequences (TRL #6952). Here each sequence's last token comes from the documents the batch
already numbers (PairFields.doc_index: padding -1), found on the device without a host sync, and only those rows of
the hidden states go through the head.
"""

from __future__ import annotations

from typing import Any

import torch

from finetune.attention.kernels import setting
from finetune.batch import Documents
from finetune.model.score_head import score_layers
from finetune.model.with_loss import takes_boundaries


def last_positions(doc_index: torch.Tensor, n_docs: int) -> torch.Tensor:
    """The flat position in [B*T] of each document's last token ([n_docs], in document order), from each position's
    document number (-1: padding, never read). On the tensor's device, without a host sync: the largest position
    of each document, by scatter_reduce (padding goes to a spare slot, dropped)."""
    flat = doc_index.reshape(-1)
    positions = torch.arange(flat.numel(), device=flat.device)
    slot = torch.where(flat >= 0, flat, torch.full_like(flat, n_docs))
    ends = torch.full((n_docs + 1,), -1, dtype=positions.dtype, device=flat.device)
    return ends.scatter_reduce(0, slot, positions, reduce="amax")[:n_docs]


class SequenceScorer(torch.nn.Module):
    """Backbone + score head in one forward (what DDP/FSDP wrap): one float32 score per document of the batch.

    Called as net(input_ids, attention_mask=..., position_ids=..., documents=..., ends=...): `ends` are the flat
    positions whose hidden states are scored (last_positions). A batch with no documents (a filler) gives an empty
    score tensor that still reaches every parameter, so DDP and FSDP hooks fire."""

    router = None  # no load-balancing loss here (verify and eval ask)

    def __init__(self, lm: torch.nn.Module, packed_attention: str = "auto") -> None:
        super().__init__()
        self.lm = lm
        self._layers = score_layers(lm)  # a tuple: not registered again as submodules of this one
        self.takes_boundaries = takes_boundaries(lm)
        self.packed_kernel = setting(packed_attention)

    def forward(self, input_ids: torch.Tensor, ends: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, documents: Documents | None = None,
                **ignored: Any) -> torch.Tensor:
        backbone, head = self._layers
        extra = documents.model_kwargs(self.packed_kernel) if documents is not None and self.takes_boundaries else {}
        # use_cache=False always: with a cache, transformers lets packed documents attend to each other.
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                       **extra)
        hidden = out.last_hidden_state
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, ends)
        return head(rows).squeeze(-1).float()
