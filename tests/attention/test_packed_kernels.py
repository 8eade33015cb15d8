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
from packed_rows import VOCAB, packed_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from finetune import batch as batch_module
from finetune.attention import dispatch as attention
from finetune.attention import kernels as packed_kernels
from finetune.batch import DOCUMENTS_KWARG, Documents, document_spans
from finetune.errors import UserError
from finetune.model.isolation import check_packing_isolation, default_tolerance, packed_attention

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


# --- the varlen wrapper, against stand-ins with torch's two signatures of varlen_attn --------------------------

def _attend(q, k, v, cu_q, scale, window_size):
    """What flash attention computes over [T, heads, d] rows cut by cu_seqlens: window_size (left, right), -1 for
    no limit ((-1, 0): causal)."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
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
                                                        enable_gqa=kk.shape[1] != qq.shape[1])[0].transpose(0, 1)
    return out


def _flash_checks(query, key, value, enable_gqa):
    # varlen_attn's own check (torch 2.13; 2.11 has no enable_gqa: heads must be equal), and flash attention's one
    # head size for query, key and value.
    if not enable_gqa and query.size(1) != key.size(1):
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={query.size(1)} "
                         f"and Hkv={key.size(1)}. Try setting enable_gqa=True for GQA.")
    assert query.shape[-1] == key.shape[-1] == value.shape[-1], "flash attention: one head size for q, k and v"


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's torch.nn.attention.varlen.varlen_attn: its exact signature (compared with the installed torch's
    by test_the_stand_in_has_this_torchs_signature), computed with sdpa on the CPU."""
    _flash_checks(query, key, value, enable_gqa)
    return _attend(query, key, value, cu_seq_q, scale, window_size)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    """torch 2.11's varlen_attn (docs.pytorch.org/docs/2.11, nn.attention.varlen): keyword-only scale and
    window_size, no enable_gqa, so key/value carry as many heads as the query."""
    _flash_checks(query, key, value, enable_gqa=False)
    return _attend(query, key, value, cu_seq_q, scale, window_size)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's varlen_attn: is_causal, no scale, no window. Not used (varlen_problem says why)."""
    raise AssertionError("the wrapper must not call torch 2.10's varlen_attn")


@pytest.fixture
def fresh_choice():
    """The kernel choice is cached per run; tests that swap the varlen kernel or the environment start afresh."""
    packed_kernels.choose.cache_clear()
    packed_kernels.reread_environment()
    yield
    packed_kernels.choose.cache_clear()
    packed_kernels.reread_environment()


def _use_varlen(monkeypatch, kernel) -> None:
    """Packed attention runs `kernel` as torch's varlen_attn, on the CPU (the choice forced, the wrapper real)."""
    monkeypatch.setattr(packed_kernels, "_varlen_attn", lambda: kernel)
    monkeypatch.setattr(packed_kernels, "kernel_for", lambda *args: "varlen")


# Which stand-in describes this torch's varlen_attn (2.12's is 2.13's, per its documentation).
STAND_INS = {"2.11": varlen_2_11, "2.12": varlen_2_13, "2.13": varlen_2_13}


def test_the_stand_in_has_this_torchs_signature():
    """The stand-in of the installed torch (2.13 here; 2.11 on the GPU machines we reach) has its varlen_attn's
    exact signature: names, kinds and defaults."""
    import inspect

    version = ".".join(torch.__version__.split(".")[:2])
    if version not in STAND_INS:
        pytest.skip(f"no stand-in describes torch {version}'s varlen_attn")
    from torch.nn.attention.varlen import varlen_attn

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    assert shape(varlen_attn) == shape(STAND_INS[version])


