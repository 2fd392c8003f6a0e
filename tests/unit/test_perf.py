"""The performance model: held to every measured point of the profile tables, monotone where the
data is, extrapolating as perf.py documents; splitwise rows, the roofline, and the KV arithmetic."""

from __future__ import annotations

import csv
import itertools
import math
import statistics
from pathlib import Path

import pytest

from tests.paths import H200_PROFILE, SPLITWISE
from xpyd.perf.model import (
    H200_LLAMA31_8B_MAX_KV_TOKENS,
    DecodePoint,
    MeasuredDecode,
    PerfModel,
    PiecewiseLinear,
    PrefillPoint,
    link_seconds,
    read_profile,
    saturated_points,
    transfer_to_prefill_ratio,
)
from xpyd.perf.shapes import GPUS, MODELS, ModelShape, lookup_gpu, lookup_model
from xpyd.sim.core import EnginePerf

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROFILE = H200_PROFILE
K = H200_LLAMA31_8B_MAX_KV_TOKENS

PREFILL_POINTS, DECODE_POINTS = read_profile(PROFILE)
ROWS: dict[int, list[DecodePoint]] = {}
for _point in DECODE_POINTS:
    ROWS.setdefault(_point.context_tokens, []).append(_point)
CONTEXTS = sorted(ROWS)
MONOTONE_CONTEXTS = [c for c in CONTEXTS if all(a.itl_s <= b.itl_s for a, b in itertools.pairwise(ROWS[c]))]


@pytest.fixture(scope="module")
def model() -> PerfModel:
    return PerfModel.from_profile(PROFILE)


def _decode(model: PerfModel) -> MeasuredDecode:
    assert isinstance(model.decode, MeasuredDecode)
    return model.decode


# --- data and interface --------------------------------------------------------------------


def test_profile_tables_are_read_whole() -> None:
    assert len(PREFILL_POINTS) == 17 and len(DECODE_POINTS) == 41
    assert CONTEXTS == [350, 2997, 5644, 8291, 10938, 13585]
    assert MONOTONE_CONTEXTS == [2997, 5644, 8291, 10938, 13585]  # context 350 dips at 49% usage


def test_perf_model_is_an_engine_perf(model: PerfModel) -> None:
    perf: EnginePerf = model
    assert perf.max_kv_tokens == K
    assert isinstance(perf.prefill_seconds(1000), float)
    assert isinstance(perf.decode_step_seconds(8, 8000), float)
    assert perf.kv_transfer_seconds(1000) == 0.0  # no KV shape given
    assert perf.prefill_seconds(0) == 0.0 and perf.decode_step_seconds(0, 0) == 0.0


# --- prefill ---------------------------------------------------------------------------------


@pytest.mark.parametrize("point", PREFILL_POINTS, ids=lambda p: f"isl{p.isl_tokens}")
def test_prefill_is_exact_at_every_measured_point(model: PerfModel, point: PrefillPoint) -> None:
    assert model.prefill_seconds(point.isl_tokens) == point.ttft_s
    assert model.ttft_seconds(point.isl_tokens) == point.ttft_s
    assert model.prefill_tokens_per_second(point.isl_tokens) == pytest.approx(point.tokens_per_s, rel=1e-5)


def test_prefill_is_monotone_like_its_data(model: PerfModel) -> None:
    assert all(a.ttft_s < b.ttft_s for a, b in itertools.pairwise(PREFILL_POINTS))
    times = [model.prefill_seconds(isl) for isl in range(1, 40_000, 7)]
    assert all(a <= b for a, b in itertools.pairwise(times))


def _last_prefill_slope() -> float:
    a, b = PREFILL_POINTS[-2], PREFILL_POINTS[-1]
    return (b.ttft_s - a.ttft_s) / (b.isl_tokens - a.isl_tokens)


