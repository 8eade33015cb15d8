"""finetune/attention/kernels.py and the Documents of finetune/batch.py: a packed micro-batch's documents found once
on the CPU, and the kernels that attend within them (torch's varlen_attn and flex_attention on CUDA, sdpa per
document on a CPU), chosen by the run's setting that the Documents carry.

On a CPU: the documents passed with the model call give the same logits and gradients as the boundaries read
from position_ids in every layer (fp32), and are the ones used; the varlen wrapper (layouts,
grouped-query heads, windows, both signatures of torch's varlen_attn) is run against a kernel of the same contract
made of sdpa; flex_attention's forward (torch runs it uncompiled on a CPU, without backward) checks the document
BlockMask and isolation. On CUDA (`gpu`): varlen_attn and flex_attention against transformers' sdpa with its
block-diagonal mask, in bf16, forward and backward, and the start-of-run isolation check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_pack import VOCAB, packed_batch, tiny_model

from finetune import batch as batch_module
from finetune.attention import dispatch as attention
from finetune.attention import kernels as packed_kernels
from finetune.batch import DOCUMENTS_KWARG, Documents, document_spans
from finetune.errors import UserError
from finetune.model.isolation import check_packing_isolation, default_tolerance

OURS = attention.ATTN_NAME
attention.register()


def test_documents_of_the_position_ids_and_their_model_kwargs():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
    docs = Documents.of(pos)
    assert docs.spans == document_spans(pos, 2) == [[(0, 3), (3, 4), (4, 6)], [(0, 6)]]
    assert docs.cu_seqlens.dtype == torch.int32 and docs.cu_seqlens.tolist() == [0, 3, 4, 6, 12]  # flattened rows
    kwargs = docs.model_kwargs("flex")
    assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"] is docs.cu_seqlens
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 6
    # The run's setting travels with the documents; the micro-batch's own Documents are left as they were.
    assert kwargs[DOCUMENTS_KWARG].kernel == "flex" and docs.kernel == "auto"
    assert kwargs[DOCUMENTS_KWARG].spans is docs.spans


def _forward_backward(model: torch.nn.Module, batch, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **kwargs).logits
    labels = batch.labels[:, 1:].flatten()
    F.cross_entropy(logits[:, :-1].flatten(0, 1), labels, ignore_index=-100).backward()
    return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.Qwen2Config])
def test_boundaries_passed_once_equal_boundaries_read_per_layer(config_cls: type, monkeypatch):
    """The keyword path (what training runs) and the position_ids path give the same logits and gradients, fp32,
    and with the keywords no layer reads the documents from position_ids."""
    _, batch, _ = packed_batch()
    model = tiny_model(config_cls, OURS).train()
    read_logits, read_grads = _forward_backward(model, batch)
    kwargs = Documents.of(batch.position_ids).model_kwargs()
    calls = []
    monkeypatch.setattr(attention, "document_spans", lambda *a: calls.append(a) or [])  # ours: never called now
    monkeypatch.setattr(batch_module, "document_spans", lambda *a: calls.append(a) or [])
    kw_logits, kw_grads = _forward_backward(model, batch, **kwargs)
    assert calls == []
    assert (kw_logits - read_logits).abs().max() <= 1e-5
    assert (kw_grads - read_grads).norm() <= 1e-5 * read_grads.norm()


def test_boundaries_from_another_source_are_ignored():
    # cu_seq_lens without our Documents (another library's) are not trusted: position_ids decide.
    _, batch, _ = packed_batch()
    model = tiny_model(transformers.LlamaConfig, OURS)
    b, length = batch.input_ids.shape
    foreign = torch.tensor([0, b * length], dtype=torch.int32)  # "one document": would leak if it were used
    with torch.no_grad():
        a = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        c = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                  cu_seq_lens_q=foreign, cu_seq_lens_k=foreign, max_length_q=b * length,
                  max_length_k=b * length).logits
    assert torch.equal(a, c)


# --- the varlen wrapper, against a kernel of varlen_attn's contract made of sdpa ----------------------------------

def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract (torch 2.13): [T, heads, d] rows cut by cu_seqlens;
    window_size (left, right), (-1, 0) causal."""
    out = torch.empty_like(q)
    bounds = cu_q.tolist()
    left, right = window_size
    for start, end in zip(bounds, bounds[1:]):
        n = end - start
        allowed = torch.ones(n, n, dtype=torch.bool)
        if right >= 0:
            allowed = allowed.tril(right)
        if left >= 0:
            allowed = allowed & allowed.new_ones(n, n).triu(-left)
        qq, kk, vv = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=scale,
                                                        enable_gqa=enable_gqa)[0].transpose(0, 1)
    return out


