"""`xpyd engine-sim` against recordings of real vLLM 0.32 (tests/fixtures/vllm-0.32-cpu/: its CPU
build with NixlConnector, a tiny Llama served as "tiny"; a prefill engine, kv_producer, and a decode
engine, kv_consumer, after completions and chats, streamed and not, handed off through NIXL).

The emulator runs in this process on 127.0.0.1 (a prefill, a decode and a plain engine, at a high
time scale) and is sent what the recordings were made with; its answers are compared with them.

The rule, for `/metrics` (a family is a `# TYPE`d name; its type and label names, not the values):

1. Every family the emulator exposes exists in real vLLM's exposition of the same role with the same
   type and the same label names: no invented families, no wrong types or labels. prometheus_client's
   `_created` gauges are families too (the emulator writes them as vLLM does), and label names are
   written sorted, as prometheus_client 0.26 writes them.
2. Every family the project reads (the autoscaler's PromQL, the proxy's NIXL failed-transfers
   counter, the drain hook, the chart's dashboards and alerts) is in both, in both roles.
3. A family real vLLM has and the emulator does not model is listed in `NOT_MODELLED`, with why:
   a new family in a new recording fails the test until it is modelled or listed. An entry that no
   recording has any more fails it too.
4. The enumerating labels (`finished_reason`, `source`, `reason`, `stage`, `sleep_state`, `le`) take
   the same values: the project's queries select by them and `histogram_quantile` needs the buckets.

For the API: the prefill answer's `kv_transfer_params` has the recorded keys with the recorded value
types; the completion and chat answers, streamed and not, `/v1/models` and the error bodies have the
recorded shape (keys and JSON types, recursively); the two recorded errors are equal to the letter.

The emulator emulates vLLM 0.33 (`/version`), the recordings are of 0.32. What 0.33 adds to the wire
is allowed beside the recording (`ADDED_IN_0_33`) and checked to be in 0.33's own code and not in
0.32's (both unpacked by `bash e2e/build/vllm-wheels.sh`, `make tools`; without them that test
fails, it never skips). The metric families of the two releases are the same.

Known differences that stay (see operator/xpyd/sim/emulator/exposition.py): `/metrics` always answers
in text format 0.0.4, while vLLM's prometheus_client negotiates OpenMetrics (or text 1.0.0) with a
scraper that asks for it -- the sample names PromQL reads are the same; and sample values follow the
emulator's model, not vLLM's (e.g. a decode engine's `vllm:request_prefill_kv_computed_tokens`
counts 0 computed tokens where vLLM 0.32 counts the prompt less the prefill engine's cache hits).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conformance.vllm_release import release_root
from tests.integration.enginesim import HOST, PERF, PREFILL_KV, client_session, post, token_prompt
from xpyd.api.naming import ROLES
from xpyd.autoscaler.collect import Scope, queries
from xpyd.proxy.kvhealth import FAILED_TRANSFERS_SAMPLE, failed_transfers
from xpyd.sim.emulator.config import EMULATED_VLLM_VERSION, EmulatorConfig
from xpyd.sim.emulator.http import EmulatorServer, start_server

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = ROOT / "tests" / "fixtures" / "vllm-0.32-cpu"
MODEL = "tiny"
MAX_MODEL_LEN = 4096   # the recorded engines': the token histograms' buckets and the error messages follow it


#: Families of real vLLM 0.32 the emulator does not expose (their `_created` gauges go with them), and why.
NOT_MODELLED: dict[str, str] = {
    # prometheus_client's default collectors: vLLM's Python process, not its engine.
    "python_gc_objects_collected_total": "the process's garbage collector",
    "python_gc_objects_uncollectable_total": "the process's garbage collector",
    "python_gc_collections_total": "the process's garbage collector",
    "python_info": "the process's Python",
    "process_virtual_memory_bytes": "the process's memory",
    "process_resident_memory_bytes": "the process's memory",
    "process_start_time_seconds": "the process's start",
    "process_cpu_seconds_total": "the process's CPU time",
    "process_open_fds": "the process's file descriptors",
    "process_max_fds": "the process's file descriptors",
    # prometheus-fastapi-instrumentator: vLLM's FastAPI server, per handler.
    "http_requests_total": "the API server's requests",
    "http_request_size_bytes": "the API server's request sizes",
    "http_response_size_bytes": "the API server's response sizes",
    "http_request_duration_highr_seconds": "the API server's latencies",
    "http_request_duration_seconds": "the API server's latencies",
    # vLLM's own, counting what the emulated engine does not have.
    "vllm:nixl_post_time_seconds": "NIXL's transfer posting is not modelled",
    "vllm:nixl_num_descriptors": "NIXL's descriptor lists are not modelled",
    "vllm:estimated_flops_per_gpu_total": "no FLOP model (0 on the CPU build too)",
    "vllm:estimated_read_bytes_per_gpu_total": "no memory-traffic model",
    "vllm:estimated_write_bytes_per_gpu_total": "no memory-traffic model",
    "vllm:mm_cache_queries_total": "text only: no multi-modal cache",
    "vllm:mm_cache_hits_total": "text only: no multi-modal cache",
    "vllm:admission_rejections_total": "no --max-num-queued-* admission limits",
    "vllm:cache_config_info": "CacheConfig's fields (37 labels) are mostly not modelled",
}

#: What vLLM 0.33 (the release the emulator emulates) adds to the wire over the 0.32 recordings, by
#: path in an answer or an SSE event: where 0.33's code (and not 0.32's) has it.
ADDED_IN_0_33: dict[str, list[tuple[str, str]]] = {
    # NIXL's metadata version 15: the prefill engine's handshake generation, for the decode engine.
    "kv_transfer_params.remote_registration_generation": [
        ("vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py",
         "remote_registration_generation=self._registration_generation")],
    # Every choice's weight-version spans (null unless `return_weight_versions`).
    "choices[].weight_versions": [
        ("vllm/entrypoints/openai/completion/protocol.py", "weight_versions: list[WeightVersionSpan] | None = None"),
        ("vllm/entrypoints/openai/chat_completion/protocol.py",
         "weight_versions: list[WeightVersionSpan] | None = None")],
    # SSE events carry `kv_transfer_params` (null but on the final event of a prefill leg).
    "kv_transfer_params": [
        ("vllm/entrypoints/openai/completion/protocol.py", "KV transfer params returned with the final chunk"),
        ("vllm/entrypoints/openai/chat_completion/protocol.py", "KV transfer params returned with the final chunk")],
}
ALLOWED = frozenset(ADDED_IN_0_33)


# --- the exposition: families ---------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?')
_SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"),
             "summary": ("", "_count", "_sum")}


@dataclass(frozen=True)
class Family:
    """A `# TYPE`d family: its type, its samples' label names (`le`/`quantile` aside) and the values
    each label takes."""

    kind: str
    labels: frozenset[str]
    values: dict[str, frozenset[str]]


def families(text: str) -> dict[str, Family]:
    """The families of an exposition, checking that every sample follows its `# TYPE` line with a name
    its type allows, and that its labels are written sorted by name (as prometheus_client does)."""
    kinds: dict[str, str] = {}
    labels: dict[str, dict[str, set[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, current, kind = line.split(" ")
            assert current not in kinds, f"{current} typed twice"
            kinds[current], labels[current] = kind, {}
            continue
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match and current is not None, f"malformed or untyped sample line: {line!r}"
        name = match.group(1)
        assert name in {current + suffix for suffix in _SUFFIXES[kinds[current]]}, \
            f"{name} is not a sample of the {kinds[current]} {current}"
        pairs = _LABEL.findall(match.group(2) or "")
        assert [key for key, _ in pairs] == sorted(key for key, _ in pairs), f"labels not sorted: {line!r}"
        for key, value in pairs:
            labels[current].setdefault(key, set()).add(value)
    return {name: Family(kinds[name], frozenset(set(labels[name]) - {"le", "quantile"}),
                         {key: frozenset(values) for key, values in labels[name].items()}) for name in kinds}


def created_of(name: str, family: Family) -> str:
    """The name of the `_created` gauge prometheus_client writes beside a counter or histogram."""
    return (name.removesuffix("_total") if family.kind == "counter" else name) + "_created"


def resolve(sample: str, exposed: dict[str, Family]) -> str | None:
    """The family a name read by the project belongs to: one of its samples, or the family named
    (a counter may be named without `_total`)."""
    for name, family in exposed.items():
        if sample in {name, *(name + suffix for suffix in _SUFFIXES[family.kind])} or sample + "_total" == name:
            return name
    return None


@cache
def recorded_metrics(role: str) -> str:
    return (RECORDINGS / f"{role}_metrics.txt").read_text()


@cache
def recorded_responses() -> dict[str, Any]:
    responses: dict[str, Any] = json.loads((RECORDINGS / "responses.json").read_text())
    return responses


def unmodelled(recorded: dict[str, Family]) -> set[str]:
    """`NOT_MODELLED` and their `_created` gauges, as far as the recording has them."""
    out = set()
    for name in NOT_MODELLED:
        if name in recorded:
            out |= {name, created_of(name, recorded[name])}
    return out & set(recorded)


# --- the emulator, driven like the recorded engines -------------------------------------------------

@dataclass
class Session:
    """What the emulated engines answered and exposed."""

    answers: dict[str, Any]
    metrics: dict[str, str]   # by role: prefill, decode, plain (no KV connector)


async def _engine(role: str | None) -> EmulatorServer:
    return await start_server(EmulatorConfig(
        model=f"/models/{MODEL}", served_model_names=(MODEL,), host=HOST, port=0, side_channel_port=0,
        kv_role=role, max_model_len=MAX_MODEL_LEN, time_scale=100.0, kv_bytes_per_token=4096, seed=7), PERF)


async def _stream_text(session: Any, url: str, body: dict[str, Any]) -> str:
    async with session.post(url, json={**body, "stream": True}) as response:
        assert response.status == 200
        return str(await response.text())


async def _drive() -> Session:
    engines = [await _engine(role) for role in ("kv_producer", "kv_consumer", None)]
    prefill, decode, plain = (engine.url for engine in engines)
    answers: dict[str, Any] = {}
    try:
        async with client_session() as session:
            completion = {"model": MODEL, "prompt": token_prompt(300), "max_tokens": 16}
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 800}], "max_tokens": 8}
            for name, body, url in (("prefill_completion", completion, "completions"),
                                    ("prefill_chat", chat, "chat/completions")):
                status, answers[name] = await post(session, f"{prefill}/v1/{url}", {
                    **body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
                assert status == 200, answers[name]
            status, answers["decode_completion"] = await post(session, f"{decode}/v1/completions", {
                **completion, "kv_transfer_params": answers["prefill_completion"]["kv_transfer_params"]})
            assert status == 200, answers["decode_completion"]
            status, again = await post(session, f"{prefill}/v1/completions", {
                **completion, "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
            assert status == 200, again
            answers["decode_completion_stream"] = await _stream_text(session, f"{decode}/v1/completions", {
                **completion, "kv_transfer_params": again["kv_transfer_params"]})
            answers["decode_chat_stream"] = await _stream_text(session, f"{decode}/v1/chat/completions", {
                **chat, "kv_transfer_params": answers["prefill_chat"]["kv_transfer_params"]})
            status, answers["single"] = await post(session, f"{plain}/v1/completions", completion)
            assert status == 200, answers["single"]
            async with session.get(f"{prefill}/v1/models") as response:
                answers["models"] = await response.json()
            answers["bad_model"] = list(await post(session, f"{prefill}/v1/completions",
                                                   {"model": "nope", "prompt": "hello"}))
            answers["too_long"] = list(await post(session, f"{prefill}/v1/completions",
                                                  {"model": MODEL, "prompt": "hello", "max_tokens": 100000}))
            metrics = {}
            for role, url in (("prefill", prefill), ("decode", decode), ("plain", plain)):
                async with session.get(f"{url}/metrics") as response:
                    assert response.status == 200
                    metrics[role] = await response.text()
    finally:
        for engine in engines:
            await engine.close()
    return Session(answers, metrics)


@pytest.fixture(scope="module")
def emulated() -> Iterator[Session]:
    yield asyncio.run(asyncio.wait_for(_drive(), timeout=60))


# --- /metrics -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ROLES)
def test_every_emulated_family_is_real_with_its_type_and_labels(emulated: Session, role: str) -> None:
    real, emulator = families(recorded_metrics(role)), families(emulated.metrics[role])
    problems = [f"{name}: not in real vLLM's {role} exposition (invented?)" for name in emulator if name not in real]
    problems += [f"{name}: {emulator[name].kind} {sorted(emulator[name].labels)}, real vLLM's is "
                 f"{real[name].kind} {sorted(real[name].labels)}"
                 for name in emulator if name in real and
                 (emulator[name].kind, emulator[name].labels) != (real[name].kind, real[name].labels)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("role", ROLES)
def test_every_real_family_is_emulated_or_listed_as_not_modelled(emulated: Session, role: str) -> None:
    real, emulator = families(recorded_metrics(role)), families(emulated.metrics[role])
    absent = unmodelled(real)
    missing = sorted(set(real) - set(emulator) - absent)
    assert not missing, f"real vLLM's {role} engine has families the emulator neither exposes nor lists in " \
                        f"NOT_MODELLED: {missing}"
    listed_but_exposed = sorted(absent & set(emulator))
    assert not listed_but_exposed, f"NOT_MODELLED lists families the emulator exposes: {listed_but_exposed}"


def helps(text: str) -> dict[str, str]:
    """Each family's HELP text."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP "):].partition(" ")
            out[name] = help_text
    return out


