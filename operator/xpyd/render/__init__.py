"""Rendering: a validated DisaggregatedServing in, every desired child object out. Pure: no I/O.

The shape of each object lives in a jinja2 template under `xpyd/templates/` (`templates`); the
values that depend on the connector, role and vLLM version are computed in `engine` (the engine
pools) and `proxy` (the proxy), with `kvconfig`, `kvaware`, `lmcache` and `drain` beneath them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from xpyd import __version__
from xpyd.api import naming
from xpyd.api.models import DisaggregatedServingSpec
from xpyd.api.naming import Role
from xpyd.common.jsontypes import JSON
from xpyd.render import engine, proxy
from xpyd.render.compat import compat_hash

DEFAULT_OPERATOR_IMAGE: Final = f"ghcr.io/xpyd-operator/xpyd-operator:{__version__}"


@dataclass(frozen=True)
class RenderOptions:
    """What the operator adds to the spec: its own image (for the proxy), replica counts decided by
    the autoscaler (when absent, the spec's replicas) and the roles whose Deployment keeps its old
    pods while the other role rolls to the same KV revision (`controller.rollout`)."""

    operator_image: str = DEFAULT_OPERATOR_IMAGE
    replicas: Mapping[Role, int] = field(default_factory=dict)
    held: frozenset[Role] = frozenset()


def service_url(name: str, namespace: str, spec: DisaggregatedServingSpec) -> str:
    """The in-cluster URL clients use: the proxy Service's (`status.endpoint`)."""
    return f"http://{naming.child_name(name, 'proxy')}.{namespace}:{spec.proxy.port}"


def render(name: str, namespace: str, spec: DisaggregatedServingSpec,
           options: RenderOptions | None = None) -> list[JSON]:
    """Every child object of a DisaggregatedServing, in apply order (RBAC before the pods using it)."""
    options = options or RenderOptions()
    compat = compat_hash(spec)
    proxy_host = proxy.proxy_host(name, namespace)
    objects: list[JSON] = []
    for role in naming.ROLES:
        replicas = options.replicas.get(role, getattr(spec, role).replicas)
        objects += engine.objects(name, namespace, spec, role, replicas=replicas, held=role in options.held,
                                  compat=compat, proxy_host=proxy_host)
    return objects + proxy.objects(name, namespace, spec, options.operator_image)
