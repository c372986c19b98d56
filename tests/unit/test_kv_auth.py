"""Loading the worker token and checking it on every call."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from splitserve_worker.server.auth import TokenAuthInterceptor, TokenError, load_token
from splitserve_worker.server.config import ConfigError, WorkerConfig

pytestmark = pytest.mark.unit


def test_token_from_file_wins_over_env(tmp_path: Path) -> None:
    f = tmp_path / "tok"
    f.write_text("s3cret\n")
    assert load_token(f, {"SPLITSERVE_WORKER_TOKEN": "other"}) == "s3cret"
    assert load_token(None, {"SPLITSERVE_WORKER_TOKEN": " envtok "}) == "envtok"


def test_missing_or_empty_token_says_where_to_put_one(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match="--token-file FILE or set SPLITSERVE_WORKER_TOKEN"):
        load_token(None, {})
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(TokenError, match="is empty"):
        load_token(empty, {})
    with pytest.raises(TokenError, match="cannot read"):
        load_token(tmp_path / "absent", {})


def test_interceptor_accepts_only_the_exact_bearer_token() -> None:
    auth = TokenAuthInterceptor("abc")
    assert auth.allowed((("authorization", "Bearer abc"),))
    assert not auth.allowed((("authorization", "Bearer abcd"),))
    assert not auth.allowed((("authorization", "abc"),))
    assert not auth.allowed((("x-other", "Bearer abc"),))
    assert not auth.allowed(())


def test_the_token_is_found_among_other_metadata_as_grpc_hands_it_over() -> None:
    auth = TokenAuthInterceptor("abc")
    # gRPC builds each key afresh (never the interned constant), and the token may come
    # after other keys, some sorting before "authorization"
    key = "".join(["author", "ization"])
    assert auth.allowed((("accept", "x"), ("a-trace", "t"), (key, "Bearer abc")))
    assert auth.allowed(((key, b"Bearer abc"), ("user-agent", "grpc-python")))
    assert not auth.allowed((("accept", "Bearer abc"), ("zz", "Bearer abc")))


class _Details:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = "/splitserve.v1.Worker/Health"
        self.invocation_metadata = metadata


def test_the_interceptor_serves_callers_with_the_token_and_refuses_the_others() -> None:
    auth = TokenAuthInterceptor("abc")
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    def intercept(found: Any, metadata: tuple[tuple[str, str], ...]) -> Any:
        async def continuation(_details: Any) -> Any:
            return found

        return asyncio.run(auth.intercept_service(continuation, _Details(metadata)))

    assert intercept(handler, (("authorization", "Bearer abc"),)) is handler
    refused = intercept(handler, (("authorization", "Bearer nope"),))
    refused_bare = intercept(handler, ())
    for r in (refused, refused_bare):
        # not the method's own handler: one that never reads (or parses) the request
        assert r is not handler and r.request_deserializer is None and r.request_streaming
        assert not r.response_streaming  # answered in the method's own shape
    streaming = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(()))
    refused_stream = intercept(streaming, ())
    assert refused_stream is not streaming and refused_stream.response_streaming
    # an unknown method stays unknown (UNIMPLEMENTED), with or without the token
    assert intercept(None, ()) is None
    assert intercept(None, (("authorization", "Bearer abc"),)) is None


def test_worker_config_checks_fields_and_hides_token() -> None:
    cfg = WorkerConfig(role="decode", model="m", token="hidden-value")
    assert "hidden-value" not in repr(cfg)
    with pytest.raises(ConfigError, match="--role"):
        WorkerConfig(role="router", model="m", token="t")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--kv-streams"):
        WorkerConfig(role="prefill", model="m", token="t", kv_streams=9)
    with pytest.raises(ConfigError, match="--lease-seconds"):
        WorkerConfig(role="decode", model="m", token="t", lease_seconds=0)
    with pytest.raises(ConfigError, match="token"):
        WorkerConfig(role="decode", model="m")
    with pytest.raises(ConfigError, match="--kv-backend"):
        WorkerConfig(role="decode", model="m", token="t", kv_backend="rdma")
    with pytest.raises(ConfigError, match=r"--max-batch-tokens \(32\) must be >= --max-num-seqs"):
        WorkerConfig(role="decode", model="m", token="t", max_batch_tokens=32)
    with pytest.raises(ConfigError, match="--gpu-memory-fraction"):
        WorkerConfig(role="decode", model="m", token="t", gpu_memory_fraction=0)
    with pytest.raises(ConfigError, match="--prefill-chunk-tokens"):
        WorkerConfig(role="decode", model="m", token="t", prefill_chunk_tokens=0)
    # the engine's checks, with the worker's flag names
    for kw, words in [({"block_size": 0}, "--block-size must be >= 1, got 0"),
                      ({"threads": 0}, "--threads must be >= 1, got 0"),
                      ({"num_blocks": 0}, "--num-blocks must be >= 1"),
                      ({"kv_cache_memory": 0}, "--kv-cache-memory must be a positive byte"),
                      ({"dtype": "int4"}, "--dtype must be auto, float32")]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            WorkerConfig(role="decode", model="m", token="t", **kw)  # type: ignore[arg-type]
        assert words in str(e.value)


def test_tls_settings_are_checked_when_the_worker_is_configured(tmp_path: Path) -> None:
    from splitserve.tls import TlsConfig, TlsError
    from tls_kit import make_tls_files

    files = make_tls_files(tmp_path)
    ok = WorkerConfig(role="both", model="m", token="t", tls=files.config(mutual=True))
    assert ok.tls.serves and ok.tls.verifies and ok.tls.mutual
    assert not WorkerConfig(role="decode", model="m", token="t").tls.enabled
    with pytest.raises(TlsError, match="--tls-cert and --tls-key go together"):
        TlsConfig(cert_file=str(files.cert))
    with pytest.raises(TlsError, match="--tls-server-name needs --tls-ca"):
        TlsConfig(server_name="x")
    with pytest.raises(TlsError, match="--tls-mutual needs --tls-cert, --tls-key and --tls-ca"):
        TlsConfig(cert_file=str(files.cert), key_file=str(files.key), mutual=True)
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    for kw, words in [
        ({"cert_file": str(files.cert), "key_file": str(empty)}, "cannot load --tls-cert"),
        ({"cert_file": str(files.key), "key_file": str(files.cert)}, "cannot load --tls-cert"),
        ({"ca_file": str(tmp_path / "absent.pem")}, "cannot load --tls-ca"),
        ({"ca_file": str(empty)}, "cannot load --tls-ca"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            WorkerConfig(role="both", model="m", token="t", tls=TlsConfig(**kw))  # type: ignore[arg-type]


def test_the_router_checks_its_tls_files_and_needs_the_ca_with_a_certificate(
    tmp_path: Path,
) -> None:
    from splitserve.tls import TlsConfig
    from splitserve_worker.router.config import ConfigError as RouterConfigError
    from splitserve_worker.router.config import RouterConfig
    from tls_kit import make_tls_files

    files = make_tls_files(tmp_path)
    cfg = RouterConfig.from_mapping({"tls": {"ca_file": str(files.ca),
                                             "cert_file": str(files.cert),
                                             "key_file": str(files.key)}})  # fmt: skip
    assert cfg.tls.verifies and cfg.tls.serves
    with pytest.raises(RouterConfigError, match="give --tls-ca too"):
        RouterConfig(tls=TlsConfig(str(files.cert), str(files.key)))
    with pytest.raises(RouterConfigError, match="cannot load --tls-ca"):
        RouterConfig(tls=TlsConfig(ca_file=str(tmp_path / "absent.pem")))
