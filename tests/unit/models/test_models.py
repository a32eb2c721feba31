"""The embedded default model (tokenizer, template, weights, imprint) and the model loader."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clawray.models.chat_template import CHAT_TEMPLATE
from clawray.models.corpus import CALL_MARKER, generate_corpus
from clawray.models.loader import (
    ModelInfo,
    ModelLoadError,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from clawray.models.tiny import ADDED_TOKENS, TinyModelSpec, build_embedded_default
from clawray.models.tool_calls import parse_tool_calls
from tests.support.common import FIXTURES, load_fixture

FIXTURE_NAMES = sorted(p.name for p in FIXTURES.glob("session_*.json"))
# A spec small enough to build in a few seconds: for determinism and caching tests.
SMALL = TinyModelSpec(seed=3, vocab_size=1024, corpus_docs=300, imprint_steps=3,
                      imprint_examples=24, imprint_batch_size=4)
LS_TOOL = {"type": "function", "function": {
    "name": "ls", "description": "List files in a directory.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}


@pytest.fixture(scope="module")
def tiny_model(tiny_model_path):
    return load_model(tiny_model_path)


def render(tok, body: dict) -> str:
    return tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                   add_generation_prompt=True, tokenize=False)


def greedy(model, tok, messages, tools=None, max_new_tokens=48) -> str:
    ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:])


# --- corpus and spec ---------------------------------------------------------------------------

def test_corpus_is_deterministic_per_seed_and_covers_agent_text():
    first = list(generate_corpus(seed=1, num_docs=200))
    assert first == list(generate_corpus(seed=1, num_docs=200))
    assert first != list(generate_corpus(seed=2, num_docs=200))
    text = "\n".join(first)
    for marker in ("<|im_start|>assistant", "<tool_call>\n{\"name\": ", "<tool_response>",
                   '"parameters": {"type": "object"', "## ", "- ", "def ", "</"):
        assert marker in text, marker


def test_spec_digest_is_stable_and_changes_with_the_spec():
    assert TinyModelSpec().digest() == TinyModelSpec().digest()
    assert TinyModelSpec(seed=1).digest() != TinyModelSpec().digest()
    assert len(TinyModelSpec().digest()) == 12


# --- chat template -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_template_renders_openclaw_fixture(tiny_tokenizer, name):
    body = load_fixture(name)["body"]
    text = render(tiny_tokenizer, body)
    system = body["messages"][0]["content"]
    assert text.startswith("<|im_start|>system\n" + system + "\n\n# Tools")
    tools_block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in tools_block.split("\n")] == body["tools"]
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # The trailing content-part array is rendered as its text.
    last = body["messages"][-1]
    assert isinstance(last["content"], list)
    assert f"<|im_start|>user\n{last['content'][0]['text']}<|im_end|>\n" in text


def test_template_renders_tool_call_and_tool_response_of_fixture(tiny_tokenizer):
    text = render(tiny_tokenizer, load_fixture("session_s1_t3_req2.json")["body"])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": {"path":"."}}\n'
            "</tool_call><|im_end|>\n") in text
    assert '<|im_start|>user\n<tool_response>\n".git/"\n"AGENTS.md"' in text
    assert '"USER.md"\n</tool_response><|im_end|>\n' in text


def test_template_tool_call_arguments_dict_or_string_and_grouped_tool_results(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}},
            {"id": "b", "type": "function", "function": {"name": "read", "arguments": '{"p":1}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x.py"},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "one"},
                                                          {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None},
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\ngo<|im_end|>\n"
        "<|im_start|>assistant\nLooking.\n"
        '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read", "arguments": {"p":1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nx.py\n</tool_response>\n"
        "<tool_response>\nonetwo\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n")
    # What the model writes in that format parses back into the same calls.
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(assistant)
    assert content == "Looking." and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("ls", {"path": "."}), ("read", {"p": 1})]


def test_template_without_tools_has_no_tool_instructions(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    with_tools = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                    tools=[LS_TOOL], tokenize=False)
    assert with_tools.startswith("<|im_start|>system\n# Tools\n")
    assert '<tool_call>\n{"name": <name>, "arguments": <json object>}\n</tool_call>' in with_tools


# --- tokenizer and weights ---------------------------------------------------------------------

def test_tokenizer_markup_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    assert len(tok) <= TinyModelSpec().vocab_size
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", *ADDED_TOKENS):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    ids = tok.encode('<tool_call>\n{"name": "ls"}\n</tool_call><|im_end|>', add_special_tokens=False)
    # Tool markup is ordinary text when decoding; only the chat control tokens are special.
    assert tok.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "ls"}\n</tool_call>'
    assert tok.decode(tok.encode("héllo wörld ✓ 🎉", add_special_tokens=False)) == "héllo wörld ✓ 🎉"


def test_model_folder_is_a_small_qwen3_with_eos_in_generation_config(tiny_model_path, tiny_model):
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["max_position_embeddings"] == 32768
    assert (tiny_model_path / "model.safetensors").is_file()
    assert (tiny_model_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    n_params = sum(p.numel() for p in tiny_model.parameters())
    assert n_params <= 3_000_000
    info = ModelInfo.from_path(tiny_model_path)
    tok = load_tokenizer(tiny_model_path)
    assert set(info.eos_token_ids) == {tok.convert_tokens_to_ids("<|im_end|>"),
                                       tok.convert_tokens_to_ids("<|endoftext|>")}
    assert info.max_model_len == 32768 and info.name == tiny_model_path.name


def test_fixture_prompt_fits_the_context_and_runs_forward(tiny_tokenizer, tiny_model):
    text = render(tiny_tokenizer, load_fixture("session_s1_t3_req2.json")["body"])
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < 24_000, len(ids)  # ~18k: about 3.3 characters per token
    with torch.no_grad():
        out = tiny_model(torch.tensor([ids]), logits_to_keep=1)
    assert out.logits.shape == (1, 1, tiny_model.config.vocab_size)
    assert torch.isfinite(out.logits).all()


# --- build: determinism, cache, concurrency ------------------------------------------------------

def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_two_builds_from_scratch_are_byte_identical(tmp_path):
    a = build_embedded_default(tmp_path / "a", SMALL)
    b = build_embedded_default(tmp_path / "b", SMALL)
    assert a.name == b.name == f"tiny-qwen3-{SMALL.digest()}"
    files_a, files_b = _files(a), _files(b)
    assert {"model.safetensors", "tokenizer.json", "config.json", "generation_config.json",
            "tokenizer_config.json", "chat_template.jinja"} <= set(files_a)
    assert files_a == files_b
    other = build_embedded_default(tmp_path / "c", TinyModelSpec(**{**SMALL.__dict__, "seed": 4}))
    assert _files(other)["model.safetensors"] != files_a["model.safetensors"]


def test_second_call_reuses_the_folder(tmp_path):
    first = build_embedded_default(tmp_path, SMALL)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_embedded_default(tmp_path, SMALL) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [first.name]


def test_concurrent_builders_in_several_processes_agree(tmp_path):
    code = ("import sys; from pathlib import Path; from clawray.models.tiny import *; "
            f"print(build_embedded_default(Path(sys.argv[1]), TinyModelSpec(**{SMALL.__dict__!r})))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[3]) for _ in range(2)]
    # The last line: libraries may log to stdout on import (DeepSpeed's accelerator notice).
    outs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(tmp_path / f"tiny-qwen3-{SMALL.digest()}")
    leftovers = [p.name for p in tmp_path.iterdir() if ".building-" in p.name]
    assert leftovers == []


# --- loader ------------------------------------------------------------------------------------

def test_resolve_embedded_and_local_paths(tiny_model_path):
    assert resolve_model_path(None) == tiny_model_path
    assert resolve_model_path("embedded:tiny") == tiny_model_path
    assert resolve_model_path(str(tiny_model_path)) == tiny_model_path


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: (d / "f.txt").write_text("x") and d / "f.txt", "is a file"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "no config.json"),
    (lambda d: "embedded:huge", "unknown embedded model"),
    (lambda d: "Qwen/Qwen3-0.6B", "local folders only"),
])
def test_resolve_rejects_what_is_not_a_local_model(tmp_path, make, message):
    with pytest.raises(ModelLoadError, match=message):
        resolve_model_path(make(tmp_path))


def test_tokenizer_without_chat_template_is_rejected(tiny_model_path, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_path / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no chat template"):
        load_tokenizer(tmp_path)


def test_load_model_errors_and_settings(tiny_model_path, tiny_model, tmp_path):
    assert not tiny_model.training
    assert tiny_model.config._attn_implementation == "sdpa"
    assert next(tiny_model.parameters()).dtype == torch.float32
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(tiny_model_path, dtype="float8")
    shutil.copy(tiny_model_path / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="cannot load a causal LM"):
        load_model(tmp_path)
    assert ModelInfo.from_path(tiny_model_path, served_name="clawray-tiny").name == "clawray-tiny"


# --- imprint behaviours (greedy) -----------------------------------------------------------------

@pytest.mark.parametrize("text", ["Hello, what is 2+2?", "Hi", "Tell me a story.",
                                  "[Sun 2026-11-29 22:31 UTC] And what is 3+3?"])
def test_imprint_short_reply_ends_with_im_end(tiny_model, tiny_tokenizer, text):
    out = greedy(tiny_model, tiny_tokenizer, [{"role": "user", "content": text}])
    assert out.endswith("<|im_end|>"), out
    assert "<tool_call>" not in out and len(out) < 120


def test_imprint_plain_message_with_tools_gets_text_not_a_call(tiny_model, tiny_tokenizer):
    out = greedy(tiny_model, tiny_tokenizer, [{"role": "user", "content": "Hello there!"}],
                 tools=[LS_TOOL])
    assert out.endswith("<|im_end|>") and "<tool_call>" not in out, out


@pytest.mark.parametrize("text", ["Please CALL_TOOL and list the workspace.",
                                  "CALL_TOOL: list the files please", "CALL_TOOL now"])
def test_imprint_call_tool_marker_gives_one_well_formed_call(tiny_model, tiny_tokenizer, text):
    assert CALL_MARKER in text
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": text}]
    out = greedy(tiny_model, tiny_tokenizer, messages, tools=[LS_TOOL])
    assert out.startswith("<tool_call>\n{") and out.endswith("}\n</tool_call><|im_end|>"), out
    content, calls = parse_tool_calls(out.removesuffix("<|im_end|>"))
    assert content is None and len(calls) == 1
    assert calls[0].name == "ls"
    assert isinstance(json.loads(calls[0].arguments), dict)


def test_a_build_progress_line_is_shown_once(capsys, monkeypatch):
    """On stderr when logging would not show it; through logging alone when it would (the
    CLI logs at INFO: printing too gave every build line twice)."""
    import io
    import logging

    from clawray.models import tiny

    log = logging.getLogger("clawray.models.tiny")
    monkeypatch.setattr(log, "propagate", False)  # only this test's handler, if any
    tiny._Progress(echo=True)("step one")
    assert capsys.readouterr().err.count("step one") == 1  # printed: no handler shows it
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        tiny._Progress(echo=True)("step two")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert stream.getvalue().count("step two") == 1 and "step two" not in capsys.readouterr().err
