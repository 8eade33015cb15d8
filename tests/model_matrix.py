"""The support matrix: every decoder-only causal LM architecture of the pinned transformers, built tiny with random
weights through finetune's own load path, and what finetune does with it (tests/model/test_models.py asserts it,
scripts/gen_models_doc.py writes it to docs/models.md).

For each architecture, in fp32 on the CPU (`evaluate`, computed once and cached):
  1. load: `finetune.model.loading.load_model` (attn_implementation auto) builds it, or refuses it with a message;
  2. loss: the fused loss (chunked and torch) against the model's own `model(labels=...)`, loss and gradients;
  3. packing: refused from the model's structure, or the isolation check's exact change of a neighbour's logits;
  4. LoRA: `target_modules: all-linear` through finetune's adapter path, and one optimizer step;
  5. trainer: one optimizer step of the real trainer (in-process), packed where packing is allowed.
Each check records what happened (never raises), so one architecture's failure is reported, not fatal.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tiny_configs import IDS, TOKENS, StubTokenizer, tiny_kwargs

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5

# Not decoder-only causal LMs here: the reason, shown in docs/models.md.
_ENCODER_DECODER = "the decoder half of an encoder-decoder model (cross-attention to an encoder)"
_MULTIMODAL = "multimodal (a vision, audio or speech model around a text decoder)"
OUT_OF_SCOPE = {
    **dict.fromkeys(("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
                     "pegasus", "plbart", "prophetnet", "trocr", "whisper", "bert-generation"), _ENCODER_DECODER),
    **dict.fromkeys(("gemma3", "gemma3n", "gemma4", "gemma4_unified", "got_ocr2", "fuyu", "mllama",
                     "moss_transcribe_diarize", "phi4_multimodal", "git", "emu3", "dots3_note", "minimax_m3_vl_text",
                     "qwen3_5", "qwen3_5_moe", "qwen4_exp", "musicgen", "musicgen_melody", "moshi"), _MULTIMODAL),
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"),
                    "a draft model for speculative decoding (reads the target model's key/value cache)"),
}


def architectures() -> list[str]:
    """Every model_type of transformers' causal-LM mapping that is in scope, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(mt for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if mt not in OUT_OF_SCOPE)


# --- the checks ------------------------------------------------------------------------------------------------

@dataclass
class Row:
    """What finetune does with one architecture. `*_error` holds an unexpected failure (the test fails on it)."""

    model_type: str
    refused: str | None = None  # the UserError of a load that refuses the architecture
    load_error: str | None = None
    head: str = ""  # the head transforms honoured, in words
    loss: dict = field(default_factory=dict)  # impl -> (loss relative difference, gradient relative difference)
    loss_error: str | None = None
    attention: str = ""  # the attn_implementation the model runs
    packing_refused: str | None = None
    leak: float | None = None  # max change of a neighbour document's logits, tolerance off
    packed_grads_finite: bool | None = None  # only where packing is refused for NaN
    lora_layers: int = 0
    lora_excluded: list[str] = field(default_factory=list)
    lora_losses: tuple[float, float] | None = None
    lora_error: str | None = None
    trainer: dict = field(default_factory=dict)  # the step's metrics line
    trainer_packed: bool | None = None
    trainer_error: str | None = None
    seconds: float = 0.0


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


@functools.cache
def evaluate(model_type: str) -> Row:
    """Every check of one architecture (see the module docstring), computed once per process."""
    import time

    from finetune.errors import UserError

    start = time.perf_counter()
    row = Row(model_type)
    with warnings.catch_warnings(), _quiet_transformers():
        warnings.simplefilter("ignore")
        try:
            model = _load(model_type)
        except UserError as e:
            row.refused = str(e)
        except Exception as e:  # noqa: BLE001 - recorded; test_models fails on it
            row.load_error = _short(e)
        if row.refused is None and row.load_error is None:
            for check in (_check_loss, _check_packing, _check_lora):
                check(row, model)
            del model
        if row.refused is None and row.load_error is None:
            _check_trainer(row)
    row.seconds = time.perf_counter() - start
    return row


