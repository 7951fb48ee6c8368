"""The Ray executor: one Worker actor per tensor-parallel rank in a placement group, and
where a replica's actors sit in that group.

    placement group (STRICT_PACK)          TP = 1                       TP > 1
      bundle 0                             the Serve replica            the replica + SchedulerActor
      bundle 1 .. TP                       SchedulerActor with rank 0   Worker actor rank 0 .. TP-1
                                           in its process (no actor     (a GPU each on GPU clusters)
                                           call per step), its GPU

At TP > 1 the SchedulerActor drives the ranks through a Ray Compiled Graph compiled once at
start-up: each step's StepMessage is written once into a shared-memory channel that every
rank reads, and rank 0's samples come back the same way (`worker_transport:
compiled_graph`, the default); `actor_calls` keeps one `.remote()` call per rank per step
(the object store carries the step). The ranks meet in torch.distributed (NCCL on GPU, gloo
on CPU) at a free port of rank 0's node.
"""

from __future__ import annotations

import logging
import socket

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.outputs import StepMessage
from rayserve_paged.engine.executor import Executor
from rayserve_paged.models.sampler import SamplerOutput
from rayserve_paged.worker.worker import CacheSizes, Worker

logger = logging.getLogger(__name__)


def show_info_logs() -> None:
    """Show the package's INFO lines (the loader's load time and peak memory among them) in
    this Ray actor's log. An actor process's root logger has no handler, so Python would
    show only WARNING and up; where the root logger has one (configured by the operator),
    nothing changes. Idempotent."""
    package = logging.getLogger("rayserve_paged")
    if logging.getLogger().handlers or any(getattr(h, "is_rayserve_paged", False) for h in package.handlers):
        return
    handler = logging.StreamHandler()  # stderr: Ray writes it to the actor's log and the driver
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s -- %(message)s"))
    handler.is_rayserve_paged = True
    package.addHandler(handler)
    if package.getEffectiveLevel() > logging.INFO:
        package.setLevel(logging.INFO)


class WorkerActor(Worker):
    """A Worker that can also join the tensor-parallel process group and name its node."""

    def node_address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port

    def init_distributed(self, init_method: str) -> None:
        show_info_logs()  # the model loads here
        if self.world_size == 1:
            self.load_model()
            return
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size)
        self.load_model(group=dist.group.WORLD)


def is_gpu(config: EngineConfig) -> bool:
    if config.device == "auto":
        return bool(ray.cluster_resources().get("GPU", 0))
    return config.device == "cuda"


def worker_bundle(config: EngineConfig, worker_cpus: float) -> dict:
    bundle = {"CPU": worker_cpus}
    if is_gpu(config):
        bundle["GPU"] = 1
    return bundle


def rank0_in_scheduler(config: EngineConfig) -> bool:
    """TP = 1: the only rank runs inside the SchedulerActor's process (the step costs a
    function call, not an actor call each way)."""
    return config.tensor_parallel_size == 1


def replica_bundles(
    config: EngineConfig, replica_cpus: float, scheduler_cpus: float, worker_cpus: float, gpu: bool
) -> list[dict[str, float]]:
    """A replica's placement-group bundles: 0 for the replica (and the SchedulerActor at
    TP > 1), then one per rank (at TP = 1 the SchedulerActor, which hosts rank 0)."""
    rank = {"CPU": worker_cpus, **({"GPU": 1.0} if gpu else {})}
    if rank0_in_scheduler(config):
        return [{"CPU": replica_cpus}, rank | {"CPU": worker_cpus + scheduler_cpus}]
    return [{"CPU": replica_cpus + scheduler_cpus}] + [dict(rank) for _ in range(config.tensor_parallel_size)]


def scheduler_actor_options(
    config: EngineConfig, scheduler_cpus: float, worker_cpus: float, pg: PlacementGroup | None
) -> dict:
    """Ray options of a replica's SchedulerActor, matching `replica_bundles`. Hosting rank 0,
    it takes rank 0's bundle whole, so it sees exactly that bundle's GPU."""
    if not rank0_in_scheduler(config):
        bundle, resources = 0, {"num_cpus": scheduler_cpus}
    else:
        bundle, resources = 1, {"num_cpus": scheduler_cpus + worker_cpus, "num_gpus": 1 if is_gpu(config) else 0}
    if pg is None:
        return resources
    return resources | {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)}


class RayExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        pg: PlacementGroup | None = None,
        first_worker_bundle: int = 1,
        worker_cpus: float = 1.0,
    ) -> None:
        self.config = config
        tp = config.tensor_parallel_size
        self._own_pg = None
        pg = pg or get_current_placement_group()
        if pg is None:
            # outside Serve (tests, scripts): a group of our own, workers only
            pg = placement_group([worker_bundle(config, worker_cpus)] * tp, strategy="STRICT_PACK")
            ray.get(pg.ready())
            self._own_pg = pg
            first_worker_bundle = 0
        num_gpus = 1 if is_gpu(config) else 0
        actor_class = ray.remote(WorkerActor)
        self._graph = None
        self.workers = [
            actor_class.options(
                num_cpus=worker_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=first_worker_bundle + rank
                ),
            ).remote(config, model_path, rank, tp)
            for rank in range(tp)
        ]

    def initialize(self) -> CacheSizes:
        ip, port = ray.get(self.workers[0].node_address.remote())
        ray.get([w.init_distributed.remote(f"tcp://{ip}:{port}") for w in self.workers])
        sizes = ray.get([w.determine_num_blocks.remote() for w in self.workers])
        # every rank holds the same block ids: the smallest pool decides
        num_gpu = min(s.num_gpu_blocks for s in sizes)
        num_cpu = min(s.num_cpu_blocks for s in sizes)
        ray.get([w.init_cache.remote(num_gpu, num_cpu) for w in self.workers])
        if self.config.worker_transport == "compiled_graph":
            self._graph = _compile_step_graph(self.workers)
        return CacheSizes(num_gpu, num_cpu, sizes[0].block_bytes)

    def execute(self, msg: StepMessage) -> SamplerOutput:
        if len(self.workers) == 1 and self._graph is None:
            return ray.get(self.workers[0].execute.remote(msg))
        # the token bitmasks go to rank 0 alone (the rank that samples)
        bitmasks, msg.token_bitmasks = msg.token_bitmasks, b""
        if self._graph is not None:
            return ray.get(self._graph.execute(msg, bitmasks), timeout=STEP_TIMEOUT_S)[0]
        ref = ray.put(msg)  # serialised once, read by every rank
        results = ray.get([w.execute.remote(ref, bitmasks) if rank == 0 else w.execute.remote(ref)
                           for rank, w in enumerate(self.workers)])  # fmt: skip
        return results[0]

    def add_lora(self, key: tuple, adapter) -> None:
        """Every rank gets the same tensors (one object in the store, read by each), and
        cuts its own shard of them. Under the compiled graph the step runs on each actor's
        graph thread and this call on its main thread (Ray's rule for actors in a compiled
        graph); the key is new, so no step reads it yet."""
        ref = ray.put(adapter)
        ray.get([w.add_lora.remote(key, ref) for w in self.workers], timeout=STEP_TIMEOUT_S)

    def gpu_snapshots(self) -> list[dict]:
        return ray.get([w.gpu_snapshot.remote() for w in self.workers], timeout=10)

    def batch_states(self) -> list[tuple[int, int]]:
        return [tuple(s) for s in ray.get([w.batch_state.remote() for w in self.workers], timeout=10)]

    def check_health(self, timeout_s: float = 10.0) -> None:
        ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)

    def shutdown(self) -> None:
        if self._graph is not None:
            try:
                self._graph.teardown()
            except Exception as e:  # a rank already gone: the actors are killed below anyway
                logger.warning("tearing down the step graph failed: %r", e)
            self._graph = None
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._own_pg is not None:
            ray.util.remove_placement_group(self._own_pg)
            self._own_pg = None


# A step never takes this long; a rank that hangs this long fails the step loop (and every
# waiting request) instead of stalling it silently.
STEP_TIMEOUT_S = 600.0


def _compile_step_graph(workers: list):
    """The step as a compiled graph: two inputs, the StepMessage (without its token
    bitmasks), read by every rank, and the bitmasks, read by rank 0 only (one channel per
    input attribute, each to its readers); one output per rank (rank 0's samples; None
    from the others)."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as step:
        msg, bitmasks = step[0], step[1]
        graph = MultiOutputNode([w.execute.bind(msg, bitmasks) if rank == 0 else w.execute.bind(msg)
                                 for rank, w in enumerate(workers)])  # fmt: skip
    return graph.experimental_compile()
