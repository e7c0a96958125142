"""The configuration's schema: one msgspec Struct per section, each field's type, range, default and
docstring (the docs' configuration reference is generated from them), and the tables of derived defaults."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec
from msgspec import Meta

from pipeline.errors import UserError


class ConfigError(UserError, ValueError):
    """A config the user must fix; the message is one paragraph that names the field."""


# Value ranges live in the annotations: msgspec enforces them, range_text() explains them.
PositiveInt = Annotated[int, Meta(ge=1)]


NonNegativeInt = Annotated[int, Meta(ge=0)]


PositiveFloat = Annotated[float, Meta(gt=0)]


NonNegativeFloat = Annotated[float, Meta(ge=0)]


Fraction = Annotated[float, Meta(ge=0, le=1)]


OpenFraction = Annotated[float, Meta(gt=0, le=1)]


AdamBeta = Annotated[float, Meta(ge=0, lt=1)]


Port = Annotated[int, Meta(ge=0, le=65535)]


Dtype = Literal["float32", "bfloat16", "float16"]


DERIVED: Any = None
"""The default of a field that loading derives when it is not given (``config/derive.py``; how: ``FORMULAS``).
None only on the way in (``--set field=none`` asks for the derived value again): a loaded Config holds a
value of the field's own type in each of ``DERIVED_FIELDS``."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the section structs. Not frozen: the CLI may adjust a field (see also ``replace``)."""


class RunConfig(Section):
    name: str = "demo"
    """Run name: the Redis key prefix (``rollstream:{name}:...``) and the output directory's stem."""
    output_dir: str = ""
    """Checkpoints, metrics.jsonl and logs; "" = ``runs/<name>-<YYYYmmdd-HHMMSS>`` (resolve_output_dir). Over
    Redis (separate worker processes) it must be set, and a relative one is made absolute in each worker."""
    seed: NonNegativeInt = 42
    """Seed for torch, the built-in dataset and (unless ``data.data_seed``) the epoch shuffle."""
    max_steps: NonNegativeInt = 0
    """Optimizer steps to train; 0 = as many as ``data.num_train_epochs`` gives. Wins over epochs."""
    external_plugins: list[str] = []
    """Python files imported before the run, to register rewards and schedulers (as ms-swift)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """structlog level of every worker."""
    metrics_port: Port = 0
    """0 = off; else /metrics and /healthz: `train` serves every stage on it, a Procfile worker on port + i
    for stage i of feeder, rollout, reward, advantage, learner (ops/prometheus.yml scrapes 9400-9404)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics server binds; loopback unless a scraper on another host needs it."""
    report_to: list[Literal["tensorboard", "wandb"]] = []
    """Also send every metrics.jsonl row to TensorBoard (<output_dir>/tensorboard) and/or Weights & Biases
    (as ms-swift's report_to); the package must be installed, it is not a dependency."""
    log_completions: bool = True
    """Write every trained completion (prompt, completion, rewards, advantage, versions) to
    <output_dir>/completions.jsonl, as ms-swift's and TRL's log_completions (their default is false); false =
    no completions.jsonl (``rollstream inspect RUN_DIR`` then says so; ``--redis`` still reads the scored edge)."""
    num_completions_to_print: NonNegativeInt = 0
    """TRL's num_completions_to_print: every 10 optimizer steps, ``rollstream train`` prints a table of this many
    completions (a seeded random sample) of the generation batch just trained; 0 = none (TRL's None, all of
    them: grpo.generation_batch_size or more). Needs log_completions (as in TRL)."""
    ledger: bool = False
    """Every stage records, in the same atomic step as each ack, the record ids it acked and produced
    (Redis: ``rollstream:{name}:ledger.<stage>``; memory: ``<output_dir>/ledger/<stage>.jsonl`` at the end);
    ``rollstream ledger check`` audits it: nothing lost, nothing trained twice, groups whole."""
    max_consecutive_errors: PositiveInt = 3
    """The same error from a multi-turn scheduler or a reward function on this many consecutive groups stops
    the run with that error (exit code 1) instead of resampling or scoring 0 forever."""


class ModelConfig(Section):
    model: str = "tiny"
    """"tiny" = the project's built-in tiny model (the demo's); "mid" = an ~18 M-parameter random-init
    Qwen2 for throughput benchmarks (tinymodels/text.py); a local model directory; or a Hub id
    (``Qwen/Qwen2.5-0.5B-Instruct``, ms-swift's ``org/name:subfolder`` too), fetched once into the Hugging Face
    cache (``huggingface_hub.snapshot_download``: HF_HOME / HF_HUB_CACHE; HF_HUB_OFFLINE=1 reads the cache only)."""
    model_revision: str | None = None
    """Branch, tag or commit of a Hub model (ms-swift's model_revision); None = main (ModelScope: master)."""
    use_hf: bool = True
    """Hub ids of model.model, reward.reward_model and data.dataset name Hugging Face Hub repositories (true) or
    ModelScope ones (false: needs ``pip install modelscope``). ms-swift's default is false (ModelScope, or its
    USE_HF=1); rollstream's is true: the Hugging Face libraries are its dependencies and most recipes cite HF ids."""
    torch_dtype: Dtype = "float32"
    """Learner weights dtype."""
    chat_template: str | None = None
    """A chat template used instead of the tokenizer's, for every prompt the rollout, the multi-turn schedulers
    and evaluation render: jinja text, or the path of a .jinja file or a chat_template.json (transformers'
    ``tokenizer.chat_template``; ms-swift's ``--template`` names a built-in template instead). None = the
    tokenizer's own."""


class DataConfig(Section):
    dataset: str | list[str] = "arithmetic"
    """One dataset or a list of them, concatenated in order (as ms-swift's --dataset). Each is a built-in task
    (arithmetic, guess_number, shapes), a local .jsonl / .json / .parquet / .csv / .txt file, a folder of data
    files or a ``datasets`` save_to_disk folder, or a Hub dataset id (``datasets.load_dataset``, its cache;
    HF_HUB_OFFLINE=1 reads the cache only), with ms-swift's syntax ``id_or_path:subset1/subset2#N`` (subsets;
    N rows sampled with data_seed) and ``hf::`` / ``ms::`` prefixes. Columns are mapped as ms-swift does
    (docs/data.md)."""
    columns: dict[str, str] = {}
    """Column renames applied before the automatic mapping, ms-swift style: ``{question = "query", gold = "solution"}``."""
    disable_auto_column_mapping: bool = False
    """ms-swift's: skip the automatic mapping of column aliases (question, problem, answer, conversations, ...);
    rows then need ms-swift's own names (messages, or query / response / system / history) after ``columns``."""
    system: str | None = None
    """System prompt prepended to conversations that have none; a path ending in .txt is read as the prompt (as
    ms-swift's --system); a literal ``\\n`` in the string is a newline. None = none."""
    num_train_epochs: PositiveInt = 1
    """Passes over the dataset (``run.max_steps`` > 0 wins over it)."""
    dataset_shuffle: bool = True
    """Shuffle the rows every epoch (seeded, so a restart replays the same order)."""
    data_seed: NonNegativeInt | None = None
    """Seed of the shuffle and of the built-in dataset; None = ``run.seed``."""
    dataset_size: PositiveInt = 2000
    """Rows generated for a built-in task without ``#N`` (files and Hub datasets give all their rows)."""
    max_length: PositiveInt | None = None
    """Prompt token cap (ms-swift's max_length, its max_prompt_length in GRPO); longer prompts follow
    ``grpo.truncation_strategy``. max_length + grpo.max_completion_length must fit rollout.max_model_len.
    None = rollout.max_model_len - grpo.max_completion_length, so no completion is ever cut by the context."""
    val_dataset: str | list[str] | None = None
    """Held-out set for evaluation: one or more datasets as data.dataset (``#N`` takes the first N rows, as
    ms-swift's unshuffled val set), read with the same ``columns`` mapping; None or [] = none (see
    split_dataset_ratio)."""
    split: str = "train"
    """The split read from Hub datasets, data folders and save_to_disk DatasetDicts for data.dataset (ms-swift
    reads train; the Hub takes slices such as ``train[:10%]``)."""
    val_split: str = "train"
    """The same for data.val_dataset (e.g. "test" for a Hub dataset's test split)."""

    def __post_init__(self) -> None:
        # ms-swift's args.json writes val_dataset = [] for "none"; an empty train list cannot mean anything.
        if self.val_dataset == []:
            self.val_dataset = None
        entries = [self.dataset] if isinstance(self.dataset, str) else self.dataset
        if not entries or any(not entry.strip() for entry in entries):
            raise ConfigError(f"data.dataset={self.dataset!r}: give a dataset (a name, path or Hub id) or a list of them")
    max_image_bytes: PositiveInt = 8 * 1024 * 1024
    """Largest image file a row may carry (bytes); a bigger one is an error naming the row."""
    split_dataset_ratio: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Hold out this fraction of the train set's distinct prompts for evaluation (ms-swift >= 3.6's default 0):
    split from the data seed, deterministically, and a prompt is never on both sides."""
    chat_template_kwargs: dict[str, Any] = {}
    """Extra keywords of every ``apply_chat_template`` that renders a prompt (rollout, multi-turn turns,
    evaluation), TRL's ``chat_template_kwargs``: e.g. ``{enable_thinking = false}`` for Qwen3."""
    enable_thinking: bool | None = None
    """ms-swift's ``--enable_thinking``: sets ``chat_template_kwargs.enable_thinking`` (false: Qwen3's template
    opens each reply with an empty think block). None = the template's default; both set and different is an error."""
    response_prefix: str | None = None
    """ms-swift's ``--response_prefix``: text appended after the generation prompt, so every reply starts with it
    (a prompt token, not trained); e.g. ``"<think>\\n"``. None = none."""


