"""DisaggregatedServing objects for the tests: `serving()`, a minimal valid object, and the API's
cases, which tests/unit/test_api.py checks against the models and the CRD's CEL rules and
e2e/test_e2e.py against a real API server."""

from __future__ import annotations

from typing import Any


def serving(spec: dict[str, Any] | None = None, name: str = "llama") -> dict[str, Any]:
    """A minimal valid object with `spec` merged over it (one level deep per top-level key)."""
    base: dict[str, Any] = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}}
    for key, value in (spec or {}).items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "xpyd.io/v1alpha1", "kind": "DisaggregatedServing",
            "metadata": {"name": name, "namespace": "default"}, "spec": base}


VALID = {
    "minimal": serving(),
    "scale to zero": serving({"autoscaling": {"mode": "Auto", "prometheus": {"url": "http://p:9090"},
                                              "prefill": {"minReplicas": 0}, "decode": {"minReplicas": 0},
                                              "scaleToZero": {"idleSeconds": 900, "waitSeconds": 400}}}),
    "nixl hetero tp": serving({"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 4}}),
    "nixl push 0.24": serving({"kvTransfer": {"connector": "NixlPushConnector"}, "engine": {"vllmVersion": "0.24"}}),
    "p2pnccl 0.23": serving({"kvTransfer": {"connector": "P2pNcclConnector"}, "engine": {"vllmVersion": "0.23.1"}}),
    "oldest version 0.10": serving({"engine": {"vllmVersion": "0.10"}}),
    "gpu count explicit": serving({"prefill": {"tensorParallelSize": 4, "dataParallelSize": 2,
                                               "gpu": {"count": 8}}}),
    "lmcache": serving({"kvTransfer": {"connector": "LMCacheConnectorV1",
                                       "lmcache": {"configMapRef": {"name": "cfg"}}}}),
    "nixl mooncake backend": serving({"kvTransfer": {"nixl": {"backends": ["Mooncake", "UCX"]}}}),
    "mooncake 0.16": serving({"kvTransfer": {"connector": "MooncakeConnector"}, "engine": {"vllmVersion": "0.16"}}),
    "gpu nic mapping 0.23": serving({"engine": {"vllmVersion": "0.23"}, "kvTransfer": {"rdma": {
        "gpuNicMapping": [{"gpu": "0000:18:00.0", "nic": "0000:19:00.0"}, {"gpu": "2a:00.0", "nic": "2b:00.1"}]}}}),
    "mooncake block": serving({"kvTransfer": {"connector": "MooncakeConnector", "mooncake": {"protocol": "tcp"}}}),
    "auto": serving({"autoscaling": {"mode": "Auto", "prometheus": {"url": "http://p:9090"}, "gpuBudget": 2}}),
    "prometheus token and ca secret": serving({"autoscaling": {"mode": "Auto", "prometheus": {
        "url": "https://thanos-querier.openshift-monitoring:9091", "bearerTokenSecretRef": {"name": "reader"},
        "tls": {"caSecretRef": {"name": "prom-ca", "key": "tls.ca"}}}}}),
    "react off at the shortest interval": serving({"autoscaling": {"intervalSeconds": 5, "reactSeconds": 0}}),
    "react just under the interval": serving({"autoscaling": {"intervalSeconds": 10, "reactSeconds": 9}}),
    "react at the shortest interval by default (never acts)": serving({"autoscaling": {"intervalSeconds": 5}}),
    "react above the interval (never acts)": serving({"autoscaling": {"intervalSeconds": 30, "reactSeconds": 40}}),
    "prometheus ca configmap": serving({"autoscaling": {"prometheus": {
        "url": "https://p:9090", "tls": {"caConfigMapRef": {"name": "kube-root-ca.crt"}}}}}),
    "prometheus insecure": serving({"autoscaling": {"prometheus": {"url": "https://p:9090",
                                                                   "tls": {"insecureSkipVerify": True}}}}),
    "prometheus empty tls": serving({"autoscaling": {"prometheus": {"url": "https://p:9090", "tls": {}}}}),
    "prometheus token over http": serving({"autoscaling": {"prometheus": {
        "url": "http://p:9090", "bearerTokenSecretRef": {"name": "reader", "key": "t"}}}}),
    "pvc": serving({"model": {"name": "m", "source": {"pvc": {"claimName": "models"}}}}),
    "env valueFrom": serving({"engine": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s",
                                                                                          "key": "k"}}}]}}),
    "name 55": serving(name="a" * 55),
    "multi-node tp": serving({"decode": {"nodesPerReplica": 2, "tensorParallelSize": 16,
                                         "topologyKey": "nvidia.com/gpu.clique"}}),
    "multi-node dp": serving({"prefill": {"nodesPerReplica": 2, "dataParallelSize": 16, "gpu": {"count": 8}},
                              "decode": {"nodesPerReplica": 4, "dataParallelSize": 8, "tensorParallelSize": 4}}),
    "multi-node 0.12": serving({"engine": {"vllmVersion": "0.12"}, "prefill": {"nodesPerReplica": 2,
                                                                               "tensorParallelSize": 2}}),
    "nixl prefill pp 0.32": serving({"engine": {"vllmVersion": "0.32"}, "prefill": {"pipelineParallelSize": 2}}),
    "multi-node budget": serving({"prefill": {"nodesPerReplica": 2, "tensorParallelSize": 2},
                                  "autoscaling": {"gpuBudget": 3}}),
    "cpu pool": serving({"engine": {"device": "cpu", "cpu": {"kvCacheSpaceGiB": 8, "threadsBind": "0-15|16-31"}},
                         "kvTransfer": {"bufferDevice": "cpu"}, "prefill": {"resources": {"cpu": "16"}}}),
    "cpu pool push": serving({"engine": {"device": "cpu", "cpu": {"threadsBind": "nobind"}},
                              "kvTransfer": {"connector": "NixlPushConnector"}}),
    "gpu pool host buffer": serving({"kvTransfer": {"bufferDevice": "cpu"}}),
    "kvaware events": serving({"proxy": {"routingPolicy": "KVAware"}}),
    "kvaware events sha256_cbor": serving({"proxy": {"routingPolicy": "KVAware"}, "engine": {
        "extraArgs": ["--prefix-caching-hash-algo", "sha256_cbor"]}}),
    "kvaware events 0.24 seeded": serving({"proxy": {"routingPolicy": "KVAware"}, "engine": {
        "vllmVersion": "0.24", "env": [{"name": "PYTHONHASHSEED", "value": "random"}]}}),
    "kvaware routed xxhash 0.24": serving({"proxy": {"routingPolicy": "KVAware", "kvAware": {"index": "Routed"}},
                                          "engine": {"vllmVersion": "0.24",
                                                     "extraArgs": ["--prefix-caching-hash-algo=xxhash"]},
                                          "decode": {"env": [{"name": "PYTHONHASHSEED", "valueFrom": {
                                              "secretKeyRef": {"name": "s", "key": "k"}}}]}}),
}

