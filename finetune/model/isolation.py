"""Prove, on the real model, that packed documents do not see each other.

Packed rows carry no attention mask: the model's attention must take the documents from the position_ids that
restart at 0 for each of them (finetune/attention/dispatch.py under `attn_implementation: auto`; transformers' own
packed-sequence detection under sdpa, eager and flash_attention_2, which only happens with the cache off).
Whether that holds depends on the model class, the attention implementation, the transformers version and any
wrapper around the model, so it is measured once before a packed run trains, on the run's device and dtype.

What is measured: the same packed micro-batch is run twice, the second time with the tokens of the *first*
document replaced. Shapes, positions and kernels are identical between the two runs, so any change in the
logits of the other documents can only come from attention crossing a document (or a batch-row) boundary.
When isolation holds the change is exactly 0 in every dtype we measured (masked keys contribute exact zeros),
up to rounding in MoE models (default_tolerance); a leak of attention moves logits by ~0.1 on tiny random models
and by ~14 on SmolLM2-135M. Layers that carry a state along the sequence can leak far less, so they are refused
from the model's structure first (check_packable). Why not compare "packed" with
"each document alone": the two use different shapes and kernels, whose noise in half precision is as large as
a leak (docs/design.md, "Packing").
"""

from __future__ import annotations

import torch

from finetune.attention.dispatch import is_ours
from finetune.attention.kernels import describe
from finetune.batch import Documents
from finetune.data.collate import collate_packed
from finetune.errors import UserError
from finetune.model.architectures import packing_refusal
from finetune.model.score_head import is_score_model, score_layers
from finetune.model.with_loss import takes_boundaries

__all__ = ["attention_layers", "check_packable", "check_packing_isolation", "default_tolerance", "input_dtype",
           "is_ours", "packed_attention"]

# Two short documents of different lengths; a fixed generator so the check is reproducible.
_DOC_LENGTHS = (7, 11)
_SEED = 1234
_PAD_ID = 0


def check_packable(model: torch.nn.Module, pad_token_id: int | None) -> None:
    """Refuse packing for a model whose structure lets packed documents see each other whatever the dtype and
    the device (layers carrying a state along the sequence, attention transformers does not isolate), or whose
    padding trains to NaN. Runs whether or not data.packing_check is on: no measurement can make these right."""
    why = packing_refusal(model, pad_token_id)
    if why:
        raise UserError(why)


def default_tolerance(dtype: torch.dtype, device: torch.device | None = None) -> float:
    """Largest cross-document logit change that still counts as isolated, by compute dtype and device.

    With isolation the measured change is exactly 0: the two runs have the same shapes and kernels, and masked
    keys contribute exact zeros (fp32, CPU, every architecture of docs/models.md), except for rounding where an
    MoE expert's matmul gets another number of rows because the other document routes differently (FlexOlmo:
    7.5e-8, and 0.0 in float64). A tolerance absorbs that and kernels that are not bit-reproducible run to run,
    a few units in the last place of O(1-30) logits:
      - fp32 on a CPU: 1e-5, a few ulps of a logit of 20. Leaks of short convolutions at random init are as
        small as 1e-4 (LFM2-MoE: 9.7e-5), which the former 1e-4 let through;
      - fp32 on CUDA: 1e-4 (atomics in scatter/index_add kernels, e.g. MoE expert sums, reorder additions);
      - bf16/fp16, and fp32 with TF32 matmuls on CUDA (8-11 bit mantissas): 5e-2.
    A leak of attention is far above all of them: >= 0.12 on tiny random Llama/Qwen2 models and ~14 on
    SmolLM2-135M in every dtype. Leaks that are small at any size, those of layers that carry a state along the
    sequence, are refused from the model's structure before this check runs (architectures.packing_refusal).
    """
    if dtype in (torch.bfloat16, torch.float16):
        return 5e-2
    if device is not None and device.type == "cuda":
        return 5e-2 if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else 1e-4
    return 1e-5


def packed_attention(model: torch.nn.Module, device: torch.device, kernel: str = "auto") -> tuple[str, str]:
    """(the kernel our attention runs packed rows of this model with on `device` under the run's setting `kernel`,
    why), for the run log and the run directory's record: what each attention layer will choose in training (its
    head sizes and attention dropout decide), named per layer kind where the kinds differ."""
    _, dtype = _input_device_dtype(model)
    return describe(attention_layers(model), device, dtype, kernel)


def attention_layers(model: torch.nn.Module) -> list[tuple[str, int, int, float]]:
    """(layer kind, query head size, value head size, attention dropout in training) of each attention module.

    From the modules, not the config: some configs (Gemma 4) vary head_dim by layer and refuse a global read, and
    MLA attention (DeepSeek-V2/V3, MiniCPM3, LongCat-Flash) has qk_head_dim and v_head_dim instead. The kind is the
    config's layer_types entry (sliding_attention, full_attention), or "attention"."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    kinds = getattr(get_text() if callable(get_text) else config, "layer_types", None)
    layers = []
    for m in model.modules():
        head_dim = getattr(m, "qk_head_dim", None) or getattr(m, "head_dim", None)
        if not isinstance(head_dim, int) or not hasattr(m, "attention_dropout"):
            continue
        v_head_dim = getattr(m, "v_head_dim", None)
        index = getattr(m, "layer_idx", None)
        kind = kinds[index] if isinstance(kinds, (list, tuple)) and isinstance(index, int) and index < len(kinds) \
            else "attention"
        dropout = getattr(m, "attention_dropout", 0.0)
        layers.append((str(kind), head_dim, v_head_dim if isinstance(v_head_dim, int) else head_dim,
                       float(dropout) if isinstance(dropout, (int, float)) else 0.0))
    return layers


def input_dtype(model: torch.nn.Module) -> torch.dtype:
    """The model's compute dtype: that of its first floating-point weight."""
    return _input_device_dtype(model)[1]


