"""What does attention without the n x n matrix cost, in time and memory, on a CPU? (chapter 10)

One head, ``n`` queries against ``n`` keys of width ``d = 64``, float32, for ``n`` from 1,024 to
32,768. Five variants compute the same output from **the same q, k, v**:

=====================  ==========================================================================
``sdpa_flash``         ``torch.nn.functional.scaled_dot_product_attention`` on 4-D ``(1, 1, n, d)``
                       inputs: torch's fused FlashAttention kernel (C++), its choice asserted
``blockwise``          ``attnlib.blockwise.blockwise_attention``, tiles of 256 x 256, a Python loop
``written_out``        ``attnlib.attention``: the scores, their scaled copy and the weights written
                       out, three fresh ``n x n`` matrices at every call (two alive at once)
``written_out_reuse``  the same arithmetic into one ``n x n`` buffer allocated once and reused
                       (:func:`written_out_into`: ``S``, softmax in place, ``P V``)
``sdpa_math``          ``scaled_dot_product_attention``'s math path (forced with ``sdpa_kernel``):
                       what SDPA runs on 3-D inputs, the baseline this benchmark timed before
=====================  ==========================================================================

**The gate** (:func:`check_agreement`), before anything is timed: every variant's output on the
query rows of :func:`gate_rows` (one in every tile of 256 queries, and at least 64) against
float64 ``attnlib.attention``, within ``attnlib.blockwise_bounds.typical_rounding_bound`` (a
tolerance for the typical rounding error, which one dropped tile of keys, or one wrong tile of
queries, exceeds) and within ``rounding_bound`` (the worst case, the proof, which grows like
``n`` and lets such a tile through at large ``n``). The SDPA variants run it under
``torch.nn.attention.sdpa_kernel`` with only their own backend, so a fallback fails. What it is
shown to refuse, and what it lets through (scores off by a few per cent in one tile, one
dropped key), is measured in chapter 10.

**Time**: medians of interleaved rounds (``benchmarks/harness.py``: every variant once per
round, the first one rotating), one torch thread, with the process's **user** and **system**
CPU time read apart, and its minor page faults: the written-out form faults in fresh pages
for its two ``n x n`` matrices at every call, which is system time, not arithmetic. Each
round also times one ``1024 x 1024`` product, for the GEMM floor (the ``4 n^2 d`` FLOPs of
the two products at that rate).

**Memory**, two measurements beside the count (``intermediate_bytes``):

- ``live_bytes``: ``attnlib.blockwise_io.peak_live_bytes``, the most bytes held at once by the
  tensors a call allocates (output excluded), followed op by op; not for ``sdpa_flash``, whose
  buffers live inside one C++ kernel where no tensor is seen;
- ``rss_growth_bytes``: the peak resident memory during one call minus the resident memory
  before it (Linux's ``VmHWM``, reset just before the call, less ``VmRSS``), in a fresh
  process per variant and ``n``, after a small warm-up call so that the libraries' one-time
  buffers are not counted. It counts pages touched, whatever allocated them: a kernel's own
  buffers too.

``written_out``, ``written_out_reuse`` and ``sdpa_math`` run only where ``2 n^2`` float32
numbers fit in ``--naive-limit-gib`` (default 2 GiB: up to ``n = 16,384``).

Usage (from the repository root)::

    python benchmarks/bench_blockwise.py --threads 1 --out benchmarks/results/cpu_blockwise.csv
    python benchmarks/bench_blockwise.py --quick     # seconds: a smoke test, into a temporary folder

Where the CSV goes: ``--out``; without it ``benchmarks/results/cpu_blockwise.csv`` unless that
file exists (the committed results are replaced only by naming them in ``--out``). ``--quick``
never writes into ``benchmarks/results/``.

The committed ``results/cpu_blockwise.csv`` comes from the book's build machine: 2 CPU cores
shared with other jobs (load average 10 to 16 during the run, so single rounds scattered by
5 to 38 percent, interquartile range over the median), PyTorch 2.13 CPU build, ``--threads 1 --rounds 5``. No GPU was available
to the book, so there is no GPU row; ``--device cuda`` times ``sdpa_flash`` (backend asserted)
against ``written_out`` on a GPU, with the wall clock around ``torch.cuda.synchronize()`` and the
growth of ``torch.cuda.max_memory_allocated`` as memory; it has not been run.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import attnlib  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:  # imported by path (the book, the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import interleaved, sdpa_backend  # noqa: E402

from attnlib import attention  # noqa: E402
from attnlib.blockwise import blockwise_attention, intermediate_bytes, rounding_bound  # noqa: E402
from attnlib.blockwise_bounds import typical_rounding_bound  # noqa: E402
from attnlib.blockwise_io import peak_live_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "cpu_blockwise.csv"
VARIANTS = ["sdpa_flash", "blockwise", "written_out", "written_out_reuse", "sdpa_math"]
WRITTEN_OUT = {"written_out", "written_out_reuse", "sdpa_math"}  # hold n x n matrices
BACKEND = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_math": SDPBackend.MATH}
FIELDS = ["n", "d", "block", "variant", "backend", "ran", "rounds", "cpu_ms", "q1_cpu_ms", "q3_cpu_ms",
          "user_ms", "sys_ms", "wall_ms", "faults", "ratio_vs_flash", "floor_ms", "matmul_gflops",
          "count_bytes", "live_bytes", "rss_growth_bytes", "threads", "dtype", "torch", "device", "date"]
MATMUL = 1024  # (1024 x 1024) @ (1024 x 1024): the arithmetic rate of the GEMM floor
ROWS = 64  # the gate compares at least this many query rows with float64
GATE_TILE = 256  # and at least one in every tile of this many queries (the timed kernels' query tile)


def gate_rows(n: int, tile: int = GATE_TILE, at_least: int = ROWS) -> Tensor:
    """The query rows the gate compares: the ``n`` rows cut into consecutive tiles of
    ``t = max(1, min(tile, n // at_least))`` rows, and one row at a fixed pseudo-random place in each
    (seeded, the same on every machine). So every tile of ``tile`` queries that starts at a
    multiple of ``t`` holds a row (a kernel that drops or miscomputes such a query tile changes a
    row the gate reads), and there are ``ceil(n / t)`` rows: 64 up to ``n = 64 tile``, ``n / tile``
    beyond. Returns a sorted ``(ceil(n / t),)`` int64 tensor."""
    if n < 1 or tile < 1 or at_least < 1:
        raise ValueError(f"n, tile and at_least must be >= 1, got {n}, {tile}, {at_least}")
    t = max(1, min(tile, n // at_least))
    starts = torch.arange(0, n, t)
    offset = torch.randint(0, t, (len(starts),), generator=torch.Generator().manual_seed(0))
    return torch.minimum(starts + offset, torch.tensor(n - 1))  # the last tile may be short


def written_out_into(buf: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> Tensor:
    """Attention written out into a reused buffer: ``buf`` ``(n_q, n_k)`` takes the scores, then
    (in place) the weights; ``out`` ``(n_q, d_v)`` the output. No allocation of ``n x n``."""
    torch.matmul(q, k.transpose(-2, -1), out=buf).mul_(1.0 / math.sqrt(q.shape[-1]))  # S
    torch.softmax(buf, dim=-1, out=buf)  # P, in place of S
    return torch.matmul(buf, v, out=out)  # (n_q, d_v)


def make_variants(q: Tensor, k: Tensor, v: Tensor, block: int, names: list[str]) -> dict[str, Callable[[], Tensor]]:
    """The variants on one head's ``q, k, v`` ``(n, d)``, each returning the output ``(n, d)``."""
    q4, k4, v4 = q[None, None], k[None, None], v[None, None]  # (1, 1, n, d): 4-D, the fused kernel's input
    fns: dict[str, Callable[[], Tensor]] = {
        "sdpa_flash": lambda: F.scaled_dot_product_attention(q4, k4, v4)[0, 0],
        "blockwise": lambda: blockwise_attention(q, k, v, block_q=block, block_k=block).out,
        "written_out": lambda: attention(q, k, v)[0],
    }
    if "written_out_reuse" in names:
        buf, out = q.new_empty(q.shape[0], k.shape[0]), torch.empty_like(q)
        fns["written_out_reuse"] = lambda: written_out_into(buf, q, k, v, out)

    def math_path() -> Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q4, k4, v4)[0, 0]

    fns["sdpa_math"] = math_path
    return {name: fns[name] for name in names}


def check_agreement(fns: dict[str, Callable[[], Tensor]], q: Tensor, k: Tensor, v: Tensor) -> float:
    """The gate: each variant's output, of shape ``(n, d_v)``, on the rows of :func:`gate_rows` (one
    in every tile of 256 queries, at least 64) within the typical-error tolerance of float64 attention (and within the
    worst-case bound); the SDPA variants checked under their own backend only, and against
    torch's own choice. Returns the largest gap / tolerance."""
    rows = gate_rows(q.shape[0])
    ref, _ = attention(q[rows].double(), k.double(), v.double())  # (rows, d)
    gate, proof = typical_rounding_bound(q[rows], k, v), rounding_bound(q[rows], k, v)[0]
    worst = 0.0
    for name, fn in fns.items():
        if name in BACKEND:
            if name == "sdpa_flash":
                chosen = sdpa_backend(q[None, None], k[None, None], v[None, None])
                if chosen != BACKEND[name]:
                    raise AssertionError(f"{name}: torch chooses {chosen.name} for these inputs, not FLASH_ATTENTION")
            with sdpa_kernel(BACKEND[name]):
                out = fn()
        else:
            out = fn()
        if out.shape != (q.shape[0], v.shape[-1]):  # a missing or extra row would pass the rows read
            raise AssertionError(f"{name} returns shape {tuple(out.shape)}, not (n, d_v) = {(q.shape[0], v.shape[-1])}")
        gap = (out[rows].double() - ref).abs()
        if not (gap <= proof).all():
            raise AssertionError(f"{name} differs from float64 attention by {gap.max():.3g}, over the worst-case bound")
        if not (gap <= gate).all():
            raise AssertionError(f"{name} differs from float64 attention by {gap.max():.3g}, over the typical-error "
                                 f"tolerance {gate.flatten()[(gap - gate).argmax()]:.3g}: a wrong tile?")
        worst = max(worst, float((gap / gate).max()))
    return worst


def rss_growth(variant: str, n: int, d: int, block: int, seed: int) -> int:
    """Bytes by which the peak resident memory grows during one call, in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--rss-child", variant, str(n), str(d), str(block), str(seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1])["growth"])


def _status(key: str) -> int:
    """A field of /proc/self/status in bytes (``VmRSS``: resident now; ``VmHWM``: its peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _rss_child(variant: str, n: int, d: int, block: int, seed: int) -> None:
    """Peak resident memory during one call minus resident memory before it. Linux resets the
    peak ("high water mark") to the current size when 5 is written to /proc/self/clear_refs;
    elsewhere the lifetime peak ``ru_maxrss`` is all there is, which hides growth below it."""
    torch.set_num_threads(1)
    with torch.no_grad():
        small = torch.randn(256, d)
        make_variants(small, small, small, block, [variant])[variant]()  # the libraries' one-time set-up
        torch.manual_seed(seed)
        q, k, v = (torch.randn(n, d) for _ in range(3))
        fn = make_variants(q, k, v, block, [variant])[variant]
        if variant == "written_out_reuse":
            fn()  # its buffer is allocated once, outside the calls measured
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _status("VmRSS")
            fn()
            growth = _status("VmHWM") - before
        except OSError:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            fn()
            growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024  # KiB on Linux
    print(json.dumps({"growth": growth}))


def run(lengths: list[int], d: int, block: int, rounds: int, naive_limit: float, threads: int,
        device: str = "cpu", rss: bool = True) -> list[dict[str, object]]:
    date = datetime.date.today().isoformat()
    rows: list[dict[str, object]] = []
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    a = torch.randn(MATMUL, MATMUL, device=dev)
    for n in lengths:
        torch.manual_seed(n)
        q, k, v = (torch.randn(n, d, device=dev) for _ in range(3))  # the same inputs for all
        names = [x for x in VARIANTS if x not in WRITTEN_OUT or intermediate_bytes(n, n, d) <= naive_limit]
        if dev.type == "cuda":
            names = [x for x in names if x in ("sdpa_flash", "written_out")]
        with torch.no_grad():
            fns = make_variants(q, k, v, block, names)
            worst = check_agreement(fns, q, k, v)
            print(f"n={n:6d}: every variant within the gate (largest gap {worst:.2f} of it)", flush=True)
            live = {x: peak_live_bytes(fns[x]) for x in names if x != "sdpa_flash" and dev.type == "cpu"}
            steps: dict[str, Callable[[], object]] = dict(fns)
            steps["matmul"] = lambda: a @ a
            interleaved(steps, 1, threads=threads, warmup=0, sync=sync)  # a warm-up round
            samples = interleaved(steps, rounds, threads=threads, warmup=0, sync=sync)
        gemm = samples.pop("matmul")
        rate = 2 * MATMUL**3 / statistics.median(s.wall if dev.type == "cuda" else s.cpu for s in gemm) / 1e9
        for variant in VARIANTS:
            ts = samples.get(variant)
            row: dict[str, object] = {
                "n": n, "d": d, "block": block, "variant": variant, "ran": ts is not None, "rounds": 0,
                "backend": BACKEND[variant].name if variant in BACKEND else "",
                "floor_ms": round(4 * n * n * d / (rate * 1e9) * 1e3, 3), "matmul_gflops": round(rate, 1),
                "count_bytes": intermediate_bytes(n, n, d, block_q=block, block_k=block) if variant == "blockwise"
                else intermediate_bytes(n, n, d) if variant == "written_out"
                else 4 * n * n if variant == "written_out_reuse" else "",  # its buffer, held between calls
                "live_bytes": live.get(variant, ""), "rss_growth_bytes": "",
                "threads": threads, "dtype": "float32", "torch": torch.__version__, "device": dev.type, "date": date,
            }
            if ts is not None:
                main = [s.wall if dev.type == "cuda" else s.cpu for s in ts]
                ref = [s.wall if dev.type == "cuda" else s.cpu for s in samples["sdpa_flash"]]
                q1, _, q3 = statistics.quantiles(main, n=4) if len(main) > 1 else (main[0],) * 3

                def ms(xs: list[float]) -> float:
                    return round(1e3 * statistics.median(xs), 3)

                row.update(rounds=len(ts), cpu_ms=ms(main), q1_cpu_ms=round(1e3 * q1, 3), q3_cpu_ms=round(1e3 * q3, 3),
                           user_ms=ms([s.user for s in ts]), sys_ms=ms([s.system for s in ts]),
                           wall_ms=ms([s.wall for s in ts]), faults=int(statistics.median(s.faults for s in ts)),
                           ratio_vs_flash=round(statistics.median(x / y for x, y in zip(main, ref)), 3))
                if rss and dev.type == "cpu":
                    row["rss_growth_bytes"] = rss_growth(variant, n, d, block, seed=n)
            rows.append(row)
            what = (f"{row['cpu_ms']:>10} ms (user {row['user_ms']}, sys {row['sys_ms']}, {row['faults']} faults; "
                    f"{row['ratio_vs_flash']}x flash); live {row['live_bytes']} B, RSS +{row['rss_growth_bytes']} B"
                    if ts else "not run (memory)")
            print(f"n={n:6d} {variant:17s} {what}", flush=True)
    return rows


def read_results(path: Path) -> list[dict[str, object]]:
    """The CSV's rows with numbers as numbers (empty cells as None)."""
    def conv(key: str, x: str) -> object:
        if x == "":
            return None
        if key == "ran":
            return x == "True"
        for kind in (int, float):
            try:
                return kind(x)
            except ValueError:
                pass
        return x
    with open(path, newline="") as f:
        return [{key: conv(key, x) for key, x in r.items()} for r in csv.DictReader(f)]


def output_path(p: argparse.ArgumentParser, a: argparse.Namespace) -> Path:
    """``--out``; for ``--quick`` a fresh temporary folder, never ``RESULTS``; otherwise
    ``DEFAULT_OUT`` if it does not exist."""
    if a.quick:
        if a.out is not None and RESULTS in Path(a.out).resolve().parents:
            p.error(f"--quick is a smoke test and must not write into {RESULTS}")
        return Path(a.out) if a.out is not None else Path(tempfile.mkdtemp(prefix="attnlib-bench-")) / DEFAULT_OUT.name
    if a.out is not None:
        return Path(a.out)
    if DEFAULT_OUT.exists():
        p.error(f"{DEFAULT_OUT} exists (committed results): give --out elsewhere, or name it to replace it")
    return DEFAULT_OUT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rss-child"]:
        _rss_child(argv[1], *(int(x) for x in argv[2:6]))  # type: ignore[arg-type]
        return 0
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--naive-limit-gib", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU time is per process: keep 1)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process memory measurement")
    p.add_argument("--quick", action="store_true", help="n = 256, 512; 2 rounds, no RSS: a smoke test")
    a = p.parse_args(argv)
    if a.threads != 1 and a.device == "cpu":
        p.error("the CPU clock is the process's user + system time, summed over its threads: use --threads 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    out = output_path(p, a)
    lengths, rounds, block = ([256, 512], 2, 128) if a.quick else (a.lengths, a.rounds, a.block)
    rss = not (a.no_rss or a.quick)  # a fresh process per variant and n: seconds each
    rows = run(lengths, a.d, block, rounds, a.naive_limit_gib * 2**30, a.threads, a.device, rss=rss)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
