"""``clawray status``'s screen (clawray/apps/status.py ``render``) from the state ``gather``
reads: every part an operator asks about, absent parts as absent, a part that does not answer
as unreachable. ``gather`` on a running app: tests/cpu/training/test_trainer_on_cpu.py."""

from __future__ import annotations

from clawray.apps.status import render

NOW = 1_800_000_000.0


def state(**parts) -> dict:
    base = {
        "app": "clawray", "time": NOW,
        "serve": {"status": "RUNNING", "message": "", "deployments": {
            "Ingress": {"status": "HEALTHY", "replicas": {"RUNNING": 2}}}},
        "engine": {"engine": "vllm", "model": "smollm2-135m-instruct", "max_model_len": 8192,
                   "policy_version": 3, "running": 2, "waiting": 1, "paused": False},
        "control": {"version": 3, "kind": "lora", "published_at": NOW - 42,
                    "collecting": True, "adapters": {"alice": 2},
                    "replicas": {"r-aaaaaaaaaaaa": {"version": 3, "live": True,
                                                    "weights": True, "error": None},
                                 "r-bbbbbbbbbbbb": {"version": 2, "live": True,
                                                    "weights": True, "error": None}}},
        "judge_control": None,
        "hubs": [{"sessions": 5, "turns_held": 7, "judging": 2, "rows_written": 40},
                 {"sessions": 1, "turns_held": 1, "judging": 0, "rows_written": 4}],
        "buffer": {"available": 12, "leased_rows": 8, "consumed": {"seq": 4, "offset": 0},
                   "policy_version": 3},
        "gate": {"phase": "canary", "incumbent": 2, "candidate": 3, "pinned": False,
                 "events": [{"seq": 7, "t": NOW - 90, "event": "shadow_pass", "version": 3,
                             "p": 0.01}]},
    }
    base.update(parts)
    return base


def test_the_screen_names_every_part_an_operator_asks_about():
    screen = render(state())
    for fact in ("app clawray: RUNNING", "Ingress", "2 running",
                 "engine: vllm serving smollm2-135m-instruct (window 8,192 tokens), policy v3, "
                 "2 running, 1 waiting",
                 "published v3 (lora, 42 s ago); 1 of 2 live replicas on it",
                 "replica bbbbbbbbbbbb v2", "adapters: alice v2",
                 "sessions: 6 open, 8 turns held, 2 being judged, 44 samples written (2 hubs)",
                 "buffer: 12 rows available, 8 leased", "gate: canary, incumbent v2, candidate v3",
                 "last decision: shadow_pass v3 90 s ago (p 0.01)"):
        assert fact in screen, (fact, screen)


def test_absent_parts_are_absent_and_silent_ones_unreachable():
    screen = render(state(hubs=[], buffer=None, gate=None, control=None))
    assert "sessions: no session pipeline" in screen and "buffer: none" in screen
    assert "gate: off" in screen and "weights: no control actor" in screen
    down = {"error": "GetTimeoutError: timed out"}
    screen = render(state(engine=down, buffer=down, gate=down,
                          hubs=[down, {"sessions": 2, "turns_held": 0, "judging": 0,
                                       "rows_written": 1}]))
    assert "engine: unreachable (GetTimeoutError: timed out)" in screen
    assert "buffer: unreachable" in screen and "gate: unreachable" in screen
    assert "sessions: 2 open" in screen and "(2 hubs, 1 unreachable)" in screen
