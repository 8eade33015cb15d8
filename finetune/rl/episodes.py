"""Multi-turn rollouts: the policy calls tools, or acts in an environment, over several turns (docs/rl.md, "Tools
and environments"). Behind the Generator seam: any generator samples the turns.

Every rollout is an episode; the episodes of a batch take their turns together (one generate call per turn for the
episodes still going):
1. the policy samples a turn from the ids so far (the prompt's, then the completion's) within what the rollout's
   budget has left (grpo.max_new_tokens covers the whole completion, the environment's tokens too);
2. the turn's text is parsed for tool calls (rl/tool_calls.py): none ends the episode, as does a call that does not
   parse (counted);
3. each call runs (rl/tools.py), and the environment's turn (the tool messages, the next assistant header) is
   rendered by the chat template and appended as ids (chat/continuation.py), env_mask 0;
4. until grpo.max_turns policy turns, or the budget: an environment's turn that would fill it is dropped and the
   episode ends with the policy's turn (as TRL does), so the completion never passes max_new_tokens.
The policy's ids are never decoded and encoded again: what trains is what it sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from finetune.chat.continuation import environment_turn
from finetune.chat.spans import render_chat
from finetune.errors import UserError
from finetune.recipe import Recipe
from finetune.rl.generation import Generator, StopAsked, sampled_logprobs
from finetune.rl.prompts import Prompt
from finetune.rl.tool_calls import CallParser
from finetune.rl.tools import CallCounts, Tool, capped, environment_tools, run_call


@dataclass
class Episode:
    """One rollout as it runs: its conversation, ids, and what the environment wrote of them."""

    prompt: Prompt
    prompt_ids: list[int]
    text: str
    """The text of the ids so far (the prompt's rendering, then each turn's)."""
    messages: list[dict[str, Any]]
    tools: dict[str, Tool]
    environment: Any = None
    completion: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    """The engine's log-probability of each completion token (0.0 at the environment's, never read), or None where
    the engine gives none (grpo.engine: generate) or the turns were greedy."""
    turns: int = 0
    calls: int = 0
    malformed: bool = False
    rewritten: bool = False
    done: bool = False
    last_turn: str = ""
    """The text of the policy's last turn."""

    @property
    def completion_messages(self) -> list[dict[str, Any]]:
        """The messages after the prompt's: the policy's turns and the tools' results (what rewards receive)."""
        return self.messages[len(self.prompt.messages or ()):]


