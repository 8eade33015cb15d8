"""The vocabulary a recipe asks for: special-token overrides and added tokens on the tokenizer, the embedding (and
output layer) resized for them, and the check that the new rows train.

New rows of the input embedding and the output layer start untrained; a run that would keep them so (an adapter
without both layers in `adapter.modules_to_save`, or `train.trainable_parameters` leaving them out) is refused:
the model would see and predict the new tokens through rows that never move. With LoRA the two layers are trained
in full next to the adapter (PEFT's modules_to_save, as Axolotl requires too); the fused loss multiplies by the
output layer's trained copy (model.output_layer looks through PEFT's wrapper).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from finetune.errors import UserError
from finetune.recipe import ModelConfig, TokenizerConfig


def customize_tokenizer(tokenizer: Any, tok: TokenizerConfig) -> None:
    """Apply tokenizer.special_tokens, added_tokens and added_special_tokens (in that order, as Axolotl does)."""
    if not (tok.special_tokens or tok.added_tokens or tok.added_special_tokens):
        return
    from tokenizers import AddedToken

    def token(text: str, special: bool) -> AddedToken:
        # Matched as written (not normalized) and without eating neighbouring spaces: the text is the token.
        return AddedToken(text, rstrip=False, lstrip=False, normalized=False, special=special)

    for key, text in tok.special_tokens.items():
        tokenizer.add_special_tokens({key: token(text, True)})
    ends = {"bos_token", "eos_token"} & set(tok.special_tokens)
    if ends and (getattr(tokenizer, "add_bos_token", False) or getattr(tokenizer, "add_eos_token", False)) \
            and hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()  # the bos/eos its post-processor adds are the new ones
    if tok.added_tokens:
        tokenizer.add_tokens([token(t, False) for t in tok.added_tokens])
    if tok.added_special_tokens:
        tokenizer.add_tokens([token(t, True) for t in tok.added_special_tokens], special_tokens=True)


def embedding_rows(tokenizer: Any, cfg: ModelConfig) -> int:
    """The rows the embedding needs: the tokenizer's length, rounded up to model.vocab_multiple_of."""
    rows = len(tokenizer)
    return math.ceil(rows / cfg.vocab_multiple_of) * cfg.vocab_multiple_of if cfg.vocab_multiple_of else rows


def resize_embeddings(model: torch.nn.Module, tokenizer: Any, cfg: ModelConfig) -> range:
    """Grow the input embedding (and an untied output layer) to embedding_rows() when it has fewer rows; the new
    rows start at the mean of the others (model.mean_resizing) or at the model's own init. Returns the new rows'
    indices (empty when nothing was resized). A model with spare rows already keeps its size, as in Axolotl."""
    before = model.get_input_embeddings().weight.shape[0]
    target = embedding_rows(tokenizer, cfg)
    if before >= target:
        return range(0)
    try:
        model.resize_token_embeddings(target, mean_resizing=cfg.mean_resizing)
    except (NotImplementedError, ValueError, RuntimeError) as e:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model's embedding {before} rows, and "
                        f"resizing it failed ({type(e).__name__}: {e})") from None
    return range(before, target)


def check_new_rows_train(model: torch.nn.Module, new_rows: range, layers: tuple[torch.nn.Module, torch.nn.Module],
                         tokenizer: Any) -> None:
    """Refuse a run in which the embedding rows of added tokens would not train (see the module docstring).
    `layers`: (input embedding, output layer) as the training forward uses them (through PEFT's wrappers)."""
    # Rows past the tokenizer's length only pad the matrix, and the pad token is never a target nor attended to.
    tokens = [i for i in range(new_rows.start, min(new_rows.stop, len(tokenizer))) if i != tokenizer.pad_token_id]
    if not tokens:
        return
    frozen = [name for name, layer in zip(("input embedding", "output layer"), layers)
              if not layer.weight.requires_grad]
    if not frozen:
        return
    texts = [t for t in tokenizer.convert_ids_to_tokens(tokens[:5]) if t is not None]
    names = _layer_names(model, layers)
    shown = f" ({', '.join(map(repr, texts))}{', ...' if len(tokens) > 5 else ''})" if texts else ""
    raise UserError(f"the tokenizer adds {len(tokens)} tokens{shown}: their rows of the {' and '.join(frozen)} are "
                    "new and would never train. With an adapter, train both layers in full: adapter.modules_to_save: "
                    f"[{', '.join(names)}]; with train.trainable_parameters, include them.")


def _layer_names(model: torch.nn.Module, layers: tuple[torch.nn.Module, torch.nn.Module]) -> list[str]:
    """The short module names of the input embedding and the output layer (embed_tokens, lm_head, ...)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = []
    for layer in layers:
        inner = getattr(layer, "original_module", None)  # under PEFT's modules_to_save wrapper
        names += [name.rsplit(".", 1)[-1] for name, module in base.named_modules() if module is layer or
                  (inner is not None and module is inner)][:1]
    return list(dict.fromkeys(names)) or ["embed_tokens", "lm_head"]