def _qkv(batch, heads: int = 4, kv_heads: int = 2, dim: int = 8, v_dim: int | None = None):
    b, length = batch.input_ids.shape
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, length, heads, dim, generator=gen).transpose(1, 2)  # transformers' layout: a transposed view
    k = torch.randn(b, length, kv_heads, dim, generator=gen).transpose(1, 2)
    v = torch.randn(b, length, kv_heads, v_dim or dim, generator=gen).transpose(1, 2)
    return q, k, v


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("kernel", [varlen_2_13, varlen_2_11], ids=["torch-2.13", "torch-2.11"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("v_dim", [8, 4], ids=["v-as-q", "mla-v-smaller"])
def test_varlen_wrapper_equals_sdpa_per_document(kernel, window, v_dim):
    """Grouped-query heads (4 on 2), sliding windows, and MLA's smaller value head (zero-padded for flash attention,
    the output cut back) under both signatures: the per-document sdpa result to 1e-6 (fp32)."""
    _, batch, _ = packed_batch()
    q, k, v = _qkv(batch, v_dim=v_dim)
    docs = Documents.of(batch.position_ids)
    want, _ = attention.sdpa_varlen_attention(_Module(), q, k, v, None, scaling=0.3,
                                              position_ids=batch.position_ids, sliding_window=window)
    got = packed_kernels.varlen(q, k, v, docs, 0.3, window, kernel=kernel)
    assert got.shape == want.shape == (q.shape[0], q.shape[2], q.shape[1], v_dim)
    assert (got - want).abs().max() <= 1e-6


def test_varlen_choice_by_torch_signature_and_head_sizes(monkeypatch, fresh_choice):
    """On CUDA in bf16 (asked of the choice, no GPU needed): varlen under torch 2.11's and 2.13's signatures, an MLA
    value head smaller than the query's padded, a larger one or a head size flash attention refuses -> one masked
    sdpa call, and torch 2.10's signature (no scale, no window) is not used."""
    cuda = torch.device("cuda")
    for kernel in (varlen_2_13, varlen_2_11):
        monkeypatch.setattr(packed_kernels, "_varlen_attn", lambda k=kernel: k)
        packed_kernels.choose.cache_clear()
        assert packed_kernels.choose("auto", cuda, torch.bfloat16, 64, 64, 0.0)[0] == "varlen"
        kernel_name, why = packed_kernels.choose("auto", cuda, torch.bfloat16, 192, 128, 0.0)  # DeepSeek-V3's sizes
        assert kernel_name == "varlen" and "value head 128 padded to 192" in why
        assert packed_kernels.choose("auto", cuda, torch.bfloat16, 64, 128, 0.0) == (
            "masked", "auto: value head size 128 larger than the query's 64")
        assert packed_kernels.choose("auto", cuda, torch.bfloat16, 320, 320, 0.0)[0] == "masked"
        assert packed_kernels.choose("auto", cuda, torch.float32, 64, 64, 0.0)[0] == "masked"  # item 4: fp32
        assert packed_kernels.choose("auto", cuda, torch.bfloat16, 64, 64, 0.1) == (
            "masked", "auto: attention dropout 0.1 (varlen_attn has none)")
    monkeypatch.setattr(packed_kernels, "_varlen_attn", lambda: varlen_2_10)
    packed_kernels.choose.cache_clear()
    assert "predates 2.11" in packed_kernels.varlen_problem(cuda, torch.bfloat16, 64)
    assert packed_kernels.choose("auto", cuda, torch.bfloat16, 64, 64, 0.0)[0] == "masked"
    with pytest.raises(UserError, match="predates 2.11"):
        packed_kernels.choose("varlen", cuda, torch.bfloat16, 64, 64, 0.0)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "minicpm3"])
@pytest.mark.parametrize("kernel", [varlen_2_13, varlen_2_11], ids=["torch-2.13", "torch-2.11"])
def test_mla_models_train_packed_through_varlen(model_type, kernel, monkeypatch, fresh_choice):
    """MLA models (value head 8, query/key head 16) through the varlen wrapper with a stand-in kernel: the logits
    and gradients of sdpa per document (fp32, 1e-5), and the isolation check holds. Before the fix the wrapper
    reshaped V with the query's head size and raised."""
    from tiny_configs import tiny_kwargs

    config = transformers.AutoConfig.for_model(model_type, **tiny_kwargs(model_type, VOCAB))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=OURS).train()
    dims = {(m.qk_head_dim, m.v_head_dim) for m in model.modules() if hasattr(m, "v_head_dim")}
    assert dims == {(16, 8)}
    _, batch, _ = packed_batch()
    want = _forward_backward(model, batch, **Documents.of(batch.position_ids).model_kwargs("sdpa"))
    _use_varlen(monkeypatch, kernel)
    got = _forward_backward(model, batch, **Documents.of(batch.position_ids).model_kwargs())
    assert (got[0] - want[0]).abs().max() <= 1e-5
    assert (got[1] - want[1]).norm() <= 1e-5 * want[1].norm()
    assert check_packing_isolation(model, VOCAB) <= default_tolerance(torch.float32)


