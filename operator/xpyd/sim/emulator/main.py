"""`xpyd engine-sim`'s command line: a pod's `vllm serve` arguments to an `EmulatorConfig`, then serve."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from xpyd import vllm
from xpyd.common.netguard import NonLoopbackAddress
from xpyd.kvcache.hashing import hash_function
from xpyd.perf.model import DEFAULT_PROFILE
from xpyd.sim.core import EnginePerf
from xpyd.sim.emulator.config import (
    BLOCK_SIZE,
    DEFAULT_LINK_GBPS,
    DEFAULT_MODEL,
    DEFAULT_SIDE_CHANNEL_PORT,
    EmulatorConfig,
    KVEventsConfig,
    env_flag,
)
from xpyd.sim.emulator.group import GroupFailed, GroupLeader, GroupSpec, run_worker
from xpyd.sim.emulator.http import start_server
from xpyd.sim.emulator.kvevents import local_endpoint

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """`xpyd engine-sim` options: DESIGN's contract plus the `vllm serve` arguments the operator renders."""
    parser = argparse.ArgumentParser(
        prog="xpyd engine-sim", description="Emulate one vLLM engine (OpenAI API, vllm:* metrics, NIXL P/D "
        "hand-off) in real time. Accepts a pod's `vllm serve` arguments unchanged; other vLLM flags are "
        "ignored with a warning.")
    parser.add_argument("model", nargs="?", default=None, help=f"model name or path (default {DEFAULT_MODEL})")
    parser.add_argument("--model", dest="model_option", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["prefill", "decode"], help="P/D role (NixlConnector kv_producer or "
                        "kv_consumer) when no --kv-transfer-config says it")
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="performance profile prefix "
                        "(PREFIX_prefill.csv, PREFIX_decode.csv; default: the bundled H200 Llama-3.1-8B FP8 one)")
    parser.add_argument("--host", default=os.environ.get("POD_IP") or "127.0.0.1",
                        help="loopback address to bind (default $POD_IP, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--served-model-name", nargs="+", default=None, help="names the API accepts and answers "
                        "with (default: the model)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="reported as tp_size")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="accepted, not modelled")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="accepted; one engine is emulated")
    parser.add_argument("--max-model-len", type=_token_count, default=131072, help="context limit (e.g. 8192, 32k)")
    parser.add_argument("--revision", default=None, help="accepted, not used")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0, help="seconds SIGTERM waits for in-flight "
                        "requests and held KV (default 0: abort at once)")
    parser.add_argument("--kv-transfer-config", default=None, help="vLLM KVTransferConfig JSON (kv_role, "
                        "kv_load_failure_policy, engine_id, kv_connector_extra_config.kv_lease_duration)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV dtype for the transfer size (auto = bf16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="running-request limit")
    parser.add_argument("--max-kv-tokens", type=int, default=None, help="KV capacity in tokens (default: the "
                        "profile's)")
    parser.add_argument("--kv-lease-s", type=float, default=None, help="modelled seconds a prefill engine holds "
                        "unclaimed KV (default: the connector's kv_lease_duration, else 30)")
    parser.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS, help="prefill-to-decode link in "
                        f"Gb/s for the KV transfer time (default {DEFAULT_LINK_GBPS:g})")
    parser.add_argument("--startup-delay-s", type=float, default=0.0, help="modelled seconds of 'loading' "
                        "(503 on /health) before serving")
    parser.add_argument("--time-scale", type=float, default=1.0, help="run K times faster than real time: every "
                        "modelled duration is divided by K")
    parser.add_argument("--seed", type=int, default=None, help="seed of the engine id and block ids")
    cache = parser.add_argument_group("prefix cache and KV events (vLLM's flags)")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=vllm.PREFIX_CACHING_DEFAULT, help="keep prompt blocks for later requests (vLLM's "
                       "default: on)")
    cache.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"tokens per KV block (default "
                       f"{BLOCK_SIZE}, vLLM's on GPUs)")
    cache.add_argument("--prefix-caching-hash-algo", choices=vllm.PREFIX_CACHING_HASH_ALGOS,
                       default=vllm.PREFIX_CACHING_HASH_ALGOS[0],
                       help="block hash (default sha256; the xxhash ones need the xxhash package)")
    cache.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV blocks of the engine, "
                       "vLLM's null block among them: the KV capacity is (N - 1) x --block-size tokens "
                       "(overrides --max-kv-tokens)")
    cache.add_argument("--kv-events-config", default=None, help="vLLM KVEventsConfig JSON (enable_kv_cache_events, "
                       "publisher, endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic)")
    cache.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
                       help="usage.prompt_tokens_details (cached_tokens) in answers")
    parser.add_argument("--data-parallel-rank", "-dpn", type=int, default=0, help="this engine's data-parallel "
                        "rank: offsets the KV events ports and is stamped on their batches")
    group = parser.add_argument_group("multi-node engine (vLLM's multiprocessing launch)")
    group.add_argument("--nnodes", "-n", type=int, default=1, help="nodes of the engine (default 1)")
    group.add_argument("--node-rank", "-r", type=int, default=0, help="this node's rank; 0 runs the API server")
    group.add_argument("--master-addr", default="127.0.0.1", help="the first node's address (loopback here)")
    group.add_argument("--master-port", type=int, default=29501, help="where the first node waits for the others")
    group.add_argument("--headless", action="store_true", help="a node without API server (node rank above 0)")
    group.add_argument("--data-parallel-rpc-port", type=int, default=None, help="accepted, not used")
    return parser


