"""``swift.plugin.context_manager`` (ms-swift 3): ``ContextManager`` and the ``context_managers`` registry."""

from schedulers import ContextManager, DummyContextManager, context_managers  # noqa: F401
