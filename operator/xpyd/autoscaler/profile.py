"""The performance model a DisaggregatedServing's autoscaler sizes with, from `spec.autoscaling.profile`.

- `name`: a profile shipped with the operator (`xpyd/perf/profiles/<name>_{prefill,decode}.csv`);
- `configMap`: a measured profile the user keeps in a ConfigMap (keys `prefill.csv`, `decode.csv`);
- neither: a roofline estimate from the model's shape and the decode pool's GPU product, when both
  are known to `xpyd plan`; otherwise there is nothing to size with (`ProfileError`).

Whatever the source, `decide()` corrects capacity online from what the pool delivers (clamped), so
a roofline estimate converges to the truth within its bounds.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

from xpyd.api.models import DisaggregatedServingSpec
from xpyd.common.jsontypes import JSON
from xpyd.perf.model import BUNDLED_PROFILES, PerfModel
from xpyd.perf.shapes import lookup_gpu, lookup_model

PROFILE_KEYS = ("prefill.csv", "decode.csv")


class ProfileError(Exception):
    """No performance model can be built; the message says what to set."""


def bundled_profiles() -> list[str]:
    return sorted(p.name.removesuffix("_prefill.csv") for p in BUNDLED_PROFILES.glob("*_prefill.csv"))


def perf_model(spec: DisaggregatedServingSpec, config_map: JSON | None = None) -> PerfModel:
    """The model of `spec`'s engines. `config_map` is the ConfigMap `profile.configMap` names (None
    when it does not exist)."""
    profile = spec.autoscaling.profile
    tp = spec.decode.tensor_parallel_size
    extra = {"max_kv_tokens": profile.max_kv_tokens} if profile.max_kv_tokens else {}
    if profile.name:
        if profile.name not in bundled_profiles():
            raise ProfileError(f"autoscaling.profile.name {profile.name!r} is not a bundled profile "
                               f"(bundled: {', '.join(bundled_profiles())})")
        return PerfModel.from_profile(BUNDLED_PROFILES / profile.name, gpus=tp, **extra)
    if profile.config_map:
        if config_map is None:
            raise ProfileError(f"ConfigMap {profile.config_map} (autoscaling.profile.configMap) not found")
        return from_config_map(profile.config_map, config_map.get("data") or {}, tp, profile.max_kv_tokens)
    try:
        shape = lookup_model(spec.model.name)
        gpu = lookup_gpu(spec.decode.gpu.product or "")
    except KeyError as error:
        raise ProfileError(f"no autoscaling.profile and no roofline estimate: {error.args[0]}; set "
                           "autoscaling.profile.name or .configMap") from None
    return PerfModel.roofline(shape, gpu, tp, max_kv_tokens=profile.max_kv_tokens)


def from_config_map(name: str, data: Mapping[str, str], tp: int, max_kv_tokens: int | None) -> PerfModel:
    """A profile from a ConfigMap's `prefill.csv` and `decode.csv`; errors name the ConfigMap."""
    missing = [key for key in PROFILE_KEYS if key not in data]
    if missing:
        raise ProfileError(f"ConfigMap {name} lacks key(s) {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="xpyd-profile-") as directory:
        prefix = Path(directory) / name
        for key in PROFILE_KEYS:
            Path(f"{prefix}_{key.replace('.csv', '')}.csv").write_text(data[key])
        try:
            model = PerfModel.from_profile(prefix, gpus=tp, **({"max_kv_tokens": max_kv_tokens}
                                                              if max_kv_tokens else {}))
        except (ValueError, KeyError) as error:
            raise ProfileError(f"ConfigMap {name}: {str(error).replace(str(directory) + '/', '')}") from None
    return model
