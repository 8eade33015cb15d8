"""The built-in reward `reward_model`: a trained reward model scores each completion (`args: {path: ...}`).

`path` is a finished run of train.objective: reward (its final/ holds the model or a LoRA adapter on its base), the
final/ of one, or any model directory of a transformers XForSequenceClassification with one label (TRL's reward
models too). Each prompt and its completion are rendered as one conversation with the reward model's own chat
template (a text prompt is a user message, a text completion an assistant message; a multi-turn episode's
messages follow the prompt's), and scored as training scored them: at each conversation's own last token, never
a pad token (model/with_score.py). The model is loaded once per process and path, on this rank's device, in
eval mode, and runs without gradients.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from finetune.errors import UserError, first_line


def reward_model(prompts: list, completions: list, path: str, batch_size: int = 8,
                 **fields: Any) -> list[float | None]:
    """Each completion's score by the reward model at `path`, `batch_size` conversations per forward."""
    scorer = _load(str(Path(path).expanduser().resolve()))
    conversations = [_messages(p, "user") + _messages(c, "assistant") for p, c in zip(prompts, completions)]
    return [float(s) for s in scorer.score(conversations, batch_size)]


def _messages(value: Any, role: str) -> list[dict[str, Any]]:
    """Text as one message of `role`; messages as they are."""
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


class RewardScorer:
    """A loaded reward model: its backbone and score head, its tokenizer, its device."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        from finetune import dist
        from finetune.model.score_head import score_layers

        self.device = dist.default_device()
        self.model = model.to(self.device).eval()
        self.backbone, self.head = score_layers(self.model)
        self.tokenizer = tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.no_grad()
    def score(self, conversations: list[list[dict[str, Any]]], batch_size: int) -> list[float]:
        """One score per conversation, right-padded batches read at each one's last real token."""
        ids = [self._ids(c) for c in conversations]
        out: list[float] = []
        for start in range(0, len(ids), batch_size):
            chunk = ids[start:start + batch_size]
            width = max(len(x) for x in chunk)
            input_ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for i, x in enumerate(chunk):
                input_ids[i, :len(x)] = torch.tensor(x)
                mask[i, :len(x)] = 1
            hidden = self.backbone(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                   use_cache=False).last_hidden_state
            last = torch.tensor([len(x) - 1 for x in chunk], device=self.device)
            rows = hidden[torch.arange(len(chunk), device=self.device), last]
            out += self.head(rows).squeeze(-1).float().tolist()
        return out

    def _ids(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        except Exception as e:  # noqa: BLE001 - the template's own error, said with the reward's name
            raise UserError(f"reward_model: the reward model's chat template could not render a conversation "
                            f"({type(e).__name__}: {first_line(e)})") from None
        if not ids:
            raise UserError("reward_model: a conversation rendered to no tokens")
        return list(ids)


@functools.cache
def _load(path: str) -> RewardScorer:
    """The reward model at `path` (a run directory, its final/, or a model directory), loaded once per process."""
    from finetune.run.directory import finished_run, is_run
    from finetune.run.trained import is_reward_model, load_trained

    where = Path(path)
    if is_run(where.parent) and where.name == "final":
        where = where.parent
    if is_run(where):
        recipe, _ = finished_run(where)
        if not is_reward_model(recipe):
            raise UserError(f"reward_model: {path} is a run of train.objective {recipe.train.objective}, not a reward "
                            "model (train.objective: reward)")
        return RewardScorer(*load_trained(where, recipe))
    if not (where / "config.json").is_file():
        raise UserError(f"reward_model: {path} is neither a finished reward model run (recipe.yaml + final/) nor a "
                        "model directory (config.json)")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        model = AutoModelForSequenceClassification.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"reward_model: {path} could not be loaded as a sequence classifier ({type(e).__name__}: "
                        f"{first_line(e)})") from None
    return RewardScorer(model, tokenizer)
