"""What an engine with the plugin is, from its configuration alone, with neither vLLM nor torch:
its knobs and their defaults (:mod:`.settings`) and the sizes that follow from a step
configuration (:mod:`.sizing`: vLLM's decode threshold, the reservation, the smallest budget).
The vLLM backend sizes an engine with them at start-up; ``mla-planner doctor`` predicts the same
with the same functions."""


def minor_of(version: str) -> str:
    """``major.minor`` of a version string (``1.2`` of ``1.2.3rc1``): the key of a release's modules, both the
    backend's (``vllm_backend.releases``) and the doctor's (``cli.vllm_releases``)."""
    return ".".join(version.split(".")[:2])
