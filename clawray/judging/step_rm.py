r"""The step-wise reward model of RLAnything (docs/rlanything.md): its prompt and its score.

The RM judges one action of an agent in an environment: did it make progress toward the task?
It sees the task, a bounded slice of the interaction so far (oldest messages dropped first, with
a note saying how many), the action and the observation the environment returned after it. It
reasons, then ends with ``\boxed{1}`` (progress) or ``\boxed{-1}`` (no progress, invalid, or a
mistake); there is no neutral score, so a ``\boxed{0}`` is read as unparseable.

As in ``prompts.py``, every literal ``\boxed{…}`` in the prompt sits inside the
``EXAMPLES_START`` … ``EXAMPLES_END`` section, written as glosses, so ``parse_vote`` never reads
an example the RM quotes back as its score.
"""

from __future__ import annotations

from typing import Any

from clawray.judging.parse import parse_vote
from clawray.judging.prompts import (
    EXAMPLES_END,
    EXAMPLES_START,
    render_history,
    render_reply,
    tool_names,
)

STEP_RM_SYSTEM = f"""You are a step-wise reward model. You judge ONE action of an agent that \
works on a task in an interactive environment, by whether that action made progress toward \
completing the task.

You are shown the task, the earlier interaction (possibly shortened), the action the agent took \
at this step, and the observation the environment returned right after it.

Score the action:
- +1 (progress): the action is valid and brings the agent closer to completing the task, for \
example it reaches a place or object the task needs, gathers information the task needs, or \
completes a required sub-goal.
- -1 (no progress): the action is invalid or has no effect (the environment reports an error, \
or that nothing happens), repeats an earlier action without learning anything new, undoes \
earlier progress, or is a mistake that leads away from the task.

There is no neutral score: decide which is more likely. Judge from the task, the state and the \
observation. Think step by step, then end your answer with exactly one verdict box, written as \
in the format examples below, with nothing after it.

{EXAMPLES_START}
\\boxed{{1}} means the action made progress toward the task.
\\boxed{{-1}} means it did not: it was invalid, had no effect, or was a mistake.
{EXAMPLES_END}"""


def build_step_rm_prompt(task_text: str, history: list[dict[str, Any]], action_text: str,
                         next_observation: str, max_history_chars: int = 6000,
                         max_message_chars: int = 4000) -> list[dict[str, str]]:
    """The step RM prompt (system rubric + the rendered step) for one action.

    ``history`` is the OpenAI-format interaction before the action; the newest messages that fit
    in ``max_history_chars`` are shown. Over-long messages, action and observation keep their
    head and tail (``max_message_chars``).
    """
    names = tool_names(history)
    earlier = render_history(history, names, max_history_chars, max_message_chars)
    observation = (render_reply(next_observation, [], max_message_chars)
                   if next_observation and next_observation.strip() else "(no observation)")
    sections = [
        "## The task\n" + (task_text.strip() or "(no task text)"),
        "## Earlier interaction\n" + (earlier or "(none: this is the first step)"),
        "## The action taken at this step\n" + render_reply(action_text, [], max_message_chars),
        "## The observation right after the action\n" + observation,
    ]
    return [{"role": "system", "content": STEP_RM_SYSTEM},
            {"role": "user", "content": "\n\n".join(sections)
             + "\n\nDid this action make progress toward the task?"}]


def parse_step_score(text: str) -> int | None:
    r"""The RM's score of a step, +1 or -1, from its last verdict box; None when there is no
    valid verdict, including ``\boxed{0}`` (the step RM has no neutral score)."""
    vote = parse_vote(text)
    return vote if vote in (1, -1) else None
