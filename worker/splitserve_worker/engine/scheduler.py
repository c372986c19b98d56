"""Continuous batching: which sequences run this step, and with how many tokens.

Each step, in order:

1. every running sequence that is decoding gets one token (oldest first);
2. running sequences part-way through their prompt get their next chunk;
3. waiting sequences are admitted (first come, first served) while there is room in
   the batch, in the token budget and in the KV pool, reusing cached prefix blocks.

Prefill tokens per step are capped by ``prefill_chunk_tokens`` while anything is
decoding (so decode steps keep flowing between chunks of a long prompt) and by
``max_batch_tokens`` otherwise. When a running sequence needs a block and none is free,
the most recently admitted unscheduled sequence is preempted: its blocks are freed and
it waits to be recomputed (prompt plus tokens so far), so no token is ever wrong.
New work never preempts: it waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve_worker.engine.block_pool import BlockPool
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.sequence import SeqStatus, Sequence


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """After this chunk the sequence can sample its next token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.tokens)


@dataclass
class StepPlan:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_queried: int = 0
    prefix_hit: int = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return (tokens + block_size - 1) // block_size


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockPool,
        *,
        on_preempt: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.config = config
        self.bs = config.block_size
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._on_preempt = on_preempt

    # ---- membership ----
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks are already filled (remote prefill) joins the batch."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> int:
        """Take a sequence out (finished or aborted) and free its blocks; returns how many."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        return self.free_blocks_of(seq)

    def free_blocks_of(self, seq: Sequence) -> int:
        n = len(seq.block_table)
        self.blocks.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0
        return n

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- after a forward ----
    def commit(self, seq: Sequence, num_tokens: int, *, cache: bool) -> None:
        """``num_tokens`` more tokens of ``seq`` have their KV in the pool."""
        seq.num_computed += num_tokens
        if not cache:
            return
        full = seq.num_computed // self.bs
        if full > seq.num_registered:
            hashes = seq.full_block_hashes(self.bs)
            for b in range(seq.num_registered, full):
                self.blocks.register(seq.block_table[b], hashes[b])
            seq.num_registered = full

    # ---- one step ----
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_batch_tokens
        chosen: set[str] = set()
        decoding = [s for s in self.running if s.remaining == 1]
        prefill_budget = (
            self.config.prefill_chunk_tokens if decoding else self.config.max_batch_tokens
        )
        for seq in decoding:
            if seq.status is not SeqStatus.RUNNING or budget <= 0:
                continue
            if self._grow(seq, 1, chosen, plan):
                plan.scheduled.append(Scheduled(seq, 1))
                chosen.add(seq.request_id)
                budget -= 1
        for seq in list(self.running):
            if seq.request_id in chosen or seq.status is not SeqStatus.RUNNING:
                continue
            n = min(seq.remaining, prefill_budget, budget)
            if n <= 0:
                break
            if self._grow(seq, n, chosen, plan):
                plan.scheduled.append(Scheduled(seq, n))
                chosen.add(seq.request_id)
                budget -= n
                prefill_budget -= n
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            n_max = min(prefill_budget, budget)
            if n_max <= 0 or plan.preempted:
                break
            seq = self.waiting[0]
            admitted = self._admit(seq, n_max, plan)
            if admitted == 0:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.scheduled.append(Scheduled(seq, admitted))
            chosen.add(seq.request_id)
            budget -= admitted
            prefill_budget -= admitted
        return plan

    def _grow(self, seq: Sequence, n: int, chosen: set[str], plan: StepPlan) -> bool:
        """Make room for ``n`` more tokens of ``seq``, preempting if needed."""
        need = blocks_for(seq.num_computed + n, self.bs) - len(seq.block_table)
        while need > self.blocks.free_blocks:
            victim = next((s for s in reversed(self.running) if s.request_id not in chosen), None)
            if victim is None:
                return False
            self._preempt(victim, plan)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.free_blocks_of(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        if self._on_preempt is not None:
            self._on_preempt(seq)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding a prefix of ``seq``'s tokens (none when the cache is
        off, when the request scores its prompt: cached positions have no logits, or when
        it asks for its prompt computed whole). At least one token is always left to
        compute, for the logits of the last one."""
        if (
            not self.config.enable_prefix_cache
            or seq.params.prompt_logprobs is not None
            or not seq.reuse_prefix
        ):
            return []
        hashes = seq.full_block_hashes(self.bs)[: (len(seq.tokens) - 1) // self.bs]
        return self.blocks.lookup(hashes)

    def _admit(self, seq: Sequence, n_max: int, plan: StepPlan) -> int:
        """Give a waiting sequence its cached prefix and blocks for its first chunk.

        Returns the number of tokens scheduled, or 0 if it must keep waiting.
        """
        hit = self.cached_prefix(seq)
        total = len(seq.tokens)
        cached = len(hit) * self.bs
        n = min(total - cached, n_max)
        need = blocks_for(cached + n, self.bs) - len(hit)
        reclaimed = sum(1 for b in hit if self.blocks.refcount(b) == 0)
        if need + reclaimed > self.blocks.free_blocks:
            return 0
        self.blocks.touch(hit)
        seq.block_table = [*hit, *self.blocks.allocate(need)]
        seq.num_computed = cached
        seq.num_registered = len(hit)
        if seq.num_output == 0:
            seq.num_cached_tokens = cached
        plan.prefix_queried += total
        plan.prefix_hit += cached
        return n