class GrpoConfig(Section):
    # Group and batch sizes, with ms-swift's names and semantics (see derive_batch_sizes).
    num_generations: PositiveInt = 8
    """Completions sampled per prompt (one group); advantages are relative within the group."""
    per_device_train_batch_size: PositiveInt = 8
    """Completions per learner mini-batch on one device."""
    world_size: PositiveInt = 1
    """Learner data-parallel processes; a global mini-batch is per_device_train_batch_size * world_size."""
    generation_batch_size: PositiveInt = DERIVED
    """Completions per generation cycle, all devices; wins over steps_per_generation. An int after load."""
    steps_per_generation: PositiveInt = DERIVED
    """Mini-batches per generation batch; unset = gradient_accumulation_steps. An int after load."""
    gradient_accumulation_steps: PositiveInt = DERIVED
    """Mini-batches per optimizer step; unset = 1, or derived from effective_batch_size. An int after load."""
    effective_batch_size: PositiveInt | None = None
    """Completions per optimizer step; sets gradient_accumulation_steps = ceil(this / global mini-batch)."""
    num_iterations: PositiveInt = 1
    """Passes over each generation batch (ms-swift's mu); > 1 reuses samples under the clipped ratio."""
    max_staleness: NonNegativeInt = 1
    """Train only on trajectories at most this many policy versions old; 0 = synchronous on-policy."""

    # Sampling.
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature; 0 (greedy) is rejected when num_generations > 1."""
    top_p: OpenFraction = 1.0
    """Nucleus sampling mass; 1.0 = off."""
    top_k: Annotated[int, Meta(ge=-1)] = -1
    """Sample among the k likeliest tokens; -1 (or 0) = off, as vLLM."""
    repetition_penalty: PositiveFloat = 1.0
    """vLLM repetition penalty; 1.0 = off."""
    max_completion_length: PositiveInt = 512
    """Most tokens generated per completion (per turn for multi-turn schedulers)."""

    # Loss.
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = "grpo"
    """The policy term and how token losses are averaged (ms-swift/TRL names): the PPO clip averaged per
    sequence (grpo), per token of the mini-batch (bnpo), by a constant (dr_grpo) or per token of the generation
    batch (dapo); cispo (MiniMax-M1): -sg(min(w, epsilon_high)) A logp, averaged as dapo; sapo: a soft gate
    -sigmoid(tau (w - 1)) (4 / tau) A (tau_pos, tau_neg), averaged as grpo."""
    beta: NonNegativeFloat = 0.04
    """KL coefficient against the reference model; 0 = no reference model is loaded."""
    epsilon: NonNegativeFloat = 0.2
    """PPO clip range of the importance ratio: [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: NonNegativeFloat | None = None
    """Upper clip (DAPO's clip-higher); None = epsilon. For cispo the cap of the ratio itself, not 1 + it
    (ScaleRL uses 5.0; left unset, cispo caps every token's weight at epsilon)."""
    delta: PositiveFloat | None = None
    """Two-sided clipping bound on the ratio for negative advantages (TRL/INTELLECT-2); None = off."""
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = "token"
    """Importance ratio per token (GRPO) or per sequence (GSPO); cispo takes token only."""
    tau_pos: PositiveFloat = 1.0
    """sapo's gate temperature where the advantage is positive (ms-swift's name); larger = closer to a hard clip."""
    tau_neg: PositiveFloat = 1.05
    """sapo's gate temperature where the advantage is not positive (ms-swift's name); usually above tau_pos."""
    off_policy_sequence_mask_delta: NonNegativeFloat | None = None
    """Off-policy sequence masking (DeepSeek-V3.2, ms-swift's name): leave out of the loss every completion whose
    mean over its tokens of (engine - current policy) log-probs exceeds this and whose advantage is negative;
    None = off. Logged as off_policy_sequence_mask/dropped_token_ratio."""
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo"
    """Baseline of the advantage (ms-swift): the group mean (grpo), the mean of the group's other
    completions (rloo), or the group mean then whitened by the batch's advantage std (reinforce_plus_plus)."""
    scale_rewards: Literal["group", "batch", "none", "gdpo"] = DERIVED
    """Divide advantages by the reward std of the group, of the whole batch, or not at all (Dr. GRPO); gdpo
    (ms-swift): normalise each reward function within its group, sum them by reward.reward_weights, then
    normalise the sum over the generation batch (grpo estimator only, no kl_in_reward).
    None = the estimator's ms-swift default: grpo group, rloo none, reinforce_plus_plus batch.
    A str after load."""
    kl_in_reward: bool = DERIVED
    """Subtract beta * KL_i (KL_i = sum over the completion of old - ref log-probs, as ms-swift) from each
    reward before the advantages, instead of adding beta * KL to the loss. None = the estimator's
    ms-swift default: false for grpo, true for rloo and reinforce_plus_plus. A bool after load."""
    rollout_importance_sampling_mode: (
        Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] | None
    ) = None
    """Correct the engine/learner mismatch (ms-swift): weight tokens by the old/rollout ratio, truncated or masked above the threshold; None = off."""
    rollout_importance_sampling_threshold: PositiveFloat = 2.0
    """Upper bound of the rollout importance-sampling weight (ms-swift's C)."""
    rollout_importance_sampling_convention: Literal["ms-swift", "trl"] = "ms-swift"
    """How the rollout IS weight is formed: ms-swift's (a sequence's ratio is the geometric mean of its token
    ratios, sequence_mask keeps the token ratios, the weight multiplies the KL term too) or TRL's (its
    vllm_importance_sampling_*: the sequence ratio is their product and is itself the weight, on the policy
    term only). ``rollstream config from-trl`` and TRL's names set "trl"."""
    use_bias_correction_kl: bool = False
    """Multiply the KL term by the importance ratio (TRL's name and DeepSeek-V3.2's unbiased KL gradient; TRL's
    default is true, ms-swift has no such option); false = the plain k3 term."""
    top_entropy_quantile: Fraction = 1.0
    """Train only on completion tokens whose entropy is in this top fraction of the mini-batch's (TRL/ms-swift);
    1.0 = every token."""
    log_entropy: bool = False
    """Log the policy's mean per-token entropy over completion tokens as entropy/mean (one softmax pass more)."""

    # Data shaping.
    truncation_strategy: Literal["left", "delete"] = "left"
    """Prompts over data.max_length: keep their last tokens ("left"), or drop and resample them ("delete")."""
    dynamic_sample: bool = False
    """DAPO dynamic sampling: resample groups whose rewards all agree (zero advantage)."""
    max_resample_times: NonNegativeInt = 3
    """Rounds of resampling under dynamic_sample, as ms-swift counts them: each round re-asks, with new prompts,
    every group found zero-std in the round before (round 0 = the generation batch's own prompts; a group's
    round is its attempt); a zero-std group of the last round is trained as it is. 0 = never resample."""
    overlong_filter: bool = False
    """Mask truncated completions out of the loss (DAPO's overlong filtering)."""

    @property
    def prompt_batch_size(self) -> int:
        """Prompt groups per generation batch (derived): generation_batch_size // num_generations."""
        return self.generation_batch_size // self.num_generations

    @property
    def drop_last(self) -> bool:
        """Always true: a partial generation batch at the end of an epoch is dropped (as ms-swift)."""
        return True


