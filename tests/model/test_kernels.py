"""finetune/model/kernels.py: the opt-in model.liger_kernels and train.compile.

Liger's RMSNorm and SwiGLU kernels do not run in Triton's interpreter, so its decision (installed? CUDA? an
architecture Liger supports?) is a pure function of the device and of the import's result, tested here on a CPU, and
the numbers are compared on a GPU only (`gpu`); how Liger is applied to a model instance (its changes to
transformers' modules put back) is checked in the interpreter's child process, where liger_kernel imports. Compilation runs on a CPU (inductor through gcc): one
training step compiled equals the same step eager, packed and padded; parameter names stay; micro-batches with other
document boundaries do not recompile.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import TINY_MODEL_CONFIG, TOKENIZER_DIR
from torch._dynamo.testing import CompileCounterWithBackend

from finetune.attention import dispatch as attention
from finetune.data.collate import collate_packed, collate_padded
from finetune.errors import UserError
from finetune.model import kernels
from finetune.model.loading import load_model
from finetune.model.tokenizer import load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.recipe import AdapterConfig, LossConfig, ModelConfig, Recipe, TokenizerConfig, features
from finetune.versions import FEATURE_PACKAGES

CPU = torch.device("cpu")


def _llama_like(rope: bool = True, cross_entropy: bool = False, fused_linear_cross_entropy: bool = True,
                rms_norm: bool = True, swiglu: bool = True, model: object = None) -> None:
    """The signature of Liger 0.8.5's apply_liger_kernel_to_llama (a stand-in: only its signature is read)."""


def _granite_like(rope: bool = True, cross_entropy: bool = True, fused_linear_cross_entropy: bool = False,
                  rms_norm: bool = True, swiglu: bool = True, model: object = None) -> None:
    """Liger 0.8.5's Granite function: its cross_entropy is on by default (we turn it off)."""


def _gemma_like(rope: bool = True, cross_entropy: bool = False, fused_linear_cross_entropy: bool = True,
                rms_norm: bool = True, geglu: bool = True, model: object = None) -> None:
    """Liger 0.8.5's Gemma function: GeGLU instead of SwiGLU, on by default."""


TABLE = {"llama": _llama_like, "granite": _granite_like, "gemma": _gemma_like}


# --- model.liger_kernels --------------------------------------------------------------------------------------

def test_liger_not_installed_says_how_to_install():
    why = kernels.liger_problem(torch.device("cuda"), None, "ModuleNotFoundError: No module named 'liger_kernel'",
                                "llama")
    assert why and "model.liger_kernels" in why and "No module named 'liger_kernel'" in why
    assert "pip install 'finetune[liger]'" in why


def test_liger_on_a_cpu_is_refused():
    why = kernels.liger_problem(CPU, TABLE, "", "llama")
    assert why and "CUDA" in why and "'cpu'" in why and "model.liger_kernels: false" in why


def test_liger_unsupported_architecture_names_the_supported_ones():
    why = kernels.liger_problem(torch.device("cuda"), TABLE, "", "gpt2")
    assert why and "'gpt2'" in why and "gemma, granite, llama" in why
    assert kernels.liger_problem(torch.device("cuda", 0), TABLE, "", "llama") is None


def test_liger_swiglu_on_an_mlp_that_is_not_silu_is_refused():
    why = kernels.liger_problem(torch.device("cuda"), TABLE, "", "llama", "gelu_pytorch_tanh")
    assert why and "SiLU" in why and "'gelu_pytorch_tanh'" in why
    assert kernels.liger_problem(torch.device("cuda"), TABLE, "", "llama", "silu") is None
    # Gemma's function has GeGLU, not SwiGLU: its gelu MLP is Liger's own kernel there.
    assert kernels.liger_problem(torch.device("cuda"), TABLE, "", "gemma", "gelu_pytorch_tanh") is None


def test_liger_kernels_applied_never_include_a_loss_or_rope():
    assert kernels.liger_kernels_of(_llama_like) == ["rms_norm", "swiglu"]
    assert kernels.liger_kernels_of(_granite_like) == ["rms_norm", "swiglu"]
    assert kernels.liger_kernels_of(_gemma_like) == ["rms_norm", "geglu"]
    # What we pass, for every architecture: our loss is already fused (finetune/loss/); Liger's RoPE can only replace
    # transformers' function for the whole process.
    assert kernels.LIGER_SETTINGS["cross_entropy"] is False
    assert kernels.LIGER_SETTINGS["fused_linear_cross_entropy"] is False
    assert kernels.LIGER_SETTINGS["rope"] is False
    assert set(kernels.LIGER_SETTINGS) <= set(inspect.signature(_llama_like).parameters)


