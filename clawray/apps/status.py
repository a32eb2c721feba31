"""``clawray status``: what a running app is doing, on one screen (``--json`` for scripts).

Read through Ray from the app's own parts, never through HTTP: Serve's view of the app (its
deployments and replicas), one ingress replica's engine, the ``AppControl`` actor (published
policy version, the version and liveness of every replica, adapters, the collecting switch),
the live pipeline (session hubs: sessions open, turns held and being judged; the sample
buffer: rows available, leased, consumed) and the policy gate. Each part that is not there
(an app without a gate, a pipeline that is off) is shown as absent, never as an error.
"""

from __future__ import annotations

import time
from typing import Any

from clawray.names import (NAMESPACE, buffer_name, control_name, gate_name, hub_name,
                           judge_channel)

MAX_HUBS = 64  # session hubs are numbered from 0; the first missing one ends the count
CALL_TIMEOUT_S = 10.0


class NoApp(Exception):
    """No app of that name runs in the cluster."""


def _failed(e: Exception) -> dict[str, str]:
    """What a part that did not answer is shown as."""
    return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}


def gather(app: str, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
    """The app's state as one dict (Ray must be connected). Raises :class:`NoApp`."""
    import ray
    from ray import serve

    apps = serve.status().applications
    if app not in apps:
        running = sorted(apps)
        raise NoApp(f"no app {app!r} runs in this Ray cluster"
                    + (f" (running: {', '.join(running)})" if running else
                       " (no Serve app runs in it)"))
    serve_app = apps[app]
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE}

    def call(name: str, method: str) -> Any:
        if name not in named:
            return None
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            return ray.get(getattr(actor, method).remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - one part down must not hide the others
            return _failed(e)

    engine: dict[str, Any] | None
    try:
        engine = serve.get_app_handle(app).status.remote().result(timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001
        engine = _failed(e)
    hubs = []
    for i in range(MAX_HUBS):
        if hub_name(app, i) not in named:
            break
        hubs.append(call(hub_name(app, i), "stats"))
    return {
        "app": app, "time": time.time(),
        "serve": {"status": str(getattr(serve_app.status, "value", serve_app.status)),
                  "message": serve_app.message or "",
                  "deployments": {name: {
                      "status": str(getattr(d.status, "value", d.status)),
                      "replicas": {str(getattr(k, "value", k)): v
                                   for k, v in (d.replica_states or {}).items()}}
                      for name, d in serve_app.deployments.items()}},
        "engine": engine,
        "control": call(control_name(app), "status"),
        "judge_control": call(control_name(judge_channel(app)), "status"),
        "hubs": hubs,
        "buffer": call(buffer_name(app), "stats"),
        "gate": call(gate_name(app), "status"),
    }


def _ago(t: float | None, now: float) -> str:
    if not t:
        return "never"
    s = max(0.0, now - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else \
        f"{s / 3600:.1f} h ago"


def _error(part: Any) -> str | None:
    return part.get("error") if isinstance(part, dict) else None


def _engine(eng: dict[str, Any], now: float) -> list[str]:
    return [f"engine: {eng['engine']} serving {eng['model']} (window "
            f"{eng['max_model_len']:,} tokens), policy v{eng['policy_version']}, "
            f"{eng['running']} running, {eng['waiting']} waiting"
            + (", PAUSED" if eng.get("paused") else "")]


def _weights(ctl: dict[str, Any], now: float) -> list[str]:
    reps = ctl.get("replicas", {})
    live = [r for r in reps.values() if r.get("live")]
    on = sum(r.get("version") == ctl["version"] for r in live)
    lines = [f"weights: published v{ctl['version']} ({ctl.get('kind') or 'none yet'}, "
             f"{_ago(ctl.get('published_at'), now)}); {on} of {len(live)} live replicas on "
             f"it; collecting turns: {'on' if ctl['collecting'] else 'OFF'}"]
    for rid, r in sorted(reps.items()):
        state = "live" if r.get("live") else f"silent {r.get('seen_s_ago', '?')} s"
        err = f", error: {r['error']}" if r.get("error") else ""
        lines.append(f"  replica {rid[-12:]:<12} v{r.get('version')}  {state}{err}")
    if ctl.get("adapters"):
        shown = ", ".join(f"{u} v{v}" for u, v in sorted(ctl["adapters"].items())[:8])
        more = len(ctl["adapters"]) - 8
        lines.append(f"  adapters: {shown}" + (f" and {more} more" if more > 0 else ""))
    return lines


def _buffer(buf: dict[str, Any], now: float) -> list[str]:
    return [f"buffer: {buf.get('available', 0)} rows available, {buf.get('leased_rows', 0)} "
            f"leased to the trainer, consumed up to segment "
            f"{buf.get('consumed', {}).get('seq')}; trained policy v{buf.get('policy_version')}"]


def _gate(gate: dict[str, Any], now: float) -> list[str]:
    events = gate.get("events") if isinstance(gate.get("events"), list) else []
    candidate = gate.get("candidate")
    lines = [f"gate: {gate.get('phase', '?')}, incumbent v{gate.get('incumbent')}, candidate "
             f"{'none' if candidate is None else f'v{candidate}'}"
             + (" (pinned)" if gate.get("pinned") else "")]
    if events:
        last = events[-1]
        detail = ", ".join(f"{k} {v}" for k, v in last.items()
                           if k not in ("seq", "t", "event", "version"))
        lines.append(f"  last decision: {last.get('event')} v{last.get('version')} "
                     f"{_ago(last.get('t'), now)}" + (f" ({detail})" if detail else ""))
    return lines


# (key, label, what its lines are, what to say when the app has none)
PARTS = (("engine", "engine", _engine, "engine: none"),
         ("control", "weights: control actor", _weights,
          "weights: no control actor (the app has not started one)"),
         ("buffer", "buffer", _buffer, "buffer: none"),
         ("gate", "gate", _gate, "gate: off"))


def _sessions(hubs_st: list[Any]) -> str:
    hubs = [h for h in hubs_st if h and not _error(h)]
    if not hubs_st:
        return "sessions: no session pipeline (record_sink has no hub)"
    down = len(hubs_st) - len(hubs)
    return (f"sessions: {sum(h.get('sessions', 0) for h in hubs)} open, "
            f"{sum(h.get('turns_held', 0) for h in hubs)} turns held, "
            f"{sum(h.get('judging', 0) for h in hubs)} being judged, "
            f"{sum(h.get('rows_written', 0) for h in hubs)} samples written "
            f"({len(hubs_st)} hubs" + (f", {down} unreachable)" if down else ")"))


def render(st: dict[str, Any]) -> str:
    """The human-readable screen of :func:`gather`'s dict."""
    now = st.get("time") or time.time()
    lines = [f"app {st['app']}: {st['serve']['status']}"
             + (f" ({st['serve']['message']})" if st["serve"].get("message") else "")]
    for name, d in st["serve"]["deployments"].items():
        counts = ", ".join(f"{n} {state.lower()}" for state, n in sorted(d["replicas"].items()))
        lines.append(f"  {name:<14} {d['status'].lower():<10} {counts or 'no replicas'}")
    for key, label, lines_of, absent in PARTS:
        part = st.get(key)
        if _error(part):
            lines.append(f"{label}: unreachable ({_error(part)})")
        elif part:
            lines.extend(lines_of(part, now))
        else:
            lines.append(absent)
        if key == "control":  # the pipeline after the weights, before the buffer
            lines.append(_sessions(st.get("hubs") or []))
    return "\n".join(lines)
