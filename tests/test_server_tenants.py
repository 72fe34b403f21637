"""API keys, tenants and cache salts: over HTTP, a tenant never hits another tenant's cache."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server_common import TINY_ARGS, ServerThread, error_of, write_keys

from kvserve.server.auth import ANONYMOUS_TENANT, DEFAULT_TENANT, ApiKeys, cache_salt

PROMPT = "the tenants share this long system prompt word for word, " * 5
GREEDY = dict(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    keys = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt")
    with ServerThread(tiny_model_dir, "--api-keys", str(keys), *TINY_ARGS) as s:
        yield s


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def cached(server, key: str, prompt: str, salt: str | None = None) -> int:
    extra = {"cache_salt": salt} if salt else None
    r = client(server, key).completions.create(model=None, prompt=prompt, extra_body=extra, **GREEDY)
    return r.usage.prompt_tokens_details.cached_tokens


def test_other_tenant_never_hits_the_cache(server):
    prompt = "isolation: " + PROMPT
    assert cached(server, "key-a", prompt) == 0
    assert cached(server, "key-b", prompt) == 0  # B sends A's exact prompt
    assert cached(server, "key-a", prompt) > 0  # A's own prefix is cached
    assert cached(server, "key-b", prompt) > 0  # and now B's own


def test_client_salt_cannot_join_another_tenant(server):
    prompt = "salted: " + PROMPT
    assert cached(server, "key-a", prompt) == 0
    for salt in ("A", "key-a", cache_salt(b"guess", "A"), "anything"):
        assert cached(server, "key-b", prompt, salt) == 0


def test_client_salt_splits_a_tenant_further(server):
    prompt = "split: " + PROMPT
    assert cached(server, "key-a", prompt) == 0
    assert cached(server, "key-a", prompt, "team-1") == 0
    assert cached(server, "key-a", prompt, "team-1") > 0
    assert cached(server, "key-a", prompt, "team-2") == 0


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "key-a"}, {"Authorization": "Basic key-a"}]
)
def test_missing_or_invalid_key_is_401(server, headers):
    for method, path, body in [
        ("POST", "/v1/completions", {"prompt": "x"}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "x"}),
    ]:
        r = httpx.request(method, server.url + path, json=body, headers=headers)
        assert r.status_code == 401
        assert error_of(r)["code"] == "invalid_api_key"


def test_sdk_sees_authentication_error(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").completions.create(model=None, prompt="x", max_tokens=1)


def test_open_routes_need_no_key(server):
    for path in ("/health", "/load", "/metrics", "/version", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 200


def test_keys_file_format(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\n\nk1 alice\n  k2   bob  \n# k3 carol\n")
    keys = ApiKeys.from_file(path)
    assert keys.tenant("k1") == "alice" and keys.tenant("k2") == "bob"
    assert keys.tenant("k3") is None and keys.tenant(None) is None and keys.tenant("alice") is None
    for bad in ("k1\n", "k1 alice extra\n", "k1 a\nk1 b\n", "# nothing\n"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            ApiKeys.from_file(path)


def test_single_key_and_open_server():
    keys = ApiKeys.from_key("secret")
    assert keys.tenant("secret") == DEFAULT_TENANT and keys.tenant("other") is None
    assert ApiKeys({}).tenant(None) == ANONYMOUS_TENANT


def test_salt_derivation():
    secret = b"s" * 32
    a, b = cache_salt(secret, "A"), cache_salt(secret, "B")
    assert a != b and a == cache_salt(secret, "A") and len(bytes.fromhex(a)) == 32
    assert cache_salt(b"t" * 32, "A") != a  # depends on the server secret
    assert cache_salt(secret, "A", "x") not in (a, b, cache_salt(secret, "B", "x"))
