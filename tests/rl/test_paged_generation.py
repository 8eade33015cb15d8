"""grpo.engine: paged (finetune/rl/generation.py PagedGenerator, transformers' continuous batching): greedy decoding
gives exactly HFGenerator's tokens on ragged prompts with early stops (Llama and Qwen2, tiny, our attention put back
after); sampled tokens' log-probabilities equal the trainer's recomputed ones (logits / temperature) within 1e-5 in
fp32; GRPO runs generate with it, keep the loss contract, resume bit for bit and weigh its log-probabilities."""

from __future__ import annotations

import threading

import pytest
import torch
from grpo_files import write_prompts
from helpers import QUICKSTART, TINY, run_cli, train_lines

from finetune.errors import Interrupted
from finetune.recipe import GRPOConfig
from finetune.rl.generation import HFGenerator, PagedGenerator

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15], [1, 2, 3]]


def _model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.attention.dispatch import ATTN_NAME, register

    register()
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                  max_position_embeddings=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_NAME).eval()


class _Tokenizer:
    pad_token_id = 0


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_greedy_paged_is_generate_token_for_token(model_type):
    lm = _model(model_type)
    cfg = GRPOConfig(max_new_tokens=12)
    want = HFGenerator(lm, _Tokenizer(), cfg, {5, 40}, torch.device("cpu"), 2).generate(PROMPTS, greedy=True)
    got = PagedGenerator(lm, _Tokenizer(), cfg, {5, 40}, torch.device("cpu"), 2).generate(PROMPTS, greedy=True)
    assert got == want
    assert any(c[-1] in (5, 40) and len(c) < 12 for c in got)  # some stop early, on an end id, which is kept
    assert lm.config._attn_implementation == "finetune_sdpa_varlen"  # our attention is back


def test_sampled_logprobs_are_the_trainers():
    lm = _model("llama")
    cfg = GRPOConfig(max_new_tokens=8, temperature=0.7)
    paged = PagedGenerator(lm, _Tokenizer(), cfg, {5}, torch.device("cpu"), 2)
    torch.manual_seed(3)
    completions = paged.generate(PROMPTS)
    for prompt, completion, logprobs in zip(PROMPTS, completions, paged.logprobs):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = lm(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1].float() / 0.7
        want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(logprobs), want, rtol=1e-5, atol=1e-5)


def test_paged_generates_with_the_lora_adapter_on():
    """A LoRA policy (adapter weights not zero): paged greedy decoding gives generate's tokens on the PEFT model,
    which differ from the base model's: the adapter is in the engine's forward."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    lm = get_peft_model(_model("llama"), LoraConfig(r=4, lora_alpha=32, target_modules="all-linear",
                                                   init_lora_weights=False))
    cfg = GRPOConfig(max_new_tokens=10)
    want = HFGenerator(lm, _Tokenizer(), cfg, {5}, torch.device("cpu"), 2).generate(PROMPTS, greedy=True)
    got = PagedGenerator(lm, _Tokenizer(), cfg, {5}, torch.device("cpu"), 2).generate(PROMPTS, greedy=True)
    assert got == want
    with lm.disable_adapter():
        base = PagedGenerator(lm, _Tokenizer(), cfg, {5}, torch.device("cpu"), 2).generate(PROMPTS, greedy=True)
    assert base != got


def _nucleus_logprobs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """log-probabilities renormalized over the top-p nucleus, by transformers' TopPLogitsWarper's rule (tokens whose
    ascending cumulative probability is above 1 - top_p, the most likely always kept); -inf outside it."""
    ordered, order = torch.sort(logits, dim=-1)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[..., -1] = False
    kept = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(kept, dim=-1)


def test_a_top_p_samples_logprob_is_the_nucleus_renormalized_one():
    """With top_p < 1 the engine's log-probability is that of the truncated distribution it sampled from (renormalized
    over the nucleus), not the policy's: engine - trainer = -log(nucleus mass) > 0, so the correction's weight
    exp(trainer - engine) is the nucleus' mass, the ratio of the policy to the truncated sampler (TRL #6789)."""
    lm = _model("llama")
    paged = PagedGenerator(lm, _Tokenizer(), GRPOConfig(max_new_tokens=8, temperature=0.7, top_p=0.3), {5},
                           torch.device("cpu"), 2)
    torch.manual_seed(0)
    completions = paged.generate(PROMPTS)
    for prompt, completion, logprobs in zip(PROMPTS, completions, paged.logprobs):
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0, len(prompt) - 1:-1]
        logits = logits.float() / 0.7
        tokens = torch.tensor(completion)[:, None]
        want = _nucleus_logprobs(logits, 0.3).gather(1, tokens).squeeze(1)
        torch.testing.assert_close(torch.tensor(logprobs), want, rtol=1e-5, atol=1e-5)
        policy = torch.log_softmax(logits, dim=-1).gather(1, tokens).squeeze(1)
        assert bool((torch.tensor(logprobs) > policy).all())


