"""The Dockerfiles, without Docker: multi-stage, pinned bases, non-root, every COPY source
present in the build context, and entry points that exist and run."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
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
    # the pods fix no IDs of their own (the platform may assign them): the image's user
    # is what runAsNonRoot checks
    context = security.pod_security_context()
    assert context["runAsNonRoot"] is True
    assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(context)


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
        "operator/splitserve_operator/api/parse.py",
        "worker/splitserve_worker/models.py",
        "proto/splitserve/cli.py",
        "pyproject.toml",
    ):
        assert not ignored(path), path


def copied(name: str) -> list[str]:
    """The build-context paths a Dockerfile copies (not those from other stages)."""
    return [
        source.rstrip("/")
        for word, rest in instructions(name)
        if word == "COPY" and not rest.startswith("--from")
        for source in rest.split()[:-1]
    ]


def test_the_operator_image_copies_no_worker_code() -> None:
    sources = copied("Dockerfile.operator")
    assert sorted(sources) == [
        "README.md", "constraints.txt", "operator", "proto", "pyproject.toml"
    ]  # fmt: skip
    installs = [rest for word, rest in instructions("Dockerfile.operator") if word == "RUN"]
    # at the versions the suite passed with
    assert any('install -c constraints.txt ".[operator]"' in rest for rest in installs)
    assert not any("[worker" in rest for rest in installs)


@pytest.mark.slow
def test_what_the_operator_image_copies_builds_a_package_without_the_worker(
    tmp_path: Path,
) -> None:
    """The wheel ``pip install`` builds from exactly what Dockerfile.operator copies:
    the contract and the operator, the ``splitserve`` command, no worker module."""
    context = tmp_path / "context"
    context.mkdir()
    for source in copied("Dockerfile.operator"):
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, context / source)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(context)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("splitserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"splitserve", "splitserve_operator"}
    assert "splitserve_operator/control/runtime.py" in names
    assert "splitserve = splitserve.cli:main" in entry_points


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


def worker_build_runs() -> str:
    return " ".join(rest for word, rest in instructions("Dockerfile.worker") if word == "RUN")


def nixl_snippet(text: str) -> str:
    """The Python the build runs to name NIXL's wheel (the same in the Makefile)."""
    found = re.findall(r"python -c ['\"]([^'\"]*nixl_package[^'\"]*)['\"]", text)
    assert found, "NIXL's wheel is not chosen by nixl_package()"
    return str(found[0])


@pytest.mark.parametrize(("cuda", "wheel"), [("13.0", "nixl-cu13"), ("12.8", "nixl-cu12"),
                                             (None, "nixl-cu12")])  # fmt: skip
def test_the_worker_image_installs_the_nixl_wheel_for_its_torchs_cuda(
    monkeypatch: pytest.MonkeyPatch, cuda: str | None, wheel: str
) -> None:
    import contextlib
    import io

    import torch
    from splitserve_worker.kv.nixl_common import NIXL_VERSION

    runs = worker_build_runs()
    assert not re.search(r"nixl-cu\d+", runs), "a fixed NIXL wheel, whatever torch's CUDA"
    monkeypatch.setattr(torch.version, "cuda", cuda)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(nixl_snippet(runs), {})
    assert out.getvalue().strip() == wheel
    # the meta package without its dependencies (it would pull both wheels and a torch)
    install = 'pip install --no-deps "${NIXL_PACKAGE}==${NIXL_VERSION}" "nixl==${NIXL_VERSION}"'
    assert install in runs
    args = dict(rest.split("=", 1) for word, rest in instructions("Dockerfile.worker")
                if word == "ARG" and "=" in rest)  # fmt: skip
    assert args["NIXL_VERSION"] == NIXL_VERSION and args["WITH_NIXL"] == "1"
    make = (ROOT / "Makefile").read_text()
    made = re.search(r"^NIXL_PACKAGE := (.*)$", make, re.M)
    assert made is not None and made[1] == nixl_snippet(runs), "make setup chooses alike"
    assert '-c "$(NIXL_PACKAGE)")==$(NIXL_VERSION)"' in make
    assert f"NIXL_VERSION := {NIXL_VERSION}" in make


def test_the_worker_image_is_a_gpu_image() -> None:
    """A pinned CUDA torch, the driver capabilities CUDA and NVML need, and a C compiler in
    the runtime stage (Triton builds its launcher at first use: FlexAttention on CUDA)."""
    found = instructions("Dockerfile.worker")
    args = dict(rest.split("=", 1) for word, rest in found if word == "ARG" and "=" in rest)
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", args["TORCH_SPEC"])
    env = " ".join(rest for word, rest in found if word == "ENV").split()
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES") for e in env), "the device plugin's"
    runtime = found[max(i for i, (word, _) in enumerate(found) if word == "FROM") :]
    installs = " ".join(rest for word, rest in runtime if word == "RUN")
    assert "apt-get install -y --no-install-recommends gcc" in installs
    assert "rm -rf /var/lib/apt/lists/*" in installs
    assert args["WITH_FLASHINFER"] == "0", "FlashInfer stays optional"
