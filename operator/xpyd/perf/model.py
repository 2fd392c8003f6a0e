"""The performance model of one vLLM engine (one replica): prefill time, decode step time, KV
capacity and KV hand-off time, from a measured profile, from splitwise's measurements, or from a
roofline of the model shape and GPU datasheet.

`PerfModel` is what the engine emulator, the cluster simulator, the autoscaler and `xpyd plan`
read. Its core (`max_kv_tokens`, `prefill_seconds`, `decode_step_seconds`, `kv_transfer_seconds`)
is the `EnginePerf` protocol the simulator types against; the rest are the derived quantities the
planner needs.

Interpolation and extrapolation
===============================

Prefill (all sources) is a piecewise-linear function of the tokens in the prefill step:

- exact at every measured point (`PREFIX_prefill.csv`: `ttft_ms` at `isl_tokens`);
- linear between neighbouring points, so it is monotone wherever the table is (the H200 table is);
- below the first point: the first point's time (clamp). The smallest prompt measured already costs
  the engine's fixed per-step overhead, and a linear continuation could reach zero or below;
- above the last point: linear continuation of the last segment, its slope floored at zero. Batched
  prefill is throughput-bound, so time keeps growing about linearly with tokens; a clamp would make
  long prompts free.

Decode (a measured profile) is a surface over (context length, KV-cache usage). The table measures,
for each context length `c`, the inter-token latency at several KV usages `u`; the engine then holds
`u · max_kv_tokens` tokens in `b = u · max_kv_tokens / c` sequences. A query for `batch_size` `b`
holding `kv_tokens` `T` maps to `c = T / b` and `u = T / max_kv_tokens`, and:

- within one measured context, ITL is piecewise linear in `u` (exact at the points, monotone where
  the row is); below a row's smallest usage (batch ≈ 1) it is clamped, above its largest usage it
  continues the last segment with the slope floored at zero (a larger batch never decodes faster);
- between two measured contexts, the two rows' values at the same `u` are blended linearly in `c`
  (so a blend of two monotone rows is monotone);
- outside the measured contexts, the nearest row is used at the same `u` (clamp in context): at a
  fixed number of KV tokens the measured ITL varies little with context (9.7 to 11.7 ms at u ≈ 0.16
  over contexts 2,997 to 13,585), so holding the row is well supported, while a linear continuation
  in context would amplify the table's noise.

At context 350 the table's three highest usages imply batches of 1,049 to 1,573 sequences, but their
measured throughput (tokens/s x ITL) shows the engine ran only 788 to 900: it was capped by its
sequence limit, not by KV. `from_profile` therefore infers `max_num_seqs` from such saturated points
(throughput more than 10% below `b / ITL`) and `max_batch_for_itl` never exceeds it.

`decode_tokens_per_second` is `b / ITL(b)`, what a decode replica emits at batch `b`. At unsaturated
points it reads about 2% (at most 8%) above the table's `decode_tokens_per_s_per_gpu`: the profiling
run interleaved some prefill steps.

Splitwise rows (`splitwise_perf_model.csv`, one model, hardware and TP): prefill is `prompt_time`
against the tokens in the prefill batch (`prompt_size · batch_size`), decode step time is
`token_time` against `batch_size` (the rows' contexts are 128 to 8,704 tokens and `token_time` is flat
in context at batch 1, so the curve is context-independent). Repeats and rows with the same x are
reduced to their median. Rows whose KV need (`batch · prompt_size` for prefill, `batch · (prompt_size +
token_size)` for decode) exceeds the replica's KV capacity are dropped: they cannot have run as
specified, and they are the rows that break the trend (e.g. Llama2-70B on two H100s). Both curves
use the same clamp-below / linear-above rules.

Roofline: prefill time is `2 · active_params · tokens / (gpus · flops · mfu)` (attention's quadratic
term is left out, as in the seed's arithmetic, which understates long prompts); a decode step is the
larger of reading the weights and the batch's KV, `(weight_bytes + kv_tokens · kv_bytes_per_token) /
(gpus · hbm_bandwidth · mbu)`, and computing `2 · active_params · batch / (gpus · flops · mfu)`;
`max_kv_tokens` is what is left of `gpus · memory · gpu_memory_utilization` after the weights.

KV transfer: `kv_bytes_per_token · tokens / link bandwidth`, serial after prefill (the worst case:
connectors can overlap layer-wise transfer with compute), 0 when the KV shape or link is unknown.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import importlib.resources
import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from xpyd.perf.shapes import GpuDatasheet, ModelShape, lookup_gpu, lookup_model

H200_LLAMA31_8B_MAX_KV_TOKENS = 945_029
"""`max_kv_tokens` of the engine behind `h200_llama31_8b_fp8_tp1` (data/README.md)."""

SATURATION_TOLERANCE = 0.10
"""A decode point whose measured throughput is this far below `batch / ITL` ran a smaller batch."""


@dataclass(frozen=True)
class PiecewiseLinear:
    """y(x) through the points (xs, ys): linear between points, clamped below the first point,
    continued with the last segment's slope (floored at zero) above the last point."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or len(self.xs) < 2:
            raise ValueError("a piecewise-linear curve needs at least two (x, y) points")
        if any(b <= a for a, b in itertools.pairwise(self.xs)):
            raise ValueError(f"x values must be strictly increasing: {self.xs}")
        if not all(math.isfinite(v) for v in (*self.xs, *self.ys)):
            raise ValueError("x and y values must be finite")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (x - xs[-1])
        i = bisect.bisect_right(xs, x) - 1
        return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