def test_kernel_choice_and_its_switch(monkeypatch, fresh_choice):
    _, batch, _ = packed_batch()
    q, _, v = _qkv(batch)
    docs = Documents.of(batch.position_ids)
    monkeypatch.delenv(packed_kernels.KERNEL_ENV, raising=False)
    assert packed_kernels.kernel_for(q, v, 0.0, docs) == "sdpa"  # a CPU: sdpa per document
    assert "CUDA only" in packed_kernels.varlen_problem(torch.device("cpu"), torch.bfloat16, 64)
    assert "bfloat16" in packed_kernels.varlen_problem(torch.device("cuda"), torch.float32, 64)
    kernel, why = packed_kernels.describe([("attention", 64, 64, 0.0)], torch.device("cpu"), torch.float32)
    assert kernel == "sdpa per document" and "CUDA only" in why
    flex = Documents.of(batch.position_ids)
    flex.kernel = "flex"
    assert packed_kernels.kernel_for(q, v, 0.0, flex) == "flex"
    with pytest.raises(UserError, match="dropout"):
        packed_kernels.kernel_for(q, v, 0.1, flex)
    flex.kernel = "varlen"
    with pytest.raises(UserError, match="CUDA only"):
        packed_kernels.kernel_for(q, v, 0.0, flex)


def test_the_environment_override_is_read_once(monkeypatch, fresh_choice):
    """model.packed_attention, unless FINETUNE_PACKED_ATTENTION overrides it; the variable is read once per process,
    so every part of a run (the model with its loss, the isolation check, the record) sees the same setting."""
    monkeypatch.delenv(packed_kernels.KERNEL_ENV, raising=False)
    assert packed_kernels.setting("flex") == "flex"
    monkeypatch.setenv(packed_kernels.KERNEL_ENV, "sdpa")
    assert packed_kernels.setting("flex") == "flex"  # read already: unset
    packed_kernels.reread_environment()
    assert packed_kernels.setting("flex") == packed_kernels.setting("auto") == "sdpa"
    monkeypatch.setenv(packed_kernels.KERNEL_ENV, "varlen")
    assert packed_kernels.setting("auto") == "sdpa"
    monkeypatch.setenv(packed_kernels.KERNEL_ENV, "fast")
    packed_kernels.reread_environment()
    with pytest.raises(UserError, match="auto, varlen, flex, sdpa"):
        packed_kernels.setting()


# --- the record of what runs (versions.json's run record, `finetune runs compare`) -----------------------------

def _tiny(model_type: str, dtype: torch.dtype = torch.float32, **config) -> torch.nn.Module:
    from tiny_configs import tiny_kwargs

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **{**tiny_kwargs(model_type, VOCAB), **config})
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=OURS, dtype=dtype)


def test_the_record_says_what_each_layer_runs(monkeypatch, fresh_choice):
    """The kernel recorded for a run is the one each attention call picks: attention dropout and head sizes count
    (before: the record said varlen_attn where sdpa ran), named per layer kind where kinds differ (Gemma 4's full
    layers have heads of 512, past flash attention's 256). Asked for CUDA in bf16 with torch 2.13's signature."""
    monkeypatch.setattr(packed_kernels, "_varlen_attn", lambda: varlen_2_13)
    cuda = torch.device("cuda")
    dropout = _tiny("llama", torch.bfloat16, attention_dropout=0.1)
    assert packed_attention(dropout, cuda) == ("sdpa with a block-diagonal mask",
                                               "auto: attention dropout 0.1 (varlen_attn has none)")
    assert packed_attention(_tiny("llama", torch.bfloat16), cuda) == ("varlen_attn", "auto: cuda, bfloat16, head_dim 8")
    assert packed_attention(_tiny("deepseek_v2", torch.bfloat16), cuda) == (
        "varlen_attn", "auto: cuda, bfloat16, head_dim 16, value head 8 padded to 16")
    assert packed_attention(_tiny("gemma4_text", torch.bfloat16), cuda) == (
        "varlen_attn (sliding_attention layers); sdpa with a block-diagonal mask (full_attention layers)",
        "sliding_attention: auto: cuda, bfloat16, head_dim 8; full_attention: auto: flash attention takes head "
        "dimensions up to 256 in multiples of 8 (here: 512)")
    assert packed_attention(dropout, torch.device("cpu"), "sdpa") == (
        "sdpa per document", f"model.packed_attention sdpa (or {packed_kernels.KERNEL_ENV})")