class RolloutConfig(Section):
    engine: Literal["async", "server"] = "async"
    """"async" = vLLM AsyncLLM inside the rollout worker; "server" = OpenAI-compatible ``vllm serve``
    processes started separately (``server_urls``), asked for token ids and logprobs."""
    server_urls: list[str] = []
    """Base URLs of the vLLM servers for engine = "server" (``http://host:port``); requests go round-robin,
    a failed one is retried on the next server. Weight reloads need the servers in VLLM_SERVER_DEV_MODE=1."""
    server_timeout_s: PositiveFloat = 300.0
    """Longest wait for one server request (a turn) before it is retried on another server."""
    max_model_len: PositiveInt | None = None
    """vLLM context length: prompt plus completion tokens (all turns of a multi-turn request); ms-swift's
    ``vllm_max_model_len``. None = the model's maximum (config.json's max_position_embeddings and kin, as
    ms-swift and vLLM read it), on a CPU engine at most what ``kv_cache_gib`` holds. data.max_length +
    grpo.max_completion_length must fit in it (an error otherwise), so a completion is never cut short."""
    kv_cache_gib: PositiveFloat = 1.0
    """KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE on CPU)."""
    enforce_eager: bool = True
    """Skip CUDA-graph / compile warm-up; right for tiny models and tests."""
    dtype: Dtype = "float32"
    """vLLM weights dtype."""
    limit_mm_per_prompt: dict[str, int] = msgspec.field(default_factory=lambda: {"image": 1})
    """Image-prompt models: the most images one prompt may carry, vLLM's limit_mm_per_prompt (ms-swift's
    vllm_limit_mm_per_prompt); videos are always 0 here. Ignored for text models."""
    max_concurrent_groups: PositiveInt = 16
    """Prompt groups in flight per rollout worker (bounds the engine's queue)."""
    max_num_seqs: PositiveInt = DERIVED
    """vLLM's concurrent sequences; None = per_device_train_batch_size * tensor_parallel_size *
    steps_per_generation (ms-swift's default). An int after load."""
    tensor_parallel_size: PositiveInt = 1
    """vLLM tensor parallelism (GPU only; 1 on CPU)."""
    engine_threads: PositiveInt | None = None
    """OpenMP threads of a CPU vLLM engine (its engine-core process; ignored on GPU). None = the cores this
    process may use less learner.torch_threads, at least 1 (a learner on the same machine keeps its cores).
    Each engine thread spins on its core between parallel regions, so threads the engine cannot keep busy
    take cores from the learner: on 2 cores the demo trains 1.4x faster with 1 than with vLLM's default (all).
    A rollout worker alone on its machine may want all of them."""
    weight_load: Literal["pause", "drain", "in_flight"] = "pause"
    """When the engine loads new weights, how it pauses (formerly ``weight_sync``, still accepted): "pause" stops
    starting new turns, loads once the running turns end, and resumes (a multi-turn trajectory may span versions);
    "drain" stops starting new requests and loads once every in-flight request has finished all its turns (each
    trajectory has one version); "in_flight" loads at once, between two engine steps, while requests run: their
    later tokens come from the new weights (PipelineRL's in-flight update; each trajectory records the oldest and
    newest version it used, staleness counts the oldest, and its log-probs are the sampling ones token by token).
    No load waits for the longest request, which at scale is what keeps engines busy. In-process vLLM engine, full
    weights (not "lora", not servers)."""
    weight_transport: Literal["file", "lora", "broadcast", "nccl"] = DERIVED
    """How weights travel to the engine (formerly ``weight_sync_mode``, still accepted): a full safetensors
    snapshot loaded in place ("file"; every rollout worker must see the learner's run.output_dir), the learner's
    LoRA adapter hot-swapped into a LoRA-enabled engine ("lora", the base stays loaded), or one collective
    broadcast per version from the learner to every rollout engine, with no shared filesystem ("broadcast": gloo on
    CPU, NCCL when the learner and every engine are on CUDA; docs/weight-sync.md). None = "lora" when
    learner.train_type = "lora", else "file". "nccl" is the former name of "broadcast" on GPUs: use "broadcast"."""
    weight_sync_address: str = ""
    """Broadcast: the address the learner binds and advertises to the rollout workers; "" = the local
    address of its connection to Redis (127.0.0.1 on the memory transport). Never a wildcard (0.0.0.0)."""
    weight_sync_port: NonNegativeInt = 0
    """Broadcast: the learner's port for the group's rendezvous; 0 = a free one per epoch (the members
    also accept connections from each other on free ports: open them between the rollout hosts)."""
    weight_sync_chunk_mb: PositiveFloat = 64.0
    """Broadcast: the size of one packed chunk (one collective call)."""
    weight_sync_bucket_mb: PositiveFloat = 1024.0
    """Broadcast: the most device memory an engine's receive holds besides its model: the version arrives
    bucket by bucket into one buffer of this size on the engine's device, each bucket copied into a staging
    copy in (pinned) host memory, loaded into the model only once whole. At least weight_sync_chunk_mb on
    GPUs (a chunk is one collective call; a smaller bucket grows to one chunk)."""
    weight_sync_timeout_s: PositiveFloat = 30.0
    """Broadcast: the longest a member may take to join a group, or one chunk may take on the wire: past it
    the learner's round fails, it rebuilds the group without whoever did not answer and sends again (a
    member that dies fails the round at once; one that stalls, after this)."""
    colocate: bool = False
    """Share the device with the learner, sleeping vLLM between rollouts (GPU only; an error on CPU)."""
    seed: NonNegativeInt = 0
    """Base sampling seed of the engine."""
    min_p: Fraction = 0.0
    """vLLM min_p sampling (drop tokens below min_p * the top probability); 0 = off."""
    stop: list[str] = []
    """Stop strings: a turn ends when it writes one (not included in the completion)."""
    multi_turn_scheduler: str | None = None
    """Registered multi-turn scheduler name (schedulers.multi_turns, plugins, entry points); None = single turn."""
    max_turns: PositiveInt | None = None
    """Turn cap for the multi-turn scheduler; None = the scheduler decides."""
    loss_scale: Literal["default", "last_round"] = DERIVED
    """Which model turns are trained (ms-swift): every one, or only the last assistant round. A scheduler's
    explicit response_loss_mask wins. None = "last_round" with use_gym_env (as ms-swift), else "default"."""

    # Gym-style environments (schedulers/gym.py; docs/gym.md).
    use_gym_env: bool = DERIVED
    """Roll out in environments (ms-swift's --use_gym_env): the multi-turn scheduler defaults to gym_scheduler,
    and the env's reward (env_reward) is always one more reward, after reward_funcs and reward_model, as ms-swift
    adds its gym_reward column (reward_weights then hold one weight more; unset = 1.0 each). Naming env_reward in
    reward_funcs places it there instead. None = true when gym_env is set."""
    gym_env: str | None = None
    """Registered env name (schedulers.envs, plugins, entry points ``rollstream.envs``); a row's
    ``env_config.name`` wins over it."""
    context_manager: str | None = None
    """Registered context manager applied to the history before each turn; a row's ``ctx_config.name`` wins;
    None = the history as it is."""
    env_config: dict[str, Any] = {}
    """Default env init keys, under each row's own ``env_config`` (e.g. ``{url = "http://127.0.0.1:8100"}``
    for the remote env)."""
    env_timeout_s: PositiveFloat = 60.0
    """Longest one env reset / step / close may take; longer fails the request like a raise."""
    max_concurrent_envs: PositiveInt = 64
    """Live envs per rollout worker at most (a request waits for a slot before its reset)."""

    # TRL's agent training (schedulers/tool_calling.py; docs/agents.md).
    tools: list[str] = []
    """TRL's ``GRPOTrainer(tools=[...])``: Python functions the model may call, as "module:function" (or names a
    plugin registered in ``schedulers.registered_tools``); their JSON schemas come from their type hints and
    Google-style docstrings (transformers' get_json_schema) and are rendered into every prompt. Selects the
    tool_calling scheduler."""
    environment_factory: str | None = None
    """TRL's ``environment_factory``: a class (or function) as "module:Class" (or a name in
    ``schedulers.environment_factories``) whose instances are the episodes' environments: ``reset(**row)``,
    public methods as tools, rewards get ``environments=[...]``. Selects the tool_calling scheduler."""
    max_tool_calling_iterations: PositiveInt | None = None
    """TRL's: tool-calling rounds per episode at most; None = until the model stops calling tools or the
    completion budget (grpo.max_completion_length) is spent."""
    agent: str | None = None
    """Any agent program (docs/agents.md): an async function "module:function" called per episode as
    ``await agent(base_url, api_key, row)`` that talks to the policy through an OpenAI-compatible endpoint
    served over this worker's engine (``/v1/chat/completions``, ``/v1/completions``, ``/inference/v1/generate``)
    and returns the episode's reward (or None: the reward functions score it). Selects the agent scheduler."""
    agent_timeout_s: PositiveFloat = 600.0
    """Longest one episode of rollout.agent may take; longer fails the request (retried, then counted against
    run.max_consecutive_errors)."""
    agent_host: str = "127.0.0.1"
    """Address the agent endpoint binds (loopback: reachable only from this host; every call needs the episode's
    key)."""
    verifiers_python: str = ".venv-verifiers/bin/python"
    """The interpreter of the verifiers venv (``make venv-verifiers``) that runs data.dataset = "verifiers:<env>"
    environments through compat/verifiers_bridge.py (verifiers' pins are not rollstream's)."""
    verifiers_taskset: dict[str, Any] = {}
    """The verifiers taskset's own settings (its config knobs, e.g. ``{num_tasks = 100}``), passed unchanged."""
    verifiers_max_episodes: PositiveInt = 4
    """verifiers episodes in flight per rollout worker: each runs a harness process (about 1.7 s of CPU to
    start on the 2-core machine), so bound them by cores, not by engine slots."""
    tool_timeout_s: PositiveFloat = 30.0
    """Longest one tool call (or an environment's reset / get_reward) may take; longer answers the model
    with an error (a tool) or fails the request (reset)."""


