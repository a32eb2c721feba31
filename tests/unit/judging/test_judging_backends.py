"""Judge backends: Python functions by import path, and a real OpenAI client against a local
fake OpenAI server (uvicorn in a thread), including the fallback for endpoints without n > 1."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from clawray.config import JudgeConfig
from clawray.judging.backends import (
    FunctionBackend,
    JudgeUnavailable,
    OpenAIBackend,
    ServerBackend,
    make_backend,
    needs_server,
)
from clawray.judging.formats import hint_format, verdict_format
from clawray.judging.parse import tally
from clawray.judging.prompts import TurnContext, build_judge_request
from tests.support.common import free_port

REQ = build_judge_request("prm", TurnContext(
    history=[], request=[{"role": "user", "content": "2+2?"}], response_text="4",
    response_tool_calls=[], next_state=[{"role": "user", "content": "thanks!"}]))


# ---------------------------------------------------------------------------- function backend
def sync_judge(request, n, temperature):
    return [f"sync {request.kind} t={temperature} \\boxed{{1}}"] * n


async def async_judge(request, n, temperature):
    await asyncio.sleep(0)
    return [f"async \\boxed{{-1}} #{i}" for i in range(n)]


def wrong_type_judge(request, n, temperature):
    return "\\boxed{1}"


def wrong_count_judge(request, n, temperature):
    return ["\\boxed{1}"] * (n + 1)


class ScoringJudge:
    def __call__(self, request, n, temperature):
        return ["\\boxed{0}"] * n

    async def teacher_logprobs(self, messages, tools, response_ids):
        return [-0.5] * len(response_ids)


scoring_judge = ScoringJudge()


async def test_function_backend_sync_and_async_callables():
    out = await FunctionBackend(f"{__name__}:sync_judge").complete(REQ, 3, 0.6, 64)
    assert out == ["sync prm t=0.6 \\boxed{1}"] * 3
    out = await FunctionBackend(f"{__name__}:async_judge").complete(REQ, 2, 0.6, 64)
    assert out == ["async \\boxed{-1} #0", "async \\boxed{-1} #1"]
    assert tally(out).score == -1


async def test_function_backend_default_is_the_heuristic_judge():
    backend = make_backend(JudgeConfig())
    assert isinstance(backend, FunctionBackend)
    assert tally(await backend.complete(REQ, 3, 0.6, 64)).score == 1


async def test_function_backend_rejects_wrong_outputs():
    with pytest.raises(TypeError, match="list of str"):
        await FunctionBackend(f"{__name__}:wrong_type_judge").complete(REQ, 3, 0.6, 64)
    with pytest.raises(ValueError, match="expected n=3"):
        await FunctionBackend(f"{__name__}:wrong_count_judge").complete(REQ, 3, 0.6, 64)


def test_function_backend_bad_import_paths():
    for path in ("no_colon", "clawray.nonexistent_module:x", f"{__name__}:missing"):
        with pytest.raises(ValueError):
            FunctionBackend(path)


async def test_function_backend_teacher_logprobs():
    with pytest.raises(JudgeUnavailable, match="judge.backend=server"):
        await FunctionBackend(f"{__name__}:sync_judge").teacher_logprobs([], None, [1, 2])
    backend = FunctionBackend(f"{__name__}:scoring_judge")
    assert await backend.complete(REQ, 2, 0.6, 8) == ["\\boxed{0}"] * 2
    assert await backend.teacher_logprobs([], None, [5, 6, 7]) == [-0.5] * 3


# ---------------------------------------------------------------------------- fake OpenAI server
class FakeOpenAI:
    """/v1/chat/completions that answers ``n`` choices, or rejects n > 1 like some servers."""

    def __init__(self) -> None:
        self.mode = "ok"  # "ok" | "reject_n" | "one_choice"
        self.requests: list[dict] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            n = body.get("n") or 1
            if self.mode == "reject_n" and n > 1:
                return JSONResponse(status_code=400, content={"error": {
                    "message": "n > 1 is not supported by this server",
                    "type": "invalid_request_error",
                    "param": None, "code": None}})
            count = 1 if self.mode == "one_choice" else n
            last = body["messages"][-1]["content"]
            choices = [{"index": i, "finish_reason": "stop",
                        "message": {"role": "assistant",
                                    "content": f"choice {len(self.requests)}.{i} saw {len(last)} "
                                               f"chars \\boxed{{1}}"}} for i in range(count)]
            return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0,
                    "model": body["model"], "choices": choices,
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def fake_openai():
    server = FakeOpenAI()
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def fake(fake_openai):
    fake_openai.mode = "ok"
    fake_openai.requests.clear()
    return fake_openai


async def test_openai_backend_one_request_with_n(fake):
    backend = OpenAIBackend(fake.base_url, "sk-x", "judge-model", timeout_s=10)
    out = await backend.complete(REQ, 3, 0.6, 128)
    assert len(out) == 3 and tally(out).score == 1
    assert len(fake.requests) == 1
    body = fake.requests[0]
    assert body["n"] == 3 and body["temperature"] == 0.6 and body["max_tokens"] == 128
    assert body["model"] == "judge-model" and body["messages"] == REQ.messages


async def test_openai_backend_falls_back_to_single_calls_when_n_is_rejected(fake):
    fake.mode = "reject_n"
    backend = OpenAIBackend(fake.base_url, None, "judge-model", timeout_s=10)
    out = await backend.complete(REQ, 3, 0.6, 128)
    assert len(out) == 3 and len(set(out)) == 3
    assert [r.get("n") for r in fake.requests] == [3, None, None, None]
    fake.requests.clear()  # it remembers: the next call goes straight to single calls
    assert len(await backend.complete(REQ, 2, 0.6, 128)) == 2
    assert [r.get("n") for r in fake.requests] == [None, None]


async def test_openai_backend_fills_missing_choices(fake):
    fake.mode = "one_choice"
    backend = OpenAIBackend(fake.base_url, "sk-x", "judge-model", timeout_s=10)
    out = await backend.complete(REQ, 3, 0.6, 128)
    assert len(out) == 3
    assert [r.get("n") for r in fake.requests] == [3, None, None]


async def test_openai_backend_other_errors_propagate(fake):
    import openai

    backend = OpenAIBackend(fake.base_url.replace("/v1", "/nope"), "sk-x", "m", timeout_s=10)
    with pytest.raises(openai.NotFoundError):
        await backend.complete(REQ, 3, 0.6, 16)


async def test_openai_backend_cannot_be_a_teacher_and_make_backend(fake, monkeypatch):
    monkeypatch.setenv("CLAWRAY_JUDGE_API_KEY", "sk-env")
    backend = make_backend(JudgeConfig(backend="openai", url=fake.base_url, model="m"))
    assert isinstance(backend, OpenAIBackend)
    assert backend.client.api_key == "sk-env"
    with pytest.raises(JudgeUnavailable, match="cannot score given token ids"):
        await backend.teacher_logprobs([{"role": "user", "content": "x"}], None, [1])
    with pytest.raises(ValueError):
        make_backend(JudgeConfig(backend="server"))


# ---------------------------------------------------------------------------- server backend
class _Method:
    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class FakeHandle:
    def __init__(self):
        self.calls = []
        self.judge = _Method(lambda *a, **kw: self.calls.append(("judge", a, kw))
                             or ["\\boxed{1}"] * a[1])
        self.teacher_logprobs = _Method(
            lambda *a: self.calls.append(("teacher", a)) or [-1.0] * len(a[2]))


async def test_server_backend_calls_the_handle_methods():
    handle = FakeHandle()
    backend = make_backend(JudgeConfig(backend="server"), server_handle=handle)
    assert isinstance(backend, ServerBackend)
    assert await backend.complete(REQ, 2, 0.6, 32) == ["\\boxed{1}"] * 2
    msgs = [{"role": "user", "content": "x"}]
    assert await backend.teacher_logprobs(msgs, None, [3, 4]) == [-1.0, -1.0]
    assert handle.calls == [("judge", (REQ.messages, 2, 0.6, 32),
                             {"structural_tag": verdict_format((1, -1, 0), 32)}),
                            ("teacher", (msgs, None, [3, 4]))]


async def test_an_unconstrained_server_judge_samples_free_text():
    """judge.constrained=false: the JudgeServer samples as the model writes (the parser alone
    reads the verdict); OPD hint requests get the hint format when constrained."""
    handle = FakeHandle()
    free = make_backend(JudgeConfig(backend="server", constrained=False), server_handle=handle)
    await free.complete(REQ, 1, 0.6, 32)
    constrained = make_backend(JudgeConfig(backend="server", hint_max_chars=50),
                               server_handle=handle)
    await constrained.complete(build_judge_request("opd", REQ.context), 1, 0.6, 32)
    assert [c[2] for c in handle.calls] == [{"structural_tag": None},
                                            {"structural_tag": hint_format(32, 50)}]


class _Pending:
    """A Serve ``DeploymentResponse`` stand-in that never finishes; records ``cancel()``."""

    def __init__(self):
        self.cancelled = False
        self._never = asyncio.get_running_loop().create_future()

    def __await__(self):
        return self._never.__await__()

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("method", ["judge", "teacher_logprobs"])
async def test_a_server_call_its_caller_gives_up_on_is_cancelled_on_the_server(method):
    """A voter's timeout cancels the awaiting task; the request on the JudgeServer must be
    cancelled with it (awaiting a DeploymentResponse does not do that by itself)."""
    pending = []

    class Handle:
        def __getattr__(self, name):
            assert name == method
            return type("M", (), {"remote": lambda _self, *a, **kw: pending.append(_Pending())
                                  or pending[-1]})()

    backend = ServerBackend(Handle())
    call = (backend.complete(REQ, 3, 0.6, 8) if method == "judge"
            else backend.teacher_logprobs([{"role": "user", "content": "x"}], None, [1, 2]))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(call, 0.05)
    assert [p.cancelled for p in pending] == [True]


async def test_teacher_server_keeps_the_judges_votes_and_scores_on_the_judge_server(fake,
                                                                                    monkeypatch):
    """judge.teacher='server': the configured backend writes votes and hints (here the rule
    judge, and an external API that cannot score ids), the JudgeServer scores the teacher."""
    handle = FakeHandle()
    backend = make_backend(JudgeConfig(teacher="server"), server_handle=handle)
    assert isinstance(backend.judge, FunctionBackend)
    votes = await backend.complete(REQ, 2, 0.6, 32)
    assert votes == await FunctionBackend(JudgeConfig().function).complete(REQ, 2, 0.6, 32)
    msgs = [{"role": "user", "content": "x"}]
    assert await backend.teacher_logprobs(msgs, None, [3, 4, 5]) == [-1.0] * 3
    assert handle.calls == [("teacher", (msgs, None, [3, 4, 5]))]  # votes never reached it

    monkeypatch.setenv("CLAWRAY_JUDGE_API_KEY", "sk-env")
    api = make_backend(JudgeConfig(backend="openai", url=fake.base_url, model="m",
                                   teacher="server"), server_handle=handle)
    assert isinstance(api.judge, OpenAIBackend)
    assert await api.teacher_logprobs(msgs, None, [7]) == [-1.0]
    with pytest.raises(ValueError, match="needs a JudgeServer"):
        make_backend(JudgeConfig(teacher="server"))
    # The app builds a JudgeServer for it only when turns are judged live (the hub sink).
    assert needs_server(JudgeConfig(teacher="server")) and not needs_server(JudgeConfig())
