"""The generation seam: prompts in, sampled completions out. `HFGenerator` runs transformers' `generate` on the
policy itself (adapters on, eval mode, KV cache, left-padded batches); `PagedGenerator` transformers' continuous
batching (grpo.engine: paged); another engine (vLLM on CUDA) can take their place by implementing `Generator`,
without touching the objective or the plan.

A generator is handed `stop`, the run's stop request (SIGTERM, train/stop.py): it asks it between tokens and, once
it says yes, raises `Interrupted` instead of returning, so that a preempted run stops within a token of the signal
rather than after a whole batch's generation."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from finetune.errors import Interrupted
from finetune.recipe import GRPOConfig

StopAsked = Callable[[], bool]


def never() -> bool:
    return False


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], greedy: bool = False, stop: StopAsked = never,
                 max_new_tokens: int | None = None) -> list[list[int]]:
        """One completion per prompt (repeat a prompt for a group): its token ids, cut after the first end
        token (kept), at most `max_new_tokens` (None: grpo.max_new_tokens; a multi-turn rollout's turn gets what its
        budget has left). Raises Interrupted once `stop()` is true (asked between tokens)."""
        ...


class HFGenerator:
    """transformers' generate on the policy, `batch_size` prompts at a time."""

    def __init__(self, lm: torch.nn.Module, tokenizer: Any, cfg: GRPOConfig, end_ids: Collection[int],
                 device: torch.device, batch_size: int) -> None:
        self.lm, self.cfg, self.end_ids, self.device = lm, cfg, sorted(end_ids), device
        self.pad_id = tokenizer.pad_token_id
        self.batch_size = batch_size

    def generate(self, prompts: list[list[int]], greedy: bool = False, stop: StopAsked = never,
                 max_new_tokens: int | None = None) -> list[list[int]]:
        training = self.lm.training
        self.lm.eval()
        out: list[list[int]] = []
        most = max_new_tokens or self.cfg.max_new_tokens
        try:
            with torch.no_grad():
                for i in range(0, len(prompts), self.batch_size):
                    if stop():
                        raise Interrupted
                    out += self._batch(prompts[i:i + self.batch_size], greedy, stop, most)
        finally:
            self.lm.train(training)
        if stop():  # asked during the last batch, which generate then cut short
            raise Interrupted
        return out

    def _batch(self, prompts: list[list[int]], greedy: bool, stop: StopAsked, most: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left-padded: every completion starts at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": self.cfg.temperature,
                                                        "top_p": self.cfg.top_p, "top_k": 0}
        out = self.lm.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                               max_new_tokens=most, eos_token_id=self.end_ids,
                               pad_token_id=self.pad_id, use_cache=True,
                               stopping_criteria=StoppingCriteriaList([_Asking(stop)]), **sampling)
        return [cut_at_end(row, self.end_ids) for row in out[:, width:].tolist()]



def cut_at_end(ids: list[int], end_ids: Collection[int]) -> list[int]:
    """A completion up to and including its first end token (what follows is an engine's padding)."""
    for i, t in enumerate(ids):
        if t in end_ids:
            return ids[:i + 1]
    return ids


def sampled_logprobs(generator: Any, count: int, greedy: bool) -> list[list[float] | None]:
    """The log-probabilities the engine gave for its last call's `count` completions (grpo.engine: paged gives them,
    for the importance correction), or None for each where it gives none or the call was greedy."""
    engine = getattr(generator, "logprobs", None)
    return engine if engine is not None and len(engine) == count and not greedy else [None] * count


