"""The engine core: the process that schedules and steps.

    core        EngineCore: one step = schedule() -> execute_model() -> update_from_output()
    core_proc   the busy loop in its own process (or a thread)
    shared_core the same loop for one core that N API servers share (--api-server-count)
    xray        what the core records for GET /xray and the snapshot it builds

Kept light on purpose: it imports nothing of the core itself, so importing the package
costs nothing and closes no cycle.
"""
