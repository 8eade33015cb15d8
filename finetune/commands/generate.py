"""`finetune generate RUN_DIR --prompt ...` and `finetune chat RUN_DIR`: talk to a trained model.

RUN_DIR is a run directory (its final/ holds a full model, or a LoRA adapter that goes on the run's base,
rebuilt as `finetune merge` rebuilds it), or any HF model directory (e.g. RUN_DIR/merged). The conversation is
rendered with the tokenizer's chat template, saved with the run, and the run's tokenizer.chat_template_kwargs,
so the model sees prompts formatted exactly as in training. `generate --image PATH` (a vision-language run) puts
the images before the prompt's text in the user message, laid out and processed as training did
(image_prompt.py). Tokens stream to stdout as they are produced. Generation uses the KV cache: it is inference on
one sequence, where the packed-document problem that makes training turn the cache off does not arise.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch

from finetune.chat.mistral import is_mistral_common
from finetune.commands.image_prompt import (
    check_images_allowed,
    image_files,
    image_tokens,
    prompt_inputs,
    user_content,
)
from finetune.dist import default_device
from finetune.errors import UserError
from finetune.model import vision
from finetune.recipe import ModelConfig
from finetune.run.directory import finished_run, is_run
from finetune.run.trained import has_adapter, is_reward_model, load_trained


@dataclass
class GenerationOptions:
    max_new_tokens: int = 256
    """Most tokens to generate per reply."""
    temperature: float = 0.0
    """0: greedy (deterministic); above 0: sample from the softmax at this temperature."""
    top_p: float = 1.0
    """Sampling only: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int = 0
    """Seed of the sampler (set once per command, so a whole chat session is reproducible)."""
    system: str | None = None
    """A system message put before the conversation."""
    min_new_tokens: int = 0
    """Generate at least this many tokens before the model may stop."""
    template_kwargs: Mapping[str, Any] | None = None
    """Chat template variables; None: those the run was trained with (its tokenizer.chat_template_kwargs)."""


@dataclass
class Completion:
    text: str
    """The reply, special tokens removed."""
    prompt: str
    """The prompt exactly as the model saw it (the chat template's rendering)."""
    new_tokens: int
    """How many tokens were generated (including a final end-of-turn token)."""
    token_ids: tuple[int, ...] = ()
    """The generated token ids."""


def generate(run_dir: str, prompt: str, options: GenerationOptions, images: Sequence[str] = ()) -> str:
    """Answer one user message (the images, then the prompt's text), streaming the reply to stdout; returns the
    reply."""
    paths = image_files(images)
    model, tokenizer, options = _load_with_options(run_dir, options)
    torch.manual_seed(options.seed)
    messages = _with_system([{"role": "user", "content": user_content(prompt, len(paths))}], options.system)
    return complete(model, tokenizer, messages, options, images=paths).text


def chat(run_dir: str, options: GenerationOptions) -> None:
    """A REPL: one user message per line from stdin, replies streamed, the conversation kept, until EOF or
    /exit (/reset starts over)."""
    model, tokenizer, options = _load_with_options(run_dir, options)
    torch.manual_seed(options.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {run_dir}: /exit or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    chat_session(model, tokenizer, options, _prompted_lines() if interactive else sys.stdin)


def chat_session(model: Any, tokenizer: Any, options: GenerationOptions, lines: Iterable[str]) -> list[dict]:
    """Run the chat over `lines` (user messages); returns the conversation (without the system message)."""
    history: list[dict] = []
    for line in lines:
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            history = []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        messages = _fit_context(model, tokenizer, _with_system(history, options.system), options)
        reply = complete(model, tokenizer, messages, options).text
        history.append({"role": "assistant", "content": reply})
    return history


def render_prompt(tokenizer: Any, messages: list[dict], template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The conversation rendered by the chat template, ending with the assistant's header (generation prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the model's tokenizer has no chat template; train with tokenizer.chat_template set, "
                        "or add chat_template.jinja to the model directory")
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **dict(template_kwargs or {}))
    except (TemplateError, TypeError) as e:  # e.g. image parts given to a template that only renders strings
        raise UserError(f"the chat template could not render the conversation ({type(e).__name__}: {e})") from None


def complete(model: Any, tokenizer: Any, messages: list[dict], options: GenerationOptions,
             stream: TextIO | None = sys.stdout, images: Sequence[str] = ()) -> Completion:
    """Generate the assistant's reply to `messages`; tokens stream to `stream` (None: silent). `images`: the files of
    the messages' image parts, in order."""
    from transformers import GenerationConfig, TextStreamer

    check_images_allowed(tokenizer, images)
    prompt, inputs = _prompt(tokenizer, messages, options, images)
    inputs = {k: v.to(_device(model)) for k, v in inputs.items()}
    ids = inputs["input_ids"]
    max_new = _room(model, ids.shape[1], options.max_new_tokens, image_tokens(tokenizer, ids))
    sampling = options.temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new, min_new_tokens=min(options.min_new_tokens, max_new), do_sample=sampling,
        temperature=options.temperature if sampling else None, top_p=options.top_p if sampling else None,
        top_k=None, eos_token_id=_stop_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id,
        use_cache=True)
    streamer = None
    if stream is not None:
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=config, streamer=streamer)
    new = out[0, ids.shape[1]:]
    return Completion(tokenizer.decode(new, skip_special_tokens=True).strip(), prompt, int(new.numel()),
                      tuple(new.tolist()))