def _token_count(text: str) -> int:
    """An integer, or vLLM's human-readable form (32k, 1m; k = 1000, K = 1024)."""
    factors = {"k": 1000, "m": 1_000_000, "K": 1024, "M": 1024 * 1024}
    try:
        if text and text[-1] in factors:
            return int(float(text[:-1]) * factors[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None


DOTTED = ("--kv-transfer-config", "--kv-events-config")
"""The JSON flags whose fields vLLM also takes one by one (`--flag.KEY VALUE`)."""


def _split_dotted(argv: Sequence[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Take `--kv-transfer-config.KEY VALUE` / `=VALUE` (vLLM's dotted form, for each of `DOTTED`) out
    of argv: (the rest, the fields by flag)."""
    rest: list[str] = []
    dotted: dict[str, dict[str, Any]] = {flag: {} for flag in DOTTED}
    items = iter(argv)
    for arg in items:
        flag = next((f for f in DOTTED if arg.startswith(f + ".")), None)
        if flag is None:
            rest.append(arg)
            continue
        key, _, value = arg[len(flag) + 1:].partition("=")
        if not _:
            value = next(items, "")
        try:
            dotted[flag][key] = json.loads(value)
        except ValueError:
            dotted[flag][key] = value
    return rest, dotted


def _json_flag(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{flag} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def group_from_args(argv: Sequence[str]) -> GroupSpec | None:
    """The multi-node launch the arguments ask for (None for a one-node engine). Raises ValueError."""
    args, _ = build_parser().parse_known_args(_split_dotted(argv)[0])
    if args.nnodes == 1 and not args.headless:
        return None
    spec = GroupSpec(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                     master_port=args.master_port, headless=args.headless)
    spec.check()
    return spec


def config_from_args(argv: Sequence[str]) -> tuple[EmulatorConfig, EnginePerf, list[str]]:
    """Parse `xpyd engine-sim` arguments: (config, performance model, ignored vLLM arguments).

    Raises ValueError, OSError (profile) or KeyError (KV dtype); argparse exits on --help and bad flags.
    """
    from xpyd.perf.model import PerfModel

    argv, dotted = _split_dotted(argv)
    args, ignored = build_parser().parse_known_args(argv)
    kv = _json_flag(args.kv_transfer_config, "--kv-transfer-config")
    kv.update(dotted["--kv-transfer-config"])
    events = _json_flag(args.kv_events_config, "--kv-events-config")
    events.update(dotted["--kv-events-config"])
    kv_events = KVEventsConfig.parse(events)
    for endpoint in (kv_events.endpoint, kv_events.replay_endpoint) if kv_events.publishes else ():
        if endpoint is not None:
            local_endpoint(endpoint, args.host)   # refuses what it cannot bind or dial now
    if args.enable_prefix_caching:
        try:
            hash_function(args.prefix_caching_hash_algo)("")
        except ModuleNotFoundError as error:
            raise ValueError(f"--prefix-caching-hash-algo {args.prefix_caching_hash_algo}: {error}") from None
    max_kv_tokens = args.max_kv_tokens
    if args.num_gpu_blocks_override is not None:
        if args.num_gpu_blocks_override < 2:
            raise ValueError("--num-gpu-blocks-override must be at least 2 (one is vLLM's null block)")
        max_kv_tokens = (args.num_gpu_blocks_override - 1) * args.block_size
    kv_role = kv.get("kv_role")
    role_of = {"prefill": "kv_producer", "decode": "kv_consumer"}
    if args.role is not None:
        if kv_role not in (None, "kv_both", role_of[args.role]):
            raise ValueError(f"--role {args.role} contradicts kv_role {kv_role} in --kv-transfer-config")
        kv_role = kv_role or role_of[args.role]
    elif kv and kv_role is None:
        raise ValueError("--kv-transfer-config needs kv_role once a connector is set")
    connector = kv.get("kv_connector", "NixlConnector")
    if kv_role is not None and connector not in ("NixlConnector", "NixlPullConnector"):
        log.warning("kv_connector %s: only the NixlConnector pull protocol is emulated", connector)
    if args.data_parallel_size > 1:
        log.warning("--data-parallel-size %d: one engine is emulated", args.data_parallel_size)
    if not args.link_gbps > 0:
        raise ValueError("--link-gbps must be positive")
    extra = kv.get("kv_connector_extra_config") or {}
    lease = args.kv_lease_s if args.kv_lease_s is not None else float(extra.get("kv_lease_duration", 30.0))
    side_port = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    model = args.model or args.model_option or DEFAULT_MODEL
    served = tuple(args.served_model_name or ())
    kv_bytes = _kv_bytes_per_token(model, served, args.kv_cache_dtype)
    config = EmulatorConfig(
        model=model, served_model_names=served, host=args.host, port=args.port, kv_role=kv_role,
        kv_load_failure_policy=kv.get("kv_load_failure_policy", "fail"), engine_id=kv.get("engine_id"),
        side_channel_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or None,
        side_channel_port=int(side_port) if side_port else DEFAULT_SIDE_CHANNEL_PORT,
        tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_kv_tokens=max_kv_tokens, kv_lease_s=lease, kv_bytes_per_token=kv_bytes, time_scale=args.time_scale,
        startup_delay_s=args.startup_delay_s, shutdown_timeout_s=args.shutdown_timeout, seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details, kv_events=kv_events,
        kv_events_int_hashes=env_flag("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", vllm.KV_EVENTS_INT_BLOCK_HASHES_DEFAULT),
        data_parallel_rank=args.data_parallel_rank)
    perf = PerfModel.from_profile(args.profile).with_kv_transfer(kv_bytes, args.link_gbps)
    return config, perf, ignored


def _kv_bytes_per_token(model: str, served: tuple[str, ...], kv_cache_dtype: str) -> int:
    """KV bytes per token of the first known name among the model and its served names (else the
    bundled profile's Llama-3.1-8B), in the KV dtype (`auto`: bf16)."""
    from xpyd.perf.shapes import lookup_model

    dtype = "fp8" if kv_cache_dtype.startswith("fp8") else {"auto": "bf16", "bfloat16": "bf16",
                                                             "float16": "fp16"}.get(kv_cache_dtype, kv_cache_dtype)
    for name in (model, *served):
        with contextlib.suppress(KeyError):
            return lookup_model(name).kv_bytes_per_token(dtype)
    return lookup_model("llama-3.1-8b").kv_bytes_per_token(dtype)


async def serve(config: EmulatorConfig, perf: EnginePerf, group: GroupSpec | None = None) -> None:
    """Run one engine until SIGTERM or SIGINT, then drain it (see `EmulatorServer.drain`). With a
    `group`, the leader serves once every worker joined; GroupFailed when the group breaks."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        if group is not None and group.headless:
            log.info("engine-sim headless node %d of %d (leader %s:%d)", group.node_rank, group.nnodes,
                     group.master_addr, group.master_port)
            await run_worker(group, stop)
            return
        await _serve(config, perf, group, stop)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def _serve(config: EmulatorConfig, perf: EnginePerf, group: GroupSpec | None, stop: asyncio.Event) -> None:
    leader = GroupLeader(group) if group is not None else None
    if leader is not None:
        await leader.start()
    server = await start_server(config, perf)
    engine = server.engine
    if leader is not None:
        engine.not_ready_reason = lambda: leader.waiting_for
    host, port = engine.side_channel
    log.info("engine-sim %s (%s) serving %s on %s; NIXL side channel %s; time scale %g; ready in %.1f s",
             engine.engine_id, config.role, config.model_name, server.url,
             f"{host}:{port}" if config.kv_role else "off", config.time_scale, engine.loading_left_s)
    waits = [asyncio.ensure_future(stop.wait())]
    if leader is not None:
        waits.append(asyncio.ensure_future(leader.failed.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if leader is not None and leader.failed.is_set() and not stop.is_set():
            raise GroupFailed(leader.failure)
        log.info("engine-sim draining (shutdown timeout %g s)", config.shutdown_timeout_s)
        await server.drain()
    finally:
        for wait in waits:
            wait.cancel()
        await server.close()
        if leader is not None:
            await leader.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`xpyd engine-sim ARGS`: exit 0 after a graceful stop, 2 on a bad configuration, 1 if it cannot bind
    or its multi-node group broke."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config, perf, ignored = config_from_args(argv)
        group = group_from_args(argv)
    except (ValueError, OSError, KeyError, NonLoopbackAddress) as error:
        sys.stderr.write(f"xpyd engine-sim: {error}\n")
        return 2
    if ignored:
        log.warning("ignoring vLLM arguments the emulator does not model: %s", " ".join(ignored))
    try:
        asyncio.run(serve(config, perf, group))
    except GroupFailed as error:  # vLLM's engine dies with a rank of its group
        sys.stderr.write(f"xpyd engine-sim: {error}\n")
        return 1
    except (ValueError, RuntimeError) as error:   # a configuration the engine cannot run (pyzmq missing, a
        sys.stderr.write(f"xpyd engine-sim: {error}\n")   # KV events endpoint outside loopback)
        return 2
    except OSError as error:      # cannot bind
        sys.stderr.write(f"xpyd engine-sim: {error}\n")
        return 1
    return 0


def add_parser(subparsers: Any) -> None:
    """Register `xpyd engine-sim`. Its arguments pass through untouched (a pod's `vllm serve` arguments
    include flags only vLLM knows) and are parsed by `run`, which prints its own `--help`."""
    command = subparsers.add_parser("engine-sim", help="emulate one vLLM engine (OpenAI API, vllm:* metrics, "
                                    "NIXL P/D hand-off) in real time", add_help=False, prefix_chars="\0")
    command.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    command.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`xpyd engine-sim`, from `add_parser`'s namespace."""
    return main(list(args.argv))


