"""A model directory's files checked before transformers or PEFT reads them, and the errors of a bad one named.

A truncated download or copy of a safetensors file reaches the user, unchecked, as safetensors' "Error while
deserializing header: incomplete metadata, file not fully covered": which file, and that it is cut short, are
left to guess. `check_model_dir` reads what a loader would read first, cheaply (the JSON files, and each safetensors
file's 8-byte header length and JSON header, never its tensors), and names the first bad file, what is wrong with it
and what to do. `load_errors` names what only the load itself finds: a tensor of another shape than config.json
makes it, and a safetensors error in a file the check did not see (a hub model's cached files).

`key` says where the directory came from, for the message: a recipe key (model.path, grpo.reference,
dpo.reference), or FINAL, a finished run's final/.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from finetune.errors import UserError, first_line

FINAL = "final/"  # the key of a finished run's model (run/trained.py): not a recipe key
MAX_HEADER = 100_000_000  # safetensors' own limit on a header's length (it refuses longer ones)
JSON_FILES = ("config.json", "adapter_config.json", "model.safetensors.index.json")
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")
INDEX = "model.safetensors.index.json"


def remedy(key: str) -> str:
    """What the user can do about a bad file of the model at `key`."""
    if key == FINAL:
        return "Restore final/ from a copy, or train the run again"
    return f"Re-download or re-save the model, or set {key} to another model directory"


def where(key: str) -> str:
    """The model at `key`, in words."""
    return "the run's final model" if key == FINAL else key


def bad_file(file: Path, problem: str, key: str) -> UserError:
    """The one message of a bad model file: where it came from, the file, what is wrong, what to do."""
    return UserError(f"{where(key)}: {file} {problem}. {remedy(key)}.")


def check_model_dir(path: str | Path, key: str = "model.path") -> None:
    """Raise a UserError naming the first bad file of the model directory `path`: a JSON file that does not parse,
    a shard its index lists that is missing, a safetensors file that is empty, truncated or not one. Anything
    that is not a local directory (a hub id, a .gguf file) is left to the loader."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    for name in JSON_FILES:
        if (folder / name).is_file():
            _read_json(folder / name, key)
    for file in dict.fromkeys(_weight_files(folder, key)):
        check_safetensors(file, key)


def _read_json(file: Path, key: str) -> Any:
    try:
        value = json.loads(file.read_bytes())
    except OSError as e:
        raise bad_file(file, f"cannot be read ({type(e).__name__}: {first_line(e)})", key) from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and bytes that are not UTF-8 text
        raise bad_file(file, f"is not valid JSON ({first_line(e)})", key) from None
    if not isinstance(value, dict):
        raise bad_file(file, f"is not a JSON object (it holds a {type(value).__name__})", key)
    return value


def _shards(folder: Path, index: dict, key: str) -> list[Path]:
    """The files a sharded model's index maps its tensors to, each one there."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise bad_file(folder / INDEX, "has no weight_map of tensor names to file names", key)
    shards = [folder / name for name in dict.fromkeys(weight_map.values())]
    for shard in shards:
        if not shard.is_file():
            raise bad_file(folder / INDEX, f"lists {shard.name}, which is missing", key)
    return shards


def check_safetensors(file: Path, key: str = "model.path") -> dict[str, Any]:
    """The header of a safetensors file (tensor name -> dtype, shape, data_offsets), after checking what safetensors
    checks before it reads a tensor: an 8-byte little-endian header length, a JSON header of that length, tensor
    data that ends where the file does. Reads the header only."""
    try:
        with open(file, "rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(0)
            start = handle.read(8)
            if size < 8:
                raise bad_file(file, "is empty (0 bytes)" if size == 0 else f"is truncated: {size} bytes, shorter "
                               "than the 8-byte header length a safetensors file starts with", key)
            length = struct.unpack("<Q", start)[0]
            if length > MAX_HEADER:
                raise bad_file(file, f"is not a safetensors file: its first 8 bytes give a header length of "
                               f"{length:,} bytes (safetensors allows at most {MAX_HEADER:,})", key)
            text = handle.read(length)
    except OSError as e:
        raise bad_file(file, f"cannot be read ({type(e).__name__}: {first_line(e)})", key) from None
    if len(text) < length:
        # A header's first byte is "{": then the file is a safetensors file cut short, else it is something else.
        what = "is truncated" if text[:1] == b"{" else "is truncated or not a safetensors file"
        raise bad_file(file, f"{what}: its header alone takes {8 + length:,} bytes, but the file has {size:,}", key)
    header = _parse_header(file, text, key)
    end = 8 + length + _data_end(file, header, key)
    if size < end:
        raise bad_file(file, f"is truncated: its header says the file holds {end:,} bytes, but it has {size:,}", key)
    if size > end:
        raise bad_file(file, f"is damaged: it has {size:,} bytes, {size - end:,} more than its header accounts for "
                       f"({end:,})", key)
    return header


def _parse_header(file: Path, text: bytes, key: str) -> dict[str, Any]:
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad_file(file, f"is not a safetensors file: its header is not JSON ({first_line(e)})", key) from None
    if not isinstance(header, dict):
        raise bad_file(file, "is not a safetensors file: its header is not a JSON object", key)
    return header


def _data_end(file: Path, header: dict[str, Any], key: str) -> int:
    """Where the header says the tensor data ends (bytes after the header)."""
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad_file(file, f"is damaged: its header gives tensor {name} no valid data_offsets", key)
        end = max(end, offsets[1])
    return end


@contextlib.contextmanager
def load_errors(path: str | Path, key: str, auto: Any = None, trust_remote_code: bool = False) -> Iterator[None]:
    """Around a load from `path`: safetensors' errors, and (with `auto`, the class that loads) transformers' refusal
    of a tensor whose shape is not the one config.json makes, as UserErrors naming the file. Other errors pass:
    they are not a bad file's."""
    try:
        yield
    except SafetensorError as e:
        raise UserError(f"{where(key)}: a safetensors file of {path} is damaged ({first_line(e)}). "
                        f"{remedy(key)}.") from None
    except RuntimeError as e:
        # transformers' two refusals of a checkpoint tensor of another shape both name this argument.
        if auto is None or "ignore_mismatched_sizes" not in str(e):
            raise
        raise shape_mismatch(Path(path), key, _meta_shapes(auto, path, trust_remote_code)) from None


def _meta_shapes(auto: Any, path: str | Path, trust_remote_code: bool) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape by its state-dict name, as config.json makes them (built on the meta device: no memory,
    no weights read). Only on the error path: a load that works never pays for it."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def shape_mismatch(folder: Path, key: str, expected: dict[str, tuple[int, ...]]) -> UserError:
    """The first tensor of the directory's safetensors files whose shape is not the model's, named with its file."""
    for file in _weight_files(folder, key):
        for name, info in check_safetensors(file, key).items():
            want = expected.get(name)
            shape = info.get("shape") if isinstance(info, dict) and name != "__metadata__" else None
            if want is not None and isinstance(shape, list) and tuple(shape) != want:
                return bad_file(file, f"holds {name} of shape {shape}, but {folder / 'config.json'} makes it "
                                f"{list(want)} (saved from a model of another config?)", key)
    return UserError(f"{where(key)}: {folder} holds a tensor of another shape than its config.json makes it (the "
                     f"load report above names it). {remedy(key)}.")


def _weight_files(folder: Path, key: str) -> list[Path]:
    files = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if (folder / INDEX).is_file():
        files += _shards(folder, _read_json(folder / INDEX, key), key)
    return files