def test_liger_kernels_needs_liger_kernel_at_validation():
    # cli.load_recipe_arg checks the packages of features(recipe) before anything loads.
    assert "liger_kernels" in features(Recipe(model=ModelConfig(liger_kernels=True)))
    assert "liger_kernels" not in features(Recipe())
    assert FEATURE_PACKAGES["liger_kernels"] == "liger-kernel"


def test_load_model_refuses_liger_here(tokenizer):
    """On this CPU machine: refused at load, whichever reason comes first (not installed, or not CUDA)."""
    cfg = ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG), liger_kernels=True)
    with pytest.raises(UserError, match="model.liger_kernels"):
        load_model(cfg, AdapterConfig(), tokenizer, seed=0, device=CPU)


def _tiny(tokenizer, setting: bool | str = "auto") -> torch.nn.Module:
    cfg = ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG), liger_kernels=setting)
    return load_model(cfg, AdapterConfig(), tokenizer, seed=0, device=CPU)


def test_liger_auto_is_the_default_and_off_a_gpu_does_not_even_import_liger(tokenizer):
    assert ModelConfig().liger_kernels == "auto"
    asked = kernels.liger_table.cache_info()
    lm = _tiny(tokenizer)
    assert not kernels.liger_modules(lm)
    assert kernels.liger_auto_note(lm, CPU, "auto") == ""  # nothing to say on a CPU
    after = kernels.liger_table.cache_info()
    assert after.hits + after.misses == asked.hits + asked.misses


@pytest.mark.parametrize(("table", "why"), [(None, "liger-kernel cannot be imported"),
                                            ({"gemma": _gemma_like}, "no kernels for model_type 'llama'")])
def test_liger_auto_on_cuda_leaves_what_liger_cannot_serve_and_says_why(tokenizer, monkeypatch, table, why):
    """Where Liger cannot serve the model (not installed; an architecture it lacks), auto trains without it and the
    run log says why, while true refuses. Liger's table is replaced here (our own lookup, not Liger's code): on
    this CPU machine the decision is reached as on CUDA, and nothing is applied."""
    monkeypatch.setattr(kernels, "liger_table", lambda: (table, "ModuleNotFoundError: No module named 'liger_kernel'"))
    lm = _tiny(tokenizer)
    cuda = torch.device("cuda")
    assert kernels.apply_liger(lm, cuda, "auto") == [] and not kernels.liger_modules(lm)
    note = kernels.liger_auto_note(lm, cuda, "auto")
    assert note.startswith("off (auto: ") and why in note and "set model.liger_kernels" not in note.lower(), note
    assert kernels.liger_auto_note(lm, cuda, False) == ""  # off by request: nothing to say
    with pytest.raises(UserError, match=why):
        kernels.apply_liger(lm, cuda, True)


def test_liger_kernels_takes_auto_true_or_false():
    for value in ("auto", True, False):
        assert Recipe(model=ModelConfig(liger_kernels=value)).model.liger_kernels == value
    with pytest.raises(ValueError, match="liger_kernels"):
        Recipe.model_validate({"model": {"liger_kernels": "sometimes"}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.liger_table()[0] is None,
                    reason="needs CUDA and liger-kernel")
def test_liger_auto_applies_on_cuda(tokenizer):
    cfg = ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG), dtype="bfloat16")
    lm = load_model(cfg, AdapterConfig(), tokenizer, seed=0, device=torch.device("cuda"))
    assert kernels.liger_summary(lm) == "LigerRMSNorm x5, LigerSwiGLUMLP x2"
    assert kernels.liger_auto_note(lm, torch.device("cuda"), "auto") == "LigerRMSNorm x5, LigerSwiGLUMLP x2"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.liger_table()[0] is None,
                    reason="needs CUDA and liger-kernel")
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_liger_kernels_equal_torch(tokenizer, dtype: str, tolerance: float):
    """A tiny Llama's summed loss and gradients with Liger's RMSNorm, SwiGLU and RoPE equal torch's: relative
    difference at most 1e-4 in float32 (kernels that reorder sums), 3e-2 in bfloat16 (a few bf16 ulps)."""
    device = torch.device("cuda")
    results = []
    for liger in (False, True):
        cfg = ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG), dtype=dtype, liger_kernels=liger)
        lm = load_model(cfg, AdapterConfig(), tokenizer, seed=0, device=device).to(device)
        if liger:
            assert kernels.liger_summary(lm) == "LigerRMSNorm x5, LigerSwiGLUMLP x2"
        results.append(_step(lm, _packed_batch(tokenizer, [[5, 7, 10], [12, 3]]), device))
    (loss0, grads0), (loss1, grads1) = results
    assert abs(loss1 - loss0) <= tolerance * abs(loss0)
    assert _rel(grads1, grads0) <= tolerance


