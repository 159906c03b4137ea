"""The worker half of belayer-shadow (private): main worker, shadow worker, handover, slot supervisor.

`_worker` and `_shadow` are the two worker processes (both serve an `_service.EngineService`);
`_heartbeat` and `_events` are what they share with the supervisor on disk; `_slot` supervises
one slot's children (`_children`, `_processes`) and recovers it, by handover or by the restart
baselines (`_baseline`). Uses the engine half only through what it exports.
The public API is re-exported from `belayer_shadow`.
"""
