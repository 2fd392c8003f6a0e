"""`xpyd engine-sim`: one process that behaves like one vLLM engine on the wire, in real time.

The engine is an `EngineCore` (the continuous-batching model the cluster simulator uses) driven by
the wall clock, behind an aiohttp server with vLLM 0.33's OpenAI-compatible surface, `/metrics` and,
with a KV connector, NixlConnector's P/D hand-off. What it answers and when -- time and `--time-scale`,
the wire behaviour, P/D, the prefix cache and KV events -- is specified in docs/emulator.md;
tests/conformance/ holds it to real vLLM.
"""


# Modules: `config` (arguments and the scaled performance model), `engine` (the real-time engine),
# `tokens` (token ids without a tokenizer), `wire` (request parsing and response bodies), `http` (the
# aiohttp server), `exposition` (`/metrics`), `kvevents` (KV events and their ZMQ publisher), `main`
# (the command line; `python -m xpyd.sim.emulator`).
