"""The tested library matrix, checked at run time, and the data behind `finetune env`.

Why this exists: packed-sequence masking, LoRA injection names, fused-loss numerics and 4-bit
loading all change between releases of the libraries below, so a run on an untested version can
silently train a different model. Recipes are therefore run only on the exact pins (or, for torch,
the tested minor series) unless the user opts out with --allow-unpinned / FINETUNE_ALLOW_UNPINNED=1,
in which case the mismatch is recorded in the run's versions.json.

This is a leaf module: it imports nothing from the package except finetune.errors and nothing heavy
at import time (torch, rich and packaging are imported inside the functions that need them), so
`docker/build.sh` can read the pins with a bare python3 and the CLI can check versions before it
pays for importing torch. pyproject.toml, constraints.txt and the Docker build args are tested to
agree with the constants here (tests/test_versions.py, tests/test_docker.py).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError

if TYPE_CHECKING:  # only for the annotation; rich is imported lazily in env_table()
    from rich.table import Table

# Exact pins. Must equal pyproject.toml (dependencies and extras); tests/test_versions.py checks it.
PINNED: dict[str, str] = {
    "transformers": "5.23.0",
    "peft": "0.21.2",
    "liger-kernel": "0.8.5",
    "bitsandbytes": "0.50.2",
    "flash-attn": "2.8.3.post2",
    "mistral-common": "1.13.1",
    "torchao": "0.18.0",
}

# torch is a range, not a pin: CPU, CUDA 12.x and CUDA 13.x builds of one release differ only in the
# local label (+cpu, +cu130) and any 2.13.x patch keeps our numerics, but 2.14 is untested.
# Kept as the two PEP 440 clauses of pyproject's "torch>=2.13,<2.14" (joined with "," it is a
# specifier set).
TORCH_RANGE: tuple[str, str] = (">=2.13", "<2.14")

# The one torch release CI (Makefile, constraints.txt) and the Docker images install; any version in
# TORCH_RANGE is accepted at run time, but images need one exact version to be reproducible.
TORCH_TESTED = "2.13.0"

# Always needed: nothing trains without them.
CORE: tuple[str, ...] = ("torch", "transformers", "peft")

# Recipe feature -> the optional package it needs. Only required when a recipe turns the feature on.
FEATURE_PACKAGES: dict[str, str] = {
    "liger": "liger-kernel",
    "liger_kernels": "liger-kernel",
    "flash_attention_2": "flash-attn",
    "bnb": "bitsandbytes",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "tensorboard": "tensorboard",
    "gguf": "gguf",
    "mistral_common": "mistral-common",
    "qat": "torchao",
}

# pyproject extra that provides each optional package, for the friendlier "pip install 'finetune[x]'".
EXTRAS: dict[str, str] = {
    "liger-kernel": "liger",
    "flash-attn": "flash",
    "bitsandbytes": "bnb",
    "wandb": "tracking",
    "mlflow": "tracking",
    "tensorboard": "tracking",
    "gguf": "gguf",
    "mistral-common": "mistral",
    "torchao": "qat",
}

# Lower bounds of the unpinned optional packages (trackers only log; any recent release works).
# Also equal to pyproject.toml, checked by the tests.
MINIMUMS: dict[str, str] = {
    "wandb": ">=0.17",
    "mlflow": ">=2.10",
    "tensorboard": ">=2.15",
    "gguf": ">=0.10",
}

# Libraries recorded in versions.json: the matrix plus the ones whose behaviour feeds the data path.
SNAPSHOT_PACKAGES: tuple[str, ...] = (
    "torch",
    "transformers",
    "peft",
    "liger-kernel",
    "bitsandbytes",
    "flash-attn",
    "mistral-common",
    "torchao",
    "tokenizers",
    "datasets",
    "safetensors",
    "accelerate",
)

ALLOW_ENV = "FINETUNE_ALLOW_UNPINNED"


@dataclass
class VersionProblem:
    """One library that is missing or not at the tested version."""

    package: str
    wanted: str  # a PEP 440 specifier: "==5.23.0" or ">=2.13,<2.14"
    installed: str | None  # None: not installed
    fix: str  # the exact pip command that installs the tested version

    def describe(self) -> str:
        have = "not installed" if self.installed is None else f"installed {self.installed}"
        return f"{self.package}: {have}, tested {self.wanted}; fix: {self.fix}"


def installed_version(package: str) -> str | None:
    """Version string from the installed distribution's metadata, or None if it is not installed.

    Uses importlib.metadata rather than importing the module: importing torch or flash-attn takes
    seconds and can fail for reasons unrelated to the version (no driver, ABI mismatch). `finetune` itself is
    the running code's own __version__ (right for a checkout that is not pip-installed too).
    """
    if package.lower() == "finetune":
        from finetune import __version__  # the package root: version only, already imported as our parent

        return __version__
    # Distribution names are normalized by importlib.metadata on 3.11+, not on every 3.10 patch
    # release, so also try the underscore spelling used by the dist-info directory.
    for name in dict.fromkeys((package, package.replace("-", "_"), package.replace("_", "-"))):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def wanted_spec(package: str) -> str | None:
    """The tested specifier for a package: exact pin, torch range, tracker minimum, or None."""
    if package == "torch":
        return ",".join(TORCH_RANGE)
    if package in PINNED:
        return f"=={PINNED[package]}"
    return MINIMUMS.get(package)


def pip_line(package: str, spec: str | None = None) -> str:
    """The exact pip command that installs `package` at `spec` (default: its tested version)."""
    spec = wanted_spec(package) if spec is None else spec
    line = f"pip install '{package}{spec or ''}'"
    if package == "flash-attn":
        # flash-attn's setup.py imports torch, so it must build against the installed torch.
        line += " --no-build-isolation"
    return line


def compare_version(package: str, wanted: str, installed: str | None) -> VersionProblem | None:
    """Pure check of one installed version against a specifier; None when it satisfies it (see `satisfies`)."""
    fix = pip_line(package, wanted)
    if installed is None:
        return VersionProblem(package, wanted, None, fix)
    if satisfies(installed, wanted):
        return None
    return VersionProblem(package, wanted, installed, fix)


def satisfies(installed: str, wanted: str) -> bool:
    """Whether an installed version meets a PEP 440 specifier: the one version rule of the pins and `requires:`.

    What is installed is what runs, so a pre-release is judged by where it sorts, like any version: 2.13.1rc1 is
    in >=2.13,<2.14, while an NGC 2.13.0a0 build sorts before 2.13 and is not (PEP 440 ordering; `<2.14` still
    excludes 2.14's own pre-releases). A local label is ignored by == (2.13.0+cu130 == 2.13.0). An unparseable
    version (a git checkout, say) meets nothing. `packaging` is a transformers dependency, imported lazily so
    this module stays stdlib-only at import.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(installed)
    except InvalidVersion:
        return False
    return SpecifierSet(wanted).contains(version, prereleases=True)


def check_versions(packages: Iterable[str] = CORE) -> list[VersionProblem]:
    """Problems for the given packages: missing, or outside the pin/range. Empty list means all good.

    Packages with no pin, range or minimum (e.g. "tokenizers") are only checked for presence.
    """
    problems = []
    for package in dict.fromkeys(packages):  # de-duplicated, order kept for stable messages
        installed = installed_version(package)
        wanted = wanted_spec(package)
        if wanted is None:
            if installed is None:
                problems.append(VersionProblem(package, "any", None, f"pip install '{package}'"))
            continue
        problem = compare_version(package, wanted, installed)
        if problem is not None:
            problems.append(problem)
    return problems


def packages_for(features: Iterable[str]) -> list[str]:
    """CORE plus the optional packages the given recipe features need (for `enforce`)."""
    return [*CORE, *(_package_for(f) for f in features)]


def _package_for(feature: str) -> str:
    if feature in FEATURE_PACKAGES:
        return FEATURE_PACKAGES[feature]
    if feature in FEATURE_PACKAGES.values():  # a package name is accepted as its own feature
        return feature
    known = ", ".join(sorted(FEATURE_PACKAGES))
    raise ValueError(f"unknown feature {feature!r}; known features: {known}")


def require_packages(features: Iterable[str]) -> None:
    """Raise UserError naming every optional package a recipe needs that is not installed.

    Only presence is checked here; whether an installed one is at its pin is `enforce`'s job, so
    the two messages stay separate (install something vs. change a version).
    """
    missing = []
    for feature in dict.fromkeys(features):
        package = _package_for(feature)
        if installed_version(package) is None:
            extra = EXTRAS.get(package)
            alt = f" (or pip install 'finetune[{extra}]')" if extra else ""
            missing.append(f"  - {package} (needed by {feature!r}): {pip_line(package)}{alt}")
    if missing:
        raise UserError(
            "the recipe needs optional packages that are not installed:\n"
            + "\n".join(missing)
            + "\nInstall them, or turn the feature off in the recipe."
        )


def allow_unpinned_env() -> bool:
    """Whether FINETUNE_ALLOW_UNPINNED opts out of the pins: 1, true or yes (any case). The one reading of it."""
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")


def enforce(packages: Iterable[str], *, allow_unpinned: bool) -> list[str]:
    """Refuse to run on untested library versions unless the user opted out.

    Returns warning strings (one per mismatch, for the log and versions.json) when allowed via the
    argument or FINETUNE_ALLOW_UNPINNED=1; raises UserError listing every mismatch otherwise. A
    package that is not installed at all raises either way: no flag makes a run without it possible,
    and failing here gives the install line instead of an ImportError mid-setup.
    """
    problems = check_versions(packages)
    if not problems:
        return []
    allowed = allow_unpinned or allow_unpinned_env()
    missing = [p for p in problems if p.installed is None]
    if allowed and not missing:
        return [f"unpinned: {p.describe()}" for p in problems]
    listed = missing if allowed else problems
    hints = []
    if any(p.installed is not None for p in listed):
        hints.append(
            f"Run the fix commands above, or pass --allow-unpinned (or set {ALLOW_ENV}=1) to run on"
            " these versions anyway; the mismatch is then recorded in versions.json."
        )
    if missing:
        hints.append("Missing packages must be installed: --allow-unpinned only covers other versions.")
    header = (
        "libraries this run needs are not installed:"
        if len(missing) == len(listed)
        else "installed libraries differ from the tested versions:"
    )
    raise UserError("\n".join([header, *(f"  - {p.describe()}" for p in listed), *hints]))


def check_requires(requires: dict[str, str], source: str = "recipe") -> None:
    """Refuse a recipe whose `requires:` (distribution -> PEP 440 specifier) the installed packages do not meet,
    naming each one and the fix. Read from package metadata, never by importing: `finetune validate` stays fast.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    problems = []
    for package, text in requires.items():
        try:
            spec = str(SpecifierSet(text))
        except InvalidSpecifier:
            bare = text.strip()
            hint = f" (did you mean '=={bare}'?)" if bare[:1].isdigit() else ""
            problems.append(f"requires.{package}: {text!r} is not a version specifier{hint}; write e.g. "
                            "'>=5.23', '==5.23.0' or '>=2.13,<2.14'")
            continue
        wanted = f"{package}{spec}"
        installed = installed_version(package)
        if installed is None:
            problems.append(f"requires.{package}: needs {wanted}, which is not installed{_similar_dist(package)}; "
                            f"fix: pip install '{wanted}'")
        elif not satisfies(installed, spec):
            problems.append(f"requires.{package}: needs {wanted}, installed {installed}; fix: pip install '{wanted}'")
    if problems:
        noun = "requirement is" if len(problems) == 1 else "requirements are"
        raise UserError(f"{source}: {len(problems)} {noun} not met by the installed packages:\n"
                        + "\n".join(f"  - {line}" for line in problems)
                        + "\n  (to try anyway, drop the check with the override requires={})")


def _similar_dist(package: str) -> str:
    """' (did you mean X?)' when an installed distribution has a close name: a typo, not a missing package."""
    import difflib

    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    guess = difflib.get_close_matches(package.lower(), sorted(n for n in names if n), n=1, cutoff=0.75)
    return f" (did you mean '{guess[0]}'?)" if guess else ""


def device_info() -> dict[str, Any]:
    """What the run will compute on. Imports torch (lazily: this is the only place that does)."""
    info: dict[str, Any] = {
        "device": "cpu",
        "count": 0,
        "cuda_version": None,
        "capability": None,
        "bf16": False,
    }
    try:
        import torch
    except ImportError:
        info["device"] = "cpu (torch not installed)"
        return info
    info["cuda_version"] = torch.version.cuda  # what torch was built with; None for CPU builds
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            count=torch.cuda.device_count(),
            capability=f"{major}.{minor}",
            bf16=bool(torch.cuda.is_bf16_supported()),
        )
    else:
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            info.update(device="mps", count=1)
        # torch implements bf16 kernels on CPU (slow without AMX, but correct), and on MPS.
        info["bf16"] = True
    return info


def snapshot(warnings: Sequence[str] = ()) -> dict[str, Any]:
    """Everything versions.json records: interpreter, platform, library versions, device, warnings.

    JSON-serializable. Missing libraries are None rather than absent so runs compare key by key.
    """
    data: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "finetune": installed_version("finetune"),
    }
    for package in SNAPSHOT_PACKAGES:
        data[package] = installed_version(package)
    data["device_info"] = device_info()
    data["unpinned_warnings"] = list(warnings)
    return data


# Optional packages that only work with a CUDA GPU: `finetune env` does not suggest installing them elsewhere
# (flash-attn's build would fail, or take an hour, on a CPU-only machine).
CUDA_ONLY = ("flash-attn",)


def env_table() -> Table:
    """The `finetune env` table: each library's pin, installed version, status and fix, then device."""
    from rich.table import Table

    table = Table(
        title="finetune environment", caption=f"mismatches stop a run unless --allow-unpinned / {ALLOW_ENV}=1"
    )
    for column in ("library", "pinned", "installed", "status", "fix"):
        # The fix is a command to copy: folded on a narrow terminal, never cut with an ellipsis.
        table.add_column(column, no_wrap=column != "fix", overflow="fold" if column == "fix" else "ellipsis")
    optional = [p for p in dict.fromkeys(FEATURE_PACKAGES.values()) if p not in CORE]
    info = device_info()
    for package in (*CORE, *optional):
        installed = installed_version(package)
        wanted = wanted_spec(package)
        problem = compare_version(package, wanted, installed) if wanted else None
        if installed is None and package in CUDA_ONLY and info["device"] != "cuda":
            status, fix = "[dim]optional-missing[/dim]", "needs a CUDA GPU: not for this machine"
        elif installed is None:
            status = "[red]missing[/red]" if package in CORE else "[dim]optional-missing[/dim]"
            fix = pip_line(package)
        elif problem is not None:
            status, fix = "[bold red]MISMATCH[/bold red]", problem.fix
        else:
            status, fix = "[green]ok[/green]", ""
        table.add_row(package, wanted or "", installed or "-", status, fix)
    table.add_section()
    table.add_row("python", "", platform.python_version(), "", "")
    for key in ("device", "count", "cuda_version", "capability", "bf16"):
        value = info[key]
        table.add_row(key, "", "-" if value is None else str(value), "", "")
    return table


def _shell_exports() -> str:
    """Pins as shell assignments, for docker/build.sh (`eval "$(python3 -m finetune.versions)"`)."""
    values = {
        "TORCH_VERSION": TORCH_TESTED,
        "TRANSFORMERS_VERSION": PINNED["transformers"],
        "PEFT_VERSION": PINNED["peft"],
        "LIGER_KERNEL_VERSION": PINNED["liger-kernel"],
        "BITSANDBYTES_VERSION": PINNED["bitsandbytes"],
        "FLASH_ATTN_VERSION": PINNED["flash-attn"],
    }
    return "\n".join(f"{key}={value}" for key, value in values.items())


if __name__ == "__main__":
    print(_shell_exports())
