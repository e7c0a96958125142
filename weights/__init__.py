"""Weight sync: how a new policy version travels from the learner to the engines.

``membership`` (the weights group's control plane, records only), ``transfer`` (the broadcast's wire format
and vLLM's weight-transfer backend: imported inside vLLM's engine-core process, so it imports nothing of the
stages), ``sender`` (the learner's end of a broadcast), ``snapshots`` (versioned snapshot files).

This package's ``__init__`` imports nothing: vLLM's worker process imports ``weights.transfer`` and must
not pull the rest in.
"""