class RewardConfig(Section):
    reward_funcs: list[str] = []
    """Registered reward function names (built-in or from run.external_plugins)."""
    reward_weights: list[float] = DERIVED
    """One weight per reward (reward_funcs, then reward_model); None = 1.0 each. A list after load."""
    reward_model: str | None = None
    """A reward model scored after reward_funcs: a local sequence-classification model directory
    (transformers) or its Hub id, or an http(s):// URL of a reward service (JSON in/out); None = none."""

    # Failure policy (rewards/ and stages/reward.py).
    timeout_s: PositiveFloat = 30.0
    """Longest one reward call may take (over a batch of groups: reward.batch_groups); longer counts as an error."""
    max_retries: NonNegativeInt = 1
    """Retries of a reward call that raised or timed out, before reward.on_error applies."""
    on_error: Literal["zero", "drop_group", "dead_letter"] = "zero"
    """After the retries (or when every function returned None/NaN): score 0 and count it (zero), drop
    the whole group so the feeder resamples it (drop_group), or dead-letter the record (dead_letter)."""
    executor: Literal["threads", "processes"] = "threads"
    """Where sync reward functions run, so none blocks the event loop: a thread pool, or a process pool
    (CPU-heavy or untrusted functions; a call over timeout_s kills its process)."""
    executor_workers: PositiveInt = 4
    """Threads or processes of that pool."""
    batch_groups: PositiveInt = 8
    """Most prompt groups one call of each reward function scores: a reward worker scores the groups it
    holds at the same time (those delivered together) in one call, as ms-swift and TRL call a reward once
    per local batch, so a batched reward model or a remote verifier amortises its call. 1 = a call per group."""

    # Built-in rewards' parameters: ms-swift's names and defaults.
    cosine_min_len_value_wrong: float = -0.5
    """cosine: reward of a wrong answer of length 0 (r^w_0, arXiv 2502.03373)."""
    cosine_max_len_value_wrong: float = 0.0
    """cosine: reward of a wrong answer of length cosine_max_len (r^w_L)."""
    cosine_min_len_value_correct: float = 1.0
    """cosine: reward of a correct answer of length 0 (r^c_0)."""
    cosine_max_len_value_correct: float = 0.5
    """cosine: reward of a correct answer of length cosine_max_len (r^c_L)."""
    cosine_max_len: PositiveInt | None = None
    """cosine: L_max in completion tokens; None = grpo.max_completion_length."""
    repetition_n_grams: PositiveInt = 3
    """repetition: n-gram size (words) of the repetition penalty."""
    repetition_max_penalty: float = -1.0
    """repetition: the penalty of a completion that is nothing but one repeated n-gram (<= 0)."""
    soft_max_length: PositiveInt | None = None
    """soft_overlong (DAPO): L_max in completion tokens; None = grpo.max_completion_length."""
    soft_cache_length: PositiveInt | None = None
    """soft_overlong: the punished band before soft_max_length; required when soft_overlong is used."""

    # code_execution: limits of the sandboxed subprocess that runs each test case.
    code_timeout_s: PositiveFloat = 5.0
    """Wall-clock limit of one test-case run (CPU limit: the same, rounded up)."""
    code_memory_mb: PositiveInt = 512
    """Address-space limit of the program (RLIMIT_AS), MiB."""
    code_max_output_bytes: PositiveInt = 65536
    """stdout/stderr kept per run; a program writing more is killed and scores 0."""
    code_max_file_bytes: PositiveInt = 1048576
    """Largest file the program may write in its temp dir (RLIMIT_FSIZE)."""

    # Reward models.
    reward_model_batch_size: PositiveInt = 16
    """Conversations per forward pass of a local reward model."""
    remote_max_concurrency: PositiveInt = 8
    """Requests in flight to a remote reward service (reward_model = http(s)://...)."""
    remote_retries: NonNegativeInt = 3
    """Retries of a failed remote request (connection error, 5xx, 429), with exponential backoff."""
    remote_backoff_s: NonNegativeFloat = 0.2
    """First backoff of those retries; doubles each time."""