def _legacy_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
    """The signature of torch 2.10/2.11's varlen_attn: is_causal, no enable_gqa, no window."""
    assert k.shape[1] == q.shape[1], "no grouped-query heads in this signature: the wrapper repeats key/value"
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                             window_size=(-1, 0) if is_causal else (-1, -1))


def _qkv(batch, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    b, length = batch.input_ids.shape
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, length, heads, dim, generator=gen).transpose(1, 2)  # transformers' layout: a transposed view
    k, v = (torch.randn(b, length, kv_heads, dim, generator=gen).transpose(1, 2) for _ in range(2))
    return q, k, v


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("kernel", [_reference_varlen, _legacy_varlen], ids=["torch-2.13", "torch-2.11"])
@pytest.mark.parametrize("window", [None, 4])
def test_varlen_wrapper_equals_sdpa_per_document(kernel, window):
    if window is not None and kernel is _legacy_varlen:
        pytest.skip("that signature has no window: kernel_for keeps sdpa per document there")
    _, batch, _ = packed_batch()
    q, k, v = _qkv(batch)
    docs = Documents.of(batch.position_ids)
    want, _ = attention.sdpa_varlen_attention(_Module(), q, k, v, None, scaling=0.3,
                                              position_ids=batch.position_ids, sliding_window=window)
    got = packed_kernels.varlen(q, k, v, docs, 0.3, window, kernel=kernel)
    assert got.shape == want.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    assert (got - want).abs().max() <= 1e-6


def test_kernel_choice_and_its_switch(monkeypatch):
    _, batch, _ = packed_batch()
    q, _, _ = _qkv(batch)
    docs = Documents.of(batch.position_ids)
    monkeypatch.delenv(packed_kernels.KERNEL_ENV, raising=False)
    assert packed_kernels.kernel_for(q, 0.0, None, docs) == "sdpa"  # a CPU: sdpa per document
    assert "CUDA only" in packed_kernels.varlen_problem(torch.device("cpu"), torch.bfloat16, 64)
    assert "bfloat16" in packed_kernels.varlen_problem(torch.device("cuda"), torch.float32, 64)
    kernel, why = packed_kernels.describe(torch.device("cpu"), torch.float32, 64)
    assert kernel == "sdpa per document" and "CUDA only" in why
    flex = Documents.of(batch.position_ids)
    flex.kernel = "flex"
    assert packed_kernels.kernel_for(q, 0.0, None, flex) == "flex"
    with pytest.raises(UserError, match="dropout"):
        packed_kernels.kernel_for(q, 0.1, None, flex)
    flex.kernel = "varlen"
    with pytest.raises(UserError, match="CUDA only"):
        packed_kernels.kernel_for(q, 0.0, None, flex)
    # The setting: the recipe's, unless the environment overrides it (read once per run, by the model with loss).
    assert packed_kernels.setting("flex") == "flex"
    monkeypatch.setenv(packed_kernels.KERNEL_ENV, "sdpa")
    assert packed_kernels.setting("flex") == "sdpa"
    monkeypatch.setenv(packed_kernels.KERNEL_ENV, "fast")
    with pytest.raises(UserError, match="auto, varlen, flex, sdpa"):
        packed_kernels.setting()


