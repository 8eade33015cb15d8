"""The import direction of docs/design.md ("Layout"), checked by parsing every module's imports with ast.

recipe -> data -> attention -> model -> loss -> rl -> objectives -> train -> commands. Leaves (errors, labels,
versions, dist, templates, batch) import nothing from the package but `errors` (batch: labels); data, loss, metrics
and run never import each other's internals beyond this table; only cli imports the training loop, and lazily.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"

LEAVES = {"errors", "labels", "versions", "dist", "templates", "batch", "attention", "progress", "chat"}
SIBLINGS = {"data", "loss", "metrics"}
# What each top-level module or package may import from the package (beyond `errors`, which everything may
# import). A package is one module here: its files may import each other.
ALLOWED = {
    "errors": set(),
    "labels": set(),  # IGNORE_INDEX, shared by the data pipeline and the loss
    "versions": set(),
    "dist": set(),  # rank and world facts, each rank's device, the few collectives
    "templates": set(),  # the chat templates shipped by name (tokenizer.chat_template: chatml)
    "progress": set(),  # a long phase's progress on stderr (a line in place on a terminal, a line per update off one)
    "chat": set(),  # the chat rendering engine: any Jinja template's messages, turns and their tokens (SFT and RL)
    # rows split across ranks: their targets and documents found whole; Ulysses attention around ours, or the ring;
    # which models it can split (ours: attention; their heads: model)
    "context_parallel": {"attention", "batch", "labels", "model"},
    "recipe": {"versions", "templates"},  # `requires:` is checked by the version rules; chat template names
    "batch": {"labels"},  # the micro-batch: what collate makes and the objectives and the model read
    "data": {"recipe", "labels", "batch", "chat", "progress"},  # recipe datasets -> samples -> rows -> micro-batches
    "attention": {"batch"},  # packed attention: transformers' extension point and the kernels behind it
    "loss": {"labels", "batch"},  # the fused linear cross-entropy, per-token log-probabilities
    "model": {"attention", "batch", "data", "loss", "progress", "recipe", "templates"},  # loading, the model with its loss
    # the seam, SFT, DPO/ORPO, the reference; GRPO's plan and rows from rl
    "objectives": {"batch", "context_parallel", "data", "dist", "labels", "loss", "model", "progress", "recipe", "rl"},
    # rollouts (replayed), rewards (the reward_model built-in loads a trained reward model: model, run), advantages,
    # which rows each step trains
    "rl": {"batch", "chat", "data", "dist", "labels", "model", "progress", "recipe", "run"},
    "run": {"dist", "model", "recipe"},  # the run directory, checkpoints, a finished run's model
    "metrics": {"recipe", "run"},
    "train": {"attention", "batch", "context_parallel", "data", "dist", "loss", "metrics", "model", "objectives",
              "progress", "recipe", "rl", "run", "versions"},
    "commands": {"batch", "chat", "data", "dist", "loss", "metrics", "model", "objectives", "progress", "recipe", "run",
                 "train"},
    "convert": {"recipe", "templates"},  # `finetune convert axolotl`: a config in, a recipe out
    "cli": {"commands", "convert", "data", "model", "progress", "recipe", "run", "train", "versions", "__init__"},
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


def test_only_cli_and_commands_import_train_and_lazily():
    for path in PACKAGE.rglob("*.py"):
        for name, top_level in _imports(path):
            if name == "train" and _top(path) not in ("train", "commands"):
                assert _top(path) == "cli", f"{path.name} imports the training package"
                assert not top_level, "cli must import training inside the command (lazily)"


def _files(module: str) -> list[Path]:
    """The files of a top-level module: module.py, or every file of the package module/."""
    single = PACKAGE / f"{module}.py"
    return [single] if single.is_file() else sorted((PACKAGE / module).rglob("*.py"))


def test_leaves_import_nothing_from_the_package():
    for leaf in LEAVES:
        for path in _files(leaf):
            names = {n for n, _ in _imports(path)} - {"errors", "__version__", leaf} - ALLOWED[leaf]
            assert not names, f"{path.relative_to(PACKAGE)} imports {names}"
