"""The router's labeled set: requests the small model answers well ("easy") and ones that need
the large model ("hard"). Built by hand for this project and shipped; `python -m router.train`
fits the classifier on the `train` split and `python -m bench route` reports on `test`.

A label is the *task*, not the topic: "What is a hash table?" is easy, "Implement a hash table
with open addressing" is hard. Topics are shared across both classes on purpose, so the
classifier has to learn the kind of work asked for. Easy: lookups, definitions, small talk,
one-step conversions and arithmetic, short lists, word-level edits and translations,
sentiment. Hard: writing or fixing code, multi-step math and proofs, analysis and comparison
with trade-offs, plans, system design, logic puzzles, long constrained writing.

Held out by *template*: in every category one template of four (and every other hand-written
request) is only in `test`, so the score measures new phrasings, not memorized ones. To route
on your own traffic, write labeled JSONL (`{"text": ..., "label": "easy"|"hard"}`) and pass
it to `python -m router.train --data FILE`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import cycle, islice
from typing import Literal

Label = Literal["easy", "hard"]
Split = Literal["train", "test", "all"]

COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "India", "Egypt", "Peru", "Vietnam"]
TERMS = ["a hash table", "photosynthesis", "inflation", "a neural network", "a binary search tree", "DNS",
         "a mortgage", "entropy", "a vaccine", "recursion", "an index fund", "a mutex"]
WORDS = ["ubiquitous", "ephemeral", "pragmatic", "serendipity", "candid", "meticulous", "resilient", "obscure"]
ANIMALS = ["octopuses", "penguins", "elephants", "owls", "dolphins", "bees", "cats", "sloths"]
UNITS = [("5", "kilometers", "miles"), ("12", "inches", "centimeters"), ("3", "liters", "cups"),
         ("100", "Fahrenheit", "Celsius"), ("2", "pounds", "kilograms"), ("90", "minutes", "hours")]
PHRASES = ["good morning", "thank you", "where is the train station", "I am hungry", "see you tomorrow", "how much"]
LANGS = ["Spanish", "French", "German", "Italian", "Japanese", "Portuguese"]
LIST_OF = ["fruits", "primary colors", "planets", "programming languages", "dog breeds", "musical instruments",
           "European capitals", "noble gases"]
REVIEWS = ["The food was cold and the waiter was rude.", "Absolutely loved it, will come back!",
           "Battery died after two days.", "Great value for the price.", "The plot was boring and too long.",
           "Fast shipping and works perfectly."]
ADJECTIVES = ["happy", "fast", "bright", "ancient", "generous", "fragile", "loud", "narrow"]
BOOKS = ["Pride and Prejudice", "1984", "Don Quixote", "Hamlet", "The Odyssey", "War and Peace"]
TYPOS = ["I recieved the pakage yesterday.", "Their going to the libary.", "She dont like brocoli.",
         "We was very exited.", "The wether is beautifull today."]
CODE_TASKS = ["parses a CSV file and returns the average of each numeric column",
              "finds the longest palindromic substring of a string",
              "merges overlapping intervals in a list",
              "implements an LRU cache with O(1) get and put",
              "validates an email address and explains each rule",
              "computes the shortest path in a weighted graph with Dijkstra's algorithm",
              "rate-limits calls with a token bucket",
              "serializes a binary tree to a string and back"]
LANGUAGES = ["Python", "Rust", "Go", "TypeScript", "Java", "C++"]
BUGS = [("IndexError", "for i in range(len(xs) + 1): total += xs[i]"),
        ("KeyError", "counts = {}\nfor w in words: counts[w] += 1"),
        ("a race condition", "if not os.path.exists(p): os.makedirs(p)"),
        ("an infinite loop", "while lo < hi: mid = (lo + hi) // 2; lo = mid"),
        ("a memory leak", "cache = []\ndef handle(req): cache.append(req.body)"),
        ("wrong results", "def mean(xs): return sum(xs) / len(xs) - 1")]
STATEMENTS = ["the square root of 2 is irrational", "there are infinitely many primes",
              "the sum of the first n odd numbers is n squared", "every tree with n nodes has n-1 edges",
              "the angles of a triangle sum to 180 degrees", "a bounded monotone sequence converges"]
WORD_PROBLEMS = ["a train leaves at 3pm at 80 km/h and a second leaves at 4pm at 100 km/h; when does the second catch up",
                 "a tank fills in 6 hours with pipe A and 4 hours with pipe B, and drains in 12 hours; how long to fill it",
                 "I invest $5,000 at 4% compounded monthly and add $200 a month; what do I have after 10 years",
                 "three workers paint a house in 8 days; how long do 5 workers take if one quits after 2 days",
                 "how many ways can 8 people sit at a round table if two of them refuse to sit together"]
PAIRS = [("PostgreSQL", "MongoDB"), ("microservices", "a monolith"), ("renting", "buying a home"),
         ("React", "Vue"), ("nuclear power", "solar power"), ("index funds", "picking individual stocks"),
         ("TCP", "UDP"), ("remote work", "office work")]
EVENTS = ["the 2008 financial crisis", "the fall of the Roman Empire", "the industrial revolution",
          "the Cuban missile crisis", "the dot-com bubble", "the printing press"]
CITIES = ["Tokyo", "Lisbon", "Mexico City", "Istanbul", "Vancouver", "Cape Town", "Rome", "Seoul"]
GOALS = ["running a first marathon", "learning conversational Spanish", "passing a calculus exam",
         "losing 10 kilograms safely", "launching a small online shop", "switching careers into data science"]
SYSTEMS = ["URL shortener", "chat service", "ride-sharing dispatch system", "video streaming backend",
           "payment processing pipeline", "news feed", "distributed rate limiter", "search autocomplete"]
PHENOMENA = ["the sky is blue", "ice floats on water", "airplanes stay in the air", "interest rates affect inflation",
             "vaccines produce immunity", "the tides happen twice a day", "quicksort is O(n log n) on average"]
POSITIONS = ["cities should ban cars from their centers", "homework should be abolished",
             "social media does more harm than good", "a four-day work week should be standard",
             "space exploration is worth its cost", "nuclear energy is essential for climate goals"]

# category -> (label, four templates, the fills they draw from). Template 3 is held out.
CATEGORIES: dict[str, tuple[Label, list[str], list]] = {
    "geography": ("easy", ["What is the capital of {0}?", "Which continent is {0} in?",
                           "What currency does {0} use?", "What language do people speak in {0}?"], COUNTRIES),
    "definition": ("easy", ["What is {0}?", "Define {0} in one sentence.",
                            "Give me a short definition of {0}.", "What does the term {0} mean?"], TERMS),
    "word_meaning": ("easy", ["What does '{0}' mean?", "Meaning of the word {0}?",
                              "Use '{0}' in a sentence.", "Is '{0}' a noun or an adjective?"], WORDS),
    "small_talk": ("easy", ["Tell me a fun fact about {0}.", "Do you like {0}?",
                            "Hi! What's something cute about {0}?", "Say something nice about {0}."], ANIMALS),
    "conversion": ("easy", ["Convert {0} {1} to {2}.", "How many {2} is {0} {1}?",
                            "{0} {1} in {2}?", "What is {0} {1} expressed in {2}?"], UNITS),
    "translation": ("easy", ["How do you say '{0}' in {1}?", "Translate '{0}' to {1}.",
                             "'{0}' in {1}, please.", "What's the {1} word for '{0}'?"],
                    [(p, lang) for p, lang in zip(PHRASES, LANGS)]),
    "short_list": ("easy", ["Name three {0}.", "List five {0}.", "Give me a few examples of {0}.",
                            "What are some well-known {0}?"], LIST_OF),
    "sentiment": ("easy", ["Is this review positive or negative? \"{0}\"", "Sentiment of: {0}",
                           "Classify this as positive or negative: {0}", "Happy or unhappy customer? \"{0}\""], REVIEWS),
    "synonym": ("easy", ["Give me a synonym for {0}.", "What's the opposite of {0}?",
                         "Another word for {0}?", "What is an antonym of '{0}'?"], ADJECTIVES),
    "trivia": ("easy", ["Who wrote {0}?", "When was {0} written?", "Is {0} a novel or a play?",
                        "In what language was {0} first published?"], BOOKS),
    "spelling": ("easy", ["Fix the spelling: {0}", "Correct this sentence: {0}",
                          "Any typos here? {0}", "Please proofread: {0}"], TYPOS),
    "code_writing": ("hard", ["Write a Python function that {0}, with type hints and unit tests.",
                              "Implement code that {0}. Explain the complexity.",
                              "I need a well-documented module that {0}; handle edge cases.",
                              "Show me an efficient program that {0}, and walk through how it works."], CODE_TASKS),
    "code_port": ("hard", ["Implement {0} in {1} and explain the design.",
                           "Write idiomatic {1} code for {0}, with error handling.",
                           "Port an implementation of {0} to {1} and compare its performance characteristics.",
                           "How would you build {0} in {1}? Give complete code."],
                  [(t, lang) for t, lang in zip(["a hash table with open addressing", "a thread-safe queue",
                                                 "a JSON parser", "a binary search tree with deletion",
                                                 "a trie for autocomplete", "an event loop"], LANGUAGES)]),
    "debugging": ("hard", ["This code fails with {0}. Find the bug and fix it:\n{1}",
                           "Why does this give {0}? Explain the root cause and patch it:\n{1}",
                           "Debug this snippet ({0}) and rewrite it correctly:\n{1}",
                           "My program hits {0} here. What is wrong and how do I prevent it in general?\n{1}"], BUGS),
    "proof": ("hard", ["Prove that {0}.", "Give a rigorous proof that {0}.",
                       "Show step by step why {0}.", "Can you demonstrate formally that {0}? Justify each step."],
              STATEMENTS),
    "word_problem": ("hard", ["Solve step by step: {0}?", "Work out carefully, showing your reasoning: {0}?",
                              "Puzzle for you: {0}? Explain the method.",
                              "Calculate and explain each step: {0}?"], WORD_PROBLEMS),
    "comparison": ("hard", ["Compare {0} and {1} in depth: trade-offs, costs and when to choose each.",
                            "Analyze the pros and cons of {0} versus {1} for a mid-size company.",
                            "Write a detailed comparison of {0} and {1} with a recommendation.",
                            "When is {0} a better choice than {1}? Argue both sides with examples."], PAIRS),
    "history_analysis": ("hard", ["Analyze the causes and long-term consequences of {0}.",
                                  "Explain the economic and political factors behind {0}, and what we learned.",
                                  "Write an essay on {0}: causes, key actors and its legacy.",
                                  "How did {0} reshape society? Discuss several perspectives critically."], EVENTS),
    "planning": ("hard", ["Plan a 5-day itinerary for {0} on a tight budget, with daily costs and transport.",
                          "Create a detailed week-by-week schedule for a two-week trip to {0} with kids.",
                          "Organize a business conference in {0} for 200 people: venues, budget, timeline.",
                          "Design a full relocation plan for moving a family to {0}: visas, schools, housing, costs."],
                 CITIES),
    "coaching": ("hard", ["Design a 12-week plan for {0}, with milestones and how to adapt when behind.",
                          "Create a structured program for {0}, explaining the reasoning behind each phase.",
                          "Lay out a realistic roadmap for {0}, including risks and fallback options.",
                          "Give me a detailed, personalized strategy for {0} and how to measure progress."], GOALS),
    "system_design": ("hard", ["Design a {0} that serves 10 million users. Discuss storage, caching and bottlenecks.",
                               "How would you architect a scalable {0}? Cover failure modes and trade-offs.",
                               "Walk me through the system design of a {0}, with capacity estimates.",
                               "Propose an architecture for a highly available {0} and justify each component."],
                      SYSTEMS),
    "deep_explanation": ("hard", ["Explain in depth why {0}, including the underlying mechanism.",
                                  "Give a thorough, step-by-step explanation of why {0}, with the math if any.",
                                  "Why exactly {0}? Go beyond the textbook answer and address misconceptions.",
                                  "Teach me rigorously why {0}, building it up from first principles."], PHENOMENA),
    "essay": ("hard", ["Write a 600-word persuasive essay arguing that {0}, with counterarguments.",
                       "Argue that {0}. Structure it with evidence, rebuttals and a conclusion.",
                       "Write a balanced debate brief on whether {0}, citing likely evidence on both sides.",
                       "Draft an op-ed making the case that {0}, anticipating the strongest objections."], POSITIONS),
}

# Written freely, not from templates: the closest thing here to real traffic.
WRITTEN: list[tuple[str, Label]] = [
    ("hey there", "easy"), ("thanks, that helped a lot!", "easy"), ("What time zone is London in?", "easy"),
    ("How many days are in a leap year?", "easy"), ("What's 15% of 80?", "easy"), ("Who painted the Mona Lisa?", "easy"),
    ("What is the boiling point of water in Fahrenheit?", "easy"), ("Spell 'necessary' for me.", "easy"),
    ("What's the plural of 'cactus'?", "easy"), ("Which planet is closest to the sun?", "easy"),
    ("How do I say hello in Korean?", "easy"), ("Give me a word that rhymes with 'light'.", "easy"),
    ("What year did the Berlin Wall fall?", "easy"), ("Is a tomato a fruit?", "easy"),
    ("What does CPU stand for?", "easy"), ("Recommend a name for a goldfish.", "easy"),
    ("How many legs does a spider have?", "easy"), ("What's the chemical symbol for gold?", "easy"),
    ("Tell me a short joke.", "easy"), ("What color do you get mixing blue and yellow?", "easy"),
    ("What's the capital of Australia?", "easy"), ("good night!", "easy"),
    ("Round 3.14159 to two decimals.", "easy"), ("Which is bigger, a kilobyte or a megabyte?", "easy"),
    ("Write a Flask API with JWT authentication and a SQLite user table.", "hard"),
    ("Refactor this class hierarchy to use composition and explain the benefits.", "hard"),
    ("My Kubernetes pods keep getting OOMKilled under load. How should I investigate and fix it?", "hard"),
    ("Derive the closed form of the Fibonacci sequence using generating functions.", "hard"),
    ("What are the tax implications of exercising stock options early versus at IPO? Work through an example.", "hard"),
    ("Write a short story where the twist is revealed through the narrator's unreliable memory.", "hard"),
    ("Explain how backpropagation computes gradients, with the chain rule written out for a two-layer network.",
     "hard"),
    ("Help me structure a literature review on transformer efficiency methods.", "hard"),
    ("Compare three approaches to consensus in distributed databases and when each fails.", "hard"),
    ("Given monthly sales of 120, 135, 150, 149, 170 and 190, forecast the next quarter and justify the method.",
     "hard"),
    ("Design a database schema for a hospital appointment system, with normalization and indexes.", "hard"),
    ("Critique the methodology of a study that links coffee to longevity using observational data.", "hard"),
    ("Write a regex that matches valid IPv4 addresses and explain every part of it.", "hard"),
    ("Translate this legal clause into plain English and point out the risks for the tenant.", "hard"),
    ("Optimize this SQL query that joins four tables and runs for 30 seconds; what indexes would help?", "hard"),
    ("Plan a migration from a monolith to microservices for a team of eight, phase by phase.", "hard"),
    ("Solve the 8 queens problem and explain the backtracking algorithm.", "hard"),
    ("Explain the difference between eventual and strong consistency with concrete failure scenarios.", "hard"),
    ("Write unit tests for a function that parses dates in five different formats.", "hard"),
    ("Summarize the key arguments of Kant's Critique of Pure Reason and evaluate them.", "hard"),
]


@dataclass(frozen=True, slots=True)
class Example:
    text: str
    label: Label
    category: str
    split: Literal["train", "test"]

    @property
    def hard(self) -> bool:
        return self.label == "hard"


def _fill(template: str, item) -> str:
    return template.format(*(item if isinstance(item, tuple) else (item,)))


def examples(split: Split = "all") -> list[Example]:
    """The labeled set, deterministic. Each template meets its fills in a rotated order so the
    four templates of a category don't all pair with the same items."""
    out: list[Example] = []
    for category, (label, templates, fills) in CATEGORIES.items():
        for t, template in enumerate(templates):
            part = "test" if t == 3 else "train"
            rotated = list(islice(cycle(fills), t, t + len(fills)))
            out.extend(Example(_fill(template, item), label, category, part) for item in rotated)
    for i, (text, label) in enumerate(WRITTEN):
        out.append(Example(text, label, "written", "test" if i % 2 else "train"))
    return [e for e in out if split == "all" or e.split == split]


def fingerprint() -> str:
    """Changes whenever the labeled set does, so stale weights are caught."""
    digest = hashlib.sha256()
    for e in examples():
        digest.update(f"{e.text}\x1f{e.label}\x1f{e.split}\x1e".encode())
    return digest.hexdigest()[:16]
