"""Prompt sets for the speculative-decoding benchmark: chat, RAG, code edit, adversarial."""

from __future__ import annotations

DOCS = [
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
    "reefs and 900 islands stretching for over 2,300 kilometres. It is located in the Coral Sea, off the coast "
    "of Queensland, Australia. The reef can be seen from outer space and is the world's biggest single "
    "structure made by living organisms.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to produce "
    "glucose and oxygen. It takes place mainly in the chloroplasts of leaf cells, which contain the pigment "
    "chlorophyll. The light-dependent reactions happen in the thylakoid membranes, and the Calvin cycle "
    "happens in the stroma.",
    "The Python programming language was created by Guido van Rossum and first released in 1991. Python "
    "emphasizes code readability with significant indentation. It supports multiple programming paradigms, "
    "including structured, object-oriented and functional programming, and has a large standard library.",
]
RAG_QUESTIONS = [
    "Where is the Great Barrier Reef located and how large is it? Answer using the context's own words.",
    "Where does photosynthesis take place? Quote the relevant sentences from the context.",
    "Who created Python and what does it emphasize? Repeat the key facts from the context.",
]

CODE = [
    (
        "Rename the function `add` to `add_numbers` and return the whole file.",
        "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n\n\n"
        "def multiply(a, b):\n    return a * b\n\n\nprint(add(2, 3))\n",
    ),
    (
        "Fix the bug in `average` and return the complete corrected code.",
        "def total(values):\n    result = 0\n    for v in values:\n        result += v\n    return result\n\n\n"
        "def average(values):\n    return total(values) * len(values)\n\n\nprint(average([1, 2, 3]))\n",
    ),
    (
        "Add a docstring to the class and return the full code.",
        "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
        "        self.count += 1\n        return self.count\n\n    def reset(self):\n        self.count = 0\n",
    ),
]

CHAT = [
    "Give me three tips for a good night's sleep.",
    "Explain in simple terms what a neural network is.",
    "Write a short friendly email inviting a colleague to lunch.",
]

# Drafts mostly fail here: random, non-repeating output defeats prompt lookup (measured:
# 0-27% of its guesses accepted), and near-ties are where a quantized draft disagrees most.
ADVERSARIAL = [
    "Output a random sequence of 40 lowercase letters with no spaces.",
    "List 20 random integers between 1000 and 9999.",
    "Translate 'good morning, how are you' into ten different languages.",
]


def conversations() -> dict[str, list[list[dict[str, str]]]]:
    rag = [
        [
            {"role": "system", "content": "Answer only from the context. Quote it where possible."},
            {"role": "user", "content": f"Context:\n{doc}\n\nQuestion: {q}"},
        ]
        for doc, q in zip(DOCS, RAG_QUESTIONS)
    ]
    code = [[{"role": "user", "content": f"{task}\n\n```python\n{src}```"}] for task, src in CODE]
    chat = [[{"role": "user", "content": q}] for q in CHAT]
    adversarial = [[{"role": "user", "content": q}] for q in ADVERSARIAL]
    return {"chat": chat, "rag": rag, "code_edit": code, "adversarial": adversarial}
