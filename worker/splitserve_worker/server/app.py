"""Assemble a worker: model, engine, KV backends, the gRPC server, metrics, background tasks.

A worker told to run on CUDA checks first that it can (:mod:`.device_health`), and
watches the engine's errors for a failed device: :attr:`RunningWorker.device_failed` is
set then, and ``splitserve worker`` exits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from splitserve.kv_compat import Compat
from splitserve.metric_registry import Metrics
from splitserve.metric_server import MetricsServer, start_metrics_server
from splitserve.roles import Role

from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.lease import LeaseTable
from splitserve_worker.kv.transport import (
    BackendContext,
    ReceiverBackend,
    create_receiver_backend,
)
from splitserve_worker.metrics import gpu as gpu_metrics
from splitserve_worker.parallel.collectives import RankLost
from splitserve_worker.server.config import ROLES, WorkerConfig
from splitserve_worker.server.device_health import DeviceHealth, require_device
from splitserve_worker.server.errors import RpcFailure
from splitserve_worker.server.events import EventHub
from splitserve_worker.server.grpc_listen import listen
from splitserve_worker.server.handoff import DecodeHandoff
from splitserve_worker.server.pod_labels import follow_role_label
from splitserve_worker.server.prefill import PrefillRunner
from splitserve_worker.server.rank_kv import RankKV, RankKVSpec
from splitserve_worker.server.rank_push import RankPushes, RankPushSpec
from splitserve_worker.server.role_switch import RoleState, RoleSwitcher
from splitserve_worker.server.service import WorkerService, add_to_server
from splitserve_worker.server.tcp_sink import start_tcp_server

log = logging.getLogger(__name__)

RANK_EXIT_WAIT_S = 1.0
"""How long a collective's failure waits to see which rank process exited, so that the
worker names it (a peer's sockets close a moment before its exit shows)."""


@dataclass
class RunningWorker:
    config: WorkerConfig
    server: grpc.aio.Server
    address: str
    engine: Any
    service: WorkerService
    metrics: Metrics
    device: DeviceHealth
    device_failed: asyncio.Event
    """Set once the engine met a sticky device error (``device.failure`` says which)."""
    metrics_port: int | None = None
    _resources: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    """Everything :func:`start_worker` started, closed in the reverse order."""

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (calls under way get ``grace`` seconds), then close the rest:
        background tasks, KV push port and backends, metrics, the engine thread."""
        await self.server.stop(grace)
        await self._resources.aclose()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_worker(
    config: WorkerConfig, *, loaded: Any = None, clock: Callable[[], float] = time.monotonic
) -> RunningWorker:
    """Load the model (unless ``loaded`` is given), start the engine and serve. ``clock``:
    what leases and a role switch's drain are measured on (tests move it).

    When a step fails (a port taken, a KV backend that cannot start), everything started
    before it is closed again, the engine thread included, and the error is raised. A
    CUDA device that is not there raises :class:`~.device_health.DeviceUnavailable`
    before anything is loaded.
    """
    from splitserve_worker.engine.async_engine import AsyncEngine
    from splitserve_worker.engine.engine import Engine
    from splitserve_worker.models import load_model
    from splitserve_worker.server.ranks import start_ranked_engine

    require_device(config.device)
    tp = config.tensor_parallel_size
    if loaded is None and tp == 1:
        loaded = await asyncio.to_thread(
            load_model, config.model, dtype=config.dtype, device=config.device
        )
    stack = contextlib.AsyncExitStack()
    try:
        metrics = Metrics(CollectorRegistry())
        device = DeviceHealth()
        device_failed = asyncio.Event()
        loop = asyncio.get_running_loop()

        def failed(_: str) -> None:  # on the engine thread, or the rank watcher's
            loop.call_soon_threadsafe(device_failed.set)

        device.on_failure(failed)
        engine_config: Any = config.engine_config()
        # tcp and grpc cost nothing until used: a decode worker takes both, and NIXL when
        # configured
        receiver_names = tuple(sorted({"tcp", "grpc", config.kv_backend}))
        ranked = None
        if tp > 1:
            serve: list[Any] = []  # what every rank does besides forwards
            if config.serves_decode:  # receives its own KV heads
                serve.append(RankKVSpec(config.host, config.kv_port, config.token, config.tls,
                                        world=tp, backends=receiver_names))  # fmt: skip
            if config.serves_prefill:  # pushes its own KV heads
                serve.append(RankPushSpec(config.token, config.tls, config.kv_streams,
                                          config.checksums, config.checksum_every,
                                          config.transfer_timeout_s))  # fmt: skip
            ranked = await asyncio.to_thread(
                start_ranked_engine, config.model, tp, engine_config, metrics,
                allreduce=config.tp_allreduce, serve=tuple(serve),
            )  # fmt: skip
            stack.callback(ranked.ranks.stop)
            ranked.ranks.on_lost(device.fail)
            engine = ranked.engine
        else:
            engine = Engine(loaded, engine_config, metrics)
        gpu_metrics.register_device_metrics(metrics.registry, engine.device.type)

        def on_error(e: BaseException) -> None:  # on the engine thread
            if isinstance(e, RankLost):
                if ranked is not None:  # a rank that has exited is named (it fails first)
                    ranked.ranks.check(within_s=RANK_EXIT_WAIT_S)
                device.fail(str(e))
            device.observe(e)

        aengine = AsyncEngine(engine, on_error=on_error).start()
        stack.push_async_callback(aengine.close)
        compat = Compat.from_mapping(engine.compat_info())

        server, port = listen(config.host, config.port, config.token, config.tls, "--port")
        serving = False

        async def close_server() -> None:
            if not serving:
                # grpcio holds a bound port until its server has started: start it only
                # to stop it, so that the port is free again
                await server.start()
            await server.stop(None)

        stack.push_async_callback(close_server)
        address = config.advertise_address or f"{_reachable_host(config.host)}:{port}"
        ctx = BackendContext(
            compat=compat,
            token=config.token,
            checksums=config.checksums,
            checksum_every=config.checksum_every,
            streams=config.kv_streams,
            faults=config.faults,
            pool=PoolView(engine.kv.pool),
            leases=LeaseTable(clock),
            tls=config.tls,
            clock=clock,
            name_hint=f"splitserve-{config.role}-{port}",
        )

        handoff = None
        if config.serves_decode:
            receivers: dict[str, ReceiverBackend] = {}
            for name in receiver_names:
                receivers[name] = create_receiver_backend(name, ctx)
                stack.callback(receivers[name].close)
            assert ctx.pool is not None and ctx.leases is not None
            ranks = None
            if tp > 1:
                assert ranked is not None and engine.layout is not None
                ranks = await asyncio.to_thread(
                    RankKV, engine, aengine.call, engine.layout, ranked.ranks.store.port,
                    receiver_names,
                )  # fmt: skip
            handoff = DecodeHandoff(
                aengine,
                compat,
                ctx.pool,
                ctx.leases,
                receivers,
                default_backend=config.kv_backend,
                lease_seconds=config.lease_seconds,
                max_lease_seconds=config.max_lease_seconds,
                address=address,
                metrics=metrics,
                holds=config.faults.holds,
                ranks=ranks,
            )
        prefill = None
        if config.serves_prefill:
            pushes = None
            if tp > 1:
                assert ranked is not None and engine.layout is not None
                pushes = await asyncio.to_thread(RankPushes, engine.layout, ranked.ranks.store.port)
            prefill = PrefillRunner(
                aengine, ctx, transfer_timeout_s=config.transfer_timeout_s, metrics=metrics,
                ranks=pushes,
            )  # fmt: skip
            stack.push_async_callback(prefill.close)

        events = EventHub(aengine)
        kv_backends = sorted(handoff.receivers) if handoff else [config.kv_backend]
        state = RoleState(Role(config.role), switchable=config.switchable)
        switcher = None
        if config.switchable:
            assert handoff is not None and prefill is not None  # a switchable worker has both

            async def relabel(role: Role) -> None:
                await aengine.call(engine.set_role, role.value)

            switcher = RoleSwitcher(
                state,
                engine=aengine,
                handoff=handoff,
                prefill=prefill,
                metrics=metrics,
                drain_seconds=config.drain_seconds,
                relabel=relabel,
                clock=clock,
            )
        service = WorkerService(
            role=config.role,
            engine=aengine,
            compat=compat,
            handoff=handoff,
            prefill=prefill,
            events=events,
            kv_backends=kv_backends,
            holds=config.faults.holds,
            device=device,
            state=state,
            switcher=switcher,
        )
        add_to_server(service, server, engine.max_model_len)
        if handoff is not None:
            tls = config.tls.server_context() if config.tls.serves else None
            kv_port = start_tcp_server(handoff, config.host, config.kv_port, config.token, tls)
            stack.callback(kv_port.close)
        await server.start()
        serving = True
        tasks = [asyncio.create_task(events.poll_forever(), name="kv-events")]
        if handoff is not None:
            tasks.append(asyncio.create_task(handoff.reap_forever(), name="lease-reaper"))
        if switcher is not None and config.role_labels_file is not None:
            tasks.append(asyncio.create_task(_follow_labels(config, switcher), name="role-label"))
        stack.push_async_callback(_cancel, tasks)
        metrics_port = None
        if config.metrics_port is not None:
            ms = _serve_metrics(config, metrics)
            metrics_port = ms.port
            stack.callback(ms.close)
        return RunningWorker(
            config=config,
            server=server,
            address=address,
            engine=aengine,
            service=service,
            metrics=metrics,
            device=device,
            device_failed=device_failed,
            metrics_port=metrics_port,
            _resources=stack,
        )
    except BaseException:
        await stack.aclose()
        raise


async def _follow_labels(config: WorkerConfig, switcher: RoleSwitcher) -> None:
    """Switch to the role the pod's label names whenever it changes (the operator
    relabels a switchable pod to switch it)."""
    assert config.role_labels_file is not None
    st = switcher.state

    async def switch(role: str) -> None:
        try:
            await switcher.switch(Role(role))
        except RpcFailure as e:  # a SwitchRole call got there first: read the label again
            log.warning("switch to %s from the pod's label not started: %s", role, e.message)

    await follow_role_label(
        Path(config.role_labels_file),
        config.role_label,
        ROLES,
        lambda: None if st.switching else st.role.value,
        switch,
        poll_seconds=config.labels_poll_seconds,
    )


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _serve_metrics(config: WorkerConfig, metrics: Metrics) -> MetricsServer:
    try:
        return start_metrics_server(config.metrics_port or 0, metrics.registry, host=config.host)
    except OSError as e:
        raise OSError(
            f"cannot serve metrics on {config.host}:{config.metrics_port}: {e.strerror}; "
            "choose another --metrics-port"
        ) from None


def _reachable_host(host: str) -> str:
    """What to put in Reserve handles when no --advertise-address was given."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return host
