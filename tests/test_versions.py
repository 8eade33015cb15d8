"""The pinned matrix: one source of truth (finetune.versions) that pyproject and run time agree with."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import versions
from finetune.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project supports 3.10, where tomllib is the third-party tomli
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]

# The tested environment as our own lookup would report it: what CI installs (`make install`: liger-kernel comes
# with the dev extra), with the optional packages it leaves out (flash-attn, wandb, mlflow) absent.
TESTED = {"torch": versions.TORCH_TESTED,
          **{p: versions.PINNED[p] for p in ("transformers", "peft", "bitsandbytes", "liger-kernel")},
          "tensorboard": "2.20.0", "gguf": "0.17.1", "tokenizers": "0.22.1", "safetensors": "0.6.2"}


@pytest.fixture(params=[pytest.param("installed", marks=pytest.mark.pinned_env), "tested"])
def environment(request, monkeypatch) -> str:
    """`installed`: the tests read this machine's packages (the tested environment in CI; skipped where it differs,
    e.g. torch 2.11 and flash-attn on a GPU machine). `tested`: the same tests against the tested environment
    faked through versions.installed_version, so the rules are checked on every machine."""
    if request.param == "tested":
        real = versions.installed_version
        monkeypatch.setattr(versions, "installed_version",
                            lambda p: real(p) if p == "finetune" else TESTED.get(p))
    return request.param


def _requirements() -> dict[str, str]:
    """Every requirement string in pyproject (dependencies and extras), keyed by package name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs.extend(extra)
    out: dict[str, str] = {}
    for req in reqs:
        name, spec = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", req).groups()
        # The same package may appear in two extras (dev repeats bitsandbytes); they must agree.
        assert out.setdefault(name.lower(), spec.replace(" ", "")) == spec.replace(" ", ""), req
    return out


def test_pyproject_pins_equal_versions_module():
    reqs = _requirements()
    for package, version in versions.PINNED.items():
        assert reqs[package] == f"=={version}", f"{package}: pyproject {reqs[package]} vs PINNED {version}"
    assert reqs["torch"] == ",".join(versions.TORCH_RANGE)
    for package, minimum in versions.MINIMUMS.items():
        assert reqs[package] == minimum, package
    # Every exact pin in pyproject is in PINNED, so a new pin cannot bypass the run-time check.
    exact = {name for name, spec in reqs.items() if spec.startswith("==")}
    assert exact == set(versions.PINNED)


def test_tested_torch_is_in_range_and_matches_constraints():
    assert versions.compare_version("torch", ",".join(versions.TORCH_RANGE), versions.TORCH_TESTED) is None
    constraints = (ROOT / "constraints.txt").read_text()
    assert f"torch=={versions.TORCH_TESTED}" in constraints.split()


def test_feature_packages_have_extras():
    for feature, package in versions.FEATURE_PACKAGES.items():
        assert package in versions.EXTRAS, feature
        assert package in versions.PINNED or package in versions.MINIMUMS, package
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for package, extra in versions.EXTRAS.items():
        names = [re.split(r"[=<>]", r)[0] for r in project["optional-dependencies"][extra]]
        assert package in names, f"extra {extra!r} does not provide {package}"


def test_core_versions_pass_here(environment):
    assert versions.check_versions(versions.CORE) == []
    assert versions.enforce(versions.CORE, allow_unpinned=False) == []


@pytest.mark.parametrize(
    ("package", "wanted", "installed", "ok"),
    [
        ("transformers", "==5.23.0", "5.23.0", True),
        ("transformers", "==5.23.0", "5.24.0", False),
        ("transformers", "==5.23.0", "5.23.0rc1", False),
        ("peft", "==0.21.2", "0.21.2+local", True),  # PEP 440: local labels do not break ==
        ("flash-attn", "==2.8.3.post2", "2.8.3.post1", False),
        ("torch", ">=2.13,<2.14", "2.13.0+cpu", True),
        ("torch", ">=2.13,<2.14", "2.13.1+cu130", True),
        ("torch", ">=2.13,<2.14", "2.14.0", False),
        ("torch", ">=2.13,<2.14", "2.12.1", False),
        ("torch", ">=2.13,<2.14", "2.13.0a0+git1234", False),  # NGC-style pre-release build
        ("torch", ">=2.13,<2.14", "2.13.1rc1", True),  # a pre-release is judged by where it sorts
        ("torch", ">=2.13,<2.14", "2.14.0rc1", False),  # <2.14 never admits 2.14's own pre-releases
        ("torch", ">=2.13,<2.14", "not a version", False),
    ],
)
def test_compare_version(package, wanted, installed, ok):
    problem = versions.compare_version(package, wanted, installed)
    assert (problem is None) == ok


