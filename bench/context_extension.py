"""What a context extension costs: a model against its YaRN-extended import, token by token.

``clawray model import MODEL --out DIR --context N`` extends a model's window by YaRN RoPE
scaling (clawray/models/importer.py). This measures, on one long English text, the mean
negative log-likelihood per token (nats; perplexity is its exp) by position bucket:

- ``original``: the model as trained, on the first ``original positions`` tokens (its window);
- ``extended``: the YaRN import, on all ``--tokens`` tokens: inside the original window (the
  cost of the scaling where the original works) and beyond it (what the extension buys);
- ``unscaled`` (``--unscaled``): the original RoPE run past its window, for comparison: what
  serving a longer prompt without any scaling would do.

The text (``--text``, default: this project's README and docs/*.md joined, ~50k tokens) is
never trained on by either model. Usage::

    .venv/bin/python bench/context_extension.py --model bundled:smollm2 --context 16384 \\
        --tokens 16384 --unscaled --out bench/results/context_extension-smollm2.json

Writes the JSON (settings, per-bucket NLL per arm, the differences) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def default_text() -> str:
    parts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n\n".join(p.read_text() for p in parts)


def token_nll(model, ids, chunk: int = 1024) -> list[float]:
    """NLL of each token given the ones before it (the first token has none), computing the
    vocabulary projection a chunk of positions at a time (a 16k x 49k logit matrix would take
    3 GB)."""
    import torch

    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        out = []
        for start in range(0, len(ids) - 1, chunk):
            h = hidden[start:min(start + chunk, len(ids) - 1)]
            logp = torch.log_softmax(model.lm_head(h).float(), -1)
            target = torch.tensor(ids[start + 1:start + 1 + len(h)])
            out += (-logp.gather(-1, target[:, None])[:, 0]).tolist()
    return out


def buckets(nll: list[float], size: int) -> list[dict]:
    """Mean NLL per bucket of ``size`` predicted positions (position i predicts token i+1)."""
    return [{"from": k, "to": min(k + size, len(nll)),
             "nll": sum(nll[k:k + size]) / len(nll[k:k + size])}
            for k in range(0, len(nll), size)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:smollm2")
    ap.add_argument("--context", type=int, default=16384, help="the extended window")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the text measured")
    ap.add_argument("--bucket", type=int, default=1024)
    ap.add_argument("--text", help="a text file (default: README.md and docs/*.md)")
    ap.add_argument("--unscaled", action="store_true",
                    help="also run the original RoPE past its window")
    ap.add_argument("--out", required=True, help="the results JSON (a PNG goes beside it)")
    args = ap.parse_args()

    import torch

    from clawray.models.importer import import_model, provenance
    from clawray.models.loader import load_model, load_tokenizer, resolve_model_path

    torch.set_num_threads(max(1, torch.get_num_threads()))
    original_path = resolve_model_path(args.model)
    text = Path(args.text).read_text() if args.text else default_text()
    tok = load_tokenizer(original_path)
    ids = tok(text, add_special_tokens=False)["input_ids"][:args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    result = {"model": args.model, "text": args.text or "README.md + docs/*.md",
              "tokens": len(ids), "bucket": args.bucket, "torch": torch.__version__,
              "machine": platform.machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                       time.gmtime()),
              "arms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        extended_path = import_model(original_path, Path(tmp) / "extended", context=args.context)
        ext = provenance(extended_path)["context_extension"]
        result["extension"] = ext
        window = ext["original_positions"]
        arms = [("original", original_path, ids[:window]), ("extended", extended_path, ids)]
        if args.unscaled:
            arms.append(("unscaled", original_path, ids))
        for name, path, seq in arms:
            t0 = time.perf_counter()
            model = load_model(path).eval()
            nll = token_nll(model, seq)
            del model
            result["arms"][name] = {"positions": len(seq), "mean_nll": sum(nll) / len(nll),
                                    "buckets": buckets(nll, args.bucket),
                                    "seconds": round(time.perf_counter() - t0, 1)}
            print(f"{name}: {len(seq)} tokens, mean NLL {sum(nll) / len(nll):.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    o, e = result["arms"]["original"], result["arms"]["extended"]
    inside = [b for b in e["buckets"] if b["to"] <= window]
    result["inside_window"] = {
        "original_nll": o["mean_nll"],
        "extended_nll": sum(b["nll"] * (b["to"] - b["from"]) for b in inside)
        / sum(b["to"] - b["from"] for b in inside)}
    result["inside_window"]["extended_minus_original"] = (
        result["inside_window"]["extended_nll"] - o["mean_nll"])
    beyond = [b for b in e["buckets"] if b["from"] >= window]
    if beyond:
        result["beyond_window"] = {"extended_nll": sum(b["nll"] for b in beyond) / len(beyond)}
        if "unscaled" in result["arms"]:
            ub = [b for b in result["arms"]["unscaled"]["buckets"] if b["from"] >= window]
            result["beyond_window"]["unscaled_nll"] = sum(b["nll"] for b in ub) / len(ub)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("inside_window", "beyond_window")
                      if k in result}, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, color in (("original", "tab:blue"), ("extended", "tab:green"),
                        ("unscaled", "tab:red")):
        arm = result["arms"].get(name)
        if arm:
            xs = [(b["from"] + b["to"]) / 2 for b in arm["buckets"]]
            ax.plot(xs, [b["nll"] for b in arm["buckets"]], "o-", color=color, label=name)
    ax.axvline(result["extension"]["original_positions"], color="grey", ls=":",
               label="original window")
    ax.set(xlabel="position in the text (tokens)", ylabel="mean NLL per token (nats)",
           title=f"{result['model']}: YaRN x{result['extension']['factor']:g} "
                 f"({result['extension']['positions']} positions)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