def test_the_engine_runs_with_older_objects_left_out_of_collections():
    """transformers' continuous batching collects garbage three times a call; the objects alive before the call are
    frozen out of those collections while it runs (gc.freeze: 0.62 -> 0.14 s a call with a trainer's heap), and
    thawed after; a freeze someone else made is left as it was."""
    import gc

    lm = _model("llama")
    frozen: list[int] = []
    lm.register_forward_hook(lambda *_: frozen.append(gc.get_freeze_count()))
    paged = PagedGenerator(lm, _Tokenizer(), GRPOConfig(max_new_tokens=4), {5}, torch.device("cpu"), 2)
    paged.generate(PROMPTS)
    assert frozen and min(frozen) > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        paged.generate(PROMPTS)
        assert gc.get_freeze_count() > before // 2  # still frozen (objects freed meanwhile leave it)
    finally:
        gc.unfreeze()


def test_a_stop_request_stops_the_paged_engine_while_it_generates():
    """SIGTERM's stop request, asked while the engine's thread generates: it stops after a few of the 5 x 200
    tokens (at least 200 forwards had it run to the end), raises Interrupted, leaves no thread behind, and puts the
    policy's mode and attention back; asked before, nothing runs."""
    lm = _model("llama").train()
    forwards: list[int] = []
    lm.register_forward_hook(lambda *_: forwards.append(1))
    paged = PagedGenerator(lm, _Tokenizer(), GRPOConfig(max_new_tokens=200), {63}, torch.device("cpu"), 2)
    threads = threading.active_count()
    with pytest.raises(Interrupted):
        paged.generate(PROMPTS, stop=lambda: len(forwards) >= 3)
    assert 3 <= len(forwards) < 100, len(forwards)
    assert threading.active_count() == threads
    assert lm.training and lm.config._attn_implementation == "finetune_sdpa_varlen"
    forwards.clear()
    with pytest.raises(Interrupted):
        paged.generate(PROMPTS, stop=lambda: True)
    assert forwards == []


def _grpo(tmp_path, name: str, *extra: str):
    prompts = write_prompts(tmp_path / "p.jsonl", 8, 1)
    run = tmp_path / name
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *TINY, "data.packing=false", "train.objective=grpo",
                f"datasets.0.path={prompts}", "datasets.0.format=prompt", "eval_datasets=[]", "grpo.engine=paged",
                "grpo.num_generations=2", "grpo.max_new_tokens=8", "grpo.rewards=[{function: length, args: {target: 4}}]",
                "grpo.importance_correction=mis", "grpo.importance_level=token", "train.max_steps=4",
                "checkpoint.every_steps=2", "train.warmup_steps=0", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_paged_rollouts_keep_the_loss_contract_and_resume_bit_for_bit(tmp_path):
    """A step's prompts are generated together whatever the split, so 4 x 1 and 2 x 2 sample the same completions
    and train the same weights (1e-5); a run resumed from its step-2 checkpoint is the straight one, bit for bit.
    The engine's log-probabilities reach the importance correction: they are the trainer's here (fp32, one
    process), so the mismatch is at the float floor and every weight 1."""
    import shutil

    from helpers import final_weights, rel_diff

    whole = _grpo(tmp_path, "whole", "train.micro_batch_size=4", "train.gradient_accumulation_steps=1")
    split = _grpo(tmp_path, "split", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2")
    a, b = train_lines(whole), train_lines(split)
    for x in a:
        assert x["completion_length"] > 0 and 0 <= x["logprob_mismatch"] < 1e-5 and x["importance_masked"] == 0
        assert x["importance_weight"] == pytest.approx(1.0, abs=1e-5)
    assert [x["tokens"] for x in a] == [x["tokens"] for x in b]
    ref = final_weights(whole)
    assert all(rel_diff(w, ref[k]) < 1e-5 for k, w in final_weights(split).items())
    resumed = tmp_path / "resumed"
    shutil.copytree(split, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    _grpo(tmp_path, "resumed", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2", "resume=auto")
    assert [(x["step"], x["loss"]) for x in train_lines(resumed)] == [(x["step"], x["loss"]) for x in b]
    got, want = final_weights(resumed), final_weights(split)
    assert all(torch.equal(got[k], want[k]) for k in want)
