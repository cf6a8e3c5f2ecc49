"""A launched step, from Executor.execute() to finish(): what every step carries. A feature
with work left at finish (KV copies to report, drafts to propose) adds a finish hook rather
than a field of its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.sample.host_rows import SampledRows, VerifiedRows
from shoal.worker.step_forward import ForwardOutput, StageOutput
from shoal.worker.step_inputs import StepInputs

# hook(the step's results, whether no later step has been launched yet)
FinishHook = Callable[[ModelRunnerOutput, bool], None]


@dataclass
class StepHandle:
    out: ModelRunnerOutput
    inputs: StepInputs | None = None  # None: a step of KV copies only
    forward: ForwardOutput | StageOutput | None = None
    sampled: SampledRows | VerifiedRows | None = None  # on their way to the host
    hooks: list[FinishHook] = field(default_factory=list)
