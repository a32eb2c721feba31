"""Does a model write the tool-call markup on its own? Ten requests rendered with two tools by
the model folder's chat template, greedy; counts the replies with a valid ``<tool_call>``.

    .venv/bin/python scripts/tool_markup.py --model bundled:smollm2
"""

from __future__ import annotations

import argparse
import json

ASKS = ["What is the weather in Paris?", "Is it raining in Tokyo right now?",
        "Weather in Lima please.", "Search the web for the tallest building.",
        "Find news about the Olympics.", "How warm is it in Cairo today?",
        "Look up the population of Canada.", "What's the weather like in Oslo?",
        "Search for pasta recipes.", "Tell me a joke."]
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "Current weather in a city.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}},
         {"type": "function", "function": {
             "name": "search_web", "description": "Search the web.",
             "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                            "required": ["query"]}}}]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawray.models.loader import resolve_model_path
    from clawray.models.tool_calls import parse_tool_calls

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled:smollm2")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": a}], tools=TOOLS,
                                     add_generation_prompt=True, tokenize=False) for a in ASKS]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        ids = lm.generate(**enc, do_sample=False, max_new_tokens=args.max_new_tokens,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    width, valid = enc["input_ids"].shape[1], 0
    for ask, row in zip(ASKS, ids):
        reply = tok.decode(row[width:], skip_special_tokens=True)
        calls = parse_tool_calls(reply)[1]
        valid += bool(calls)
        print(json.dumps({"ask": ask, "reply": reply[:160],
                          "calls": [[c.name, c.arguments] for c in calls]}))
    print(json.dumps({"model": args.model, "requests": len(ASKS), "valid_calls": valid}))


if __name__ == "__main__":
    main()
