"""Every record that crosses a process boundary, in one place.

Records are frozen msgspec Structs in one tagged union, msgpack on the wire. Bulk numeric data
(token ids, loss masks, logprobs) travels as packed little-endian arrays in ``bytes``: decoding
never builds Python lists of numbers, and ``np.frombuffer`` reads them without a copy.

Schema evolution follows msgspec's rules: a new field gets a default, so an old worker still
decodes a newer record of the same ``schema``. A record whose ``schema`` is higher than this
module's ``SCHEMA`` is refused with a ``RecordError`` instead of being half-understood.
Nothing here is ever pickled: a payload that does not decode is dead-lettered, never executed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

SCHEMA = 1
"""The newest record schema this code understands."""


class RecordError(ValueError):
    """A payload that is not a valid record: garbage, an unknown tag, a bad field or a newer schema."""


# ---------------------------------------------------------------- packed arrays

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def pack_i32(values: Any) -> bytes:
    """Pack token ids / masks (any int sequence, numpy array or tensor) as little-endian int32."""
    return _as_numpy(values, _I32).tobytes()


def pack_f32(values: Any) -> bytes:
    """Pack logprobs (any float sequence, numpy array or tensor) as little-endian float32."""
    return _as_numpy(values, _F32).tobytes()


def unpack_i32(blob: bytes) -> np.ndarray:
    """A read-only int32 view of packed bytes (no copy)."""
    return np.frombuffer(blob, dtype=_I32)


def unpack_f32(blob: bytes) -> np.ndarray:
    """A read-only float32 view of packed bytes (no copy)."""
    return np.frombuffer(blob, dtype=_F32)


def _as_numpy(values: Any, dtype: np.dtype) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor; avoid importing torch here
        values = values.detach().cpu().numpy()
    return np.ascontiguousarray(values, dtype=dtype)


# ---------------------------------------------------------------- records


class Record(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every wire record. ``record_id`` is deterministic, so consumers are idempotent on it."""

    schema: int = SCHEMA

    @property
    def record_id(self) -> str:  # overridden by each record
        raise NotImplementedError


class FeederPosition(msgspec.Struct, frozen=True, kw_only=True):
    """Where the feeder stands once a task is out: the next generation batch and slot to fill, and how
    many prompts of the epoch-order stream it has taken. A restarted feeder resumes from the newest."""

    batch: int = 0
    slot: int = 0
    cursor: int = 0


class PromptTask(Record, frozen=True, kw_only=True, tag="prompt_task"):
    """One prompt group: the rollout samples ``num_generations`` independent requests for it."""

    prompt_id: str  # epoch + dataset row, e.g. "e0:17"
    attempt: int = 0  # 0 for a batch's own prompt; n for the n-th replacement of a dropped group
    generation_batch: int  # index b of the generation batch this group belongs to
    num_generations: int
    messages: list[dict[str, Any]]  # chat messages up to the assistant turn
    data_dict: dict[str, Any] = {}  # the dataset row's other columns (solution, ...)
    seed: int = 0  # base sampling seed; request i uses seed + i
    # Content keys ("sha256:<hex>", data/media.py) of the prompt's images, in order of their placeholders;
    # the bytes are stored once per group through the transport, never carried in records.
    images: list[str] = []
    min_policy_version: int = 0  # generate only with weights at least this new (generation_batch - max_staleness)
    # The row's tools column (JSON-schema dicts) that the chat template renders; None = no tools. Older tasks
    # carried it in data_dict.
    tools: list[dict[str, Any]] | None = None
    resume_at: FeederPosition | None = None  # the feeder's position after this task

    @property
    def group_id(self) -> str:
        return f"{self.prompt_id}/{self.attempt}"

    @property
    def record_id(self) -> str:
        return self.group_id


