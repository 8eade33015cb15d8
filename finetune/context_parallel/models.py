"""Which models context parallelism can split: the attention of split rows runs inside finetune's packed attention
(finetune/attention/dispatch.py), where the exchange takes the rows' documents; the student's and a distillation
teacher's alike."""

from __future__ import annotations

import torch

from finetune.attention.dispatch import is_ours
from finetune.context_parallel.ulysses import check_heads
from finetune.errors import UserError
from finetune.model.vision import family, text_config


def check_model(lm: torch.nn.Module, ranks: int, method: str = "ulysses") -> None:
    """A model context parallelism can split (UserError otherwise): a text model with our packed attention, which
    takes the rows' documents (the exchange runs in it), and for Ulysses query heads divisible by the ranks."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if family(base.config) is not None:
        raise UserError("distributed.context_parallel: vision-language models are not split across ranks yet (an "
                        "image's tokens would have to stay whole, and their attention masks are not causal)")
    if not is_ours(base):
        raise UserError("distributed.context_parallel: the attention is split across ranks inside finetune's packed "
                        f"attention, and this model runs {base.config._attn_implementation!r}: leave "
                        "model.attn_implementation unset (or auto)")
    try:
        if method == "ulysses":
            check_heads(text_config(base.config).num_attention_heads, ranks)
    except ValueError as e:
        raise UserError(f"distributed.context_parallel: {e} (distributed.context_parallel_method: ring splits "
                        "positions only, for any head count)") from None
