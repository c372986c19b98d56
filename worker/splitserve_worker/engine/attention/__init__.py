"""Attention over the paged KV pool, behind one small interface.

:mod:`.base` says what a backend is (:class:`~.base.AttentionBackend`) and what it is
given (:class:`~.base.Span`: one sequence's new rows in a forward). The backends, one
module each: :mod:`.sdpa` gathers each sequence's blocks and calls PyTorch's
``scaled_dot_product_attention`` (every device; the CPU default), :mod:`.flex` runs
PyTorch's FlexAttention with the block tables as its block mask and reads the pool in
place (compiled through Triton on CUDA, through inductor's C++ on the CPU), and
:mod:`.flashinfer` calls FlashInfer's paged decode kernels (CUDA, half precision, only
when ``flashinfer`` is installed). :mod:`.buckets` holds the batch-size buckets that keep
compiled kernels and captured graphs to a few shapes. :mod:`.registry` picks one by name
or the best available and says why.

May import: torch, and of the engine only :mod:`~splitserve_worker.engine.config` (the
backends' names).
``flashinfer`` is imported only by :mod:`.flashinfer`, and only when that backend is made.
"""
