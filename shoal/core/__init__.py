"""What the scheduler, the KV manager, the runners and the frontends hand each other: the
engine core's view of a request, the per-step hand-off (SchedulerOutput / ModelRunnerOutput)
and the messages between the frontend and the engine core. Plain data, no torch, importing
nothing above it."""