class LearnerConfig(Section):
    learning_rate: PositiveFloat = DERIVED
    """AdamW peak learning rate; None = ms-swift's default: 1e-5 for train_type = "full", 1e-4 for "lora".
    A float after load."""
    weight_decay: NonNegativeFloat = 0.1
    """AdamW decoupled weight decay (ms-swift's default), on the weight matrices only: biases and norm weights
    (1-D parameters) are not decayed, as transformers' Trainer."""
    adam_beta1: AdamBeta = 0.9
    """AdamW beta1."""
    adam_beta2: AdamBeta = 0.95
    """AdamW beta2 (ms-swift's default; transformers' is 0.999)."""
    adam_epsilon: PositiveFloat = 1e-8
    """AdamW epsilon."""
    max_grad_norm: PositiveFloat = 1.0
    """Gradient clipping by global norm."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "cosine"
    """Learning-rate schedule after warm-up (transformers' names): cosine (ms-swift's default) and linear decay
    to 0 at the run's last optimizer step."""
    warmup_ratio: Fraction = 0.0
    """Fraction of the optimizer steps spent warming up linearly from 0."""
    device: str = "auto"
    """Where the learner trains: "cpu", "cuda" or "cuda:N"; "auto" = the first CUDA GPU when torch sees one,
    else the CPU. With grpo.world_size > 1 (torchrun) each process takes the GPU of its local rank ("cuda", or
    "auto" when there is a GPU per local process) and FSDP2 runs over NCCL, else over gloo on the CPU."""
    torch_threads: PositiveInt = 1
    """torch.set_num_threads for the learner process. 1 leaves the other cores to a rollout engine on the same
    machine; at ``max_staleness = 0`` generation and training take turns, so more threads can pay off (an 18 M
    model on 2 cores: 1.6x samples/s with 2; the 0.4 M demo model: slower, thread overhead)."""
    save_steps: NonNegativeInt = 0
    """Checkpoint (``checkpoint-<step>``: weights, optimizer, scheduler, RNGs, counters, feeder position) at
    the first generation-batch boundary after every this many optimizer steps; 0 = only at the end."""
    save_total_limit: PositiveInt | None = None
    """Keep at most this many checkpoints, removing the oldest (transformers' name); None = keep all."""
    sync_ref_model: bool = False
    """Move the reference model toward the policy every ref_model_sync_steps optimizer steps (TRL/ms-swift)."""
    ref_model_mixup_alpha: Fraction = 0.6
    """With sync_ref_model: ref = alpha * policy + (1 - alpha) * ref (TRL's default 0.6)."""
    ref_model_sync_steps: PositiveInt = 512
    """With sync_ref_model: optimizer steps between reference updates (TRL's default 512)."""
    max_tokens_per_batch: PositiveInt | None = None
    """Padding-free training: each mini-batch is split into micro-batches of at most this many tokens
    (prompt + completion; a longer sequence goes alone), packed into one row each and backpropagated one at
    a time; loss and gradients equal the padded path's. None = one padded forward per mini-batch."""
    gradient_checkpointing: bool = False
    """Recompute activations during backward instead of keeping them (less memory, ~1/3 more compute)."""
    own_process: bool = False
    """Train in a child process of the learner's worker (trainer/process.py). For a one-process run (memory
    transport): there the stages' event loop and the learner's Python share one interpreter lock, so the
    process uses at most one core; a small model's training is mostly Python. Snapshots, checkpoints and
    metrics are as in process. Not with rollout.weight_transport = "broadcast" or grpo.world_size > 1."""
    train_type: Literal["full", "lora"] = "full"
    """full = train every weight; lora = a peft LoRA adapter on the frozen base (ms-swift's name). Under
    LoRA the reference model is the base (adapter disabled) and weight snapshots hold the adapter only."""
    lora_rank: PositiveInt = 8
    """LoRA rank r (train_type = "lora"; ms-swift's default 8)."""
    lora_alpha: PositiveInt = 32
    """LoRA scaling alpha (the update is scaled by alpha / r; ms-swift's default 32)."""
    lora_dropout: Fraction = 0.05
    """Dropout on the LoRA branch's input (ms-swift's default 0.05)."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: ["all-linear"])
    """Modules that get an adapter: ["all-linear"] (every linear layer but the output head) or names
    such as ["q_proj", "v_proj"]."""
    ref_model: str | None = None
    """Reference model directory for the KL term; None = a frozen copy of the initial policy."""
    freeze_vit: bool = True
    """Image-prompt models: keep the vision tower's weights fixed (ms-swift's default)."""
    freeze_aligner: bool = True
    """Image-prompt models: keep the merger (vision-to-language projector) fixed (ms-swift's default)."""


class EvalConfig(Section):
    """Evaluation while training (ms-swift / transformers names): the evaluate stage samples the held-out
    prompts with published weights and scores them with the training rewards; the learner never waits."""

    eval_strategy: Literal["no", "steps"] = DERIVED
    """"steps" = evaluate every eval_steps policy versions (and the final one); "no" = never. None = "steps"
    when there is held-out data (data.val_dataset or data.split_dataset_ratio > 0), else "no". A str after load."""
    eval_steps: PositiveInt = 1
    """Evaluate policy versions that are multiples of this (a version = one published generation batch)."""
    eval_on_start: bool = False
    """Also evaluate version 0, the initial weights (transformers' name): the curve's starting point."""
    per_device_eval_batch_size: PositiveInt = 8
    """Eval completions in flight per device; world_size * this must be divisible by eval_num_generations."""
    eval_num_generations: PositiveInt = DERIVED
    """Completions sampled per held-out prompt (pass@k is over these); None = grpo.num_generations. An int after load."""
    eval_temperature: NonNegativeFloat = DERIVED
    """Sampling temperature of evaluation; 0 = greedy; None = grpo.temperature. A float after load."""
    eval_limit: PositiveInt | None = None
    """Evaluate at most this many held-out prompts (the first ones, in the set's order); None = all."""
    share_rollout_engine: bool = False
    """In `rollstream train`: sample on the rollout engine at a lower vLLM priority instead of a second
    engine (less memory); a version whose weights change mid-evaluation is then skipped, which is every
    version when one evaluation outlasts a generation batch. A separate evaluate worker always has its own."""
    engine_nice: Annotated[int, Meta(ge=0, le=19)] = 19
    """CPU priority (Unix nice, 0-19) of evaluation's own engine process. 19: it runs on the CPU time that
    training leaves idle (the idle scheduling class as well, so a training thread that wakes takes the core
    at once), and on a busy machine evaluation falls behind and skips versions instead of slowing the
    learner; 0: it competes with training as an equal. (No effect on a shared engine or vLLM servers.)"""


class TransportConfig(Section):
    kind: Literal["memory", "redis"] = "memory"
    """memory = all stages in one process (the embedded default); redis = Redis Streams between processes."""
    url: str = "redis://127.0.0.1:6379/0"
    """redis://, rediss:// or unix:// URL, with user:password for AUTH/ACL; or Sentinel addresses,
    ``redis+sentinel://[user:password@]h1:26379,h2:26379/<master name>/<db>`` (``rediss+sentinel://`` for
    TLS): every connection asks the sentinels for the primary, so a failover is followed (docs/sentinel.md)."""
    max_deliveries: PositiveInt = 5
    """Deliveries of one record before it is dead-lettered with its error."""
    min_idle_ms: NonNegativeInt = 30000
    """Idle time after which a dead consumer's pending records are reclaimed (XAUTOCLAIM)."""
    block_ms: PositiveInt = 1000
    """Longest wait of one read for new records."""
    maxlen: PositiveInt = 10000
    """Approximate cap on each stream's length (acknowledged entries only are trimmed)."""
    batch_size: PositiveInt = 64
    """Records read per call by a worker."""
    blob_ttl_s: PositiveInt = 7 * 24 * 3600
    """Redis: how long a stored image (``rollstream:{run}:blob:<sha256>``, stored once per prompt group, the
    records carry the key) lives; renewed whenever a group stores it again. ``rollstream reset`` deletes them."""
    reconnect_s: NonNegativeFloat = 60.0
    """How long a worker keeps retrying a lost Redis connection (backoff 0.1 s doubling to 2 s) before it
    fails: a Redis restart within this window is survived."""
    min_replicas_acked: NonNegativeInt = 0
    """Replicas that must hold every produce, ack and dead-letter before it returns (Redis WAIT); 0 = off.
    Replication is asynchronous: with 0, a primary that dies before replicating loses writes it confirmed.
    With Sentinel set 1 and run two replicas, so one is left to acknowledge after a failover."""
    replica_wait_ms: PositiveInt = 1000
    """Longest wait of one WAIT for ``min_replicas_acked`` replicas; short of them it waits again, for up to
    ``reconnect_s`` in all, and then the call fails."""


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, dict=True):
    """The whole run. Build it with ``load_config``: that fills every derived value."""

    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    grpo: GrpoConfig = msgspec.field(default_factory=GrpoConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)


