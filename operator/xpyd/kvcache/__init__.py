"""vLLM's prefix cache as a model: which prompt blocks an engine already holds, and which it evicts.

A leaf (it imports only `xpyd.common`), shared by the simulator's engines and, as they come to use
it, the engine emulator and the proxy's router:

- `pool`: the block pool of one engine (`BlockPool`): blocks keyed by a hash chain, reference-counted
  while requests hold them, free ones evicted in vLLM's free-queue order, capacity shared with the
  requests running; a request's keys come in runs (`BlockKeys`), which it keeps and evicts together
  where vLLM's pool treats their blocks alike.
- `chains`: the simulator's cheap keys, runs of integer chain ids made from a trace's prefix block ids
  (Mooncake's `hash_ids`) for the engine's block size (`TraceKeys`).
- `hashing`: vLLM's own keys for real token ids (`hash_block_tokens` with `--prefix-caching-hash-algo`),
  a run of one block each (`BlockKeys.of`).
"""

from xpyd.common.native import package_path

__path__ = package_path(__name__, __path__)   # the compiled build first, when it matches the sources
