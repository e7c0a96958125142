"""Reward functions, registered by name as in ms-swift (``swift.plugin.orm.orms``).

A reward is ms-swift's ORM protocol: a callable ``(completions: list[str], **kwargs) -> list[float | None]``,
sync or async, a function or a class with ``__call__``, called with every dataset column as a list kwarg
(``solution=[...]``) plus ``messages``, ``is_truncated``, ``trajectory_inputs``, ``rollout_infos``,
``multi_turn_infos``, ``prompt_id``, ``request_id`` and ``completion_ids`` (see ``stages/reward.py``).
``None`` means "not applicable to this sample".

Register a class or any callable. A class is instantiated once per worker as ms-swift builds it: each
``__init__`` parameter named like an ms-swift GRPO argument (``soft_max_length``, ``cosine_max_len``,
``max_completion_length``, ...) gets its value from the run's config, ``args`` gets all of them
(``SwiftArgs``, ms-swift 4 style), ``tokenizer`` the run's tokenizer, ``config`` the run's ``Config``.
Async rewards subclass ``AsyncORM``. A plugin file listed in ``run.external_plugins`` does::

    from rewards import ORM, orms

    class Brevity(ORM):
        def __call__(self, completions, **kwargs):
            return [1.0 if len(c) < 20 else 0.0 for c in completions]

    orms["brevity"] = Brevity

An installed package can register instead through the entry-point group ``rollstream.rewards``
(``[project.entry-points."rollstream.rewards"] brevity = "mypkg.rewards:Brevity"``); a name in ``orms``
wins over an entry point of the same name.
"""

from rewards import builtin as _builtin  # noqa: F401 - fills ``orms`` with the built-in rewards
from rewards import code as _code  # noqa: F401 - code_execution
from rewards.registry import (  # noqa: F401 - the public names, importable as ``from rewards import ...``
    ENTRY_POINT_GROUP,
    ORM,
    AsyncORM,
    RewardBuildError,
    RewardFunc,
    SwiftArgs,
    UnknownRewardError,
    build_reward,
    get_reward,
    orms,
    registered_names,
    swift_args,
    takes_config,
)