SECTIONS: dict[str, type[Section]] = {f.name: f.type for f in msgspec.structs.fields(Config)}


FIELDS: dict[str, dict[str, Any]] = {
    name: {f.name: f.type for f in msgspec.structs.fields(cls)} for name, cls in SECTIONS.items()
}


# Read-only values a user may try to set: why they cannot.
# Former names of fields, still accepted in a TOML file, a dict and --set (each maps to its field; the two
# given with different values are an error naming both). Rendered under the new name.
ALIASES = {
    "rollout.weight_sync_mode": "rollout.weight_transport",
    "rollout.weight_sync": "rollout.weight_load",
}

READ_ONLY = {
    "grpo.prompt_batch_size": "is derived (generation_batch_size // num_generations); "
    "set grpo.generation_batch_size",
    "grpo.drop_last": "is always true (as ms-swift GRPO, a partial generation batch is dropped); remove it",
}


# ms-swift's scale_rewards and kl_in_reward when unset, per advantage_estimator.
DEFAULT_SCALE_REWARDS = {"grpo": "group", "rloo": "none", "reinforce_plus_plus": "batch"}


DEFAULT_KL_IN_REWARD = {"grpo": False, "rloo": True, "reinforce_plus_plus": True}


DEFAULT_LEARNING_RATE = {"full": 1e-5, "lora": 1e-4}  # ms-swift's, per learner.train_type


