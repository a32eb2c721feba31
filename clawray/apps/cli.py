"""``clawray`` command line: build the embedded model, serve, and run the demo.

    clawray build-model           # build (or reuse) the embedded tiny model, print its folder
    clawray serve [-c cfg.yaml]   # start Ray + the Serve app and block (Ctrl-C stops)
    clawray demo                  # serve + train from simulated users; the model visibly learns
    clawray demo --per-user       # opposite preferences: one shared policy vs an adapter per user
    clawray demo --gate           # the policy gate against a poisoned judge, and on a healthy run
    clawray replay                # serve the embedded default and replay an OpenClaw session
    clawray sft [-c cfg.yaml]     # warm-start the policy on expert demos (cached), print its folder
    clawray rm-sft [-c cfg.yaml]  # warm-start the step-wise reward model on oracle-labelled steps
    clawray judge-sft             # train the live loop's judge model on user feedback (cached)
    clawray env-demo              # sft + GRPO on household tasks with a curriculum, before/after
    clawray rla-table             # RLAnything's Table 1 (policy / +RM / +env) on household tasks
    clawray samples stats PATH    # the sample log: counts, rewards; `samples head PATH -n 5`
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import sys
from pathlib import Path
from typing import Any

from clawray.config import ClawRayConfig, ConfigError, apply_sets, load_config

# Each command imports its own stack (Ray, Serve, torch, DeepSpeed) inside its function, so
# `clawray --help`, a bad flag or `clawray samples` answer at once instead of after seconds of
# imports.


def _config(args: argparse.Namespace) -> ClawRayConfig:
    """The config from ``--config`` and ``--port``, validated, with the embedded model built."""
    cfg = ClawRayConfig.from_yaml(args.config) if args.config else ClawRayConfig()
    if args.port:
        cfg.serving(port=args.port)
    cfg.check().apply_log_level()
    _prebuild(cfg)
    return cfg


def cmd_build_model(args: argparse.Namespace) -> int:
    from clawray.models.tiny import build_embedded_default

    print(build_embedded_default(progress=True))
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    """``clawray model import SOURCE --out DIR`` / ``clawray model prepare bundled:NAME``."""
    from clawray.models.importer import ModelImportError, import_model, provenance
    from clawray.models.loader import ModelLoadError, resolve_model_path

    try:
        if args.action == "import":
            if not args.out:
                print("clawray model import: --out DIR is required", file=sys.stderr)
                return 2
            template = Path(args.chat_template).read_text() if args.chat_template else None
            folder = import_model(args.source, args.out, chat_template=template,
                                  context=args.context)
        else:
            folder = resolve_model_path(args.source)
    except (ModelImportError, ModelLoadError) as e:
        print(f"clawray model {args.action}: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"folder": str(folder), **(provenance(folder) or {})}, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _config(args)
    print(f"clawray: serving {cfg.model_cfg.path} at http://{cfg.serving_cfg.host}:"
          f"{cfg.serving_cfg.port}/v1 (Ctrl-C stops)", flush=True)
    from clawray.apps.launch import start_serving

    start_serving(cfg, blocking=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from clawray.apps.demo import run_demo

    cfg = _config(args)
    if args.model:
        cfg = cfg.copy_with(model={"path": args.model})
    if args.gate:
        from clawray.apps.gate_demo import combine, run_gate_demo

        if args.combine:
            for key, a in combine([Path(p) for p in args.combine], Path(args.out)).items():
                print(f"{key}: held-out {a['before']['mean']:.1%} → {a['after']['mean']:.1%} "
                      f"(change {a['change']['mean']:+.1%} ± {a['change']['stderr'] or 0:.1%},"
                      f" seeds {a['seeds']})")
            paired = json.loads((Path(args.out) / "gate.json").read_text())["paired"]
            for key, c in paired.items():
                d = c["difference"]
                print(f"{key}: {100 * d['mean']:+.1f} ± {100 * (d['stderr'] or 0):.1f} points "
                      f"over seeds {c['seeds']} (paired t p = "
                      f"{'n/a' if c['p_value'] is None else format(c['p_value'], '.3g')}; "
                      f"{'shown' if c['shown'] else 'not shown'})")
            return 0

        extra = {k: v for k, v in (("budget", args.budget), ("eval_n", args.eval_n))
                 if v is not None}
        return run_gate_demo(cfg, Path(args.out), args.seeds or [args.seed],
                             scenarios=tuple(args.scenarios),
                             arms=tuple(a == "gate" for a in args.arms),
                             on_reject=args.on_reject, eval_pool=args.eval_pool,
                             shadow_score=args.shadow_score, **extra)
    if args.per_user:
        from clawray.apps.per_user_demo import combine as combine_per_user
        from clawray.apps.per_user_demo import run_per_user_demo

        if args.combine:
            agg = combine_per_user([Path(p) for p in args.combine], Path(args.out))
            for name, groups in agg["paired"].items():
                print(f"{name}, rise paired by seed: " + "; ".join(
                    f"{g} {_paired_text(d)}" for g, d in groups.items() if d["difference"]))
            print(f"clawray demo --per-user: {Path(args.out) / 'per_user.json'}")
            return 0

        extra = {k: v for k, v in (("budget", args.budget), ("eval_n", args.eval_n),
                                   ("lr", args.lr), ("kl", args.kl)) if v is not None}
        return run_per_user_demo(cfg, Path(args.out), args.seeds or [args.seed],
                                 modes=tuple(args.modes), eval_pool=args.eval_pool,
                                 judge=args.judge, **extra)
    if args.combine:
        from clawray.apps.demo import combine_demo, compare_arms, print_arms, print_compared

        aggs = combine_demo([Path(p) for p in args.combine], Path(args.out))
        print_arms(aggs, Path(args.out), nested=True)
        print_compared(compare_arms(aggs))
        return 0
    if args.seeds:
        from clawray.apps.demo import run_demo_seeds

        return run_demo_seeds(cfg, Path(args.out), args.seeds, iterations=args.iterations,
                              users=args.users, judge=args.judge, lockstep=args.lockstep,
                              controls=tuple(args.controls), preference=args.preference,
                              eval_n=args.eval_n, eval_pool=args.eval_pool,
                              overrides=tuple(args.set))
    if len(args.controls) > 1:
        raise SystemExit("clawray demo: --controls with more than one arm needs --seeds")
    return run_demo(cfg, Path(args.out), iterations=args.iterations, users=args.users,
                    seed=args.seed, judge=args.judge, lockstep=args.lockstep,
                    control=args.controls[0], preference=args.preference,
                    eval_n=args.eval_n, eval_pool=args.eval_pool, overrides=tuple(args.set))


def cmd_replay(args: argparse.Namespace) -> int:
    from clawray.apps.replay import run_replay

    cfg = _config(args)
    return run_replay(cfg, records_dir=Path(args.out))


def cmd_rm_sft(args: argparse.Namespace) -> int:
    from clawray.training.rm_sft import run_rm_sft

    cfg = apply_sets(load_config(args.config), args.set).check().apply_log_level()
    _prebuild(cfg)
    result = run_rm_sft(cfg, args.policy or cfg.model_cfg.path, force=args.force,
                        n_tasks=args.tasks, max_difficulty=args.max_difficulty,
                        label_noise=args.label_noise,
                        select_every=args.select_every or None,
                        select_tasks=args.select_tasks)
    info = result.info
    print(f"clawray rm-sft: {'cached' if result.cached else 'trained'} {result.path}")
    if "selected_step" in info:
        print(f"clawray rm-sft: kept step {info['selected_step']} of {info['config']['steps']}"
              f" (best on {info['validation_steps']} validation-pool steps)")

    def rm(scored: dict) -> str:
        f = (lambda v: "-" if v is None else f"{v:.3f}")
        return (f"balanced {f(scored.get('balanced_acc'))} (p₊ {f(scored.get('plus_acc'))}, "
                f"p₋ {f(scored.get('minus_acc'))}, μ {f(scored.get('mu'))}, unparseable "
                f"{f(scored.get('unparseable'))})")

    if info.get("rm_after"):
        print(f"clawray rm-sft: on {info['rm_after']['n_steps']} test-pool steps: base "
              f"{rm(info['rm_before'])} -> {rm(info['rm_after'])}")
    if info.get("rm_last"):
        print(f"clawray rm-sft: the last step's weights would score {rm(info['rm_last'])}")
    print(f"clawray rm-sft: use it with rlanything.rm_model_path: {result.path}")
    return 0


def cmd_judge_sft(args: argparse.Namespace) -> int:
    from clawray.sim.judge_sft import EVAL_SPLITS, aggregate_builds, plot_builds, run_judge_sft

    cfg = apply_sets(load_config(args.config), args.set).check().apply_log_level()
    _prebuild(cfg)
    infos = []
    for seed in args.seeds or [cfg.sft_cfg.seed]:
        result = run_judge_sft(cfg.copy_with(sft={"seed": seed}), force=args.force,
                               n_train=args.train, n_eval=args.eval, m=args.m,
                               eval_base=not args.no_base, threads=args.threads,
                               eval_engine=args.eval_engine)
        _print_judge_build(result)
        if not result.cached:  # a fresh build's held-out evaluations go on the ledger
            from clawray import ledger
            from clawray.apps.demo import is_real_model
            from clawray.models.loader import policy_model_info
            from clawray.sim.judge_sft import ledger_lines

            ledger.record_lines(ledger_lines(result.info, policy_model_info(cfg).name
                                             if is_real_model(cfg) else "embedded"))
        infos.append(result.info)
    if args.out is not None:
        agg = aggregate_builds(infos)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "judge_builds.json").write_text(json.dumps(agg, indent=2) + "\n")
        plot_builds(agg, args.out / "judge_builds.png")
        for split in (k for k in EVAL_SPLITS if k in agg):
            pm, p, m = (agg[split][f] for f in ("balanced_acc_pm", "p_plus", "p_minus"))
            se = "" if pm["stderr"] is None else f" ± {pm['stderr']:.3f}"
            print(f"clawray judge-sft: {agg['builds']} builds, {split}: ±1 balanced accuracy "
                  f"{pm['mean']:.3f}{se} (min {pm['min']:.3f}; p+ {p['mean']:.2f}, "
                  f"p- {m['mean']:.2f}); {args.out / 'judge_builds.json'}")
            versus = agg["beside"][split].get("judge_minus_best_reply_rule")
            if versus and versus["difference"]:
                d = versus["difference"]
                se = "" if d["stderr"] is None else f" ± {d['stderr']:.3f}"
                p_value = "" if versus["p_value"] is None else f", paired p = {versus['p_value']:.2g}"
                print(f"clawray judge-sft:   minus the better reply-only rule: {d['mean']:+.3f}"
                      f"{se}{p_value}")
    return 0


def _print_judge_build(result: Any) -> None:
    from clawray.sim.judge_sft import EVAL_SPLITS

    info = result.info
    print(f"clawray judge-sft: {'cached' if result.cached else 'trained'} {result.path}")

    def line(m: dict) -> str:
        def f(x: float | None, digits: int) -> str:  # None: no example of that label
            return "-" if x is None else f"{x:.{digits}f}"
        return (f"balanced acc {f(m['balanced_acc'], 3)} (p+ {f(m['p_plus'], 2)}, p- "
                f"{f(m['p_minus'], 2)}, p0 {f(m['p_zero'], 2)})")

    for split in (k for k in EVAL_SPLITS if k in info):
        row = info[split]
        print(f"clawray judge-sft: {split} ({info['splits'][split]['phrasing']} wording, "
              f"{row['judge']['n']} examples): "
              + "; ".join(f"{who} {line(row[who])}" for who in ("heuristic", "base", "judge")
                          if who in row))
        for who, m in row["judge"].get("by_preference", {}).items():
            print(f"clawray judge-sft:   users who want {who} replies: judge {line(m)}")
        rules = row.get("reply_rules", {})
        if rules:
            print("clawray judge-sft:   rules that read only the reply: " + "; ".join(
                f"{name} ±1 balanced acc {m['balanced_acc_pm']:.3f}" for name, m in rules.items()))
    print(f"clawray judge-sft: use it with judge.backend: server, judge.model_path: {result.path}")


def cmd_sft(args: argparse.Namespace) -> int:
    from clawray.training.sft import run_sft

    cfg = apply_sets(load_config(args.config), args.set).check().apply_log_level()
    _prebuild(cfg)
    result = run_sft(cfg, force=args.force)
    info = result.info
    print(f"clawray sft: {'cached' if result.cached else 'trained'} {result.path}")
    if "success_before" in info:
        print(f"clawray sft: held-out success on {info['eval_tasks']} {info['family']} tasks "
              f"at temperature {info.get('eval_temperature', '?')}: "
              f"{info['success_before']:.1%} -> {info['success_after']:.1%} "
              f"(NLL {info['nll_first']:.3f} -> {info['nll_last']:.3f})")
    print(f"clawray sft: use it with model.path: {result.path}")
    return 0


def cmd_env_demo(args: argparse.Namespace) -> int:
    from clawray.apps.env_demo import run_env_demo

    cfg = _config(args)
    kwargs = {"iterations": args.iterations, "eval_n": args.eval_n,
              "eval_every": args.eval_every, "sets": args.set, "eval_pool": args.eval_pool}
    if args.seeds:
        from clawray.apps.env_demo import run_env_demo_seeds

        return run_env_demo_seeds(cfg, Path(args.out), args.seeds, args.sft_seed, **kwargs)
    return run_env_demo(cfg, Path(args.out), seed=args.seed, sft_seed=args.sft_seed, **kwargs)


def cmd_rla_table(args: argparse.Namespace) -> int:
    import dataclasses

    from clawray.experiments.rla_table import (SCALES, merge_tables, run_table, table_markdown,
                                        warm_starts, write_table)

    if args.merge:
        summaries = []
        for src in map(Path, args.merge):
            path = src / "rla_table.json" if src.is_dir() else src
            if not path.is_file():
                raise ConfigError(f"--merge: no rla_table.json at {src}")
            summaries.append(json.loads(path.read_text()))
        try:
            summary = merge_tables(summaries)
        except ValueError as exc:
            raise ConfigError(f"--merge: {exc}") from exc
        write_table(summary, Path(args.out))
        print(table_markdown(summary))
        print(f"clawray rla-table: {args.out}/rla_table.json, rla_table.md, rla_table.png")
        return 0
    cfg = apply_sets(load_config(args.config), args.set).check().apply_log_level()
    _prebuild(cfg)
    if args.warm_starts_only:
        policy, rm = warm_starts(cfg, args.sft_seed, args.label_noise, SCALES[args.scale])
        print(f"clawray rla-table: warm starts ready: policy {policy}, RM {rm}")
        return 0
    try:
        scale = SCALES[args.scale]
        scale = dataclasses.replace(scale, steps=args.steps or scale.steps,
                                    eval_tasks=args.eval_n or scale.eval_tasks,
                                    slots=args.slots or scale.slots,
                                    slots_per_step=(scale.slots_per_step
                                                    if args.slots_per_step is None
                                                    else args.slots_per_step))
        summary = run_table(cfg, Path(args.out), args.seeds, args.rows.split(","),
                            args.label_noise, args.sft_seed, scale, args.parallel,
                            eval_pool=args.eval_pool)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    print(table_markdown(summary))
    print(f"clawray rla-table: {args.out}/rla_table.json, rla_table.md, rla_table.png")
    return 0


def cmd_key_digest(args: argparse.Namespace) -> int:
    import hashlib

    from clawray.serve.auth import tenant_of_digest

    key = sys.stdin.readline().strip()
    if not key:
        raise ConfigError("give the key on stdin, e.g. `printenv MY_KEY | clawray key-digest`")
    digest = hashlib.sha256(key.encode()).hexdigest()
    print(f"{digest}  tenant {tenant_of_digest(digest)}")
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    """Per-user adapters on disk: list them, export one as a PEFT folder, delete one."""
    from clawray.learner.adapters import AdapterStore, export_peft, user_slug

    cfg = apply_sets(load_config(args.config), args.set)
    store = AdapterStore(args.dir or cfg.training_cfg.user_adapters_dir)
    if args.action == "list":
        users = store.users()
        for m in users:
            print(f"{m['user']}\tversion {m['version']}\trows {m['rows_trained']}\t"
                  f"{m['bytes'] / 1e6:.2f} MB")
        print(f"clawray users: {len(users)} in {store.root}")
        return 0
    if not args.user:
        raise ConfigError(f"`clawray users {args.action}` needs a user id")
    if args.action == "export":
        if not store.exists(args.user):
            raise ConfigError(f"user {args.user!r} has no adapter in {store.root}")
        out = export_peft(store, args.user, args.out or f"adapter-{user_slug(args.user)}")
        print(f"clawray users: {args.user!r}'s adapter as a PEFT folder in {out}")
        return 0
    had_adapter = store.delete(args.user)
    rows = forget_rows(cfg, args.user, args.samples, args.app)
    if not had_adapter and not rows["rows"] + rows["open_rows"]:
        raise ConfigError(f"user {args.user!r} has no adapter in {store.root} and no rows in "
                          f"the sample log ({rows['where']})")
    print(f"clawray users: {args.user!r}: "
          + ("adapter and optimizer state deleted; " if had_adapter else "no adapter; ")
          + f"{rows['rows'] + rows['open_rows']} rows forgotten in the sample log "
          f"({rows['where']}; {rows['segments']} segments rewritten, "
          f"{rows['leases_revoked']} leases revoked)")
    return 0


def join_cluster(address: str) -> None:
    """Connect to the cluster a running app is in (``auto``: the one on this machine), or a
    ConfigError that says to start the app first."""
    import ray

    from clawray.names import NAMESPACE

    if ray.is_initialized():  # (a notebook or test may hold a connection already)
        return
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=False)
    except ConnectionError as e:
        raise ConfigError(f"no Ray cluster at {address!r} ({e}): start the app first "
                          "(serve run deployments/local.yaml)") from None


def cmd_ledger(args: argparse.Namespace) -> int:
    """The ledger's figures: per experiment, arm and metric the first run of each seed."""
    from clawray import ledger

    path = Path(args.path).expanduser() if args.path else ledger.ledger_path()
    lines = ledger.read(path)
    if not lines:
        raise ConfigError(f"the ledger {path} holds no evaluation yet")
    if args.headline:  # the README's table (README.md, "Results on the ledger")
        print(ledger.headline(lines, pool=args.pool))
        return 0
    print(f"{path}: {len(lines)} evaluations; pool {args.pool}, each seed's first run "
          "(later runs counted, never averaged in)")
    print(ledger.table(lines, args.pool))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """The running app on one screen (clawray/apps/status.py); ``--json`` for scripts."""
    from clawray.apps.status import NoApp, gather, render

    join_cluster(args.address)
    try:
        st = gather(args.app)
    except NoApp as e:
        raise ConfigError(str(e)) from None
    print(json.dumps(st, indent=2, default=str) if args.json else render(st))
    return 0


