"""What does attention without the n x n matrix buy on a CPU? (chapter 10)

One head, ``n`` queries against ``n`` keys of width ``d = 64``, float32, for ``n`` from 1,024
to 32,768. Three variants compute the same output from **the same q, k, v**:

=============  ==================================================================================
``naive``      ``attnlib.attention``: the scores and the weights written out, two n x n matrices
``blockwise``  ``attnlib.blockwise.blockwise_attention`` (block_q = block_k = 256), in Python
``sdpa``       ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch's fused C++ kernel)
=============  ==================================================================================

Protocol: before anything is timed, every variant's output is checked against a float64
``attnlib.attention`` on 64 of the query rows, within ``attnlib.blockwise.rounding_bound`` for
float32; times are **medians of interleaved rounds** (each round runs every variant once, in
rotating order); each round also times one large ``torch.matmul`` and one large copy, so the
machine's arithmetic rate (GFLOP/s) and memory bandwidth (GB/s), and their ratio, the
*balance point* in FLOP per byte, are measured under the same conditions.

``naive`` is run only where its two n x n float32 matrices fit in ``--naive-limit-gib``
(default 2 GiB, so up to n = 16,384); above that its row says ``ran = False`` and its memory
comes from the arithmetic alone. Memory is not measured with a profiler: the ``bytes``
column is :func:`attnlib.blockwise.intermediate_bytes`, the bytes of the intermediates each
algorithm holds (exact and the same on every machine).

The ``flop`` and ``traffic`` columns count the two matrix products, ``4 n^2 d`` FLOPs, and
the bytes each algorithm must move to and from main memory if a tile fits in cache and an
n x n matrix does not: naive: read q, k, v, write S, read S and write P (the softmax), read P,
write the output: ``(4 n^2 + 4 n d) * 4`` bytes; blockwise: q read and the output written
once, k and v read once per query tile: ``(2 n d + 2 n d * n / block_q) * 4`` bytes.
``intensity`` = flop / traffic.

Usage (from the repository root)::

    python benchmarks/bench_blockwise.py --threads 1 --clock cpu --out benchmarks/results/cpu_blockwise.csv
    python benchmarks/bench_blockwise.py --quick     # seconds: a smoke test, into a temporary folder

Where the CSV goes: ``--out``; without it ``benchmarks/results/cpu_blockwise.csv`` unless that
file exists (the committed results are replaced only by naming them in ``--out``). ``--quick``
never writes into ``benchmarks/results/``.

The committed ``results/cpu_blockwise.csv`` comes from the book's build machine: 2 shared CPU
cores, PyTorch 2.13 CPU build, ``--threads 1 --clock cpu --rounds 5``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import attnlib  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnlib import attention
from attnlib.blockwise import blockwise_attention, intermediate_bytes, rounding_bound

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "cpu_blockwise.csv"
VARIANTS = ["naive", "blockwise", "sdpa"]
FIELDS = ["n", "d", "block", "variant", "ran", "bytes", "flop", "traffic", "intensity",
          "median_ms", "q1_ms", "q3_ms", "rounds", "ratio_vs_sdpa", "matmul_gflops", "copy_gbs",
          "threads", "clock", "dtype", "torch", "date"]
MATMUL = 1024  # (1024 x 1024) @ (1024 x 1024): the arithmetic rate
COPY_MIB = 256  # a 256 MiB copy (read 256, write 256): the memory bandwidth


def traffic_bytes(variant: str, n: int, d: int, block: int) -> int:
    """Bytes to and from main memory (see the module docstring), float32."""
    if variant == "blockwise":
        return 4 * (2 * n * d + 2 * n * d * math.ceil(n / block))
    return 4 * (4 * n * n + 4 * n * d)  # naive; SDPA's kernel is blockwise too, left out


def check_agreement(fns: dict[str, Callable[[], Tensor]], q: Tensor, k: Tensor, v: Tensor) -> None:
    """Each variant's output on 64 query rows within the float32 rounding bound of float64 attention."""
    rows = torch.linspace(0, q.shape[0] - 1, min(64, q.shape[0])).long()
    ref, _ = attention(q[rows].double(), k.double(), v.double())  # (64, d)
    bound, _ = rounding_bound(q[rows], k, v)  # float32's eps
    for name, fn in fns.items():
        gap = (fn()[rows].double() - ref).abs()
        if not (gap <= bound).all():
            raise AssertionError(f"{name} differs from float64 attention by {gap.max():.3g}, over the bound")


