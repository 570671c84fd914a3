"""The admin key: its own keys, checked before routing; user keys can never administer."""

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from banyan.config import ServerConfig
from banyan.server.app import Guard, ServerState, is_admin_path
from banyan.server.auth import AdminAuth, ApiKeyAuth, load_api_keys

USER, ADMIN = "user-key-1", "admin-key-1"


def guarded(user_keys: list[str], admin_keys: list[str]) -> Starlette:
    async def ok(request):
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route("/admin/models", ok), Route("/v1/models", ok), Route("/start_profile", ok,
                                                                                          methods=["POST"])])
    users = ApiKeyAuth(user_keys)
    state = ServerState(ServerConfig(), client=None, serving=None, auth=users, metrics=None,
                        admin=AdminAuth(admin_keys, users))
    return Guard(inner, state)


def status(app, method: str, path: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.request(method, path, headers=headers)).status_code

    return asyncio.run(go())


@pytest.mark.parametrize("key, expected", [(ADMIN, 200), (USER, 403), (None, 401), ("wrong", 401)])
def test_admin_routes_answer_by_key(key, expected):
    app = guarded([USER], [ADMIN])
    assert status(app, "GET", "/admin/models", key) == expected
    assert status(app, "POST", "/start_profile", key) == expected


def test_without_an_admin_key_the_admin_routes_do_not_exist():
    app = guarded([USER], [])
    assert status(app, "GET", "/admin/models", USER) == 404
    assert status(app, "GET", "/v1/models", USER) == 200


def test_the_admin_key_is_not_a_user_key():
    app = guarded([USER], [ADMIN])
    assert status(app, "GET", "/v1/models", ADMIN) == 401
    assert status(app, "GET", "/v1/models", USER) == 200


def test_admin_routes_need_the_admin_key_even_when_user_auth_is_off():
    app = guarded([], [ADMIN])
    assert status(app, "GET", "/admin/models", None) == 401
    assert status(app, "GET", "/v1/models", None) == 200
    assert status(app, "GET", "/admin/models", ADMIN) == 200


def test_admin_paths_are_prefixes_or_exact():
    assert is_admin_path("/admin/models/x/swap") and is_admin_path("/v1/load_lora_adapter")
    assert not is_admin_path("/administrator") and not is_admin_path("/v1/load_lora_adapter/x")


def test_admin_keys_load_from_flag_and_environment():
    keys = load_api_keys(["a1"], {"BANYAN_ADMIN_API_KEY": "a2,a3"}, None, flag="--admin-api-key",
                         env_name="BANYAN_ADMIN_API_KEY")
    assert keys == ["a1", "a2", "a3"]
