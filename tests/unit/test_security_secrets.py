"""Secrets stay out of command lines, reprs, files others can read, and error answers.

Complements the chart and operator checks (RBAC verbs, restricted pods, NetworkPolicy:
``test_chart_*``, ``test_operator_*``) and the integration checks (every RPC needs the
token, no secret in any log line: ``test_security_worker_auth``, ``test_faults_secrets``).
"""

from __future__ import annotations

import argparse
import asyncio
import stat
from pathlib import Path

import pytest
from splitserve.roles import Role
from splitserve_worker.commands import router as router_cmd
from splitserve_worker.commands import up as up_cmd
from splitserve_worker.commands import worker as worker_cmd
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.errors import APIError
from splitserve_worker.server.auth import UNAUTHENTICATED_MESSAGE, TokenAuthInterceptor
from splitserve_worker.server.config import WorkerConfig

pytestmark = pytest.mark.unit

SECRET = "s3cr3t-value-9c1f"


def options(module: object) -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser()
    module.add_arguments(p)  # type: ignore[attr-defined]
    return {opt: a for a in p._actions for opt in a.option_strings}


@pytest.mark.parametrize("module", [worker_cmd, router_cmd, up_cmd], ids=["worker", "router", "up"])
def test_the_worker_token_is_never_a_command_line_value(module: object) -> None:
    """Command lines are visible to every user of the host (ps, /proc): the shared worker
    token comes from a file or the environment only."""
    for opt in options(module):
        if "token" in opt and "tokens" not in opt:
            assert opt.endswith("-file"), f"{opt} would put the worker token on a command line"


def test_configs_never_print_their_secrets() -> None:
    rc = RouterConfig.from_mapping({"api_key": SECRET, "worker_token": SECRET + "w"})
    assert rc.api_key == SECRET and rc.worker_token == SECRET + "w"
    assert SECRET not in repr(rc) and SECRET not in str(rc)
    wc = WorkerConfig(role="decode", model="m", token=SECRET)
    assert SECRET not in repr(wc)


def test_up_keeps_the_token_in_a_private_file_not_on_the_command_line() -> None:
    procs = up_cmd.WorkerProcs("m", [Role.PREFILL, Role.DECODE], SECRET)
    try:
        assert procs.token_file.read_text() == SECRET
        assert stat.S_IMODE(procs.token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(procs.token_file.parent.stat().st_mode) == 0o700
        for role in procs.roles:
            assert not any(SECRET in arg for arg in procs.command(role))
    finally:
        procs.stop()
    assert not procs.token_file.exists(), "the token file outlives the stack"


def test_refusals_never_echo_a_secret() -> None:
    assert "{" not in UNAUTHENTICATED_MESSAGE  # a constant: nothing from the call is echoed
    body = APIError(401, "missing or wrong API key", code="invalid_api_key").body()
    assert body["error"]["type"] == "authentication_error"
    assert "API key" in body["error"]["message"]
    with pytest.raises(ValueError, match="must not be empty"):
        TokenAuthInterceptor("")


def test_router_secret_files_must_not_be_empty(tmp_path: Path) -> None:
    empty = tmp_path / "key"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        router_cmd.read_secret(str(empty), "SPLITSERVE_TEST_UNSET_ENV")
    full = tmp_path / "key2"
    full.write_text(SECRET + "\n")
    assert router_cmd.read_secret(str(full), "SPLITSERVE_TEST_UNSET_ENV") == SECRET


def test_api_key_check_is_exact(tmp_path: Path) -> None:
    """Near misses of the key are refused: prefix, suffix, case, other schemes."""
    import httpx
    from splitserve_worker.router.app import create_app
    from splitserve_worker.router.discovery import StaticDiscovery
    from splitserve_worker.router.service import RouterService

    class Tok:
        chat_template = None

        def __len__(self) -> int:
            return 10

    app = create_app(RouterService(RouterConfig(api_key=SECRET), Tok(), StaticDiscovery([])))

    async def status(auth: str) -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as c:
            r = await c.get("/v1/models", headers={"Authorization": auth} if auth else {})
            assert SECRET not in r.text
            return r.status_code

    async def scenario() -> None:
        for bad in ("", SECRET, f"Bearer {SECRET[:-1]}", f"Bearer {SECRET}x",
                    f"Bearer {SECRET.upper()}", f"Token {SECRET}", "Bearer "):  # fmt: skip
            assert await status(bad) == 401, bad
        assert await status(f"Bearer {SECRET}") == 200
        assert await status(f"bearer {SECRET}") == 200  # the scheme is case-insensitive

    asyncio.run(scenario())


def test_an_api_key_on_a_command_line_is_refused_saying_what_to_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--api-key`` put the key in ``ps`` for every user of the host: ``up`` and
    ``router`` refuse it and name the file and the environment variable instead."""
    p = argparse.ArgumentParser()
    up_cmd.add_arguments(p)
    assert up_cmd.run(p.parse_args(["--model", "m", "--api-key", SECRET])) == 1
    err = capsys.readouterr().err
    assert "--api-key-file" in err and "SPLITSERVE_API_KEY" in err and SECRET not in err
    p = argparse.ArgumentParser()
    router_cmd.add_arguments(p)
    args = p.parse_args(["--model", "m", "--workers", "decode=127.0.0.1:9", "--api-key", SECRET])
    with pytest.raises(ValueError, match="--api-key-file") as e:
        router_cmd.build_app(args)
    assert SECRET not in str(e.value)


def test_the_api_key_comes_from_its_file_or_the_environment(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(SECRET + "\n")
    env = {"SPLITSERVE_API_KEY": SECRET + "-env"}
    assert router_cmd.read_secret(str(key), "SPLITSERVE_API_KEY", env) == SECRET
    assert router_cmd.read_secret(None, "SPLITSERVE_API_KEY", env) == SECRET + "-env"
    assert router_cmd.read_secret(None, "SPLITSERVE_API_KEY", {}) is None


def test_the_operators_pods_carry_no_secret_on_their_command_lines() -> None:
    """What the operator renders for the example InferenceService (its router's API key
    from a Secret): the worker token reaches every pod as a mounted file, the API key as
    an environment variable from its Secret; no container's command or arguments hold
    either, nor a flag that would take one."""
    import yaml
    from render_helpers import objects

    example = Path(__file__).parents[2] / "charts/splitserve/examples/inferenceservice.yaml"
    spec = yaml.safe_load(example.read_text())["spec"]
    objs = objects({k: v for k, v in spec.items() if k not in ("model", "image")})
    pods = [o["spec"]["template"]["spec"] for o in objs.values() if o["kind"] == "Deployment"]
    assert len(pods) == 3
    for pod in pods:
        for c in pod["containers"] + pod.get("initContainers", []):
            line = [*c.get("command", []), *c.get("args", [])]
            assert not any("secret-token" in a for a in line), line
            assert not any(a in ("--api-key", "--token") for a in line), line
            for e in c.get("env", []):
                if any(w in e["name"] for w in ("KEY", "TOKEN", "SECRET", "PASSWORD")):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], e
    keyed = [e for p in pods for c in p["containers"] for e in c.get("env", [])
             if e["name"] == "SPLITSERVE_API_KEY"]  # fmt: skip
    assert keyed, "the example's API key does not reach the router"
    secrets_ = [o for o in objs.values() if o["kind"] == "Secret"]
    assert [s["stringData"] for s in secrets_] == [{"token": "secret-token"}]
