"""``swift.rewards.rm_plugin`` (ms-swift 4): reward-model plugins import here; using one is a clear error
(rollstream's reward models: ``reward.reward_model``)."""

from swift._shim import DefaultRMPlugin, GenRMPlugin, rm_plugins  # noqa: F401
