"""rollstream's framework: records, transports, the worker runtime, config, metrics, logging, plugins, CLI.
Nothing GRPO-specific lives here except the config semantics."""