class Trajectory(Record, frozen=True, kw_only=True, tag="trajectory"):
    """One rollout request's result (one model completion, possibly over several turns)."""

    prompt_id: str
    attempt: int
    request_id: str  # "<prompt_id>/<attempt>/<i>"
    turn: int = 0  # >0 only when a scheduler splits one request into several records
    generation_batch: int
    prompt_ids: bytes  # int32
    completion_ids: bytes  # int32
    logprobs: bytes  # float32, the sampled tokens' logprobs under the rollout policy
    loss_mask: bytes = b""  # int32; empty means every completion token is trained on
    messages: list[dict[str, Any]] = []  # the prompt messages
    completion: str = ""  # decoded completion text
    finish_reason: str = "stop"  # "stop" | "length" | "abort"
    data_dict: dict[str, Any] = {}
    # A multi-turn scheduler's extra info (ms-swift ``rollout_infos``; rewards also see it as
    # ``multi_turn_infos``). Keys ``images``/``audios``/``videos`` override the row's media for training.
    rollout_infos: dict[str, Any] = {}
    # Content keys of the images the learner must see with ``prompt_ids`` (which are the engine's expanded
    # ids: one image token per merged patch). A scheduler's rollout_infos["images"] override lands here.
    images: list[str] = []
    # A multi-turn scheduler's final structured conversation (ms-swift's ``RolloutOutput.messages``: system,
    # user, assistant 1, inserted user/tool message, assistant 2, ...), the last reply last. Empty without a
    # scheduler: then the conversation is ``messages`` plus the assistant ``completion``.
    conversation: list[dict[str, Any]] = []
    # A multi-turn scheduler's ``(start, end)`` offsets in ``completion_ids`` of each assistant message's ids
    # after the prompt, in order (a continued message is one span, its inserted tokens included; an inserted
    # user/tool message and the template's markers lie in no span): ms-swift's ``response_token_ids`` lists.
    # Empty without a scheduler, and in records written before the field (rewards then rebuild them).
    message_spans: list[tuple[int, int]] = []
    policy_version: int  # oldest weights version used in any turn
    max_policy_version: int  # newest weights version used in any turn

    def __post_init__(self) -> None:
        # Checked on decode too (msgspec turns the error into a RecordError naming the record): a packed
        # array of a length no 4-byte element divides would otherwise fail later, in some stage's handler.
        for name in ("prompt_ids", "completion_ids", "logprobs", "loss_mask"):
            if len(getattr(self, name)) % 4:
                size = len(getattr(self, name))
                raise ValueError(f"field `{name}`: {size} bytes is not a packed 4-byte array")

    @property
    def record_id(self) -> str:
        return f"{self.request_id}/{self.turn}"

    @property
    def group_id(self) -> str:
        return f"{self.prompt_id}/{self.attempt}"

    @property
    def is_truncated(self) -> bool:
        return self.finish_reason == "length"

    def prompt_token_ids(self) -> np.ndarray:
        return unpack_i32(self.prompt_ids)

    def completion_token_ids(self) -> np.ndarray:
        return unpack_i32(self.completion_ids)

    def completion_logprobs(self) -> np.ndarray:
        return unpack_f32(self.logprobs)

    def completion_loss_mask(self) -> np.ndarray:
        if not self.loss_mask:
            return np.ones(len(self.completion_ids) // 4, dtype=_I32)
        return unpack_i32(self.loss_mask)


class GroupClosed(Record, frozen=True, kw_only=True, tag="group_closed"):
    """Manifest of a prompt group: every record_id it produced, in order. It travels inside the group's
    entries (``TrajectoryGroup``, ``ScoredGroup``); the ledger checks each trained group against it."""

    prompt_id: str
    attempt: int
    generation_batch: int
    record_ids: list[str]
    stage: str = "rollout"  # the stage that emitted it; forwarded manifests keep their identity

    @property
    def group_id(self) -> str:
        return f"{self.prompt_id}/{self.attempt}"

    @property
    def record_id(self) -> str:
        return f"{self.group_id}/closed"


class TrajectoryGroup(Record, frozen=True, kw_only=True, tag="trajectory_group"):
    """A whole prompt group in one entry: what the rollout sends for every group (the reward stage's only
    input), since a scheduler may split a request into several records that must be scored together (once
    per request), and separate entries could reach different reward workers."""

    manifest: GroupClosed
    trajectories: list[Trajectory]

    @property
    def group_id(self) -> str:
        return self.manifest.group_id

    @property
    def record_id(self) -> str:
        return f"{self.group_id}/group"


def trajectories_in(entries: list[Any]) -> list[Trajectory]:
    """The trajectories among a stage's output entries (``(edge, record)`` pairs or records): single
    ``Trajectory`` entries and those inside ``TrajectoryGroup`` entries, in order."""
    out: list[Trajectory] = []
    for entry in entries:
        record = entry[1] if isinstance(entry, tuple) else entry
        if isinstance(record, TrajectoryGroup):
            out += record.trajectories
        elif isinstance(record, Trajectory):
            out.append(record)
    return out


class ScoredTrajectory(Record, frozen=True, kw_only=True, tag="scored"):
    """A trajectory with its rewards: per function (None = not applicable) and the weighted total."""

    trajectory: Trajectory
    rewards: dict[str, float | None]
    reward: float
    # Non-empty when scoring failed and reward.on_error = "drop_group": the reason. The advantage stage
    # drops the whole group (it never trains on a partial or unscored group) and asks for a resample.
    failed: str = ""
    # Reward functions that failed on this record after their retries: name -> error (metrics.jsonl counts
    # them per step as rewards/<name>/failures; under on_error = "zero" they scored 0).
    reward_errors: dict[str, str] = {}
    # What the reward functions logged through TRL's log_extra (column -> this completion's value: columns of
    # completions.jsonl) and log_metric (name -> the mean over the call that scored this record's group:
    # averaged over the step's groups into metrics.jsonl).
    logged_extra: dict[str, Any] = {}
    logged_metrics: dict[str, float] = {}

    @property
    def record_id(self) -> str:
        return self.trajectory.record_id

    @property
    def group_id(self) -> str:
        return self.trajectory.group_id


class ScoredGroup(Record, frozen=True, kw_only=True, tag="scored_group"):
    """A whole scored prompt group in one entry (the reward stage's answer to a ``TrajectoryGroup``): one
    advantage worker gets all of it, so any number of reward and advantage workers never split a group."""

    manifest: GroupClosed
    records: list[ScoredTrajectory]

    @property
    def group_id(self) -> str:
        return self.manifest.group_id

    @property
    def record_id(self) -> str:
        return f"{self.group_id}/scored"


class TrainGroup(Record, frozen=True, kw_only=True, tag="train_group"):
    """Every scored record of one prompt attempt, with one advantage per record. Atomic unit of training."""

    prompt_id: str
    attempt: int
    generation_batch: int
    records: list[ScoredTrajectory]
    advantages: list[float]
    # One loss weight per record, multiplied into its completion mask; empty = 1.0 each. DAPO's
    # overlong filter sets 0.0 for truncated completions (their reward still counts in the advantages).
    loss_weights: list[float] = []
    # Groups the advantage worker dropped since its previous TrainGroup, by reason ("zero_std",
    # "reward_error"): the learner sums them into its per-step metrics (dropped/<reason>).
    drops: dict[str, int] = {}

    @property
    def group_id(self) -> str:
        return f"{self.prompt_id}/{self.attempt}"

    @property
    def record_id(self) -> str:
        return self.group_id


class WeightsPublished(Record, frozen=True, kw_only=True, tag="weights"):
    """The learner finished generation batch ``version - 1``; new weights are at ``path``, or (``via =
    "broadcast"``) every member of the weights group holds them already (weights/membership.py)."""

    version: int
    path: str  # a directory holding model.safetensors (or an adapter when ``lora``); via broadcast: no file
    lora: bool = False
    step: int = 0  # optimizer steps so far
    published_at: float = 0.0  # unix time
    final: bool = False  # the run is over: every worker drains and exits
    via: str = "file"  # "file": load ``path``; "broadcast": sent in epoch ``epoch`` of the weights group
    epoch: int = 0
    # Generation batches trained into these weights (-1 in records of older builds: equal to ``version``).
    # Versions never repeat within a run: a learner restarted from an older checkpoint numbers its restored
    # weights after every version its predecessors put out, so ``version - batches`` grows by the jump.
    batches: int = -1
    blob: str = ""  # a LoRA adapter over Redis: its content key (data/media.py), for a host not seeing ``path``

    @property
    def batches_trained(self) -> int:
        return self.version if self.batches < 0 else self.batches

    @property
    def record_id(self) -> str:
        return f"weights/{self.version}"


# The weights group's control plane (rollout.weight_transport = "broadcast"), on the fan-out edge
# ``weights.sync`` (weights/membership.py says who sends what, when).


class WeightsMember(Record, frozen=True, kw_only=True, tag="weights_member"):
    """A rollout worker registers as a member of the weights group. ``nonce`` names this process's
    incarnation; the worker's heartbeat keeps it alive as a lease (``membership.MEMBER_LEASE``)."""

    worker: str
    nonce: int
    seq: int = 0  # registrations of this incarnation: one left out of an epoch registers again
    host: str = ""
    engine: str = "async"  # rollout.engine
    server_urls: list[str] = []
    world_size: int = 1  # the engine's ranks (vLLM workers): consecutive ranks from its offset
    backends: list[str] = msgspec.field(default_factory=lambda: ["gloo"])
    role: str = "rollout"  # "eval": an evaluate worker's own engine (it loads only the versions it evaluates)

    @property
    def record_id(self) -> str:
        return f"weights_member/{self.worker}/{self.nonce}/{self.seq}"


class EpochMember(msgspec.Struct, frozen=True, kw_only=True):
    worker: str
    nonce: int
    seq: int = 0
    rank_offset: int = 0
    world_size: int = 1


class WeightsEpoch(Record, frozen=True, kw_only=True, tag="weights_epoch"):
    """The learner (rank 0) opens one group: "open" asks ``members`` whether they reach ``address:port``
    (each answers a ``WeightsAck`` step "reach"); "form" lists those that do, with their ranks, and they
    join (step "join"). ``left_out``: registered members not in it (they register again). "left_out": a
    notice with no members, sent the moment members are left out (``reasons[i]``: why ``left_out[i]`` was),
    so they register again without waiting for an epoch that may never come. The parameter metadata is the
    wire layout of every round of the epoch (weights/transfer.py)."""

    epoch: int
    phase: str  # "open" | "form" | "left_out"
    learner: int = 0  # the opening learner's incarnation (a restarted learner ignores its predecessor's acks)
    address: str
    port: int
    backend: str  # "gloo" | "nccl"
    world_size: int = 1
    members: list[EpochMember] = []
    left_out: list[EpochMember] = []
    reasons: list[str] = []  # "left_out": why each of ``left_out`` was left out (an older learner sends none)
    timeout_s: float = 60.0
    chunk_bytes: int = 0
    bucket_bytes: int = 0  # a receiver's device buffer at most (rollout.weight_sync_bucket_mb; 0: its default)
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []

    @property
    def record_id(self) -> str:
        return f"weights_epoch/{self.epoch}/{self.phase}"


class WeightsRound(Record, frozen=True, kw_only=True, tag="weights_round"):
    """The learner sends ``version`` to every member of ``epoch`` now (one broadcast round)."""

    epoch: int
    version: int
    bytes: int = 0
    final: bool = False  # the run's last version (an evaluator's engine loads it to evaluate it)

    @property
    def record_id(self) -> str:
        return f"weights_round/{self.epoch}/{self.version}"


class WeightsAck(Record, frozen=True, kw_only=True, tag="weights_ack"):
    """A member's answer: it reaches the learner ("reach"), joined the group ("join"), or holds ``version``
    ("load"); or why not (``error``, e.g. "unreachable 10.0.0.1:4242")."""

    epoch: int
    worker: str
    nonce: int
    step: str  # "reach" | "join" | "load"
    ok: bool = True
    version: int = 0
    error: str = ""
    seconds: float = 0.0

    @property
    def record_id(self) -> str:
        return f"weights_ack/{self.epoch}/{self.worker}/{self.step}/{self.version}"


class Feedback(Record, frozen=True, kw_only=True, tag="feedback"):
    """What happened to a prompt group downstream: trained, or dropped with a reason."""

    prompt_id: str
    attempt: int
    generation_batch: int
    outcome: str  # "trained" | "dropped"
    reason: str = ""  # why it was dropped: "staleness", "zero_std" (dynamic sampling), "dead_letter", ...
    learner_version: int = 0

    @property
    def record_id(self) -> str:
        return f"{self.prompt_id}/{self.attempt}/{self.outcome}"


DEAD_LETTER_DROP = "dead_letter"
"""``Feedback.reason`` of a group dropped because a record of it was dead-lettered: it can never be whole."""


class DeadLetter(Record, frozen=True, kw_only=True, tag="dead_letter"):
    """A payload no stage could handle, kept with the reason, never executed."""

    edge: str  # the stream it came from
    entry_id: str  # its id there
    payload: bytes  # raw bytes as received
    error: str
    stage: str = ""
    worker: str = ""
    deliveries: int = 0

    @property
    def record_id(self) -> str:
        return f"dead/{self.edge}/{self.entry_id}"


class LedgerOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One output of a ledger step: where it went and what it was (enough to audit, not the payload)."""

    edge: str
    type: str  # the record's tag: prompt_task, trajectory, train_group, feedback, ...
    record_id: str
    members: list[str] = []  # record ids it stands for: a manifest's, a TrainGroup's, a TrajectoryGroup's
    outcome: str = ""  # Feedback only: trained | dropped
    reason: str = ""  # Feedback only: why it was dropped


class LedgerEntry(Record, frozen=True, kw_only=True, tag="ledger"):
    """``run.ledger``: one atomic step of a stage worker, written in the same transport call as the ack
    it describes (``pipeline/ledger.py`` checks a run with them)."""

    stage: str
    worker: str
    acked: list[str] = []  # record ids of the inputs acked in this step
    outputs: list[LedgerOutput] = []
    note: str = ""  # "run_finished": held inputs acked because the run is over, not because they were used
    at: float = 0.0  # unix time

    @property
    def record_id(self) -> str:
        return f"ledger/{self.stage}/{self.worker}/{self.at}"
class LearnerCommand(Record, frozen=True, kw_only=True, tag="learner_command"):
    """Rank 0 of a distributed learner to its followers: the collective step they take next
    (trainer/distributed.py). ``action``: "train" (``groups`` at policy ``version``), "publish" (gather
    the weights), "checkpoint" (gather weights and optimizer), "stop"."""

    action: str
    version: int = 0
    groups: list[TrainGroup] = []

    @property
    def record_id(self) -> str:
        return f"learner_command/{self.action}/{self.version}"


AnyRecord = (
    PromptTask
    | Trajectory
    | GroupClosed
    | TrajectoryGroup
    | ScoredTrajectory
    | ScoredGroup
    | TrainGroup
    | WeightsPublished
    | WeightsMember
    | WeightsEpoch
    | WeightsRound
    | WeightsAck
    | Feedback
    | DeadLetter
    | LedgerEntry
    | LearnerCommand
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyRecord)


def encode(record: Record) -> bytes:
    """Encode one record; a field msgpack cannot hold (an arbitrary object in ``rollout_infos``, an int
    beyond 64 bits) is a RecordError naming the record, so the producing handler fails, not its worker."""
    try:
        return _encoder.encode(record)
    except (TypeError, OverflowError, ValueError) as exc:
        raise RecordError(f"cannot encode {type(record).__name__} {_record_id(record)}: {exc}") from None


def _record_id(record: Record) -> str:
    try:
        return repr(record.record_id)
    except Exception:  # noqa: BLE001 - only for the message; a half-built record may not have one
        return "(no record_id)"


def decode(payload: bytes) -> AnyRecord:
    """Decode one record; any problem (garbage, unknown tag, bad field, newer schema) is a RecordError."""
    try:
        record = _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise RecordError(f"invalid record: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError itself for a bad UTF-8 tag (found by tests/test_fuzz.py): left
        # unwrapped, it escaped the worker's RecordError handler and killed the worker.
        raise RecordError(f"undecodable payload ({len(payload)} bytes): {exc}") from None
    if record.schema > SCHEMA:
        raise RecordError(
            f"field `schema`: record {type(record).__name__} has schema {record.schema}, this worker "
            f"understands up to {SCHEMA}; upgrade rollstream on this worker"
        )
    return record
