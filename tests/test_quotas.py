"""Callers' quotas and priorities (streamrec/serving/access/quotas.py), on a simulated clock."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from streamrec.plumbing.config import CallerEntry, load_config
from streamrec.serving.errors import ApiError
from streamrec.serving.access.quotas import ANONYMOUS, OUTCOMES, Callers, OverQuota

CALLERS = [CallerEntry("batch", "k-batch", rate_per_s=10, burst=5, priority="low"),
           CallerEntry("web", "k-web", rate_per_s=0, priority="normal"),
           CallerEntry("checkout", "k-checkout", rate_per_s=0, priority="high")]


def _callers(anonymous_rate: float = 0.0, registry: CollectorRegistry | None = None) -> Callers:
    return Callers(CALLERS, "x-api-key", "x-priority", anonymous_rate, 0.5, registry=registry or CollectorRegistry())


def _h(key: str | None = None, priority: str | None = None) -> list[tuple[bytes, bytes]]:
    headers = [(b"host", b"node"), (b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"x-api-key", key.encode()))
    if priority is not None:
        headers.append((b"x-priority", priority.encode()))
    return headers


def _run(callers: Callers, headers, seconds: float, offered_per_s: float) -> int:
    """Offer requests evenly for ``seconds`` of simulated time; the number admitted."""
    admitted, n = 0, int(seconds * offered_per_s)
    for i in range(n):
        try:
            callers.admit(headers, 0.0, now=1000.0 + i / offered_per_s)
            admitted += 1
        except OverQuota:
            pass
    return admitted


def test_a_caller_over_its_rate_is_held_to_rate_times_time_plus_burst_and_others_are_not():
    callers = _callers()
    admitted = _run(callers, _h("k-batch"), seconds=60, offered_per_s=200)
    assert abs(admitted - (10 * 60 + 5)) <= 0.05 * (10 * 60 + 5)
    assert _run(callers, _h("k-web"), seconds=60, offered_per_s=200) == 60 * 200
    counts = callers.counts()
    assert counts["batch"] == {"admitted": admitted, "over_quota": 60 * 200 - admitted, "shed": 0, "refused": 0}
    assert counts["web"]["admitted"] == 60 * 200 and counts[ANONYMOUS] == dict.fromkeys(OUTCOMES, 0)


def test_over_quota_answer_names_the_caller_and_rate_and_when_to_retry():
    callers = Callers([CallerEntry("slow", "secret-key", rate_per_s=0.25, burst=1)], "x-api-key", "x-priority", 0, 0.5,
                      registry=CollectorRegistry())
    assert callers.admit(_h("secret-key"), 0.0, now=0.0).caller == "slow"
    with pytest.raises(OverQuota) as err:
        callers.admit(_h("secret-key"), 0.0, now=1.0)
    assert err.value.status == 429 and "caller 'slow' is over its quota of 0.25 requests/s" in err.value.message
    assert "secret-key" not in err.value.message
    assert (b"retry-after", b"3") in err.value.headers()
    assert callers.admit(_h("secret-key"), 0.0, now=4.0).caller == "slow"


def test_burst_zero_is_one_seconds_worth_and_at_least_one_request():
    callers = Callers([CallerEntry("a", "ka", rate_per_s=3), CallerEntry("b", "kb", rate_per_s=0.5)], "x-api-key", "x-priority",
                      0, 0.5, registry=CollectorRegistry())
    assert sum(1 for _ in range(10) if _admitted(callers, _h("ka"), 0.0)) == 3
    assert sum(1 for _ in range(10) if _admitted(callers, _h("kb"), 0.0)) == 1


def _admitted(callers: Callers, headers, now: float, fill: float = 0.0) -> bool:
    try:
        callers.admit(headers, fill, now=now)
        return True
    except ApiError:
        return False


def test_priorities_are_shed_in_order_as_the_queue_fills():
    callers = _callers()
    by_fill = {}
    for fill in (0.0, 0.49, 0.5, 0.74, 0.75, 0.99, 1.0):
        by_fill[fill] = [p for key, p in (("k-batch", "low"), ("k-web", "normal"), ("k-checkout", "high"))
                         if _admitted(callers, _h(key), now=1000.0 + fill * 100, fill=fill)]
    assert by_fill == {0.0: ["low", "normal", "high"], 0.49: ["low", "normal", "high"], 0.5: ["normal", "high"],
                       0.74: ["normal", "high"], 0.75: ["high"], 0.99: ["high"], 1.0: ["high"]}
    with pytest.raises(ApiError) as err:
        callers.admit(_h("k-web"), 0.8, now=2000.0)
    assert err.value.status == 429 and "normal-priority requests are shed past 75%" in err.value.message
    assert (b"retry-after", b"1") in err.value.headers()
    assert callers.counts()["batch"]["shed"] == 5 and callers.counts()["web"]["shed"] == 4


def test_a_shed_request_takes_no_token():
    callers = _callers()
    for _ in range(100):
        assert not _admitted(callers, _h("k-batch"), now=0.0, fill=0.9)
    assert sum(_admitted(callers, _h("k-batch"), now=0.0) for _ in range(10)) == 5


def test_the_priority_header_may_lower_a_callers_priority_but_never_raise_it():
    callers = _callers()
    assert callers.admit(_h("k-checkout", "low"), 0.0, now=0.0).priority == "low"
    assert callers.admit(_h("k-checkout", " Normal "), 0.0, now=0.0).priority == "normal"
    assert callers.admit(_h("k-batch", "high"), 0.0, now=0.0).priority == "low"
    assert callers.admit(_h("k-web", "high"), 0.0, now=0.0).priority == "normal"
    assert not _admitted(callers, _h("k-checkout", "low"), now=0.0, fill=0.6)
    assert _admitted(callers, _h("k-checkout"), now=0.0, fill=0.6)


def test_with_callers_an_unknown_key_is_refused_and_no_key_is_refused_or_bounded_at_low_priority():
    """A low-priority caller over its quota must gain nothing by hiding its key (issue 55)."""
    for rate in (0, 2):
        with pytest.raises(ApiError) as err:
            _callers(anonymous_rate=rate).admit(_h("k-batc"), 0.0, now=0.0)
        assert err.value.status == 401 and "unknown API key in header x-api-key" in err.value.message
        assert "k-batc" not in err.value.message
    refusing = _callers(anonymous_rate=0)
    with pytest.raises(ApiError, match="no API key: send your caller's key in header x-api-key") as err:
        refusing.admit(_h(), 0.0, now=0.0)
    assert err.value.status == 401 and refusing.counts()[ANONYMOUS]["refused"] == 1
    bounded = _callers(anonymous_rate=2)
    assert bounded.admit(_h(), 0.0, now=0.0).caller == ANONYMOUS  # a burst of one second's worth, then 2/s
    assert bounded.admit(_h(), 0.0, now=0.0) == bounded.admit(_h(), 0.0, now=0.5) == bounded.admit(_h(), 0.0, now=1.0)
    with pytest.raises(OverQuota, match="caller 'anonymous' is over its quota of 2 requests/s"):
        bounded.admit(_h(), 0.0, now=1.0)
    assert bounded.admit(_h(), 0.0, now=1.5).priority == "low"
    assert not _admitted(bounded, _h(), now=5.0, fill=0.5)  # shed with the low-priority callers


def test_without_callers_every_request_is_anonymous_at_normal_priority():
    open_node = Callers([], "x-api-key", "x-priority", 0, 0.5, registry=CollectorRegistry())
    assert all(_admitted(open_node, _h("any", None), now=0.0) for _ in range(1000))
    limited = Callers([], "x-api-key", "x-priority", 2, 0.5, registry=CollectorRegistry())
    assert limited.admit(_h("any"), 0.0, now=0.0) == limited.admit(_h(), 0.0, now=0.0)
    assert limited.admit(_h(), 0.0, now=1.0).priority == "normal"


def test_bad_or_repeated_headers_are_400():
    callers = _callers()
    for headers, message in ((_h("k-web", "urgent"), "header x-priority: 'urgent' is not one of low, normal, high"),
                             (_h("k-web") + [(b"x-api-key", b"k-batch")], "more than one x-api-key header: send exactly one"),
                             (_h("k-web", "low") + [(b"x-priority", b"low")], "more than one x-priority header: send exactly one")):
        with pytest.raises(ApiError) as err:
            callers.admit(headers, 0.0, now=0.0)
        assert (err.value.status, err.value.message) == (400, message)
    assert callers.counts()["web"] == dict.fromkeys(OUTCOMES, 0)


def test_metrics_by_caller_and_outcome_never_show_a_key():
    registry = CollectorRegistry()
    callers = _callers(registry=registry)
    admitted = _run(callers, _h("k-batch"), seconds=1, offered_per_s=20)
    _admitted(callers, _h("k-web"), now=0.0, fill=0.9)
    value = registry.get_sample_value
    assert 0 < admitted < 20
    assert value("streamrec_serving_caller_requests_total", {"caller": "batch", "outcome": "admitted"}) == admitted
    assert value("streamrec_serving_caller_requests_total", {"caller": "batch", "outcome": "over_quota"}) == 20 - admitted
    assert value("streamrec_serving_caller_requests_total", {"caller": "web", "outcome": "shed"}) == 1
    assert value("streamrec_serving_caller_requests_total", {"caller": ANONYMOUS, "outcome": "admitted"}) == 0
    assert b"k-batch" not in generate_latest(registry)


def test_from_config_and_a_caller_named_anonymous(tmp_path):
    path = tmp_path / "streamrec.toml"
    path.write_text('[serving]\ncaller_header = "X-Key"\n\n[[serving.callers]]\nname = "web"\nkey = "k"\nrate_per_s = 1.0\n')
    config = load_config(path, environ={})
    callers = Callers.from_config(config.serving, CollectorRegistry())
    assert callers.admit([(b"x-key", b"k")], 0.0, now=0.0).caller == "web"
    with pytest.raises(ValueError, match="'anonymous' is the name of requests without a known key"):
        Callers([CallerEntry(ANONYMOUS, "k", 1.0)], "x-api-key", "x-priority", 0, 0.5, registry=CollectorRegistry())
