from rollstream_add.taskset import RollstreamAddTaskset

__all__ = ["RollstreamAddTaskset"]
