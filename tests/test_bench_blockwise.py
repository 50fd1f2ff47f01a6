"""benchmarks/bench_blockwise.py (chapter 10): a quick run leaves the committed results alone,
the committed results are refused as an output, and the stored CSV reads back as the chapter uses it."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

from attnlib.blockwise import intermediate_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_blockwise", ROOT / "benchmarks" / "bench_blockwise.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_blockwise"] = module
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_a_temporary_folder_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    committed = {f: f.read_bytes() for f in RESULTS.iterdir() if f.is_file()}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _bench().main(["--quick"])
    out = capsys.readouterr().out
    written = [Path(line.removeprefix("wrote ")) for line in out.splitlines() if line.startswith("wrote ")]
    assert len(written) == 1 and tmp_path in written[0].parents
    rows = _bench().read_results(written[0])
    assert {r["variant"] for r in rows} == {"naive", "blockwise", "sdpa"} and all(r["ran"] for r in rows)
    assert {f: f.read_bytes() for f in RESULTS.iterdir() if f.is_file()} == committed


@pytest.mark.parametrize(("argv", "message"), [
    (["--quick", "--out", str(RESULTS / "x.csv")], "--quick is a smoke test and must not write into"),
    (["--rounds", "1"], "cpu_blockwise.csv exists (committed results)"),
    (["--clock", "cpu"], "use it with --threads 1"),
])
def test_refuses_committed_results_and_cpu_time_of_many_threads(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        _bench().main(argv)
    assert message in " ".join(capsys.readouterr().err.split())


def test_committed_results_hold_what_the_chapter_reads() -> None:
    rows = _bench().read_results(RESULTS / "cpu_blockwise.csv")
    assert len(rows) == 18
    for r in rows:
        if r["variant"] == "naive":
            assert r["bytes"] == intermediate_bytes(r["n"], r["n"], r["d"])
            assert r["ran"] == (r["bytes"] <= 2 * 2**30)  # --naive-limit-gib 2
        if r["ran"]:
            assert r["q1_ms"] <= r["median_ms"] <= r["q3_ms"] and r["rounds"] == 5
