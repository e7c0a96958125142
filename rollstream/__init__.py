"""The application on top of the stages: the ``rollstream`` CLI, ``train`` wiring, ``top``, ``inspect``,
``plot`` and offline evaluation."""
