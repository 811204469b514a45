"""Sleuth's vLLM plugin: the ``vllm.general_plugins`` entry point (``pyproject.toml``) that vLLM calls in
each of its processes. It registers the ``gloo`` weight-transfer backend (:mod:`agent.backends.vllm_gloo`)
by module path, so nothing is imported until an engine is started with
``--weight-transfer-config '{"backend": "gloo"}'``. Safe to call more than once (vLLM may)."""

from __future__ import annotations

#: the backend name this plugin registers
BACKEND = "gloo"


def register() -> None:
    """Register the gloo weight-transfer engine with vLLM's ``WeightTransferEngineFactory`` (once; a backend
    of that name already registered is left as it is). Needs vLLM."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "agent.backends.vllm_gloo", "GlooWeightTransferEngine")
    except ValueError:  # registered already (the plugin loaded twice in this process)
        pass
