"""What an engine with the plugin is, from its configuration alone, with neither vLLM nor torch:
its knobs and their defaults (:mod:`.settings`) and the sizes that follow from a step
configuration (:mod:`.sizing`: vLLM's decode threshold, the reservation, the smallest budget).
The vLLM backend sizes an engine with them at start-up; ``mla-planner doctor`` predicts the same
with the same functions."""
