"""Trace reading: both shapes, BOM and line ends, windows, speed-up, malformed files."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from xpyd.traces import TraceError, TraceRequest, load_trace, read_trace, scale_prompts, scale_rate, surge

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
DATA = Path(__file__).resolve().parents[2] / "data" / "traces"
AZURE = FIXTURES / "azure_conv_2023_head200.csv"
MOONCAKE = FIXTURES / "mooncake_synthetic_head50.jsonl"


def write(tmp_path: Path, name: str, text: str, encoding: str = "utf-8") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode(encoding))
    return path


def test_azure_csv_slice() -> None:
    requests = read_trace(AZURE)
    assert len(requests) == 200
    assert requests[0] == TraceRequest(0.0, 374, 44)
    # 2023-11-16 18:15:46.6805900 -> 18:15:50.9951690, all seven fractional digits kept.
    assert requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert requests[1].isl == 396 and requests[1].osl == 109
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(requests))


def test_mooncake_jsonl_slice() -> None:
    requests = read_trace(MOONCAKE)
    assert len(requests) == 50
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert requests[0].isl == first["input_length"] and requests[0].osl == first["output_length"]
    assert requests[0].prefix_blocks == tuple(first["hash_ids"])
    last = json.loads(MOONCAKE.read_text().splitlines()[-1])
    assert requests[-1].arrival_s == pytest.approx(last["timestamp"] / 1000.0)


def test_csv_with_bom_crlf_and_blank_lines(tmp_path: Path) -> None:
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,10,5\r\n\r\n"
            "2023-11-16 18:15:47.1805900,20,0\r\n")
    requests = read_trace(write(tmp_path, "bom.csv", text, "utf-8-sig"))
    assert [(r.arrival_s, r.isl, r.osl) for r in requests] == [(0.0, 10, 5), (pytest.approx(0.5), 20, 1)]


def test_other_traces_in_either_shape(tmp_path: Path) -> None:
    csv_path = write(tmp_path, "other.csv", "arrival_time,prompt_tokens,output_tokens,extra\n2.5,7,3,x\n1.0,9,4,y\n")
    assert read_trace(csv_path) == [TraceRequest(0.0, 9, 4), TraceRequest(1.5, 7, 3)]
    jsonl = write(tmp_path, "iso.jsonl", '{"timestamp": "2024-01-01T00:00:01", "isl": 5, "osl": 2}\n'
                  '{"timestamp": "2024-01-01T00:00:00.25", "isl": 6, "osl": 3}\n')
    assert read_trace(jsonl) == [TraceRequest(0.0, 6, 3), TraceRequest(0.75, 5, 2)]


def test_window_and_speedup(tmp_path: Path) -> None:
    lines = "".join(f'{{"timestamp": {i * 1000}, "input_length": {i + 1}, "output_length": 1}}\n' for i in range(10))
    path = write(tmp_path, "t.jsonl", lines)
    window = load_trace(path, start_s=2.0, duration_s=4.0, speedup=2.0)
    assert [r.isl for r in window] == [3, 4, 5, 6]
    assert [r.arrival_s for r in window] == [0.0, 0.5, 1.0, 1.5]
    assert len(load_trace(path, speedup=50)) == 10
    with pytest.raises(TraceError, match="no requests in the window"):
        load_trace(path, start_s=100.0)
    with pytest.raises(ValueError, match="speedup"):
        load_trace(path, speedup=0)
    with pytest.raises(ValueError, match="duration"):
        load_trace(path, duration_s=-1)


@pytest.mark.parametrize("factor", [1, 2, 3, 10])
def test_rate_scale_copies_each_request_within_its_jitter(factor: int) -> None:
    requests = read_trace(AZURE)
    gap = (requests[-1].arrival_s - requests[0].arrival_s) / (len(requests) - 1)
    scaled = scale_rate(requests, factor, seed=1)
    assert len(scaled) == factor * len(requests)
    assert [r.arrival_s for r in scaled] == sorted(r.arrival_s for r in scaled)
    # every request is there unchanged, with factor - 1 copies of its lengths within [t, t + gap / factor)
    assert set(requests) <= set(scaled)
    by_lengths = sorted(scaled, key=lambda r: (r.isl, r.osl, r.arrival_s))
    originals = sorted(requests, key=lambda r: (r.isl, r.osl, r.arrival_s))
    for (isl, osl), group in itertools.groupby(by_lengths, key=lambda r: (r.isl, r.osl)):
        times = [r.arrival_s for r in group]
        starts = [r.arrival_s for r in originals if (r.isl, r.osl) == (isl, osl)]
        assert len(times) == factor * len(starts)
        assert all(any(t <= x < t + gap / factor for t in starts) for x in times)
    assert scale_rate(requests, factor, seed=1) == scaled
    if factor > 1:
        assert scale_rate(requests, factor, seed=2) != scaled


@pytest.mark.parametrize(("factor", "seed"), [(4, 0), (10, 7)])
def test_rate_scale_keeps_the_load_shape(factor: int, seed: int) -> None:
    # a step from 1 to 5 requests per second: each second holds factor times its requests
    requests = [TraceRequest(float(i), 100, 10) for i in range(10)]
    requests += [TraceRequest(10 + i / 5, 200, 20, (i,)) for i in range(50)]
    scaled = scale_rate(requests, factor, seed=seed)
    per_second = [sum(1 for r in requests if s <= r.arrival_s < s + 1) for s in range(20)]
    scaled_per_second = [sum(1 for r in scaled if s <= r.arrival_s < s + 1) for s in range(20)]
    # the jitter (the mean gap over the factor, 0.34 s / factor) moves few copies past a boundary
    assert all(abs(n - factor * m) <= factor for n, m in zip(scaled_per_second, per_second, strict=True))
    assert sum(scaled_per_second) == factor * len(requests)
    assert sorted(r.prefix_blocks for r in scaled) == sorted(r.prefix_blocks for r in requests for _ in range(factor))


def test_rate_scale_in_load_trace_and_bad_factors(tmp_path: Path) -> None:
    assert load_trace(AZURE, rate_scale=1) == load_trace(AZURE)
    scaled = load_trace(AZURE, speedup=2.0, rate_scale=3, seed=5)
    assert scaled == scale_rate(load_trace(AZURE, speedup=2.0), 3, seed=5)
    assert scale_rate([TraceRequest(1.5, 10, 2)], 3) == [TraceRequest(1.5, 10, 2)] * 3   # no gap, no jitter
    for factor in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="rate scale"):
            load_trace(AZURE, rate_scale=factor)  # type: ignore[arg-type]


def test_surge_multiplies_only_its_span() -> None:
    requests = [TraceRequest(i / 2, 100 + i, 10) for i in range(40)]   # 2 req/s for 20 s
    surged = surge(requests, 5.0, 10.0, 3, seed=1)
    per_second = [sum(1 for r in surged if s <= r.arrival_s < s + 1) for s in range(20)]
    assert per_second[:5] == [2] * 5 and per_second[10:] == [2] * 10
    assert sum(per_second[5:10]) == 30 and len(surged) == 40 + 20
    assert [r.arrival_s for r in surged] == sorted(r.arrival_s for r in surged)
    assert sorted(r.isl for r in surged if 5.0 <= r.arrival_s < 10.0) == sorted(
        r.isl for r in requests if 5.0 <= r.arrival_s < 10.0 for _ in range(3))
    assert surge(requests, 30.0, 40.0, 5) == requests       # nothing arrives in the span
    with pytest.raises(ValueError, match="end after it starts"):
        surge(requests, 5.0, 5.0, 2)
    with pytest.raises(ValueError, match="rate scale"):
        surge(requests, 5.0, 6.0, 0)


def test_scale_prompts_lengthens_prompts_within_the_cap() -> None:
    requests = [TraceRequest(0.0, 1000, 7, (1, 2)), TraceRequest(1.0, 5000, 9), TraceRequest(2.0, 1, 3)]
    assert scale_prompts(requests, 4.0, max_isl=16_000) == [
        TraceRequest(0.0, 4000, 7), TraceRequest(1.0, 16_000, 9), TraceRequest(2.0, 4, 3)]
    assert [r.isl for r in scale_prompts(requests, 0.001, max_isl=100)] == [1, 5, 1]
    for factor, cap, message in ((0.0, 10, "prompt scale"), (float("inf"), 10, "prompt scale"), (2.0, 0, "max_isl")):
        with pytest.raises(ValueError, match=message):
            scale_prompts(requests, factor, max_isl=cap)


@pytest.mark.parametrize(("name", "text", "message"), [
    ("bad_time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\nyesterday,1,1\n",
     r"bad_time.csv:3: bad timestamp 'yesterday'"),
    ("short.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1\n",
     r"short.csv:2: expected 3 fields"),
    ("header.csv", "when,ContextTokens,GeneratedTokens\n1,1,1\n", r"header.csv:1: CSV header .* lacks a column"),
    ("count.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,lots,1\n",
     r"count.csv:2: input length must be an integer"),
    ("zero.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,0,1\n", r"zero.csv:2: input length must be at least 1"),
    ("negative.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": -1}\n',
     r"negative.jsonl:1: output length must not be negative"),
    ("broken.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1}\n{"timestamp": 1,\n',
     r"broken.jsonl:2: not JSON"),
    ("missing.jsonl", '{"timestamp": 0, "output_length": 1}\n', r"missing.jsonl:1: missing 'isl'"),
    ("array.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1}\n[1, 2]\n',
     r"array.jsonl:2: expected a JSON object"),
    ("hashes.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": "x"}\n',
     r"hashes.jsonl:1: hash_ids must be a list of integers"),
    ("empty.csv", "\n\n", r"empty.csv: empty trace"),
    ("headeronly.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", r"headeronly.csv: no requests"),
])
def test_malformed_files_name_file_and_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        read_trace(write(tmp_path, name, text))


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "absent.csv")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(TraceError, match="not UTF-8"):
        read_trace(binary)


def test_data_traces_load_and_fixtures_match_them() -> None:
    conv = read_trace(DATA / "azure_conv_2023.csv")
    assert len(conv) == 19366
    assert conv[:200] == read_trace(AZURE)
    assert 3500 < conv[-1].arrival_s < 3600
    mooncake = read_trace(DATA / "mooncake_synthetic.jsonl")
    assert len(mooncake) == 3993
    assert mooncake[:50] == read_trace(MOONCAKE)
    assert len(read_trace(DATA / "azure_code_2023.csv")) == 8819


@pytest.mark.parametrize(("fixture", "source", "start", "length"), [
    ("azure_code_2023_600s_720s.csv", "azure_code_2023.csv", 600.0, 720.0),
    ("azure_conv_2023_600s_240s.csv", "azure_conv_2023.csv", 600.0, 240.0),
])
def test_trace_slices_match_the_data_traces(fixture: str, source: str, start: float, length: float) -> None:
    """The e2e's slices: the requests of the source arriving in [start, start + length), in order."""
    sliced = read_trace(FIXTURES / fixture)
    raw_lines = (FIXTURES / fixture).read_bytes().splitlines()[1:]
    source_lines = set((DATA / source).read_bytes().splitlines()[1:])
    assert raw_lines and all(line in source_lines for line in raw_lines)  # byte for byte
    whole = read_trace(DATA / source)
    window = [r for r in whole if start <= r.arrival_s < start + length]
    assert [(r.isl, r.osl) for r in sliced] == [(r.isl, r.osl) for r in window]