@pytest.mark.parametrize("model_type", ["gemma4_text", "deepseek_v2"])
def test_the_recorded_layer_facts_are_those_the_attention_calls_see(model_type, monkeypatch):
    """What the record decides from (each attention module's head sizes and training dropout) is what the
    attention calls hand `kernel_for` in a training forward, so the recorded choice is the one made."""
    from finetune.model.isolation import attention_layers

    model = _tiny(model_type, attention_dropout=0.25).train()
    seen = []
    real = packed_kernels.kernel_for

    def spy(query, value, dropout, docs):
        seen.append((query.shape[-1], value.shape[-1], dropout))
        return real(query, value, 0.0, docs)  # sdpa per document on the CPU
    monkeypatch.setattr(packed_kernels, "kernel_for", spy)
    _, batch, _ = packed_batch()
    model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
          **Documents.of(batch.position_ids).model_kwargs())
    assert seen == [tuple(facts) for _, *facts in attention_layers(model)]


def _render(table) -> str:
    import io

    from rich.console import Console

    console = Console(width=250, record=True, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.export_text()


def test_the_run_directory_records_the_packed_kernel_and_compare_shows_it(tmp_path, fresh_choice):
    """Two one-step packed runs, the recipe's setting (auto) and the sdpa one: versions.json's run record names the
    kernel and why, and `finetune runs compare` shows both, side by side."""
    import json

    from conftest import REPO_ROOT, tiny_recipe

    from finetune.commands.compare import compare_runs
    from finetune.recipe import validate
    from finetune.train.loop import train

    data = REPO_ROOT / "examples" / "data" / "quickstart_train.jsonl"
    runs = []
    for setting in ("auto", "sdpa"):
        recipe = tiny_recipe(tmp_path / setting, data)
        recipe["model"]["packed_attention"] = setting
        runs.append(train(validate(recipe)))
    records = [json.loads((run / "versions.json").read_text())["run"] for run in runs]
    assert [r["packed_kernel"] for r in records] == ["sdpa per document"] * 2
    assert records[0]["packed_kernel_why"] == "auto: varlen_attn runs on CUDA only (here: cpu)"
    assert records[1]["packed_kernel_why"] == f"model.packed_attention sdpa (or {packed_kernels.KERNEL_ENV})"
    text = _render(compare_runs(*map(str, runs)))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in text.splitlines() if line.count("│") >= 4}
    assert rows["packed kernel"] == ["sdpa per document"] * 2
    assert rows["packed kernel: why"] == [r["packed_kernel_why"] for r in records]
    assert rows["attention"] == [OURS] * 2 and rows["loss"] == ["chunked"] * 2


# --- one masked sdpa call per layer: auto's kernel on CUDA where varlen_attn cannot run (fp32) ---------------------

@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("v_dim", [8, 4], ids=["v-as-q", "mla-v-smaller"])
def test_masked_kernel_equals_sdpa_per_document(window, v_dim):
    """fp32, grouped-query heads: outputs and input gradients of the per-document loop to 1e-5, from one mask per
    micro-batch (built by the first call, shared by the next)."""
    _, batch, _ = packed_batch()
    docs = Documents.of(batch.position_ids)
    results = []
    for run in ("loop", "masked"):
        q, k, v = (t.detach().requires_grad_() for t in _qkv(batch, v_dim=v_dim))
        if run == "loop":
            out, _ = attention.sdpa_varlen_attention(_Module(), q, k, v, None, scaling=0.3,
                                                     position_ids=batch.position_ids, sliding_window=window)
        else:
            out = packed_kernels.masked(q, k, v, docs, 0.3, window)
        out.pow(2).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for want, got in zip(*results):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5
    mask = packed_kernels.dense_mask(docs, torch.device("cpu"), torch.float32, window)
    assert packed_kernels.dense_mask(docs, torch.device("cpu"), torch.float32, window) is mask
    assert mask.shape == (2, 1, docs.length, docs.length) and mask.stride(2) % 16 == 0


