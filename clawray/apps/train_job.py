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
import sys
from pathlib import Path

from clawray.config import ConfigError, apply_sets, load_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clawray.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", help="clawray YAML, or a Serve config file")
    p.add_argument("--app", help="Serve application to train (default: training.app)")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--address", default=None, help="Ray address (default: the running "
                   "cluster if there is one, else a local one)")
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
        cfg.check()
    except ConfigError as e:
        print(f"clawray.train: {e}", file=sys.stderr)
        return 2

    # Imported once the config is known good: a bad flag or config answers without the
    # seconds that Ray, Tune and torch take to import.
    import ray

    from clawray.training.trainer import Trainer

    if not ray.is_initialized():
        ray.init(address=args.address, num_cpus=args.num_cpus, include_dashboard=False,
                 log_to_driver=False)
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


if __name__ == "__main__":
    sys.exit(main())