def run(lengths: list[int], d: int, block: int, rounds: int, naive_limit: float, clock_name: str) -> list[dict[str, object]]:
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    a = torch.randn(MATMUL, MATMUL)
    big = torch.empty(COPY_MIB * 2**20 // 4)
    big_to = torch.empty_like(big)
    date = datetime.date.today().isoformat()
    rows: list[dict[str, object]] = []
    for n in lengths:
        torch.manual_seed(n)
        q, k, v = torch.randn(n, d), torch.randn(n, d), torch.randn(n, d)  # the same inputs for all
        fns: dict[str, Callable[[], Tensor]] = {
            "naive": lambda: attention(q, k, v)[0],
            "blockwise": lambda: blockwise_attention(q, k, v, block_q=block, block_k=block).out,
            "sdpa": lambda: F.scaled_dot_product_attention(q[None], k[None], v[None])[0],
        }
        if intermediate_bytes(n, n, d) > naive_limit:
            del fns["naive"]
        with torch.no_grad():
            check_agreement(fns, q, k, v)
            steps: dict[str, Callable[[], object]] = dict(fns)
            steps["matmul"] = lambda: a @ a
            steps["copy"] = lambda: big_to.copy_(big)
            for step in steps.values():  # warm-up
                step()
            times: dict[str, list[float]] = {name: [] for name in steps}
            for r in range(rounds):
                order = list(steps)[r % len(steps):] + list(steps)[: r % len(steps)]
                for name in order:
                    t = clock()
                    steps[name]()
                    times[name].append(clock() - t)
        gflops = 2 * MATMUL**3 / statistics.median(times.pop("matmul")) / 1e9
        gbs = 2 * big.nbytes / statistics.median(times.pop("copy")) / 1e9
        for variant in VARIANTS:
            ts = times.get(variant)
            flop = 4 * n * n * d
            blocks = variant == "blockwise"
            traffic = traffic_bytes(variant, n, d, block) if variant != "sdpa" else 0
            row: dict[str, object] = {
                "n": n, "d": d, "block": block, "variant": variant, "ran": ts is not None,
                "bytes": intermediate_bytes(n, n, d, block_q=block, block_k=block) if blocks
                else intermediate_bytes(n, n, d) if variant == "naive" else "",
                "flop": flop, "traffic": traffic or "",
                "intensity": round(flop / traffic, 2) if traffic else "",
                "median_ms": "", "q1_ms": "", "q3_ms": "", "rounds": 0, "ratio_vs_sdpa": "",
                "matmul_gflops": round(gflops, 1), "copy_gbs": round(gbs, 2),
                "threads": torch.get_num_threads(), "clock": clock_name, "dtype": "float32",
                "torch": torch.__version__, "date": date,
            }
            if ts is not None:
                q1, med, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (ts[0],) * 3
                ratios = [x / y for x, y in zip(ts, times["sdpa"])]
                row.update(median_ms=round(1e3 * statistics.median(ts), 3), q1_ms=round(1e3 * q1, 3),
                           q3_ms=round(1e3 * q3, 3), rounds=len(ts),
                           ratio_vs_sdpa=round(statistics.median(ratios), 3))
            rows.append(row)
            what = f"{row['median_ms']:>10} ms ({row['ratio_vs_sdpa']}x SDPA)" if ts else "not run (memory)"
            print(f"n={n:6d} {variant:9s} {what}; intermediates {row['bytes']} B", flush=True)
        print(f"  matmul {gflops:.1f} GFLOP/s, copy {gbs:.2f} GB/s, balance {gflops / gbs:.1f} FLOP/byte", flush=True)
    return rows


def read_results(path: Path) -> list[dict[str, object]]:
    """The CSV's rows with numbers as numbers (empty cells as None)."""
    def conv(key: str, x: str) -> object:
        if x == "":
            return None
        if key == "ran":
            return x == "True"
        try:
            return int(x)
        except ValueError:
            try:
                return float(x)
            except ValueError:
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
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--naive-limit-gib", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    p.add_argument("--quick", action="store_true", help="n = 256, 512; 2 rounds: a smoke test")
    a = p.parse_args(argv)
    if a.clock == "cpu" and a.threads != 1:
        p.error("--clock cpu sums the CPU time of all the process's threads: use it with --threads 1")
    out = output_path(p, a)
    if a.threads:
        torch.set_num_threads(a.threads)
    lengths, rounds, block = ([256, 512], 2, 128) if a.quick else (a.lengths, a.rounds, a.block)
    rows = run(lengths, a.d, block, rounds, a.naive_limit_gib * 2**30, a.clock)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
