"""The ``splitserve.v1.Worker`` servicer: maps each call onto the engine and the handoff.

Each handler is thin: it checks the worker's role, converts the message, calls the
decode handoff (:mod:`.handoff`), the prefill runner (:mod:`.prefill`) or the engine,
and turns known failures into the gRPC status the proto documents. Once the device has
failed (:mod:`.device_health`), every call is answered UNAVAILABLE with what failed:
Health too, so the router stops sending work here while the worker restarts.

A switchable worker's role can change while it runs (:mod:`.role_switch`): the role
checks read its :class:`~.role_switch.RoleState`, and new work is refused while a
switch drains.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any, TypeVar

import grpc
from splitserve.kv_compat import Compat
from splitserve.roles import Role
from splitserve.sampling import SamplingError
from splitserve.v1 import worker_pb2 as pb
from splitserve.v1 import worker_pb2_grpc

from splitserve_worker import __version__
from splitserve_worker.kv.faults import Holds
from splitserve_worker.kv.kvwire import KVSpan
from splitserve_worker.server.convert import (
    chunk_from_output,
    compat_to_proto,
    sampling_from_proto,
    top_to_proto,
)
from splitserve_worker.server.device_health import DeviceHealth
from splitserve_worker.server.errors import RpcFailure
from splitserve_worker.server.events import EventHub
from splitserve_worker.server.handoff import DecodeHandoff
from splitserve_worker.server.message_limits import Oversized, bounded, limit_of, request_limits
from splitserve_worker.server.prefill import PrefillRunner
from splitserve_worker.server.role_switch import FROM_PROTO, TO_PROTO, RoleState, RoleSwitcher

R = TypeVar("R")


def _unary(
    fn: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]:
    @functools.wraps(fn)
    async def wrapped(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        from splitserve_worker.engine.errors import RequestError

        if isinstance(request, Oversized):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        try:
            self.refuse_if_failed()
            return await fn(self, request, context)
        except RpcFailure as e:
            await context.abort(e.code, e.message, e.metadata)
        except (RequestError, SamplingError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        raise AssertionError("context.abort returned")  # pragma: no cover

    return wrapped


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        *,
        role: str,
        engine: Any,
        compat: Compat,
        handoff: DecodeHandoff | None,
        prefill: PrefillRunner | None,
        events: EventHub,
        kv_backends: list[str],
        holds: Holds | None = None,
        device: DeviceHealth | None = None,
        state: RoleState | None = None,
        switcher: RoleSwitcher | None = None,
    ) -> None:
        self.state = state or RoleState(Role(role))
        self.switcher = switcher
        self.engine = engine
        self.compat = compat
        self.handoff = handoff
        self.prefill = prefill
        self.events = events
        self.kv_backends = kv_backends
        self.holds = holds or Holds()
        self.instance_id = uuid.uuid4().hex
        """This worker's own id in Health: a worker started again is another one."""
        self.device = device or DeviceHealth()

    @property
    def role(self) -> str:
        """The role served now (a switchable worker's changes)."""
        return self.state.role.value

    def refuse_if_failed(self) -> None:
        """Raise UNAVAILABLE once the device has failed: nothing here can run on it."""
        failure = self.device.failure
        if failure is not None:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, failure)

    def _decode(self, new_work: bool = False) -> DecodeHandoff:
        """The decode side; ``new_work``: a call that starts a request here (refused while
        a switch drains), not one that carries on a reservation."""
        if self.handoff is None or not self.state.role.can_decode:
            raise self.state.wrong_role(
                f"this worker's role is {self.role!r}: it does not receive KV or decode "
                "remote requests (use a decode or both worker)",
            )
        if new_work:
            self.state.check_new_work()
        return self.handoff

    def _prefill(self) -> PrefillRunner:
        self.state.check_new_work()
        if self.prefill is None or not self.state.role.can_prefill:
            raise self.state.wrong_role(
                f"this worker's role is {self.role!r}: it does not run Prefill "
                "(use a prefill or both worker)",
            )
        return self.prefill

    @_unary
    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        s = self.engine.stats()
        return pb.HealthResponse(
            role=TO_PROTO[self.state.role],
            compat=compat_to_proto(self.compat),
            free_blocks=s.get("free_blocks", 0),
            total_blocks=s.get("total_blocks", 0),
            running=s.get("running", 0),
            waiting=s.get("waiting", 0),
            tokens_in_flight=s.get("tokens_in_flight", 0),
            version=__version__,
            kv_backends=self.kv_backends,
            leases=len(self.handoff.leases) if self.handoff else 0,
            prefilling=self.prefill.in_progress if self.prefill else 0,
            instance_id=self.instance_id,
            switchable=self.state.switchable,
            switching=self.state.switching,
            switching_to=TO_PROTO[self.state.switching_to] if self.state.switching_to else None,
            switches=self.state.switches,
        )

    @_unary
    async def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelResponse:
        found = False
        if self.handoff is not None and self.handoff.leases.contains(request.request_id):
            found = True
            await self.handoff.drop(request.request_id, "cancelled")
        found = bool(await self.engine.abort(request.request_id)) or found
        return pb.CancelResponse(found=found)

    @_unary
    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        handle = await self._decode(new_work=True).reserve(request)
        return pb.ReserveResponse(handle=handle)

    @_unary
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        handoff = self._decode()
        held = handoff.leases.contains(request.request_id)
        freed = await handoff.drop(request.request_id, "released")
        return pb.ReleaseResponse(released=held or freed > 0, blocks_freed=freed)

    @_unary
    async def PushKV(self, request_iterator: AsyncIterator[KVSpan], context: Any) -> pb.PushKVAck:
        return await self._decode().push(request_iterator)

    @_unary
    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:
        await self._decode().commit(request)
        return pb.CommitResponse(admitted=True)

    @_unary
    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        runner = self._prefill()
        sampling = sampling_from_proto(request.sampling)
        return await runner.run(request, sampling)

    @_unary
    async def SwitchRole(
        self, request: pb.SwitchRoleRequest, context: Any
    ) -> pb.SwitchRoleResponse:
        target = FROM_PROTO.get(request.role)
        if target is None:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                "SwitchRole needs a role: ROLE_PREFILL, ROLE_DECODE or ROLE_BOTH",
            )
        if self.switcher is None:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker serves {self.role} only: start it with --switchable "
                "to change its role in place",
            )
        done = await self.switcher.switch(target, request.drain_seconds)
        return pb.SwitchRoleResponse(
            role=TO_PROTO[done.role],
            previous=TO_PROTO[done.previous],
            seconds=done.seconds,
            migrated=done.migrated,
            leases_released=done.leases_released,
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TokenChunk]:
        from splitserve_worker.engine.errors import NoCapacity, RequestError

        if isinstance(request, Oversized):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        rid = request.request_id
        streams = self.state.streams
        registered = False
        try:
            self.refuse_if_failed()
            sampling = sampling_from_proto(request.sampling)
            if request.expect_remote_kv:
                handoff = self._decode(new_work=not self._holds_lease(rid))
                registered = self._start_stream(rid)
                lease, stream = await handoff.admit(rid, list(request.prompt_token_ids), sampling)
                first = pb.TokenChunk(
                    request_id=rid,
                    token_ids=[lease.first_token],
                    num_prompt_tokens=lease.num_tokens,
                )
                if sampling.logprobs:
                    first.logprobs.append(lease.first_logprob)
                if sampling.top_logprobs:
                    first.top_logprobs.append(top_to_proto(lease.first_top_logprobs))
                if lease.prompt_logprobs is not None:
                    first.prompt_logprobs.CopyFrom(lease.prompt_logprobs)
            else:
                self.state.check_new_work()
                if not self.state.role.can_decode:
                    raise self.state.wrong_role(
                        f"this worker's role is {self.role!r}: it does not decode",
                    )
                registered = self._start_stream(rid)
                stream = self.engine.generate(
                    rid,
                    list(request.prompt_token_ids),
                    sampling,
                    reuse_prefix=not request.recompute_prompt,
                )
                first = None
        except RpcFailure as e:
            failure = self.state.refusal() if registered and streams.get(rid) else e
            self._end_stream(rid, registered)
            await context.abort(failure.code, failure.message, failure.metadata)
            return
        except (RequestError, SamplingError) as e:
            self._end_stream(rid, registered)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        except NoCapacity as e:
            self._end_stream(rid, registered)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return
        except BaseException:
            self._end_stream(rid, registered)
            raise
        try:
            if first is not None:
                yield first
            sent = first is not None
            async for out in stream:
                if sent and self.holds.directory:
                    await self.holds.wait_async("stream")
                sent = True
                chunk = chunk_from_output(out)
                if chunk.finish_reason == "abort" and registered and streams.get(rid):
                    # ended by a role switch: the caller migrates it (never an "abort")
                    refusal = self.state.refusal()
                    await context.abort(refusal.code, refusal.message, refusal.metadata)
                if first is not None and not chunk.num_prompt_tokens:
                    chunk.num_prompt_tokens = first.num_prompt_tokens
                yield chunk
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self._end_stream(rid, registered)

    def _holds_lease(self, request_id: str) -> bool:
        return self.handoff is not None and self.handoff.leases.contains(request_id)

    def _start_stream(self, request_id: str) -> bool:
        """Count a Generate stream for the drain; False for an id already streaming (the
        engine refuses that one)."""
        if request_id in self.state.streams:
            return False
        self.state.streams[request_id] = False
        return True

    def _end_stream(self, request_id: str, registered: bool) -> None:
        if registered:
            self.state.streams.pop(request_id, None)

    async def Events(
        self, request: pb.EventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEvent]:
        if isinstance(request, Oversized):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        failure = self.device.failure
        if failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, failure)
        async for ev in self.events.subscribe():
            yield ev


