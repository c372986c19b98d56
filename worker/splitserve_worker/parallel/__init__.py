"""Tensor parallelism: one engine's weights, heads and KV pool split over N rank processes.

Its modules: :mod:`.layout` (pure: which heads, MLP columns and weight slices each rank
owns), :mod:`.collectives` (the ranks' process group: all-reduce, the leader's step
broadcast, gathers; gloo or a shared-memory all-reduce on the CPU, NCCL on CUDA),
:mod:`.shm_allreduce` (that shared-memory all-reduce), :mod:`.sharded_load` (a checkpoint
loaded as one rank's shard, each rank reading only its slices) and :mod:`.launch` (rank 0
starting the other ranks as processes, watching them, and leaving none behind).

May import: torch, transformers, safetensors, and of the worker only
:mod:`splitserve_worker.models`; never the engine, the servers or the KV transports (the
rank processes' own loop is :mod:`splitserve_worker.engine.follower`, started by
:mod:`splitserve_worker.commands.rank`).
"""