@pytest.mark.parametrize("role", ROLES)
def test_every_emulated_family_has_real_vllms_help_text(emulated: Session, role: str) -> None:
    real, emulator = helps(recorded_metrics(role)), helps(emulated.metrics[role])
    problems = [f"{name}: {text!r}, real vLLM's {real[name]!r}" for name, text in emulator.items()
                if name in real and text != real[name]]
    assert not problems, "\n".join(problems)
    assert "vllm:prefix_cache_queries_total" in emulator and "vllm:prefix_cache_hits_total" in emulator


def test_the_prefix_cache_series_count_what_the_emulator_found(emulated: Session) -> None:
    """The emulated prefill engine gets the 300-token completion prompt twice: the second time it finds
    its first 288 tokens (whole blocks of 16, at most prompt - 1), counted in every series vLLM counts
    its hits in (the recorded engine, with the CPU backend's blocks of 128, found 512 of 1,414)."""
    samples = {(metric.name, sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for metric in text_string_to_metric_families(emulated.metrics["prefill"])
               for sample in metric.samples}

    def value(name: str, **labels: str) -> float:
        wanted = tuple(sorted({"engine": "0", "model_name": MODEL, **labels}.items()))
        return next(v for (_, sample, found), v in samples.items() if sample == name and found == wanted)

    assert value("vllm:prefix_cache_hits_total") == 288
    assert value("vllm:prompt_tokens_cached_by_source_total", source="device") == 288
    assert value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 288
    assert emulated.answers["prefill_completion"]["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0


def test_not_modelled_lists_only_recorded_families() -> None:
    recorded = set(families(recorded_metrics("prefill"))) | set(families(recorded_metrics("decode")))
    stale = sorted(set(NOT_MODELLED) - recorded)
    assert not stale, f"NOT_MODELLED names families no recording has: {stale}"


def test_an_engine_without_a_kv_connector_has_no_connector_families(emulated: Session) -> None:
    plain = families(emulated.metrics["plain"])
    real = families(recorded_metrics("prefill"))
    assert not [name for name in plain if name.startswith("vllm:nixl_")], "vLLM registers NIXL's only with it"
    invented = [name for name in plain if name not in real or (plain[name].kind, plain[name].labels) != (
        real[name].kind, real[name].labels)]
    assert not invented, f"families real vLLM has not (or with another type or labels): {invented}"


@pytest.mark.parametrize("role", ROLES)
def test_enumerating_labels_take_real_vllms_values(emulated: Session, role: str) -> None:
    real, emulator = families(recorded_metrics(role)), families(emulated.metrics[role])
    problems = []
    for name, family in emulator.items():
        for label, values in family.values.items():
            if label not in ("model_name", "engine") and values != real[name].values[label]:
                problems.append(f"{name}{{{label}}}: {sorted(values)}, real vLLM's: {sorted(real[name].values[label])}")
    assert not problems, "\n".join(problems)


def project_reads() -> dict[str, set[str]]:
    """The `vllm:` sample names the project reads, with where: the autoscaler's queries, and every name
    written out in the autoscaler, the proxy, the drain hook and the chart."""
    reads: dict[str, set[str]] = {}
    for query in queries(Scope("ns", "serving")).values():
        for name in re.findall(r"vllm:[A-Za-z0-9_:]+", query):
            reads.setdefault(name, set()).add("autoscaler queries")
    reads.setdefault(FAILED_TRANSFERS_SAMPLE, set()).add("proxy kvhealth")
    sources = [*ROOT.glob("operator/xpyd/autoscaler/*.py"), *ROOT.glob("operator/xpyd/proxy/*.py"),
               ROOT / "operator/xpyd/render/drain.py",
               *(path for path in ROOT.glob("charts/**/*") if path.suffix in (".yaml", ".json", ".tpl"))]
    for path in sources:
        for name in re.findall(r"vllm:[A-Za-z0-9_:]+", path.read_text()):
            reads.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return reads


def test_the_families_the_project_reads_are_in_real_vllm_and_the_emulator(emulated: Session) -> None:
    reads = project_reads()
    assert {"vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
            "vllm:nixl_num_failed_transfers_total", "vllm:request_success_total"} <= set(reads)
    problems = []
    for role in ROLES:
        exposed = {"real vLLM": families(recorded_metrics(role)), "the emulator": families(emulated.metrics[role])}
        for name, where in sorted(reads.items()):
            for who, found in exposed.items():
                if resolve(name, found) is None:
                    problems.append(f"{name} (read by {', '.join(sorted(where))}): not in {who}'s {role} exposition")
    assert not problems, "\n".join(problems)


def test_the_proxy_reads_the_emulated_and_the_real_failed_transfers_alike(emulated: Session) -> None:
    for role in ROLES:
        for text in (recorded_metrics(role), emulated.metrics[role]):
            list(text_string_to_metric_families(text))   # prometheus_client's parser, the proxy's, takes both
            assert failed_transfers(text) == 0
    assert failed_transfers(emulated.metrics["plain"]) is None


# --- the API --------------------------------------------------------------------------------------------

def shape(value: Any) -> Any:
    """A JSON value's shape: an object's keys with their shapes, a list's element shapes (merged), or a
    scalar's JSON type."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        shapes = []
        for item in value:
            if shape(item) not in shapes:
                shapes.append(shape(item))
        return shapes
    return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}[type(value)]


def differences(real: Any, emulated: Any, path: str = "", allowed: frozenset[str] = frozenset()) -> list[str]:
    """Where `emulated` does not have `real`'s shape; extra keys at paths in `allowed` are fine."""
    real_shape, emulated_shape = shape(real), shape(emulated)
    if isinstance(real_shape, dict) and isinstance(emulated_shape, dict):
        out = [f"{path}.{key}: missing" for key in real_shape if key not in emulated_shape]
        out += [f"{path}.{key}: not in real vLLM" for key in emulated_shape
                if key not in real_shape and f"{path}.{key}".lstrip(".") not in allowed]
        for key in real_shape.keys() & emulated_shape.keys():
            out += differences(real[key], emulated[key], f"{path}.{key}", allowed)
        return out
    if isinstance(real_shape, list) and isinstance(emulated_shape, list):
        out = []
        for real_item in real or []:
            for emulated_item in emulated or []:
                out += differences(real_item, emulated_item, f"{path}[]", allowed)
        return out
    return [] if real_shape == emulated_shape else [f"{path}: {emulated_shape}, real vLLM's {real_shape}"]


def events(sse: str) -> list[Any]:
    """The events of an SSE body: JSON objects, then the `[DONE]` marker (as the string)."""
    out: list[Any] = []
    for block in sse.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_kv_transfer_params_have_the_recorded_keys_and_types(emulated: Session) -> None:
    recorded = recorded_responses()
    extra = {path.split(".", 1)[1] for path in ALLOWED if path.startswith("kv_transfer_params.")}
    for real_name, name in (("prefill_completion_0", "prefill_completion"), ("prefill_completion_1",
                                                                             "prefill_completion"),
                            ("prefill_chat", "prefill_chat")):
        real = recorded[real_name]["kv_transfer_params"]
        params = emulated.answers[name]["kv_transfer_params"]
        assert set(params) == set(real) | extra, (sorted(set(params) - set(real)), sorted(set(real) - set(params)))
        problems = [f"{key}: {shape(params[key])}, real vLLM's {shape(real[key])}" for key in real
                    if shape(params[key]) != shape(real[key])]
        assert not problems, "\n".join(problems)
        # vLLM's internal request id: the response id, the prompt index for completions, 8 random hex digits.
        suffix = "" if name == "prefill_chat" else "-0"
        for params_ in (real, params):
            assert re.fullmatch(r"(chat)?cmpl-[0-9a-f]{16}" + suffix + r"-[0-9a-f]{8}", params_["remote_request_id"])


@pytest.mark.parametrize(("real_name", "name"), [
    ("prefill_completion_0", "prefill_completion"),
    ("decode_completion_stream=False", "decode_completion"),
    ("prefill_chat", "prefill_chat"),
    ("single_0", "single"),
    ("/v1/models", "models"),
])
def test_answers_have_the_recorded_shape(emulated: Session, real_name: str, name: str) -> None:
    real = recorded_responses()[real_name]
    answer = emulated.answers[name]
    problems = differences(json.loads(real) if isinstance(real, str) else real, answer, allowed=ALLOWED)
    assert not problems, "\n".join(problems)
    if "id" in answer:   # vLLM's random_uuid(): 16 hex digits
        assert re.fullmatch(r"(chatcmpl|cmpl)-[0-9a-f]{16}", answer["id"]), answer["id"]


@pytest.mark.parametrize(("real_name", "name"), [
    ("decode_completion_stream=True", "decode_completion_stream"),
    ("decode_chat_stream", "decode_chat_stream"),
])
def test_streams_have_the_recorded_events(emulated: Session, real_name: str, name: str) -> None:
    real, emulator = events(recorded_responses()[real_name]), events(emulated.answers[name])
    assert real[-1] == emulator[-1] == "[DONE]"
    # The first event, the middle ones and the last (finished) one, each like its recorded peer.
    pairs = [(real[0], emulator[0]), (real[-2], emulator[-2])]
    pairs += [(real[i], emulator[i]) for i in range(1, min(len(real), len(emulator)) - 2)]
    problems = {problem for real_event, emulated_event in pairs
                for problem in differences(real_event, emulated_event, allowed=ALLOWED)}
    assert not problems, "\n".join(sorted(problems))


@pytest.mark.parametrize("name", ["bad_model", "too_long"])
def test_errors_are_real_vllms_to_the_letter(emulated: Session, name: str) -> None:
    status, body = recorded_responses()[name]
    assert emulated.answers[name] == [status, json.loads(body)]


def test_what_the_emulator_adds_over_0_32_is_in_vllm_0_33_only() -> None:
    new, old = release_root(EMULATED_VLLM_VERSION), release_root("0.32.0")
    problems = []
    for path, places in ADDED_IN_0_33.items():
        for source, text in places:
            if text not in (new / source).read_text():
                problems.append(f"{path}: {text!r} is not in {EMULATED_VLLM_VERSION}'s {source}")
            if (old / source).is_file() and text in (old / source).read_text():
                problems.append(f"{path}: {text!r} is in 0.32's {source} already (then the recording has it)")
    assert not problems, "\n".join(problems)
