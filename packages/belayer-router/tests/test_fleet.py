"""Several router processes: requests spread by hash, one router SIGKILLed mid-stream and replaced."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import anyio
import anyio.abc
import pytest
from router_helpers import ADMIN_TOKEN, StartRouter

from belayer_router import InvalidRequestError, RouterFleet, TokenEvent, owner_index
from belayer_router.testing import expected_tokens, running_worker, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers


def test_the_owner_is_a_deterministic_spread_hash() -> None:
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    owners = [owner_index(urls, f"req-{i}") for i in range(3000)]
    assert owners == [owner_index(list(urls), f"req-{i}") for i in range(3000)]
    counts = Counter(owners)
    assert all(800 <= counts[i] <= 1200 for i in range(3)), counts
    # A fourth router takes over only keys it wins; every other key keeps its owner.
    grown = [owner_index([*urls, "http://10.0.0.4:8000"], f"req-{i}") for i in range(3000)]
    assert all(new in (old, 3) for old, new in zip(owners, grown, strict=True))
    with pytest.raises(InvalidRequestError):
        owner_index([], "req-0")
    with pytest.raises(InvalidRequestError):
        RouterFleet([urls[0], urls[0]])


async def test_a_router_killed_mid_stream_is_replaced_on_its_journal(
    tmp_path: Path, router_process: StartRouter
) -> None:
    routers: list[anyio.abc.Process] = []
    urls = []
    for i in range(3):
        process, url = await router_process(tmp_path / f"router{i}.jsonl")
        routers.append(process)
        urls.append(url)
    # Four requests owned by each router (the ports are random: twelve fixed ids left one router
    # without a request about once in forty runs).
    ids: list[str] = []
    owned: Counter[int] = Counter()
    for i in range(1000):
        owner = owner_index(urls, f"fleet-{i}")
        if owned[owner] < 4:
            owned[owner] += 1
            ids.append(f"fleet-{i}")
    owners = [owner_index(urls, request_id) for request_id in ids]
    assert len(ids) == 12
    assert set(owners) == {0, 1, 2}  # spread over all three routers
    victim = owners[0]
    async with (
        running_worker(1, token_delay_s=0.02, frame_tokens=3) as (url_a, _a),
        running_worker(1, token_delay_s=0.02) as (url_b, _b),
        RouterFleet(urls, admin_token=ADMIN_TOKEN, reconnect_timeout_s=90) as fleet,
    ):
        await fleet.register("a", url_a, 1)
        await fleet.register("b", url_b, 1)
        received: dict[str, list[int]] = {request_id: [] for request_id in ids}
        indices: dict[str, list[int]] = {request_id: [] for request_id in ids}
        resumes: dict[str, int] = {}

        async def one(n: int, request_id: str) -> None:
            async for event in fleet.generate_stream([5, n], 200, seed=100 + n, request_id=request_id):
                if isinstance(event, TokenEvent):
                    received[request_id].append(event.token_id)
                    indices[request_id].append(event.index)
                else:
                    resumes[request_id] = event.num_resumes

        victims = [r for r, o in zip(ids, owners, strict=True) if o == victim]
        async with anyio.create_task_group() as group:
            for n, request_id in enumerate(ids):
                group.start_soon(one, n, request_id)
            await wait_until(lambda: all(len(received[r]) >= 10 for r in victims), limit_s=120)
            assert all(len(received[r]) < 200 for r in victims)  # still mid-stream
            routers[victim].kill()  # SIGKILL: no chance to write anything more
            await routers[victim].wait()
            port = int(urls[victim].rsplit(":", 1)[1])
            routers[victim], _ = await router_process(tmp_path / f"router{victim}.jsonl", port)
    for n, request_id in enumerate(ids):
        assert received[request_id] == expected_tokens(100 + n, 200), request_id
        assert indices[request_id] == list(range(200))
    assert all(resumes[r] >= 1 for r in victims)  # picked up again by the replacement
    others = [r for r in ids if r not in victims]
    assert all(resumes[r] == 0 for r in others)  # the other routers were not disturbed
    for i, process in enumerate(routers):
        ops = [json.loads(line) for line in (tmp_path / f"router{i}.jsonl").read_text().splitlines()]
        finished = {op["request_id"] for op in ops if op["op"] == "finish"}
        assert finished == {r for r, o in zip(ids, owners, strict=True) if o == i}
        assert process.returncode is None
