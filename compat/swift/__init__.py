"""rollstream's stand-in for ms-swift's plugin API, so an ms-swift plugin file loads with no edit.

Not a real ms-swift: ``pipeline.plugins.load_plugins`` puts the directory holding this package at the END of
``sys.path`` only when no other ``swift`` package is importable, so an installed ms-swift always wins. Every
name here is rollstream's own object (``orms`` IS ``rewards.orms``, ``multi_turns`` IS
``schedulers.multi_turns``), re-exported under ms-swift's module paths (v3: ``swift.plugin``, ``swift.llm``;
v4: ``swift.rewards``, ``swift.rollout``, ``swift.infer_engine``, ``swift.template``; both: ``swift.utils``).
"""

ROLLSTREAM_SHIM = True  # tells rollstream (and a curious user) this is not ms-swift
