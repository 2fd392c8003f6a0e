"""Facts about vLLM releases that decide what the operator renders and accepts.

Each boundary is checked against the vLLM source; see docs/connectors.md for the references.
"""

from __future__ import annotations

import re
from typing import Final

VersionTuple = tuple[int, int]

#: `major.minor` or `major.minor.patch`; the patch level never changes what is rendered.
VERSION_PATTERN: Final = r"^[0-9]+[.][0-9]+([.][0-9]+)?$"

#: The newest release the templates were checked against (the default engine).
LATEST: Final[VersionTuple] = (0, 33)
#: The oldest release whose V1 engine has the KV-connector API the operator renders for.
OLDEST_SUPPORTED: Final[VersionTuple] = (0, 10)
#: P2pNcclConnector was removed in 0.24: it exists up to and including 0.23.
P2P_NCCL_LAST: Final[VersionTuple] = (0, 23)
#: `kv_buffer_size`, `kv_rank`, `kv_parallel_size` and `kv_ip` were removed in 0.32; the config
#: classes forbid unknown keys, so sending them to 0.32+ fails at start-up.
LEGACY_KV_FIELDS_REMOVED: Final[VersionTuple] = (0, 32)
#: `kv_load_failure_policy` came with vLLM PR #26813 (after 0.11.0); 0.12 is the first minor
#: release certain to have it. Its default was `recompute` until early 2026, then `fail`: the
#: operator always renders the user's choice explicitly.
LOAD_FAILURE_POLICY_ADDED: Final[VersionTuple] = (0, 12)
#: NixlPushConnector (PR #35264) was merged after the 0.23 release.
NIXL_PUSH_ADDED: Final[VersionTuple] = (0, 24)
#: `--shutdown-timeout` (drain in-flight requests on SIGTERM) exists from 0.18 on.
SHUTDOWN_TIMEOUT_ADDED: Final[VersionTuple] = (0, 18)

#: CEL regex for "vLLM version <= 0.23", i.e. P2pNcclConnector's lifetime; its negation is
#: "NixlPushConnector exists". A unit test keeps it in step with the two constants above.
UP_TO_0_23_REGEX: Final = r"^0[.]([0-9]|1[0-9]|2[0-3])([.][0-9]+)?$"

#: CEL regex for "vLLM version < 0.10" (older than OLDEST_SUPPORTED).
BEFORE_OLDEST_REGEX: Final = r"^0[.][0-9]([.][0-9]+)?$"

_VERSION_RE: Final = re.compile(VERSION_PATTERN)


def parse_version(text: str) -> VersionTuple:
    """`"0.33"` or `"0.33.1"` -> `(0, 33)`; raises ValueError on anything else."""
    if not _VERSION_RE.match(text):
        raise ValueError(f"vLLM version {text!r} is not of the form MAJOR.MINOR[.PATCH]")
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def format_version(version: VersionTuple) -> str:
    return f"{version[0]}.{version[1]}"
