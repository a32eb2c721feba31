"""``model: "<served model>:<user>"`` (serve/session_meta.py ``addressed_user``): who may name
whose policy, and the API errors for the rest."""

from __future__ import annotations

import pytest

from clawray.serve.protocol import MAX_ID_CHARS, APIError
from clawray.serve.session_meta import addressed_user

SERVED = "clawray-tiny"


def test_the_served_model_or_none_leaves_the_fields_as_they_are():
    fields = {"user": "u1", "session_id": "s"}
    for model in (None, "", SERVED):
        assert addressed_user(SERVED, model, fields, "t1", trusted_app=False) is fields


def test_a_trusted_app_names_any_of_its_end_users():
    assert addressed_user(SERVED, f"{SERVED}:alice", {}, "app", trusted_app=True) == \
        {"user": "alice"}
    assert addressed_user(SERVED, f"{SERVED}:alice", {"user": "alice"}, "app", True) == \
        {"user": "alice"}
    with pytest.raises(APIError, match="must agree") as e:
        addressed_user(SERVED, f"{SERVED}:alice", {"user": "bob"}, "app", trusted_app=True)
    assert e.value.status == 400


def test_any_other_key_names_only_its_own_tenant():
    assert addressed_user(SERVED, f"{SERVED}:t1", {"x": 1}, "t1", trusted_app=False) == {"x": 1}
    with pytest.raises(APIError) as e:
        addressed_user(SERVED, f"{SERVED}:t2", {}, "t1", trusted_app=False)
    assert (e.value.status, e.value.code) == (403, "model_not_permitted")


@pytest.mark.parametrize("model", ["gpt-9", f"{SERVED}:", f"other:{SERVED}"])
def test_another_model_is_not_found(model):
    with pytest.raises(APIError) as e:
        addressed_user(SERVED, model, {}, "t1", trusted_app=True)
    assert (e.value.status, e.value.code) == (404, "model_not_found")


def test_an_overlong_user_is_refused():
    with pytest.raises(APIError, match="longer than") as e:
        addressed_user(SERVED, f"{SERVED}:" + "u" * (MAX_ID_CHARS + 1), {}, "t", True)
    assert e.value.status == 400