def _paired_text(d: dict) -> str:
    """A paired difference (``clawray.stats.paired_difference``) as "+x ± se (p = …)"."""
    p = "n/a" if d["p_value"] is None else f"{d['p_value']:.3g}"
    se = d["difference"]["stderr"]
    return f"{d['difference']['mean']:+.1%} ± {'n/a' if se is None else f'{se:.1%}'} (p = {p})"


def cmd_gate(args: argparse.Namespace) -> int:
    """The policy gate of a running app (docs/gate.md): status, promote, reject, rollback,
    pin, unpin; through Ray (the cluster the app runs on), never through HTTP."""
    import ray

    from clawray.gate.actor import get_policy_gate

    if args.action in ("rollback", "pin") and args.version is None:
        raise ConfigError(f"`clawray gate {args.action}` needs a version (0: the base model)")
    join_cluster(args.address)
    try:
        gate = get_policy_gate(args.app)
    except ValueError:
        raise ConfigError(f"app {args.app!r} has no policy gate (gate.enabled, and a trainer "
                          "started since)") from None
    by = f"operator ({getpass.getuser()})"  # recorded with the decision
    try:
        if args.action == "status":
            out = ray.get(gate.status.remote())
        elif args.action == "events":
            out = ray.get(gate.events.remote(args.n))
        elif args.action == "promote":
            out = ray.get(gate.promote.remote(by=by))
        elif args.action == "reject":
            out = ray.get(gate.reject.remote(args.reason or "", by=by))
        elif args.action == "unpin":
            out = ray.get(gate.unpin.remote(by=by))
        else:
            out = ray.get(gate.rollback.remote(args.version, pin=args.action == "pin", by=by))
    except ray.exceptions.RayTaskError as e:
        cause = e.as_instanceof_cause()
        if isinstance(cause, ValueError):
            raise ConfigError(str(cause).splitlines()[-1]) from None
        raise
    print(json.dumps(out, indent=2, default=str))
    return 0