def _liger_on_an_instance() -> dict:
    """In the interpreter's child process (conftest.interpreted, where liger_kernel imports): Liger's instance API
    applied to one tiny Llama (nothing runs), then what transformers' Llama module and a Llama built afterwards
    look like."""
    from transformers.models.llama import modeling_llama

    tokenizer = load_tokenizer(TokenizerConfig(path=str(TOKENIZER_DIR)), ModelConfig())
    lm = _model(tokenizer)  # first: building a model caches a few values on transformers' classes
    names = ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb", "LlamaAttention", "LlamaForCausalLM")
    before = {name: getattr(modeling_llama, name) for name in names}
    classes = {name: dict(vars(before[name])) for name in ("LlamaRMSNorm", "LlamaMLP", "LlamaForCausalLM")}
    layer_norm = torch.nn.LayerNorm
    restored = kernels.apply_liger_to_instance(lm)
    changed = [n for n in names if getattr(modeling_llama, n) is not before[n]]
    classes_changed = [n for n, d in classes.items() if dict(vars(before[n])) != d]
    later = _model(tokenizer)
    return {"restored": restored, "changed": changed, "classes_changed": classes_changed,
            "layer_norm_same": torch.nn.LayerNorm is layer_norm, "instance": dict(kernels.liger_modules(lm)),
            "summary": kernels.liger_summary(lm), "later": dict(kernels.liger_modules(later)),
            "later_patched": [n for n, m in later.named_modules() if "forward" in vars(m)],
            "later_types": sorted({type(m).__name__ for m in later.modules() if "Norm" in type(m).__name__
                                   or "MLP" in type(m).__name__})}


def test_liger_on_an_instance_leaves_transformers_as_it_was(interpreted):
    """Liger's instance API rebinds transformers' LlamaRMSNorm and LlamaMLP (and its RoPE function, which we do not
    ask for) for the whole process; apply_liger puts them back: the instance keeps Liger's modules, a Llama built
    afterwards (the DPO reference, `finetune eval` after training) is transformers' own."""
    seen = interpreted(_liger_on_an_instance)
    where = "transformers.models.llama.modeling_llama"
    assert sorted(seen["restored"]) == [f"{where}.LlamaMLP", f"{where}.LlamaRMSNorm"]
    assert seen["changed"] == [] and seen["classes_changed"] == [] and seen["layer_norm_same"]
    assert seen["instance"] == {"LigerRMSNorm": 5, "LigerSwiGLUMLP": 2}  # 2 layers x 2 norms + the final norm
    assert seen["summary"] == "LigerRMSNorm x5, LigerSwiGLUMLP x2"
    assert seen["later"] == {} and seen["later_patched"] == []
    assert seen["later_types"] == ["LlamaMLP", "LlamaRMSNorm"]


# --- train.compile --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TokenizerConfig(path=str(TOKENIZER_DIR)), ModelConfig())


def _model(tokenizer, **model_keys) -> torch.nn.Module:
    cfg = ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG), **model_keys)
    lm = load_model(cfg, AdapterConfig(), tokenizer, seed=0).train()
    assert attention.is_ours(lm)  # packed rows go through our attention, the part left out of the compiled code
    return lm


def _packed_batch(tokenizer, rows: list[list[int]], width: int | None = None):
    """Packed rows of documents of these lengths (random ids, every token but a document's first trained)."""
    gen = torch.Generator().manual_seed(sum(map(sum, rows)))
    packed = []
    for lengths in rows:
        ids = torch.randint(3, 200, (sum(lengths),), generator=gen).tolist()
        positions = [i for n in lengths for i in range(n)]
        labels = [-100 if p == 0 else t for p, t in zip(positions, ids)]
        packed.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    batch = collate_packed(packed, tokenizer.pad_token_id)
    assert width is None or batch.input_ids.shape[1] == width
    return batch


