"""`xpyd plan`: what disaggregating a model costs and how to size it, before buying hardware.

From a model shape, a KV dtype, a performance model (a measured profile, splitwise rows or a GPU
roofline), a workload (ISL, OSL and rate, or a trace) and the SLOs, it computes:

- the KV arithmetic: bytes per token and per request, transfer time over the link and its ratio to
  the prefill time (the seed's table: the ratio is the same for every prompt length);
- both pools sized by the autoscaler's own model (`xpyd.autoscaler.sizing.PoolModel`, see
  `docs/autoscaling.md`): decode by the ITL frontier (the largest batch `b*` whose ITL at context
  `ISL + OSL/2` is under `TPOT target x itl_margin` and whose KV fits `kv_headroom` of the cache,
  then `D = ceil(rate · OSL · ITL(b*) / b*)`), prefill as an M/G/c queue of batching engines (Erlang C
  with the Allen-Cunneen tail) over the prompt-length distribution (a trace's, or a lognormal);
- the P:D ratio, both from those counts and from the steady-state formula
  `(decode_tput / prefill_tput) · (ISL / OSL)`;
- a verdict in the spirit of the seed's table: *skip* when prompts are short (one whole prompt's
  prefill stalls a colocated decode batch for no more than one TPOT target, so chunked prefill is
  enough) or the cluster is small (one replica per pool, under half busy: splitting strands
  capacity); *marginal* when the transfer costs more than 25% of the prefill (30% "is hard to hide");
  otherwise *disaggregate*.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from xpyd.autoscaler.sizing import DEFAULT_MAX_NUM_SEQS, PoolModel, PromptMix
from xpyd.common.args import positive_float, positive_int
from xpyd.perf.model import PerfModel, link_seconds
from xpyd.perf.shapes import DTYPE_BYTES, ModelShape, lookup_gpu, lookup_model
from xpyd.traces import read_trace

SHORT_PROMPT_TPOTS = 1.0
"""A prompt whose whole prefill takes at most this many TPOT targets is short."""
COSTLY_TRANSFER_RATIO = 0.25
CHEAP_TRANSFER_RATIO = 0.10
SMALL_POOL_BUSY = 0.5
"""Single-replica pools busier than this are not "too small to batch"."""
REFERENCE_LINKS_GBPS = (100.0, 200.0, 400.0, 800.0)


class PlanError(ValueError):
    """Inputs that cannot be planned; the message says why."""


@dataclass(frozen=True)
class Workload:
    """Mean prompt and output lengths, the request rate, and (from a trace) the prompt lengths."""

    isl: int
    osl: int
    rate_rps: float | None
    isl_samples: tuple[int, ...] = ()
    source: str = "flags"


@dataclass(frozen=True)
class PlanInputs:
    """Everything `plan()` needs; `run()` builds it from the command line."""

    shape: ModelShape
    kv_dtype: str
    prefill_model: PerfModel
    decode_model: PerfModel
    workload: Workload
    link_gbps: float
    slo_ttft_s: float
    slo_tpot_s: float
    percentile: float = 90.0
    itl_margin: float = 0.9
    kv_headroom: float = 0.9
    isl_cv2: float = 1.0
    """Squared coefficient of variation of prompt lengths when no trace gives them."""


@dataclass(frozen=True)
class PlanResult:
    """The plan; `to_json()` is the `--json` object."""

    inputs: PlanInputs
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    prefill_s: float
    transfer_s: float
    prefill_tokens_per_s: float
    decode_batch: int
    decode_limit: str
    """What bounds the decode batch: "ITL" (the TPOT target), "KV" (cache capacity) or "max_num_seqs"."""
    decode_itl_s: float
    decode_tokens_per_s: float
    tpot_feasible: bool
    pd_ratio_steady_state: float
    prefill_replicas: int | None = None
    decode_replicas: int | None = None
    prefill_utilisation: float | None = None
    ttft_at_percentile_s: float | None = None
    ttft_floor_s: float | None = None
    ttft_feasible: bool | None = None
    decode_batch_in_use: float | None = None
    verdict: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def transfer_to_prefill_ratio(self) -> float:
        return self.transfer_s / self.prefill_s

    @property
    def gpus(self) -> int | None:
        if self.prefill_replicas is None or self.decode_replicas is None:
            return None
        return (self.prefill_replicas * self.inputs.prefill_model.gpus
                + self.decode_replicas * self.inputs.decode_model.gpus)

    @property
    def pd_ratio(self) -> str | None:
        if self.prefill_replicas is None or self.decode_replicas is None:
            return None
        common = math.gcd(self.prefill_replicas, self.decode_replicas)
        return f"{self.prefill_replicas // common}:{self.decode_replicas // common}"

    def to_json(self) -> dict[str, Any]:
        """The machine-readable plan (DESIGN.md's `xpyd plan --json` keys first)."""
        inputs, workload = self.inputs, self.inputs.workload
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_request": self.kv_bytes_per_request,
            "transfer_ms": self.transfer_s * 1e3,
            "prefill_ms": self.prefill_s * 1e3,
            "transfer_to_prefill_ratio": self.transfer_to_prefill_ratio,
            "prefill_replicas": self.prefill_replicas,
            "decode_replicas": self.decode_replicas,
            "pd_ratio": self.pd_ratio,
            "pd_ratio_steady_state": self.pd_ratio_steady_state,
            "gpus": self.gpus,
            "verdict": self.verdict,
            "notes": list(self.notes),
            "model": inputs.shape.name,
            "kv_dtype": inputs.kv_dtype,
            "performance_model": {"prefill": inputs.prefill_model.description,
                                  "decode": inputs.decode_model.description,
                                  "prefill_gpus_per_replica": inputs.prefill_model.gpus,
                                  "decode_gpus_per_replica": inputs.decode_model.gpus,
                                  "decode_max_kv_tokens": inputs.decode_model.max_kv_tokens},
            "workload": {"isl": workload.isl, "osl": workload.osl, "rate_rps": workload.rate_rps,
                         "source": workload.source},
            "link_gbps": inputs.link_gbps,
            "slo": {"ttft_ms": inputs.slo_ttft_s * 1e3, "tpot_ms": inputs.slo_tpot_s * 1e3,
                    "percentile": inputs.percentile},
            "prefill_tokens_per_s_per_replica": self.prefill_tokens_per_s,
            "prefill_utilisation": self.prefill_utilisation,
            "ttft_ms_at_percentile": _ms(self.ttft_at_percentile_s),
            "ttft_floor_ms": _ms(self.ttft_floor_s),
            "ttft_slo_feasible": self.ttft_feasible,
            "decode_batch_per_replica": self.decode_batch,
            "decode_batch_limit": self.decode_limit,
            "decode_batch_in_use": self.decode_batch_in_use,
            "decode_itl_ms": self.decode_itl_s * 1e3,
            "decode_tokens_per_s_per_replica": self.decode_tokens_per_s,
            "tpot_slo_feasible": self.tpot_feasible,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# --- queueing ----------------------------------------------------------------------------------


# --- the plan ----------------------------------------------------------------------------------


def _pool(inputs: PlanInputs, perf: PerfModel) -> PoolModel:
    return PoolModel(perf, inputs.slo_ttft_s, inputs.slo_tpot_s, quantile=inputs.percentile / 100.0,
                     itl_margin=inputs.itl_margin, kv_headroom=inputs.kv_headroom)


def plan(inputs: PlanInputs) -> PlanResult:
    """The KV arithmetic, replica counts and verdict for `inputs` (pure). Both pools are sized by the
    autoscaler's own model (`xpyd.autoscaler.sizing.PoolModel`), so `xpyd plan` and `decide()` agree
    on the same inputs."""
    workload, prefill_model, decode_model = inputs.workload, inputs.prefill_model, inputs.decode_model
    kv_per_token = inputs.shape.kv_bytes_per_token(inputs.kv_dtype)
    prefill_pool = _pool(inputs, prefill_model.with_kv_transfer(kv_per_token, inputs.link_gbps))
    decode_pool = replace(_pool(inputs, decode_model), max_num_seqs=decode_model.max_num_seqs or DEFAULT_MAX_NUM_SEQS)
    prefill_s = prefill_model.prefill_seconds(workload.isl)
    transfer_s = link_seconds(kv_per_token * workload.isl, inputs.link_gbps)
    prefill_tput = prefill_pool.saturated_tokens_per_s()

    context = workload.isl + workload.osl / 2
    if decode_model.max_batch_for_kv(context, inputs.kv_headroom) < 1:
        raise PlanError(f"one request ({context:.0f} tokens of context) does not fit {inputs.kv_headroom:.0%} of a "
                        f"decode replica's KV cache ({decode_model.max_kv_tokens} tokens)")
    batch, itl, limit = decode_pool.decode_frontier(context)
    decode_tput = batch / itl
    result = PlanResult(
        inputs=inputs, kv_bytes_per_token=kv_per_token, kv_bytes_per_request=kv_per_token * workload.isl,
        prefill_s=prefill_s, transfer_s=transfer_s, prefill_tokens_per_s=prefill_tput, decode_batch=batch,
        decode_limit=limit, decode_itl_s=itl, decode_tokens_per_s=decode_tput,
        tpot_feasible=itl <= inputs.slo_tpot_s * inputs.itl_margin,
        pd_ratio_steady_state=(decode_tput / prefill_tput) * (workload.isl / workload.osl))

    if workload.rate_rps:
        mix = (PromptMix.from_samples(workload.isl_samples) if workload.isl_samples
               else PromptMix.from_quantiles(workload.isl, default_cs2=inputs.isl_cv2))
        prefill = prefill_pool.size_prefill(workload.rate_rps, mix, itl)
        decode = decode_pool.size_decode(workload.rate_rps, workload.isl, workload.osl)
        floor = prefill_pool.ttft_floor(mix, itl)
        result = replace(result, prefill_replicas=prefill.replicas, decode_replicas=decode.replicas,
                         prefill_utilisation=prefill.utilisation,
                         ttft_at_percentile_s=prefill_pool.ttft_quantile(prefill.replicas, workload.rate_rps, mix, itl),
                         ttft_floor_s=floor, ttft_feasible=floor <= inputs.slo_ttft_s,
                         decode_batch_in_use=decode.in_flight / decode.replicas)
    verdict, notes = judge(result)
    return replace(result, verdict=verdict, notes=tuple(notes))


def judge(result: PlanResult) -> tuple[str, list[str]]:
    """The verdict (disaggregate / marginal / skip) and the reasons, after the seed's table."""
    inputs = result.inputs
    ratio = result.transfer_to_prefill_ratio
    tpot = inputs.slo_tpot_s
    notes: list[str] = []
    short = result.prefill_s <= SHORT_PROMPT_TPOTS * tpot
    if short:
        notes.append(f"short prompts: a whole prompt prefills in {result.prefill_s * 1e3:.0f} ms, within one TPOT "
                     f"target ({tpot * 1e3:.0f} ms), so a colocated prefill barely stalls decode; chunked prefill "
                     "is enough")
    else:
        notes.append(f"a colocated prefill of one prompt stalls every decoding sequence for "
                     f"{result.prefill_s / tpot:.1f} TPOT targets; disaggregation removes that stall")
    small = (result.prefill_replicas == 1 and result.decode_replicas == 1
             and ((result.prefill_utilisation or 0.0) < SMALL_POOL_BUSY
                  or (result.decode_batch_in_use or 0.0) < SMALL_POOL_BUSY * result.decode_batch))
    if small:
        notes.append("small cluster: one replica per pool, under half busy; a split strands capacity that one "
                     "colocated pool would share")
    if ratio > COSTLY_TRANSFER_RATIO:
        notes.append(f"KV transfer adds {ratio:.0%} of the prefill time to TTFT: hard to hide; a faster link, "
                     "FP8 KV or layer-wise overlap would cut it")
    elif ratio <= CHEAP_TRANSFER_RATIO:
        notes.append(f"KV transfer is cheap: {ratio:.0%} of the prefill time")
    else:
        notes.append(f"KV transfer costs {ratio:.0%} of the prefill time: acceptable, less with layer-wise overlap")
    if inputs.link_gbps <= 100 and DTYPE_BYTES[inputs.kv_dtype] > 1:
        notes.append("100 Gb/s or slower without FP8 KV: FP8 KV halves both the bytes and the KV memory")
    if not result.tpot_feasible:
        notes.append(f"TPOT target {tpot * 1e3:.0f} ms is out of reach: one sequence alone decodes at "
                     f"{result.decode_itl_s * 1e3:.1f} ms per token (sized at batch 1)")
    if result.ttft_feasible is False:
        notes.append(f"TTFT target {inputs.slo_ttft_s * 1e3:.0f} ms is out of reach: an idle pool already takes "
                     f"{(result.ttft_floor_s or 0.0) * 1e3:.0f} ms at p{inputs.percentile:g} "
                     "(prefill sized for the prompts that can meet it)")
    if result.prefill_replicas is None:
        notes.append("no request rate (--rate or --trace): replica counts not computed")
    if short or small:
        return "skip", notes
    if ratio > COSTLY_TRANSFER_RATIO:
        return "marginal", notes
    return "disaggregate", notes


# --- workloads ---------------------------------------------------------------------------------


def read_workload(path: str | Path) -> Workload:
    """ISL/OSL means, the arrival rate and the prompt lengths of a trace (either format `traces`
    reads: CSV `TIMESTAMP,ContextTokens,GeneratedTokens` or Mooncake JSONL)."""
    requests = read_trace(path)
    span = requests[-1].arrival_s - requests[0].arrival_s
    return Workload(isl=round(statistics.fmean(r.isl for r in requests)),
                    osl=max(1, round(statistics.fmean(r.osl for r in requests))),
                    rate_rps=(len(requests) - 1) / span if span > 0 else None,
                    isl_samples=tuple(r.isl for r in requests), source=str(path))


# --- command line ------------------------------------------------------------------------------


def _count(text: str) -> float:
    """A parameter count: 70e9, 70B, 12.9b, 405000M."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}.get(text.strip()[-1:].lower())
    try:
        value = float(text.strip()[:-1]) * scale if scale else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 70e9 or 70B)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"parameter count must be positive: {text!r}")
    return value


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `xpyd plan` on `subparsers`."""
    dtypes = sorted(DTYPE_BYTES)
    parser = subparsers.add_parser(
        "plan", help="P:D ratio, replica counts and KV-transfer cost for a model, hardware and workload",
        description="Size a prefill/decode-disaggregated deployment and say whether disaggregation pays.")
    model = parser.add_argument_group("model (a known name, explicit shape flags, or both: flags override)")
    model.add_argument("--model", help="known model (Llama-3.1-8B/70B/405B, Qwen2.5-7B/72B, DeepSeek-V3, "
                       "Mixtral-8x7B, Llama-2-70B, BLOOM-176B) or its Hugging Face id")
    model.add_argument("--layers", type=positive_int, help="transformer layers")
    model.add_argument("--kv-heads", type=positive_int, help="KV heads (GQA groups)")
    model.add_argument("--head-dim", type=positive_int, help="dimension of one attention head")
    model.add_argument("--params", type=_count, help="total parameters (70e9 or 70B)")
    model.add_argument("--active-params", type=_count, help="parameters per token (MoE; default --params)")
    model.add_argument("--kv-dtype", choices=dtypes, default="bf16", help="KV-cache dtype (default bf16)")
    model.add_argument("--weight-dtype", choices=dtypes, default="bf16", help="weight dtype for the roofline "
                       "(default bf16)")
    hardware = parser.add_argument_group("hardware (one of --profile, --gpu, --splitwise)")
    source = hardware.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", metavar="PREFIX", help="measured profile PREFIX_prefill.csv/PREFIX_decode.csv")
    source.add_argument("--gpu", help="roofline from datasheet figures: H100, H200, A100-80GB, L40S")
    source.add_argument("--splitwise", metavar="CSV", help="splitwise_perf_model.csv rows for --model, "
                        "--splitwise-hardware and --tp")
    hardware.add_argument("--splitwise-hardware", help="hardware column for --splitwise (a100-80gb, h100-80gb, ...)")
    hardware.add_argument("--tp", type=positive_int, default=1, help="GPUs per replica (tensor parallel; "
                          "default 1; a profile's own TP)")
    hardware.add_argument("--prefill-gpus", type=positive_int, help="GPUs per prefill replica with --gpu "
                          "(default --tp)")
    hardware.add_argument("--tflops", type=positive_float, help="effective dense TFLOP/s per GPU with --gpu "
                          "(replaces --mfu x datasheet)")
    hardware.add_argument("--mfu", type=positive_float, default=0.5, help="share of datasheet FLOP/s reached "
                          "with --gpu (default 0.5)")
    hardware.add_argument("--mbu", type=positive_float, default=0.7, help="share of datasheet HBM bandwidth "
                          "reached with --gpu (default 0.7)")
    hardware.add_argument("--max-kv-tokens", type=positive_int, help="KV capacity of one replica (default: the "
                          "profile's 945029, or what the memory leaves)")
    hardware.add_argument("--link-gbps", type=positive_float, default=100.0, help="prefill-to-decode link "
                          "bandwidth in Gb/s (default 100)")
    workload = parser.add_argument_group("workload (--isl/--osl/--rate, or a --trace; flags override the trace)")
    workload.add_argument("--isl", type=positive_int, help="prompt tokens per request")
    workload.add_argument("--osl", type=positive_int, help="output tokens per request")
    workload.add_argument("--rate", type=positive_float, help="requests per second")
    workload.add_argument("--trace", help="CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake JSONL")
    workload.add_argument("--isl-cv2", type=float, default=1.0, help="squared coefficient of variation of "
                          "prompt lengths without a trace (default 1)")
    slo = parser.add_argument_group("SLOs")
    slo.add_argument("--slo-ttft-ms", type=positive_float, default=500.0, help="TTFT target (default 500)")
    slo.add_argument("--slo-tpot-ms", type=positive_float, default=50.0, help="TPOT target (default 50)")
    slo.add_argument("--slo-percentile", type=positive_float, default=90.0, help="TTFT percentile (default 90)")
    slo.add_argument("--itl-margin", type=positive_float, default=0.9, help="decode ITL budget as a share of the "
                     "TPOT target (default 0.9)")
    slo.add_argument("--kv-headroom", type=positive_float, default=0.9, help="share of the KV cache decode may "
                     "fill (default 0.9)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


def _shape(args: argparse.Namespace) -> ModelShape:
    base = lookup_model(args.model) if args.model else None
    overrides = {key: value for key, value in (("layers", args.layers), ("kv_heads", args.kv_heads),
                                               ("head_dim", args.head_dim), ("params", args.params),
                                               ("active_params", args.active_params)) if value is not None}
    if base is None:
        missing = [flag for flag, key in (("--layers", "layers"), ("--kv-heads", "kv_heads"),
                                          ("--head-dim", "head_dim"), ("--params", "params")) if key not in overrides]
        if missing:
            raise PlanError(f"give --model or the shape ({', '.join(missing)} missing)")
        return ModelShape(name="custom", **overrides)
    if overrides.keys() & {"layers", "kv_heads", "head_dim"} and base.is_mla:
        raise PlanError(f"{base.name} uses MLA: its KV size comes from the latent, not --layers/--kv-heads/--head-dim")
    return replace(base, **overrides) if overrides else base


def _models(args: argparse.Namespace, shape: ModelShape) -> tuple[PerfModel, PerfModel]:
    if args.profile:
        model = PerfModel.from_profile(args.profile, gpus=args.tp, **(
            {"max_kv_tokens": args.max_kv_tokens} if args.max_kv_tokens else {}))
        return model, model
    if args.splitwise:
        if not args.splitwise_hardware or not args.model:
            raise PlanError("--splitwise needs --model (e.g. llama2-70b) and --splitwise-hardware (e.g. a100-80gb)")
        model = PerfModel.from_splitwise(args.splitwise, args.model, args.splitwise_hardware, args.tp,
                                         max_kv_tokens=args.max_kv_tokens)
        return model, model
    gpu = lookup_gpu(args.gpu)
    common = {"weight_dtype": args.weight_dtype, "kv_dtype": args.kv_dtype, "mfu": args.mfu, "mbu": args.mbu,
              "effective_tflops": args.tflops}
    decode = PerfModel.roofline(shape, gpu, args.tp, max_kv_tokens=args.max_kv_tokens, **common)
    prefill_gpus = args.prefill_gpus or args.tp
    prefill = decode if prefill_gpus == args.tp else PerfModel.roofline(shape, gpu, prefill_gpus, **common)
    return prefill, decode


def _workload(args: argparse.Namespace) -> Workload:
    traced = read_workload(args.trace) if args.trace else None
    isl = args.isl or (traced.isl if traced else None)
    osl = args.osl or (traced.osl if traced else None)
    if isl is None or osl is None:
        raise PlanError("give --isl and --osl, or a --trace")
    rate = args.rate or (traced.rate_rps if traced else None)
    if traced and not args.isl:  # the trace's prompt lengths describe the tail only when ISL is the trace's
        return replace(traced, osl=osl, rate_rps=rate)
    return Workload(isl=isl, osl=osl, rate_rps=rate, source=traced.source if traced else "flags")


def build_inputs(args: argparse.Namespace) -> PlanInputs:
    """`PlanInputs` from parsed `xpyd plan` arguments (reads the profile/trace files)."""
    if args.prefill_gpus and not args.gpu:
        raise PlanError("--prefill-gpus applies to --gpu (a profile or splitwise rows fix the prefill replica)")
    if args.splitwise_hardware and not args.splitwise:
        raise PlanError("--splitwise-hardware applies to --splitwise")
    if not 0 < args.slo_percentile < 100:
        raise PlanError("--slo-percentile must be between 0 and 100")
    if args.isl_cv2 < 0:
        raise PlanError("--isl-cv2 must not be negative")
    shape = _shape(args)
    prefill_model, decode_model = _models(args, shape)
    return PlanInputs(shape=shape, kv_dtype=args.kv_dtype, prefill_model=prefill_model, decode_model=decode_model,
                      workload=_workload(args), link_gbps=args.link_gbps, slo_ttft_s=args.slo_ttft_ms / 1e3,
                      slo_tpot_s=args.slo_tpot_ms / 1e3, percentile=args.slo_percentile, itl_margin=args.itl_margin,
                      kv_headroom=args.kv_headroom, isl_cv2=args.isl_cv2)


def _bytes(value: float) -> str:
    return f"{value / 1024:.1f} KiB" if value < 1024**2 else f"{value / 1e9:.2f} GB"


def render_table(result: PlanResult) -> str:
    """The human-readable plan."""
    inputs, workload = result.inputs, result.inputs.workload
    rate = f"{workload.rate_rps:.2f} req/s" if workload.rate_rps else "no rate"
    others = ", ".join(f"{gbps:g} Gb/s {link_seconds(result.kv_bytes_per_request, gbps) * 1e3:.0f} ms"
                       for gbps in REFERENCE_LINKS_GBPS if gbps != inputs.link_gbps)
    rows = [
        ("model", f"{inputs.shape.name}, KV {inputs.kv_dtype}"),
        ("hardware", f"prefill: {inputs.prefill_model.description}; decode: {inputs.decode_model.description}"),
        ("workload", f"ISL {workload.isl}, OSL {workload.osl}, {rate} ({workload.source})"),
        ("KV cache", f"{_bytes(result.kv_bytes_per_token)}/token, {_bytes(result.kv_bytes_per_request)}/request"),
        ("prefill", f"{result.prefill_s * 1e3:.0f} ms/request, "
                    f"{result.prefill_tokens_per_s:,.0f} tokens/s per replica"),
        ("KV transfer", f"{result.transfer_s * 1e3:.0f} ms at {inputs.link_gbps:g} Gb/s = "
                        f"{result.transfer_to_prefill_ratio:.0%} of prefill ({others})"),
        ("decode", f"batch {result.decode_batch} ({result.decode_limit}-bound) at ITL {result.decode_itl_s * 1e3:.1f} "
                   f"ms (TPOT target {inputs.slo_tpot_s * 1e3:.0f} ms): {result.decode_tokens_per_s:,.0f} tokens/s "
                   "per replica"),
    ]
    if result.prefill_replicas is not None and result.decode_replicas is not None:
        rows += [
            ("prefill pool", f"{result.prefill_replicas} replica(s), {result.prefill_utilisation:.0%} busy, TTFT "
                             f"p{inputs.percentile:g} {(result.ttft_at_percentile_s or 0.0) * 1e3:.0f} ms "
                             f"(target {inputs.slo_ttft_s * 1e3:.0f})"),
            ("decode pool", f"{result.decode_replicas} replica(s), {result.decode_batch_in_use:.1f} sequences each"),
            ("P:D", f"{result.pd_ratio} ({result.gpus} GPUs); steady-state formula "
                    f"{result.pd_ratio_steady_state:.2f} P per D"),
        ]
    else:
        rows.append(("P:D", f"steady-state formula {result.pd_ratio_steady_state:.2f} P per D"))
    rows.append(("verdict", result.verdict.upper()))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines += [f"{'':<{width}}  - {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """`xpyd plan`: print the plan (a table, or JSON with --json); 2 on bad input, 1 on unreadable files."""
    try:
        result = plan(build_inputs(args))
    except (PlanError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        sys.stderr.write(f"xpyd plan: {message}\n")
        return 2
    except (OSError, ValueError) as error:
        sys.stderr.write(f"xpyd plan: {error}\n")
        return 1
    sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n" if args.json else render_table(result))
    return 0
