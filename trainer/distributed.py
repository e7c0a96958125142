"""The learner as several processes: FSDP2 data parallelism under ``torchrun``.

    torchrun --nproc_per_node N -m rollstream.cli worker learner -c CFG     (grpo.world_size = N)

Rank 0 is the learner worker: the only process that talks to the transport (consumes TrainGroups, acks,
publishes weights and feedback, writes metrics, snapshots and checkpoints). The other ranks *follow*: they
load the same model, shard it with ``fully_shard`` and wait for rank 0's ``LearnerCommand``s, which rank 0
broadcasts before every collective step (training a generation batch, gathering the weights for a
snapshot, gathering model + optimizer for a checkpoint, stopping). A command travels as its msgpack bytes
in a uint8 tensor (its length first): no pickle, so no ``broadcast_object_list``.

Batch semantics are ms-swift's: a mini-batch is ``per_device_train_batch_size * world_size`` trajectories
of the shuffled generation batch, rank r trains rows ``[r * P, (r + 1) * P)`` of each, and FSDP averages the
gradients over ranks. So for grpo (a mean over rows), dr_grpo (rows x max length) and dapo (whose
``num_items_in_batch`` is the generation batch's tokens divided by the number of processes) the step is the
one a single process takes on the whole mini-batch; bnpo's token mean becomes a mean of per-rank token
means (as in TRL and ms-swift).

On GPUs (``learner.device = "cuda"``, or ``"auto"`` where torch sees a GPU for every local rank) each rank
trains on GPU ``LOCAL_RANK`` (after CUDA_VISIBLE_DEVICES) and FSDP2's collectives run over NCCL; the same
code as on CPU, where they run over gloo. The group is one process group with both backends
(``cpu:gloo,cuda:nccl``): the commands, the stats and the token counts are small host tensors that go over
gloo, the weights and gradients over NCCL; and a follower waiting hours for rank 0's next command waits in
gloo, not in NCCL's watchdog.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

from config import Config
from pipeline.errors import SetupError
from pipeline.records import LearnerCommand, RecordError, decode, encode

# Followers wait for rank 0's next command while rank 0 waits for the pipeline (rollout, reward): that
# can be long, so the process group's timeout is generous. A rank that dies is seen by torchrun, which
# stops the others, so this bounds only a live rank 0 that stopped sending.
WAIT_FOR_RANK0 = datetime.timedelta(hours=6)


def processes_from_env() -> int:
    """The number of learner processes torchrun started (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def check_world_size(cfg: Config) -> None:
    """grpo.world_size must say how many learner processes there are: the batch sizes derive from it."""
    processes, configured = processes_from_env(), cfg.grpo.world_size
    if processes != configured:
        how = (
            f"launch the learner with `torchrun --nproc_per_node {configured} -m rollstream.cli worker learner -c CFG`"
            if processes == 1
            else f"set grpo.world_size = {processes}"
        )
        raise SetupError(
            f"grpo.world_size = {configured} but the learner runs as {processes} process(es) "
            f"(torchrun's WORLD_SIZE); {how}"
        )
    if processes == 1:
        return
    unsupported = {
        "learner.train_type": cfg.learner.train_type == "lora",
        "learner.max_tokens_per_batch": cfg.learner.max_tokens_per_batch is not None,
    }
    for name, used in unsupported.items():
        if used:
            raise SetupError(
                f"{name}: not supported with grpo.world_size > 1 yet (the distributed learner trains full "
                f"weights with padded mini-batches); run the learner as one process or unset {name}"
            )


def local_ranks_from_env() -> tuple[int, int]:
    """(this process's rank on its host, the learner processes on its host): torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE (0 and 1 when not under torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def group_device(spec: str, local_rank: int, local_world_size: int, gpus: int) -> str:
    """The device a rank of the distributed learner trains on: ``cuda:LOCAL_RANK`` or ``cpu``, from
    ``learner.device`` and the GPUs torch sees on this host. "auto" takes the GPUs when there is one per local
    rank, else the CPU; "cuda" refuses to start on fewer GPUs than local ranks, with the numbers and the fix
    (ranks sharing a GPU would each hold a replica and NCCL refuses two ranks on one device)."""
    if spec == "cpu" or (spec == "auto" and gpus < local_world_size):
        return "cpu"
    if gpus < local_world_size:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"torch sees {gpus} GPU(s)" + (
            f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        )
        fix = (
            f"start torchrun with --nproc_per_node {gpus} (and grpo.world_size to match)"
            if gpus
            else 'set learner.device = "cpu" (the same FSDP2 learner, over gloo)'
        )
        raise SetupError(
            f"learner.device={spec!r} with {local_world_size} learner processes on this host (torchrun's "
            f"LOCAL_WORLD_SIZE) but {seen}: one GPU per process; {fix}"
        )
    return f"cuda:{local_rank}"


class LearnerGroup:
    """This process's place among the learner processes, and the collective operations they share.
    ``device``: ``learner.device`` (see ``group_device``); ``self.device`` is the one this rank trains on."""

    def __init__(self, device: str = "cpu") -> None:
        local_rank, local_world_size = local_ranks_from_env()
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.device = torch.device(group_device(device, local_rank, local_world_size, gpus))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL: its communicator binds the current device
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=WAIT_FOR_RANK0)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ sharding

    def shard(self, model: torch.nn.Module) -> None:
        """FSDP2: each decoder layer is a unit (its weights gathered for its forward/backward only), then
        the rest (embeddings, norm, head) at the root. Works for transformers' decoder-only models."""
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        if not any(p.requires_grad for p in model.parameters()):
            # FSDP2 keeps the root's weights gathered after forward for the backward that follows; a frozen
            # model (the reference) has none, so shard them again at once (sync_ref_model mixes shards).
            def reshard(module: Any, args: Any, output: Any) -> None:  # module: an FSDPModule by now
                module.reshard()

            model.register_forward_hook(reshard)

    def rows(self, per_device: int) -> slice:
        """This rank's rows of a global mini-batch (as a slice of it)."""
        return slice(self.rank * per_device, (self.rank + 1) * per_device)

    # ------------------------------------------------------------------ commands

    def send(self, command: LearnerCommand) -> None:
        """Rank 0: broadcast ``command`` to the followers."""
        payload = encode(command)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)

    def receive(self) -> LearnerCommand:
        """Followers: the next command from rank 0."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0)
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0)
        command = decode(buffer.numpy().tobytes())
        if not isinstance(command, LearnerCommand):
            raise RecordError(
                f"learner rank {self.rank}: expected a LearnerCommand from rank 0, got {type(command).__name__}"
            )
        return command

    # ------------------------------------------------------------------ reductions

    def reduce_stats(self, stats: dict[str, float], tokens: float) -> dict[str, float]:
        """One mini-batch's stats over every rank: the loss averages (FSDP averages the gradients the same
        way), token means weigh by each rank's completion tokens, entropy sums add up."""
        extremes = sorted(k for k in stats if k.endswith(("_min", "_max")))  # the least / greatest over ranks
        keys = sorted(k for k in stats if k not in extremes)
        sums = ("entropy_sum", "entropy_tokens", "logp_diff_sum", "logp_diff_tokens")
        values = [stats[k] if k in sums else stats[k] * (1.0 if k == "loss" else tokens) for k in keys]
        packed = torch.tensor([*values, tokens], dtype=torch.float64)
        dist.all_reduce(packed)
        total_tokens = max(float(packed[-1]), 1.0)
        reduced = {}
        for key, value in zip(keys, packed[:-1].tolist()):
            if key == "loss":
                reduced[key] = value / self.world_size
            elif key in sums:
                reduced[key] = value
            else:
                reduced[key] = value / total_tokens
        for key in extremes:
            extreme = torch.tensor([float(stats[key])], dtype=torch.float64)
            dist.all_reduce(extreme, op=dist.ReduceOp.MIN if key.endswith("_min") else dist.ReduceOp.MAX)
            reduced[key] = float(extreme)
        return reduced

    def sum(self, value: float) -> float:
        """``value`` summed over every rank."""
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total)

    def gather_rows(self, local: torch.Tensor, per_device: int) -> torch.Tensor:
        """Per-row values of this rank's rows (per_device rows of each mini-batch, in order) -> the values
        of every row of the generation batch, in its order (mini-batch by mini-batch, rank by rank)."""
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous())
        by_rank = [part.split(per_device) for part in parts]
        return torch.cat([chunk for minibatch in zip(*by_rank) for chunk in minibatch])

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
        """Clip by the global norm of the sharded gradients (as torchtitan: the DTensor norm made whole)."""
        parameters = [p for p in parameters if p.grad is not None]
        total: Any = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        total = total.full_tensor() if hasattr(total, "full_tensor") else total  # a DTensor's, made whole
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return float(total)

    # ------------------------------------------------------------------ whole states (collective)

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded weights on rank 0's CPU (an empty dict on the others)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast("dict[str, torch.Tensor]", state)  # full_state_dict: tensors, not DTensors

    def full_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, unsharded, on rank 0 (empty on the others)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer, options=options)

    def load_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Shard a name-keyed optimizer state (from any number of processes) onto this rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(
            f"learner: cannot shard {type(model).__name__} with FSDP2: no model.layers (a transformers "
            f"decoder-only model has them); run the learner as one process"
        )
    return list(layers)