@pytest.mark.parametrize(("isl", "expected"), [
    (1, PREFILL_POINTS[0].ttft_s),                       # below the table: clamp
    (99, PREFILL_POINTS[0].ttft_s),
    (608, (19.5252 + (38.4941 - 19.5252) * 508 / 1017) / 1e3),  # between 100 and 1117: linear
    (16_372 + 1017, PREFILL_POINTS[-1].ttft_s + 1017 * _last_prefill_slope()),  # above: last segment
    (65_536, PREFILL_POINTS[-1].ttft_s + (65_536 - 16_372) * _last_prefill_slope()),
])
def test_prefill_interpolation_and_extrapolation(model: PerfModel, isl: int, expected: float) -> None:
    assert model.prefill_seconds(isl) == pytest.approx(expected, rel=1e-12)


# --- decode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("point", DECODE_POINTS, ids=lambda p: f"c{p.context_tokens}-u{p.kv_usage}")
def test_decode_is_exact_at_every_measured_point(model: PerfModel, point: DecodePoint) -> None:
    assert _decode(model).itl_seconds_at(point.context_tokens, point.kv_usage) == point.itl_s
    batch = point.batch_size(K)  # the README's mapping: usage x max_kv_tokens / context
    assert model.decode.step_seconds(batch, point.kv_usage * K) == pytest.approx(point.itl_s, rel=1e-12)


@pytest.mark.parametrize(("usage", "context", "batch"), [
    (0.00037, 350, 1.0), (0.0974, 350, 263.0), (0.1554, 2997, 49.0), (0.91651, 2997, 289.0),
    (0.62709, 5644, 105.0), (0.96314, 13585, 67.0),
])
def test_decode_batch_is_usage_times_capacity_over_context(usage: float, context: int, batch: float) -> None:
    point = DecodePoint(usage, context, 0.01, 0.0)
    assert point.batch_size(K) == pytest.approx(batch, abs=0.02)


def test_integer_batches_read_the_table_through_the_engine_interface(model: PerfModel) -> None:
    # 49 sequences of 2,997 tokens is the (0.1554, 2997) point up to the rounding of its usage.
    assert model.itl_seconds(49, 2997) == pytest.approx(9.9375e-3, rel=1e-3)
    assert model.decode_step_seconds(49, 49 * 2997) == model.itl_seconds(49, 2997)
    assert model.itl_seconds(1, 13585) == pytest.approx(4.8265e-3, rel=1e-3)


@pytest.mark.parametrize("context", MONOTONE_CONTEXTS + [
    (a + b) / 2 for a, b in itertools.pairwise(MONOTONE_CONTEXTS)] + [20_000.0])
def test_decode_is_monotone_in_batch_where_the_data_is(model: PerfModel, context: float) -> None:
    cap = model.max_batch_for_kv(context)
    itls = [model.itl_seconds(batch, context) for batch in range(1, cap + 50)]
    assert all(a <= b + 1e-15 for a, b in itertools.pairwise(itls))


def _row_value(context: int, usage: float) -> float:
    points = ROWS[context]
    xs, ys = [p.kv_usage for p in points], [p.itl_s for p in points]
    return PiecewiseLinear(tuple(xs), tuple(ys))(usage)


@pytest.mark.parametrize(("context", "usage", "expected"), [
    # above a row's largest usage: the last segment continues
    (2997, 1.0, 41.7078e-3 + (41.7078e-3 - 31.7967e-3) / (0.91651 - 0.76429) * (1.0 - 0.91651)),
    # ... but never downwards: context 13585 ends 29.34 -> 36.17 ms, so it rises
    (13585, 1.0, 36.169e-3 + (36.169e-3 - 29.3389e-3) / (0.96314 - 0.80501) * (1.0 - 0.96314)),
    # below a row's smallest usage (batch ~1): clamp
    (13585, 0.0, 4.8265e-3),
    (350, 0.0, 4.3799e-3),
    # outside the measured contexts: the nearest row at the same usage
    (100, 0.2, _row_value(350, 0.2)),
    (40_000, 0.5, _row_value(13585, 0.5)),
    # between contexts: linear in context at the same usage
    ((2997 + 5644) / 2, 0.3, (_row_value(2997, 0.3) + _row_value(5644, 0.3)) / 2),
    (2997 + (5644 - 2997) / 4, 0.7, 0.75 * _row_value(2997, 0.7) + 0.25 * _row_value(5644, 0.7)),
])
def test_decode_interpolation_and_extrapolation(model: PerfModel, context: float, usage: float,
                                                expected: float) -> None:
    assert _decode(model).itl_seconds_at(context, usage) == pytest.approx(expected, rel=1e-12)


