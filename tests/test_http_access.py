"""Who may call which route, over a real socket (CONTRACT §2): the API key and admin routes."""
import logging

import pytest

from server.access import AccessPolicy, admin_routes_open, is_loopback
from server.app import ServerConfig
from tests.server_harness import OK, assert_error, call, metrics_lines, serving

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed_port(engines):
    with serving(engines["llama"], ServerConfig(access=AccessPolicy(api_key=KEY))) as port:
        yield port


def bearer(token: str, scheme: str = "Bearer") -> dict:
    return {"Authorization": f"{scheme} {token}"}


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_right_key_scores_in_any_case_of_the_scheme(keyed_port, scheme):
    status, payload, _ = call(keyed_port, "POST", "/v1/score", OK, bearer(KEY, scheme))
    assert status == 200 and len(payload["scores"]) == 2


@pytest.mark.parametrize("headers", [
    {}, bearer(KEY[:-1]), bearer(KEY + "x"), bearer(KEY.upper()), bearer(KEY, "Basic"),
    {"Authorization": KEY}, {"Authorization": "Bearer"}, {"X-API-Key": KEY}])
def test_a_missing_or_wrong_key_is_a_401_with_a_challenge(keyed_port, headers):
    status, payload, response_headers = call(keyed_port, "POST", "/v1/score", OK, headers)
    assert_error(status, payload, 401, "API key")
    assert payload["type"] == "AuthenticationError"
    assert response_headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("GET", "/get_model_info"), ("GET", "/metrics"),
    ("POST", "/flush_cache"), ("POST", "/start_profile"), ("POST", "/v1/rerank"),
    ("GET", "/no/such/route")])
def test_every_route_but_health_needs_the_key(keyed_port, method, path):
    assert_error(*call(keyed_port, method, path)[:2], 401)


def test_health_answers_without_a_key(keyed_port):
    assert call(keyed_port, "GET", "/health")[:2] == (200, {"status": "ok"})
    assert call(keyed_port, "GET", "/v1/models", headers=bearer(KEY))[0] == 200
    assert call(keyed_port, "GET", "/no/such/route", headers=bearer(KEY))[0] == 404


def test_the_key_is_never_logged(engines, caplog, access_log):
    """Neither in the access log (written to absl's stream) nor in any other log line."""
    config = ServerConfig(access=AccessPolicy(api_key=KEY))
    with caplog.at_level(logging.INFO), serving(engines["llama"], config) as port:
        for token in (KEY, KEY + "x"):
            call(port, "POST", "/v1/score", OK, bearer(token))
    access_lines = [line for line in access_log.getvalue().splitlines() if "/v1/score" in line]
    assert [line.split()[-3] for line in access_lines] == ["200", "401"]
    assert KEY not in access_log.getvalue() and KEY not in caplog.text
    assert KEY not in repr(config)


def test_metrics_without_key_opens_metrics_only(engines):
    access = AccessPolicy(api_key=KEY, metrics_without_key=True)
    with serving(engines["llama"], ServerConfig(access=access)) as port:
        assert metrics_lines(port)  # a 200 in Prometheus text, without the key
        assert_error(*call(port, "GET", "/get_model_info")[:2], 401)


def test_admin_routes_off_answer_403_and_the_rest_serves(engines):
    with serving(engines["llama"], ServerConfig(access=AccessPolicy(admin_routes=False))) as port:
        for path in ("/flush_cache", "/start_profile", "/stop_profile"):
            assert_error(*call(port, "POST", path)[:2], 403, "--admin-routes on")
        assert call(port, "POST", "/v1/score", OK)[0] == 200


def test_admin_routes_are_off_by_default_only_when_exposed_without_a_key():
    assert admin_routes_open("auto", "127.0.0.1", None)
    assert admin_routes_open("auto", "::1", None) and admin_routes_open("auto", "localhost", None)
    assert not admin_routes_open("auto", "0.0.0.0", None)
    assert not admin_routes_open("auto", "myhost.example", None)
    assert admin_routes_open("auto", "0.0.0.0", KEY)
    assert not admin_routes_open("off", "127.0.0.1", KEY)
    assert admin_routes_open("on", "0.0.0.0", None)
    assert is_loopback("127.0.0.2") and not is_loopback("")


def test_the_start_up_line_says_which_routes_are_open():
    routes = ["/v1/score", "/health", "/metrics", "/flush_cache", "/start_profile",
              "/stop_profile"]
    line = AccessPolicy(api_key=KEY, metrics_without_key=True).describe(routes)
    assert line == ("routes open: /health /metrics; with the API key: /v1/score /flush_cache "
                    "/start_profile /stop_profile")
    line = AccessPolicy(admin_routes=False).describe(routes)
    assert line == ("routes open: /v1/score /health /metrics; off: /flush_cache "
                    "/start_profile /stop_profile (--admin-routes on opens them)")


@pytest.mark.parametrize("key", ["", "two words", "caf\u00e9", "tab\there"])
def test_an_unusable_key_is_refused(key):
    with pytest.raises(ValueError, match="API key"):
        AccessPolicy(api_key=key)
