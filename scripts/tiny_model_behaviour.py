"""How often a built embedded model does what its imprint taught, on chats it never saw.

    .venv/bin/python scripts/tiny_model_behaviour.py [MODEL_DIR] [N]

MODEL_DIR defaults to the embedded default (built if needed); N fresh imprint-style chats
(``corpus.imprint_example`` from a seed no build uses) are answered greedily and compared with
the imprint's answer: plain replies exactly right, CALL_TOOL answers a well-formed single call,
and exactly right (the first tool's name copied) for names of at most 4 tokens and longer ones.
The figures in ``clawray/models/tiny.py``'s docstring come from this script (N = 300).
"""

from __future__ import annotations

import random
import sys

import torch

from clawray.models.corpus import imprint_example
from clawray.models.loader import load_model, load_tokenizer
from clawray.models.tiny import build_embedded_default
from clawray.models.tool_calls import parse_tool_calls

SEED = 987654


def main() -> None:
    torch.set_num_threads(1)
    path = sys.argv[1] if len(sys.argv) > 1 else str(build_embedded_default())
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    model, tok = load_model(path), load_tokenizer(path)
    rng = random.Random(SEED)
    stats: dict[str, list[int]] = {}

    def count(key: str, hit: bool) -> None:
        s = stats.setdefault(key, [0, 0])
        s[0] += bool(hit)
        s[1] += 1

    for _ in range(n):
        messages, tools, answer = imprint_example(rng)
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=48, do_sample=False)
        text = tok.decode(out[0, ids["input_ids"].shape[1]:])
        exact = text == answer + "<|im_end|>"
        if not answer.startswith("<tool_call>"):
            count("plain reply exactly right", exact)
            continue
        content, calls = parse_tool_calls(text.removesuffix("<|im_end|>"))
        count("CALL_TOOL: one well-formed call",
              content is None and len(calls) == 1 and text.endswith("<|im_end|>"))
        name = tools[0]["function"]["name"]
        extra = len(tok(f'{{"name": "{name}"', add_special_tokens=False)["input_ids"]) - \
            len(tok('{"name": "', add_special_tokens=False)["input_ids"])
        count(f"CALL_TOOL: exactly right, name of {'<= 4' if extra <= 4 else '> 4'} tokens", exact)
    for key, (hits, total) in stats.items():
        print(f"{key}: {hits}/{total} = {hits / max(total, 1):.0%}")


if __name__ == "__main__":
    main()
