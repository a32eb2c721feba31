"""Scripted ``generate`` functions for playing episodes without a model (shared by tests)."""

from __future__ import annotations

from clawray.inference.engine import TokenOutput
from clawray.models.chat_template import IM_END


def scripted(tokenizer, texts_for):
    """A ``generate`` that answers each prompt with ``texts_for(prompt_ids)`` + <|im_end|>."""
    end = tokenizer.convert_tokens_to_ids(IM_END)
    calls = []

    async def generate(prompt_ids, params):
        ids = tokenizer.encode(texts_for(prompt_ids), add_special_tokens=False) + [end]
        calls.append(list(prompt_ids))
        return TokenOutput(ids, [-0.5] * len(ids), "stop", policy_version=3)

    generate.calls = calls
    return generate


def expert_policy(family, task, tokenizer):
    """Answers with the expert's action, tracked on a shadow copy of the environment."""
    shadow = family.make_env()
    shadow.reset(task)

    def texts_for(_prompt):
        action = shadow.expert_action()
        shadow.step(action)
        return action.text()

    return scripted(tokenizer, texts_for)