@contextlib.contextmanager
def _collections_skip_older_objects() -> Iterator[None]:
    """The objects alive now left out of garbage collections until the block ends (gc.freeze). transformers'
    continuous batching runs gc.collect() three times a call (stopping its manager, freeing its batch processor): in
    a trainer's process, whose heap holds hundreds of thousands of objects, they made a 0.14 s call take 0.62 s
    (benchmarks/rollout_engines.py's note). Collections inside still free what the call itself left. Where someone
    else froze objects already, nothing is changed."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# How often the stop request is asked while the paged engine generates (seconds): a few of a tiny model's tokens on
# a CPU, less than one of a real model's.
POLL_S = 0.005

# The attention implementations transformers' continuous batching runs (its own check's list, transformers 5.x).
_PAGED_ATTENTION = ("sdpa", "eager", "paged|eager", "paged|sdpa")


class PagedGenerator:
    """transformers' continuous batching (`generate_batch`: a paged KV cache, requests join and leave the batch as they
    finish, no padding) on the policy: grpo.engine: paged. The same sampling settings as HFGenerator's; greedy
    decoding gives its tokens exactly. The sampled tokens' log-probabilities (of the processed distribution: logits /
    temperature, top-p) are kept in `logprobs` for the last call. The policy's attention runs as transformers' sdpa
    while it generates (continuous batching takes no other; HFGenerator's cached path runs sdpa too), and is put back
    after. The engine generates on its own thread; the stop request is asked every POLL_S seconds while it runs, and a
    request stops it after the forward under way (hard stop: no request is finished) and raises Interrupted.
    Sampling is seeded by torch's global generator, as HFGenerator's; the scheduler decides which requests share a
    forward, which does not change a greedy token and, in fp32 on a CPU, gave the same samples run after run
    (tests/rl/test_paged_generation.py resumes bit for bit); on a GPU batch shapes can change the last bits."""

    def __init__(self, lm: torch.nn.Module, tokenizer: Any, cfg: GRPOConfig, end_ids: Collection[int],
                 device: torch.device, batch_size: int) -> None:
        self.lm, self.cfg, self.end_ids, self.device = lm, cfg, sorted(end_ids), device
        self.pad_id = tokenizer.pad_token_id
        self.batch_size = batch_size  # the scheduler decides how many requests run together; kept for the seam
        self.logprobs: list[list[float]] = []

    def generate(self, prompts: list[list[int]], greedy: bool = False, stop: StopAsked = never,
                 max_new_tokens: int | None = None) -> list[list[int]]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        if stop():
            raise Interrupted
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        attention, training = base.config._attn_implementation, self.lm.training
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": self.cfg.temperature,
                                                        "top_p": self.cfg.top_p, "top_k": 0}
        most = max_new_tokens or self.cfg.max_new_tokens
        config = GenerationConfig(max_new_tokens=most, eos_token_id=self.end_ids, pad_token_id=self.pad_id, **sampling)
        # The paged cache sized for these requests: by default it takes a share of the device's free memory, which on
        # a CPU is the host's (seconds to allocate, for a few blocks used).
        page = ContinuousBatchingConfig().page_size
        paging = ContinuousBatchingConfig(
            return_logprobs=True, num_blocks=sum(-(-(len(p) + most) // page) for p in prompts) + len(prompts),
            max_batch_tokens=min(max(256, sum(map(len, prompts))), 16384))
        self.lm.eval()
        try:
            if attention not in _PAGED_ATTENTION:
                base.set_attn_implementation("sdpa")
            with torch.no_grad(), _collections_skip_older_objects():
                results = self._run(base, prompts, config, paging, most, stop)
        finally:
            if base.config._attn_implementation != attention:
                base.set_attn_implementation(attention)
            self.lm.train(training)
        for result in results:
            if result.error:
                raise RuntimeError(f"continuous batching failed on a prompt: {result.error}")
        completions = [cut_at_end(r.generated_tokens, self.end_ids) for r in results]
        self.logprobs = [list(r.logprobs[:len(c)]) for r, c in zip(results, completions)]
        return completions

    @staticmethod
    def _run(base: torch.nn.Module, prompts: list[list[int]], config: Any, paging: Any, most: int,
             stop: StopAsked) -> list[Any]:
        """transformers' continuous-batching manager (its public API, as generate_batch drives it), with the stop
        request asked while it runs; the results in the order of the prompts."""
        manager = base.init_continuous_batching(generation_config=config, continuous_batching_config=paging)
        if not manager.warmed_up:
            manager.warmup()
        manager.start()
        stopped = False
        try:
            ids = manager.add_requests(inputs=prompts, max_new_tokens=most)
            done: dict[str, Any] = {}
            while len(done) < len(ids):
                if stop():
                    stopped = True
                    raise Interrupted
                result = manager.get_result(timeout=POLL_S)
                if result is not None and result.is_finished():
                    done[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("continuous batching ended before its requests finished")
        finally:
            manager.stop(block=True, timeout=5, hard_stop=stopped)
            manager.destroy()
        return [done[i] for i in ids]



class _Asking(StoppingCriteria):
    """Ends every sequence of the batch once the stop request is noted (transformers asks after each token)."""

    def __init__(self, stop: StopAsked) -> None:
        self.stop = stop

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.stop(), dtype=torch.bool, device=input_ids.device)
