"""Train the difficulty classifier: `python -m router.train [--data FILE.jsonl] [--out PATH]`.

Embeds the labeled set with the same MiniLM the ingress uses, fits logistic regression on the
`train` split, reports accuracy on both splits and writes the weights (a small JSON file that
ships in the repo). With `--data`, trains on your own JSONL lines `{"text", "label"}` (label
"easy" or "hard", optional "split": "train"|"test"; without one, every fifth line is held out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from router.classifier import DEFAULT_WEIGHTS, DifficultyClassifier
from router.dataset import Example, examples, fingerprint


def load_jsonl(path: Path) -> list[Example]:
    out = []
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("label") not in ("easy", "hard") or not isinstance(row.get("text"), str):
            raise SystemExit(f"{path}:{n + 1}: needs a string `text` and `label` 'easy' or 'hard'")
        split = row.get("split") or ("test" if n % 5 == 4 else "train")
        out.append(Example(row["text"], row["label"], row.get("category", "custom"), split))
    return out


def accuracy(model: DifficultyClassifier, vectors: np.ndarray, hard: np.ndarray, threshold: float = 0.5) -> float:
    return float(np.mean((model.p_hard_many(vectors) >= threshold) == hard)) if len(hard) else float("nan")


def train(data: list[Example], l2: float = 1.0, embedder=None) -> tuple[DifficultyClassifier, dict]:
    from semantic_cache.embedder import Embedder

    embedder = embedder or Embedder()
    t = time.perf_counter()
    vectors = embedder.embed_many([e.text for e in data])
    print(f"embedded {len(data)} requests in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    hard = np.array([e.hard for e in data])
    train_mask = np.array([e.split == "train" for e in data])
    model = DifficultyClassifier.fit(vectors[train_mask], hard[train_mask], l2=l2)
    report = {
        "train_examples": int(train_mask.sum()),
        "test_examples": int((~train_mask).sum()),
        "train_accuracy": round(accuracy(model, vectors[train_mask], hard[train_mask]), 4),
        "test_accuracy": round(accuracy(model, vectors[~train_mask], hard[~train_mask]), 4),
        "l2": l2,
        "embedder": "all-MiniLM-L6-v2",
    }
    return model, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.train", description=__doc__)
    parser.add_argument("--data", type=Path, help="labeled JSONL (default: the shipped set, router/dataset.py)")
    parser.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS)
    parser.add_argument("--l2", type=float, default=1.0, help="L2 penalty (higher: smoother, less overfit)")
    args = parser.parse_args(argv)
    data = load_jsonl(args.data) if args.data else examples()
    model, report = train(data, args.l2)
    model.meta = {**report, "dataset": str(args.data) if args.data else f"router/dataset.py@{fingerprint()}"}
    model.save(args.out)
    print(json.dumps(report, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
