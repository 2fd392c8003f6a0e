"""The `xpyd sim` report: SLO attainment, goodput, GPU-hours, latency percentiles, history, and a plot.

Definitions (DESIGN.md's keys):
- `attainment`: share of the trace's requests meeting both the TTFT and the TPOT target (0-1);
  requests that never fit an engine count as missing both.
- `duration_s`: simulated time from the window's start to the last request's finish.
- `goodput_rps`: requests meeting both targets per second of `duration_s`.
- `gpu_hours`: GPU time of every replica from its start (model loading included) to its drain or
  the end, in hours; `goodput_per_gpu_hour`: good requests per GPU-hour (the headline: it rewards
  meeting the SLOs and punishes over-provisioning at once).
- Percentiles (`p50`, `p90`, `p99`) interpolate linearly between order statistics, in milliseconds.
- `prefix_cache`, per role: `hit_rate`, the share of the prompt tokens its engines looked up that
  they found in their prefix caches (vLLM's `prefix_cache_hits / prefix_cache_queries`; hits are
  whole blocks, so this is the block hit rate in tokens); `prompt_tokens` (requested), `cached_tokens`,
  `computed_tokens` (prefilled there) and `transferred_tokens` (loaded from the prefill engine: the
  rest; 0 on prefill). The timeline has each role's hit rate per bin, by arrival.
- `busy_gpu_hours_by_role`: GPU time of the engines' steps, the part of `gpu_hours_by_role` at work.
- `held` (a pool that scales to zero): the requests that arrived with no ready prefill and decode
  pair and waited in the proxy's waiting room (`requests`), those dropped from it (`overflow`,
  `expired`), their attainment and their TTFT.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from xpyd.api.naming import ROLES
from xpyd.common.stats import finite, percentile, summary_ms
from xpyd.plotting import ROLE_COLORS, LatencyPanel, Series, TimelinePlot, write_timeline_plot
from xpyd.sim.simulator import SimResult

_NICE_BINS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)


def timeline_bin_s(duration_s: float, bins: int = 90) -> int:
    """A round bin width giving about `bins` bins over `duration_s`."""
    return next((width for width in _NICE_BINS_S if width * bins >= duration_s), _NICE_BINS_S[-1])


def timeline(result: SimResult) -> dict[str, Any]:
    """Per time bin, by arrival: arrivals/s, SLO-meeting arrivals/s, TTFT and TPOT percentiles (ms)."""
    width = timeline_bin_s(max(result.arrival_s[-1], 1.0))
    count = int(result.arrival_s[-1] // width) + 1
    slo = result.config.slo
    ttft: list[list[float]] = [[] for _ in range(count)]
    tpot: list[list[float]] = [[] for _ in range(count)]
    arrivals = [0] * count
    good = [0] * count
    _, met = result.meets(slo)
    for arrival, first, per_token, ok in zip(result.arrival_s, result.ttft_s, result.tpot_s(), met, strict=True):
        index = int(arrival // width)
        arrivals[index] += 1
        good[index] += ok
        if not math.isnan(first):
            ttft[index].append(first * 1000.0)
            tpot[index].append(per_token * 1000.0)
    out: dict[str, Any] = {"bin_s": width, "t_s": [i * width for i in range(count)],
                           "arrivals_rps": [n / width for n in arrivals], "good_rps": [n / width for n in good]}
    for role in ROLES:
        asked = [0] * count
        found = [0] * count
        for arrival, isl, cached in zip(result.arrival_s, result.isl, result.cached_tokens[role], strict=True):
            if cached >= 0:
                index = int(arrival // width)
                asked[index] += isl
                found[index] += cached
        out[f"{role}_hit_rate"] = [round(f / a, 6) if a else None for f, a in zip(found, asked, strict=True)]
    for name, series in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            out[f"{name}_{label}"] = [finite(percentile(sorted(values), q), 3) for values in series]
    return out


def prefix_cache(result: SimResult) -> dict[str, dict[str, float]]:
    """Per role: the hit rate and the prompt tokens requested, found cached, computed and transferred
    (requests whose leg ran on the role)."""
    out: dict[str, dict[str, float]] = {}
    for role in ROLES:
        requested = cached = computed = 0
        for isl, found, done in zip(result.isl, result.cached_tokens[role], result.computed_tokens[role],
                                    strict=True):
            if found >= 0:
                requested += isl
                cached += found
                computed += done
        out[role] = {"hit_rate": round(cached / requested, 6) if requested else 0.0, "prompt_tokens": requested,
                     "cached_tokens": cached, "computed_tokens": computed,
                     "transferred_tokens": requested - cached - computed}
    return out


def build_report(result: SimResult, trace_name: str = "", speedup: float = 1.0, rate_scale: int = 1) -> dict[str, Any]:
    """The report as a JSON-ready dict (DESIGN.md's keys first)."""
    slo = result.config.slo
    tpot = result.tpot_s()
    requests = len(result.arrival_s)
    meets_ttft, met = result.meets(slo)
    meets_tpot = [t <= slo.tpot_s for t in tpot]
    good = sum(met)
    duration_s = result.end_s
    gpu_hours = sum(result.gpu_seconds.values()) / 3600.0
    config = result.config
    return {
        "requests": requests,
        "attainment": round(good / requests, 6),
        "goodput_rps": round(good / duration_s, 6) if duration_s > 0 else None,
        "gpu_hours": round(gpu_hours, 6),
        "goodput_per_gpu_hour": round(good / gpu_hours, 3) if gpu_hours > 0 else None,
        "ttft_ms": summary_ms(result.ttft_s),
        "tpot_ms": summary_ms(tpot),
        "scaling_actions": result.scaling_actions,
        "e2e_ms": summary_ms(result.e2e_s),
        "good_requests": good,
        "attainment_ttft": round(sum(meets_ttft) / requests, 6),
        "attainment_tpot": round(sum(meets_tpot) / requests, 6),
        "rejected": result.rejected,
        "duration_s": round(duration_s, 3),
        "gpu_hours_by_role": {role: round(seconds / 3600.0, 6) for role, seconds in result.gpu_seconds.items()},
        "busy_gpu_hours_by_role": {role: round(seconds / 3600.0, 6) for role, seconds in result.busy_seconds.items()},
        "prefix_cache": prefix_cache(result),
        "replicas_started": result.replicas_started,
        "replicas_stopped": result.replicas_stopped,
        "trace": trace_name,
        "speedup": speedup,
        "rate_scale": rate_scale,
        "policy": result.policy,
        "config": {
            "prefill": config.prefill, "decode": config.decode,
            "slo_ttft_ms": slo.ttft_s * 1000.0, "slo_tpot_ms": slo.tpot_s * 1000.0,
            "startup_delay_s": config.startup_delay_s, "interval_s": config.interval_s,
            "window_s": config.window_s, "seed": config.seed, "gpus_per_replica": config.gpus_per_replica,
            "max_num_batched_tokens": config.engine.max_num_batched_tokens,
            "max_num_seqs": config.engine.max_num_seqs,
            "enable_prefix_caching": config.engine.enable_prefix_caching, "block_size": config.engine.block_size,
        },
        "replicas": [{"t_s": round(s.time_s, 3), "prefill": s.prefill_ready, "decode": s.decode_ready,
                      "prefill_starting": s.prefill_starting, "decode_starting": s.decode_starting,
                      "prefill_draining": s.prefill_draining, "decode_draining": s.decode_draining}
                     for s in result.replicas],
        "decisions": [{"t_s": round(d.time_s, 3), "prefill_before": d.prefill_before,
                       "decode_before": d.decode_before, "prefill": d.prefill, "decode": d.decode}
                      for d in result.decisions],
        "timeline": timeline(result),
        **({"held": held(result)} if any(result.held) else {}),
    }


def held(result: SimResult) -> dict[str, Any]:
    """The requests that arrived at a pool without a ready pair (at zero, or starting from it)."""
    _, met = result.meets(result.config.slo)
    indexes = [i for i, was in enumerate(result.held) if was]
    return {"requests": len(indexes), "overflow": result.dropped.get("overflow", 0),
            "expired": result.dropped.get("expired", 0),
            "attainment": round(sum(met[i] for i in indexes) / len(indexes), 6),
            "served": round(sum(not math.isnan(result.ttft_s[i]) for i in indexes) / len(indexes), 6),
            "ttft_ms": summary_ms([result.ttft_s[i] for i in indexes])}


def summary(report: dict[str, Any], wall_s: float | None = None) -> str:
    """A few human lines about a report."""
    def ms(stats: dict[str, float | None]) -> str:
        return " ".join(f"{q} {stats[q]:,.0f}" if stats[q] is not None else f"{q} -" for q in ("p50", "p90", "p99"))

    config = report["config"]
    goodput_per_gpu_hour = report["goodput_per_gpu_hour"]
    lines = [
        f"xpyd sim: {report['trace'] or 'trace'} x{report['speedup']:g}"
        + (f", rate x{report['rate_scale']}" if report.get("rate_scale", 1) != 1 else "")
        + f", {report['requests']:,} requests over "
        f"{report['duration_s']:,.1f} s, policy {report['policy']}, start {config['prefill']}P/{config['decode']}D",
        f"  attainment {report['attainment']:.1%} (TTFT <= {config['slo_ttft_ms']:g} ms: "
        f"{report['attainment_ttft']:.1%}, TPOT <= {config['slo_tpot_ms']:g} ms: {report['attainment_tpot']:.1%})",
        f"  goodput {report['goodput_rps']:,.2f} req/s  GPU-hours {report['gpu_hours']:,.3f}  goodput/GPU-hour "
        + (f"{goodput_per_gpu_hour:,.0f}" if goodput_per_gpu_hour is not None else "-"),
        f"  TTFT ms {ms(report['ttft_ms'])}   TPOT ms {ms(report['tpot_ms'])}",
        "  prefix cache: " + ("off" if not config["enable_prefix_caching"] else "; ".join(
            f"{role} hit {cache['hit_rate']:.1%}, "
            + (f"computed {cache['computed_tokens']:,} of {cache['prompt_tokens']:,} prompt tokens" if role == "prefill"
               else f"loaded {cache['transferred_tokens']:,}"
               + (f", computed {cache['computed_tokens']:,}" if cache["computed_tokens"] else ""))
            for role, cache in report["prefix_cache"].items())),
        *([f"  held without a ready pair {held['requests']:,}: served {held['served']:.1%}, attainment "
           f"{held['attainment']:.1%}, TTFT ms {ms(held['ttft_ms'])}, dropped {held['overflow']} full, "
           f"{held['expired']} timed out"] if (held := report.get("held")) else []),
        f"  scaling actions {report['scaling_actions']}"
        + (f"   rejected {report['rejected']}" if report["rejected"] else "")
        + (f"   wall {wall_s:.2f} s" if wall_s is not None else ""),
    ]
    return "\n".join(lines)


def plot(result: SimResult, path: str | Path, title: str = "") -> None:
    """Write a PNG: load (and the part of it meeting the SLOs), P and D replicas, TTFT and TPOT
    percentiles over time against the SLO lines, and each role's prefix-cache hit rate (when anything hit:
    a trace without prefix blocks shares nothing)."""
    report = build_report(result)
    line = report["timeline"]
    minutes = result.end_s > 900
    scale = 60.0 if minutes else 1.0
    edges = [x / scale for x in line["t_s"]] + [(line["t_s"][-1] + line["bin_s"]) / scale]
    slo = result.config.slo
    role_lines: list[Series] = []
    for role, color in ROLE_COLORS.items():
        ready = [getattr(s, f"{role}_ready") for s in result.replicas]
        total = [getattr(s, f"{role}_ready") + getattr(s, f"{role}_starting") for s in result.replicas]
        role_lines.append(Series(f"{role} (serving)", ready, color, width=2.2))
        if total != ready:
            role_lines.append(Series(f"{role} incl. starting", total, color, width=1.2, dashed=True))

    def quantiles(name: str) -> list[Series]:
        return [Series(q, line[f"{name}_{q}"], shade, width=1.6)
                for q, shade in (("p50", "#9ecae1"), ("p90", "#3182bd"), ("p99", "#08306b"))]

    goodput = report["goodput_per_gpu_hour"]
    anything_hit = any(cache["cached_tokens"] for cache in report["prefix_cache"].values())
    hit_rate = ([Series(f"{role} hits / prompt tokens", line[f"{role}_hit_rate"], color)
                 for role, color in ROLE_COLORS.items()] if anything_hit else [])
    write_timeline_plot(TimelinePlot(
        title=f"{title}   policy {result.policy}   attainment {report['attainment']:.1%}   "
              f"{report['gpu_hours']:.2f} GPU-h   good requests/GPU-h "
              + (f"{goodput:,.0f}" if goodput is not None else "-"),
        edges=edges,
        sent=Series("arrivals (missed an SLO)", line["arrivals_rps"], "#fcbba1"),
        good=Series("met both SLOs", line["good_rps"], "#74c476"),
        replica_times=[s.time_s / scale for s in result.replicas] + [result.end_s / scale],
        replicas=role_lines,
        latency=(LatencyPanel("TTFT", slo.ttft_s * 1000.0, quantiles("ttft_ms")),
                 LatencyPanel("TPOT", slo.tpot_s * 1000.0, quantiles("tpot_ms"))),
        xlabel=f"time ({'min' if minutes else 's'}); latencies of the requests arriving in each {line['bin_s']} s bin",
        x_end=max(edges[-1], result.end_s / scale),
        log_latency=True,
        height_ratios=(1, 0.8, 1.2, 1.2, 0.8) if hit_rate else (1, 0.8, 1.2, 1.2),
        size=(12, 12) if hit_rate else (12, 10),
        dpi=110,
        hit_rate=hit_rate,
    ), path)