def _prompt(tokenizer: Any, messages: list[dict], options: GenerationOptions, images: Sequence[str] = ()
            ) -> tuple[str, dict[str, torch.Tensor]]:
    """The prompt (its text, shown and returned) and the model's inputs for it. mistral-common builds the ids
    itself (tokenizer.backend: mistral_common): they are used as they are, never re-tokenized from their text."""
    if not is_mistral_common(tokenizer):
        prompt = render_prompt(tokenizer, messages, options.template_kwargs)
        return prompt, prompt_inputs(tokenizer, prompt, images)
    if images:
        raise UserError("images with tokenizer.backend: mistral_common are not supported")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    except Exception as e:  # mistral-common's validation: roles, order
        raise UserError(f"mistral-common could not encode the conversation ({type(e).__name__}: {e})") from None
    input_ids = torch.tensor([ids])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return text, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _load_with_options(run_dir: str, options: GenerationOptions) -> tuple[Any, Any, GenerationOptions]:
    """load_for_inference, and the options with the run's chat template kwargs unless they give their own."""
    model, tokenizer, template_kwargs = _load(run_dir)
    if options.template_kwargs is None:
        options = replace(options, template_kwargs=template_kwargs)
    return model, tokenizer, options


def load_for_inference(run_dir: str) -> tuple[Any, Any]:
    """(model in eval mode on the best device, tokenizer) from a run directory, its final/, or an HF model
    directory."""
    model, tokenizer, _ = _load(run_dir)
    return model, tokenizer


def _load(run_dir: str) -> tuple[Any, Any, dict[str, Any]]:
    """load_for_inference's model and tokenizer, and the chat template kwargs of the run ({} for a model dir)."""
    from transformers import AutoTokenizer

    template_kwargs: dict[str, Any] = {}
    path = Path(run_dir).expanduser()
    if has_adapter(path) and is_run(path.parent):
        path = path.parent  # RUN/final holding an adapter: its base comes from the run's recipe
    if is_run(path):
        recipe, final = finished_run(path)
        if is_reward_model(recipe):
            raise UserError(f"{run_dir}: a reward model (train.objective: reward) scores text, it does not generate; "
                            "use it as a GRPO reward (grpo.rewards: [{function: reward_model, args: {path: ...}}])")
        if has_adapter(final) and recipe.adapter.type == "qlora":
            print("note: QLoRA adapter applied to the base loaded unquantized (as `finetune merge` does)",
                  file=sys.stderr)
        model, tokenizer = load_trained(path, recipe, generation=True)
        template_kwargs = dict(recipe.tokenizer.chat_template_kwargs)
    elif (path / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = _load_hf(_hf_auto_class(tokenizer, path), path, "auto")
    else:
        raise UserError(f"{run_dir}: neither a run directory (recipe.yaml + final/) nor an HF model directory "
                        "(config.json)")
    return model.to(default_device()).eval(), tokenizer, template_kwargs


def _hf_auto_class(tokenizer: Any, path: Path) -> Any:
    """AutoModelForImageTextToText for a supported vision-language model directory (e.g. a merged VLM run), its
    image processor (preprocessor_config.json) attached to the tokenizer as training attached it; else
    AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = ModelConfig(path=str(path))
    if vision.family(vision.model_config(cfg)) is None:
        return AutoModelForCausalLM
    vision.attach_layout(tokenizer, cfg)
    return AutoModelForImageTextToText


def _load_hf(auto: Any, path: Path, dtype: str) -> Any:
    try:
        return auto.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: the model could not be loaded ({type(e).__name__}: {e})") from None


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + list(messages)


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _max_positions(model: Any) -> int | None:
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    # A vision-language model's positions are its language model's.
    return getattr(vision.text_config(config), "max_position_embeddings", None)


def _room(model: Any, prompt_tokens: int, wanted: int, image_tokens: int = 0) -> int:
    """max_new_tokens, shortened so prompt + reply fit the model's positions (beyond them output is garbage)."""
    limit = _max_positions(model)
    if limit is None:
        return wanted
    if prompt_tokens >= limit:
        images = f" ({image_tokens} of them for its images: give fewer images)" if image_tokens else ""
        raise UserError(f"the prompt has {prompt_tokens} tokens{images}; the model handles at most {limit} "
                        "positions")
    return min(wanted, limit - prompt_tokens)


def _fit_context(model: Any, tokenizer: Any, messages: list[dict], options: GenerationOptions) -> list[dict]:
    """Drop the oldest turns (never the system message or the newest user turn) until prompt + reply fit."""
    limit = _max_positions(model)
    if limit is None:
        return messages
    messages = list(messages)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    while len(messages) - first > 1:
        if is_mistral_common(tokenizer):
            n = _prompt(tokenizer, messages, options)[1]["input_ids"].shape[1]
        else:
            n = len(tokenizer(render_prompt(tokenizer, messages, options.template_kwargs),
                              add_special_tokens=False)["input_ids"])
        if n + min(options.max_new_tokens, 64) <= limit:
            break
        del messages[first]
    return messages


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokenizer's eos (for ChatML `<|im_end|>`, the end of a turn) and the model's own eos ids."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)


def _prompted_lines() -> Iterator[str]:
    while True:
        try:
            yield input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
