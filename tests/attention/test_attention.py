"""finetune/attention/dispatch.py: sdpa one packed document at a time (what `attn_implementation: auto` picks).

It must give transformers' sdpa results wherever both are defined (packed rows, padded batches, generation,
sliding windows, gradients), and keep packed documents apart even where transformers' own path does not
(the cache on).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packed_rows import VOCAB, packed_batch, packed_vs_alone, tiny_model
from transformers import AutoModelForCausalLM

from finetune.attention import dispatch as attention
from finetune.model.isolation import check_packing_isolation, default_tolerance

VARLEN = attention.ATTN_NAME
attention.register()


def test_document_spans_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
    assert attention.document_spans(pos, 2) == [[(0, 3), (3, 4), (4, 6)], [(0, 6)]]
    # transformers sometimes passes [1, S] position ids for a batch: they apply to every row.
    assert attention.document_spans(pos[:1], 2) == [[(0, 3), (3, 4), (4, 6)]] * 2


@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.Qwen2Config])
def test_isolated_even_with_the_cache_on(config_cls: type):
    # transformers' sdpa leaks here (test_pack.test_use_cache_true_leaks_across_documents): the documents
    # come from position_ids in every attention call, whatever the cache does.
    model = tiny_model(config_cls, VARLEN)
    assert packed_vs_alone(model, use_cache=True) <= 1e-5
    assert packed_vs_alone(model) <= 1e-5


@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.Qwen2Config])
def test_packed_gradients_equal_sdpa(config_cls: type):
    """Backward through the per-document path equals transformers' block-diagonal sdpa (fp32, rel 1e-5)."""
    _, batch, _ = packed_batch()
    grads = {}
    for impl in ("sdpa", VARLEN):
        model = tiny_model(config_cls, impl).train()
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        labels = batch.labels[:, 1:].flatten()
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels, ignore_index=-100).backward()
        grads[impl] = torch.cat([p.grad.flatten() for p in model.parameters()])
    diff = (grads["sdpa"] - grads[VARLEN]).norm() / grads["sdpa"].norm()
    assert diff <= 1e-5, diff


def test_padded_batches_and_generation_are_transformers_sdpa():
    """With a padding mask, or a cache prefix, our function hands over to transformers' sdpa: same numbers."""
    ref, ours = tiny_model(transformers.LlamaConfig, "sdpa"), tiny_model(transformers.LlamaConfig, VARLEN)
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    mask[2, 2:] = 0
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
        b = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(a[mask.bool()], b[mask.bool()])
    prompt = ids[:1, :5]
    gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ref.generate(prompt, **gen), ours.generate(prompt, **gen))


def test_a_window_kept_only_in_the_mask_is_kept():
    # Qwen2-MoE does not pass sliding_window to its attention function: the window lives only in the mask, which
    # is then built (transformers' path) for rows longer than the window.
    config = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
                                         use_sliding_window=True, sliding_window=3, max_window_layers=2)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    logits = {}
    for impl in ("sdpa", VARLEN):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, use_cache=False).logits
    assert (logits["sdpa"] - logits[VARLEN]).abs().max() <= 1e-5


