"""``swift.plugin.orm`` (ms-swift 3): reward base classes, the ``orms`` registry, the built-in rewards."""

from rewards import ORM, AsyncORM, orms  # noqa: F401
from rewards.builtin import (  # noqa: F401
    CosineReward,
    Format,
    MathAccuracy,
    MathORM,
    ReActFormat,
    RepetitionPenalty,
    SoftOverlong,
)
from swift._shim import ReactORM  # noqa: F401