class DecodeModel(Protocol):
    """Decode step time of one engine: the part of `PerfModel` that differs by source."""

    def step_seconds(self, batch_size: float, kv_tokens: float) -> float:
        """One decode step of `batch_size` sequences holding `kv_tokens` KV tokens in total."""
        ...

    def batch_breakpoints(self, context_tokens: float) -> list[float]:
        """Batch sizes where the step time at this context may change slope (it is linear between)."""
        ...


@dataclass(frozen=True)
class UsageRow:
    """One measured context length of a decode profile: ITL (seconds) against KV usage (0-1)."""

    context_tokens: float
    itl_by_usage: PiecewiseLinear


@dataclass(frozen=True)
class MeasuredDecode:
    """Decode step time from a measured (context, KV usage) table; see the module docstring."""

    rows: tuple[UsageRow, ...]
    max_kv_tokens: int
    contexts: tuple[float, ...] = dataclasses.field(init=False, repr=False, compare=False)  # the rows' contexts

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a decode profile needs at least one context length")
        contexts = tuple(row.context_tokens for row in self.rows)
        if any(b <= a for a, b in itertools.pairwise(contexts)):
            raise ValueError("decode rows must be sorted by context length")
        object.__setattr__(self, "contexts", contexts)   # frozen: set once here, for the step-time lookups

    def _bracket(self, context_tokens: float) -> tuple[UsageRow, UsageRow, float]:
        rows = self.rows
        if context_tokens <= rows[0].context_tokens:
            return rows[0], rows[0], 0.0
        if context_tokens >= rows[-1].context_tokens:
            return rows[-1], rows[-1], 0.0
        j = bisect.bisect_right(self.contexts, context_tokens)
        low, high = rows[j - 1], rows[j]
        return low, high, (context_tokens - low.context_tokens) / (high.context_tokens - low.context_tokens)

    def itl_seconds_at(self, context_tokens: float, kv_usage: float) -> float:
        """ITL at a context length and KV usage fraction: exact at the table's points."""
        # `_bracket` inlined: the simulator asks this once per engine step.
        rows, contexts = self.rows, self.contexts
        if context_tokens <= contexts[0]:
            return rows[0].itl_by_usage(kv_usage)
        if context_tokens >= contexts[-1]:
            return rows[-1].itl_by_usage(kv_usage)
        j = bisect.bisect_right(contexts, context_tokens)
        low, high = contexts[j - 1], contexts[j]
        weight = (context_tokens - low) / (high - low)
        itl = rows[j - 1].itl_by_usage(kv_usage)
        if weight == 0.0:
            return itl
        return (1.0 - weight) * itl + weight * rows[j].itl_by_usage(kv_usage)

    def step_seconds(self, batch_size: float, kv_tokens: float) -> float:
        return self.itl_seconds_at(kv_tokens / batch_size, kv_tokens / self.max_kv_tokens)

    def batch_breakpoints(self, context_tokens: float) -> list[float]:
        low, high, _ = self._bracket(context_tokens)
        usages = {*low.itl_by_usage.xs, *high.itl_by_usage.xs}
        return sorted(usage * self.max_kv_tokens / context_tokens for usage in usages)