FORMULAS = {
    "grpo.generation_batch_size": "per_device_train_batch_size * world_size * steps_per_generation",
    "grpo.steps_per_generation": "generation_batch_size // (per_device_train_batch_size * world_size)",
    "grpo.gradient_accumulation_steps": "1, or ceil(effective_batch_size / "
    "(per_device_train_batch_size * world_size))",
    "reward.reward_weights": "1.0 per reward",
    "grpo.scale_rewards": "group for grpo, none for rloo, batch for reinforce_plus_plus (as ms-swift)",
    "grpo.kl_in_reward": "false for grpo, true for rloo and reinforce_plus_plus (as ms-swift)",
    "grpo.prompt_batch_size": "generation_batch_size // num_generations",
    "grpo.drop_last": "always true, as ms-swift",
    "rollout.max_num_seqs": "per_device_train_batch_size * tensor_parallel_size * steps_per_generation",
    "rollout.weight_transport": "lora when learner.train_type = lora, else file",
    "eval.eval_strategy": "steps when there is held-out data (data.val_dataset or data.split_dataset_ratio), else no",
    "eval.eval_num_generations": "grpo.num_generations",
    "eval.eval_temperature": "grpo.temperature",
    "learner.learning_rate": "1e-5 for train_type full, 1e-4 for lora (as ms-swift)",
    "rollout.use_gym_env": "true when rollout.gym_env is set",
    "rollout.loss_scale": "last_round with use_gym_env (as ms-swift), else default",
    "rollout.multi_turn_scheduler": "gym_scheduler with use_gym_env; tool_calling with rollout.tools or "
                                    "rollout.environment_factory; agent with rollout.agent; verifiers with a "
                                    "verifiers:<env> dataset",
    "reward.reward_funcs": "with use_gym_env, env_reward appended unless named (as ms-swift appends its gym_reward "
    "column: the last reward_weights entry is the env's)",
}
# The fields declared "= DERIVED" (their default is None, as other optional fields' are, so they are named):
# never empty once loaded. A test checks this set against the annotations.
DERIVED_FIELDS = frozenset({
    "grpo.generation_batch_size", "grpo.steps_per_generation", "grpo.gradient_accumulation_steps",
    "grpo.scale_rewards", "grpo.kl_in_reward", "rollout.max_num_seqs", "rollout.weight_transport",
    "rollout.loss_scale", "rollout.use_gym_env", "reward.reward_weights", "learner.learning_rate",
    "eval.eval_strategy", "eval.eval_num_generations", "eval.eval_temperature",
})


