from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from clawray.serve.detokenize import IncrementalDetokenizer, StopCutter, first_stop


class _Tok:
    """A byte-level BPE (multi-byte characters split across tokens) with HF-style decode."""

    def __init__(self):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(["hello world ünïcödé 你好 emoji 🎉 tool_call"] * 20,
                                trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        self.t = tok

    @property
    def backend_tokenizer(self):
        return self.t

    def encode(self, s):
        return self.t.encode(s).ids

    def decode(self, ids, skip_special_tokens=True):
        return self.t.decode(ids)


TOK = _Tok()


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab üé你好🎉 \n", max_size=40), st.integers(1, 4))
def test_streamed_text_equals_full_decode(text, step):
    ids = TOK.encode(text)
    d = IncrementalDetokenizer(TOK)
    out = "".join(d.add(ids[i:i + step]) for i in range(0, len(ids), step)) + d.finish()
    assert out == TOK.decode(ids)
    assert "\ufffd" not in out or "\ufffd" in text


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet="abcXY", max_size=30), st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_stop_cutter_never_emits_a_stop_string(text, sizes):
    stops = ("XY", "cab")
    cutter, out, pos = StopCutter(stops), "", 0
    for n in sizes * 10:
        if pos >= len(text):
            break
        out += cutter.feed(text[pos:pos + n])
        pos += n
    out += cutter.feed(text[pos:]) + cutter.finish()
    cut = first_stop(text, stops)
    assert out == (text if cut is None else text[:cut])


def test_a_tokenizer_without_a_tokenizers_backend_is_a_clear_error():
    import pytest

    class Slow:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    with pytest.raises(TypeError, match="fast"):
        IncrementalDetokenizer(Slow())


def test_finish_never_drops_text_the_full_decoding_has():
    """Text the stream held back is released at the end, and should the streamed text and the
    full decoding ever disagree, the decoding's text beyond the streamed length still is."""
    for streamed in ("hello", "HELLO"):
        d = IncrementalDetokenizer(TOK)
        d.add(TOK.encode("hello world"))
        d.text = streamed  # as if the stream had released only five characters
        assert d.finish() == " world" and d.text == streamed + " world"
