"""``python -m splitserve_worker.commands.rank``: tensor-parallel rank ``r > 0`` of a worker.

Started by the worker's rank 0 (:mod:`splitserve_worker.parallel.launch`), never by hand:
it reads what to build from rank 0's store on 127.0.0.1, loads its shard of the model,
joins the group and runs rank 0's forwards (:mod:`splitserve_worker.engine.follower`)
until told to stop (status 0). It exits with its parent (a parent-death signal), and
with status 3 and one ``error:`` line when another rank is lost.
"""

from __future__ import annotations

import argparse
import datetime
import pickle
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitserve-rank", description=__doc__)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)

    from splitserve_worker.commands.worker import die_with_parent

    die_with_parent(args.parent_pid)

    import torch.distributed as dist

    from splitserve_worker.engine.config import EngineConfig
    from splitserve_worker.engine.follower import Follower
    from splitserve_worker.models import ModelError
    from splitserve_worker.parallel.collectives import RankGroup, RankLost
    from splitserve_worker.parallel.launch import SPEC_KEY, RankSpec, rank_device
    from splitserve_worker.parallel.sharded_load import layout_of, load_sharded
    from splitserve_worker.server.rank_kv import RankKVSpec, RankReceiver, rank_compat
    from splitserve_worker.server.rank_push import RankPusher, RankPushSpec

    store = dist.TCPStore("127.0.0.1", args.store_port, args.world, False,
                          timeout=datetime.timedelta(seconds=300))  # fmt: skip
    spec: RankSpec = pickle.loads(store.get(SPEC_KEY))  # this worker's own rank 0
    device = rank_device(spec.device, args.rank)
    try:
        loaded = load_sharded(spec.model, args.world, args.rank, spec.dtype, str(device))
        layout = layout_of(loaded.config, args.world, args.rank)
        group = RankGroup(store, args.rank, args.world, device, allreduce=spec.allreduce)
        config = EngineConfig(**{**spec.engine, "device": str(device)})
        follower = Follower(loaded, config, group, layout)
        compat = rank_compat(loaded, config)
        receiver = pusher = None
        try:
            for part in spec.serve or ():
                if isinstance(part, RankKVSpec):  # this rank receives its own KV heads
                    receiver = RankReceiver(follower.pool, args.rank, args.store_port, part,
                                            compat)  # fmt: skip
                elif isinstance(part, RankPushSpec):  # and pushes them
                    pusher = RankPusher(args.rank, layout, args.store_port, part, compat)
            rx = receiver
            follower.serve(None if rx is None else (lambda step: rx.handle(step, group)),
                           pusher)  # fmt: skip
        finally:
            for part in (receiver, pusher):
                if part is not None:
                    part.close()
    except (ModelError, ValueError) as e:
        print(f"error: rank {args.rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except RankLost as e:
        print(f"error: rank {args.rank}: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
