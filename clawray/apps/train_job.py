"""``python -m clawray.train``: the training job (the ``ray job submit`` entry point).

    ray start --head
    serve run deployments/local.yaml &              # the app users talk to
    ray job submit -- python -m clawray.train --config deployments/local.yaml --iterations 100

It joins the running Ray cluster (or starts a local one), attaches to the Serve app named
``training.app`` (starting it when absent), and trains from the app's sample buffer, pushing
weights to its replicas after every update. A progress bar shows step, samples, reward, loss
and policy version; every iteration is also a JSONL line (``training.metrics_path``) and Ray
metrics (``clawray_train_*``). ``--config`` takes a clawray YAML file or a Serve config file
whose application args are a clawray config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from clawray.config import ConfigError, apply_sets, load_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clawray.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", help="clawray YAML, or a Serve config file")
    p.add_argument("--app", help="Serve application to train (default: training.app)")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else "
                   "a cluster started with `ray start`, else a new local one)")
    p.add_argument("--num-cpus", type=float, default=None,
                   help="logical CPUs of the local cluster started when none runs (default: "
                        "the cores); the actors mostly wait on each other, so a small machine "
                        "can offer more than it has")
    p.add_argument("--restore", help="checkpoint folder to resume from")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set training.lr=1e-4")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.app)
        if args.app:
            cfg.training(app=args.app)
        cfg = apply_sets(cfg, args.set)
        saved_curriculum = Path(args.restore or "", "curriculum.json")
        if args.restore and saved_curriculum.is_file() and not cfg.curriculum_cfg.checkpoint_path:
            cfg.curriculum(checkpoint_path=str(saved_curriculum))
        cfg.check().apply_log_level()
    except ConfigError as e:
        print(f"clawray.train: {e}", file=sys.stderr)
        return 2

    # Imported once the config is known good: a bad flag or config answers without the
    # seconds that Ray, Tune and torch take to import.
    import ray

    from clawray.training.trainer import Trainer

    if not ray.is_initialized():
        refused = connect(args.address, args.num_cpus, cfg)
        if refused:
            print(f"clawray.train: {refused}", file=sys.stderr)
            return 2
    trainer = Trainer(config=cfg.to_dict())
    try:
        if args.restore:
            trainer.restore(args.restore)
        results = trainer.fit(args.iterations)
        last = results[-1] if results else {}
        print(f"clawray.train: {len(results)} iterations, policy version "
              f"{last.get('policy_version')}, metrics in {trainer.metrics_path}")
    finally:
        trainer.stop()
    return 0


def connect(address: str | None, num_cpus: float | None, cfg: Any) -> str | None:
    """Join the Ray cluster to train in: ``address``, else ``RAY_ADDRESS``, else the cluster
    running on this machine (``ray start``, or the one ``serve run`` started: Ray finds it by
    its processes), else a new local one. Returns why it refuses instead: no cluster was
    found, yet something answers on the app's port, so the app runs where this job cannot
    reach it (another user's cluster, another machine's port forward); training here would
    start a second app and train a model nobody talks to."""
    import functools
    import socket

    import ray

    init = functools.partial(ray.init, include_dashboard=False, log_to_driver=False)
    if address or os.environ.get("RAY_ADDRESS"):
        init(address=address)
        return None
    try:
        init(address="auto")
        return None
    except ConnectionError:
        pass  # no cluster on this machine (or several: then say which with --address)
    host, port = cfg.serving_cfg.host, cfg.serving_cfg.port
    probe = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        with socket.create_connection((probe, port), timeout=1.0):
            pass
    except OSError:
        init(num_cpus=num_cpus)
        return None
    return (f"something already answers on {probe}:{port} (the app's port), but no Ray "
            "cluster was found on this machine to join: pass the app's cluster with --address "
            "(or RAY_ADDRESS), or submit the job to it (`ray job submit -- python -m "
            "clawray.train -c CONFIG`); to run a new app here, set serving.port to a free port")


if __name__ == "__main__":
    sys.exit(main())
