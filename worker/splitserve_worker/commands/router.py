"""``splitserve router``: the OpenAI-compatible router alone, in front of running workers.

    splitserve router --model smollm2-135m --workers prefill=127.0.0.1:7001,decode=127.0.0.1:7002
    splitserve router --model /models/x --discovery kubernetes --namespace ns \\
        --selector app.kubernetes.io/instance=my-llm

The worker token comes from ``--token-file`` or ``SPLITSERVE_WORKER_TOKEN``; the API key
(optional) from ``--api-key-file`` or ``SPLITSERVE_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from splitserve_worker.commands.tls_flags import TLS_FLAGS, add_tls_arguments

API_KEY_ENV = "SPLITSERVE_API_KEY"
SECRET_ON_COMMAND_LINE = (
    "--api-key would show the key to every user of this host (ps, /proc): put it in a "
    f"file and pass --api-key-file FILE, or set {API_KEY_ENV}"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in name or checkpoint folder (tokenizer)")
    p.add_argument(
        "--served-model-name", default=None, help="model id clients use (default: --model)"
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve /metrics, alone and without the API key, on this "
                   "port (for Prometheus; on the API port it needs the key when one is "
                   "set)")  # fmt: skip
    p.add_argument(
        "--workers",
        default=None,
        help="static list: ROLE=HOST:PORT,... (ROLE: prefill, decode, both)",
    )
    p.add_argument("--discovery", choices=("static", "kubernetes"), default="static")
    p.add_argument("--namespace", default=None, help="Kubernetes namespace of the worker pods")
    p.add_argument("--selector", default=None, help="label selector of the worker pods")
    p.add_argument("--role-label", default=None, help="pod label holding the worker role")
    p.add_argument("--token-file", default=None, help="file holding the shared worker token")
    p.add_argument(
        "--api-key-file", default=None, help=f"file holding the API key (or ${API_KEY_ENV})"
    )
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: a secret
    p.add_argument(
        "--config", default=None, help="router settings, YAML or JSON (see RouterConfig)"
    )
    p.add_argument("--kv-backend", choices=("tcp", "grpc", "nixl"), default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--disaggregation", choices=("auto", "always", "never"), default=None)
    p.add_argument("--default-max-tokens", type=int, default=None)
    p.add_argument("--max-request-bytes", type=int, default=None)
    p.add_argument("--max-retries", type=int, default=None)
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=None,
        help="lease asked for the decode blocks reserved for a remote prefill "
        "(timeouts.lease_s; the workers' --lease-seconds)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="any other setting of the config, e.g. queues.max_wait_s=10 "
        "(repeatable; over --config, under the flags above)",
    )
    add_tls_arguments(p, worker=False)
    p.add_argument("--log-level", default="info")


def load_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """RouterConfig from --config, then the command-line flags, then ``overrides``."""
    from splitserve_worker.router.config import RouterConfig

    data: dict[str, Any] = {}
    if args.config:
        text = Path(args.config).read_text()
        if args.config.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    for item in args.set:
        set_path(data, item)
    data["model_name"] = args.served_model_name or args.model
    if args.kv_backend:
        data["kv_backend"] = args.kv_backend
    if args.block_size:
        data["block_size"] = args.block_size
    for name in ("max_model_len", "disaggregation", "default_max_tokens", "max_request_bytes",
                 "max_retries"):  # fmt: skip
        if getattr(args, name) is not None:
            data[name] = getattr(args, name)
    if args.lease_seconds is not None:
        set_path(data, f"timeouts.lease_s={args.lease_seconds}")
    for name in TLS_FLAGS:  # --tls-cert sets tls.cert_file, ...
        if getattr(args, name, None) is not None:
            key = name.removeprefix("tls_")
            setting = key if key == "server_name" else f"{key}_file"
            data.setdefault("tls", {})[setting] = getattr(args, name)
    data.update(overrides)
    if "max_model_len" not in data:  # what the workers serve, read from the model's config
        from splitserve_worker.models import model_context_limit

        data["max_model_len"] = model_context_limit(args.model)
    return RouterConfig.from_mapping(data)


def set_path(data: dict[str, Any], item: str) -> None:
    """Apply one ``--set SECTION.KEY=VALUE`` to the config mapping: the value is read as
    JSON (numbers, true/false) or else taken as text; the config's own checks judge it."""
    from splitserve_worker.router.config import ConfigError

    key, sep, raw = item.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(
            f"--set takes SECTION.KEY=VALUE (e.g. queues.max_wait_s=10), got {item!r}"
        )
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    node = data
    for i, part in enumerate(path[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {'.'.join(path[: i + 1])} is a value, not a section")
    node[path[-1]] = value


def read_secret(path: str | None, env: str, environ: dict[str, str] | None = None) -> str | None:
    """A secret from the file ``path``, else from the environment variable ``env``, else
    None (never from a command line)."""
    if path:
        value = Path(path).read_text().strip()
        if not value:
            raise ValueError(f"{path} is empty")
        return value
    return (os.environ if environ is None else environ).get(env, "").strip() or None


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from splitserve_worker.models import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model, weights=False)))


def make_discovery(args: argparse.Namespace) -> Any:
    from splitserve_worker.router import discovery as disc

    if args.discovery == "kubernetes":
        if not args.namespace or not args.selector:
            raise ValueError("--discovery kubernetes needs --namespace and --selector")
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return disc.KubernetesDiscovery(
            client.CoreV1Api(), args.namespace, args.selector, args.role_label or disc.ROLE_LABEL
        )
    if not args.workers:
        raise ValueError("pass --workers ROLE=HOST:PORT,... or --discovery kubernetes")
    return disc.StaticDiscovery(disc.parse_static(args.workers))


def build_app(args: argparse.Namespace, **overrides: Any) -> Any:
    from splitserve_worker.router.app import create_app
    from splitserve_worker.router.service import RouterService
    from splitserve_worker.server.auth import TOKEN_ENV, load_token

    if args.api_key is not None:
        raise ValueError(SECRET_ON_COMMAND_LINE)
    token = load_token(args.token_file) if (args.token_file or os.environ.get(TOKEN_ENV)) else None
    api_key = read_secret(args.api_key_file, API_KEY_ENV)
    cfg = load_config(args, worker_token=token, api_key=api_key, **overrides)
    service = RouterService(cfg, load_tokenizer(args.model), make_discovery(args))
    if args.metrics_port is not None:
        serve_metrics(args.host, args.metrics_port, service.registry)
    return create_app(service)


def serve_metrics(host: str, port: int, registry: Any) -> Any:
    """``/metrics`` on a port of its own, from a daemon thread (for the process's life);
    returns the :class:`~splitserve.metric_server.MetricsServer`."""
    from splitserve.metric_server import start_metrics_server

    if not 0 <= port < 65536:
        raise ValueError(f"--metrics-port must be in [0, 65535], got {port}")
    try:
        return start_metrics_server(port, registry, host=host)
    except OSError as e:
        raise OSError(
            f"cannot serve metrics on {host}:{port}: {e.strerror}; choose another --metrics-port"
        ) from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from splitserve_worker.router.http_server import server_config

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = build_app(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"router: OpenAI API on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.Server(server_config(app, args.host, args.port, log_level=args.log_level)).run()
    return 0
