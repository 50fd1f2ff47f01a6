"""benchmarks/bench_blockwise.py (chapter 10) and benchmarks/harness.py: a quick run leaves the
committed results alone, the committed results are refused as an output, the gate reads a row in every tile of 256 queries
at every timed length and refuses a dropped tile of keys, a wrong or zeroed tile of queries and an
SDPA call that is not the fused kernel, the harness reads user and
system time apart, and the stored CSV reads back as the chapter uses it."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from attnlib.blockwise import blockwise_attention, intermediate_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _bench() -> ModuleType:
    return _load("bench_blockwise")


def test_quick_run_writes_a_temporary_folder_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    committed = {f: f.read_bytes() for f in RESULTS.iterdir() if f.is_file()}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _bench().main(["--quick", "--lengths", "256"])
    out = capsys.readouterr().out
    written = [Path(line.removeprefix("wrote ")) for line in out.splitlines() if line.startswith("wrote ")]
    assert len(written) == 1 and tmp_path in written[0].parents
    rows = _bench().read_results(written[0])
    assert {r["variant"] for r in rows} == set(_bench().VARIANTS) and all(r["ran"] for r in rows)
    assert {r["backend"] for r in rows if r["variant"].startswith("sdpa")} == {"FLASH_ATTENTION", "MATH"}
    assert {f: f.read_bytes() for f in RESULTS.iterdir() if f.is_file()} == committed


@pytest.mark.parametrize(("argv", "message"), [
    (["--quick", "--out", str(RESULTS / "x.csv")], "--quick is a smoke test and must not write into"),
    (["--rounds", "1"], "cpu_blockwise.csv exists (committed results)"),
    (["--threads", "2"], "use --threads 1"),
])
def test_refuses_committed_results_and_cpu_time_of_many_threads(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        _bench().main(argv)
    assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.filterwarnings("ignore:.*(Flash attention kernel not used|4 dimensional).*:UserWarning")
def test_the_gate_refuses_a_dropped_tile_and_a_math_path_called_flash() -> None:
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2048, 64, generator=g) for _ in range(3))
    with torch.no_grad():
        assert bench.check_agreement(bench.make_variants(q, k, v, 256, ["sdpa_flash", "blockwise"]), q, k, v) < 1
        dropped = {"blockwise": lambda: blockwise_attention(q, k[:-256], v[:-256], block_q=256, block_k=256).out}
        with pytest.raises(AssertionError, match="over the (worst-case bound|typical-error tolerance)"):
            bench.check_agreement(dropped, q, k, v)
        for short in (lambda: blockwise_attention(q[:-1], k, v).out,  # a row missing, an extra row
                      lambda: torch.cat([blockwise_attention(q, k, v).out, torch.full((1, 64), 1e9)])):
            with pytest.raises(AssertionError, match=r"returns shape \((2047|2049), 64\), not \(n, d_v\) = \(2048, 64\)"):
                bench.check_agreement({"blockwise": short}, q, k, v)
        three_d = {"sdpa_flash": lambda: F.scaled_dot_product_attention(q[None], k[None], v[None])[0]}
        with pytest.raises(RuntimeError, match="No available kernel"):  # 3-D: only the math path would run
            bench.check_agreement(three_d, q, k, v)


@pytest.mark.parametrize("n", [1024, 2048, 4096, 8192, 16384, 32768, 1000, 300, 7])
def test_the_gate_reads_a_row_in_every_tile_of_256_queries(n: int) -> None:
    bench = _bench()
    rows = bench.gate_rows(n)
    assert rows.dtype == torch.int64 and (rows[1:] > rows[:-1]).all() and 0 <= rows[0] and rows[-1] < n
    assert set((rows // 256).tolist()) == set(range(-(-n // 256)))  # every query tile holds a row
    assert len(rows) == max(min(n, 64), -(-n // 256)) if n % 64 == 0 else len(rows) >= min(n, 64)
    assert torch.equal(rows, bench.gate_rows(n))  # seeded: the same rows every time
    with pytest.raises(ValueError, match="n, tile and at_least must be >= 1"):
        bench.gate_rows(0)


def test_the_gate_refuses_a_wrong_tile_of_queries() -> None:
    """A loop right everywhere but in one tile of 256 queries (two positions): zeroed, or missing
    one tile of keys there; the gate refuses each. (Chapter 10 plants these at every position and
    every timed length, in float64 from each tile's terms.)"""
    bench = _bench()
    n = 2048
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 64, generator=g) for _ in range(3))
    with torch.no_grad():
        right = blockwise_attention(q, k, v, block_q=256, block_k=256).out
        assert bench.check_agreement({"blockwise": lambda: right}, q, k, v) < 1
        for i in (1, 6):
            rows = slice(256 * i, 256 * (i + 1))
            zeroed = right.clone()
            zeroed[rows] = 0
            missing = right.clone()  # query tile i misses key tile (i + 3) mod 8
            j = (i + 3) % 8
            keep = torch.cat([torch.arange(0, 256 * j), torch.arange(256 * (j + 1), n)])
            missing[rows] = blockwise_attention(q[rows], k[keep], v[keep], block_q=256, block_k=256).out
            for wrong in (zeroed, missing):
                with pytest.raises(AssertionError, match="over the (worst-case bound|typical-error tolerance)"):
                    bench.check_agreement({"blockwise": lambda: wrong}, q, k, v)


def test_harness_reads_user_and_system_time_and_faults_apart() -> None:
    harness = _load("harness")
    calls: list[str] = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = harness.interleaved(steps, 3, threads=1, warmup=0)
    assert calls == list("abc" "bca" "cab")  # the first step rotates
    assert all(len(ts) == 3 and all(t.cpu == t.user + t.system >= 0 for t in ts) for ts in samples.values())
    fresh = harness.measure(lambda: torch.ones(2**23), warmup=0)  # 32 MiB of fresh pages
    assert fresh.faults > 1000
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        harness.interleaved(steps, 0)


def test_committed_results_hold_what_the_chapter_reads() -> None:
    bench = _bench()
    rows = bench.read_results(RESULTS / "cpu_blockwise.csv")
    assert [r["variant"] for r in rows[:5]] == bench.VARIANTS and len(rows) == 5 * 6
    for r in rows:
        if r["variant"] in bench.WRITTEN_OUT:
            assert r["ran"] == (intermediate_bytes(r["n"], r["n"], r["d"]) <= 2 * 2**30)  # --naive-limit-gib 2
        if r["variant"] == "blockwise":
            assert r["count_bytes"] == r["live_bytes"] == intermediate_bytes(r["n"], r["n"], r["d"], block_q=256,
                                                                             block_k=256)
        if r["ran"]:
            assert r["q1_cpu_ms"] <= r["cpu_ms"] <= r["q3_cpu_ms"] and r["rounds"] == 5
            assert r["threads"] == 1 and r["rss_growth_bytes"] is not None
