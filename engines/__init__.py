"""The engines below the stages: vLLM in process and behind servers, the vLLM worker extension, the group
sampler shared by rollout and evaluation, and model resolution (a Hub id, a directory or a tiny model).
Imports the framework, the config, data and the tiny models; never a stage."""
