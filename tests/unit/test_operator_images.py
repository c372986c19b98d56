"""The Dockerfiles, without Docker: multi-stage, pinned bases, non-root, every COPY source
present in the build context, and entry points that exist and run."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from splitserve_operator.render import commands, security

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile.operator", "Dockerfile.worker"]


def instructions(name: str) -> list[tuple[str, str]]:
    text = (ROOT / name).read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def base_images(name: str) -> list[str]:
    args: dict[str, str] = {}
    images = []
    for word, rest in instructions(name):
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args.setdefault(key, value.strip('"'))
        if word == "FROM":
            image = rest.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image))
    return images


def ignored(path: str) -> bool:
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    parts = Path(path).parts
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if (
                fnmatch.fnmatch(prefix, pattern)
                or fnmatch.fnmatch(prefix, pattern.replace("**/", ""))
                or (pattern.startswith("**/") and fnmatch.fnmatch(parts[i - 1], pattern[3:]))
            ):
                return True
    return False


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_with_pinned_bases(name: str) -> None:
    images = base_images(name)
    assert len(images) >= 2, "a build stage and a small runtime stage"
    for image in images:
        _repo, _, tag = image.partition(":")
        assert tag and tag != "latest", image
        assert re.match(r"^\d+\.\d+\.\d+-slim-[a-z]+$", tag), f"{image}: pin version and distro"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_the_non_root_user_the_pods_expect(name: str) -> None:
    users = [rest for word, rest in instructions(name) if word == "USER"]
    assert users, "the final stage must switch user"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can verify it"
    assert int(uid) == security.RUN_AS_USER


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_file_is_in_the_build_context(name: str) -> None:
    for word, rest in instructions(name):
        if word != "COPY" or rest.startswith("--from"):
            continue
        *sources, _dest = rest.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{name} copies {source}, which does not exist"
            assert not ignored(source.rstrip("/")), f".dockerignore excludes {source}"


def test_the_context_leaves_out_what_images_do_not_need() -> None:
    for path in (".venv", ".git", "tests/unit", "operator/splitserve_operator/__pycache__"):
        assert ignored(path), path
    for path in (
        "operator/splitserve_operator/spec.py",
        "worker/splitserve_worker/cli.py",
        "pyproject.toml",
    ):
        assert not ignored(path), path


def test_the_operator_entry_point_runs() -> None:
    (entry,) = [rest for word, rest in instructions("Dockerfile.operator") if word == "ENTRYPOINT"]
    assert entry == '["python", "-m", "splitserve_operator"]'
    out = subprocess.run(
        [sys.executable, "-m", "splitserve_operator", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--router-cluster-role" in out


def test_the_worker_entry_point_is_the_command_the_operator_runs() -> None:
    (entry,) = [rest for word, rest in instructions("Dockerfile.worker") if word == "ENTRYPOINT"]
    assert entry == f'["{commands.EXECUTABLE}"]'
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts[commands.EXECUTABLE].partition(":")
    out = subprocess.run(
        [sys.executable, "-c", f"import {module} as m; m.{func}(['--help'])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "worker" in out.stdout and "router" in out.stdout and "operator" in out.stdout


def test_the_worker_image_exposes_the_rendered_ports() -> None:
    exposed = {
        int(p)
        for word, rest in instructions("Dockerfile.worker")
        if word == "EXPOSE"
        for p in rest.split()
    }
    assert {
        commands.WORKER_GRPC_PORT,
        commands.WORKER_METRICS_PORT,
        commands.ROUTER_HTTP_PORT,
    } <= exposed
