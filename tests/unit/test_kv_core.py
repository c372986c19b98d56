"""Pure parts of the KV handoff: compat check, block layout, leases, fault knob, registry."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from splitserve import kv_compat as compat_mod
from splitserve.kv_compat import Compat, CompatError
from splitserve_worker.kv import layout, transport
from splitserve_worker.kv.faults import FaultConfig, FaultInjector, Holds, InjectedFault
from splitserve_worker.kv.layout import PoolView, as_bytes, block_spans, slot_runs, token_chunks
from splitserve_worker.kv.lease import LeaseError, LeaseTable, State

pytestmark = pytest.mark.unit

BASE = Compat("tiny", "float32", 16, 4, 2, 16, "LKBTHD-v1")


# ---- compat ----
def test_same_fields_same_hash_and_check_passes() -> None:
    other = Compat("tiny", "float32", 16, 4, 2, 16, "LKBTHD-v1")
    assert other.hash == BASE.hash
    compat_mod.check(BASE, other)


def test_the_hash_is_sha256_of_the_canonical_fields_pinned() -> None:
    # workers of two releases meet during a rolling upgrade: the hash is sha256 over the
    # fields as sorted, compact JSON, pinned as well so that a change is a deliberate one
    canon = json.dumps(BASE.fields(), sort_keys=True, separators=(",", ":"))
    assert canon.startswith('{"block_size":16,"dtype":"float32",')
    assert BASE.hash == hashlib.sha256(canon.encode()).hexdigest()
    assert BASE.hash == "79559da1c63e432dcddf012a3be879470ea0b2e8bc58f48266c474086e12011a"
    # computed once from the fields: a field changed afterwards would leave it stale
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.dtype = "bfloat16"  # type: ignore[misc]


def test_mismatch_names_each_field_with_both_values() -> None:
    other = Compat("tiny", "bfloat16", 32, 4, 2, 16, "LKBTHD-v1")
    with pytest.raises(CompatError) as e:
        compat_mod.check(BASE, other, peer="10.0.0.2:7000")
    msg = str(e.value)
    assert "dtype: this worker='float32', 10.0.0.2:7000='bfloat16'" in msg
    assert "block_size: this worker=16, 10.0.0.2:7000=32" in msg
    assert "num_layers" not in msg


def _fresh(value: object) -> object:
    """An equal value that is not the same object (as one decoded off the wire is)."""
    return "".join(list(value)) if isinstance(value, str) else int(str(value))


def test_only_the_fields_that_differ_are_named_whatever_objects_carry_them() -> None:
    big = Compat("tiny", "float32", 16, 4, 2, 4096, "LKBTHD-v1")
    for mine in (BASE, big):
        fields = {k: _fresh(v) for k, v in mine.fields().items()}
        theirs = Compat.from_mapping({**fields, "dtype": "bfloat16"})
        with pytest.raises(CompatError) as e:
            compat_mod.check(mine, theirs)
        assert str(e.value).count("this worker=") == 1 and "dtype:" in str(e.value)


def test_hash_only_difference_is_still_refused() -> None:
    other = Compat("tiny", "float32", 16, 4, 2, 16, "LKBTHD-v1", hash="f" * 64)
    with pytest.raises(CompatError, match="hash"):
        compat_mod.check(BASE, other)


def test_an_engines_identity_is_hashed_beyond_the_fields_carried() -> None:
    # a checkpoint's shape is in the hash though not on the wire: same fields, other hash
    info = {**BASE.fields(), "architecture": "LlamaForCausalLM", "vocab_size": 100,
            "hidden_size": 64}  # fmt: skip
    one = Compat.from_mapping(info)
    assert one.fields() == BASE.fields() and one.hash != BASE.hash
    other = Compat.from_mapping({**info, "vocab_size": 101})
    with pytest.raises(CompatError, match="same fields: the checkpoints differ") as e:
        compat_mod.check(one, other)
    # each side's hash is shown, its first 16 hex digits
    shown = re.search(r"hash: this worker=([0-9a-f]+), peer=([0-9a-f]+) ", str(e.value))
    assert shown is not None and shown.groups() == (one.hash[:16], other.hash[:16])
    assert Compat.from_mapping(dict(info)).hash == one.hash
    for field in ("dtype", "block_size", "kv_heads"):
        changed = Compat.from_mapping({**info, field: {"dtype": "bfloat16"}.get(field, 99)})
        assert changed.hash != one.hash, field


def test_from_mapping_requires_every_field() -> None:
    with pytest.raises(CompatError, match="head_dim"):
        Compat.from_mapping({"model": "m", "dtype": "float32", "block_size": 16,
                             "num_layers": 1, "kv_heads": 1, "kv_layout": "x"})  # fmt: skip


# ---- layout ----
def test_block_spans_split_at_block_edges() -> None:
    spans = block_spans([7, 3, 9], start=10, count=20, block_size=16)
    assert [(s.block, s.offset, s.token, s.count) for s in spans] == [
        (7, 10, 10, 6),
        (3, 0, 16, 14),
    ]
    with pytest.raises(ValueError, match="do not fit"):
        block_spans([7], start=0, count=17, block_size=16)


def test_slot_runs_merge_only_consecutive_blocks() -> None:
    # blocks 2,3 are consecutive in the pool; 9 is not; 4 follows 3 but not 9
    assert slot_runs([2, 3, 9, 4], start=2, count=12, block_size=4) == [
        (10, 0, 6),  # block 2 from offset 2, then all of block 3
        (36, 6, 4),  # block 9
        (16, 10, 2),  # block 4, first two slots
    ]
    assert slot_runs([5, 6, 7], start=0, count=12, block_size=4) == [(20, 0, 12)]
    assert slot_runs([5], start=1, count=0, block_size=4) == []


def test_token_chunks_target_bytes() -> None:
    assert token_chunks(10, 100, target=250) == [0, 2, 4, 6, 8]
    assert token_chunks(0, 100) == []
    assert token_chunks(5, 10**9, target=1) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("max_runs", [64, 0], ids=["copy-per-run", "indexed-copy"])
def test_pool_write_then_read_round_trips_and_touches_only_its_blocks(
    max_runs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layout, "MAX_RUN_COPIES", max_runs)
    pool = torch.zeros(3, 2, 8, 4, 2, 5)
    view = PoolView(pool)
    blocks = [6, 1, 2, 4]  # 1, 2 consecutive: one run across a block edge
    k = torch.randn(14, 2, 5)
    v = torch.randn(14, 2, 5)
    view.write(1, blocks, 0, k[:7], v[:7])
    view.write(1, blocks, 7, k[7:], v[7:])
    rk, rv = view.read(1, blocks, 0, 14)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert torch.equal(pool[1, 0, 6], k[:4]) and torch.equal(pool[1, 1, 4, :2], v[12:])
    assert torch.equal(pool[1, 0, 1:3].reshape(8, 2, 5), k[4:12])
    untouched = [b for b in range(8) if b not in blocks]
    assert pool[:, :, untouched].abs().sum() == 0
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


def test_as_bytes_is_a_view_for_any_dtype() -> None:
    t = torch.arange(6, dtype=torch.bfloat16)
    b = as_bytes(t)
    assert len(b) == 12
    t[0] = 5
    assert bytes(b[:2]) == t[:1].view(torch.uint8).numpy().tobytes()


def test_pool_view_refuses_other_layouts() -> None:
    with pytest.raises(ValueError, match="num_layers, 2"):
        PoolView(torch.zeros(2, 3, 4, 4, 1, 1))


# ---- leases ----
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_lifecycle_and_expiry() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    lease = table.add("r1", [1, 2], num_tokens=20, num_layers=2, ttl=5, backend="grpc")
    with pytest.raises(LeaseError, match="already holds"):
        table.add("r1", [3], num_tokens=1, num_layers=2, ttl=5, backend="grpc")
    assert table.get("r1", lease.lease_id) is lease
    with pytest.raises(LeaseError, match="stale"):
        table.get("r1", "nope")
    table.record(lease, 0, 0, 12, 100)
    table.record(lease, 0, 12, 8, 100)
    assert lease.layers_complete == 1 and not lease.complete
    table.record(lease, 1, 0, 20, 100)
    assert lease.complete and lease.bytes_received == 300
    with pytest.raises(LeaseError, match="out of range"):
        table.record(lease, 1, 15, 6, 1)
    clock.now += 5
    with pytest.raises(LeaseError, match="expired"):
        table.get("r1")
    assert table.expired() == [lease]
    assert len(table) == 0


def test_a_lease_needs_a_positive_ttl_and_spans_inside_its_reservation() -> None:
    table = LeaseTable(Clock())
    for ttl in (0, -1, -0.5):
        with pytest.raises(ValueError, match="must be > 0"):
            table.add(f"r{ttl}", [1], num_tokens=4, num_layers=4, ttl=ttl, backend="tcp")
    lease = table.add("r", [1], num_tokens=4, num_layers=4, ttl=5, backend="tcp")
    with pytest.raises(LeaseError, match=r"layer 4 out of range 0\.\.3$"):
        table.add_span(lease, 4, 0, 1, 1)
    for start, count in ((-1, 1), (0, -1), (2, 3)):
        with pytest.raises(LeaseError, match="out of range for a 4-token reservation"):
            table.add_span(lease, 0, start, count, 1)
    table.add_span(lease, 0, 4, 0, 0)  # an empty span at the end is no error
    table.add_span(lease, 0, 0, 4, 64)
    assert lease.layer_tokens == [4, 0, 0, 0]


def test_a_lease_is_found_by_its_id_while_it_lives() -> None:
    # what a tcp KV connection names; gone with the lease, whichever way it goes
    clock = Clock()
    table = LeaseTable(clock)
    a = table.add("a", [1], num_tokens=4, num_layers=1, ttl=5, backend="tcp")
    b = table.add("b", [2], num_tokens=4, num_layers=1, ttl=9, backend="tcp")
    assert len(a.lease_id) == 16 and table.find(a.lease_id) is a and table.find(b.lease_id) is b
    table.pop("a")
    with pytest.raises(LeaseError, match="no reservation holds lease"):
        table.find(a.lease_id)
    clock.now += 9
    assert table.now() == clock.now
    with pytest.raises(LeaseError, match="expired"):
        table.find(b.lease_id)  # expired, not yet reaped
    assert table.expired() == [b]
    with pytest.raises(LeaseError, match="no reservation holds lease"):
        table.find(b.lease_id)


def test_spans_in_any_order_complete_a_layer_only_once_all_arrived() -> None:
    # a push over several streams delivers a layer's spans out of order
    table = LeaseTable(Clock())
    lease = table.add("r1", [1, 2], num_tokens=20, num_layers=2, ttl=5, backend="grpc")
    table.add_span(lease, 0, 12, 8, 64)  # the tail first: not complete (record would say so)
    assert lease.layers_complete == 0
    table.add_span(lease, 1, 0, 20, 160)
    table.add_span(lease, 0, 0, 12, 96)
    assert lease.complete and lease.bytes_received == 320
    with pytest.raises(LeaseError, match="out of range"):
        table.add_span(lease, 0, 15, 6, 1)
    assert table.holds(lease)
    table.pop("r1")
    assert not table.holds(lease)
    again = table.add("r1", [1, 2], num_tokens=20, num_layers=2, ttl=5, backend="grpc")
    assert table.holds(again) and not table.holds(lease)  # same request, a new reservation


@pytest.mark.parametrize("name", ["tcp", "grpc"])
def test_streams_per_push_follow_the_core_count(name: str) -> None:
    from splitserve_worker.kv.span_sender import default_streams

    assert [default_streams(c) for c in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 2, 2]
    backend = transport.create_sender_backend(
        name, transport.BackendContext(compat=BASE, streams=3)
    )
    assert backend.streams == 3  # type: ignore[attr-defined]
    backend.close()
    with pytest.raises(ValueError, match="1 to 8"):
        transport.create_sender_backend(name, transport.BackendContext(compat=BASE, streams=9))


def test_nixl_on_one_host_adds_cuda_transports_where_gpus_are() -> None:
    from splitserve_worker.kv.nixl_common import loopback_tls

    assert loopback_tls(gpus=False) == "cma,tcp"
    assert loopback_tls(gpus=True).split(",")[:2] == ["cma", "tcp"]
    assert {"cuda_copy", "cuda_ipc"} <= set(loopback_tls(gpus=True).split(","))


def test_attached_leases_do_not_expire() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    lease = table.add("r1", [1], num_tokens=1, num_layers=1, ttl=1, backend="grpc")
    table.commit(lease, 5, -0.5)
    table.attach(lease)
    clock.now += 10
    assert table.expired() == []
    assert table.get("r1").state is State.ATTACHED
    assert table.pop("r1") is lease and table.pop("r1") is None


# ---- faults ----
def test_fault_config_from_env_and_bounds() -> None:
    cfg = FaultConfig.from_env(
        {"SPLITSERVE_FAULT_KV_FAIL_PROB": "0.25", "SPLITSERVE_FAULT_SEED": "3"}
    )
    assert cfg == FaultConfig(0.25, 0.0, 3) and cfg.enabled
    assert not FaultConfig.from_env({}).enabled
    with pytest.raises(ValueError, match="corrupt_prob"):
        FaultConfig(corrupt_prob=1.5)
    with pytest.raises(ValueError, match="SPLITSERVE_FAULT_KV_FAIL_PROB"):
        FaultConfig.from_env({"SPLITSERVE_FAULT_KV_FAIL_PROB": "often"})


def test_fault_config_reads_the_hold_directory_and_checks_the_seed() -> None:
    cfg = FaultConfig.from_env({"SPLITSERVE_FAULT_HOLD_DIR": "/tmp/h"})
    assert cfg.hold_dir == "/tmp/h" and cfg.holds == Holds("/tmp/h") and not cfg.enabled
    assert FaultConfig.from_env({}).holds.directory is None
    with pytest.raises(ValueError, match="SPLITSERVE_FAULT_SEED must be an integer"):
        FaultConfig.from_env({"SPLITSERVE_FAULT_SEED": "x"})


def test_an_unarmed_or_unconfigured_hold_returns_at_once(tmp_path: Path) -> None:
    assert Holds().wait("push") is False
    assert Holds(str(tmp_path)).wait("push") is False
    assert asyncio.run(Holds(str(tmp_path)).wait_async("stream")) is False
    assert not (tmp_path / str(os.getpid()) / "push.reached").exists()
    with pytest.raises(ValueError, match="unknown hold point 'nap'"):
        Holds(str(tmp_path)).wait("nap")


def test_an_armed_hold_marks_itself_reached_and_waits_for_the_file_to_go(
    tmp_path: Path,
) -> None:
    d = tmp_path / str(os.getpid())
    d.mkdir()
    (d / "receive").touch()
    holds = Holds(str(tmp_path))
    done = threading.Event()

    def hold() -> None:
        assert holds.wait("receive") is True
        done.set()

    t = threading.Thread(target=hold)
    t.start()
    deadline = time.monotonic() + 10
    while not (d / "receive.reached").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (d / "receive.reached").exists()
    assert not done.wait(0.1), "the hold let go while its file was there"
    (d / "receive").unlink()
    t.join(10)
    assert done.is_set()

    async def held_async() -> bool:
        (d / "stream").touch()
        waiter = asyncio.ensure_future(holds.wait_async("stream"))
        await asyncio.sleep(0.1)
        assert not waiter.done() and (d / "stream.reached").exists()
        (d / "stream").unlink()
        return await asyncio.wait_for(waiter, 10)

    assert asyncio.run(held_async()) is True


def test_fault_injector_fails_and_corrupts_on_demand() -> None:
    inj = FaultInjector(FaultConfig(fail_prob=1.0, corrupt_prob=1.0, seed=1))
    with pytest.raises(InjectedFault, match="layer 3"):
        inj.maybe_fail("layer 3")
    data = bytes(range(50))
    bad = inj.corrupt(data)
    assert len(bad) == len(data) and sum(a != b for a, b in zip(bad, data, strict=True)) == 1
    off = FaultInjector(FaultConfig())
    off.maybe_fail("x")
    assert not off.should_corrupt()


# ---- registry ----
def test_registry_refuses_duplicates_and_unknown_names() -> None:
    assert transport.backend_names() == ["grpc", "nixl", "tcp"]
    with pytest.raises(ValueError, match="already registered"):
        transport.register_backend("tcp", sender="somewhere:else", receiver="somewhere:else")
    with pytest.raises(ValueError, match="unknown KV backend 'carrier-pigeon'"):
        transport.create_sender_backend("carrier-pigeon", transport.BackendContext(compat=BASE))
    with pytest.raises(ValueError, match="needs the pool"):
        transport.create_receiver_backend("grpc", transport.BackendContext(compat=BASE))
    assert transport.unavailable_reason("grpc") is None
    assert transport.unavailable_reason("tcp") is None
    assert "unknown KV backend" in (transport.unavailable_reason("rdma") or "")


def test_arrivals_can_renew_a_lease() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    lease = table.add("r1", [1], num_tokens=10, num_layers=2, ttl=5, backend="grpc")
    clock.now += 4
    table.record(lease, 0, 0, 5, 10, renew=True)
    assert lease.expires_at == clock.now + 5
    clock.now += 4
    assert table.get("r1") is lease  # alive: it would have expired without the renewal
    table.record(lease, 1, 0, 5, 10)
    assert lease.expires_at == clock.now + 1  # a plain record does not renew


def test_nixl_descriptors_coalesce_only_where_both_sides_continue() -> None:
    from splitserve_worker.kv.nixl_common import coalesce

    local = [(1000, 64, 0), (1064, 64, 0), (1128, 64, 0), (5000, 64, 0)]
    remote = [(0, 64, 0), (64, 64, 0), (512, 64, 0), (576, 64, 0)]
    # 1st+2nd continue on both sides; 2nd->3rd breaks remotely; 3rd->4th breaks locally
    assert coalesce(local, remote) == (
        [(1000, 128, 0), (1128, 64, 0), (5000, 64, 0)],
        [(0, 128, 0), (512, 64, 0), (576, 64, 0)],
    )
    # another device never merges, even when addresses continue
    assert coalesce([(0, 8, 0), (8, 8, 1)], [(0, 8, 0), (8, 8, 0)])[0] == [(0, 8, 0), (8, 8, 1)]
    with pytest.raises(ValueError, match="sizes differ"):
        coalesce([(0, 8, 0)], [(0, 16, 0)])
