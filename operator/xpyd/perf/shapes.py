"""Known model shapes and GPU figures: the inputs of the KV arithmetic and of the roofline model.

Model shapes are the Hugging Face `config.json` values of each model (`num_hidden_layers`,
`num_key_value_heads`, `head_dim` or `hidden_size / num_attention_heads`, `hidden_size`) and the
parameter counts of the model cards. GPU figures are the vendor datasheets' *dense* Tensor Core
rates (the datasheets print the 2:4-sparsity rate, twice the dense one, with an asterisk), HBM
bandwidth and memory. Datasheet "GB" is taken as 10^9 bytes, which slightly understates the
capacity the driver reports, so KV capacities derived from it err on the safe side.

The KV cache of one token is `2 · layers · kv_heads · head_dim · dtype_bytes` (one K and one V
vector per KV head and layer). Multi-head latent attention (DeepSeek-V2/V3) caches one compressed
latent per layer instead, `kv_lora_rank + qk_rope_head_dim` values, with no factor 2.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of `dtype` (bf16, fp16, fp8 or fp32)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})") from None


@dataclass(frozen=True)
class ModelShape:
    """The shape facts of a decoder-only transformer that the KV arithmetic and roofline need.

    `params` is the total parameter count (what the weights occupy); `active_params` the parameters
    used per token (smaller for mixture-of-experts models; `None` for dense models). For MLA models
    `kv_lora_rank` and `qk_rope_head_dim` are set and decide the KV size; `kv_heads`/`head_dim` then
    describe the attention heads only.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float
    active_params: float | None = None
    hidden_size: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) < 1 or self.params <= 0:
            raise ValueError(f"model shape {self.name!r}: layers, kv_heads, head_dim and params must be positive")
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(f"model shape {self.name!r}: MLA needs both kv_lora_rank and qk_rope_head_dim")

    @property
    def is_mla(self) -> bool:
        """Whether the KV cache holds an MLA latent instead of per-head K and V."""
        return self.kv_lora_rank is not None

    @property
    def flops_params(self) -> float:
        """Parameters that take part in one token's forward pass (2 FLOPs each per token)."""
        return self.active_params if self.active_params is not None else self.params

    def kv_values_per_token(self) -> int:
        """Cached values (elements) per token over all layers."""
        if self.kv_lora_rank is not None and self.qk_rope_head_dim is not None:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.layers * self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """KV-cache bytes of one token: `2·layers·kv_heads·head_dim·dtype_bytes` (MLA: the latent, 1x)."""
        return self.kv_values_per_token() * dtype_bytes(kv_dtype)

    def weight_bytes(self, weight_dtype: str = "bf16") -> float:
        """Bytes the weights occupy (all experts of an MoE model)."""
        return self.params * dtype_bytes(weight_dtype)


_HF = "https://huggingface.co/{}/blob/main/config.json"

MODELS: dict[str, ModelShape] = {
    shape.name.lower(): shape
    for shape in (
        # 8,030,261,248 parameters (model card "8B"; count from the config's matrices).
        ModelShape("Llama-3.1-8B", layers=32, kv_heads=8, head_dim=128, params=8.03e9, hidden_size=4096,
                   source=_HF.format("meta-llama/Llama-3.1-8B")),
        ModelShape("Llama-3.1-70B", layers=80, kv_heads=8, head_dim=128, params=70.6e9, hidden_size=8192,
                   source=_HF.format("meta-llama/Llama-3.1-70B")),
        # 126 layers, 128 query heads, 8 KV heads, hidden 16384: 405.9e9 parameters by the config.
        ModelShape("Llama-3.1-405B", layers=126, kv_heads=8, head_dim=128, params=405.9e9, hidden_size=16384,
                   source=_HF.format("meta-llama/Llama-3.1-405B")),
        # 28 query heads of 128 over hidden 3584, 4 KV heads; model card: 7.61B parameters.
        ModelShape("Qwen2.5-7B", layers=28, kv_heads=4, head_dim=128, params=7.61e9, hidden_size=3584,
                   source=_HF.format("Qwen/Qwen2.5-7B")),
        # 64 query heads / 8 KV heads over hidden 8192; model card: 72.7B parameters.
        ModelShape("Qwen2.5-72B", layers=80, kv_heads=8, head_dim=128, params=72.7e9, hidden_size=8192,
                   source=_HF.format("Qwen/Qwen2.5-72B")),
        # DeepSeek-V3 config.json: num_hidden_layers 61, num_key_value_heads 128, qk_nope_head_dim 128 +
        # qk_rope_head_dim 64 per head, kv_lora_rank 512, hidden_size 7168 (also vLLM's DeepseekV3Config
        # defaults, docs.vllm.ai .../transformers_utils/configs/deepseek_v3). vLLM caches the MLA latent as
        # one [kv_lora_rank + qk_rope_head_dim] = 576-wide vector per layer and token (vLLM
        # kv_connector/utils.py: kv_cache shape [num_blks, blk_size, 1, kv_lora_rank + qk_rope_head_dim]),
        # so 61·576·2 B = 70,272 B/token in BF16. Technical report (arXiv 2412.19437): 671B total, 37B
        # activated per token.
        ModelShape("DeepSeek-V3", layers=61, kv_heads=128, head_dim=192, params=671e9, active_params=37e9,
                   hidden_size=7168, kv_lora_rank=512, qk_rope_head_dim=64,
                   source=_HF.format("deepseek-ai/DeepSeek-V3")),
        # 32 layers, 8 KV heads of 128, 8 experts with 2 active per token: 46.7B total, 12.9B active
        # (Mistral AI's announcement and the model card).
        ModelShape("Mixtral-8x7B", layers=32, kv_heads=8, head_dim=128, params=46.7e9, active_params=12.9e9,
                   hidden_size=4096, source=_HF.format("mistralai/Mixtral-8x7B-v0.1")),
        # The two models of splitwise_perf_model.csv.
        ModelShape("Llama-2-70B", layers=80, kv_heads=8, head_dim=128, params=68.98e9, hidden_size=8192,
                   source=_HF.format("meta-llama/Llama-2-70b-hf")),
        # BLOOM is multi-head attention: 112 KV heads of 14336/112 = 128.
        ModelShape("BLOOM-176B", layers=70, kv_heads=112, head_dim=128, params=176.25e9, hidden_size=14336,
                   source=_HF.format("bigscience/bloom")),
    )
}

