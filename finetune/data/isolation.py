"""Prove, on the real model, that packed documents do not see each other.

Packing (``finetune.data.pack``) relies on transformers detecting document boundaries from
``position_ids`` that restart at 0 when no attention_mask is passed and no cache is used. Whether that
holds depends on the model class, the attn_implementation, the transformers version and any wrapper
around the model, so rather than trusting it we measure it once before training: the logits of each
document inside a packed micro-batch must equal the logits of that document run alone.
"""

from __future__ import annotations

import torch

from finetune.data.pack import collate_packed
from finetune.errors import UserError

__all__ = ["check_packing_isolation", "default_tolerance"]

# Two short documents of different lengths; a fixed generator so the check is reproducible.
_DOC_LENGTHS = (7, 11)
_SEED = 1234


def default_tolerance(dtype: torch.dtype, device: torch.device | None = None) -> float:
    """Largest packed-vs-alone max abs logit error that still counts as isolated.

    fp32: the packed and the alone runs differ only in matmul shapes/reduction order and in the
    masked softmax (masked keys give exactly 0), which costs ~1e-7 on tiny models and ~1e-5 on real
    ones; 1e-4 leaves headroom while a leak moves logits by 1e-1 or more (measured 0.18-0.23 on
    tiny random Llama/Qwen2 models, far more on trained ones).
    bf16/fp16 (and fp32 with TF32 matmuls on CUDA, which keep a 10-bit mantissa): every matmul
    rounds to ~3 significant digits, and different shapes round differently, so identical maths
    differs by a few units in the last place of O(1) activations, ~1e-2; 5e-2 is above that noise
    and still well below a leak.
    """
    if dtype in (torch.bfloat16, torch.float16):
        return 5e-2
    if (
        dtype == torch.float32
        and device is not None
        and device.type == "cuda"
        and torch.backends.cuda.matmul.allow_tf32
    ):
        return 5e-2
    return 1e-4


def _input_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    # Inputs go where the embeddings are (models may be spread over devices); the compute dtype is
    # that of the first floating-point weight (quantized models also hold integer tensors).
    device = None
    get_emb = getattr(model, "get_input_embeddings", None)
    if callable(get_emb):
        emb = get_emb()
        if emb is not None and getattr(emb, "weight", None) is not None:
            device = emb.weight.device
    dtype = torch.float32
    for p in model.parameters():
        if device is None:
            device = p.device
        if p.is_floating_point():
            dtype = p.dtype
            break
    return device or torch.device("cpu"), dtype


def _logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    # Exactly how packed batches are run in training: keyword args, no attention_mask, no cache.
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float()


def check_packing_isolation(model: torch.nn.Module, vocab_size: int, *, tolerance: float | None = None) -> float:
    """Return the max abs logit error between packed and separately-run documents.

    Runs two random documents (lengths 7 and 11) packed in one row, plus a second row holding the
    11-token document followed by padding (as ``collate_packed`` pads), and compares each document's
    logits with the same document run alone. Uses the model's own device and dtype, under no_grad in
    eval mode (each module's training flag is restored afterwards). Raises :class:`UserError` when
    the error exceeds ``tolerance`` (default: :func:`default_tolerance` of the model's dtype).
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    device, dtype = _input_device_dtype(model)
    if tolerance is None:
        tolerance = default_tolerance(dtype, device)

    gen = torch.Generator().manual_seed(_SEED)
    docs = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in _DOC_LENGTHS]
    a, b = docs

    def row(*ds: list[int]) -> dict:
        ids = [t for d in ds for t in d]
        return {"input_ids": ids, "labels": ids, "position_ids": [p for d in ds for p in range(len(d))]}

    batch = collate_packed([row(a, b), row(b)], pad_token_id=0)
    # (row in the batch, start, document) for every real document in the packed batch
    spans = [(0, 0, a), (0, len(a), b), (1, 0, b)]

    # Remember each module's own flag: model.train(True) afterwards would wake modules that the
    # caller deliberately keeps in eval mode (e.g. a frozen base under an adapter).
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            packed = _logits(model, batch["input_ids"].to(device), batch["position_ids"].to(device))
            alone = {}
            for d in docs:
                ids = torch.tensor([d], dtype=torch.long, device=device)
                pos = torch.arange(len(d), device=device).unsqueeze(0)
                alone[len(d)] = _logits(model, ids, pos)[0]
    finally:
        for m, was_training in modes:
            m.training = was_training

    # torch's max propagates NaN (Python's max() would drop it), and NaN must fail the check.
    error = torch.stack(
        [(packed[r, start : start + len(d)] - alone[len(d)]).abs().max() for r, start, d in spans]
    ).max().item()

    if not error <= tolerance:  # also catches NaN
        config = getattr(model, "config", None)
        impl = getattr(config, "_attn_implementation", None) or "unknown"
        raise UserError(
            f"data.packing: packed documents are leaking attention with this attn_implementation "
            f"({impl!r}, {dtype}): the logits of a document packed with another differ from the same "
            f"document run alone by {error:.3g} (tolerance {tolerance:.1g}), so training would let "
            "samples see each other. Set model.attn_implementation to 'sdpa' or 'flash_attention_2', "
            "or turn packing off (data.packing: false). If you are sure this is numerical noise, skip "
            "the check with data.packing_check: false."
        )
    return error
