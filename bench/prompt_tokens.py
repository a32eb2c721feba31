"""Prompt tokenization of OpenClaw's captured requests: a whole-text encode (the baseline)
against clawray's segment cache (``clawray/models/segment_cache.py``), in the same run.

```bash
.venv/bin/python bench/prompt_tokens.py            # ~20 s; writes bench/results/prompt_tokens.json
```

Each OpenClaw fixture is rendered with the embedded model's chat template once, then encoded
``--repeats`` times by each method (the cache warm after its first pass over the session, as
on a live server); the ids of both methods are checked equal. Reported per fixture: median
milliseconds per encode, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=str(BENCH / "results" / "prompt_tokens.json"))
    args = p.parse_args(argv)

    from clawray.models.loader import load_tokenizer, policy_model_info
    from clawray.config import ClawRayConfig
    from clawray.models.segment_cache import SegmentCache
    from clawray.serve.protocol import ChatCompletionRequest, normalize_messages, normalize_tools
    from tests.support.common import FIXTURES

    tok = load_tokenizer(policy_model_info(ClawRayConfig()).path)
    cache = SegmentCache(tok)
    assert cache.enabled, cache.reason
    rows = []
    for path in sorted(FIXTURES.glob("session_*.json")):
        req = ChatCompletionRequest(**json.loads(path.read_text())["body"])
        text = tok.apply_chat_template(normalize_messages(req.messages),
                                       tools=normalize_tools(req.tools),
                                       add_generation_prompt=True, tokenize=False)
        whole_ids = tok.encode(text, add_special_tokens=False)
        assert cache.encode(text) == whole_ids, path.name  # also warms the cache
        timings = {}
        for name, fn in (("whole", lambda: tok.encode(text, add_special_tokens=False)),
                         ("segment_cache", lambda: cache.encode(text))):
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
            timings[name] = statistics.median(runs) * 1e3
        rows.append({"fixture": path.stem, "bytes": len(text.encode()), "tokens": len(whole_ids),
                     "whole_ms": timings["whole"], "cached_ms": timings["segment_cache"],
                     "speedup": timings["whole"] / timings["segment_cache"]})
        print(f"{path.stem:<22} {len(whole_ids):>6} tokens  whole {timings['whole']:7.2f} ms  "
              f"cached {timings['segment_cache']:6.3f} ms  x{rows[-1]['speedup']:.0f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]),
                               "repeats": args.repeats, "rows": rows,
                               "cache": cache.stats()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
