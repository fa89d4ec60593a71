"""Whether the Ray cluster can ever hold an engine's placement group. Ray waits forever for one
that fits no node (its autoscaler repeats "No available node types can fulfill …" every 30 s),
so the application builder asks first: without an autoscaler that could add a node, a group
that fits no alive node is a ValueError naming what it needs and what the nodes have; with
one, a single warning."""

from __future__ import annotations

import json
import logging

import ray

log = logging.getLogger(__name__)

DEMO_HINT = ("on a machine without GPUs serve the tiny demo pair on CPU instead: "
             "`serve run deploy/dflash-demo.yaml` or `make serve`")


def need(bundles: list[dict[str, float]], strategy: str) -> dict[str, float]:
    """What one node must hold: the bundles' sum under STRICT_PACK, else the largest bundle's
    each resource."""
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0) + v if strategy == "STRICT_PACK" else max(out.get(k, 0), v)
    return out


def node_totals() -> list[dict[str, float]]:
    """The alive nodes' total resources (Ray's own node:… and memory keys left out)."""
    return [{k: v for k, v in n["Resources"].items()
             if k in ("CPU", "GPU") or not (k.startswith("node:") or "memory" in k)}
            for n in ray.nodes() if n.get("Alive")]


def autoscaler_may_add_nodes() -> bool:
    """An autoscaler with node types runs (`ray up`, KubeRay): v2 publishes its node groups in
    the GCS; v1 reports each node's type, which under `ray start`/`ray.init` (the read-only
    provider: no node types, nothing to add) is the node's own id. Unknown → True (warn)."""
    try:
        from ray._private import ray_constants
        from ray._private.state import state
        from ray.autoscaler._private.util import format_readonly_node_type
        from ray.experimental.internal_kv import _internal_kv_get

        config = state.get_cluster_config()
        if config is not None and any(g.max_count != 0 for g in config.node_group_configs):
            return True
        status = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        types = json.loads(status).get("autoscaler_report", {}).get("node_type_mapping") \
            if status else None
        if not types:
            return status is None  # no report yet: cannot tell
        return any(t != format_readonly_node_type(n) for n, t in types.items())
    except Exception:
        return True


def check_capacity(bundles: list[dict[str, float]], strategy: str, what: str,
                   may_grow: bool | None = None) -> None:
    """Raises ValueError when no alive node can hold the group and no autoscaler could add
    one; warns once when an autoscaler might. `may_grow`: whether the cluster can gain nodes,
    where the caller knows (False: a Ray it started itself); None asks the cluster. Needs Ray
    connected (a no-op otherwise)."""
    if not ray.is_initialized():
        return
    needed, nodes = need(bundles, strategy), node_totals()
    if any(all(n.get(k, 0) >= v for k, v in needed.items()) for n in nodes):
        return
    have = "; ".join(", ".join(f"{k} {v:g}" for k, v in sorted(n.items())) for n in nodes)
    message = (f"{what} needs {', '.join(f'{k} {v:g}' for k, v in sorted(needed.items()))} "
               f"on one node per replica; the cluster's nodes have: {have or 'none'}")
    if autoscaler_may_add_nodes() if may_grow is None else may_grow:
        log.warning("%s: no node holds it now; waiting for the autoscaler to add one", message)
        return
    raise ValueError(f"{message}, and no autoscaler can add one; {DEMO_HINT}")