def _input_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    # Inputs go where the embeddings are (a model may be spread over devices); the compute dtype is
    # that of the first floating-point weight (quantized models also hold integer tensors).
    device = None
    get_emb = getattr(model, "get_input_embeddings", None)
    if callable(get_emb):
        weight = getattr(get_emb(), "weight", None)
        if isinstance(weight, torch.Tensor):
            device = weight.device
    dtype = torch.float32
    for p in model.parameters():
        if device is None:
            device = p.device
        if p.is_floating_point():
            dtype = p.dtype
            break
    return device or torch.device("cpu"), dtype


def _packed_logits(model: torch.nn.Module, rows: list[dict], device: torch.device, kernel: str) -> torch.Tensor:
    # Exactly how packed micro-batches are run in training: collate_packed's padding, keyword args
    # (works for PEFT wrappers too), the documents' boundaries found on the CPU (our attention's kernel for the
    # device: varlen_attn, flex_attention or sdpa per document), no attention_mask, no cache.
    batch = collate_packed(rows, pad_token_id=_PAD_ID)
    if is_score_model(model):  # a reward model: its backbone's hidden states (its head scores one token a row)
        model = score_layers(model)[0]
    documents = Documents.of(batch.position_ids, device).model_kwargs(kernel) if takes_boundaries(model) else {}
    out = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device), use_cache=False,
                **documents)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float()


def _row(*docs: list[int]) -> dict:
    ids = [t for d in docs for t in d]
    return {"input_ids": ids, "labels": ids, "position_ids": [p for d in docs for p in range(len(d))]}


def check_packing_isolation(
    model: torch.nn.Module, vocab_size: int, *, tolerance: float | None = None, kernel: str = "auto"
) -> float:
    """Return the max abs change of a packed document's logits caused by its neighbours.

    A micro-batch of two rows, ``[A | B]`` and ``[B | padding]`` (padded as ``collate_packed`` does),
    is run once, then again with document A's tokens all replaced. The logits of B in both rows must
    not change: row 0 catches attention across documents, row 1 attention across batch rows. Runs on
    the model's own device and dtype, under no_grad in eval mode (every module's training flag is
    restored afterwards). Raises :class:`UserError` when the change exceeds ``tolerance`` (default:
    :func:`default_tolerance` of the model's dtype). `kernel`: the run's packed-attention setting.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2 to build two different documents, got {vocab_size}")
    device, dtype = _input_device_dtype(model)
    # len(tokenizer) can exceed the embedding rows (added tokens before a resize): stay in range.
    get_emb = getattr(model, "get_input_embeddings", None)
    rows = getattr(get_emb(), "num_embeddings", None) if callable(get_emb) else None
    if isinstance(rows, int) and rows >= 2:
        vocab_size = min(vocab_size, rows)
    if tolerance is None:
        tolerance = default_tolerance(dtype, device)

    gen = torch.Generator().manual_seed(_SEED)
    n_a, n_b = _DOC_LENGTHS
    a = torch.randint(0, vocab_size, (n_a,), generator=gen)
    # Differs from A at every position, so every key/value of A changes.
    a2 = ((a + torch.randint(1, vocab_size, (n_a,), generator=gen)) % vocab_size).tolist()
    a = a.tolist()
    b = torch.randint(0, vocab_size, (n_b,), generator=gen).tolist()

    # Keep each module's own flag: model.train(True) afterwards would wake modules that the caller
    # deliberately keeps in eval mode (e.g. a frozen base under an adapter).
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            first = _packed_logits(model, [_row(a, b), _row(b)], device, kernel)
            second = _packed_logits(model, [_row(a2, b), _row(b)], device, kernel)
    finally:
        for m, was_training in modes:
            m.training = was_training

    # B's logits in row 0 (after A) and in row 1 (next to a row holding A). torch's max propagates NaN
    # (Python's max() would drop it), and NaN must fail the check.
    error = (
        torch.stack(
            [
                (first[0, n_a : n_a + n_b] - second[0, n_a : n_a + n_b]).abs().max(),
                (first[1, :n_b] - second[1, :n_b]).abs().max(),
            ]
        )
        .max()
        .item()
    )

    if not error <= tolerance:  # written this way so that NaN fails too
        config = getattr(model, "config", None)
        impl = getattr(config, "_attn_implementation", None) or "unknown"
        raise UserError(
            f"data.packing: packed documents are leaking attention with this attn_implementation "
            f"({impl!r}, {dtype}): changing one document of a packed row changed the logits of "
            f"another by {error:.3g} (tolerance {tolerance:.1g}), so training would let samples see "
            "each other. Set model.attn_implementation to 'auto' (documents found from position_ids), 'sdpa' or "
            "'flash_attention_2' (if it already is, "
            "the model must run packed rows with use_cache=False and no attention_mask), or turn "
            "packing off with data.packing: false. To skip this check (not recommended), set "
            "data.packing_check: false."
        )
    return error