def test_faked_mismatch_gives_pip_line():
    problem = versions.compare_version("transformers", "==5.23.0", "4.57.1")
    assert problem is not None
    assert problem.installed == "4.57.1"
    assert problem.fix == "pip install 'transformers==5.23.0'"
    missing = versions.compare_version("flash-attn", "==2.8.3.post2", None)
    assert missing.installed is None
    assert missing.fix == "pip install 'flash-attn==2.8.3.post2' --no-build-isolation"
    assert versions.pip_line("torch") == "pip install 'torch>=2.13,<2.14'"


def test_enforce_raises_and_allow_returns_warnings(monkeypatch, environment):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    # Fake an installed transformers at another version (our own lookup, not the library).
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: "5.22.0" if p == "transformers" else real(p))
    with pytest.raises(UserError) as err:
        versions.enforce(versions.CORE, allow_unpinned=False)
    message = str(err.value)
    assert "transformers: installed 5.22.0, tested ==5.23.0" in message
    assert "pip install 'transformers==5.23.0'" in message
    assert "--allow-unpinned" in message and "FINETUNE_ALLOW_UNPINNED=1" in message
    assert "peft" not in message  # only the mismatches are listed

    warnings = versions.enforce(versions.CORE, allow_unpinned=True)
    assert len(warnings) == 1 and "transformers" in warnings[0] and "5.22.0" in warnings[0]

    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    assert versions.enforce(versions.CORE, allow_unpinned=False) == warnings


def test_enforce_missing_package_raises_even_when_allowed(monkeypatch, environment):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    # flash-attn is not installed in the tested environment.
    assert versions.installed_version("flash-attn") is None
    for allow in (False, True):
        with pytest.raises(UserError) as err:
            versions.enforce([*versions.CORE, "flash-attn"], allow_unpinned=allow)
        message = str(err.value)
        assert "flash-attn: not installed" in message
        assert "pip install 'flash-attn==2.8.3.post2' --no-build-isolation" in message
        assert "transformers" not in message
    assert "--allow-unpinned" in message  # explains that the flag does not cover missing packages


def test_require_packages(monkeypatch, environment):
    with pytest.raises(UserError) as err:
        versions.require_packages(["flash_attention_2", "bnb", "liger"])
    message = str(err.value)
    assert "pip install 'flash-attn==2.8.3.post2' --no-build-isolation" in message
    assert "pip install 'finetune[flash]'" in message
    assert "bitsandbytes" not in message and "liger" not in message  # installed here, so not reported
    versions.require_packages(["bnb", "tensorboard"])  # both installed: no error
    versions.require_packages([])
    with pytest.raises(ValueError, match="unknown feature"):
        versions.require_packages(["no-such-feature"])


def test_packages_for():
    assert versions.packages_for(["liger", "flash_attention_2"]) == [
        "torch",
        "transformers",
        "peft",
        "liger-kernel",
        "flash-attn",
    ]


def test_snapshot_is_json_and_complete(environment):
    data = json.loads(json.dumps(versions.snapshot(["w1"])))
    for key in (
        "python",
        "platform",
        "finetune",
        *versions.SNAPSHOT_PACKAGES,
        "device_info",
        "unpinned_warnings",
    ):
        assert key in data, key
    assert data["unpinned_warnings"] == ["w1"]
    assert data["transformers"] == versions.PINNED["transformers"]
    assert data["liger-kernel"] == versions.PINNED["liger-kernel"] and data["flash-attn"] is None
    assert {"device", "count", "cuda_version", "bf16"} <= set(data["device_info"])


