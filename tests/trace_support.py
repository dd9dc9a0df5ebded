"""The step recorder the graph-safety tests use: `spml_cache.runtime.step_trace`, where `spml-cache check-loss`
holds anyone's loss to the same rule (see that module for what it records and why)."""

from spml_cache.runtime.step_trace import first_difference, record

__all__ = ["first_difference", "record"]
