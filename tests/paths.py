"""Where the tests' data lives: the repository's `data/` and the trace slices in `tests/fixtures/`."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
TRACES = DATA / "traces"
H200_PROFILE = DATA / "profiles" / "h200_llama31_8b_fp8_tp1"
SPLITWISE = DATA / "profiles" / "splitwise_perf_model.csv"
FIXTURE_TRACES = ROOT / "tests" / "fixtures" / "traces"