def test_sequence_cap_is_inferred_from_saturated_points(model: PerfModel) -> None:
    saturated = saturated_points(DECODE_POINTS, K)
    assert [(p.context_tokens, p.kv_usage) for p in saturated] == [(350, 0.38851), (350, 0.48554), (350, 0.58257)]
    assert [round(p.effective_batch_size()) for p in saturated] == [900, 788, 808]
    assert model.max_num_seqs == 900
    assert model.max_batch_for_kv(350) == 900
    assert PerfModel.from_profile(PROFILE, max_num_seqs=256).max_batch_for_kv(350) == 256


@pytest.mark.parametrize("point", [p for p in DECODE_POINTS if p not in saturated_points(DECODE_POINTS, K)],
                         ids=lambda p: f"c{p.context_tokens}-u{p.kv_usage}")
def test_decode_throughput_is_batch_over_itl_close_to_the_table(model: PerfModel, point: DecodePoint) -> None:
    batch = point.batch_size(K)
    modelled = batch / model.decode.step_seconds(batch, point.kv_usage * K)
    assert modelled == pytest.approx(point.tokens_per_s, rel=0.08)
    assert modelled >= point.tokens_per_s * 0.999  # the table lost some steps to interleaved prefill


def _brute_force_max_batch(model: PerfModel, target: float, context: float, headroom: float = 1.0) -> int:
    cap = model.max_batch_for_kv(context, headroom)
    fitting = [b for b in range(1, cap + 1) if model.itl_seconds(b, context) <= target]
    return max(fitting, default=0)


@pytest.mark.parametrize("target_ms", [4.0, 5.0, 10.0, 20.0, 30.0, 45.0, 100.0])
@pytest.mark.parametrize("context", [350, 1000, 2997, 4000, 8291, 12_000, 13_585, 20_000])
def test_max_batch_for_itl_is_the_largest_batch_under_the_target(model: PerfModel, target_ms: float,
                                                                  context: float) -> None:
    best = model.max_batch_for_itl(target_ms / 1e3, context)
    assert best == _brute_force_max_batch(model, target_ms / 1e3, context)
    if best:
        assert model.itl_seconds(best, context) <= target_ms / 1e3


def test_max_batch_for_itl_respects_kv_capacity_and_headroom(model: PerfModel) -> None:
    assert model.max_batch_for_itl(1.0, 13_585) == K // 13_585 == 69
    assert model.max_batch_for_itl(1.0, 13_585, kv_headroom=0.5) == math.floor(K * 0.5 / 13_585) == 34
    assert model.max_batch_for_itl(1.0, 2_000_000) == 0  # not even one sequence fits
    assert model.max_batch_for_itl(4.0e-3, 2997) == 0  # one sequence already takes 4.43 ms


def test_kv_transfer_and_disaggregated_ttft(model: PerfModel) -> None:
    wired = model.with_kv_transfer(65_536, 100.0)
    assert wired.kv_transfer_seconds(1000) == pytest.approx(1000 * 65_536 / 12.5e9, rel=1e-12)
    assert wired.kv_transfer_seconds(0) == 0.0
    assert model.kv_transfer_seconds(1000) == 0.0  # the original is untouched
    assert wired.ttft_seconds(4168, disaggregated=True) == pytest.approx(
        87.342e-3 + 4168 * 65_536 / 12.5e9 + model.itl_seconds(1, 4168), rel=1e-12)


def test_profile_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        PerfModel.from_profile(tmp_path / "missing")
    (tmp_path / "p_prefill.csv").write_text("isl_tokens,ttft_ms\n100,1\n")
    (tmp_path / "p_decode.csv").write_text("kv_usage_fraction,context_length_tokens,itl_ms\n")
    with pytest.raises(ValueError, match="missing column"):
        PerfModel.from_profile(tmp_path / "p")


# --- splitwise -------------------------------------------------------------------------------