# (case, object, message the models and the CRD's CEL rule both give)
INVALID = [
    ("gpu count mismatch", serving({"prefill": {"tensorParallelSize": 2, "gpu": {"count": 4}}}),
     "gpu.count must equal tensorParallelSize x pipelineParallelSize x dataParallelSize"),
    ("nixl tp not dividing", serving({"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 3}}),
     "prefill and decode tensorParallelSize are incompatible with the connector"),
    ("mooncake tp not dividing", serving({"kvTransfer": {"connector": "MooncakeConnector"},
                                          "prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 6}}),
     "prefill and decode tensorParallelSize are incompatible with the connector"),
    ("p2pnccl tp unequal", serving({"kvTransfer": {"connector": "P2pNcclConnector"}, "engine": {"vllmVersion": "0.23"},
                                    "prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 4}}),
     "prefill and decode tensorParallelSize are incompatible with the connector"),
    ("mooncake on 0.15", serving({"kvTransfer": {"connector": "MooncakeConnector"},
                                  "engine": {"vllmVersion": "0.15.1"}}),
     "MooncakeConnector needs engine.vllmVersion >= 0.16"),
    ("mooncake on 0.13", serving({"kvTransfer": {"connector": "MooncakeConnector"}, "engine": {"vllmVersion": "0.13"}}),
     "MooncakeConnector needs engine.vllmVersion >= 0.16"),
    ("mooncake device name on 0.24", serving({"kvTransfer": {"connector": "MooncakeConnector",
                                                             "mooncake": {"deviceName": "mlx5_0"}},
                                              "engine": {"vllmVersion": "0.24"}}),
     "kvTransfer.mooncake.deviceName needs engine.vllmVersion >= 0.32"),
    ("gpu nic mapping on 0.22", serving({"engine": {"vllmVersion": "0.22"}, "kvTransfer": {"rdma": {
        "gpuNicMapping": [{"gpu": "18:00.0", "nic": "19:00.0"}]}}}),
     "kvTransfer.rdma.gpuNicMapping needs engine.vllmVersion >= 0.23"),
    ("gpu nic mapping twice", serving({"kvTransfer": {"rdma": {"gpuNicMapping": [
        {"gpu": "18:00.0", "nic": "19:00.0"}, {"gpu": "18:00.0", "nic": "2b:00.0"}]}}}),
     "kvTransfer.rdma.gpuNicMapping lists a GPU more than once"),
    ("p2pnccl on 0.24", serving({"kvTransfer": {"connector": "P2pNcclConnector"}, "engine": {"vllmVersion": "0.24"}}),
     "P2pNcclConnector was removed in vLLM 0.24"),
    ("p2pnccl on 1.0", serving({"kvTransfer": {"connector": "P2pNcclConnector"}, "engine": {"vllmVersion": "1.0"}}),
     "P2pNcclConnector was removed in vLLM 0.24"),
    ("nixl push on 0.23",
     serving({"kvTransfer": {"connector": "NixlPushConnector"}, "engine": {"vllmVersion": "0.23"}}),
     "NixlPushConnector needs engine.vllmVersion >= 0.24"),
    ("version too old", serving({"engine": {"vllmVersion": "0.9.2"}}),
     "engine.vllmVersion must be at least 0.10"),
    ("min above max", serving({"autoscaling": {"decode": {"minReplicas": 5, "maxReplicas": 2}}}),
     "minReplicas must not exceed maxReplicas"),
    ("zero on one role", serving({"autoscaling": {"prefill": {"minReplicas": 0}}}),
     "minReplicas 0 scales the pool to zero, which takes both roles"),
    ("idle window under an interval", serving({"autoscaling": {"intervalSeconds": 60,
                                                               "scaleToZero": {"idleSeconds": 30}}}),
     "autoscaling.scaleToZero.idleSeconds must be at least intervalSeconds"),
    ("wait not above start-up", serving({"autoscaling": {"startupSeconds": 300, "scaleToZero": {"waitSeconds": 300}}}),
     "autoscaling.scaleToZero.waitSeconds must exceed startupSeconds"),
    ("lmcache without settings", serving({"kvTransfer": {"connector": "LMCacheConnectorV1"}}),
     "LMCacheConnectorV1 needs kvTransfer.lmcache.configMapRef"),
    ("mooncake block with nixl", serving({"kvTransfer": {"mooncake": {}}}),
     "kvTransfer.mooncake applies only to MooncakeConnector"),
    ("nixl block with mooncake", serving({"kvTransfer": {"connector": "MooncakeConnector", "nixl": {}}}),
     "kvTransfer.nixl applies only to NixlConnector or NixlPushConnector"),
    ("p2p block with nixl", serving({"kvTransfer": {"p2pNccl": {}}}),
     "kvTransfer.p2pNccl applies only to P2pNcclConnector"),
    ("cpu buffer with mooncake", serving({"kvTransfer": {"connector": "MooncakeConnector", "bufferDevice": "cpu"}}),
     "bufferDevice cpu (host-buffer mode) is supported only by the NIXL connectors"),
    ("auto without prometheus", serving({"autoscaling": {"mode": "Auto"}}),
     "autoscaling.prometheus.url is required when mode is Recommend or Auto"),
    ("prometheus two CAs", serving({"autoscaling": {"prometheus": {"url": "https://p:9090", "tls": {
        "caSecretRef": {"name": "a"}, "caConfigMapRef": {"name": "b"}}}}}),
     "autoscaling.prometheus.tls takes at most one of caSecretRef, caConfigMapRef and insecureSkipVerify"),
    ("prometheus CA and insecure", serving({"autoscaling": {"prometheus": {"url": "https://p:9090", "tls": {
        "caConfigMapRef": {"name": "b"}, "insecureSkipVerify": True}}}}),
     "autoscaling.prometheus.tls takes at most one of caSecretRef, caConfigMapRef and insecureSkipVerify"),
    ("prometheus tls over http", serving({"autoscaling": {"prometheus": {"url": "http://p:9090", "tls": {
        "insecureSkipVerify": True}}}}),
     "autoscaling.prometheus.tls needs an https:// url"),
    ("budget below minimum", serving({"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 2},
                                      "autoscaling": {"gpuBudget": 3}}),
     "autoscaling.gpuBudget is below the GPUs the minimum replicas of both roles need"),
    ("source with both", serving({"model": {"name": "m", "source": {"pvc": {"claimName": "c"}, "hub": {}}}}),
     "model.source needs exactly one of pvc or hub"),
    ("source with neither", serving({"model": {"name": "m", "source": {}}}),
     "model.source needs exactly one of pvc or hub"),
    ("env value and valueFrom", serving({"decode": {"env": [{"name": "A", "value": "1", "valueFrom": {}}]}}),
     "set either value or valueFrom, not both"),
    ("name too long", serving(name="a" * 56), "metadata.name must be a DNS label of at most 55 characters"),
    ("multi-node tp not dividing", serving({"prefill": {"nodesPerReplica": 3, "tensorParallelSize": 4}}),
     "nodesPerReplica must divide dataParallelSize"),
    ("multi-node dp not dividing", serving({"decode": {"nodesPerReplica": 2, "dataParallelSize": 3,
                                                       "tensorParallelSize": 2}}),
     "nodesPerReplica must divide dataParallelSize"),
    ("multi-node gpu count per replica", serving({"prefill": {"nodesPerReplica": 2, "tensorParallelSize": 16,
                                                              "gpu": {"count": 16}}}),
     "gpu.count must equal tensorParallelSize x pipelineParallelSize x dataParallelSize / nodesPerReplica"),
    ("topology key on one node", serving({"decode": {"topologyKey": "nvidia.com/gpu.clique"}}),
     "topologyKey places the pods of a multi-node replica: it needs nodesPerReplica above 1"),
    ("multi-node on 0.11", serving({"engine": {"vllmVersion": "0.11"}, "prefill": {"nodesPerReplica": 2,
                                                                                   "tensorParallelSize": 2}}),
     "nodesPerReplica above 1 needs a NIXL connector and engine.vllmVersion >= 0.12"),
    ("multi-node with mooncake", serving({"kvTransfer": {"connector": "MooncakeConnector"},
                                          "decode": {"nodesPerReplica": 2, "tensorParallelSize": 2}}),
     "nodesPerReplica above 1 needs a NIXL connector and engine.vllmVersion >= 0.12"),
    ("nixl decode pp", serving({"decode": {"pipelineParallelSize": 2}}),
     "NIXL connectors take no pipeline parallelism on decode"),
    ("nixl prefill pp on 0.24", serving({"engine": {"vllmVersion": "0.24"}, "prefill": {"pipelineParallelSize": 2}}),
     "NIXL connectors take no pipeline parallelism on decode"),
    ("multi-node budget below a group", serving({"prefill": {"nodesPerReplica": 2, "tensorParallelSize": 4},
                                                 "autoscaling": {"gpuBudget": 4}}),
     "autoscaling.gpuBudget is below the GPUs the minimum replicas of both roles need"),
    ("name uppercase", serving(name="Llama"), "metadata.name must be a DNS label of at most 55 characters"),
    ("cpu pool with a cuda buffer", serving({"engine": {"device": "cpu"}, "kvTransfer": {"bufferDevice": "cuda"}}),
     "engine.device cpu keeps the KV cache in host memory: kvTransfer.bufferDevice must be cpu"),
    ("cpu pool with mooncake", serving({"engine": {"device": "cpu"}, "kvTransfer": {"connector": "MooncakeConnector"}}),
     "engine.device cpu needs kvTransfer.connector NixlConnector or NixlPushConnector"),
    ("cpu pool with lmcache", serving({"engine": {"device": "cpu"}, "kvTransfer": {
        "connector": "LMCacheConnectorV1", "lmcache": {"configMapRef": {"name": "lmcache"}}}}),
     "engine.device cpu needs kvTransfer.connector NixlConnector or NixlPushConnector"),
    ("cpu pool requesting gpus", serving({"engine": {"device": "cpu"}, "prefill": {"gpu": {"count": 1}}}),
     "engine.device cpu requests no GPUs: prefill.gpu.count and prefill.gpu.product must be unset"),
    ("cpu pool on a gpu model", serving({"engine": {"device": "cpu"}, "decode": {"gpu": {"product": "NVIDIA-H200"}}}),
     "engine.device cpu requests no GPUs: decode.gpu.count and decode.gpu.product must be unset"),
    ("cpu pool with a gpu budget", serving({"engine": {"device": "cpu"}, "autoscaling": {"gpuBudget": 8}}),
     "autoscaling.gpuBudget counts GPUs, and engine.device cpu runs on none"),
    ("cpu settings on a gpu pool", serving({"engine": {"cpu": {"kvCacheSpaceGiB": 4}}}),
     "engine.cpu applies only to engine.device cpu"),
    ("kvaware events xxhash", serving({"proxy": {"routingPolicy": "KVAware"}, "engine": {
        "extraArgs": ["--prefix-caching-hash-algo=xxhash"]}}),
     "proxy.kvAware.index Events needs the engines' --prefix-caching-hash-algo sha256 (the default) or sha256_cbor"),
    ("kvaware events xxhash_cbor on decode, seeded", serving({"proxy": {"routingPolicy": "KVAware"}, "engine": {
        "env": [{"name": "PYTHONHASHSEED", "value": "12345"}]},
        "decode": {"extraArgs": ["--prefix-caching-hash-algo", "xxhash_cbor"]}}),
     "remove xxhash from engine.extraArgs, prefill.extraArgs and decode.extraArgs, or use index Routed"),
    ("kvaware events 0.24 unseeded", serving({"proxy": {"routingPolicy": "KVAware", "kvAware": {"index": "Events"}},
                                              "engine": {"vllmVersion": "0.24"}}),
     "proxy.kvAware.index Events on engine.vllmVersion < 0.32 needs PYTHONHASHSEED in engine.env"),
    ("kvaware events seed from a secret", serving({"proxy": {"routingPolicy": "KVAware"}, "engine": {
        "vllmVersion": "0.24", "env": [{"name": "PYTHONHASHSEED", "valueFrom": {
            "secretKeyRef": {"name": "s", "key": "k"}}}]}}),
     "proxy.kvAware.index Events hashes prompts with the engines' PYTHONHASHSEED"),
    ("kvaware events seed per role", serving({"proxy": {"routingPolicy": "KVAware"},
                                              "prefill": {"env": [{"name": "PYTHONHASHSEED", "value": "7"}]},
                                              "decode": {"env": [{"name": "PYTHONHASHSEED", "value": "7"}]}}),
     "set it, if at all, as a literal value in engine.env, not with valueFrom and not in prefill.env or decode.env"),
]


# Schema-level rules (types, enums, bounds, patterns, unknown fields): the models reject them with a
# message naming the field; the API server's schema does the same (e2e).
SCHEMA_INVALID = [
    ("unknown connector", serving({"kvTransfer": {"connector": "Bogus"}}), "spec.kvTransfer.connector"),
    ("unknown device", serving({"engine": {"device": "tpu"}}), "spec.engine.device"),
    ("kv cache below a GiB", serving({"engine": {"device": "cpu", "cpu": {"kvCacheSpaceGiB": 0}}}),
     "spec.engine.cpu.kvCacheSpaceGiB"),
    ("threads bind not a cpu list", serving({"engine": {"device": "cpu", "cpu": {"threadsBind": "cores 0-3"}}}),
     "spec.engine.cpu.threadsBind"),
    ("topology key not a label", serving({"decode": {"nodesPerReplica": 2, "tensorParallelSize": 2,
                                                     "topologyKey": "rack key"}}), "spec.decode.topologyKey"),
    ("react negative", serving({"autoscaling": {"reactSeconds": -1}}), "spec.autoscaling.reactSeconds"),
    ("nodes per replica zero", serving({"decode": {"nodesPerReplica": 0}}), "spec.decode.nodesPerReplica"),
    ("nixl backend upper-case", serving({"kvTransfer": {"nixl": {"backends": ["MOONCAKE"]}}}),
     "spec.kvTransfer.nixl.backends[0]"),
    ("gpu bdf without function", serving({"kvTransfer": {"rdma": {"gpuNicMapping": [
        {"gpu": "0000:18:00", "nic": "19:00.0"}]}}}), "spec.kvTransfer.rdma.gpuNicMapping[0].gpu"),
    ("nic bdf bad device", serving({"kvTransfer": {"rdma": {"gpuNicMapping": [
        {"gpu": "18:00.0", "nic": "19:2z.0"}]}}}), "spec.kvTransfer.rdma.gpuNicMapping[0].nic"),
    ("selection var with comma", serving({"kvTransfer": {"rdma": {"nicSelectionVars": ["UCX_NET_DEVICES:1,X"]}}}),
     "spec.kvTransfer.rdma.nicSelectionVars[0]"),
    ("negative replicas", serving({"decode": {"replicas": -1}}), "spec.decode.replicas"),
    ("bad version", serving({"engine": {"vllmVersion": "latest"}}), "spec.engine.vllmVersion"),
    ("unknown field", serving({"prefill": {"gpus": 2}}), "spec.prefill.gpus"),
    ("bad quantity", serving({"prefill": {"shmSize": "lots"}}), "spec.prefill.shmSize"),
    ("bad percentile", serving({"autoscaling": {"slo": {"percentile": 42}}}), "spec.autoscaling.slo.percentile"),
    ("missing model", {**serving(), "spec": {}}, "spec.model"),
    ("token ref without name", serving({"autoscaling": {"prometheus": {"bearerTokenSecretRef": {"key": "t"}}}}),
     "spec.autoscaling.prometheus.bearerTokenSecretRef.name"),
    ("empty token key", serving({"autoscaling": {"prometheus": {"bearerTokenSecretRef": {"name": "s", "key": ""}}}}),
     "spec.autoscaling.prometheus.bearerTokenSecretRef.key"),
    ("ca ref without name", serving({"autoscaling": {"prometheus": {"url": "https://p", "tls": {
        "caSecretRef": {}}}}}), "spec.autoscaling.prometheus.tls.caSecretRef.name"),
    ("unknown tls field", serving({"autoscaling": {"prometheus": {"url": "https://p", "tls": {"caFile": "/ca"}}}}),
     "spec.autoscaling.prometheus.tls.caFile"),
    ("insecure not a bool", serving({"autoscaling": {"prometheus": {"url": "https://p", "tls": {
        "insecureSkipVerify": "maybe"}}}}), "spec.autoscaling.prometheus.tls.insecureSkipVerify"),
]


# (case, change merged over serving(), message): edits to immutable fields, refused on update
TRANSITIONS = [
    ("connector change", {"kvTransfer": {"connector": "MooncakeConnector"}}, "kvTransfer.connector is immutable"),
    ("model change", {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}}, "model.name is immutable"),
]
