"""OPD and Combine score the policy's token ids under the judge model: a judge with another
tokenizer is a config error when the app is built, not garbage teacher log-probs later."""

from __future__ import annotations

import shutil

import pytest

from clawray.config import ClawRayConfig, ConfigError
from clawray.models.loader import check_teacher_tokenizer, load_tokenizer


def _judge_copy(tiny_model_path, tmp_path, extra_token: str | None):
    judge = tmp_path / "judge"
    shutil.copytree(tiny_model_path, judge)
    if extra_token:
        tok = load_tokenizer(judge)
        tok.add_tokens([extra_token])
        tok.save_pretrained(judge)
    return judge


def _cfg(tiny_model_path, judge, kinds):
    return (ClawRayConfig().model(path=str(tiny_model_path))
            .judge(backend="server", model_path=str(judge)).sessions(sample_kinds=kinds))


def test_a_judge_with_another_tokenizer_is_refused_for_opd_and_combine(tiny_model_path,
                                                                        tmp_path):
    judge = _judge_copy(tiny_model_path, tmp_path, "<judge_only_token>")
    for kinds in (["rl", "opd"], ["combine"]):
        with pytest.raises(ConfigError, match="another tokenizer"):
            check_teacher_tokenizer(_cfg(tiny_model_path, judge, kinds))
    check_teacher_tokenizer(_cfg(tiny_model_path, judge, ["rl"]))  # no teacher: no constraint


def test_a_judge_with_the_policys_tokenizer_passes(tiny_model_path, tmp_path):
    judge = _judge_copy(tiny_model_path, tmp_path, None)
    check_teacher_tokenizer(_cfg(tiny_model_path, judge, ["opd"]))
