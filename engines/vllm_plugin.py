"""rollstream's vLLM general plugin (entry point group ``vllm.general_plugins``): vLLM loads it in every
process it starts (the API server, the engine core, each worker), so a ``vllm serve`` started with
``--weight-transfer-config '{"backend": "rollstream"}'`` knows rollstream's weight-transfer backend
(``weights.transfer``) wherever it creates the engine. It needs rollstream installed in the server's
environment (``pip install rollstream``); nothing else, no ``--worker-extension-cls``.

vLLM may call it several times in one process, so it registers at most once (``register`` checks).
"""

from __future__ import annotations


def register() -> None:
    """Register rollstream's weight-transfer backend with vLLM's factory in this process."""
    from weights import transfer

    transfer.register()