@dataclass(frozen=True)
class BatchDecode:
    """Decode step time against batch size only (splitwise's `token_time`)."""

    itl_by_batch: PiecewiseLinear

    def step_seconds(self, batch_size: float, kv_tokens: float) -> float:
        return self.itl_by_batch(batch_size)

    def batch_breakpoints(self, context_tokens: float) -> list[float]:
        return list(self.itl_by_batch.xs)


@dataclass(frozen=True)
class RooflineDecode:
    """Decode step time as max(memory time, compute time) plus a fixed overhead."""

    weight_read_seconds: float
    kv_read_seconds_per_token: float
    compute_seconds_per_sequence: float
    overhead_seconds: float = 0.0

    def step_seconds(self, batch_size: float, kv_tokens: float) -> float:
        memory = self.weight_read_seconds + kv_tokens * self.kv_read_seconds_per_token
        return self.overhead_seconds + max(memory, batch_size * self.compute_seconds_per_sequence)

    def batch_breakpoints(self, context_tokens: float) -> list[float]:
        # Compute overtakes memory where weights + b·c·kv = b·compute.
        margin = self.compute_seconds_per_sequence - context_tokens * self.kv_read_seconds_per_token
        return [self.weight_read_seconds / margin] if margin > 0 else []


@dataclass(frozen=True)
class PrefillPoint:
    """One row of `PREFIX_prefill.csv`."""

    isl_tokens: int
    ttft_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class DecodePoint:
    """One row of `PREFIX_decode.csv`."""

    kv_usage: float
    context_tokens: int
    itl_s: float
    tokens_per_s: float

    def batch_size(self, max_kv_tokens: int) -> float:
        """Sequences in the batch: KV tokens in use / context length."""
        return self.kv_usage * max_kv_tokens / self.context_tokens

    def effective_batch_size(self) -> float:
        """Sequences the engine actually ran, from its measured output rate: tokens/s x ITL."""
        return self.tokens_per_s * self.itl_s