class Episodes:
    """Runs the multi-turn rollouts of a batch of prompts with `generator`."""

    def __init__(self, generator: Generator, tokenizer: Any, recipe: Recipe, tools: Sequence[Tool],
                 environment: Callable[[], Any] | None, parser: CallParser, end_ids: Collection[int]) -> None:
        self.generator, self.tokenizer, self.recipe = generator, tokenizer, recipe
        self.tools, self.environment, self.parser = list(tools), environment, parser
        self.end_ids = frozenset(end_ids)
        self.end_texts = [tokenizer.decode([i], skip_special_tokens=False) for i in sorted(self.end_ids)]
        self.counts = CallCounts()
        self.seconds = {"generate": 0.0, "tools": 0.0}
        self.last: list[Episode] = []  # the last run's episodes (their figures)

    def run(self, prompts: Sequence[Prompt], greedy: bool, stop: StopAsked) -> list[Episode]:
        """One episode per prompt (repeat a prompt for a group), each ended; Interrupted once `stop()` is true."""
        self.counts, self.seconds = CallCounts(), {"generate": 0.0, "tools": 0.0}
        episodes = [self._start(p) for p in prompts]
        while going := [e for e in episodes if not e.done]:
            self._turn(going, greedy, stop)
        self.counts.by_rollout = [e.calls for e in episodes]
        self.last = episodes
        return episodes

    def _start(self, prompt: Prompt) -> Episode:
        """A fresh episode: its environment made and reset with the row (its text added to the prompt's last message,
        the prompt rendered again with every tool's schema)."""
        if prompt.messages is None:
            raise UserError(f"{prompt.where}: tools and environments act in chat prompts (a list of messages), not text")
        messages = [dict(m) for m in prompt.messages]
        tools = {t.name: t for t in self.tools}
        instance = self._environment(prompt, messages, tools) if self.environment is not None else None
        schemas = [t.schema for t in tools.values()]
        text = render_chat(self.tokenizer, messages, self.recipe.tokenizer.chat_template_kwargs,
                           add_generation_prompt=True, tools=schemas or None)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        longest = (self.recipe.data.max_seq_len or 0) - self.recipe.grpo.max_new_tokens
        if self.recipe.data.max_seq_len and len(ids) > longest:
            raise UserError(f"{prompt.where}: with the tools' schemas (and the environment's reset text) the prompt is "
                            f"{len(ids)} tokens; data.max_seq_len - grpo.max_new_tokens leaves {longest}")
        return Episode(prompt, ids, text, messages, tools, instance)

    def _environment(self, prompt: Prompt, messages: list[dict[str, Any]], tools: dict[str, Tool]) -> Any:
        """The rollout's environment instance, reset with the prompt's row (TRL: reset(**row), the prompt included)."""
        assert self.environment is not None
        try:
            instance = self.environment()
            observation = instance.reset(prompt=prompt.prompt, **prompt.fields)
        except Exception as e:  # noqa: BLE001 - the user's environment: a failure names it and the row
            raise UserError(f"grpo.environment {self.recipe.grpo.environment!r} failed to start an episode for "
                            f"{prompt.where}: {type(e).__name__}: {e}") from e
        if observation is not None:
            if not isinstance(observation, str):
                raise UserError(f"grpo.environment: reset() returned {type(observation).__name__} for {prompt.where}; "
                                "it returns text (added to the prompt's last message) or None")
            messages[-1] = {**messages[-1], "content": str(messages[-1].get("content", "")) + observation}
        tools.update({t.name: t for t in environment_tools(instance, "grpo.environment")})
        return instance

    def _turn(self, going: list[Episode], greedy: bool, stop: StopAsked) -> None:
        """One policy turn of every episode still going, and the environment's turn after each that called."""
        most = self.recipe.grpo.max_new_tokens
        left = [most - len(e.completion) for e in going]
        start = time.perf_counter()
        sampled = self.generator.generate([e.prompt_ids + e.completion for e in going], greedy, stop, max(left))
        self.seconds["generate"] += time.perf_counter() - start
        engine = sampled_logprobs(self.generator, len(going), greedy)
        for episode, ids, budget, logprobs in zip(going, sampled, left, engine):
            ids = ids[:budget]
            episode.completion += ids
            episode.env_mask += [1] * len(ids)
            episode.logprobs = None if logprobs is None or episode.logprobs is None else \
                episode.logprobs + list(logprobs[:len(ids)])
            episode.turns += 1
            turn_text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            episode.text += turn_text
            episode.last_turn = turn_text
            parsed = self.parser.parse(turn_text)
            episode.messages.append(parsed.message)
            episode.malformed |= parsed.malformed
            ended = not ids or ids[-1] not in self.end_ids or len(episode.completion) >= most
            if not parsed.calls or ended or episode.turns >= self.recipe.grpo.max_turns:
                episode.done = True
                continue
            self._environment_turn(episode, parsed.calls, stop)

    def _raw(self, episode: Episode) -> str:
        """The policy's last turn as sampled, without its end token's text: the assistant message a template that
        renders no tool calls writes back as sampled."""
        turn = episode.last_turn
        for end in self.end_texts:
            if turn.endswith(end):
                return turn[:-len(end)]
        return turn

    def _environment_turn(self, episode: Episode, calls: list[dict[str, Any]], stop: StopAsked) -> None:
        """Run the turn's calls and append the environment's turn, unless it would fill the budget."""
        g = self.recipe.grpo
        start = time.perf_counter()
        results = []
        for call in calls:
            content = run_call(episode.tools, call, g.tool_timeout_s, stop, self.counts)
            content = capped(content, self.tokenizer, g.tool_result_max_tokens, g.tool_result_keep, self.counts)
            message = {"role": "tool", "name": (call.get("function") or {}).get("name"), "content": content}
            results.append(message | ({"tool_call_id": call["id"]} if call.get("id") else {}))
        episode.calls += len(calls)
        self.seconds["tools"] += time.perf_counter() - start
        turn = environment_turn(self.tokenizer, episode.messages, results, episode.text,
                                template_kwargs=self.recipe.tokenizer.chat_template_kwargs,
                                tools=[t.schema for t in episode.tools.values()] or None,
                                rewrites=g.template_rewrites, turn=episode.turns,
                                alternatives=[{"role": "assistant", "content": self._raw(episode)}])
        episode.rewritten |= not turn.prefix_kept
        episode.messages[-1] = turn.message or episode.messages[-1]  # what later renderings must write again
        if len(episode.completion) + len(turn.ids) >= g.max_new_tokens:
            episode.done = True  # no room to answer after it: the episode ends with the policy's turn (TRL's rule)
            return
        episode.messages += results
        episode.completion += turn.ids
        episode.env_mask += [0] * len(turn.ids)
        if episode.logprobs is not None:
            episode.logprobs += [0.0] * len(turn.ids)
        episode.text += turn.text