# --- flex_attention: forward on a CPU -------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 4])
def test_flex_block_mask_is_causal_within_each_document(window):
    _, batch, _ = packed_batch()
    b, length = batch.input_ids.shape
    docs = Documents.of(batch.position_ids)
    mask = packed_kernels.block_mask(docs, torch.device("cpu"), window)
    assert packed_kernels.block_mask(docs, torch.device("cpu"), window) is mask  # one per micro-batch, shared
    dense = mask.to_dense()  # which blocks are computed: every allowed score must be in one
    allowed = torch.zeros(b, length, length, dtype=torch.bool)
    for row, spans in enumerate(docs.spans):
        for start, end in spans:
            n = end - start
            block = torch.ones(n, n, dtype=torch.bool).tril()
            allowed[row, start:end, start:end] = block & block.new_ones(n, n).triu(-(window - 1)) if window else block
    size = mask.BLOCK_SIZE[0]
    for row in range(b):
        q_blocks, k_blocks = allowed[row].nonzero().div(size, rounding_mode="floor").unbind(1)
        assert dense[row, 0, q_blocks, k_blocks].all()
    q, k, v = _qkv(batch)
    want, _ = attention.sdpa_varlen_attention(_Module(), q, k, v, None, scaling=0.3,
                                              position_ids=batch.position_ids, sliding_window=window)
    got = packed_kernels.flex(q, k, v, docs, 0.3, window)
    assert (got - want).abs().max() <= 1e-5


def test_flex_keeps_documents_apart_in_a_model(monkeypatch):
    """The whole model with model.packed_attention flex, forward on a CPU: the same logits as sdpa per document
    (fp32) and the start-of-run isolation check finds no leak."""
    _, batch, _ = packed_batch()
    model = tiny_model(transformers.LlamaConfig, OURS)
    docs = Documents.of(batch.position_ids)
    with torch.no_grad():
        want = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                     **docs.model_kwargs("sdpa")).logits
        got = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                    **docs.model_kwargs("flex")).logits
    assert (got - want).abs().max() <= 1e-5
    assert check_packing_isolation(model, VOCAB, kernel="flex") <= default_tolerance(torch.float32)


# --- CUDA --------------------------------------------------------------------------------------------------------

def _gpu_forward_backward(model: torch.nn.Module, batch, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_backward(model, batch.to("cuda"), **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.Qwen2Config])
def test_cuda_kernels_equal_sdpa_with_a_block_mask(kernel: str, config_cls: type, monkeypatch):
    """bf16 on CUDA: logits and gradients of varlen_attn (auto's choice) and flex_attention equal transformers'
    sdpa behind its block-diagonal mask to bf16 precision, and the isolation check passes."""
    if kernel == "varlen" and packed_kernels.varlen_problem(torch.device("cuda"), torch.bfloat16, 8):
        pytest.skip(packed_kernels.varlen_problem(torch.device("cuda"), torch.bfloat16, 8))
    _, batch, _ = packed_batch()
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)  # head_dim 16: flash attention's multiple of 8
    results = {}
    for impl in ("sdpa", OURS):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                                              dtype=torch.bfloat16).cuda().train()
        kwargs = Documents.of(batch.position_ids, "cuda").model_kwargs(kernel) if impl == OURS else {}
        results[impl] = _gpu_forward_backward(model, batch, **kwargs)
    (ref_logits, ref_grads), (logits, grads) = results["sdpa"], results[OURS]
    assert (logits.float() - ref_logits.float()).abs().max() <= 1e-2 * ref_logits.float().abs().max()
    assert (grads.float() - ref_grads.float()).norm() <= 2e-2 * ref_grads.float().norm()
    assert check_packing_isolation(model, VOCAB, kernel=kernel) <= default_tolerance(torch.bfloat16)
