"""The trainer's message when a learner rank dies (its node lost): what died, where, and how
the job resumes; checked on two real hosts in tests/cpu/cluster/test_two_hosts_on_cpu.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from clawray.config import ClawRayConfig


def test_a_lost_learner_rank_says_where_why_and_how_to_resume():
    from clawray.training.trainer import Trainer

    cfg = (ClawRayConfig().buffer(lease_s=30)
           .training(num_learners=2, placement_strategy="STRICT_SPREAD")
           .placement(learner={"labels": {"clawray-host": "b"}}))
    me = SimpleNamespace(cfg=cfg, checkpoint_dir=Path("/data/ckpt"), version=7)
    err = RuntimeError("The actor died unexpectedly before finishing this task.\n"
                       "\tclass_name: LearnerWorker\n\tip: 10.213.1.2\n"
                       "The actor died because its node has died.\n"
                       "\tthe actor's node was terminated unexpectedly: health check failed")
    msg = Trainer._lost_message(me, err)
    assert msg.startswith("a learner rank died (ip: 10.213.1.2: the actor's node was "
                          "terminated unexpectedly: health check failed)")
    for part in ("'clawray-host': 'b'", "2 rank(s), STRICT_SPREAD", "under /data/ckpt",
                 "policy version 7", "once its lease ends (30 s)"):
        assert part in msg, (part, msg)
    msg = Trainer._lost_message(SimpleNamespace(cfg=ClawRayConfig().buffer(lease_s=None),
                                                checkpoint_dir=Path("/c"), version=0),
                                RuntimeError(""))
    assert "node unknown: RuntimeError" in msg and "again to the next trainer" in msg
