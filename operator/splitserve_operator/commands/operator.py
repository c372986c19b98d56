"""``splitserve operator``: run the Kubernetes operator (``python -m splitserve_operator``
takes the same flags; both need the ``operator`` extra)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.config import LeaseConfig, OperatorConfig

if TYPE_CHECKING:
    from splitserve_operator.control.prometheus import PrometheusAuth


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = OperatorConfig()
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        dest="namespaces",
        help="serve only this namespace (repeatable); default: the whole cluster",
    )
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file; default: in-cluster service account, else ~/.kube",
    )
    p.add_argument("--context", default=None, help="kubeconfig context")
    p.add_argument(
        "--router-cluster-role",
        default=defaults.router_cluster_role,
        help="ClusterRole bound to each router for worker discovery",
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=defaults.resync_seconds,
        help="seconds between full reconciles (0: never)",
    )
    p.add_argument(
        "--workers", type=int, default=defaults.workers, help="threads running reconciles"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout,
        help="seconds per API call",
    )
    p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz",
    )
    p.add_argument("--no-events", action="store_true", help="do not record Kubernetes Events")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the planner's /metrics (decisions, desired vs ready) on this port",
    )
    p.add_argument(
        "--prometheus-auth-url",
        default=None,
        metavar="URL",
        help="the cluster Prometheus the credentials below are for; they are sent only to "
        "queries under this URL",
    )
    p.add_argument(
        "--prometheus-bearer-token-file",
        default=None,
        metavar="FILE",
        help="bearer token for --prometheus-auth-url, read again for every query",
    )
    p.add_argument(
        "--prometheus-ca-file",
        default=None,
        metavar="FILE",
        help="PEM CA bundle that signs the certificate of --prometheus-auth-url",
    )
    p.add_argument(
        "--leader-election",
        action="store_true",
        help="run as one of several replicas: act only while holding a Lease",
    )
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        help="namespace of the Lease (default: $POD_NAMESPACE, the operator's own)",
    )
    p.add_argument("--lease-name", default="splitserve-operator", help="name of the Lease")
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="this replica's name in the Lease (default: $POD_NAME, else the host name)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def prometheus_auth(args: argparse.Namespace) -> PrometheusAuth | None:
    """The Prometheus credentials the flags give, checked together."""
    from splitserve_operator.control.prometheus import PrometheusAuth

    credentials = args.prometheus_bearer_token_file or args.prometheus_ca_file
    if not credentials:
        if args.prometheus_auth_url:
            raise SystemExit(
                "--prometheus-auth-url needs --prometheus-bearer-token-file or --prometheus-ca-file"
            )
        return None
    if not args.prometheus_auth_url:
        raise SystemExit(
            "--prometheus-bearer-token-file and --prometheus-ca-file need "
            "--prometheus-auth-url: the Prometheus they are for (nothing else gets them)"
        )
    auth = PrometheusAuth(
        url=args.prometheus_auth_url,
        bearer_token_file=args.prometheus_bearer_token_file,
        ca_file=args.prometheus_ca_file,
    )
    try:
        auth.verify()
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    return auth


def config_from(args: argparse.Namespace) -> OperatorConfig:
    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    lease = None
    if args.leader_election:
        if not args.lease_namespace:
            raise SystemExit(
                "--leader-election needs the Lease's namespace: pass --lease-namespace or set "
                "POD_NAMESPACE (the chart sets it from the pod's own namespace)"
            )
        lease = LeaseConfig(
            namespace=args.lease_namespace, name=args.lease_name, identity=args.identity
        )
    return OperatorConfig(
        namespaces=tuple(args.namespaces),
        router_cluster_role=args.router_cluster_role,
        resync_seconds=args.resync_seconds,
        workers=args.workers,
        request_timeout=args.request_timeout,
        liveness_endpoint=args.liveness,
        record_events=not args.no_events,
        autoscale=AutoscaleConfig(
            metrics_port=args.metrics_port, prometheus_auth=prometheus_auth(args)
        ),
        leader_election=lease,
    )


def run(args: argparse.Namespace) -> int:
    # Imported here: `--help` must not need a cluster or load the client.
    from splitserve_operator.control import runtime
    from splitserve_operator.control.k8s import load_configuration

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_from(args)
    configuration = load_configuration(args.kubeconfig, args.context)
    operator = runtime.build(config, configuration)
    try:
        return asyncio.run(runtime.serve(operator))
    except KeyboardInterrupt:
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="splitserve-operator",
        description="Reconcile InferenceServices into prefill, decode and router Deployments.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
