"""The step recorder the graph-safety tests use: `spml_cache.runtime.step_trace`, where `spml-cache check-loss`
holds anyone's loss to the same rule (see that module for what it records and why)."""

from spml_cache.runtime.step_trace import (  # noqa: F401  (the tests' names for it)
    CPU_ONLY_HOST_READS,
    FORBIDDEN_METHODS,
    FORBIDDEN_OPS,
    SYNCING_OVERLOADS,
    HostReads,
    KernelHostReads,
    StepRecorder,
    first_difference,
    flat,
    record,
    where_in_the_package,
)