def input_type(section: str, field: str) -> Any:
    """The type a given value must have: the field's own, or None too where loading derives it."""
    type_ = FIELDS[section][field]
    return type_ | None if f"{section}.{field}" in DERIVED_FIELDS else type_


def fits(value: Any, type_: Any) -> bool:
    try:
        msgspec.convert(value, type_)
    except msgspec.ValidationError:
        return False
    return True


def field_default(section: str, field: str) -> Any:
    for f in msgspec.structs.fields(SECTIONS[section]):
        if f.name == field:
            return f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    raise KeyError(f"{section}.{field}")


def did_you_mean(word: str, choices: Iterable[str], fmt: str = "{}") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {fmt.format(close[0])}?" if close else ""


_TYPE_NAMES = {"null": "none", "array": "list", "object": "table"}


def type_name(msgspec_name: str) -> str:
    """msgspec speaks JSON ("int | null", "array"); users wrote TOML and read Python."""
    return re.sub(r"\w+", lambda word: _TYPE_NAMES.get(word[0], word[0]), msgspec_name)


def literal_choices(type_: Any) -> list[str]:
    for arg in (type_, *get_args(type_)):
        if get_origin(arg) is Literal:
            return [str(a) for a in get_args(arg)]
    return []


def meta_of(type_: Any) -> Meta | None:
    """The Meta constraint inside ``Annotated[..., Meta(...)]``, also under ``| None``."""
    for arg in (type_, *get_args(type_)):
        if get_origin(arg) is Annotated:
            return next((m for m in arg.__metadata__ if isinstance(m, Meta)), None)
    return None


def range_text(key: str, meta: Meta) -> str:
    bounds = ((">=", meta.ge), (">", meta.gt), ("<=", meta.le), ("<", meta.lt))
    return " and ".join(f"{key} {op} {bound}" for op, bound in bounds if bound is not None)