def _step(lm: torch.nn.Module, batch, device: torch.device = CPU) -> tuple[float, torch.Tensor]:
    """One micro-batch's summed loss and the gradients of every parameter, as training computes them."""
    net = CausalLMWithLoss.for_recipe(lm, LossConfig(), "chunked" if device.type == "cpu" else "torch")
    lm.zero_grad(set_to_none=True)
    loss_sum, _ = net(**batch.to(device).model_inputs())
    loss_sum.backward()
    return loss_sum.item(), torch.cat([p.grad.flatten().float() for p in lm.parameters() if p.grad is not None])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_compiled_step_equals_eager(tokenizer, kind: str):
    """One step: loss and gradients compiled (inductor) equal eager to 1e-5 relative in float32 (inductor fuses and
    reorders the same float32 sums). About 25 s each on a busy 2-core CPU, compilation included."""
    if kind == "packed":
        batch = _packed_batch(tokenizer, [[5, 7, 10], [12, 3]])
    else:
        batch = collate_padded([{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))}
                                for n in (9, 14, 5)], tokenizer.pad_token_id)
    eager, compiled = _model(tokenizer), _model(tokenizer)
    assert kernels.compile_layers(compiled) == TINY_MODEL_CONFIG["num_hidden_layers"]
    (loss0, grads0), (loss1, grads1) = _step(eager, batch), _step(compiled, batch)
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0), (loss0, loss1)
    assert _rel(grads1, grads0) <= 1e-5


def test_other_document_boundaries_do_not_recompile(tokenizer, monkeypatch):
    """Packed micro-batches with other documents (another count, other lengths) reuse the compiled layers; a row
    length compiles once more (then symbolic), a third length not at all. Counted by torch's CompileCounter backend
    (graphs compiled by dynamo: the guards, what decides a recompile, are the backend's same for inductor)."""
    lm = _model(tokenizer)
    names = [name for name, _ in lm.named_parameters()]
    keys = list(lm.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    kernels.compile_layers(lm, backend=counter)
    # The documents reach the attention from the boundaries found on the CPU, under compile too: never re-read.
    monkeypatch.setattr(attention, "document_spans", lambda *a: pytest.fail("documents re-read from position_ids"))
    _step(lm, _packed_batch(tokenizer, [[5, 7, 10], [12, 3]], width=22))
    first = counter.frame_count
    assert first > 0
    _step(lm, _packed_batch(tokenizer, [[4, 4, 4, 4, 6], [3, 1, 9, 2]], width=22))
    _step(lm, _packed_batch(tokenizer, [[22], [1, 1, 1, 1, 1, 1, 1, 1]], width=22))
    assert counter.frame_count == first, "other document boundaries recompiled"
    _step(lm, _packed_batch(tokenizer, [[9, 9, 9, 3], [2, 2]], width=30))
    second = counter.frame_count
    _step(lm, _packed_batch(tokenizer, [[6, 7, 8, 4], [11]], width=25))
    assert counter.frame_count == second, "a third row length recompiled"
    # nn.Module.compile keeps the modules: parameter names and state dict keys (checkpoints) are unchanged.
    assert [name for name, _ in lm.named_parameters()] == names
    assert list(lm.state_dict()) == keys


def test_compile_with_gradient_checkpointing_is_refused(tokenizer):
    """Dynamo cannot split a checkpointed layer around our attention's graph break: nothing would be compiled."""
    lm = _model(tokenizer, gradient_checkpointing=True)
    with pytest.raises(UserError, match="train.compile with model.gradient_checkpointing"):
        kernels.compile_layers(lm, backend="aot_eager")


def test_compile_with_checkpointing_and_transformers_sdpa_compiles(tokenizer):
    """With transformers' sdpa there is no graph break: checkpointed layers compile, and gradients match."""
    cfg = {"attn_implementation": "sdpa", "gradient_checkpointing": True}
    eager = load_model(ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG), **cfg), AdapterConfig(),
                       tokenizer, seed=0).train()
    compiled = load_model(ModelConfig(init="random", config=dict(TINY_MODEL_CONFIG), **cfg), AdapterConfig(),
                          tokenizer, seed=0).train()
    counter = CompileCounterWithBackend("aot_eager")
    kernels.compile_layers(compiled, backend=counter)
    batch = _packed_batch(tokenizer, [[5, 7, 10], [12, 3]])
    (loss0, grads0), (loss1, grads1) = _step(eager, batch), _step(compiled, batch)
    assert counter.frame_count > 0
    assert abs(loss1 - loss0) <= 1e-6 * abs(loss0) and _rel(grads1, grads0) <= 1e-6