def _splitwise_rows(hardware: str, tp: int) -> list[dict[str, str]]:
    with SPLITWISE.open() as handle:
        return [row for row in csv.DictReader(handle)
                if row["model"] == "llama2-70b" and row["hardware"] == hardware and int(row["tensor_parallel"]) == tp]


def _median_prompt_time(rows: list[dict[str, str]], tokens: int) -> float:
    return statistics.median(float(r["prompt_time"]) / 1e3 for r in rows
                             if int(r["prompt_size"]) * int(r["batch_size"]) == tokens)


def _median_token_time(rows: list[dict[str, str]], batch: int) -> float:
    return statistics.median(float(r["token_time"]) / 1e3 for r in rows if int(r["batch_size"]) == batch)


@pytest.mark.parametrize("tokens", [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768])
def test_splitwise_prefill_is_the_median_prompt_time_of_the_batch_tokens(tokens: int) -> None:
    model = PerfModel.from_splitwise(SPLITWISE, "llama2-70b", "a100-80gb", 4)
    assert model.prefill_seconds(tokens) == _median_prompt_time(_splitwise_rows("a100-80gb", 4), tokens)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32, 64])
def test_splitwise_decode_is_the_median_token_time_of_the_batch(batch: int) -> None:
    model = PerfModel.from_splitwise(SPLITWISE, "llama2-70b", "a100-80gb", 4)
    expected = _median_token_time(_splitwise_rows("a100-80gb", 4), batch)
    assert model.decode_step_seconds(batch, batch * 640) == expected
    assert model.decode_step_seconds(batch, batch * 8000) == expected  # context-independent


def test_splitwise_drops_rows_that_cannot_fit_the_kv_cache() -> None:
    # Llama2-70B FP16 on 2 x H100 leaves (2 x 80 GB x 0.9 - 137.96 GB) / 320 KiB = 18,432 KV tokens; the
    # 32,768-token prefill (360 ms, faster than 8,192 tokens) and the batch 32/64 decode rows do not fit.
    model = PerfModel.from_splitwise(SPLITWISE, "llama2-70b", "h100-80gb", 2)
    assert model.max_kv_tokens == 18_432 and model.gpus == 2
    assert model.prefill.xs[-1] == 16_384
    assert model.decode.batch_breakpoints(600) == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert all(a <= b for a, b in itertools.pairwise(model.prefill.ys))
    # beyond the last kept batch the last segment continues
    slope = (_median_token_time(_splitwise_rows("h100-80gb", 2), 16)
             - _median_token_time(_splitwise_rows("h100-80gb", 2), 8)) / 8
    assert model.decode_step_seconds(32, 32 * 640) == pytest.approx(
        _median_token_time(_splitwise_rows("h100-80gb", 2), 16) + 16 * slope, rel=1e-12)


def test_splitwise_unknown_combination_lists_what_exists() -> None:
    with pytest.raises(ValueError, match=r"available: bloom-176b/a100-80gb/tp8, .*llama2-70b/h100-80gb/tp2"):
        PerfModel.from_splitwise(SPLITWISE, "bloom-176b", "h100-80gb", 4)


# --- roofline --------------------------------------------------------------------------------


def test_roofline_prefill_is_the_seed_arithmetic() -> None:
    shape = MODELS["llama-3.1-70b"]
    seed = ModelShape("70B", shape.layers, shape.kv_heads, shape.head_dim, params=70e9)
    model = PerfModel.roofline(seed, lookup_gpu("H100"), 4, effective_tflops=400)
    for tokens, seconds in ((2048, 0.1792), (8192, 0.7168), (32768, 2.8672)):
        assert model.prefill_seconds(tokens) == pytest.approx(seconds, rel=1e-12)
    assert model.prefill_tokens_per_second(4096) == pytest.approx(4 * 400e12 / (2 * 70e9), rel=1e-12)