# What `finetune env` says of a missing flash-attn: its pip line on a CUDA machine, elsewhere that it needs one.
FLASH_ATTN_FIX = ("pip install 'flash-attn==2.8.3.post2' --no-build-isolation" if versions.device_info()["device"] == "cuda"
                  else "needs a CUDA GPU: not for this machine")


def test_env_table_renders(environment):
    from rich.console import Console

    console = Console(width=200, record=True, color_system=None)
    console.print(versions.env_table())
    text = console.export_text()
    assert "transformers" in text and "ok" in text
    assert "optional-missing" in text  # flash-attn is absent here
    assert FLASH_ATTN_FIX in text  # a build of flash-attn is suggested only where it can work


def test_import_is_light():
    # In a fresh interpreter: importing the module (and reading the pins, as docker/build.sh does)
    # must not pull in torch, transformers, rich or packaging.
    code = (
        "import sys, finetune.versions as v; v.PINNED;"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'rich', 'packaging') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_shell_exports_for_build_script():
    out = subprocess.run(
        [sys.executable, "-m", "finetune.versions"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    values = dict(line.split("=", 1) for line in out.stdout.split())
    assert values["FLASH_ATTN_VERSION"] == versions.PINNED["flash-attn"]
    assert values["TORCH_VERSION"] == versions.TORCH_TESTED


def test_the_docs_state_the_pinned_versions():
    """README's Versions section and docker/README.md's table name exactly the pins of versions.py."""
    import re

    from conftest import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Versions"):readme.index("## Development")]
    docker = (REPO_ROOT / "docker" / "README.md").read_text()
    for package, version in versions.PINNED.items():
        assert f"{package} {version}" in section, package
        assert re.search(rf"^\| {re.escape(package)} \| {re.escape(version)} \|$", docker, re.M), package
    assert f"torch {','.join(versions.TORCH_RANGE)}" in section
    assert f"| torch | {versions.TORCH_TESTED} " in docker


@pytest.mark.pinned_env  # a subprocess reads the installed packages: flash-attn must be absent, as in CI
def test_env_piped_keeps_each_pip_line_whole():
    # `finetune env | cat` (or into a file or an issue report): the fix commands must stay copyable.
    result = subprocess.run([sys.executable, "-m", "finetune", "env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert FLASH_ATTN_FIX in result.stdout and "pip install 'wandb>=0.17'" in result.stdout
    assert "…" not in result.stdout


@pytest.mark.parametrize(("installed", "spec"), [("5.24.0rc1", ">=5.23"), ("5.23.0rc1", ">=5.23"),
                                                 ("5.23.0", "==5.23.0"), ("5.23.0rc1", "==5.23.0"),
                                                 ("2.13.1rc1", ">=2.13,<2.14"), ("2.14.0rc1", ">=2.13,<2.14")])
def test_pins_and_requires_follow_one_version_rule(monkeypatch, installed, spec):
    """A version meets a specifier the same way for the pins (compare_version) and a recipe's `requires:`."""
    monkeypatch.setattr(versions, "installed_version", lambda p: installed)
    pinned = versions.compare_version("transformers", spec, installed) is None
    try:
        versions.check_requires({"transformers": spec})
        required = True
    except UserError:
        required = False
    assert pinned == required == versions.satisfies(installed, spec)


@pytest.mark.parametrize(("value", "allowed"), [("1", True), ("true", True), ("Yes", True), (" TRUE ", True),
                                                ("0", False), ("", False), ("no", False)])
def test_allow_unpinned_env_is_read_in_one_place(monkeypatch, value, allowed):
    monkeypatch.setenv(versions.ALLOW_ENV, value)
    assert versions.allow_unpinned_env() is allowed
    monkeypatch.setattr(versions, "installed_version", lambda p: "5.22.0" if p == "transformers" else "99")
    if allowed:
        assert versions.enforce(["transformers"], allow_unpinned=False)  # warnings, no error
    else:
        with pytest.raises(UserError):
            versions.enforce(["transformers"], allow_unpinned=False)


def test_finetune_itself_is_the_running_version():
    from finetune import __version__

    assert versions.installed_version("finetune") == __version__ == versions.snapshot()["finetune"]
