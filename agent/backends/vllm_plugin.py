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


def plugin_path(folder: str) -> str:
    """A folder to put on ``PYTHONPATH`` of the vLLM processes started from this checkout so that they load
    this plugin: ``""`` when the installed Sleuth declares the entry point already, else ``folder`` after
    writing into it a distribution that declares only the entry point (a checkout newer than its install)."""
    import importlib.metadata
    from pathlib import Path

    value = f"{__name__}:register"
    if any(ep.value == value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")):
        return ""
    info = Path(folder) / "sleuth_vllm_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sleuth-vllm-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nsleuth_gloo_weight_transfer = {value}\n")
    return str(folder)
