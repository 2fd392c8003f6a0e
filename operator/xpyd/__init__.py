"""xpyd-operator: vLLM prefill/decode-disaggregated serving on Kubernetes."""

__version__ = "0.1.0"
