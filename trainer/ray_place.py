"""Where the Ray loop's parts run: a local cluster for one machine, and the actor options that place them.

Two ways to say where (``RayConfig.placement``):

* ``resources``: nodes started with custom resources, ``wsync_trainer`` (room
  for the trainer's ranks, all on one node through a ``STRICT_PACK`` placement
  group) and ``wsync_sampler`` (one per sampler). ``local_cluster`` starts
  such a cluster; on a real one, ``ray start --resources`` (docs/ray.md).
* ``spread``: any cluster. The ranks run on the driver's node; the samplers
  are pinned round-robin to the other nodes (this node when it is alone).

Every actor asks for ``num_cpus=0``: the resources say where it goes, not how
much CPU Ray should count for it.
"""
from __future__ import annotations

TRAINER, SAMPLER = "wsync_trainer", "wsync_sampler"  # custom node resources that say where the parts go


def local_cluster(samplers: int, ranks: int = 2, object_store_mb: int = 80):
    """A Ray cluster on this machine: a head node for the trainer ranks, one node per sampler (1 CPU each)."""
    from ray.cluster_utils import Cluster

    common = {"num_cpus": 1, "object_store_memory": object_store_mb << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**common, "include_dashboard": False,
                                                            "resources": {TRAINER: ranks}})
    for _ in range(samplers):
        cluster.add_node(**common, resources={SAMPLER: 1})
    cluster.wait_for_nodes()
    return cluster


def mode(asked: str, ranks: int, samplers: int) -> str:
    """'resources' when asked, or when 'auto' and the cluster has room by resources; else 'spread'."""
    import ray

    if asked != "auto":
        return asked
    have = ray.cluster_resources()
    return "resources" if have.get(TRAINER, 0) >= ranks and have.get(SAMPLER, 0) >= samplers else "spread"


def trainer_options(how: str, ranks: int, timeout: float) -> tuple:
    """(placement group or None, .options() per rank): every rank on one node."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    if how == "resources":  # one node: the gloo group and the gather stay on that machine
        pg = placement_group([{TRAINER: 1}] * ranks, strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=timeout)
        return pg, [dict(resources={TRAINER: 1}, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i)) for i in range(ranks)]
    here = ray.get_runtime_context().get_node_id()
    return None, [dict(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))] * ranks


def sampler_options(how: str, samplers: int, trainer_node: str) -> list[dict]:
    """.options() per sampler: a wsync_sampler each, or pinned round-robin to the nodes that are not the trainer's."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if how == "resources":
        return [dict(resources={SAMPLER: 1})] * samplers
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != trainer_node] or [trainer_node]
    # soft=False: a sampler whose node is gone stays lost (the driver writes it off) rather than crowding another
    return [dict(scheduling_strategy=NodeAffinitySchedulingStrategy(others[i % len(others)], soft=False))
            for i in range(samplers)]


def publish_host(asked: str | None, trainer_ip: str) -> str:
    """Where rank 0's publisher listens: as asked, else 127.0.0.1 when every node is this machine, else the
    trainer node's address (the samplers on other machines dial it)."""
    import ray

    if asked:
        return asked
    one_machine = len({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}) == 1
    return "127.0.0.1" if one_machine else trainer_ip
