"""Difficulty classifier: logistic regression on the request's MiniLM embedding.

Scoring is one 384-wide dot product (a few microseconds), so routing adds nothing measurable
beyond the embedding the cache computes anyway. Fitting is Newton's method with an L2 penalty:
a few hundred examples converge in under ten steps, no ML framework needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_WEIGHTS = Path(__file__).parent / "weights" / "difficulty.json"


@dataclass
class DifficultyClassifier:
    weights: np.ndarray  # (dimensions,) float64
    bias: float
    meta: dict[str, Any] = field(default_factory=dict)  # what it was trained on, and how well it did

    def p_hard(self, vector: np.ndarray) -> float:
        """Probability that the request needs the large model."""
        z = float(np.dot(self.weights, vector)) + self.bias
        return 1.0 / (1.0 + np.exp(-z)) if z > -500 else 0.0

    def p_hard_many(self, vectors: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(vectors @ self.weights + self.bias)))

    @classmethod
    def fit(cls, vectors: np.ndarray, hard: np.ndarray, l2: float = 1.0, steps: int = 25) -> "DifficultyClassifier":
        """L2-regularised logistic regression with classes weighted to equal total mass."""
        x = np.hstack([vectors.astype(np.float64), np.ones((len(vectors), 1))])
        y = hard.astype(np.float64)
        pos = max(1.0, y.sum())
        neg = max(1.0, len(y) - y.sum())
        sample_w = np.where(y > 0, len(y) / (2 * pos), len(y) / (2 * neg))
        penalty = np.full(x.shape[1], l2)
        penalty[-1] = 0.0  # the bias is not shrunk
        theta = np.zeros(x.shape[1])
        for _ in range(steps):
            p = 1.0 / (1.0 + np.exp(-(x @ theta)))
            grad = x.T @ (sample_w * (p - y)) + penalty * theta
            hess = (x * (sample_w * p * (1 - p))[:, None]).T @ x + np.diag(penalty) + 1e-9 * np.eye(x.shape[1])
            delta = np.linalg.solve(hess, grad)
            theta -= delta
            if np.max(np.abs(delta)) < 1e-8:
                break
        return cls(theta[:-1].copy(), float(theta[-1]))

    def save(self, path: Path = DEFAULT_WEIGHTS) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"meta": self.meta, "bias": round(self.bias, 8), "weights": [round(float(w), 8) for w in self.weights]}
        path.write_text(json.dumps(body, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path | None = None) -> "DifficultyClassifier":
        path = Path(path) if path else DEFAULT_WEIGHTS
        if not path.exists():
            raise FileNotFoundError(f"router weights not found at {path}; train them with `python -m router.train`")
        body = json.loads(path.read_text())
        return cls(np.asarray(body["weights"], dtype=np.float32), float(body["bias"]), body.get("meta", {}))