def forget_rows(cfg: ClawRayConfig, user: str, samples: str | None, app: str) -> dict[str, Any]:
    """Forget ``user``'s rows: through the running app's sample buffer when a Ray cluster
    with it is reachable (the actor owns the log), else in the log folder itself, which
    refuses while an app still has the log open (``buffer.core.forget_offline``)."""
    from clawray.buffer.core import BufferBusyError, forget_offline

    path = samples or cfg.buffer_cfg.path
    if samples is None:
        import ray

        from clawray.names import NAMESPACE
        from clawray.sessions.pipeline import names

        try:
            ray.init(address="auto", namespace=NAMESPACE, logging_level=logging.WARNING,
                     log_to_driver=False)
        except ConnectionError:
            pass
        else:
            try:
                buffer = ray.get_actor(names(app, cfg)["buffer"], namespace=NAMESPACE)
            except ValueError:
                buffer = None
            if buffer is not None:
                return {**ray.get(buffer.forget.remote(user)), "where": f"app {app!r}'s buffer"}
            ray.shutdown()
    if not Path(path).is_dir():
        raise ConfigError(f"no sample log at {path!r} (buffer.path, or --samples)")
    try:
        return {**forget_offline(path, user), "where": str(path)}
    except BufferBusyError as e:
        raise ConfigError(str(e)) from None