def test_roofline_decode_reads_weights_and_kv_then_turns_compute_bound() -> None:
    shape, gpu = lookup_model("llama-3.1-8b"), lookup_gpu("H100")
    model = PerfModel.roofline(shape, gpu, 1, mfu=0.5, mbu=1.0)
    weights = shape.weight_bytes("bf16")
    assert model.itl_seconds(1, 0.0) == pytest.approx(weights / 3.35e12, rel=1e-12)
    assert model.itl_seconds(1, 8192) == pytest.approx((weights + 8192 * 131_072) / 3.35e12, rel=1e-12)
    assert model.itl_seconds(64, 1000) > model.itl_seconds(32, 1000) > model.itl_seconds(1, 1000)
    compute_bound = 100_000  # batch far past the ridge at context 1
    assert model.decode.step_seconds(compute_bound, compute_bound) == pytest.approx(
        compute_bound * 2 * 8.03e9 / (989.4e12 * 0.5), rel=1e-12)
    for target in (0.006, 0.01, 0.05):
        for context in (1.0, 500.0, 4000.0):
            assert model.max_batch_for_itl(target, context) == _brute_force_max_batch(model, target, context)


def test_roofline_kv_capacity_is_the_memory_left_after_the_weights() -> None:
    shape, gpu = lookup_model("llama-3.1-8b"), lookup_gpu("H100")
    assert PerfModel.roofline(shape, gpu).max_kv_tokens == math.floor((80e9 * 0.9 - 8.03e9 * 2) / 131_072)
    assert PerfModel.roofline(shape, gpu, kv_dtype="fp8").max_kv_tokens == math.floor((80e9 * 0.9 - 16.06e9) / 65_536)
    with pytest.raises(ValueError, match="leave no KV space"):
        PerfModel.roofline(lookup_model("llama-3.1-405b"), gpu, 1)


def test_roofline_moe_computes_with_active_and_stores_total_parameters() -> None:
    shape, gpu = lookup_model("Mixtral-8x7B"), lookup_gpu("H200")
    model = PerfModel.roofline(shape, gpu, 1, mfu=1.0, mbu=1.0)
    assert model.prefill_seconds(1000) == pytest.approx(1000 * 2 * 12.9e9 / 989.4e12, rel=1e-12)
    assert model.itl_seconds(1, 0.0) == pytest.approx(46.7e9 * 2 / 4.8e12, rel=1e-12)


def test_roofline_fp8_uses_fp8_tensor_cores_where_they_exist() -> None:
    shape = lookup_model("llama-3.1-8b")
    fp8 = PerfModel.roofline(shape, lookup_gpu("H100"), weight_dtype="fp8", mfu=1.0)
    bf16 = PerfModel.roofline(shape, lookup_gpu("H100"), mfu=1.0)
    assert fp8.prefill_seconds(4096) == pytest.approx(bf16.prefill_seconds(4096) / 2, rel=1e-3)
    a100 = PerfModel.roofline(shape, lookup_gpu("a100-80gb"), weight_dtype="fp8", mfu=1.0)
    assert a100.prefill_seconds(4096) == pytest.approx(4096 * 2 * 8.03e9 / 312e12, rel=1e-12)


# --- KV arithmetic and shapes ----------------------------------------------------------------


@pytest.mark.parametrize(("model", "kv_dtype", "bytes_per_token"), [
    ("Llama-3.1-8B", "bf16", 128 * 1024),
    ("Llama-3.1-8B", "fp8", 64 * 1024),
    ("Llama-3.1-70B", "bf16", 320 * 1024),
    ("Llama-3.1-70B", "fp8", 160 * 1024),
    ("Llama-3.1-405B", "bf16", 2 * 126 * 8 * 128 * 2),   # 504 KiB
    ("Qwen2.5-7B", "bf16", 2 * 28 * 4 * 128 * 2),        # 56 KiB
    ("Qwen2.5-72B", "bf16", 320 * 1024),
    ("Mixtral-8x7B", "bf16", 128 * 1024),
    ("DeepSeek-V3", "bf16", 61 * (512 + 64) * 2),        # MLA latent, once: 70,272 B
    ("DeepSeek-V3", "fp8", 61 * (512 + 64)),
    ("BLOOM-176B", "fp16", 2 * 70 * 112 * 128 * 2),      # MHA: 3.8 MiB
])
def test_kv_bytes_per_token(model: str, kv_dtype: str, bytes_per_token: int) -> None:
    assert lookup_model(model).kv_bytes_per_token(kv_dtype) == bytes_per_token


