"""Engines and data below the stages: the vLLM engines, the group sampler shared by rollout and evaluation,
dataset loading and the tiny models the project builds. Imports the framework, rewards and schedulers;
never a stage."""
