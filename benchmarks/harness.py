"""The one timing harness of the book's benchmarks (``bench_attention.py``, ``bench_blockwise.py``)
and of chapter 10's live timing.

- :func:`measure`: one call after ``warmup`` untimed ones, as a :class:`Sample`: wall time, the
  process's user and system CPU time read apart (``getrusage``), and its minor page faults
  (fresh pages the kernel had to map: what allocating a large buffer costs);
- :func:`interleaved`: rounds in which every step runs once, the first step rotating from
  round to round, so that a slow moment of a shared machine hits every step alike; the
  callers take medians over the rounds;
- :func:`fused_backends`, :func:`sdpa_backend`: the kernels that
  ``torch.nn.functional.scaled_dot_product_attention`` may use for a call named fused, and the
  one it chooses; a benchmark runs its check under ``torch.nn.attention.sdpa_kernel`` with
  these, so a call that would fall back to the math path (the ``n x n`` matrix written out)
  fails instead of being timed under a fused kernel's name.

With one torch thread, user + system is the CPU time of the call alone: other programs on
the machine take the core away without adding to it. With several threads it sums them.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend


class Sample(NamedTuple):
    """One timed call: seconds of wall clock, of user and of system CPU time; minor page faults."""

    wall: float
    user: float
    system: float
    faults: int

    @property
    def cpu(self) -> float:
        """User + system seconds: the process's CPU time."""
        return self.user + self.system


def measure(fn: Callable[[], object], *, warmup: int = 1, setup: Callable[[], object] | None = None,
            sync: Callable[[], object] | None = None) -> Sample:
    """Time one call of ``fn`` after ``warmup`` untimed calls; ``setup`` runs (untimed) before each
    call, ``sync`` (an accelerator's synchronize) before and after the timed one."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    if setup is not None:
        setup()
    if sync is not None:
        sync()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    if sync is not None:
        sync()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return Sample(t1 - t0, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt)


def interleaved(steps: Mapping[str, Callable[[], object]], rounds: int, *, threads: int | None = None,
                warmup: int = 1, setups: Mapping[str, Callable[[], object]] | None = None,
                sync: Callable[[], object] | None = None) -> dict[str, list[Sample]]:
    """``rounds`` rounds of every step, timed by :func:`measure` with ``threads`` torch threads
    (the setting is restored after); round ``r`` starts with step ``r mod len(steps)``."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(steps)
    out: dict[str, list[Sample]] = {name: [] for name in names}
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                setup = None if setups is None else setups.get(name)
                out[name].append(measure(steps[name], warmup=warmup, setup=setup, sync=sync))
    finally:
        torch.set_num_threads(before)
    return out


def fused_backends(device: torch.device | str) -> list[SDPBackend]:
    """The SDPA kernels that do not write out the ``n x n`` matrix: on a CPU, FlashAttention's
    loop (torch's only fused CPU kernel); on a GPU, flash, memory-efficient and cuDNN."""
    if torch.device(device).type == "cpu":
        return [SDPBackend.FLASH_ATTENTION]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 is_causal: bool = False) -> SDPBackend:
    """The kernel ``scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal)`` runs:
    torch's own choice (``torch._fused_sdp_choice``). On a CPU it is the math path for 3-D
    inputs and FlashAttention for 4-D ones."""
    return SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal))