_NAME_SUFFIXES = ("-instruct", "-chat", "-hf", "-base", "-fp8", "-v0.1")


def _normalise(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1].removeprefix("meta-")
    for _ in range(3):  # suffixes stack: "Mixtral-8x7B-Instruct-v0.1"
        for suffix in _NAME_SUFFIXES:
            key = key.removesuffix(suffix)
    return {"llama2-70b": "llama-2-70b", "bloom": "bloom-176b"}.get(key, key)


def lookup_model(name: str) -> ModelShape:
    """The known shape of `name`, given as a short name ("llama-3.1-8b") or a Hugging Face id
    ("meta-llama/Llama-3.1-8B-Instruct"); raises KeyError with the known names otherwise."""
    key = _normalise(name)
    if key not in MODELS:
        known = ", ".join(shape.name for shape in MODELS.values())
        raise KeyError(f"unknown model {name!r} (known: {known}; or give the shape explicitly)")
    return MODELS[key]


@dataclass(frozen=True)
class GpuDatasheet:
    """Datasheet figures of one GPU: dense Tensor Core FLOP/s, HBM bandwidth and memory."""

    name: str
    bf16_flops: float
    fp8_flops: float | None
    hbm_bytes_per_s: float
    memory_bytes: float
    source: str = ""

    def flops(self, dtype: str = "bf16") -> float:
        """Dense FLOP/s for matrix maths in `dtype`; FP8 falls back to BF16 on GPUs without FP8 units
        (weight-only FP8 kernels compute in 16 bit there)."""
        if dtype_bytes(dtype) == 1 and self.fp8_flops is not None:
            return self.fp8_flops
        return self.bf16_flops


GPUS: dict[str, GpuDatasheet] = {
    gpu.name.lower(): gpu
    for gpu in (
        # H100 SXM datasheet: BF16 1,979 / FP8 3,958 TFLOPS "with sparsity" (dense: half), 80 GB HBM3,
        # 3.35 TB/s (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet).
        GpuDatasheet("H100", bf16_flops=989.4e12, fp8_flops=1978.9e12, hbm_bytes_per_s=3.35e12, memory_bytes=80e9,
                source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
        # H200 SXM: the H100's compute (BF16 1,979 / FP8 3,958 TFLOPS with sparsity), 141 GB HBM3e at
        # 4.8 TB/s (nvidia.com/en-us/data-center/h200).
        GpuDatasheet("H200", bf16_flops=989.4e12, fp8_flops=1978.9e12, hbm_bytes_per_s=4.8e12, memory_bytes=141e9,
                source="https://www.nvidia.com/en-us/data-center/h200/"),
        # A100 80GB SXM datasheet: BF16 312 TFLOPS dense (624 with sparsity), no FP8, 80 GB HBM2e at
        # 2,039 GB/s.
        GpuDatasheet("A100-80GB", bf16_flops=312e12, fp8_flops=None, hbm_bytes_per_s=2.039e12, memory_bytes=80e9,
                source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
        # L40S datasheet: BF16 362.05 / FP8 733 TFLOPS dense (733 / 1,466 with sparsity), 48 GB GDDR6 at
        # 864 GB/s.
        GpuDatasheet("L40S", bf16_flops=362.05e12, fp8_flops=733e12, hbm_bytes_per_s=864e9, memory_bytes=48e9,
                source="https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    )
}

_GPU_ALIASES = {"h100-80gb": "h100", "h100-sxm": "h100", "h100-80gb-pcap": "h100", "h200-sxm": "h200",
                "a100": "a100-80gb", "a100-80gb-sxm": "a100-80gb", "nvidia-h100": "h100",
                "nvidia-h200": "h200", "nvidia-l40s": "l40s"}


def lookup_gpu(name: str) -> GpuDatasheet:
    """The datasheet figures of `name` ("H100", "h200", "a100-80gb", "L40S", splitwise's "h100-80gb");
    raises KeyError with the known names otherwise."""
    key = name.strip().lower()
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise KeyError(f"unknown GPU {name!r} (known: {', '.join(gpu.name for gpu in GPUS.values())})")
    return GPUS[key]
