"""Render checks for the settings that become worker and router flags: each field the
operator writes is read back by that command's own argument parser and config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from render_helpers import container, objects, parseable

ROUTER_SETTINGS = {"disaggregation": "never", "maxModelLen": 2048, "defaultMaxTokens": 64,
                   "maxRequestBytes": 1 << 20, "maxRetries": 0}  # fmt: skip

ROUTER_SECTIONS: dict[str, dict[str, tuple[Any, Any]]] = {
    "queues": {"prefillMaxWaiting": (7, 7), "decodeMaxWaiting": (9, 9),
               "prefillSlotsPerWorker": (3, 3), "decodeSlotsPerWorker": (5, 5),
               "maxWait": ("2500ms", 2.5), "retryAfter": ("4s", 4)},
    "timeouts": {"connect": ("1500ms", 1.5), "prefill": ("11s", 11),
                 "firstToken": ("12s", 12), "interToken": ("13.5s", 13.5),
                 "request": ("2m20s", 140), "healthInterval": ("250ms", 0.25)},
}  # fmt: skip
"""Each field of a router settings section as written in the spec, and the value the
router's config gets."""
ROUTER_SECTION_KEYS = {
    "maxWait": "max_wait_s", "retryAfter": "retry_after_s", "connect": "connect_s",
    "prefill": "prefill_s", "firstToken": "first_token_s", "interToken": "inter_token_s",
    "request": "request_s", "healthInterval": "health_interval_s",
}  # fmt: skip
DEPRECATED_SECTION_FIELDS = {
    "queues": {"maxWaitSeconds": (2.5, "maxWait"), "retryAfterSeconds": (4, "retryAfter")},
    "timeouts": {f"{name}Seconds": (1.5, name) for name in
                 ("connect", "prefill", "firstToken", "interToken", "request", "healthInterval")},
}  # fmt: skip
"""Each deprecated field of a settings section: a value, and the field it is read as."""


def snake(field: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in field)


def router_config(objs: dict[str, Any]) -> Any:
    """The config the router builds from the args the operator wrote (parsed by its own
    CLI), as it would at start."""
    import argparse

    from splitserve_worker.commands import router as router_cmd

    args = container(objs, "router")["args"]
    parser = argparse.ArgumentParser()
    router_cmd.add_arguments(parser)
    parsed = parser.parse_args(args[1:])
    return parsed, router_cmd.load_config(parsed, max_model_len=parsed.max_model_len or 4096)


def router_setting(field: str) -> Callable[[], None]:
    def check() -> None:
        value = ROUTER_SETTINGS[field]
        objs = objects({"router": {"settings": {field: value}}})
        # the flag the operator writes is one the router's CLI reads, as that value
        parsed, cfg = router_config(objs)
        assert vars(parsed)[snake(field)] == value
        assert getattr(cfg, snake(field)) == value
        base = objects()
        assert "--" + snake(field).replace("_", "-") not in container(base, "router")["args"]
        # the router rolls, the workers do not
        for pool in ("prefill", "decode"):
            assert objs[f"Deployment/demo-{pool}"] == base[f"Deployment/demo-{pool}"]

    return check


def router_section(section: str, field: str) -> Callable[[], None]:
    def check() -> None:
        written, value = ROUTER_SECTIONS[section][field]
        objs = objects({"router": {"settings": {section: {field: written}}}})
        _, cfg = router_config(objs)
        key = ROUTER_SECTION_KEYS.get(field, snake(field))
        got = getattr(getattr(cfg, section), key)
        _, default = router_config(objects())
        assert got == value
        if isinstance(getattr(getattr(default, section), key), int):  # Retry-After: whole
            assert isinstance(got, int)
        assert getattr(getattr(default, section), key) != value
        base = objects()
        for pool in ("prefill", "decode"):
            assert objs[f"Deployment/demo-{pool}"] == base[f"Deployment/demo-{pool}"]

    return check


ENGINE_SETTINGS: dict[str, tuple[Any, Any]] = {
    "maxNumSeqs": (128, 128), "maxBatchTokens": (4096, 4096), "prefillChunkTokens": (256, 256),
    "gpuMemoryPercent": (90, 0.9), "kvCacheMemory": ("2Gi", 2 << 30), "threads": (4, 4),
}  # fmt: skip
"""Each engine field as written in the spec, and the value the engine gets."""


def engine_setting(pool: str, field: str) -> Callable[[], None]:
    def check() -> None:
        import argparse

        from splitserve_worker.commands import worker as worker_cmd
        from splitserve_worker.server.config import WorkerConfig

        written, value = ENGINE_SETTINGS[field]
        objs = objects({pool: {"engine": {field: written}}})
        parser = argparse.ArgumentParser()
        worker_cmd.add_arguments(parser)
        # the worker's own CLI reads the flag, and its engine gets the value
        parsed = vars(parser.parse_args(parseable(parser, container(objs, pool)["args"][1:])))
        names = ("max_num_seqs", "max_batch_tokens", "prefill_chunk_tokens",
                 "gpu_memory_fraction", "kv_cache_memory", "threads")  # fmt: skip
        kw = {k: parsed[k] for k in names}
        engine = vars(WorkerConfig(role=pool, model="m", token="t", **kw).engine_config())
        flag = "gpu_memory_fraction" if field == "gpuMemoryPercent" else snake(field)
        name = "num_threads" if field == "threads" else flag
        assert engine[name] == value
        default = vars(parser.parse_args(parseable(parser, container(objects(), pool)["args"][1:])))
        assert default[flag] != parsed[flag]
        # only this pool's workers roll
        other = "decode" if pool == "prefill" else "prefill"
        assert objs[f"Deployment/demo-{other}"] == objects()[f"Deployment/demo-{other}"]

    return check
