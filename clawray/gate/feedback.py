"""A shadow set scored by held-out explicit feedback: what an operator has, not what users want.

The policy gate's shadow evaluation needs a score for a reply the candidate writes now. The
users' hidden preference would be an oracle no operator holds. What an operator does hold is
explicit feedback: replies that users rated up or down (``POST /v1/feedback``), some of which
can be kept out of training. This module fits a reply scorer on those ratings and scores new
replies with it:

- ``read_rated(path)``: the rated replies, one JSON object a line: ``{"messages": [...],
  "reply": "...", "rating": "up" | "down"}`` (``1`` / ``-1`` too);
- ``FeedbackScorer.fit(rated)``: scikit-learn's logistic regression (balanced classes) on the
  reply's word uni- and bigrams (TF-IDF) and its length in words; ``prob_up(text)`` is the
  fitted probability that a user would rate ``text`` up. ``report`` holds its cross-validated
  balanced accuracy with p₊ (ups scored up) and p₋ (downs scored down), next to the rules a
  cue alone gives: the length alone, and "always up";
- ``feedback_shadow_set(path, n)``: ``gate.shadow_set: clawray.gate.feedback:feedback_shadow_set``
  with ``gate.shadow_kwargs: {path: FILE, n: 40}``: the distinct prompts of the file (the
  first ``n``), each reply scored ``prob_up``.

The scorer reads only the reply, so it can learn no more than the rated replies show: a
preference that depends on who asks needs the asker's ratings apart (one file per user group).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RATINGS = {"up": 1, "down": -1, 1: 1, -1: -1}
MIN_PER_SIDE = 4  # fewer ratings of one side cannot fit (nor cross-validate) a scorer


@dataclass(frozen=True)
class RatedReply:
    messages: list[dict[str, Any]]
    reply: str
    rating: int  # 1: up, -1: down


def read_rated(path: str | Path) -> list[RatedReply]:
    """The rated replies of a JSONL file; a precise error for any line that is not one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"rated replies: no file {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"rated replies {path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        messages, reply, rating = row.get("messages"), row.get("reply"), row.get("rating")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of chat messages")
        if not isinstance(reply, str):
            raise ValueError(f"{where}: 'reply' must be the rated reply's text")
        if isinstance(rating, bool) or rating not in RATINGS:
            raise ValueError(f"{where}: 'rating' must be 'up' or 'down' (or 1 / -1), "
                             f"got {rating!r}")
        out.append(RatedReply(messages, reply, RATINGS[rating]))
    if not out:
        raise ValueError(f"rated replies {path}: no ratings")
    return out


def _length(texts: Any) -> Any:
    import numpy as np

    return np.log1p([[len(str(t).split())] for t in texts])


def _pipeline(features: str, seed: int) -> Any:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import FeatureUnion, make_pipeline
    from sklearn.preprocessing import FunctionTransformer, StandardScaler

    length = make_pipeline(FunctionTransformer(_length), StandardScaler())
    parts = {"length": [("length", length)],
             "words+length": [("words", TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True,
                                                        min_df=1)),
                              ("length", length)]}[features]
    return make_pipeline(FeatureUnion(parts),
                         LogisticRegression(class_weight="balanced", max_iter=1000,
                                            random_state=seed))


def _scores(y_true: Any, y_pred: Any) -> dict[str, float]:
    from sklearn.metrics import balanced_accuracy_score, recall_score

    return {"balanced_accuracy": float(balanced_accuracy_score(y_true, y_pred)),
            "p_up": float(recall_score(y_true, y_pred, pos_label=1)),
            "p_down": float(recall_score(y_true, y_pred, pos_label=-1))}


class FeedbackScorer:
    """A reply scorer fitted on rated replies (``fit``); ``prob_up`` scores a new reply."""

    def __init__(self, model: Any, report: dict[str, Any]) -> None:
        self._model = model
        self.report = report

    @classmethod
    def fit(cls, rated: list[RatedReply], seed: int = 0, folds: int = 5) -> FeedbackScorer:
        import numpy as np
        from sklearn.model_selection import StratifiedKFold, cross_val_predict

        texts = [r.reply for r in rated]
        y = np.array([r.rating for r in rated])
        ups, downs = int(np.sum(y == 1)), int(np.sum(y == -1))
        if min(ups, downs) < MIN_PER_SIDE:
            raise ValueError(f"rated replies: {ups} up and {downs} down; a scorer needs at least "
                             f"{MIN_PER_SIDE} of each")
        cv = StratifiedKFold(n_splits=min(folds, ups, downs), shuffle=True, random_state=seed)
        report: dict[str, Any] = {"n": len(rated), "up": ups, "down": downs,
                                  "folds": cv.get_n_splits()}
        for name in ("words+length", "length"):
            pred = cross_val_predict(_pipeline(name, seed), texts, y, cv=cv)
            report["scorer" if name == "words+length" else "length_only"] = _scores(y, pred)
        report["always_up"] = _scores(y, np.ones_like(y))
        model = _pipeline("words+length", seed).fit(texts, y)
        return cls(model, report)

    def prob_up(self, text: str) -> float:
        classes = list(self._model.classes_)
        return float(self._model.predict_proba([text])[0][classes.index(1)])


def feedback_shadow_set(path: str, n: int | None = 40, seed: int = 0) -> Any:
    """The policy gate's shadow set from held-out explicit feedback (module docstring)."""
    from clawray.gate.actor import ShadowSet

    rated = read_rated(path)
    scorer = FeedbackScorer.fit(rated, seed=seed)
    prompts, seen = [], set()
    for r in rated:
        key = json.dumps(r.messages, sort_keys=True)
        if key not in seen:
            seen.add(key)
            prompts.append(r.messages)
    prompts = prompts[:n] if n else prompts
    acc = scorer.report["scorer"]["balanced_accuracy"]
    return ShadowSet(prompts, score=lambda i, text: scorer.prob_up(text),
                     name=f"explicit feedback {Path(path).name}: {len(rated)} ratings, "
                          f"{len(prompts)} prompts, scorer balanced accuracy {acc:.3f} "
                          f"(cross-validated)")