def add_to_server(
    service: object,
    server: grpc.aio.Server,
    max_model_len: int | None = None,
    methods: Collection[str] | None = None,
) -> None:
    """Register every method of ``splitserve.v1.Worker`` (or only ``methods``: ``service``
    implements those) like the generated code does, but decode PushKV messages with
    :func:`kvwire.decode` (payload as a view, not a copy) and, given ``max_model_len``,
    refuse each method's requests larger than it can hold (:mod:`.message_limits`) before
    they are parsed."""
    from splitserve_worker.kv import kvwire

    limits = request_limits(max_model_len) if max_model_len is not None else None

    desc = pb.DESCRIPTOR.services_by_name["Worker"]
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    for m in desc.methods:
        if methods is not None and m.name not in methods:
            continue
        request_cls = getattr(pb, m.input_type.name)
        response_cls = getattr(pb, m.output_type.name)
        deserialize = kvwire.decode if m.name == "PushKV" else request_cls.FromString
        if limits is not None:
            deserialize = bounded(deserialize, m.name, limit_of(m.name, limits))
        make = kinds[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(
            getattr(service, m.name),
            request_deserializer=deserialize,
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(desc.full_name, handlers),)
    )
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:  # grpcio >= 1.63: the faster registered-method path
        register(desc.full_name, handlers)