class _CountAttention(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += "scaled_dot_product" in str(func) and "backward" not in str(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.Qwen2Config])
def test_masked_kernel_in_a_model(config_cls, monkeypatch, fresh_choice):
    """The whole model with the masked kernel (what fp32 packed rows run on CUDA): one attention call per layer
    instead of one per document, the logits and gradients of sdpa per document (fp32: 1e-5), and the isolation
    check finds no leak."""
    _, batch, _ = packed_batch()
    model = tiny_model(config_cls, OURS).train()
    docs = Documents.of(batch.position_ids)
    with _CountAttention() as loop:
        want = _forward_backward(model, batch, **docs.model_kwargs("sdpa"))
    monkeypatch.setattr(packed_kernels, "kernel_for", lambda *args: "masked")
    with _CountAttention() as fused:
        got = _forward_backward(model, batch, **Documents.of(batch.position_ids).model_kwargs())
    layers = model.config.num_hidden_layers
    assert fused.calls == layers and loop.calls == layers * len(docs.cu_seqlens[1:])  # one per document and layer
    assert (got[0] - want[0]).abs().max() <= 1e-5
    assert (got[1] - want[1]).norm() <= 1e-5 * want[1].norm()
    assert check_packing_isolation(model, VOCAB) <= default_tolerance(torch.float32)


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


def test_block_masks_are_built_without_the_deprecated_compile_flag():
    """create_block_mask(..., _compile=True) is deprecated in torch 2.13: CUDA compiles create_block_mask itself, as
    2.13 recommends (2.11 takes it too); a CPU builds it plainly. Either way no DeprecationWarning."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask

    cuda = packed_kernels.block_mask_builder(torch.device("cuda"))
    assert cuda._torchdynamo_orig_callable is create_block_mask
    assert packed_kernels.block_mask_builder(torch.device("cuda")) is cuda  # compiled once per process
    assert packed_kernels.block_mask_builder(torch.device("cpu")) is create_block_mask
    _, batch, _ = packed_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        packed_kernels.block_mask(Documents.of(batch.position_ids), torch.device("cpu"))


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
@pytest.mark.parametrize(("kernel", "dtype"), [("varlen", torch.bfloat16), ("flex", torch.bfloat16),
                                               ("auto", torch.float32)], ids=["varlen", "flex", "auto-fp32-masked"])
@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.Qwen2Config])
def test_cuda_kernels_equal_sdpa_with_a_block_mask(kernel: str, dtype: torch.dtype, config_cls: type, monkeypatch):
    """On CUDA: logits and gradients of varlen_attn (auto's choice in bf16), flex_attention and the masked sdpa call
    (auto's choice in fp32) equal transformers' sdpa behind its block-diagonal mask to the dtype's precision, and
    the isolation check passes."""
    if kernel == "varlen" and packed_kernels.varlen_problem(torch.device("cuda"), torch.bfloat16, 8):
        pytest.skip(packed_kernels.varlen_problem(torch.device("cuda"), torch.bfloat16, 8))
    _, batch, _ = packed_batch()
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)  # head_dim 16: flash attention's multiple of 8
    results = {}
    for impl in ("sdpa", OURS):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                                              dtype=dtype).cuda().train()
        kwargs = Documents.of(batch.position_ids, "cuda").model_kwargs(kernel) if impl == OURS else {}
        results[impl] = _gpu_forward_backward(model, batch, **kwargs)
    if kernel == "auto":
        assert packed_attention(model, torch.device("cuda"))[0] == "sdpa with a block-diagonal mask"
    (ref_logits, ref_grads), (logits, grads) = results["sdpa"], results[OURS]
    rel = 1e-4 if dtype == torch.float32 else 1e-2
    assert (logits.float() - ref_logits.float()).abs().max() <= rel * ref_logits.float().abs().max()
    assert (grads.float() - ref_grads.float()).norm() <= 2 * rel * ref_grads.float().norm()
    assert check_packing_isolation(model, VOCAB, kernel=kernel) <= default_tolerance(dtype, torch.device("cuda"))
