"""serving.freeze_gc: a serving replica moves its start-up heap into Python's permanent GC
generation (as `vllm serve`'s API server does), so later collections skip it."""
import gc

from clawray.config import ClawRayConfig
from clawray.serve.policy_server import freeze_startup_heap


def test_freezing_moves_what_the_process_holds_out_of_the_collectors_reach():
    held = [{"n": i} for i in range(20_000)]  # tracked objects a start-up leaves behind
    gc.unfreeze()
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(held)
        # a full collection now walks only what was allocated since
        assert sum(len(gc.get_objects(g)) for g in range(3)) < len(held)
        made_after = [[i] for i in range(100)]  # still collectable: in generations 0-2
        assert any(o is made_after[0] for g in range(3) for o in gc.get_objects(g))
    finally:
        gc.unfreeze()


def test_on_by_default_and_can_be_turned_off():
    assert ClawRayConfig().serving_cfg.freeze_gc is True
    cfg = ClawRayConfig.from_dict({"serving": {"freeze_gc": False}})
    assert cfg.serving_cfg.freeze_gc is False
