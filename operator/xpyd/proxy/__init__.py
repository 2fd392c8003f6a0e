"""The xPyD routing proxy (`xpyd proxy`): an OpenAI-compatible front that sends each request to a
prefill engine, then to a decode engine with the KV hand-off parameters, and relays the answer.

Modules, in the order a request meets them: `validation` (client request checks), `pool` and
`picking` (instances and the routing policy), `protocol` (what each connector's legs carry),
`server` (the aiohttp server, retries, probes), `breaker`, `metrics`, `discovery` (fixed URLs or
Kubernetes pods), `p2pnccl` (P2pNcclConnector registration), `main` (the command line).
`stubengine` is a minimal engine speaking the same protocol, for the benchmark and tests.
"""
