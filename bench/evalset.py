"""The semantic cache's evaluation set: pairs that must hit, and near misses that must not.

Built by hand for this project from the false-hit classes peers report (GPTCache #694: a
question and its negation; numbers, names and opposite verbs that change the answer; close
topics). The similarity threshold is tuned on the `tune` split and reported on `test`
(`python -m bench cache`), never picked by feel. Add pairs here when a false hit is found.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

# Same question, different words: a cached answer to one serves the other.
PARAPHRASES: list[tuple[str, str]] = [
    ("How do I reverse a list in Python?", "What's the way to reverse a Python list?"),
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How can I reset my password?", "I forgot my password, how do I reset it?"),
    ("What are the symptoms of dehydration?", "What symptoms does dehydration cause?"),
    ("How do I convert a string to an integer in Python?", "Python: how to turn a string into an int?"),
    ("What is the boiling point of water?", "At what temperature does water boil?"),
    ("How do I center a div in CSS?", "What's the best way to center a div with CSS?"),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?"),
    ("What does HTTP stand for?", "What is HTTP short for?"),
    ("How long should I boil an egg?", "How many minutes do you boil an egg?"),
    ("What is the difference between a list and a tuple in Python?", "How does a Python list differ from a tuple?"),
    ("How do I undo the last git commit?", "How can I revert my most recent git commit?"),
    ("What is photosynthesis?", "Can you explain what photosynthesis is?"),
    ("How do I make a cup of tea?", "What are the steps to make tea?"),
    ("What is the speed of light?", "How fast does light travel?"),
    ("How do I delete a branch in git?", "What's the command to remove a git branch?"),
    ("What causes rain?", "Why does it rain?"),
    ("How do I install numpy?", "What's the command to install numpy?"),
    ("What is machine learning?", "Can you explain machine learning to me?"),
    ("How do I sort a dictionary by value in Python?", "Python: sort a dict by its values"),
    ("What is the tallest mountain in the world?", "Which mountain is the highest on Earth?"),
    ("How can I improve my sleep?", "What can I do to sleep better?"),
    ("What is an API?", "Explain what an API is."),
    ("How do I read a file line by line in Python?", "In Python, how can I read a file one line at a time?"),
    ("What is the largest planet in our solar system?", "Which planet in the solar system is the biggest?"),
    ("How do I open a new tab in Chrome?", "What's the shortcut to open a new tab in Chrome?"),
    ("What is inflation?", "Can you explain what inflation means?"),
    ("How do I write a for loop in JavaScript?", "What is the syntax of a for loop in JavaScript?"),
    ("Who painted the Mona Lisa?", "Who is the painter of the Mona Lisa?"),
    ("How do I check my Python version?", "How can I see which version of Python I have?"),
    ("What is a black hole?", "Explain black holes to me."),
    ("How do I merge two dictionaries in Python?", "What's the way to combine two dicts in Python?"),
    ("What are the benefits of exercise?", "Why is exercise good for you?"),
    ("How do I create a virtual environment in Python?", "How can I make a Python virtualenv?"),
    ("What is the population of Japan?", "How many people live in Japan?"),
    ("How do I take a screenshot on Windows?", "What's the way to capture a screenshot in Windows?"),
    ("What is DNA?", "Can you tell me what DNA is?"),
    ("How do I find the length of a string in Java?", "In Java, how do I get a string's length?"),
    ("What is the meaning of life?", "What's life's meaning?"),
    ("How do I clear my browser cache?", "How can I empty the cache in my browser?"),
    ("What is a prime number?", "Explain what prime numbers are."),
    ("How do I cook rice?", "What's the best way to cook rice?"),
    ("When did World War II end?", "In what year did the Second World War end?"),
    ("How do I list files in a directory in Linux?", "What command lists the files in a Linux directory?"),
    ("What is the chemical formula for water?", "What's water's chemical formula?"),
    ("How do I lose weight?", "What's the best way to lose weight?"),
    ("What is Docker?", "Can you explain what Docker is?"),
    ("How do I exit vim?", "How can I quit the vim editor?"),
    ("What is the square root of 144?", "What's the square root of 144?"),
    ("How do I rename a file in Linux?", "What's the Linux command to rename a file?"),
    ("What is a recursive function?", "Explain recursion in programming."),
    ("How do I get rid of hiccups?", "What's a good way to stop hiccups?"),
    ("What language is spoken in Brazil?", "What do people speak in Brazil?"),
    ("How do I make pancakes?", "What's a simple pancake recipe?"),
    ("What is the difference between RAM and ROM?", "How is RAM different from ROM?"),
    ("How do I kill a process in Linux?", "How can I terminate a process on Linux?"),
    ("What is the currency of the United Kingdom?", "What money is used in the UK?"),
    ("How do I change my Wi-Fi password?", "How can I update the password of my Wi-Fi network?"),
    ("What are the primary colors?", "Which colors are the primary colors?"),
    ("How do I concatenate strings in Python?", "How can I join two strings together in Python?"),
    ("What does a CPU do?", "What is the job of a CPU?"),
    ("How many continents are there?", "What is the number of continents on Earth?"),
    ("How do I stop my dog from barking?", "How can I get my dog to stop barking?"),
    ("What is the freezing point of water in Fahrenheit?", "At what Fahrenheit temperature does water freeze?"),
    ("How do I add a column to a table in SQL?", "What's the SQL to add a new column to a table?"),
    ("What is a vaccine?", "Can you explain what vaccines are?"),
    ("How do I remove duplicates from a list in Python?", "How can I deduplicate a Python list?"),
    ("What is the GDP of Germany?", "How large is Germany's GDP?"),
    ("How do I write a haiku?", "What are the rules for writing a haiku?"),
    ("Why is the sky blue?", "What makes the sky look blue?"),
    ("How do I start a small business?", "What are the steps to starting a small business?"),
    ("What is the time complexity of binary search?", "What's binary search's time complexity?"),
    ("How do I get a job in tech?", "How can I break into the tech industry?"),
    ("What is cloud computing?", "Explain cloud computing."),
    ("How do I update all packages with pip?", "How can I upgrade every pip package at once?"),
    ("What is the longest river in the world?", "Which river is the longest on Earth?"),
    ("How do I calm down when I'm anxious?", "What can I do to calm my anxiety?"),
    ("What is an index in a database?", "Explain database indexes."),
    ("How do I print to the console in JavaScript?", "How can I log a message to the console in JavaScript?"),
    ("What is the Pythagorean theorem?", "Can you state the Pythagorean theorem?"),
]

# Close in wording, different answer: serving one for the other is a false hit.
NEAR_MISSES: dict[str, list[tuple[str, str]]] = {
    "negation": [
        ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?"),
        ("Should I use a mutex here?", "Should I not use a mutex here?"),
        ("What foods are good for dogs?", "What foods are not good for dogs?"),
        ("Which countries use the euro?", "Which countries don't use the euro?"),
        ("Why does my code compile?", "Why doesn't my code compile?"),
        ("Can I take ibuprofen with coffee?", "Why can't I take ibuprofen with coffee?"),
        ("What happens if I water my plants every day?", "What happens if I never water my plants?"),
        ("Which fruits contain vitamin C?", "Which fruits contain no vitamin C?"),
        ("Is Python a compiled language?", "Why is Python not a compiled language?"),
        ("Does the function return a value?", "Does the function return nothing?"),
        ("When should I use recursion?", "When should I avoid recursion?"),
        ("List programming languages with garbage collection.", "List programming languages without garbage collection."),
        ("How do I make a query that uses the index?", "Why does my query not use the index?"),
        ("What are the side effects of taking aspirin daily?", "What are the side effects of not taking aspirin daily?"),
        ("Is coffee bad for your health?", "Is coffee not bad for your health?"),
        ("Do cats like water?", "Why don't cats like water?"),
        ("Which animals can see color?", "Which animals cannot see color?"),
        ("How do I run tests in parallel with pytest?", "How do I run tests without parallelism in pytest?"),
        ("Is zero an even number?", "Is zero neither even nor odd?"),
        ("What should I do before a job interview?", "What should I never do before a job interview?"),
    ],
    "number": [
        ("What is 15% of 200?", "What is 15% of 300?"),
        ("What is the square root of 144?", "What is the square root of 169?"),
        ("How do I install Python 3.8 on Ubuntu?", "How do I install Python 3.12 on Ubuntu?"),
        ("What happened in 1969?", "What happened in 1989?"),
        ("Convert 100 Fahrenheit to Celsius.", "Convert 10 Fahrenheit to Celsius."),
        ("How many calories are in 2 eggs?", "How many calories are in 3 eggs?"),
        ("What is 7 times 8?", "What is 7 times 9?"),
        ("Who won the World Cup in 2014?", "Who won the World Cup in 2018?"),
        ("Plan a 3 day trip to Rome.", "Plan a 7 day trip to Rome."),
        ("Write a function that returns the first 10 primes.", "Write a function that returns the first 100 primes."),
        ("How much is 50 dollars in euros?", "How much is 500 dollars in euros?"),
        ("What is the 5th planet from the sun?", "What is the 3rd planet from the sun?"),
        ("Give me 3 tips for better sleep.", "Give me 10 tips for better sleep."),
        ("How long does it take to walk 5 km?", "How long does it take to walk 15 km?"),
        ("What is the boiling point of water at 2000 meters?", "What is the boiling point of water at 5000 meters?"),
        ("How many days until December 25?", "How many days until December 31?"),
        ("Is 91 a prime number?", "Is 97 a prime number?"),
        ("What is two plus two?", "What is two plus three?"),
        ("Summarize chapter 1 of the book.", "Summarize chapter 4 of the book."),
        ("What is the speed limit at 30 mph zones in the UK?", "What is the speed limit at 20 mph zones in the UK?"),
    ],
    "entity": [
        ("What is the capital of France?", "What is the capital of Spain?"),
        ("Who founded Microsoft?", "Who founded Apple?"),
        ("How do I reverse a list in Python?", "How do I reverse a list in Java?"),
        ("What is the population of Canada?", "What is the population of Australia?"),
        ("Who wrote Hamlet?", "Who wrote Don Quixote?"),
        ("What language is spoken in Brazil?", "What language is spoken in Mexico?"),
        ("How tall is the Eiffel Tower?", "How tall is the Statue of Liberty?"),
        ("What is the currency of Japan?", "What is the currency of China?"),
        ("How do I install Docker on Ubuntu?", "How do I install Docker on Windows?"),
        ("Tell me about the history of Rome.", "Tell me about the history of Athens."),
        ("When was Google founded?", "When was Amazon founded?"),
        ("What is the time zone of New York?", "What is the time zone of Los Angeles?"),
        ("How do I connect to PostgreSQL from Python?", "How do I connect to MySQL from Python?"),
        ("Who is the CEO of Tesla?", "Who is the CEO of Netflix?"),
        ("What is the weather like in London in April?", "What is the weather like in Paris in April?"),
        ("How do I deploy a React app to Netlify?", "How do I deploy a React app to Vercel?"),
        ("What did Einstein discover?", "What did Newton discover?"),
        ("How far is the Moon from Earth?", "How far is Mars from Earth?"),
        ("What are the main exports of Germany?", "What are the main exports of Italy?"),
        ("Explain the plot of Star Wars.", "Explain the plot of Star Trek."),
    ],
    "opposite": [
        ("How do I enable two-factor authentication?", "How do I disable two-factor authentication?"),
        ("How do I increase the font size in VS Code?", "How do I decrease the font size in VS Code?"),
        ("How do I install a package with apt?", "How do I uninstall a package with apt?"),
        ("How do I encrypt a file with gpg?", "How do I decrypt a file with gpg?"),
        ("What should I eat before a run?", "What should I eat after a run?"),
        ("How do I add a user to a group in Linux?", "How do I remove a user from a group in Linux?"),
        ("How do I upload a file to S3?", "How do I download a file from S3?"),
        ("What is the maximum value of an int in Java?", "What is the minimum value of an int in Java?"),
        ("How do I start the nginx service?", "How do I stop the nginx service?"),
        ("How do I import a CSV into Excel?", "How do I export a CSV from Excel?"),
        ("What are the advantages of remote work?", "What are the disadvantages of remote work?"),
        ("How do I zoom in on a Mac?", "How do I zoom out on a Mac?"),
        ("How do I lock a table in Postgres?", "How do I unlock a table in Postgres?"),
        ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?"),
        ("Translate 'good morning' from English to French.", "Translate 'good morning' from French to English."),
        ("How do I push changes to GitHub?", "How do I pull changes from GitHub?"),
        ("What is the best time to buy stocks?", "What is the best time to sell stocks?"),
        ("How do I compress a folder on Windows?", "How do I extract a folder on Windows?"),
        ("How do I turn on dark mode in Chrome?", "How do I turn off dark mode in Chrome?"),
        ("Why do prices rise during inflation?", "Why do prices fall during deflation?"),
    ],
    "topic": [
        ("How do I sort a list in Python?", "How do I sort a dictionary in Python?"),
        ("What are the symptoms of a cold?", "What are the symptoms of the flu?"),
        ("How do I make chocolate chip cookies?", "How do I make oatmeal raisin cookies?"),
        ("How do I write a unit test?", "How do I write an integration test?"),
        ("What is a noun?", "What is a verb?"),
        ("How do I train for a marathon?", "How do I train for a sprint?"),
        ("What is the difference between TCP and UDP?", "What is the difference between HTTP and HTTPS?"),
        ("How do I bake bread?", "How do I bake a cake?"),
        ("How do I center text in CSS?", "How do I center an image in CSS?"),
        ("What do cats eat?", "What do rabbits eat?"),
        ("How do I read a JSON file in Python?", "How do I write a JSON file in Python?"),
        ("What are the rules of chess?", "What are the rules of checkers?"),
        ("How do I grow tomatoes?", "How do I grow potatoes?"),
        ("What is a stack data structure?", "What is a queue data structure?"),
        ("How do I fix a flat bike tire?", "How do I fix a flat car tire?"),
        ("What is the function of the heart?", "What is the function of the liver?"),
        ("How do I tie a tie?", "How do I tie a bow tie?"),
        ("Write a poem about the ocean.", "Write a poem about the mountains."),
        ("How do I learn to play guitar?", "How do I learn to play piano?"),
        ("What is a mortgage?", "What is a car loan?"),
    ],
}

# Templated pairs over many domains: a question template, a slot filled with one of two words
# that change the answer (antonyms, reversals, on/off, begin/end, quantifiers, time, units,
# code identifiers), and paraphrase templates of the same question. Each (template, subject,
# pair) gives one near miss; each paraphrase template one must-hit pair. They widen the set
# the threshold is checked on well past what a word list was written against.
_SUBJECTS = ["a list in Python", "an array in JavaScript", "rows in SQL", "a vector in C++", "a column in pandas",
             "files in Linux", "a slice in Go", "an ArrayList in Java"]
_ORDER_PAIRS = [("ascending", "descending"), ("increasing", "decreasing"), ("alphabetical", "reverse alphabetical")]
_TOGGLE_SUBJECTS = ["dark mode in Chrome", "notifications on Android", "Bluetooth on Windows", "autocorrect on an iPhone",
                    "two-factor authentication on GitHub", "the firewall on Ubuntu", "spell check in Word",
                    "location services on a Mac"]
_TOGGLE_PAIRS = [("turn on", "turn off"), ("enable", "disable"), ("activate", "deactivate"), ("show", "hide")]
_BOUND_SUBJECTS = ["a loop in Python", "a transaction in Postgres", "a timer in JavaScript", "a recording in OBS",
                   "a container in Docker", "a service in systemd", "a session in tmux", "a stream in Node.js"]
_BOUND_PAIRS = [("start", "stop"), ("begin", "end"), ("open", "close"), ("pause", "resume")]
_QUANT_SUBJECTS = ["vowels in a string", "duplicate rows in a table", "empty lines in a file", "odd numbers in a list",
                   "null values in a column", "prime numbers below 100"]
_QUANT_PAIRS = [("count all", "count none of the"), ("keep all", "remove all"), ("find the first", "find the last")]
_UNIT_PAIRS = [("kilometers to miles", "miles to kilometers"), ("Celsius to Kelvin", "Kelvin to Celsius"),
               ("pounds to kilograms", "kilograms to pounds"), ("inches to centimeters", "centimeters to inches"),
               ("hours to seconds", "seconds to hours"), ("bytes to megabytes", "megabytes to bytes")]
_TIME_PAIRS = [("before", "after"), ("yesterday", "tomorrow"), ("last week", "next week"), ("in the morning", "at night")]
_TIME_SUBJECTS = ["take ibuprofen", "drink coffee", "go running", "water the plants", "eat a big meal", "study for an exam"]
_CODE_PAIRS = [("append", "extend"), ("map", "filter"), ("push", "pop"), ("shallow copy", "deep copy"),
               ("sort", "sorted"), ("== ", "is ")]


# (subjects, word pairs, the question with {s} and {w}, the paraphrase pair for each subject)
_FAMILIES = [
    (_SUBJECTS, _ORDER_PAIRS, "How do I sort {s} in {w} order?",
     ("How do I sort {s} in ascending order?", "What's the way to sort {s} in ascending order?")),
    (_TOGGLE_SUBJECTS, _TOGGLE_PAIRS, "How do I {w} {s}?", ("How do I turn on {s}?", "How can I switch on {s}?")),
    (_BOUND_SUBJECTS, _BOUND_PAIRS, "How do I {w} {s}?", ("How do I start {s}?", "What's the way to start {s}?")),
    (_QUANT_SUBJECTS, _QUANT_PAIRS, "Write code to {w} {s}.",
     ("Write code to count all {s}.", "Write a program that counts all {s}.")),
    (_TIME_SUBJECTS, _TIME_PAIRS, "Is it good to {s} {w}?",
     ("Is it good to {s} before bed?", "Is it a good idea to {s} before bed?")),
    ([a for a, _ in _UNIT_PAIRS], [], "", ("How do I convert {s}?", "What's the formula to convert {s}?")),
    ([""], _UNIT_PAIRS, "How do I convert {w}?", None),
    ([""], [(a.strip(), b.strip()) for a, b in _CODE_PAIRS], "In Python, when should I use {w}?", None),
]


def _templated() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    hits: list[tuple[str, str]] = []
    misses: list[tuple[str, str]] = []
    for subjects, pairs, question, paraphrase in _FAMILIES:
        for s in subjects:
            misses += [(question.format(s=s, w=a), question.format(s=s, w=b)) for a, b in pairs]
            if paraphrase is not None:
                hits.append((paraphrase[0].format(s=s), paraphrase[1].format(s=s)))
    return hits, misses


TEMPLATED_HITS, TEMPLATED_MISSES = _templated()

Label = Literal["hit", "miss"]


@dataclass(frozen=True, slots=True)
class EvalPair:
    cached: str  # the question whose answer is in the cache
    query: str  # the incoming question
    label: Label  # "hit": the cached answer serves; "miss": it must not
    kind: str  # paraphrase | negation | number | entity | opposite | topic | templated_*
    split: Literal["tune", "test", "held_out"]


def _split(a: str, b: str) -> Literal["tune", "test"]:
    # Deterministic, order-independent half split: the same pair always lands on the same side.
    digest = hashlib.sha256("\x00".join(sorted((a, b))).encode()).digest()
    return "tune" if digest[0] % 2 == 0 else "test"


def eval_pairs(split: str | None = None) -> list[EvalPair]:
    """The hand-written pairs (split into `tune` and `test` halves), and the templated ones: a
    `held_out` split that no threshold or guard is tuned on, only reported."""
    pairs = [EvalPair(a, b, "hit", "paraphrase", _split(a, b)) for a, b in PARAPHRASES]
    for kind, items in NEAR_MISSES.items():
        pairs += [EvalPair(a, b, "miss", kind, _split(a, b)) for a, b in items]
    pairs += [EvalPair(a, b, "hit", "templated_paraphrase", "held_out") for a, b in TEMPLATED_HITS]
    pairs += [EvalPair(a, b, "miss", "templated_near_miss", "held_out") for a, b in TEMPLATED_MISSES]
    return [p for p in pairs if split is None or p.split == split]
