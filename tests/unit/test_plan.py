"""`xpyd plan`: the seed's worked table, the --json contract, the queueing sizing, the verdicts and
the errors, through the command's own parser."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.paths import H200_PROFILE, SPLITWISE
from xpyd import plan as plan_module
from xpyd.autoscaler.sizing import PoolModel, PromptMix
from xpyd.perf.model import PerfModel
from xpyd.perf.queueing import erlang_c

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROFILE = H200_PROFILE
REQUIRED_KEYS = {"kv_bytes_per_token", "kv_bytes_per_request", "transfer_ms", "prefill_ms",
                 "transfer_to_prefill_ratio", "prefill_replicas", "decode_replicas"}
# The seed's assumptions: a 70B dense model (70e9 parameters), 4 GPUs prefill at 400 TFLOPS effective.
SEED = ["--model", "llama-3.1-70b", "--params", "70e9", "--gpu", "H100", "--tp", "4", "--prefill-gpus", "4",
        "--tflops", "400", "--osl", "128"]


def xpyd_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="xpyd")
    plan_module.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code: int = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = xpyd_plan(capsys, *argv, "--json")
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


# The seed's table (kv-transfer-cost-arithmetic.md): prompt, KV GB, prefill ms, then per link
# (100/200/400 Gb/s) transfer ms and its share of the prefill time.
SEED_TABLE = [
    (2048, 0.67, 179, {100: (54, 30), 200: (27, 15), 400: (13, 7)}),
    (8192, 2.68, 717, {100: (215, 30), 200: (107, 15), 400: (54, 7)}),
    (32768, 10.74, 2867, {100: (859, 30), 200: (429, 15), 400: (215, 7)}),
]


@pytest.mark.parametrize(("isl", "kv_gb", "prefill_ms", "link", "transfer_ms", "percent"), [
    (isl, kv_gb, prefill_ms, link, transfer_ms, percent)
    for isl, kv_gb, prefill_ms, links in SEED_TABLE for link, (transfer_ms, percent) in links.items()
])
def test_plan_reproduces_the_seed_table(capsys: pytest.CaptureFixture[str], isl: int, kv_gb: float,
                                        prefill_ms: int, link: int, transfer_ms: int, percent: int) -> None:
    result = plan_json(capsys, *SEED, "--isl", str(isl), "--link-gbps", str(link))
    assert result["kv_bytes_per_token"] == 320 * 1024
    assert result["kv_bytes_per_request"] == 320 * 1024 * isl
    assert round(result["kv_bytes_per_request"] / 1e9, 2) == kv_gb
    assert round(result["prefill_ms"]) == prefill_ms
    assert round(result["transfer_ms"]) == transfer_ms
    assert round(result["transfer_to_prefill_ratio"] * 100) == percent


def test_seed_with_the_real_parameter_count_is_within_one_percent(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [arg for arg in SEED if arg not in ("--params", "70e9")]
    result = plan_json(capsys, *argv, "--isl", "8192")
    assert result["prefill_ms"] == pytest.approx(717, rel=0.01)  # Llama-3.1-70B has 70.6e9 parameters


def test_ratio_does_not_depend_on_prompt_length(capsys: pytest.CaptureFixture[str]) -> None:
    ratios = {plan_json(capsys, *SEED, "--isl", str(isl))["transfer_to_prefill_ratio"] for isl in (512, 4096, 65536)}
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)


def test_fp8_kv_halves_the_transfer(capsys: pytest.CaptureFixture[str]) -> None:
    bf16 = plan_json(capsys, *SEED, "--isl", "8192")
    fp8 = plan_json(capsys, *SEED, "--isl", "8192", "--kv-dtype", "fp8")
    assert fp8["kv_bytes_per_token"] == 160 * 1024
    assert fp8["transfer_ms"] == pytest.approx(bf16["transfer_ms"] / 2, rel=1e-12)


def test_json_has_the_contract_keys_with_and_without_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    without = plan_json(capsys, *SEED, "--isl", "8192")
    assert without.keys() >= REQUIRED_KEYS
    assert without["prefill_replicas"] is None and without["decode_replicas"] is None
    assert without["pd_ratio_steady_state"] > 0
    with_rate = plan_json(capsys, *SEED, "--isl", "8192", "--rate", "2", "--slo-ttft-ms", "3000")
    assert isinstance(with_rate["prefill_replicas"], int) and with_rate["prefill_replicas"] >= 1
    assert isinstance(with_rate["decode_replicas"], int) and with_rate["decode_replicas"] >= 1
    assert with_rate["gpus"] == 4 * (with_rate["prefill_replicas"] + with_rate["decode_replicas"])


def test_human_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = xpyd_plan(capsys, *SEED, "--isl", "8192", "--rate", "2", "--slo-ttft-ms", "3000")
    assert code == 0 and not err
    assert "KV cache      320.0 KiB/token, 2.68 GB/request" in out
    assert "215 ms at 100 Gb/s = 30% of prefill (200 Gb/s 107 ms, 400 Gb/s 54 ms, 800 Gb/s 27 ms)" in out
    assert "verdict       MARGINAL" in out


def test_profile_plan_sizes_both_pools_from_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--kv-dtype", "fp8", "--profile", str(PROFILE),
            "--isl", "4168", "--osl", "200", "--rate", "20", "--link-gbps", "400", "--slo-ttft-ms", "1000"]
    result = plan_json(capsys, *argv)
    model = PerfModel.from_profile(PROFILE)
    assert result["kv_bytes_per_token"] == 64 * 1024
    assert result["prefill_ms"] == pytest.approx(87.342, rel=1e-12)  # a measured point
    assert result["transfer_ms"] == pytest.approx(4168 * 65536 / 50e9 * 1e3, rel=1e-12)
    context = 4168 + 100
    batch = model.max_batch_for_itl(0.050 * 0.9, context, kv_headroom=0.9)
    assert result["decode_batch_per_replica"] == batch
    itl = model.itl_seconds(batch, context)
    assert result["decode_itl_ms"] == pytest.approx(itl * 1e3, rel=1e-12)
    assert result["decode_replicas"] == math.ceil(20 * 200 * itl / batch)
    assert result["prefill_utilisation"] < 1 and result["ttft_ms_at_percentile"] <= 1000
    assert result["pd_ratio_steady_state"] == pytest.approx(
        (batch / itl) / (8192 / model.prefill_seconds(8192)) * 4168 / 200, rel=1e-12)


def test_splitwise_plan(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "llama2-70b", "--splitwise", str(SPLITWISE), "--splitwise-hardware",
                       "a100-80gb", "--tp", "4", "--isl", "2048", "--osl", "128", "--rate", "1",
                       "--slo-ttft-ms", "2000", "--slo-tpot-ms", "60")
    assert result["prefill_ms"] == pytest.approx(427.4, abs=0.1)
    assert result["performance_model"]["decode"] == "splitwise llama2-70b a100-80gb TP4"
    # ITL budget 0.9 x 60 = 54 ms; 52.35 ms at batch 32, 72.95 ms at 64, linear between: 32 + 1.65 / 20.6 x 32
    assert result["decode_batch_per_replica"] == 34


def test_mla_plan(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--gpu", "H200", "--tp", "8",
                       "--weight-dtype", "fp8", "--isl", "8192", "--osl", "512")
    assert result["kv_bytes_per_token"] == 61 * 576 * 2


@pytest.mark.parametrize(("trace", "text"), [
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.0000000,100,10\n2023-11-16 18:15:47.0000000,300,30\n"
              "2023-11-16 18:15:48.0000000,200,20\n2023-11-16 18:15:50.0000000,400,40\n"),
    ("t.jsonl", '{"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [0]}\n'
                '{"timestamp": 1000, "input_length": 300, "output_length": 30, "hash_ids": [1]}\n'
                '{"timestamp": 2000, "input_length": 200, "output_length": 20, "hash_ids": [2]}\n'
                '{"timestamp": 4000, "input_length": 400, "output_length": 40, "hash_ids": [3]}\n'),
])
def test_trace_gives_means_and_rate(capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: str,
                                    text: str) -> None:
    (tmp_path / trace).write_text(text)
    result = plan_json(capsys, "--model", "llama-3.1-8b", "--profile", str(PROFILE), "--trace", str(tmp_path / trace))
    assert result["workload"] == {"isl": 250, "osl": 25, "rate_rps": 0.75, "source": str(tmp_path / trace)}
    assert result["prefill_replicas"] >= 1
    overridden = plan_json(capsys, "--model", "llama-3.1-8b", "--profile", str(PROFILE), "--trace",
                           str(tmp_path / trace), "--rate", "9", "--osl", "64")
    assert (overridden["workload"]["rate_rps"], overridden["workload"]["osl"]) == (9, 64)


# --- sizing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("servers", "load", "expected"), [
    (1, 0.5, 0.5),        # M/M/1: an arrival waits with probability rho
    (2, 1.0, 1 / 3),
    (3, 2.0, 4 / 9),
    (4, 0.0, 0.0),
    (2, 2.0, 1.0),        # saturated
])
def test_erlang_c(servers: int, load: float, expected: float) -> None:
    assert erlang_c(servers, load) == pytest.approx(expected, rel=1e-12)


POOL = PoolModel(PerfModel.from_profile(H200_PROFILE), ttft_target_s=0.6, tpot_target_s=0.05)
MIX = PromptMix.from_quantiles(2000.0)


def test_prefill_sizing_grows_with_load_and_percentile() -> None:
    def replicas(rate: float, quantile: float = 0.9) -> int:
        return replace(POOL, quantile=quantile).size_prefill(rate, MIX, 0.01).replicas

    rates = (0.5, 5, 20, 50, 100, 200)
    counts = [replicas(rate) for rate in rates]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] > 1
    assert replicas(100, 0.99) >= replicas(100, 0.9) >= replicas(100, 0.5)
    # Unlike a fixed utilisation target, the pool runs busier as it grows (docs/autoscaling.md).
    busy = [POOL.size_prefill(rate, MIX, 0.01).utilisation for rate in (20, 100, 200)]
    assert busy == sorted(busy)


@pytest.mark.parametrize("rate", [5.0, 50.0, 150.0])
def test_prefill_sizing_meets_the_target_it_reports(rate: float) -> None:
    sizing = POOL.size_prefill(rate, MIX, 0.01)
    assert sizing.feasible_share == 1.0  # every prompt can meet 600 ms: the TTFT quantile is the SLO's
    assert POOL.ttft_quantile(sizing.replicas, rate, MIX, 0.01) <= POOL.ttft_target_s
    fewer = sizing.replicas - 1
    assert fewer == 0 or POOL.ttft_quantile(fewer, rate, MIX, 0.01) > POOL.ttft_target_s \
        or rate * POOL.service_seconds(MIX.mean) / fewer > POOL.max_utilisation


def test_unreachable_ttft_sizes_for_load_only() -> None:
    pool = replace(POOL, ttft_target_s=0.001)   # below any prompt's own prefill
    sizing = pool.size_prefill(20.0, MIX, 0.01)
    assert sizing.feasible_share == 0.0 and pool.ttft_floor(MIX, 0.01) > pool.ttft_target_s
    offered = 20.0 * sum(pool.service_seconds(x) for x in MIX.isl_tokens) / len(MIX.isl_tokens)
    assert sizing.replicas == max(1, math.ceil(offered / pool.max_utilisation - 1e-9))


def test_plan_sizes_prefill_as_the_autoscaler_does(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "meta-llama/Llama-3.1-8B-Instruct", "--kv-dtype", "fp8", "--profile",
                       str(PROFILE), "--isl", "2000", "--osl", "200", "--rate", "50", "--link-gbps", "400",
                       "--slo-ttft-ms", "600", "--slo-tpot-ms", "50")
    perf = PerfModel.from_profile(PROFILE).with_kv_transfer(64 * 1024, 400.0)
    assert perf.max_num_seqs is not None   # the profile's own cap (the engine it was measured on)
    pool = PoolModel(perf, 0.6, 0.05, max_num_seqs=perf.max_num_seqs)
    batch, itl, _ = pool.decode_frontier(2100)
    assert result["prefill_replicas"] == pool.size_prefill(50.0, MIX, itl).replicas
    assert result["decode_replicas"] == pool.size_decode(50.0, 2000, 200).replicas
    assert result["decode_batch_per_replica"] == batch


# --- verdicts --------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "verdict", "note"), [
    (["--isl", "8192", "--link-gbps", "100"], "marginal", "hard to hide"),
    (["--isl", "8192", "--link-gbps", "400"], "disaggregate", "KV transfer is cheap"),
    (["--isl", "8192", "--link-gbps", "200"], "disaggregate", "acceptable"),
    (["--isl", "128", "--link-gbps", "400"], "skip", "short prompts"),
    (["--isl", "8192", "--link-gbps", "400", "--rate", "0.05", "--slo-ttft-ms", "3000"], "skip", "small cluster"),
    (["--isl", "8192", "--link-gbps", "400", "--rate", "20", "--slo-ttft-ms", "3000"], "disaggregate",
     "stalls every decoding sequence"),
])
def test_verdicts(capsys: pytest.CaptureFixture[str], argv: list[str], verdict: str, note: str) -> None:
    result = plan_json(capsys, *SEED, *argv)
    assert result["verdict"] == verdict
    assert any(note in line for line in result["notes"]), result["notes"]


def test_unreachable_slos_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, *SEED, "--isl", "32768", "--rate", "1", "--slo-tpot-ms", "5")
    assert result["ttft_slo_feasible"] is False and result["tpot_slo_feasible"] is False
    assert result["decode_batch_per_replica"] == 1
    assert any("TTFT target 500 ms is out of reach" in note for note in result["notes"])
    assert any("TPOT target 5 ms is out of reach" in note for note in result["notes"])


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["--model", "gpt-5", "--gpu", "H100", "--isl", "1", "--osl", "1"], 2, "unknown model 'gpt-5'"),
    (["--gpu", "H100", "--isl", "1", "--osl", "1"], 2, "give --model or the shape (--layers, --kv-heads"),
    (["--model", "llama-3.1-8b", "--gpu", "B200", "--isl", "1", "--osl", "1"], 2, "unknown GPU 'B200'"),
    (["--model", "llama-3.1-8b", "--gpu", "H100", "--osl", "1"], 2, "give --isl and --osl, or a --trace"),
    (["--model", "llama-3.1-8b", "--profile", str(PROFILE), "--prefill-gpus", "2", "--isl", "1", "--osl", "1"], 2,
     "--prefill-gpus applies to --gpu"),
    (["--model", "llama-3.1-8b", "--profile", "/nonexistent/p", "--isl", "1", "--osl", "1"], 1,
     "/nonexistent/p_prefill.csv"),
    (["--model", "llama-3.1-405b", "--gpu", "H100", "--isl", "1", "--osl", "1"], 1, "leave no KV space"),
    (["--model", "llama-3.1-8b", "--gpu", "H100", "--trace", "/nonexistent.csv"], 1, "/nonexistent.csv"),
])
def test_bad_input_exits_with_a_message(capsys: pytest.CaptureFixture[str], argv: list[str], code: int,
                                        message: str) -> None:
    result, out, err = xpyd_plan(capsys, *argv)
    assert (result, out) == (code, "")
    assert err.startswith("xpyd plan: ") and message in err


def test_explicit_shape_without_a_known_model(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--params", "8B",
                       "--gpu", "H100", "--isl", "1000", "--osl", "100")
    assert result["kv_bytes_per_token"] == 128 * 1024 and result["model"] == "custom"


def test_argument_errors_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--model", "llama-3.1-8b", "--isl", "1", "--osl", "1"],  # no hardware
                 ["--model", "llama-3.1-8b", "--gpu", "H100", "--isl", "-5", "--osl", "1"],
                 ["--model", "x", "--gpu", "H100", "--params", "lots", "--isl", "1", "--osl", "1"]):
        with pytest.raises(SystemExit) as exit_info:
            xpyd_plan(capsys, *argv)
        assert exit_info.value.code == 2
