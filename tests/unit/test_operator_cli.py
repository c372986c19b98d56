"""The two ways to start the operator (``python -m splitserve_operator`` and
``splitserve operator``) take the same flags; render stays pure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from splitserve_operator.commands.operator import add_arguments, config_from

pytestmark = pytest.mark.unit


def test_flags_become_the_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from(
        parser.parse_args(
            [
                "-n",
                "a",
                "--namespace",
                "b",
                "--router-cluster-role",
                "r",
                "--resync-seconds",
                "7",
                "--workers",
                "3",
                "--liveness",
                "http://0.0.0.0:8080/healthz",
                "--no-events",
            ]
        )
    )
    assert config.namespaces == ("a", "b") and not config.clusterwide
    assert (config.router_cluster_role, config.resync_seconds, config.workers) == ("r", 7.0, 3)
    assert config.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    assert config.record_events is False
    settings = config.kopf_settings()
    assert settings.peering.standalone and settings.scanning.disabled
    assert settings.posting.enabled is False


def test_leader_election_flags_and_what_they_need(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.setenv("POD_NAMESPACE", "splitserve-system")
    monkeypatch.setenv("POD_NAME", "splitserve-7d9-abc")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from(parser.parse_args(["--leader-election", "--lease-name", "ss"]))
    lease = config.leader_election
    assert lease is not None
    assert (lease.namespace, lease.name, lease.identity) == (
        "splitserve-system",
        "ss",
        "splitserve-7d9-abc",
    )
    assert config_from(parser.parse_args([])).leader_election is None
    monkeypatch.delenv("POD_NAMESPACE")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="--lease-namespace or set POD_NAMESPACE"):
        config_from(parser.parse_args(["--leader-election"]))
    settings = config.kopf_settings()
    assert settings.watching.label_selectors[("apps", "deployments")] == (
        "app.kubernetes.io/managed-by=splitserve-operator"
    )


def test_splitserve_operator_subcommand_has_the_same_flags() -> None:
    from splitserve.cli import build_parser

    args = build_parser().parse_args(["operator", "--workers", "2", "-n", "x"])
    assert args.command == "operator"
    assert config_from(args).namespaces == ("x",) and config_from(args).workers == 2


def test_render_spec_and_status_import_neither_kopf_nor_the_client() -> None:
    code = (
        "import sys; import splitserve_operator.render.manifests, "
        "splitserve_operator.api.parse, splitserve_operator.api.status, "
        "splitserve_operator.control.ownership, splitserve_operator.control.config; "
        "bad = [m for m in ('kopf', 'kubernetes', 'grpc') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