def _prebuild(cfg: ClawRayConfig) -> None:
    """Build the embedded model in this process, with progress, before replicas need it."""
    if cfg.model_cfg.path.startswith("embedded:"):
        from clawray.models.tiny import build_embedded_default

        build_embedded_default(progress=True)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["samples"]:
        from clawray.apps.samples import main as samples_main

        return samples_main(argv[1:])
    parser = argparse.ArgumentParser(prog="clawray", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build-model", help="build the embedded tiny model").set_defaults(
        fn=cmd_build_model)
    sub.add_parser("samples", help="inspect the sample log (stats, head)")
    p = sub.add_parser("model", help="bring a model: import a GGUF file or a Hugging Face "
                       "folder into a folder clawray serves and trains (import SOURCE --out "
                       "DIR), or convert a bundled one into the model cache (prepare "
                       "bundled:smollm2); prints the folder and its provenance")
    p.add_argument("action", choices=("import", "prepare"))
    p.add_argument("source", help="import: a .gguf file or a model folder; prepare: a model "
                   "name (bundled:smollm2, embedded:tiny)")
    p.add_argument("--out", help="import: the folder to write")
    p.add_argument("--chat-template", help="import: a Jinja chat template file that replaces "
                   "the model's own (kept beside it as chat_template.original.jinja), e.g. "
                   "when the model's own ignores tools")
    p.add_argument("--context", type=int, metavar="N",
                   help="import: extend the context window to N positions by YaRN RoPE scaling "
                        "(written into config.json; every engine and the learner read it; "
                        "docs/models.md says what it costs)")
    p.set_defaults(fn=cmd_model)
    p = sub.add_parser("key-digest", help="print an API key's SHA-256 digest and tenant id "
                       "(for serving.api_key_digests: a YAML that holds no key); reads the "
                       "key from stdin")
    p.set_defaults(fn=cmd_key_digest)
    p = sub.add_parser("users", help="per-user adapters on disk: list, export (PEFT), delete (the adapter and the user's rows)")
    p.add_argument("action", choices=("list", "export", "delete"))
    p.add_argument("user", nargs="?", help="the policy user (export, delete)")
    p.add_argument("--dir", help="the adapters' folder (default: training.user_adapters_dir)")
    p.add_argument("--out", help="export: the PEFT folder to write")
    p.add_argument("--samples", help="delete: the sample log folder to forget the user's rows "
                   "in, the app stopped (default: the running app's buffer if reachable, else "
                   "buffer.path)")
    p.add_argument("--app", default="clawray", help="delete: the running app's name")
    p.add_argument("-c", "--config", help="clawray YAML")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.set_defaults(fn=cmd_users)
    p = sub.add_parser("ledger", help="every held-out evaluation the tools recorded "
                       "(docs/results/ledger.jsonl): each seed's first run per experiment, arm "
                       "and metric, mean ± s.e., later runs counted")
    p.add_argument("--pool", default="test", choices=("test", "validation"))
    p.add_argument("--path", help="the ledger file (default: $CLAWRAY_LEDGER, else the "
                   "checkout's docs/results/ledger.jsonl)")
    p.add_argument("--headline", action="store_true",
                   help="the README's table: the headline experiments' arms, before, after, "
                        "change and each control against the trained arm, paired by seed")
    p.set_defaults(fn=cmd_ledger)
    p = sub.add_parser("status", help="a running app on one screen: replicas, engine, "
                       "policy versions, sessions, judge backlog, buffer, gate")
    p.add_argument("--app", default="clawray", help="the running app's name")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto, the "
                   "one on this machine)")
    p.add_argument("--json", action="store_true", help="the whole state as JSON")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("gate", help="the policy gate of a running app: status, events, "
                       "promote, reject, rollback VERSION, pin VERSION, unpin (docs/gate.md)")
    p.add_argument("action", choices=("status", "events", "promote", "reject", "rollback",
                                       "pin", "unpin"))
    p.add_argument("version", nargs="?", type=int, help="rollback/pin: a kept version (0: the "
                   "base model)")
    p.add_argument("--reason", help="reject: why (recorded in the decision log)")
    p.add_argument("-n", type=int, default=20, help="events: how many")
    p.add_argument("--app", default="clawray", help="the running app's name")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.set_defaults(fn=cmd_gate)
    p = sub.add_parser("sft", help="warm-start the policy on expert demonstrations")
    p.add_argument("-c", "--config", help="clawray YAML (environments:, sft: sections)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set sft.steps=100")
    p.add_argument("--force", action="store_true", help="retrain even if cached")
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("rm-sft", help="warm-start the step-wise reward model (RLAnything)")
    p.add_argument("-c", "--config", help="clawray YAML (environments:, sft:, rlanything:)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--policy", help="the policy whose steps are labelled (default: model.path)")
    p.add_argument("--tasks", type=int, default=200, help="tasks the policy plays")
    p.add_argument("--max-difficulty", type=float, default=0.5)
    p.add_argument("--label-noise", type=float, default=0.0,
                   help="flip this share of the oracle labels (an imperfect RM to co-train)")
    p.add_argument("--select-every", type=int, default=25,
                   help="rate the RM on validation-pool steps every N steps and keep the "
                   "best (0: train to the last step)")
    p.add_argument("--select-tasks", type=int, default=30,
                   help="validation-pool tasks whose steps rate the RM")
    p.add_argument("--force", action="store_true", help="retrain even if cached")
    p.set_defaults(fn=cmd_rm_sft)
    p = sub.add_parser("judge-sft", help="train the live loop's judge model (PRM votes) on "
                       "one wording of user feedback, test it on another")
    p.add_argument("-c", "--config", help="clawray YAML (model:, sft:)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--train", type=int, default=2000, help="training examples")
    p.add_argument("--eval", type=int, default=300, help="examples per held-out split")
    p.add_argument("--m", type=int, default=3, help="votes per example in the evaluation")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the build (part of its cache key; 1 by default, so "
                   "a build is the same on any machine)")
    p.add_argument("--eval-engine", default="hf", choices=("hf", "vllm", "auto"),
                   help="the engine that samples the held-out votes (hf starts in seconds; "
                   "vllm is faster on a real model's long prompts)")
    p.add_argument("--no-base", action="store_true",
                   help="do not evaluate the model the judge starts from")
    p.add_argument("--force", action="store_true", help="retrain even if cached")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="build one judge per training seed (sft.seed)")
    p.add_argument("--out", type=Path, default=None,
                   help="write judge_builds.json: each build's held-out figures, mean ± s.e.")
    p.set_defaults(fn=cmd_judge_sft)
    from clawray.experiments.rla_table import RM_LABEL_NOISE, ROWS, SCALES

    p = sub.add_parser("rla-table", help="RLAnything's Table 1 on household tasks")
    p.add_argument("-c", "--config", help="clawray YAML (model:, inference: ...)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", default="rla-table-output", help="where results go")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="RL seeds")
    p.add_argument("--scale", choices=list(SCALES), default="full",
                   help="full: the measured table (~17 min per seed on 2 cores); small: short "
                        "warm starts, 2 steps, small evaluations (a few minutes); tiny: the "
                        "machinery only, from 20-step warm starts (what CI runs)")
    p.add_argument("--steps", type=int, help="RLAnything steps per row (default: the scale's)")
    p.add_argument("--rows", default=",".join(ROWS), help="rows, comma-separated")
    p.add_argument("--eval-n", type=int,
                   help="held-out tasks, x2 episodes (default: the scale's)")
    p.add_argument("--slots", type=int, help="the adapter's task slots (default: the scale's)")
    p.add_argument("--slots-per-step", type=int,
                   help="slots played per step, in turn (0: all; default: the scale's)")
    p.add_argument("--label-noise", type=float, default=RM_LABEL_NOISE,
                   help="share of flipped labels in the RM's warm start")
    p.add_argument("--sft-seed", type=int, default=0, help="seed of both warm starts")
    p.add_argument("--warm-starts-only", action="store_true",
                   help="build (or find cached) the scale's warm starts, print them, stop")
    p.add_argument("--eval-pool", default="test", choices=["validation", "test"],
                   help="held-out tasks and RM steps: 'validation' to choose settings, 'test' "
                        "to report")
    p.add_argument("--parallel", action="store_true",
                   help="run a seed's rows at once on one cluster (default: one after another, "
                        "each on its own)")
    p.add_argument("--merge", nargs="+", metavar="RESULT",
                   help="run nothing: merge earlier results (folders or rla_table.json files "
                        "of other rows or seeds, same warm starts, evaluation and scale) into "
                        "one table in --out")
    p.set_defaults(fn=cmd_rla_table)
    for name, fn, help_ in (("serve", cmd_serve, "serve the policy model"),
                            ("demo", cmd_demo, "serve + train from simulated users"),
                            ("replay", cmd_replay, "serve + replay an OpenClaw session"),
                            ("env-demo", cmd_env_demo, "sft + GRPO on household tasks")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("-c", "--config", help="clawray YAML config")
        p.add_argument("--port", type=int, help="HTTP port (default from config: 8000)")
        if name in ("demo", "replay", "env-demo"):
            p.add_argument("--out", default=f"{name}-output", help="where results go")
        if name == "env-demo":
            from clawray.apps.env_demo import EVAL_N, ITERATIONS as ENV_ITERATIONS

            p.add_argument("--iterations", type=int, default=ENV_ITERATIONS)
            p.add_argument("--eval-n", type=int, default=EVAL_N)
            p.add_argument("--eval-every", type=int, default=10)
            p.add_argument("--eval-pool", default="test", choices=["validation", "test"],
                           help="held-out tasks: 'validation' to choose settings, 'test' to "
                                "report (pools disjoint by content: clawray.envs.task_pool)")
            p.add_argument("--seed", type=int, default=0, help="seed of the RL run")
            p.add_argument("--seeds", type=int, nargs="+",
                           help="one run per seed (OUT/seed<k>), then their summary")
            p.add_argument("--sft-seed", type=int, default=None,
                           help="seed of the warm start (default: --seed)")
            p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                           help="override one of the demo's settings, e.g. training.lr=1e-4 "
                                "(repeatable)")
        if name == "demo":
            from clawray.apps.demo import CONTROLS as DEMO_CONTROLS, ITERATIONS, JUDGE, SEED, USERS
            from clawray.sim.preferences import PREFERENCES

            p.add_argument("--model", help="the policy model (model.path): embedded:tiny "
                           "(default), bundled:smollm2 or a Hugging Face folder; a real model "
                           "trains LoRA adapters with its own demo settings (docs/models.md)")
            p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                           help="override one of the demo's settings, applied last, e.g. "
                                "training.lora_rank=0 (repeatable)")
            p.add_argument("--iterations", type=int, default=ITERATIONS)
            p.add_argument("--users", type=int,
                           help=f"simulated users (default {USERS}; a real model: 4)")
            p.add_argument("--seed", type=int, default=SEED)
            p.add_argument("--judge", choices=("model", "heuristic"), default=JUDGE,
                           help="heuristic (default): the keyword rule judge, which reads "
                           "only the user's next message (the users speak its keywords); "
                           "model: the judge model of clawray judge-sft on a JudgeServer "
                           "(built once and cached: ~25 min on 2 cores for the embedded "
                           "model, which does not learn to read feedback; ~17 min by LoRA "
                           "for a real model: docs/training.md)")
            p.add_argument("--preference", choices=sorted(PREFERENCES),
                           help="what the simulated users want (their hidden preference; "
                           "default brief, for a real model concise)")
            p.add_argument("--lockstep", action="store_true",
                           help="the users play one session each, the trainer trains on "
                           "exactly those turns, and again: a run repeatable for its seed "
                           "(the live default chats while training runs)")
            p.add_argument("--controls", nargs="+", default=["none"], choices=DEMO_CONTROLS,
                           help="the arms to run: none (trained), shuffled_feedback (the "
                           "judge reads another turn's next state), reply_hidden (the judge "
                           "sees no reply), no_training (--lockstep: the rounds, no updates); "
                           "with --seeds each arm runs every seed and OUT/demo_arms.json "
                           "compares them")
            p.add_argument("--seeds", type=int, nargs="+",
                           help="one run per seed (OUT/seed<k>, fresh weights each), then "
                                "their mean ± standard error (OUT/demo_seeds.json, .png)")
            p.add_argument("--per-user", action="store_true",
                           help="two groups of users who want opposite things: one shared "
                                "policy against a LoRA adapter per user (docs/per_user.md)")
            p.add_argument("--gate", action="store_true",
                           help="the policy gate against a poisoned judge and on a healthy "
                                "run, each with and without the gate (docs/gate.md)")
            p.add_argument("--scenarios", nargs="+", default=["poisoned", "healthy"],
                           choices=["poisoned", "healthy"], help="--gate: which to run")
            p.add_argument("--arms", nargs="+", default=["nogate", "gate"],
                           choices=["nogate", "gate"], help="--gate: without / with the gate")
            p.add_argument("--combine", nargs="+", metavar="DIR",
                           help="combine runs made one by one (their --out folders; also with "
                                "--gate, --per-user) into OUT's aggregate and plot")
            p.add_argument("--on-reject", default="restart", choices=["restart", "keep_line"],
                           help="--gate: a rejected candidate abandons its line (restart) or "
                                "the trainer's line goes on (keep_line)")
            p.add_argument("--shadow-score", default="feedback",
                           choices=["feedback", "preference"],
                           help="--gate: score shadow replies with a scorer fitted on the "
                                "users' held-out explicit ratings (what an operator has), or "
                                "with their hidden preference (an oracle)")
            p.add_argument("--modes", nargs="+",
                           default=["shared", "per_user", "per_user_shuffled"],
                           choices=["shared", "per_user", "per_user_shuffled",
                                    "per_user_hidden", "per_user_frozen"],
                           help="--per-user: which to run (per_user_shuffled: the control, "
                                "adapters per user judged on other turns' feedback; "
                                "per_user_hidden: judged with the reply hidden; "
                                "per_user_frozen: training off, measured twice)")
            p.add_argument("--budget", type=int, help="--per-user, --gate: rows trained per run")
            p.add_argument("--eval-n", type=int, help="held-out evaluation requests (per user "
                           "with --per-user)")
            p.add_argument("--eval-pool", default="test", choices=["validation", "test"],
                           help="the evaluation's prompt pool: 'validation' to choose "
                                "settings, 'test' to report")
            p.add_argument("--lr", type=float, help="--per-user: the LoRA learning rate")
            p.add_argument("--kl", type=float, help="--per-user: the k3 KL weight to the base")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"clawray: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