@pytest.mark.parametrize("config_cls", [transformers.Qwen2Config, transformers.MistralConfig])
def test_sliding_window_within_documents(config_cls: type):
    # Documents longer than the window (7, 11, 9 tokens vs 4): each query sees its last 4 keys of its own document,
    # as transformers' sliding-window mask says.
    extra = {"use_sliding_window": True, "max_window_layers": 0} if config_cls is transformers.Qwen2Config else {}
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4, **extra)
    _, batch, _ = packed_batch()
    logits = {}
    for impl in ("sdpa", VARLEN):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
        with torch.no_grad():
            logits[impl] = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                 use_cache=False).logits
    assert (logits["sdpa"] - logits[VARLEN]).abs().max() <= 1e-5
    # The window matters here: without it the per-document results differ.
    torch.manual_seed(0)
    wide = AutoModelForCausalLM.from_config(config_cls(**{**config.to_dict(), "sliding_window": 64}),
                                            attn_implementation=VARLEN).eval()
    with torch.no_grad():
        unwindowed = wide(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    assert (unwindowed - logits[VARLEN]).abs().max() > 1e-3


def test_softcap_is_refused_with_a_way_out():
    model = tiny_model(transformers.LlamaConfig, VARLEN)
    layer = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 5, 8)
    kv = torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match="attn_implementation: eager"):
        attention.sdpa_varlen_attention(layer, q, kv, kv, None, position_ids=torch.arange(5)[None], softcap=30.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_startup_isolation_check_passes_in_half_precision(dtype: torch.dtype):
    model = tiny_model(transformers.LlamaConfig, VARLEN, dtype=dtype)
    assert check_packing_isolation(model, VOCAB) <= default_tolerance(dtype)


@pytest.mark.parametrize(("model_type", "chosen"), [("llama", VARLEN), ("qwen2", VARLEN), ("gemma2", "eager"),
                                                    ("gpt_bigcode", "sdpa"), ("doge", "sdpa")])
def test_auto_upgrades_sdpa_and_keeps_eager_where_sdpa_is_unsupported(model_type: str, chosen: str):
    """auto = transformers' default (sdpa, or eager for architectures without sdpa such as Gemma2's softcapped
    attention), with sdpa upgraded to ours where the attention receives position_ids (GPTBigCode's does not: it
    keeps sdpa's block-diagonal mask; Doge builds its own mask from the one it is given, so it keeps sdpa too).
    Either way the packed documents stay apart."""
    from conftest import REPO_ROOT

    from finetune.model.loading import load_model
    from finetune.model.tokenizer import load_tokenizer
    from finetune.recipe import AdapterConfig, ModelConfig, TokenizerConfig

    tokenizer = load_tokenizer(TokenizerConfig(path=str(REPO_ROOT / "examples" / "tokenizer")), ModelConfig())
    config = {"model_type": model_type, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    cfg = ModelConfig(init="random", config=config)
    model = load_model(cfg, AdapterConfig(), tokenizer, seed=0).eval()
    assert model.config._attn_implementation == chosen
    assert check_packing_isolation(model, len(tokenizer)) <= 1e-5


# --- half precision, on the CPU here and on CUDA where a GPU is -------------------------------------------------

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                               reason="needs CUDA")]),
]


def _packed_logits(model: torch.nn.Module, batch: dict, device: str) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                     use_cache=False).logits.float()


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_packed_rows_match_sdpa_and_stay_isolated(device: str):
    # bf16 rounds every matmul: the per-document and the block-diagonal computations agree to bf16 precision
    # (1e-2 of the logits' scale), and the startup isolation check still finds exactly no leak.
    _, batch, _ = packed_batch()
    ref = tiny_model(transformers.LlamaConfig, "sdpa", dtype=torch.bfloat16).to(device)
    ours = tiny_model(transformers.LlamaConfig, VARLEN, dtype=torch.bfloat16).to(device)
    a, b = _packed_logits(ref, batch, device), _packed_logits(ours, batch, device)
    assert (a - b).abs().max() <= 1e-2 * a.abs().max()
    assert check_packing_isolation(ours, VOCAB) <= default_tolerance(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attention_2_isolates_packed_documents():
    pytest.importorskip("flash_attn")
    model = tiny_model(transformers.LlamaConfig, "flash_attention_2", dtype=torch.bfloat16).cuda()
    _, batch, spans = packed_batch()
    packed = _packed_logits(model, batch, "cuda")
    for r, start, ids, _ in spans:
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([ids], device="cuda"), use_cache=False).logits[0].float()
        assert (packed[r, start: start + len(ids)] - alone).abs().max() <= 1e-2 * alone.abs().max()
    assert check_packing_isolation(model, VOCAB) <= default_tolerance(torch.bfloat16)