def test_seed_kv_per_request_and_ratio_independent_of_prompt_length() -> None:
    shape = lookup_model("llama-3.1-70b")
    assert shape.kv_bytes_per_token() * 8192 / 1e9 == pytest.approx(2.68, abs=0.005)
    prefill_tokens_per_s = 4 * 400e12 / (2 * 70e9)
    for link, ratio in ((100, 0.30), (200, 0.15), (400, 0.075)):
        assert transfer_to_prefill_ratio(shape, "bf16", link, prefill_tokens_per_s) == pytest.approx(ratio, abs=0.001)
    assert link_seconds(shape.kv_bytes_per_token() * 2048, 100) == pytest.approx(0.0537, abs=5e-4)


@pytest.mark.parametrize(("name", "expected"), [
    ("llama-3.1-8b", "Llama-3.1-8B"),
    ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "Llama-3.1-70B"),
    ("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-72B"),
    ("deepseek-ai/DeepSeek-V3", "DeepSeek-V3"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B"),
    ("llama2-70b", "Llama-2-70B"),
    ("bloom-176b", "BLOOM-176B"),
])
def test_model_lookup_accepts_hugging_face_ids(name: str, expected: str) -> None:
    assert lookup_model(name).name == expected


def test_unknown_model_and_gpu_say_what_is_known() -> None:
    with pytest.raises(KeyError, match=r"known: Llama-3\.1-8B"):
        lookup_model("gpt-5")
    with pytest.raises(KeyError, match="known: H100, H200"):
        lookup_gpu("B200")


@pytest.mark.parametrize(("gpu", "bf16", "fp8", "bandwidth", "memory"), [
    ("H100", 1979e12 / 2, 3958e12 / 2, 3.35e12, 80e9),   # datasheets print 2:4-sparsity rates
    ("H200", 1979e12 / 2, 3958e12 / 2, 4.8e12, 141e9),
    ("A100-80GB", 312e12, 312e12, 2.039e12, 80e9),       # no FP8 units: FP8 weights compute in BF16
    ("L40S", 362.05e12, 733e12, 864e9, 48e9),
    ("h100-80gb", 1979e12 / 2, 3958e12 / 2, 3.35e12, 80e9),  # splitwise's name
])
def test_gpu_figures(gpu: str, bf16: float, fp8: float, bandwidth: float, memory: float) -> None:
    spec = lookup_gpu(gpu)
    assert spec.flops("bf16") == pytest.approx(bf16, rel=1e-3)
    assert spec.flops("fp8") == pytest.approx(fp8, rel=1e-3)
    assert (spec.hbm_bytes_per_s, spec.memory_bytes) == (bandwidth, memory)
    assert spec.source.startswith("https://")


def test_every_known_shape_cites_its_source() -> None:
    assert all(shape.source.startswith("https://huggingface.co/") for shape in MODELS.values())
    assert len(GPUS) == 4


def test_piecewise_linear_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="at least two"):
        PiecewiseLinear((1.0,), (1.0,))
    with pytest.raises(ValueError, match="strictly increasing"):
        PiecewiseLinear((1.0, 1.0), (1.0, 2.0))
    falling = PiecewiseLinear((0.0, 1.0), (2.0, 1.0))
    assert falling(5.0) == 1.0  # the continuation above the table never falls


def test_bundled_profile_by_name_is_the_measured_one() -> None:
    from xpyd.perf.model import DEFAULT_PROFILE, profile_paths

    assert profile_paths("h200_llama31_8b_fp8_tp1") == profile_paths(DEFAULT_PROFILE)
    for bundled, data in zip(profile_paths(DEFAULT_PROFILE), profile_paths(PROFILE), strict=True):
        assert bundled.read_bytes() == data.read_bytes()  # the package's copy is data/'s
    missing = profile_paths("/nowhere/no_such_profile")
    assert missing[0] == Path("/nowhere/no_such_profile_prefill.csv")
