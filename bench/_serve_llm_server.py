"""Hosts Ray Serve LLM (``ray.serve.llm``, vLLM inside a Serve deployment) on a fresh local
Ray cluster for ``bench/engines.py``: what a Ray user would run instead of clawray.

    python bench/_serve_llm_server.py --port 8123 --model /path --engine-kwargs '{...}'

Once the app answers it prints one JSON line (its URL) and serves until its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import httpx


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True, help="local model folder")
    p.add_argument("--served-name", default="clawray-tiny")
    p.add_argument("--engine-kwargs", default="{}", help="vLLM engine arguments as JSON")
    p.add_argument("--num-cpus", type=int, default=4)
    p.add_argument("--replica-cpus", type=int, default=1, help="CPUs of the vLLM replica")
    p.add_argument("--replica-gpus", type=int, default=0, help="GPUs of the vLLM replica")
    args = p.parse_args(argv)

    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from clawray.apps.launch import init_local_ray

    init_local_ray(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                   logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        config = LLMConfig(
            model_loading_config={"model_id": args.served_name, "model_source": args.model},
            engine_kwargs=json.loads(args.engine_kwargs),
            deployment_config={"num_replicas": 1},
            placement_group_config={"bundles": [{"CPU": args.replica_cpus,
                                                  **({"GPU": args.replica_gpus}
                                                     if args.replica_gpus else {})}]},
        )
        serve.run(build_openai_app({"llm_configs": [config]}), name="llm", route_prefix="/")
        url = f"http://127.0.0.1:{args.port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(json.dumps({"url": url, "ray_version": ray.__version__}), flush=True)
        sys.stdin.read()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