def _read_csv(path: Path, columns: Sequence[str]) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        missing = [name for name in columns if name not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        rows = list(reader)
    if not rows:
        raise ValueError(f"{path}: no data rows")
    return rows


def _number(row: dict[str, str], column: str, path: Path) -> float:
    try:
        value = float(row[column])
    except (TypeError, ValueError):
        raise ValueError(f"{path}: {column}={row[column]!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{path}: {column}={row[column]!r} is not finite")
    return value


#: Profiles shipped with the package, usable by bare name (e.g. `h200_llama31_8b_fp8_tp1`).
#: (Found through the package, not this module's `__file__`, which is elsewhere when it is compiled.)
BUNDLED_PROFILES = Path(str(importlib.resources.files("xpyd.perf") / "profiles"))
DEFAULT_PROFILE = BUNDLED_PROFILES / "h200_llama31_8b_fp8_tp1"


def profile_paths(prefix: str | Path) -> tuple[Path, Path]:
    """The prefill and decode CSV files of profile `prefix`: a path prefix, or the name of a
    bundled profile when no such files exist."""
    base = str(prefix)
    paths = Path(f"{base}_prefill.csv"), Path(f"{base}_decode.csv")
    bundled = BUNDLED_PROFILES / Path(base).name
    if not paths[0].exists() and Path(f"{bundled}_prefill.csv").exists():
        return Path(f"{bundled}_prefill.csv"), Path(f"{bundled}_decode.csv")
    return paths


def read_profile(prefix: str | Path) -> tuple[list[PrefillPoint], list[DecodePoint]]:
    """The rows of `PREFIX_prefill.csv` and `PREFIX_decode.csv`, in file order."""
    prefill_path, decode_path = profile_paths(prefix)
    prefill = [
        PrefillPoint(int(_number(row, "isl_tokens", prefill_path)), _number(row, "ttft_ms", prefill_path) / 1e3,
                     _number(row, "prefill_tokens_per_s_per_gpu", prefill_path))
        for row in _read_csv(prefill_path, ("isl_tokens", "ttft_ms", "prefill_tokens_per_s_per_gpu"))
    ]
    decode_columns = ("kv_usage_fraction", "context_length_tokens", "itl_ms", "decode_tokens_per_s_per_gpu")
    decode = [
        DecodePoint(_number(row, "kv_usage_fraction", decode_path),
                    int(_number(row, "context_length_tokens", decode_path)),
                    _number(row, "itl_ms", decode_path) / 1e3,
                    _number(row, "decode_tokens_per_s_per_gpu", decode_path))
        for row in _read_csv(decode_path, decode_columns)
    ]
    return prefill, decode


def saturated_points(points: Iterable[DecodePoint], max_kv_tokens: int) -> list[DecodePoint]:
    """Decode points whose measured throughput shows a smaller batch than their KV usage implies."""
    return [point for point in points
            if point.effective_batch_size() < (1.0 - SATURATION_TOLERANCE) * point.batch_size(max_kv_tokens)]


def _curve(points: dict[float, list[float]], what: str) -> PiecewiseLinear:
    if len(points) < 2:
        raise ValueError(f"{what}: need at least two distinct measured sizes, got {len(points)}")
    xs = sorted(points)
    return PiecewiseLinear(tuple(xs), tuple(statistics.median(points[x]) for x in xs))


def kv_capacity_tokens(shape: ModelShape, gpu: GpuDatasheet, gpus: int, *, weight_dtype: str = "bf16",
                       kv_dtype: str = "bf16", gpu_memory_utilization: float = 0.9) -> int:
    """KV tokens that fit in `gpus` GPUs after the weights, at vLLM's memory-utilisation fraction."""
    free = gpus * gpu.memory_bytes * gpu_memory_utilization - shape.weight_bytes(weight_dtype)
    tokens = math.floor(free / shape.kv_bytes_per_token(kv_dtype))
    if tokens < 1:
        raise ValueError(f"{shape.name} weights ({shape.weight_bytes(weight_dtype) / 1e9:.0f} GB {weight_dtype}) "
                         f"leave no KV space on {gpus} x {gpu.name} at {gpu_memory_utilization:.0%} utilisation")
    return tokens


@dataclass
class PerfModel:
    """The performance of one engine replica (all the GPUs of one tensor-parallel group).

    Implements the simulator's `EnginePerf` protocol (`max_kv_tokens`, `prefill_seconds`,
    `decode_step_seconds`, `kv_transfer_seconds`); build it with `from_profile`, `from_splitwise` or
    `roofline`. See the module docstring for how each source interpolates and extrapolates.
    """

    prefill: PiecewiseLinear
    decode: DecodeModel
    max_kv_tokens: int
    gpus: int = 1
    max_num_seqs: int | None = None
    kv_bytes_per_token: int | None = None
    link_gbps: float | None = None
    description: str = ""

    # --- EnginePerf --------------------------------------------------------------------------

    def prefill_seconds(self, batch_tokens: int) -> float:
        """Time of one prefill step processing `batch_tokens` prompt tokens (0 for no tokens)."""
        return self.prefill(batch_tokens) if batch_tokens > 0 else 0.0

    def decode_step_seconds(self, batch_size: int, kv_tokens: int) -> float:
        """One decode step (the ITL) for `batch_size` sequences holding `kv_tokens` KV tokens in total."""
        return self.decode.step_seconds(batch_size, max(kv_tokens, 0)) if batch_size > 0 else 0.0

    def kv_transfer_seconds(self, tokens: int) -> float:
        """Modelled KV hand-off time of a `tokens`-token prompt: bytes / link bandwidth (0 if unknown)."""
        if self.kv_bytes_per_token is None or not self.link_gbps or tokens <= 0:
            return 0.0
        return link_seconds(tokens * self.kv_bytes_per_token, self.link_gbps)

    # --- derived quantities ------------------------------------------------------------------

    def prefill_tokens_per_second(self, isl: int) -> float:
        """Prompt tokens per second one replica prefills with `isl`-token prompts."""
        return isl / self.prefill_seconds(isl)

    def itl_seconds(self, batch_size: int, context_tokens: float) -> float:
        """Inter-token latency at `batch_size` sequences of `context_tokens` tokens each."""
        return self.decode.step_seconds(batch_size, batch_size * context_tokens) if batch_size > 0 else 0.0

    def decode_tokens_per_second(self, batch_size: int, context_tokens: float) -> float:
        """Output tokens per second of one replica at this batch size and context: batch / ITL."""
        return batch_size / self.itl_seconds(batch_size, context_tokens)

    def ttft_seconds(self, isl: int, *, disaggregated: bool = False) -> float:
        """TTFT of an `isl`-token prompt at low load: its prefill; with `disaggregated`, plus the KV
        transfer and one decode step at batch 1 on the decode side."""
        ttft = self.prefill_seconds(isl)
        if disaggregated:
            ttft += self.kv_transfer_seconds(isl) + self.itl_seconds(1, isl)
        return ttft

    def max_batch_for_kv(self, context_tokens: float, kv_headroom: float = 1.0) -> int:
        """Sequences of `context_tokens` that fit in `kv_headroom` of the KV cache (and `max_num_seqs`)."""
        batch = math.floor(self.max_kv_tokens * kv_headroom / max(context_tokens, 1.0))
        return min(batch, self.max_num_seqs) if self.max_num_seqs is not None else batch

    def max_batch_for_itl(self, itl_target_s: float, context_tokens: float, kv_headroom: float = 1.0) -> int:
        """Largest batch whose ITL at this context is at most `itl_target_s` and whose KV fits
        (0 when even one sequence is slower than the target). Exact for piecewise-linear step times:
        it walks the segments between the model's breakpoints from the largest batch down."""
        context = max(context_tokens, 1.0)
        cap = self.max_batch_for_kv(context, kv_headroom)
        if cap < 1:
            return 0

        def itl(batch: float) -> float:
            return self.decode.step_seconds(batch, batch * context)

        points = sorted({1.0, float(cap), *(b for b in self.decode.batch_breakpoints(context) if 1.0 < b < cap)})
        best = 1.0 if itl(1.0) <= itl_target_s else 0.0
        for low, high in reversed(list(itertools.pairwise(points))):
            at_low, at_high = itl(low), itl(high)
            if at_high <= itl_target_s:
                best = high
                break
            if at_low <= itl_target_s:
                best = low + (itl_target_s - at_low) * (high - low) / (at_high - at_low)
                break
        batch = min(cap, math.floor(best + 1e-9))
        while batch >= 1 and itl(batch) > itl_target_s:  # float rounding at the crossing
            batch -= 1
        return batch

    def with_kv_transfer(self, kv_bytes_per_token: int | None, link_gbps: float | None) -> PerfModel:
        """This model with the KV shape and link that `kv_transfer_seconds` uses."""
        return dataclasses.replace(self, kv_bytes_per_token=kv_bytes_per_token, link_gbps=link_gbps)

    # --- sources -----------------------------------------------------------------------------

    @classmethod
    def from_profile(cls, prefix: str | Path, *, max_kv_tokens: int = H200_LLAMA31_8B_MAX_KV_TOKENS,
                     max_num_seqs: int | None = None, gpus: int = 1, kv_bytes_per_token: int | None = None,
                     link_gbps: float | None = None) -> PerfModel:
        """A measured profile pair `PREFIX_prefill.csv` / `PREFIX_decode.csv`.

        `max_kv_tokens` is the engine's KV capacity during profiling (the default is the H200
        Llama-3.1-8B profile's); `max_num_seqs` defaults to the sequence cap the table shows
        (largest batch among saturated points; none if no point is saturated); `gpus` is the
        profile's TP size.
        """
        prefill_points, decode_points = read_profile(prefix)
        prefill = PiecewiseLinear(tuple(float(p.isl_tokens) for p in prefill_points),
                                  tuple(p.ttft_s for p in prefill_points))
        by_context: dict[int, list[DecodePoint]] = defaultdict(list)
        for point in decode_points:
            by_context[point.context_tokens].append(point)
        rows = []
        for context in sorted(by_context):
            row = sorted(by_context[context], key=lambda p: p.kv_usage)
            if len(row) < 2:
                raise ValueError(f"{prefix}_decode.csv: context {context} needs at least two KV usages")
            rows.append(UsageRow(float(context), PiecewiseLinear(tuple(p.kv_usage for p in row),
                                                                 tuple(p.itl_s for p in row))))
        if max_num_seqs is None:
            saturated = saturated_points(decode_points, max_kv_tokens)
            max_num_seqs = round(max(p.effective_batch_size() for p in saturated)) if saturated else None
        return cls(prefill=prefill, decode=MeasuredDecode(tuple(rows), max_kv_tokens), max_kv_tokens=max_kv_tokens,
                   gpus=gpus, max_num_seqs=max_num_seqs, kv_bytes_per_token=kv_bytes_per_token, link_gbps=link_gbps,
                   description=f"profile {Path(str(prefix)).name}")

    @classmethod
    def from_splitwise(cls, csv_path: str | Path, model: str, hardware: str, tp: int, *,
                       max_kv_tokens: int | None = None, weight_dtype: str = "fp16", kv_dtype: str = "fp16",
                       gpu_memory_utilization: float = 0.9, kv_bytes_per_token: int | None = None,
                       link_gbps: float | None = None) -> PerfModel:
        """The rows of `splitwise_perf_model.csv` for one (model, hardware, TP), e.g. ("llama2-70b",
        "a100-80gb", 4). `max_kv_tokens` defaults to the capacity the model shape leaves on that
        hardware (splitwise measured in FP16). See the module docstring for the mapping."""
        path = Path(csv_path)
        columns = ("model", "hardware", "prompt_size", "batch_size", "token_size", "prompt_time", "token_time",
                   "tensor_parallel")
        rows = _read_csv(path, columns)
        chosen = [row for row in rows if row["model"].lower() == model.lower()
                  and row["hardware"].lower() == hardware.lower() and int(row["tensor_parallel"]) == tp]
        if not chosen:
            available = sorted({f"{r['model']}/{r['hardware']}/tp{r['tensor_parallel']}" for r in rows})
            raise ValueError(f"{path}: no rows for {model}/{hardware}/tp{tp} (available: {', '.join(available)})")
        if max_kv_tokens is None:
            max_kv_tokens = kv_capacity_tokens(lookup_model(model), lookup_gpu(hardware), tp, weight_dtype=weight_dtype,
                                               kv_dtype=kv_dtype, gpu_memory_utilization=gpu_memory_utilization)
        prompt_times: dict[float, list[float]] = defaultdict(list)
        token_times: dict[float, list[float]] = defaultdict(list)
        for row in chosen:
            batch, prompt = _number(row, "batch_size", path), _number(row, "prompt_size", path)
            if batch * prompt <= max_kv_tokens:
                prompt_times[batch * prompt].append(_number(row, "prompt_time", path) / 1e3)
            if batch * (prompt + _number(row, "token_size", path)) <= max_kv_tokens:
                token_times[batch].append(_number(row, "token_time", path) / 1e3)
        what = f"{path} {model}/{hardware}/tp{tp}"
        return cls(prefill=_curve(prompt_times, f"{what} prefill"),
                   decode=BatchDecode(_curve(token_times, f"{what} decode")), max_kv_tokens=max_kv_tokens, gpus=tp,
                   kv_bytes_per_token=kv_bytes_per_token, link_gbps=link_gbps,
                   description=f"splitwise {model} {hardware} TP{tp}")

    @classmethod
    def roofline(cls, shape: ModelShape, gpu: GpuDatasheet, tp: int = 1, *, weight_dtype: str = "bf16",
                 kv_dtype: str = "bf16", mfu: float = 0.5, mbu: float = 0.7, effective_tflops: float | None = None,
                 gpu_memory_utilization: float = 0.9, step_overhead_s: float = 0.0, max_kv_tokens: int | None = None,
                 link_gbps: float | None = None) -> PerfModel:
        """A model without measurements: compute-bound prefill, memory/compute-bound decode.

        `mfu` and `mbu` are the fractions of the datasheet FLOP/s and HBM bandwidth reached;
        `effective_tflops` (per GPU) replaces `mfu x datasheet` when given, as in the seed's "400
        TFLOPS effective". `tp` GPUs share one replica's weights, KV and work.
        """
        if tp < 1 or not 0 < mfu <= 1 or not 0 < mbu <= 1:
            raise ValueError("tp must be >= 1 and mfu, mbu in (0, 1]")
        flops = tp * (effective_tflops * 1e12 if effective_tflops is not None else gpu.flops(weight_dtype) * mfu)
        bandwidth = tp * gpu.hbm_bytes_per_s * mbu
        per_token = 2.0 * shape.flops_params / flops
        kv_bytes = shape.kv_bytes_per_token(kv_dtype)
        if max_kv_tokens is None:
            max_kv_tokens = kv_capacity_tokens(shape, gpu, tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                               gpu_memory_utilization=gpu_memory_utilization)
        decode = RooflineDecode(weight_read_seconds=shape.weight_bytes(weight_dtype) / bandwidth,
                                kv_read_seconds_per_token=kv_bytes / bandwidth,
                                compute_seconds_per_sequence=per_token, overhead_seconds=step_overhead_s)
        return cls(prefill=PiecewiseLinear((0.0, 1.0), (step_overhead_s, step_overhead_s + per_token)),
                   decode=decode, max_kv_tokens=max_kv_tokens, gpus=tp, kv_bytes_per_token=kv_bytes,
                   link_gbps=link_gbps, description=f"roofline {shape.name} on {tp} x {gpu.name}")


def link_seconds(bytes_: float, link_gbps: float) -> float:
    """Seconds to move `bytes_` over a `link_gbps` Gb/s link at line rate (no protocol overhead)."""
    return bytes_ / (link_gbps * 1e9 / 8)


def transfer_to_prefill_ratio(shape: ModelShape, kv_dtype: str, link_gbps: float, prefill_tokens_per_s: float) -> float:
    """KV transfer time / prefill time for any prompt length (the length cancels):
    `(kv_bytes_per_token / link_bytes_per_s) / (1 / prefill_tokens_per_s)`."""
    return link_seconds(shape.kv_bytes_per_token(kv_dtype), link_gbps) * prefill_tokens_per_s

