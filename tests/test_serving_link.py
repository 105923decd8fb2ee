"""The front-end <-> serving process link (serving/runtime/ipc.py, serving/http/frontend.py
``ServingProcessClient``) over a real Unix socket: the requests of one event-loop turn travel in
one frame, the answers of one batch in one frame, and every answer reaches its own request; a
request the serving process refuses at once gets its error. The serving process's side here
answers from the request itself (the link is what is under test; test_serving_frontends runs
the real serving process)."""

import asyncio

import numpy as np
import orjson
import pytest

from streamrec.contracts.events import MAX_FUTURE_SKEW_MS
from streamrec.contracts.feature_spec import FeatureSpec
from streamrec.serving.http import frontend
from streamrec.serving.runtime import ipc
from streamrec.serving.by_ids import ByIdsQuery
from streamrec.serving.errors import ApiError
from streamrec.serving.http.frontend import ServingProcessClient
from streamrec.serving.runtime.ipc import FrontendLink, Outbox
from streamrec.serving.runtime.messages import PROTOCOL, Scored, Welcome


def body(user_id: int, candidates: int) -> bytes:
    return orjson.dumps({"user_id": user_id, "context": {"device": "ios", "local_hour": 9},
                         "candidates": [{"item_id": 10 + k, "category_id": 3, "advertiser_id": 4, "position": k} for k in range(candidates)]})


def test_requests_and_answers_travel_in_groups_and_reach_their_callers(tmp_path, monkeypatch):
    frames: list[int] = []  # requests per frame the serving process read
    read_frame = ipc.read_frame

    async def counting_read_frame(reader, decoder):
        message = await read_frame(reader, decoder)
        frames.append(len(getattr(message, "items", [])))
        return message
    monkeypatch.setattr(ipc, "read_frame", counting_read_frame)
    answer_frames: list[int] = []  # answers per frame the front-end read

    async def counting_answers(reader, decoder):
        message = await read_frame(reader, decoder)
        answer_frames.append(len(getattr(message, "items", [])))
        return message
    monkeypatch.setattr(frontend, "read_frame", counting_answers)
    queued: list[tuple[ByIdsQuery, int, Outbox]] = []

    def take(message, outbox):
        payload = ipc.payload_of(message)
        assert message.model == "ctr"
        if payload.user_id == 666:
            raise ApiError(429, "overloaded: refused at once")
        queued.append((payload, message.id, outbox))
        if len(queued) == 19:  # the "batch": every answer in the same turn of the loop
            for query, rid, box in queued:
                scores = np.full(len(query), query.user_id / 1000 + query.candidates[:, 0].sum() / 1e6, np.float32)
                box.put(Scored(rid, 7, scores.tobytes(), by_ids=True, features_as_of=123))
            queued.clear()

    async def scenario():
        path = str(tmp_path / "serving.sock")
        link = FrontendLink(path, lambda: Welcome(PROTOCOL, {"ctr": FeatureSpec().to_json()}, MAX_FUTURE_SKEW_MS, True), take)
        await link.start()
        client = ServingProcessClient(path, max_instances=1000)
        await client.connect(timeout_s=10)
        asks = [(100 + i, 1 + i % 5) for i in range(19)]
        answers = await asyncio.gather(*(client.predict_body("models", "ctr", body(u, n)) for u, n in asks),
                                       client.predict_body("models", "ctr", body(666, 2)), return_exceptions=True)
        await link.stop()
        return asks, answers

    asks, answers = asyncio.run(scenario())
    assert frames[0] == 0  # the Hello
    assert frames[1:] == [20]  # 20 requests made in one turn: one frame
    assert answer_frames == [0, 20]  # the Welcome; the refusal and the batch's answers, made in one turn
    for (user, n), answer in zip(asks, answers[:19]):
        got = orjson.loads(answer)
        want = user / 1000 + sum(10 + k for k in range(n)) / 1e6
        assert got["model_version"] == 7 and got["features_as_of"] == 123
        assert got["scores"] == pytest.approx([want] * n, rel=1e-6)
    assert isinstance(answers[19], ApiError) and answers[19].status == 429 and "refused at once" in answers[19].message
