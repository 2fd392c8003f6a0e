"""The xPyD routing proxy (`xpyd proxy`): an OpenAI-compatible front that sends each request to a
prefill engine, then to a decode engine with the KV hand-off parameters, and relays the answer.

Modules, in the order a request meets them: `validation` (client request checks), `pool` and
`picking` (instances and the routing policy), `pairing` (which prefill and decode instances may
serve a request together), `kvaware` (the KVAware routing policy, whose Events index `kvevents`
fills from the engines' KV events), `protocol` and `legs` (what each connector's legs carry),
`server` (the aiohttp server and retries), `health` and `kvhealth` (upstream health, and KV-transfer
health: hand-offs failing per pair), `breaker`, `metrics`, `waiting` (requests held while a pool is
at zero), `discovery` (fixed URLs or Kubernetes pods), `p2pnccl` (P2pNcclConnector registration),
`podreport` (what the proxy reports on its own Pod), `main` (the command line).
`xpyd.testing.stubengine` is a minimal engine speaking the same protocol, for the benchmark and tests.
"""
