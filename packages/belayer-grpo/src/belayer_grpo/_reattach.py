"""What the adopted router of a killed trainer still holds of a resumed step (`belayer_grpo._rollout_host`).

A step's requests go to the router under ids a resumed run derives again: math sample ``i`` of
step ``N`` as ``<tag>-stepN-i``, agentic turn ``T`` of a trajectory as ``<trajectory_id>-t<T>``
(with ``system.resume_grace_s > 0``).  Sent again under the same id, a request the router holds
(finished, or cut when the trainer died) is answered from its tokens and continued, not generated
again; these functions count them for the report (``GET /requests/{id}``).
"""

from __future__ import annotations

from collections.abc import Sequence

from belayer_router import RouterClient, RouterClientError

__all__ = ["held_requests", "held_turns"]


async def held_requests(router: RouterClient, request_ids: Sequence[str]) -> tuple[int, int]:
    """How many of ``request_ids`` the router holds, and their tokens so far."""
    held = tokens = 0
    for request_id in request_ids:
        try:
            record = await router.request_record(request_id)
        except RouterClientError as error:
            if error.status != 404:
                raise
            continue
        held += 1
        tokens += len(record["token_ids"])
    return held, tokens


async def held_turns(
    router: RouterClient, trajectory_ids: Sequence[str], max_turns: int
) -> tuple[list[str], int, int]:
    """Of agentic trajectories (turns from 1): those the router holds a turn of, the number of
    turns it holds and their tokens."""
    begun: list[str] = []
    held = tokens = 0
    for trajectory_id in trajectory_ids:
        turns = 0
        while turns < max_turns:
            found, count = await held_requests(router, [f"{trajectory_id}-t{turns + 1}"])
            if not found:
                break
            turns, tokens = turns + 1, tokens + count
        held += turns
        if turns:
            begun.append(trajectory_id)
    return begun, held, tokens
