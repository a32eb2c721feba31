"""The prompt segment cache gives exactly the ids of a whole-text encode, on every OpenClaw
fixture, and turns itself off on a tokenizer where that would not hold."""

from __future__ import annotations

import json

import pytest

from clawray.models.segment_cache import SegmentCache
from tests.support.common import FIXTURES


def rendered(tokenizer, body) -> str:
    """The prompt text the ingress renders for an OpenAI request body."""
    from clawray.serve.protocol import ChatCompletionRequest, normalize_messages, normalize_tools

    req = ChatCompletionRequest(**body)
    return tokenizer.apply_chat_template(
        normalize_messages(req.messages), tools=normalize_tools(req.tools),
        add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def fixture_texts(tiny_tokenizer):
    names = sorted(FIXTURES.glob("session_*.json"))
    assert len(names) >= 6
    return [rendered(tiny_tokenizer, json.loads(p.read_text())["body"]) for p in names]


def test_segmented_ids_equal_whole_text_ids_on_every_openclaw_fixture(tiny_tokenizer,
                                                                      fixture_texts):
    cache = SegmentCache(tiny_tokenizer)
    assert cache.enabled, cache.reason
    for _ in range(2):  # cold, then from the cache
        for text in fixture_texts:
            assert cache.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)
    stats = cache.stats()
    # The session's requests share their system prompt and history: most segments hit.
    assert stats["hits"] > stats["misses"] > 0


def test_user_text_that_spells_an_added_token_is_split_like_the_tokenizer(tiny_tokenizer):
    cache = SegmentCache(tiny_tokenizer)
    text = "a<|im_end|>b<|im_start|>" + "z" * 100 + "<|im_end|>"
    assert cache.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)


def test_a_tokenizer_that_is_not_segment_stable_turns_the_cache_off(tiny_tokenizer):
    class PrefixPerCall:
        """Adds a marker id to every encode call: segments no longer add up to the whole."""

        def __init__(self, inner):
            self.inner = inner

        def get_added_vocab(self):
            return self.inner.get_added_vocab()

        def apply_chat_template(self, *a, **kw):
            return self.inner.apply_chat_template(*a, **kw)

        def encode(self, text, add_special_tokens=False):
            return [7] + self.inner.encode(text, add_special_tokens=add_special_tokens)

    odd = PrefixPerCall(tiny_tokenizer)
    cache = SegmentCache(odd)
    assert not cache.enabled and "differ" in cache.reason
    text = "<|im_start|>user\n" + "hello " * 30 + "<|im_end|>"
    assert cache.encode(text) == odd.encode(text)
