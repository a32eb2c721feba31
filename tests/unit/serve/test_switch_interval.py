"""``serving.switch_interval_s``: the process that runs a policy engine switches threads at
the configured interval (``PolicyCore``, the colocated ingress's and the PolicyServer's), and
leaves Python's own when unset."""

from __future__ import annotations

import sys

import pytest

from clawray.config import ClawRayConfig
from clawray.serve.policy_server import PolicyCore


@pytest.fixture
def restore_switch_interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_the_engines_process_takes_the_configured_switch_interval(tiny_model_path,
                                                                  restore_switch_interval):
    base = ClawRayConfig.from_dict({"model": {"path": str(tiny_model_path)},
                                    "inference": {"engine": "hf"}})
    PolicyCore(base)
    assert sys.getswitchinterval() == pytest.approx(restore_switch_interval)  # unset: as it was
    PolicyCore(base.copy_with(serving={"switch_interval_s": 0.002}))
    assert sys.getswitchinterval() == pytest.approx(0.002)
    with pytest.raises(ValueError, match="switch_interval_s"):
        ClawRayConfig.from_dict({"serving": {"switch_interval_s": 0}})
