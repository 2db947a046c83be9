"""benchmarks/ranks.py, the helpers every benchmark shares: the RSS probe measures what a
stretch of work allocates, and a worker that fails never passes for a result."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/<tier>/ is two folders down
_spec = importlib.util.spec_from_file_location("ranks", ROOT / "benchmarks" / "ranks.py")
ranks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ranks)

MB = 10 ** 6


def test_rss_probe_sees_an_allocation_and_forgets_it_after_a_reset():
    base = ranks.reset_peak()
    block = bytearray(64 * MB)  # zero-filled: every page is touched, so resident
    grown = ranks.peak() - base
    del block
    assert 60 * MB <= grown <= 80 * MB, grown
    base = ranks.reset_peak()
    assert ranks.peak() - base <= 2 * MB  # the 64 MB high-water mark is gone


def test_run_one_returns_the_last_json_line(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('{\"n\": 1}'); print('noise'); print('{\"n\": 2}')\n")
    assert ranks.run_one(str(script), [], timeout=60) == {"n": 2}


def test_run_one_reports_a_crash_even_after_a_json_line(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("import sys\nprint('{\"n\": 1}', flush=True)\n"
                      "sys.exit('worker broke after reporting')\n")
    row = ranks.run_one(str(script), [], timeout=60)
    assert set(row) == {"error"} and "worker broke after reporting" in row["error"], row


def test_run_one_passes_arguments_and_environment(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps({'argv': sys.argv[1:], 'x': os.environ['BENCH_X']}))\n")
    row = ranks.run_one(str(script), ["--a", "b c"], timeout=60, env={"BENCH_X": "7"})
    assert row == {"argv": ["--a", "b c"], "x": "7"}


def test_command_line_quotes_and_names_the_script_from_the_root(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x", "--out", "a b.md"])
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1000")
    got = ranks.command_line(str(ROOT / "benchmarks" / "end_to_end.py"),
                             env_keys=("MALLOC_MMAP_THRESHOLD_", "UNSET_KEY_X"))
    assert got == "MALLOC_MMAP_THRESHOLD_=1000 python benchmarks/end_to_end.py --out 'a b.md'"


def test_write_report_writes_the_lines_and_a_final_newline(tmp_path, capsys):
    path = tmp_path / "sub" / "r.md"
    ranks.write_report(str(path), ["# T", "", "| a |"], echo=False)
    assert path.read_text() == "# T\n\n| a |\n"
    assert capsys.readouterr().out == f"written to {path}\n"


def test_worst_rank_median_takes_the_worst_rank_then_the_median_round():
    runs = [[{"v": 1}, {"v": 5}], [{"v": 3}, {"v": 2}], [{"v": 9}, {"v": 4}]]
    assert ranks.worst_rank_median(runs, "v") == 5