@contextlib.contextmanager
def _quiet_transformers():
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def _load(model_type: str) -> torch.nn.Module:
    from finetune.model.loading import load_model
    from finetune.recipe import AdapterConfig, ModelConfig

    config = ModelConfig(init="random", config={"model_type": model_type, **tiny_kwargs(model_type)})
    return load_model(config, AdapterConfig(), StubTokenizer(), seed=0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 24 tokens, the first 5 of each and the last 3 of the second without a label."""
    ids = torch.randint(3, TOKENS, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, -3:] = -100
    return ids, labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _relative(ours: dict, own: dict) -> float:
    """||ours - own|| / ||own|| over every gradient; a gradient on one side only counts whole (inf if none)."""
    if set(ours) != set(own):
        return math.inf
    num = sum(float((ours[n] - own[n]).norm()) ** 2 for n in own)
    den = sum(float(own[n].norm()) ** 2 for n in own)
    return math.sqrt(num / den) if den else math.inf


def _check_loss(row: Row, model: torch.nn.Module) -> None:
    """The fused loss and its gradients against the model's own loss with labels, in train mode (dropout is 0)."""
    from finetune.model.with_loss import CausalLMWithLoss

    ids, labels = _batch()
    model.train()
    try:
        torch.manual_seed(0)
        own = model(input_ids=ids, labels=labels, use_cache=False).loss
        own.backward()
        own_grads = _grads(model)
        for impl in ("chunked", "torch"):
            net = CausalLMWithLoss(model, impl, 16, 0.0, None)
            torch.manual_seed(0)
            loss_sum, count = net(input_ids=ids, labels=labels)
            (loss_sum / count).backward()
            ours = float(loss_sum / count)
            row.loss[impl] = (abs(ours - float(own)) / abs(float(own)), _relative(_grads(model), own_grads))
        row.head = _head_words(net.head)
    except Exception as e:  # noqa: BLE001
        row.loss_error = _short(e)
        model.zero_grad(set_to_none=True)


def _head_words(spec) -> str:
    words = [f"logits x {spec.scale:.4g}"] if spec.scale != 1.0 else []
    words += [f"soft-cap {spec.softcap:g}"] if spec.softcap else []
    return ", ".join(words + ([f"logits[:{spec.vocab}]"] if spec.vocab is not None else []))


def _packed_batch():
    from finetune.data.collate import collate_packed

    g = torch.Generator().manual_seed(7)

    def row(*lengths: int) -> dict:
        docs = [torch.randint(3, TOKENS, (n,), generator=g).tolist() for n in lengths]
        return {"input_ids": [t for d in docs for t in d], "labels": [t for d in docs for t in [-100, *d[1:]]],
                "position_ids": [p for d in docs for p in range(len(d))]}

    return collate_packed([row(9, 13, 6), row(17, 5)], pad_token_id=StubTokenizer.pad_token_id)


def _check_packing(row: Row, model: torch.nn.Module) -> None:
    """The structural refusal, and the isolation check's measured change with the tolerance off: 0.0 exactly
    where packing is allowed, and > 0 (or NaN gradients) where it is refused, so no refusal is for nothing."""
    from finetune.model.architectures import packing_refusal
    from finetune.model.isolation import check_packing_isolation

    row.attention = model.config._attn_implementation
    row.packing_refused = packing_refusal(model, StubTokenizer.pad_token_id)
    try:
        row.leak = check_packing_isolation(model, TOKENS, tolerance=math.inf)
        if row.packing_refused and "NaN" in row.packing_refused:
            row.packed_grads_finite = _gradients_finite(model, _packed_batch())
    except Exception as e:  # noqa: BLE001
        row.loss_error = row.loss_error or f"packing: {_short(e)}"


def _inputs(batch) -> dict:
    """The model call's keywords: a collated MicroBatch's as the trainer passes them (documents found on the CPU),
    or a hand-built dict's tensors."""
    if not isinstance(batch, dict):
        return batch.to("cpu").model_inputs()
    return {k: batch[k] for k in ("input_ids", "labels", "attention_mask", "position_ids") if k in batch}


def _gradients_finite(model: torch.nn.Module, batch: dict) -> bool:
    from finetune.model.with_loss import CausalLMWithLoss

    loss_sum, count = CausalLMWithLoss(model, "chunked", 16, 0.0, None).train()(**_inputs(batch))
    (loss_sum / count).backward()
    return all(bool(torch.isfinite(g).all()) for g in _grads(model).values())


def _step(model: torch.nn.Module, batch: dict, lr: float) -> tuple[float, float]:
    """One AdamW step on `batch` through the fused loss: (the loss before, the loss after)."""
    from finetune.model.with_loss import CausalLMWithLoss
    from finetune.recipe import TrainConfig
    from finetune.train.optim import build_optimizer

    net = CausalLMWithLoss(model, "chunked", 16, 0.0, None).train()
    optimizer = build_optimizer(model.named_parameters(), TrainConfig(lr=lr, weight_decay=0.0))
    loss_sum, count = net(**_inputs(batch))
    (loss_sum / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        after_sum, _ = net(**_inputs(batch))
    return float(loss_sum / count), float(after_sum / count)


def _padded_batch() -> dict:
    ids, labels = _batch()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _check_lora(row: Row, model: torch.nn.Module) -> None:
    """all-linear through finetune's adapter path, then one step (packed where packing is allowed)."""
    from peft.tuners.lora import LoraLayer

    from finetune.model.architectures import lora_exclusions
    from finetune.model.loading import _apply_adapter
    from finetune.recipe import AdapterConfig

    try:
        row.lora_excluded = lora_exclusions(model)
        lora = _apply_adapter(model, AdapterConfig(type="lora", r=4, alpha=8, target_modules="all-linear"))
        row.lora_layers = sum(isinstance(m, LoraLayer) for m in lora.modules())
        batch = _padded_batch() if row.packing_refused else _packed_batch()
        row.lora_losses = _step(lora, batch, lr=1e-2)
    except Exception as e:  # noqa: BLE001
        row.lora_error = _short(e)


def _check_trainer(row: Row) -> None:
    """One optimizer step of finetune.train.loop.train on the quickstart data and tokenizer (1024 tokens), packed
    unless packing is refused: its packing refusal and isolation check, its loss, its update."""
    from rich.console import Console

    from finetune.recipe import load_recipe
    from finetune.train import loop as trainer

    row.trainer_packed = row.packing_refused is None
    kwargs = {k: v for k, v in tiny_kwargs(row.model_type, vocab=1024).items() if k not in IDS}
    with tempfile.TemporaryDirectory(prefix="finetune-matrix-") as out:
        recipe = load_recipe(ROOT / "examples" / "yaml" / "quickstart.yaml", [
            f"output_dir={out}", "datasets.0.max_rows=16", "eval_datasets=[]", "data.max_seq_len=64",
            f"data.packing={str(row.trainer_packed).lower()}", "eval.at_start=false", "eval.every_steps=null",
            "train.max_steps=1", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1",
            "train.warmup_steps=0", "logging.every_steps=1", "checkpoint.every_steps=null"])
        recipe.model.config = {"model_type": row.model_type, **kwargs}
        try:
            trainer.train(recipe, overwrite=True, console=Console(file=io.StringIO()))
            lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
            row.trainer = [json.loads(x) for x in lines if '"loss"' in x][-1]
        except Exception as e:  # noqa: BLE001 - a UserError too: every in-scope model should train
            row.trainer_error = _short(e)


# --- what counts as passing, and the table -------------------------------------------------------------------
PACKED_LEAK_LIMIT = 1e-6  # see problems()


def problems(row: Row) -> dict[str, str]:
    """check name -> what is wrong; empty when the architecture behaves as docs/models.md says it does."""
    out = {}
    if row.load_error:
        return {"load": row.load_error}
    if row.refused:
        return {}
    bad_loss = {impl: d for impl, d in row.loss.items() if not max(d) <= TOLERANCE}
    if row.loss_error or bad_loss or set(row.loss) != {"chunked", "torch"}:
        out["loss"] = row.loss_error or f"relative (loss, gradients) differences {bad_loss}"
    # Packing allowed: no change beyond rounding. Measured 0.0 everywhere but in MoE models, whose expert matmuls
    # get another number of rows when the other document routes differently (FlexOlmo: 7.5e-8, and 0.0 in
    # float64); the smallest real leak measured is 9.7e-5. Packing refused: the reason must show.
    if row.packing_refused is None and not (row.leak is not None and row.leak <= PACKED_LEAK_LIMIT):
        out["packing"] = f"a neighbour document's logits moved by {row.leak}"
    if row.packing_refused and not ((row.leak or 0) > 0 or row.packed_grads_finite is False):
        out["packing"] = f"refused, but neither a leak ({row.leak}) nor NaN gradients show: {row.packing_refused}"
    if row.lora_error or row.lora_layers < 1 or not row.lora_losses or not _changed(*row.lora_losses):
        out["lora"] = row.lora_error or f"{row.lora_layers} LoRA layers, losses {row.lora_losses}"
    step = row.trainer
    if row.trainer_error or not (math.isfinite(step.get("loss", math.nan)) and not step.get("skipped")
                                 and step.get("update_ratio", 0) > 0):
        out["trainer"] = row.trainer_error or f"metrics {step}"
    return out


def _changed(before: float, after: float) -> bool:
    return math.isfinite(before) and math.isfinite(after) and before != after


def _packing_cell(row: Row) -> str:
    why = row.packing_refused
    if why is None:
        return {"finetune_sdpa_varlen": "yes (per-document sdpa)", "sdpa": "yes (sdpa, block mask)",
                "eager": "yes (eager, block mask)"}.get(row.attention, f"yes ({row.attention})")
    if "carry a state" in why:
        return f"no: state ({why.split('(')[1].split(':')[0]})"
    return "no: zero pad embedding" if "NaN" in why else "no: attention leaks"


def _notes(row: Row) -> str:
    if row.refused:
        return row.refused.split(": ", 1)[-1].split(". See")[0].split(". Set")[0]
    notes = [row.head] if row.head else []
    if row.lora_excluded:
        skipped = sorted({name.rsplit(".", 1)[-1] for name in row.lora_excluded})
        notes.append(f"LoRA skips {', '.join(skipped)}")
    why = row.packing_refused or ""
    if "NaN" in why:
        notes.append("packing: the padding's zero embedding gives NaN gradients (AltUp's root-mean-square)")
    elif "does not keep packed documents apart" in why:
        notes.append("packing: " + why.split(f"{row.model_type}: ", 1)[1].split(". Set")[0])
    return "; ".join(notes)


def table_row(row: Row) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    bad = problems(row)
    if row.refused or "load" in bad:
        cells = ["refused" if row.refused else "FAIL: load", "", "", ""]
    else:
        cells = ["FAIL" if "loss" in bad else "exact", "FAIL" if "packing" in bad else _packing_cell(row),
                 "FAIL" if "lora" in bad else f"{row.lora_layers} layers",
                 "FAIL" if "trainer" in bad else ("packed" if row.trainer_packed else "padded")]
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[row.model_type]
    return "| " + " | ".join([f"`{row.model_type}`", cls, *cells, _notes(row).replace("|", "/")]) + " |"


def counts(rows: list[Row]) -> dict[str, int]:
    ok = [r for r in rows if not problems(r) and not r.refused]
    return {"in_scope": len(rows), "packed": sum(r.trainer_packed is True for r in ok),
            "padded": sum(r.trainer_packed is False for r in ok), "refused": sum(bool(r.refused) for r in rows),
            "failing": sum(bool(problems(r)) for r in rows), "out_of_scope": len(OUT_OF_SCOPE)}


def summary(rows: list[Row]) -> str:
    """The sentence README.md and docs/models.md both carry."""
    import transformers

    n = counts(rows)
    text = (f"Of the {n['in_scope']} decoder-only causal LM architectures in transformers {transformers.__version__}, "
            f"{n['packed'] + n['padded']} train with the fused loss equal to the model's own loss (loss and "
            f"gradients within 1e-5), LoRA all-linear and the real trainer: {n['packed']} with packing, "
            f"{n['padded']} in padded batches only (packing refused: layers that carry a state across documents, "
            f"attention that transformers does not isolate); {n['refused']} are refused when they load, with the "
            "reason")
    return text + (f"; {n['failing']} FAIL" if n["failing"] else "") + "."
