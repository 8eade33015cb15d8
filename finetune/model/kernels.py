"""Speed-ups of the model's own layers. On the Llama-1B shape (README, "On a GPU") Liger's kernels gave +23% tokens/s on
an H100 and +17% on an H200, compilation +31% and +27% (benchmarks/gpu_throughput.py rows `liger`, `compile`,
`liger+compile`). Liger's kernels are on by default where they can run (`model.liger_kernels: auto`), since the gpu
tests and the CLI stages of `make test-gpu` (LoRA, QLoRA, LoRA with Liger) passed on the H100; compilation stays
opt-in until its stage passes there too.

* `model.liger_kernels`: Liger-Kernel's fused RMSNorm and SwiGLU MLP (GeGLU for Gemma), applied to the loaded
  model's own modules through Liger's API for a model instance (`_apply_liger_kernel_to_instance`, what
  transformers' Trainer calls for `use_liger_kernel`). That API also rebinds names in transformers' modules (the
  norm and MLP classes, the RoPE function) for the whole process; `contained` puts them back, so that a model built
  later (the DPO reference, `finetune eval` after training) is transformers' own. Liger's RoPE exists only as such
  a rebinding (no module of the instance holds it), so it is not applied. Liger's cross-entropy and fused linear
  cross-entropy stay off: finetune/loss/ already fuses the output layer with the loss and never calls the head.
* `train.compile`: regional compilation (PyTorch's recipe "Reducing torch.compile cold start compilation time with
  regional compilation"): each decoder layer compiled in place with `nn.Module.compile`, which keeps the module
  and its parameter names, so state dicts and checkpoints are unchanged; the layers share one compiled code.
  Packed rows' attention (finetune/attention/dispatch.py) is excluded by `torch.compiler.disable` where it is defined: it
  finds the micro-batch's documents on the host by the identity of cu_seqlens and loops over Python spans, which
  cannot be traced; the rest of each layer (norms, projections, RoPE, MLP) is compiled around it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import torch

from finetune.attention import dispatch as attention
from finetune.errors import UserError

# Passed to Liger for every architecture; Liger drops the names an architecture's function does not take. RoPE off:
# Liger applies it only by replacing transformers' module function, for every model of the architecture.
LIGER_SETTINGS: dict[str, bool] = {"rope": False, "rms_norm": True, "swiglu": True,
                                   "cross_entropy": False, "fused_linear_cross_entropy": False}
LIGER_INSTALL = "pip install 'finetune[liger]' (liger-kernel==0.8.5; CUDA machines only)"


# --- Liger ------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def liger_table() -> tuple[Mapping[str, Callable[..., None]] | None, str]:
    """(Liger's model_type -> apply function table, "") or (None, why liger_kernel does not import)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as e:  # noqa: BLE001 - ImportError, or Triton failing to initialise without a GPU
        return None, f"{type(e).__name__}: {e}"
    return MODEL_TYPE_TO_APPLY_LIGER_FN, ""


def liger_problem(device: torch.device, table: Mapping[str, Any] | None, import_error: str,
                  model_type: str | None, hidden_act: str | None = "silu") -> str | None:
    """Why model.liger_kernels cannot run here, or None: a pure decision on the device, the result of importing
    Liger (its table, or None and the import error), the model's model_type and its MLP activation."""
    if table is None:
        return f"model.liger_kernels: liger-kernel cannot be imported ({import_error}); install it: {LIGER_INSTALL}"
    if device.type != "cuda":
        return (f"model.liger_kernels: Liger's kernels are Triton kernels for CUDA, and this model runs on "
                f"{device.type!r}; set model.liger_kernels: false")
    if model_type not in table:
        return (f"model.liger_kernels: Liger has no kernels for model_type {model_type!r}; it supports "
                f"{', '.join(sorted(table))}. Set model.liger_kernels: false")
    # Liger's SwiGLU MLP computes SiLU whatever the config says, and does not check when it replaces the MLP of an
    # existing model: another activation would train other maths, silently.
    if "swiglu" in liger_kernels_of(table[model_type]) and hidden_act not in ("silu", "swish", None):
        return (f"model.liger_kernels: Liger's SwiGLU kernel computes SiLU, and this {model_type} model's MLP uses "
                f"{hidden_act!r}; set model.liger_kernels: false")
    return None


def liger_kernels_of(apply_fn: Callable[..., None]) -> list[str]:
    """The kernels an architecture's apply function turns on with LIGER_SETTINGS: its boolean parameters, each
    at our setting where we pass one, else at Liger's default (e.g. Gemma's geglu)."""
    on = []
    for name, param in inspect.signature(apply_fn).parameters.items():
        if isinstance(param.default, bool) and LIGER_SETTINGS.get(name, param.default):
            on.append(name)
    return on


def apply_liger(model: torch.nn.Module, device: torch.device | str, setting: bool | str = True) -> list[str]:
    """Liger's kernels applied to `model` (before an adapter or a DDP/FSDP wrapper: Liger patches the model's own
    modules) as model.liger_kernels says; returns the kernels applied ([] when none). true: a UserError when Liger
    cannot serve this model here; auto: none then (liger_auto_note says why)."""
    device = torch.device(device)
    if setting is False or (setting == "auto" and device.type != "cuda"):  # no import of Liger off CUDA
        return []
    problem = _liger_problem_for(model, device)
    if problem:
        if setting == "auto":
            return []
        raise UserError(problem)
    apply_liger_to_instance(model)
    if not liger_modules(model):
        if setting == "auto":
            return []
        raise UserError(f"model.liger_kernels: Liger replaced none of this {model.config.model_type} model's own "
                        "modules (its kernels for it exist only as process-wide replacements); set "
                        "model.liger_kernels: false")
    return liger_kernels_of(liger_table()[0][model.config.model_type])


def _liger_problem_for(model: torch.nn.Module, device: torch.device) -> str | None:
    table, why = liger_table()
    text = model.config.get_text_config()
    return liger_problem(device, table, why, getattr(model.config, "model_type", None),
                         getattr(text, "hidden_act", None))


def liger_auto_note(model: torch.nn.Module, device: torch.device | str, setting: bool | str) -> str:
    """For the run log: Liger's modules in the model ("LigerRMSNorm x5, LigerSwiGLUMLP x2"), or, where auto left them
    off on CUDA, "off (auto: why)"; "" where there is nothing to say (off by request, or auto off CUDA)."""
    device = torch.device(device)
    if liger_modules(model):
        return liger_summary(model)
    if setting != "auto" or device.type != "cuda":
        return ""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    problem = _liger_problem_for(base, device) or "Liger replaced none of the model's own modules"
    why = re.split(r"[.;] [Ss]et model\.liger_kernels", problem.removeprefix("model.liger_kernels: "))[0]
    return f"off (auto: {why})"


def apply_liger_to_instance(model: torch.nn.Module) -> list[str]:
    """Liger's instance API on `model`, its changes to transformers' (and torch.nn's) module globals and classes put
    back: only the model's own modules keep Liger's forwards. Returns the names it had rebound ("module.name").
    Needs liger_kernel importable (CUDA, or Triton's interpreter); runs no kernel."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    with contained() as restored:
        _apply_liger_kernel_to_instance(model=model, **LIGER_SETTINGS)
    return restored


def _shared_namespaces() -> list[tuple[str, ModuleType | type]]:
    """What Liger's apply functions rebind names in: transformers' loaded modules and the classes defined in them,
    and torch.nn and torch.nn.functional (Liger's Mllama and SigLIP functions set `nn.LayerNorm` there)."""
    out: list[tuple[str, ModuleType | type]] = []
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or not (name == "transformers" or name.startswith("transformers.")):
            continue
        out.append((name, module))
        out += [(f"{name}.{k}", v) for k, v in list(vars(module).items())
                if isinstance(v, type) and getattr(v, "__module__", None) == name]
    return out + [("torch.nn", torch.nn), ("torch.nn.functional", torch.nn.functional)]


@contextlib.contextmanager
def contained() -> Iterator[list[str]]:
    """Every name rebound or added in transformers' loaded modules, their classes, torch.nn and torch.nn.functional
    inside the block is put back on leaving it; the list yielded is filled with those names. (A module first
    imported inside the block is not in the snapshot: Liger's functions import only what the model already did.)"""
    before = [(where, space, dict(vars(space))) for where, space in _shared_namespaces()]
    restored: list[str] = []
    try:
        yield restored
    finally:
        for where, space, names in before:
            now = vars(space)
            for key in [k for k in now if k not in names and not isinstance(now[k], ModuleType)]:
                delattr(space, key)
                restored.append(f"{where}.{key}")
            for key, value in names.items():
                if now.get(key, _MISSING) is not value:
                    setattr(space, key, value)
                    restored.append(f"{where}.{key}")


_MISSING = object()


def liger_modules(model: torch.nn.Module) -> Counter[str]:
    """How many of the model's modules run a Liger forward, by Liger's name for them (Liger renames what it
    patches): {"LigerRMSNorm": 5, "LigerSwiGLUMLP": 2} for a 2-layer Llama."""
    return Counter(name for m in model.modules() if (name := m._get_name()).startswith("Liger"))


def liger_summary(model: torch.nn.Module) -> str:
    """What model.liger_kernels applied to this model, for the run log: "LigerRMSNorm x5, LigerSwiGLUMLP x2"."""
    found = liger_modules(model)
    return ", ".join(f"{name} x{n}" for name, n in sorted(found.items())) or "none"


# --- regional compilation ---------------------------------------------------------------------------------------

def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost transformers decoder layers of `model` (GradientCheckpointingLayer, the base class of every
    decoder layer in transformers 5), looking through PEFT and any wrapper."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # parents come before their children
        if id(module) in inside:
            continue
        if isinstance(module, GradientCheckpointingLayer):
            layers.append(module)
            inside.update(id(m) for m in module.modules())
    return layers


def compile_layers(model: torch.nn.Module, backend: str | Callable[..., Any] = "inductor") -> int:
    """train.compile: every decoder layer compiled in place (nn.Module.compile); returns how many.

    Sizes are left to torch's automatic dynamic shapes (dynamic=None), except the number of packed documents:
    cu_seq_lens are marked dynamic before every call, since a packed micro-batch's document count changes every
    time. A row length (packed rows are as long as the micro-batch's longest, padded batches vary) is compiled
    static first; the first micro-batch of another length compiles once more with that length symbolic, and none
    after it. dynamic=True instead would not help: the code after the attention's graph break (the rest of the
    layer) is compiled static whatever it says (measured on torch 2.13), and it asks for every size symbolic from
    the start. `backend` is torch.compile's (tests use "aot_eager" or a counting backend)."""
    layers = decoder_layers(model)
    if not layers:
        raise UserError(f"train.compile: {type(model).__name__} has no transformers decoder layers "
                        "(GradientCheckpointingLayer) to compile; set train.compile: false")
    if attention.is_ours(model) and any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        # Dynamo cannot split a checkpointed layer around the attention's graph break, so it would compile nothing
        # (measured: 0 graphs); with transformers' sdpa there is no break, and checkpointed layers compile.
        raise UserError("train.compile with model.gradient_checkpointing: the packed-row attention of "
                        "attn_implementation auto is never compiled, and inside a checkpointed layer that leaves "
                        "nothing compiled at all. Turn one of them off, or set model.attn_implementation: sdpa "
                        "(packed rows then pay a block mask over the whole row)")
    for layer in layers:
        layer.compile(backend=backend, dynamic=None)
    for holder in {id(h): h for h in (_holder(model, layer) for layer in layers)}.values():
        holder.register_forward_pre_hook(_documents_dynamic, with_kwargs=True)
    return len(layers)


def _holder(model: torch.nn.Module, layer: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward calls `layer` (the decoder backbone): the one holding it, directly or in a list."""
    for module in model.modules():
        for child in module.children():
            if child is layer or (isinstance(child, torch.nn.ModuleList) and any(x is layer for x in child)):
                return module
    return model


def _documents_dynamic(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Runs eagerly before the backbone's forward: the packed documents' boundaries, one more every document, are
    symbolic in the compiled layers from the first micro-batch on (attention.packed_kwargs)."""
    import torch._dynamo

    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(value, 0)
