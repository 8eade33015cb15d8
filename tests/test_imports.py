"""The import direction of docs/design.md ("Layout"), checked by parsing every module's imports with ast.

recipe -> data -> model -> loss -> trainer -> metrics. Leaves (errors, labels, versions, recipe, dist, attention,
architectures) import nothing from the package but `errors` (recipe: versions); data, model, loss, optim, metrics
and checkpoint never import each other; only cli imports the trainer, and lazily.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"

LEAVES = {"errors", "labels", "versions", "recipe", "dist", "attention", "packed_kernels", "architectures", "templates",
          "kernels"}
SIBLINGS = {"data", "model", "loss", "optim", "metrics", "checkpoint"}
# What each module may import from the package (beyond `errors`, which everything may import). A package (recipe,
# data, metrics) is one module here: its files may import each other.
ALLOWED = {
    "errors": set(),
    "labels": set(),  # IGNORE_INDEX, shared by the data pipeline and the loss
    "versions": set(),
    "recipe": {"versions", "templates"},  # `requires:` is checked by the version rules; chat template names
    "templates": set(),  # the chat templates shipped by name (tokenizer.chat_template: chatml)
    "dist": set(),
    "attention": {"packed_kernels"},  # transformers' attention extension point, registered by model
    "packed_kernels": set(),  # a packed micro-batch's documents, found once, and the kernels that attend within them
    "data": {"recipe", "labels"},
    "model": {"architectures", "attention", "kernels", "recipe", "templates", "vocab"},
    "kernels": {"attention"},  # opt-in: Liger's kernels on the model instance, each decoder layer compiled
    "vocab": {"recipe"},  # special-token overrides, added tokens, the embedding resized for them
    "loss": {"labels", "targets"},
    "targets": {"labels"},  # where a micro-batch's targets are, found on the CPU
    "optim": {"recipe"},
    "rundir": {"recipe"},  # the run directory's layout and readers
    "metrics": {"recipe", "rundir"},
    "checkpoint": {"dist", "recipe", "rundir"},
    "architectures": set(),  # per-model_type knowledge: output heads, what is refused, LoRA exclusions
    "isolation": {"architectures", "attention", "data", "model_with_loss", "packed_kernels"},  # runs packed rows through a model as training collates them
    "logprobs": {"labels", "loss", "targets"},  # per-token log-probabilities through the fused head (preference objectives)
    "preference": set(),  # the per-pair DPO/ORPO losses, pure functions
    "model_with_loss": {"architectures", "attention", "logprobs", "loss", "model", "recipe", "targets"},
    "objective": {"model_with_loss", "preference", "recipe"},
    "parallel": {"dist", "model", "recipe"},
    "reference": {"data", "dist", "model", "model_with_loss", "objective", "recipe"},
    "trained": {"model", "recipe", "rundir"},
    "evaluate": {"data", "dist", "isolation", "loss", "model", "model_with_loss", "objective", "recipe", "reference",
                 "trained"},
    "step": {"dist", "objective", "parallel"},  # one optimizer step's figures on the device, read once
    "trainer": {"checkpoint", "data", "dist", "evaluate", "isolation", "kernels", "loss", "metrics", "model",
                "model_with_loss", "objective", "optim", "parallel", "recipe", "reference", "rundir", "step",
                "versions"},
    "convert": {"recipe", "templates"},  # `finetune convert axolotl`: a config in, a recipe out
    "cli": {"checkpoint", "compare", "convert", "data", "evaluate", "generate", "merge", "model", "plot", "recipe", "rundir",
            "trainer", "verify", "versions", "__init__"},
    "merge": {"model", "rundir", "trained"},
    "generate": {"dist", "rundir", "trained"},  # dist: the device (FINETUNE_DEVICE)
    "plot": {"metrics", "rundir"},
    "compare": {"recipe", "rundir"},
    "verify": {"data", "dist", "loss", "model", "model_with_loss", "objective", "recipe", "reference"},
    "__main__": {"cli"},
    "__init__": set(),
}


def _top(module_path: Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(package-level module imported, imported at module top level?)"""
    tree = ast.parse(path.read_text())
    found = []
    top_level = set(id(n) for n in tree.body)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("finetune"):
            parts = node.module.split(".")
            if len(parts) == 1:
                names = [alias.name for alias in node.names]
            else:
                names = [parts[1]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("finetune.")]
        for name in names:
            found.append((name, id(node) in top_level))
    return found


def test_every_module_is_known():
    modules = {_top(p) for p in PACKAGE.rglob("*.py")}
    assert modules <= set(ALLOWED), f"add new modules to ALLOWED: {modules - set(ALLOWED)}"


def test_import_direction():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _top(path)
        for name, _ in _imports(path):
            if name in ("errors", "__version__"):
                continue
            if name not in ALLOWED[me] and name != me:
                problems.append(f"{path.relative_to(PACKAGE)} imports finetune.{name}")
    assert not problems, "\n".join(problems)


def test_siblings_never_import_each_other():
    for path in PACKAGE.rglob("*.py"):
        me = _top(path)
        if me in SIBLINGS:
            bad = {n for n, _ in _imports(path)} & (SIBLINGS - {me})
            assert not bad, f"{path.name} imports {bad}"


def test_only_cli_imports_trainer_and_lazily():
    for path in PACKAGE.rglob("*.py"):
        for name, top_level in _imports(path):
            if name == "trainer":
                assert _top(path) == "cli", f"{path.name} imports the trainer"
                assert not top_level, "cli must import the trainer inside the command (lazily)"


def _files(module: str) -> list[Path]:
    """The files of a top-level module: module.py, or every file of the package module/."""
    single = PACKAGE / f"{module}.py"
    return [single] if single.is_file() else sorted((PACKAGE / module).rglob("*.py"))


def test_leaves_import_nothing_from_the_package():
    for leaf in LEAVES:
        for path in _files(leaf):
            names = {n for n, _ in _imports(path)} - {"errors", "__version__", leaf} - ALLOWED[leaf]
            assert not names, f"{path.relative_to(PACKAGE)} imports {names}"
