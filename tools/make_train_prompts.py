#!/usr/bin/env python3
"""Generate the built-in training prompt set, ``src/dflashkit/assets/train_prompts.jsonl``.

Deterministic: a fixed seed, no set iteration in any output path, and no input except the
installed HumanEval data, used only to reject prompts that collide with it (a HumanEval entry
point or helper name as function name, or a near copy: token Jaccard >= 0.6 with any problem).

    python3 tools/make_train_prompts.py            # rewrites the asset
    python3 tools/make_train_prompts.py --out x.jsonl

Categories: Python function completion in exactly the HumanEval user-message format, other
coding requests, math with worked steps, explanations, everyday chat. The function-completion
prompts come from task templates with reference implementations: every ``>>>`` example in a
docstring is the reference implementation's real output.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import random
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, timedelta
from fractions import Fraction
from itertools import combinations, groupby, permutations
from pathlib import Path

# Runnable from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dflashkit.data.prompts import (  # noqa: E402
    format_humaneval_prompt,
    humaneval_path,
    prompt_tokens,
    token_jaccard,
)

SEED = 20250611
NEAR_COPY = 0.6
# Category -> number of prompts (about 45/15/15/15/10 %).
COUNTS = {"code_completion": 990, "coding": 330, "math": 330, "explanation": 330, "chat": 220}

Rng = random.Random


# =============================================================================================
# Shared vocabulary
# =============================================================================================

WORDS = """apple river stone garden window yellow quick silver planet market orange bridge forest
candle pencil winter summer ocean mountain rabbit guitar butter coffee little bright green
shadow castle rocket tiger lemon paper water dragon cloud happy simple purple north metal
island zebra violin basket jungle ladder mirror needle pillow rocket saddle thunder velvet
wagon anchor barrel cactus desert engine falcon harbor igloo jacket kettle lantern meadow
noodle orbit parrot quartz radio sunset tunnel umbrella valley walnut yogurt zipper echo
idea open under eagle ice oak art egg ink owl""".split()
WORDS = list(dict.fromkeys(WORDS))
NAMES = """Ava Ben Chloe Dan Elena Farid Grace Hiro Isla Jonas Kemi Liam Maya Noor Omar Priya
Quinn Rosa Sam Tariq Uma Victor Wen Yara Zoe Mateo Lena Arjun Sofia Kenji""".split()
CITIES = """Lisbon Kyoto Nairobi Montreal Oslo Lima Hanoi Seville Krakow Melbourne Istanbul
Edinburgh Marrakesh Vancouver Tbilisi Reykjavik Cartagena Prague Singapore Valparaiso""".split()


def sentence(r: Rng, lo: int = 3, hi: int = 7, pool: list[str] | None = None) -> str:
    return " ".join(r.choice(pool or WORDS) for _ in range(r.randint(lo, hi)))


def int_list(r: Rng, lo: int = -9, hi: int = 20, n_lo: int = 3, n_hi: int = 7) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(n_lo, n_hi))]


def date_str(r: Rng, y0: int = 1990, y1: int = 2030) -> str:
    return (date(y0, 1, 1) + timedelta(days=r.randint(0, (date(y1, 12, 31) - date(y0, 1, 1)).days))).isoformat()


def to_roman(n: int) -> str:
    out = ""
    for value, sym in ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),
                       (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")):
        while n >= value:
            out, n = out + sym, n - value
    return out


def is_prime_number(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


# =============================================================================================
# Python function-completion tasks (HumanEval format)
# =============================================================================================

@dataclass
class Task:
    """A function-completion template.

    names: candidate function names (may use variant fields); args: (alternatives "a|b", type,
    description) with types in builtin style (list[int], X | None); docs: description templates
    using {a0}, {a1}... for the chosen argument names and the variant's fields; fn(*args, **variant)
    is the reference implementation that produces the docstring examples; gen(rng, variant)
    returns one example's arguments.
    """

    names: tuple[str, ...]
    args: list[tuple[str, str, str]]
    ret: str
    docs: tuple[str, ...]
    fn: Callable
    gen: Callable[[Rng, dict], tuple]
    variants: list[dict] = field(default_factory=lambda: [{}])
    returns: str = ""
    imports: tuple[str, ...] = ()


def _rle(s: str, keep_ones: bool) -> str:
    return "".join(c + (str(n) if n > 1 or keep_ones else "") for c, n in ((c, len(list(g))) for c, g in groupby(s)))


def _runs(r: Rng, letters: str = "abcd", max_run: int = 4) -> str:
    return "".join(r.choice(letters) * r.randint(1, max_run) for _ in range(r.randint(2, 5)))


def _most_common_letter(s: str, mode: str, tie: str = "") -> str:
    letters = [c for c in s.lower() if c.isalpha()]
    counts = Counter(letters)
    best = max(counts.values())
    tied = [c for c in dict.fromkeys(letters) if counts[c] == best]
    return tied[0] if mode == "first" else min(tied)


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _pig_latin(s: str) -> str:
    out = []
    for w in s.split():
        i = next((k for k, c in enumerate(w) if c in "aeiou"), None)
        out.append(w + "ay" if i is None else w + "way" if i == 0 else w[i:] + w[:i] + "ay")
    return " ".join(out)


def _alternate_case(s: str, start: str) -> str:
    out, upper = [], start == "upper"
    for c in s:
        if c.isalpha():
            out.append(c.upper() if upper else c.lower())
            upper = not upper
        else:
            out.append(c)
    return "".join(out)


def _caesar(s: str, k: int) -> str:
    def shift(c: str) -> str:
        if not c.isalpha():
            return c
        base = ord("A") if c.isupper() else ord("a")
        return chr((ord(c) - base + k) % 26 + base)
    return "".join(map(shift, s))


def _rotate(items: list, k: int, direction: str) -> list:
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k] if direction == "left" else items[len(items) - k:] + items[:len(items) - k]


def _peaks(xs: list[int]) -> list[int]:
    return [i for i in range(1, len(xs) - 1) if xs[i - 1] < xs[i] > xs[i + 1]]


def _longest_run(xs: list[int]) -> int:
    best = cur = 1 if xs else 0
    for a, b in zip(xs, xs[1:]):
        cur = cur + 1 if b > a else 1
        best = max(best, cur)
    return best


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    return steps


def _is_happy(n: int) -> bool:
    seen = []
    while n != 1 and n not in seen:
        seen.append(n)
        n = sum(int(d) ** 2 for d in str(n))
    return n == 1


def _lucas(n: int) -> int:
    a, b = 2, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _nested_sum(x) -> int:
    return x if isinstance(x, int) else sum(_nested_sum(y) for y in x)


def _depth(x) -> int:
    return 1 + max((_depth(y) for y in x if isinstance(y, list)), default=0)


def _flatten(x) -> list[int]:
    return [x] if isinstance(x, int) else [z for y in x for z in _flatten(y)]


def _nested(r: Rng, depth: int = 2) -> list:
    return [_nested(r, depth - 1) if depth and r.random() < 0.35 else r.randint(0, 9) for _ in range(r.randint(1, 3))]


def _hanoi(n: int, a: str = "A", c: str = "C", b: str = "B") -> list[tuple[str, str]]:
    return [] if n == 0 else _hanoi(n - 1, a, b, c) + [(a, c)] + _hanoi(n - 1, b, c, a)


def _stairs(n: int, steps: tuple[int, ...], steps_text: str = "") -> int:
    ways = [1] + [0] * n
    for i in range(1, n + 1):
        ways[i] = sum(ways[i - s] for s in steps if s <= i)
    return ways[n]


def _rpn(tokens: list[str]) -> int:
    stack: list[int] = []
    for t in tokens:
        if t in "+-*":
            b, a = stack.pop(), stack.pop()
            stack.append(a + b if t == "+" else a - b if t == "-" else a * b)
        else:
            stack.append(int(t))
    return stack[0]


def _rpn_tokens(r: Rng) -> list[str]:
    tokens, depth = [str(r.randint(1, 9)), str(r.randint(1, 9))], 2
    while depth > 1 or len(tokens) < 5:
        if depth >= 2 and (r.random() < 0.5 or len(tokens) >= 7):
            tokens.append(r.choice("+-*"))
            depth -= 1
        else:
            tokens.append(str(r.randint(1, 9)))
            depth += 1
    return tokens


def _balanced(s: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for c in s:
        if c in "([{":
            stack.append(c)
        elif c in pairs and (not stack or stack.pop() != pairs[c]):
            return False
    return not stack


def _compare_versions(a: str, b: str) -> int:
    x, y = [int(p) for p in a.split(".")], [int(p) for p in b.split(".")]
    n = max(len(x), len(y))
    x, y = x + [0] * (n - len(x)), y + [0] * (n - len(y))
    return (x > y) - (x < y)


def _valid_ipv4(s: str) -> bool:
    parts = s.split(".")
    return len(parts) == 4 and all(p.isdigit() and str(int(p)) == p and int(p) <= 255 for p in parts)


def _merge_intervals(xs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(xs):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _intervals(r: Rng) -> list[tuple[int, int]]:
    return [(s, s + r.randint(0, 5)) for s in (r.randint(0, 15) for _ in range(r.randint(2, 4)))]


def _spiral(m: list[list[int]]) -> list[int]:
    m, out = [row[:] for row in m], []
    while m:
        out += m.pop(0)
        m = [list(row) for row in zip(*m)][::-1]
    return out


def _islands(grid: list[list[int]]) -> int:
    seen, count = [[False] * len(row) for row in grid], 0
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v and not seen[i][j]:
                count, stack = count + 1, [(i, j)]
                while stack:
                    a, b = stack.pop()
                    if 0 <= a < len(grid) and 0 <= b < len(row) and grid[a][b] and not seen[a][b]:
                        seen[a][b] = True
                        stack += [(a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)]
    return count


def _life(g: list[list[int]]) -> list[list[int]]:
    n, m = len(g), len(g[0])

    def live(i: int, j: int) -> int:
        return sum(g[a][b] for a in range(i - 1, i + 2) for b in range(j - 1, j + 2)
                   if (a, b) != (i, j) and 0 <= a < n and 0 <= b < m)
    return [[int(live(i, j) == 3 or (g[i][j] and live(i, j) == 2)) for j in range(m)] for i in range(n)]


def _grid(r: Rng, n: int, m: int, hi: int = 9) -> list[list[int]]:
    return [[r.randint(0, hi) for _ in range(m)] for _ in range(n)]


def _square(r: Rng, hi: int = 9) -> list[list[int]]:
    n = r.randint(2, 3)
    return _grid(r, n, n, hi)


def _gray(n: int) -> list[int]:
    return [i ^ (i >> 1) for i in range(2 ** n)]


def _clock_angle(h: int, m: int) -> float:
    angle = abs(30 * (h % 12) + 0.5 * m - 6 * m)
    return min(angle, 360 - angle)


def _to_24h(s: str) -> str:
    hm, ampm = s.split()
    h, m = map(int, hm.split(":"))
    return f"{h % 12 + (12 if ampm == 'PM' else 0):02d}:{m:02d}"


def _age(birth: str, on: str) -> int:
    b, d = date.fromisoformat(birth), date.fromisoformat(on)
    return d.year - b.year - ((d.month, d.day) < (b.month, b.day))


def _shoelace(pts: list[tuple[int, int]]) -> float:
    return abs(sum(x1 * y2 - x2 * y1 for (x1, y1), (x2, y2) in zip(pts, pts[1:] + pts[:1]))) / 2


def _polygon(r: Rng) -> list[tuple[int, int]]:
    w, h, x, y = r.randint(1, 6), r.randint(1, 6), r.randint(-3, 3), r.randint(-3, 3)
    return r.choice([[(x, y), (x + w, y), (x + w, y + h), (x, y + h)], [(x, y), (x + w, y), (x, y + h)]])


def _rect(r: Rng) -> tuple[int, int, int, int]:
    x, y = r.randint(-5, 5), r.randint(-5, 5)
    return (x, y, x + r.randint(1, 6), y + r.randint(1, 6))


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> int:
    return max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))


def _triangle_kind(a: int, b: int, c: int) -> str:
    x, y, z = sorted((a, b, c))
    if x <= 0 or x + y <= z:
        return "invalid"
    return "equilateral" if x == z else "isosceles" if x == y or y == z else "scalene"


def _dense_ranks(xs: list[int]) -> list[int]:
    order = sorted(set(xs), reverse=True)
    return [order.index(x) + 1 for x in xs]


def _key_values(text: str, ps: str, kvs: str, example: str = "") -> dict[str, int]:
    return {k: int(v) for k, v in (p.split(kvs) for p in text.split(ps))} if text else {}


def _kv_text(r: Rng, v: dict) -> tuple:
    keys = list(dict.fromkeys(r.choice(["a", "b", "x", "y", "size", "depth", "width", "count", "level", "port"])
                              for _ in range(r.randint(0, 4))))
    return (v["ps"].join(f"{k}{v['kvs']}{r.randint(0, 99)}" for k in keys),)


def _duration(text: str) -> int:
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+)([hms])", text))


def _duration_text(r: Rng) -> str:
    parts = [f"{r.randint(1, 59)}{u}" for u in "hms" if r.random() < 0.6]
    return "".join(parts) or f"{r.randint(1, 90)}m"


def _query(url: str) -> dict[str, str]:
    if "?" not in url:
        return {}
    return dict(p.split("=", 1) for p in url.split("?", 1)[1].split("&") if p)


def _url(r: Rng) -> str:
    base = f"https://{r.choice(['example.com', 'shop.test', 'api.local'])}/{r.choice(WORDS)}"
    params = [f"{r.choice(['q', 'page', 'sort', 'lang', 'id'])}={r.choice(WORDS + ['2', '10', 'asc'])}"
              for _ in range(r.randint(0, 3))]
    return base + ("?" + "&".join(dict.fromkeys(params)) if params else "")


def _add_minutes(t: str, minutes: int) -> str:
    h, m = map(int, t.split(":"))
    total = (h * 60 + m + minutes) % (24 * 60)
    return f"{total // 60:02d}:{total % 60:02d}"


def _clock(r: Rng) -> str:
    return f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"


def _add_fractions(a: str, b: str) -> str:
    s = Fraction(a) + Fraction(b)
    return f"{s.numerator}/{s.denominator}"


def _fraction(r: Rng) -> str:
    return f"{r.randint(1, 9)}/{r.randint(2, 12)}"


def _anagram_pair(r: Rng) -> tuple[str, str]:
    return r.choice([("listen", "silent"), ("Dormitory", "dirty room"), ("night", "thing"), ("evil", "vile"),
                     ("stone", "tones"), ("apple", "paper"), ("cat", "act"), ("rat", "car"), ("below", "elbow"),
                     ("Astronomer", "moon starer"), ("study", "dusty"), ("hello", "world")])


def _bracket_text(r: Rng) -> str:
    return r.choice(["([]{})", "{[()()]}", "(a[b]{c})", "[(x)]", "f(x[0]) + {y}", "(()", "([)]", "}{", "a(b]c",
                     "{[}]", "((x))[y]{z}", ""])


def _camel(r: Rng) -> str:
    ws = [r.choice(WORDS) for _ in range(r.randint(2, 3))]
    return ws[0] + "".join(w.capitalize() for w in ws[1:])


def _date_pair(r: Rng) -> tuple[str, str]:
    return date_str(r), date_str(r)


def _people(r: Rng) -> tuple:
    return ([(n, r.randint(18, 40)) for n in r.sample(NAMES, r.randint(3, 4))],)


def _scores(r: Rng, n_lo: int = 2, n_hi: int = 4) -> dict[str, int]:
    return {n.lower(): r.randint(1, 20) for n in r.sample(NAMES, r.randint(n_lo, n_hi))}


def _dotted(r: Rng) -> tuple:
    data = {"db": {"host": "localhost", "port": 5432}, "debug": True, "user": {"name": r.choice(NAMES)}}
    path = r.choice(["db.port", "db.host", "user.name", "debug", "db.user", "cache.size"])
    return data, path, r.choice([None, 0, "n/a"])


def _get_path(data: dict, path: str, default: object) -> object:
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def _some_ints(lo: int = -9, hi: int = 20, n_lo: int = 3, n_hi: int = 7) -> Callable[[Rng, dict], tuple]:
    return lambda r, v: (int_list(r, lo, hi, n_lo, n_hi),)


def _one_sentence(lo: int = 3, hi: int = 7) -> Callable[[Rng, dict], tuple]:
    return lambda r, v: (sentence(r, lo, hi),)


def _one_int(lo: int, hi: int) -> Callable[[Rng, dict], tuple]:
    return lambda r, v: (r.randint(lo, hi),)


NUMS = "numbers|nums|values|xs|data"
WORD_ARG = "word|s|text|string"
TEXT_ARG = "sentence|text|s|phrase"

TASKS: list[Task] = [
    # --- strings -----------------------------------------------------------------------------
    Task(("count_char", "char_count", "occurrences_of_char"),
         [("text|s|word", "str", "the string to search"), ("ch|char|letter", "str", "a single character")], "int",
         ("Return how many times the character {a1} appears in {a0}. The comparison is case-sensitive.",
          "Count the occurrences of the single character {a1} in the string {a0} (upper and lower case differ)."),
         lambda s, c: s.count(c),
         lambda r, v: (lambda w: (w, r.choice(w + "xz")))(r.choice(WORDS) + r.choice(WORDS)),
         returns="How often the character occurs."),
    Task(("long_words", "words_longer_than", "filter_long_words"),
         [(TEXT_ARG, "str", "words separated by single spaces")], "list[str]",
         ("Return the words of {a0} that have more than {k} letters, in their original order.",
          "Given a sentence, return a list of the words whose length is greater than {k}, keeping their order."),
         lambda s, k: [w for w in s.split() if len(w) > k], _one_sentence(),
         variants=[{"k": k} for k in (3, 4, 5, 6)], returns="The long words in order."),
    Task(("capitalize_words", "title_case_words", "capitalize_each"),
         [(TEXT_ARG, "str", "lowercase words separated by single spaces")], "str",
         ("Return {a0} with the first letter of every word in upper case.",
          "Capitalize the first letter of each space-separated word in {a0} and return the result."),
         lambda s: " ".join(w[:1].upper() + w[1:] for w in s.split(" ")), _one_sentence(2, 5)),
    Task(("reverse_each_word", "mirror_words", "spell_words_backwards"),
         [(TEXT_ARG, "str", "words separated by single spaces")], "str",
         ("Reverse the letters of every word in {a0} while keeping the words in the same order.",
          "Return a sentence where each word of {a0} is spelled backwards; the word order is kept."),
         lambda s: " ".join(w[::-1] for w in s.split(" ")), _one_sentence(2, 5)),
    Task(("is_isogram", "has_no_repeated_letters", "all_letters_distinct"),
         [("word|s", "str", "a word made of letters")], "bool",
         ("Return True if no letter appears more than once in {a0}, ignoring case.",
          "An isogram is a word without a repeating letter (case-insensitive). Check whether {a0} is an isogram."),
         lambda w: len(set(w.lower())) == len(w),
         lambda r, v: (r.choice(WORDS + ["Alpha", "lumberjack", "Dermatoglyphics", "background", "moose"]),)),
    Task(("run_length_encode", "rle_compress", "compress_runs"),
         [("text|s", "str", "a string of lowercase letters")], "str",
         ("Compress {a0} with run-length encoding: every run of equal characters becomes the character followed "
          "by the length of the run.",
          "Encode {a0} by replacing each maximal block of repeated characters with the character and its count, "
          "e.g. 'aaab' becomes 'a3b1'."),
         lambda s: _rle(s, True), lambda r, v: (_runs(r),)),
    Task(("squeeze_runs", "compact_runs", "shorten_repeats"),
         [("text|s", "str", "a string of lowercase letters")], "str",
         ("Replace every run of two or more equal characters in {a0} by the character followed by the run length; "
          "characters that are not repeated are left as they are.",),
         lambda s: _rle(s, False), lambda r, v: (_runs(r),)),
    Task(("run_length_decode", "expand_runs", "rle_expand"),
         [("encoded|code|packed", "str", "letters each followed by a positive count, e.g. 'a3b1'")], "str",
         ("Decode a run-length encoded string in which each letter is followed by its (possibly multi-digit) "
          "repeat count.",
          "Expand {a0}, where every letter is followed by how many times it should be repeated."),
         lambda s: "".join(c * int(n) for c, n in re.findall(r"([a-z])(\d+)", s)),
         lambda r, v: ("".join(f"{r.choice('abcxyz')}{r.randint(1, 12)}" for _ in range(r.randint(1, 4))),)),
    Task(("first_longest_word", "longest_word", "widest_word"),
         [(TEXT_ARG, "str", "words separated by spaces")], "str",
         ("Return the longest word in {a0}. If several words share the maximum length, return the first one. "
          "Return an empty string for an empty sentence.",),
         lambda s: max(s.split(), key=len, default=""), lambda r, v: (sentence(r, 0, 6),)),
    Task(("snake_to_camel", "to_camel_case", "camelize"),
         [("name|identifier", "str", "a snake_case identifier")], "str",
         ("Convert a snake_case identifier to lowerCamelCase.",
          "Turn {a0}, written in snake_case, into camelCase: drop the underscores and capitalize every word after "
          "the first."),
         lambda s: s.split("_")[0] + "".join(p.capitalize() for p in s.split("_")[1:]),
         lambda r, v: ("_".join(r.choice(WORDS) for _ in range(r.randint(1, 4))),)),
    Task(("camel_to_snake", "to_snake_case", "underscore_name"),
         [("name|identifier", "str", "a camelCase identifier")], "str",
         ("Convert a camelCase identifier to snake_case.",
          "Insert an underscore before every upper-case letter of {a0} and lower-case the whole identifier."),
         lambda s: re.sub("([A-Z])", r"_\1", s).lower(), lambda r, v: (_camel(r),)),
    Task(("strip_punctuation", "remove_punctuation", "keep_alphanumerics"),
         [(TEXT_ARG, "str", "the text to clean")], "str",
         ("Remove every character of {a0} that is not a letter, a digit or a space.",
          "Return {a0} without its punctuation: keep only letters, digits and spaces."),
         lambda s: "".join(c for c in s if c.isalnum() or c == " "),
         lambda r, v: (" ".join(w + r.choice(["", "", ",", "!", "?", ".", ";"]) for w in sentence(r, 2, 5).split()),)),
    Task(("is_anagram", "are_anagrams", "same_letters"),
         [("first|a|left", "str", "the first phrase"), ("second|b|right", "str", "the second phrase")], "bool",
         ("Return True if {a0} and {a1} are anagrams of each other, ignoring case and spaces.",
          "Two phrases are anagrams when they use exactly the same letters the same number of times. Ignoring "
          "spaces and case, decide whether {a0} and {a1} are anagrams."),
         lambda a, b: sorted(a.replace(" ", "").lower()) == sorted(b.replace(" ", "").lower()),
         lambda r, v: _anagram_pair(r)),
    Task(("most_common_letter", "dominant_letter", "top_letter"),
         [(TEXT_ARG, "str", "a text containing at least one letter")], "str",
         ("Return the letter that occurs most often in {a0}, ignoring case and non-letters. If several letters "
          "are equally frequent, return {tie}.",),
         _most_common_letter, _one_sentence(1, 4),
         variants=[{"tie": "the one that appears first in the text", "mode": "first"},
                   {"tie": "the alphabetically smallest one", "mode": "alpha"}]),
    Task(("collapse_spaces", "normalize_whitespace", "squash_blanks"),
         [(TEXT_ARG, "str", "the text to normalise")], "str",
         ("Replace every run of whitespace in {a0} by a single space and strip leading and trailing whitespace.",),
         lambda s: " ".join(s.split()),
         lambda r, v: ("".join(r.choice([" ", "  ", "   "]) + w for w in sentence(r, 2, 4).split()) + r.choice(["", " "]),)),
    Task(("make_acronym", "acronym_of", "initials_of"),
         [("phrase|name|title", "str", "words separated by spaces or hyphens")], "str",
         ("Build an acronym from {a0}: take the first letter of every word, in upper case. Words are separated "
          "by spaces or hyphens.",),
         lambda s: "".join(w[0].upper() for w in re.split(r"[ -]+", s) if w),
         lambda r, v: (r.choice(["portable network graphics", "as soon as possible", "read-only memory",
                                 "light amplification by stimulated emission", "frequently asked questions",
                                 "point of sale", "self-contained underwater breathing apparatus",
                                 sentence(r, 2, 4)]),)),
    Task(("mask_all_but_last", "mask_secret", "hide_prefix"),
         [("secret|number|card", "str", "the string to mask")], "str",
         ("Replace every character of {a0} except the last {k} with '{ch}'. Strings of length {k} or less are "
          "returned unchanged.",),
         lambda s, k, ch: s if len(s) <= k else ch * (len(s) - k) + s[-k:],
         lambda r, v: ("".join(r.choice("0123456789") for _ in range(r.randint(2, 16))),),
         variants=[{"k": k, "ch": ch} for k in (2, 3, 4) for ch in "*#"]),
    Task(("interleave_strings", "zip_letters", "weave_strings"),
         [("first|a", "str", "the first string"), ("second|b", "str", "the second string")], "str",
         ("Merge {a0} and {a1} by taking characters alternately, starting with {a0}. When one string runs out, "
          "append the rest of the other.",),
         lambda a, b: "".join(x + y for x, y in zip(a, b)) + a[len(b):] + b[len(a):],
         lambda r, v: (r.choice(WORDS)[:r.randint(1, 5)], r.choice(WORDS)[:r.randint(1, 6)])),
    Task(("to_pig_latin", "pig_latin", "pigify"),
         [(TEXT_ARG, "str", "lowercase words separated by spaces")], "str",
         ("Translate each word of {a0} to Pig Latin: a word starting with a vowel gets 'way' appended; otherwise "
          "its leading consonants move to the end, followed by 'ay'. A word without vowels just gets 'ay'.",),
         _pig_latin, _one_sentence(1, 4)),
    Task(("is_pangram", "uses_every_letter", "contains_whole_alphabet"),
         [(TEXT_ARG, "str", "the sentence to check")], "bool",
         ("Return True if {a0} contains every letter of the English alphabet at least once, ignoring case.",),
         lambda s: set("abcdefghijklmnopqrstuvwxyz") <= set(s.lower()),
         lambda r, v: (r.choice(["The quick brown fox jumps over the lazy dog", "Pack my box with five dozen "
                                 "liquor jugs", "Sphinx of black quartz, judge my vow", sentence(r)]),)),
    Task(("letter_frequencies", "count_letters", "letter_tally"),
         [(WORD_ARG, "str", "the text to analyse")], "dict[str, int]",
         ("Return a dictionary mapping each letter in {a0} (lower-cased) to the number of times it occurs, in "
          "order of first appearance. Other characters are ignored.",),
         lambda s: dict(Counter(c for c in s.lower() if c.isalpha())),
         lambda r, v: (r.choice(WORDS).capitalize() + r.choice(["", "!", " 2"]),)),
    Task(("wrap_words", "greedy_wrap", "break_into_lines"),
         [(TEXT_ARG, "str", "words separated by spaces"), ("width|limit", "int", "the maximum line length")],
         "list[str]",
         ("Split {a0} into lines of at most {a1} characters, putting as many whole words on each line as fit. "
          "A word longer than {a1} gets a line of its own.",),
         _wrap, lambda r, v: (sentence(r, 3, 6), r.randint(8, 18))),
    Task(("longest_common_prefix", "shared_prefix", "common_start"),
         [("words|strings|names", "list[str]", "the strings to compare")], "str",
         ("Return the longest string that is a prefix of every string in {a0}; return '' if there is none or the "
          "list is empty.",),
         lambda ws: "" if not ws else next((ws[0][:i] for i in range(len(ws[0]) + 1)
                                            if any(not w.startswith(ws[0][:i + 1]) for w in ws)), ws[0]),
         lambda r, v: (lambda p: ([p + r.choice(WORDS)[:r.randint(0, 3)] for _ in range(r.randint(2, 3))],))(
             r.choice(["inter", "pre", "con", "", "re", "trans"]))),
    Task(("is_rotation", "is_rotated_copy", "rotation_of"),
         [("original|a", "str", "the original string"), ("candidate|b", "str", "the string to test")], "bool",
         ("Return True if {a1} can be obtained by rotating {a0}, i.e. by moving some characters from its front to "
          "its back.",),
         lambda a, b: len(a) == len(b) and b in a + a,
         lambda r, v: (lambda w: (w, r.choice([w[k:] + w[:k] for k in range(len(w))] + [w[::-1], w + "a"])))(
             r.choice(WORDS))),
    Task(("count_words_starting_with", "words_beginning_with", "initial_letter_count"),
         [(TEXT_ARG, "str", "words separated by spaces"), ("letter|ch", "str", "a single letter")], "int",
         ("Count the words in {a0} that begin with the letter {a1}, ignoring case.",),
         lambda s, c: sum(w.lower().startswith(c.lower()) for w in s.split()),
         lambda r, v: (lambda s: (s, r.choice(s.replace(" ", ""))))(sentence(r, 3, 8))),
    Task(("alternate_case", "zigzag_case", "sponge_case"),
         [(WORD_ARG, "str", "the text to transform")], "str",
         ("Return {a0} with its letters alternating between {start} case and the other case, starting with {start} "
          "case for the first letter. Non-letters are copied unchanged and do not affect the alternation.",),
         _alternate_case, _one_sentence(1, 3), variants=[{"start": "upper"}, {"start": "lower"}]),
    Task(("spell_digits", "digits_to_words", "read_out_digits"),
         [("number|digits|code", "str", "a string of decimal digits")], "str",
         ("Spell out every digit of {a0} as an English word and return the words joined by single spaces.",),
         lambda s: " ".join("zero one two three four five six seven eight nine".split()[int(c)] for c in s),
         lambda r, v: (str(r.randint(0, 99999)),)),
    Task(("vowel_consonant_counts", "count_vowels_and_consonants", "letter_kinds"),
         [(TEXT_ARG, "str", "the text to analyse")], "tuple[int, int]",
         ("Return a tuple (vowels, consonants) with the number of vowels (a, e, i, o, u) and of consonants among "
          "the letters of {a0}, ignoring case. Other characters are not counted.",),
         lambda s: (sum(c in "aeiou" for c in s.lower()), sum(c.isalpha() and c not in "aeiou" for c in s.lower())),
         _one_sentence(1, 3)),
    Task(("first_occurrences", "dedupe_letters", "drop_repeated_chars"),
         [(WORD_ARG, "str", "the input text")], "str",
         ("Remove repeated characters from {a0}, keeping only the first occurrence of each character.",),
         lambda s: "".join(dict.fromkeys(s)), lambda r, v: (r.choice(WORDS) + r.choice(WORDS),)),
    Task(("reads_same_backwards", "is_phrase_palindrome", "palindromic_phrase"),
         [(TEXT_ARG, "str", "a phrase")], "bool",
         ("Return True if {a0} reads the same forwards and backwards once spaces and punctuation are removed and "
          "case is ignored.",),
         lambda s: (lambda t: t == t[::-1])([c for c in s.lower() if c.isalnum()]),
         lambda r, v: (r.choice(["A man, a plan, a canal: Panama", "Was it a car or a cat I saw?", "No lemon, no melon",
                                 "Step on no pets", "Hello, world", sentence(r, 1, 3), "Never odd or even"]),)),
    Task(("rotate_letters", "caesar_cipher", "shift_letters"),
         [(TEXT_ARG, "str", "the message"), ("shift|k|offset", "int", "how far to shift, may be negative")], "str",
         ("Shift every letter of {a0} by {a1} positions in the alphabet, wrapping around from z to a. Keep the case "
          "of each letter and leave other characters unchanged.",),
         _caesar, lambda r, v: (sentence(r, 1, 3).capitalize() + r.choice(["", "!", "."]), r.randint(-5, 30))),
    # --- lists -------------------------------------------------------------------------------
    Task(("cumulative_sum", "running_total", "prefix_sums"),
         [(NUMS, "list[int]", "the input numbers")], "list[int]",
         ("Return a list whose i-th element is the sum of the first i + 1 elements of {a0}.",
          "Compute the running totals of {a0}."),
         lambda xs: [sum(xs[:i + 1]) for i in range(len(xs))], _some_ints(n_lo=0)),
    Task(("chunk_list", "split_into_chunks", "batched_list"),
         [("items|values", "list[int]", "the items to split"), ("size|n", "int", "the chunk length, at least 1")],
         "list[list[int]]",
         ("Split {a0} into consecutive chunks of length {a1}; the last chunk may be shorter.",),
         lambda xs, n: [xs[i:i + n] for i in range(0, len(xs), n)], lambda r, v: (int_list(r, 0, 9, 0, 7),
                                                                                    r.randint(1, 4))),
    Task(("flatten_once", "concat_sublists", "flatten_one_level"),
         [("nested|lists|groups", "list[list[int]]", "a list of lists")], "list[int]",
         ("Concatenate the inner lists of {a0} into one list, keeping their order.",),
         lambda xss: [x for xs in xss for x in xs],
         lambda r, v: ([int_list(r, 0, 9, 0, 3) for _ in range(r.randint(1, 4))],)),
    Task(("rotate_list", "rotate_items", "shift_elements"),
         [("items|values", "list[int]", "the list to rotate"), ("k|steps|n", "int", "a non-negative number of steps")],
         "list[int]",
         ("Rotate {a0} to the {direction} by {a1} positions and return the new list. {a1} may be larger than the "
          "length of the list; an empty list stays empty.",),
         _rotate, lambda r, v: (int_list(r, 0, 9, 0, 6), r.randint(0, 8)),
         variants=[{"direction": "left"}, {"direction": "right"}]),
    Task(("second_largest", "runner_up", "second_biggest"),
         [(NUMS, "list[int]", "the input numbers")], "int | None",
         ("Return the second largest distinct value in {a0}, or None if there are fewer than two distinct values.",),
         lambda xs: sorted(set(xs))[-2] if len(set(xs)) > 1 else None, _some_ints(n_lo=1, n_hi=6)),
    Task(("pairwise_differences", "consecutive_gaps", "deltas_of"),
         [(NUMS, "list[int]", "the input numbers")], "list[int]",
         ("Return the differences between consecutive elements of {a0}: element i of the result is "
          "{a0}[i + 1] - {a0}[i].",),
         lambda xs: [b - a for a, b in zip(xs, xs[1:])], _some_ints(n_lo=1)),
    Task(("count_increases", "count_rises", "number_of_increases"),
         [(NUMS, "list[int]", "measurements in time order")], "int",
         ("Count how many elements of {a0} are strictly greater than the element just before them.",),
         lambda xs: sum(b > a for a, b in zip(xs, xs[1:])), _some_ints()),
    Task(("moving_average", "sliding_mean", "window_averages"),
         [(NUMS, "list[float]", "the series"), ("window|k|size", "int", "the window length, at least 1")],
         "list[float]",
         ("Return the averages of every window of {a1} consecutive elements of {a0}, rounded to two decimals. "
          "Return an empty list if {a0} has fewer than {a1} elements.",),
         lambda xs, k: [round(sum(xs[i:i + k]) / k, 2) for i in range(len(xs) - k + 1)],
         lambda r, v: (int_list(r, 0, 10, 2, 6), r.randint(2, 3))),
    Task(("find_peaks", "peak_indices", "local_maxima"),
         [(NUMS, "list[int]", "the input numbers")], "list[int]",
         ("Return the indices of the elements of {a0} that are strictly greater than both of their neighbours. "
          "The first and last elements are never peaks.",),
         _peaks, _some_ints(0, 9, 3, 8)),
    Task(("merge_sorted", "merge_two_sorted", "combine_sorted"),
         [("left|a|first", "list[int]", "a list sorted in ascending order"),
          ("right|b|second", "list[int]", "another list sorted in ascending order")], "list[int]",
         ("Merge two lists that are each sorted in ascending order into one sorted list, without calling sort() "
          "or sorted().",),
         lambda a, b: sorted(a + b), lambda r, v: (sorted(int_list(r, 0, 20, 0, 4)), sorted(int_list(r, 0, 20, 1, 4)))),
    Task(("longest_increasing_run", "longest_rising_streak", "max_ascending_run"),
         [(NUMS, "list[int]", "the input numbers")], "int",
         ("Return the length of the longest run of consecutive elements of {a0} that are strictly increasing. An "
          "empty list has a run length of 0.",),
         _longest_run, _some_ints(0, 9, 0, 8)),
    Task(("split_by_sign", "partition_by_sign", "separate_signs"),
         [(NUMS, "list[int]", "the input numbers")], "tuple[list[int], list[int]]",
         ("Return a tuple (negatives, non_negatives) with the negative numbers and the remaining numbers of {a0}, "
          "each in their original order.",),
         lambda xs: ([x for x in xs if x < 0], [x for x in xs if x >= 0]), _some_ints(-9, 9)),
    Task(("elementwise_sum", "add_lists", "pad_and_add"),
         [("first|a|xs", "list[int]", "the first list"), ("second|b|ys", "list[int]", "the second list")], "list[int]",
         ("Add {a0} and {a1} element by element. If one list is shorter, treat its missing elements as 0.",),
         lambda a, b: [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))],
         lambda r, v: (int_list(r, 0, 9, 0, 4), int_list(r, 0, 9, 1, 5))),
    Task(("index_of_min", "argmin", "position_of_smallest"),
         [(NUMS, "list[int]", "the input numbers")], "int",
         ("Return the index of the smallest element of {a0}; if it occurs several times, return the first such "
          "index. Return -1 for an empty list.",),
         lambda xs: xs.index(min(xs)) if xs else -1, _some_ints(0, 9, 0, 6)),
    Task(("unique_in_order", "dedupe_keep_order", "drop_repeats"),
         [(NUMS, "list[int]", "the input numbers")], "list[int]",
         ("Return the elements of {a0} with repeated values removed, keeping the first occurrence of each value.",),
         lambda xs: list(dict.fromkeys(xs)), _some_ints(0, 5, 2, 8)),
    Task(("count_in_range", "count_between", "how_many_between"),
         [(NUMS, "list[int]", "the input numbers"), ("low|lo|lower", "int", "the lower bound"),
          ("high|hi|upper", "int", "the upper bound")], "int",
         ("Count the elements of {a0} that lie between {a1} and {a2}, both inclusive.",),
         lambda xs, lo, hi: sum(lo <= x <= hi for x in xs), lambda r, v: (int_list(r), r.randint(-5, 5), r.randint(5, 15))),
    Task(("product_except_self", "products_of_others", "leave_one_out_products"),
         [(NUMS, "list[int]", "the input numbers")], "list[int]",
         ("Return a list where element i is the product of all elements of {a0} except {a0}[i]. Do not use "
          "division.",),
         lambda xs: [math.prod(xs[:i] + xs[i + 1:]) for i in range(len(xs))], _some_ints(-3, 6, 2, 5)),
    Task(("max_window_sum", "best_window_total", "largest_k_sum"),
         [(NUMS, "list[int]", "the input numbers"), ("k|width", "int", "the window length")], "int",
         ("Return the largest sum of {a1} consecutive elements of {a0}. Assume 1 <= {a1} <= len({a0}).",),
         lambda xs, k: max(sum(xs[i:i + k]) for i in range(len(xs) - k + 1)),
         lambda r, v: (lambda xs: (xs, r.randint(1, len(xs))))(int_list(r, -5, 9, 2, 7))),
    Task(("majority_element", "dominant_value", "absolute_majority"),
         [("votes|" + NUMS, "list[int]", "the input numbers")], "int | None",
         ("Return the value that occurs more than len({a0}) // 2 times in {a0}, or None if there is no such value.",),
         lambda xs: next((x for x in xs if xs.count(x) > len(xs) // 2), None), _some_ints(1, 3, 1, 7)),
    Task(("every_nth", "take_every", "stride_items"),
         [("items|values", "list[int]", "the input list"), ("n|step", "int", "the stride, at least 1")], "list[int]",
         ("Return every {a1}-th element of {a0}, starting with the first one.",),
         lambda xs, n: xs[::n], lambda r, v: (int_list(r, 0, 30, 0, 9), r.randint(1, 4))),
    Task(("sum_{parity}_indices", "{parity}_position_total", "add_{parity}_positions"),
         [(NUMS, "list[int]", "the input numbers")], "int",
         ("Return the sum of the elements of {a0} whose index is {parity} (indices start at 0).",),
         lambda xs, parity: sum(xs[0 if parity == "even" else 1::2]), _some_ints(0, 9, 0, 7),
         variants=[{"parity": "even"}, {"parity": "odd"}]),
    Task(("most_frequent_value", "list_mode", "commonest_value"),
         [(NUMS, "list[int]", "a non-empty list of numbers")], "int",
         ("Return the value that occurs most often in {a0}; if several values tie, return the smallest of them.",),
         lambda xs: min(xs, key=lambda x: (-xs.count(x), x)), _some_ints(0, 5, 1, 8)),
    Task(("remove_all", "without_value", "drop_value"),
         [("items|values", "list[int]", "the input list"), ("value|target|x", "int", "the value to remove")],
         "list[int]",
         ("Return a new list with every occurrence of {a1} removed from {a0}.",),
         lambda xs, x: [y for y in xs if y != x], lambda r, v: (int_list(r, 0, 4), r.randint(0, 4))),
    Task(("count_pairs_with_sum", "pairs_adding_to", "two_sum_count"),
         [(NUMS, "list[int]", "the input numbers"), ("target|total", "int", "the required pair sum")], "int",
         ("Count the pairs of indices i < j such that {a0}[i] + {a0}[j] == {a1}.",),
         lambda xs, t: sum(a + b == t for a, b in combinations(xs, 2)),
         lambda r, v: (int_list(r, 0, 8, 2, 6), r.randint(4, 10))),
    Task(("move_zeros_to_end", "push_zeros_back", "zeros_last"),
         [(NUMS, "list[int]", "the input numbers")], "list[int]",
         ("Move every 0 in {a0} to the end while keeping the relative order of the other elements; return the new "
          "list.",),
         lambda xs: [x for x in xs if x] + [0] * xs.count(0), _some_ints(0, 4, 2, 7)),
    Task(("clip_values", "cap_list", "bound_all"),
         [(NUMS, "list[int]", "the input numbers"), ("low|floor", "int", "the smallest allowed value"),
          ("high|ceiling", "int", "the largest allowed value")], "list[int]",
         ("Return a copy of {a0} in which values below {a1} are replaced by {a1} and values above {a2} by {a2}.",),
         lambda xs, lo, hi: [min(max(x, lo), hi) for x in xs], lambda r, v: (int_list(r), 0, r.randint(5, 12))),
    # --- math and number theory --------------------------------------------------------------
    Task(("digital_root", "repeated_digit_sum", "reduce_to_one_digit"),
         [("n|number", "int", "a non-negative integer")], "int",
         ("Repeatedly add up the decimal digits of {a0} until a single digit remains, and return that digit.",),
         lambda n: 0 if n == 0 else 1 + (n - 1) % 9, _one_int(0, 99999)),
    Task(("is_perfect_number", "is_perfect", "perfect_check"),
         [("n|number", "int", "a positive integer")], "bool",
         ("Return True if {a0} equals the sum of its proper divisors (its divisors smaller than itself), as "
          "6 = 1 + 2 + 3 does.",),
         lambda n: n == sum(d for d in range(1, n) if n % d == 0), lambda r, v: (r.choice([6, 28, 496, 12, 1, 27, 8128]),)),
    Task(("collatz_steps", "steps_to_one", "hailstone_length"),
         [("n|start", "int", "a positive integer")], "int",
         ("Return how many steps the Collatz process needs to reach 1 from {a0}: halve an even number, replace an "
          "odd number n by 3 * n + 1.",),
         _collatz, _one_int(1, 30)),
    Task(("gcd_of_list", "list_gcd", "common_divisor_of_all"),
         [(NUMS, "list[int]", "a non-empty list of positive integers")], "int",
         ("Return the greatest common divisor of all the numbers in {a0}.",),
         lambda xs: math.gcd(*xs), lambda r, v: (lambda g: ([g * r.randint(1, 9) for _ in range(r.randint(2, 4))],))(
             r.choice([1, 2, 3, 4, 6, 12]))),
    Task(("least_common_multiple", "lcm_pair", "smallest_common_multiple"),
         [("a|x", "int", "a positive integer"), ("b|y", "int", "a positive integer")], "int",
         ("Return the least common multiple of the positive integers {a0} and {a1}.",),
         math.lcm, lambda r, v: (r.randint(1, 24), r.randint(1, 24))),
    Task(("sum_of_multiples", "multiples_total", "sum_multiples_below"),
         [("limit|n|bound", "int", "the exclusive upper bound")], "int",
         ("Return the sum of all natural numbers below {a0} that are multiples of {x} or {y}.",),
         lambda n, x, y: sum(k for k in range(n) if k % x == 0 or k % y == 0), _one_int(1, 30),
         variants=[{"x": x, "y": y} for x, y in ((3, 5), (2, 7), (4, 6), (3, 7))]),
    Task(("is_armstrong", "is_narcissistic", "armstrong_check"),
         [("n|number", "int", "a non-negative integer")], "bool",
         ("Return True if {a0} equals the sum of its digits each raised to the power of the number of digits, like "
          "153 = 1**3 + 5**3 + 3**3.",),
         lambda n: n == sum(int(d) ** len(str(n)) for d in str(n)),
         lambda r, v: (r.choice([153, 370, 371, 407, 9474, 10, 100, 9, 154, 1634]),)),
    Task(("count_primes_below", "prime_count", "primes_under"),
         [("n|limit", "int", "a non-negative integer")], "int",
         ("Return how many prime numbers are strictly smaller than {a0}.",),
         lambda n: sum(map(is_prime_number, range(n))), _one_int(0, 60)),
    Task(("count_set_bits", "popcount", "ones_in_binary"),
         [("n|value", "int", "a non-negative integer")], "int",
         ("Return the number of 1 bits in the binary representation of {a0}.",),
         lambda n: bin(n).count("1"), _one_int(0, 300)),
    Task(("reverse_integer", "reverse_number_digits", "mirror_number"),
         [("n|number", "int", "any integer")], "int",
         ("Reverse the decimal digits of {a0}, keeping its sign; leading zeros of the result disappear.",),
         lambda n: (-1 if n < 0 else 1) * int(str(abs(n))[::-1]), _one_int(-9999, 99999)),
    Task(("is_power_of_{b}", "power_of_{b}_check", "check_power_of_{b}"),
         [("n|number", "int", "any integer")], "bool",
         ("Return True if {a0} is a power of {b} (including {b}**0 = 1), otherwise False. Zero and negative numbers "
          "are never powers of {b}.",),
         lambda n, b: n > 0 and b ** round(math.log(n, b)) == n,
         lambda r, v: (r.choice([1, 0, -v["b"], v["b"] ** r.randint(1, 5), v["b"] ** r.randint(1, 4) + 1]),),
         variants=[{"b": b} for b in (2, 3, 5)]),
    Task(("factorial_trailing_zeros", "zeros_at_end_of_factorial", "trailing_zeros_of_factorial"),
         [("n|number", "int", "a non-negative integer")], "int",
         ("Return the number of trailing zeros of {a0}! (the factorial of {a0}) without computing the factorial.",),
         lambda n: sum(n // 5 ** k for k in range(1, 8)), _one_int(0, 200)),
    Task(("sum_proper_divisors", "aliquot_sum", "divisor_total"),
         [("n|number", "int", "a positive integer")], "int",
         ("Return the sum of the positive divisors of {a0} that are smaller than {a0}.",),
         lambda n: sum(d for d in range(1, n) if n % d == 0), _one_int(1, 60)),
    Task(("roman_to_int", "parse_roman", "from_roman"),
         [("numeral|roman|s", "str", "a valid Roman numeral in upper case")], "int",
         ("Convert a Roman numeral (I, V, X, L, C, D, M, with subtractive pairs such as IV and CM) to an integer.",),
         lambda s: next(n for n in range(1, 4000) if to_roman(n) == s), lambda r, v: (to_roman(r.randint(1, 3999)),)),
    Task(("squares_up_to", "perfect_squares_until", "list_squares"),
         [("n|limit", "int", "the inclusive upper bound")], "list[int]",
         ("Return all perfect squares that are at least 1 and at most {a0}, in increasing order.",),
         lambda n: [k * k for k in range(1, math.isqrt(max(n, 0)) + 1)], _one_int(0, 60)),
    Task(("population_variance", "variance_of", "spread_squared"),
         [(NUMS, "list[float]", "a non-empty list of numbers")], "float",
         ("Return the population variance of {a0} (the mean of the squared deviations from the mean), rounded to "
          "three decimals.",),
         lambda xs: round(sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs), 3), _some_ints(0, 10, 1, 5)),
    Task(("weighted_average", "weighted_mean", "average_with_weights"),
         [("values|scores", "list[float]", "the values"), ("weights", "list[float]", "one positive weight per value")],
         "float",
         ("Return the average of {a0} weighted by {a1}, rounded to two decimals.",),
         lambda xs, ws: round(sum(x * w for x, w in zip(xs, ws)) / sum(ws), 2),
         lambda r, v: (lambda n: ([r.randint(50, 100) for _ in range(n)], [r.randint(1, 4) for _ in range(n)]))(
             r.randint(2, 4))),
    Task(("clamp", "bound_value", "limit_to_range"),
         [("value|x", "int", "the value"), ("low|lo", "int", "the lower bound"), ("high|hi", "int", "the upper bound")],
         "int",
         ("Return {a0} if it lies between {a1} and {a2}; otherwise return the nearer bound.",),
         lambda x, lo, hi: min(max(x, lo), hi), lambda r, v: (r.randint(-20, 20), r.randint(-10, 0), r.randint(1, 10))),
    Task(("percent_change", "relative_change_percent", "growth_percent"),
         [("old|before", "float", "the starting value, never zero"), ("new|after", "float", "the final value")],
         "float",
         ("Return the percentage change from {a0} to {a1}, rounded to one decimal place.",),
         lambda a, b: round((b - a) / a * 100, 1), lambda r, v: (r.randint(10, 200), r.randint(0, 250))),
    Task(("is_happy_number", "happy_number_check", "reaches_one"),
         [("n|number", "int", "a positive integer")], "bool",
         ("Replace {a0} repeatedly by the sum of the squares of its digits. Return True if this reaches 1 and "
          "False if it loops forever without reaching 1.",),
         _is_happy, _one_int(1, 50)),
    Task(("product_of_digits", "digit_product", "multiply_digits_of"),
         [("n|number", "int", "a non-negative integer")], "int",
         ("Return the product of all decimal digits of {a0}.",),
         lambda n: math.prod(int(d) for d in str(n)), _one_int(0, 9999)),
    Task(("lucas_number", "nth_lucas", "lucas_term"),
         [("n|index", "int", "a non-negative index")], "int",
         ("Return the {a0}-th Lucas number, where L(0) = 2, L(1) = 1 and L(n) = L(n - 1) + L(n - 2).",),
         _lucas, _one_int(0, 15)),
    Task(("binomial", "n_choose_k", "pascal_entry"),
         [("n|total", "int", "the number of items"), ("k|chosen", "int", "how many are chosen")], "int",
         ("Return the number of ways to choose {a1} items out of {a0}, using the recurrence "
          "C(n, k) = C(n - 1, k - 1) + C(n - 1, k). Return 0 when {a1} > {a0}.",),
         math.comb, lambda r, v: (r.randint(0, 10), r.randint(0, 6))),
    Task(("integer_sqrt", "floor_sqrt", "isqrt_by_bisection"),
         [("n|number", "int", "a non-negative integer")], "int",
         ("Return the largest integer r with r * r <= {a0}, using binary search instead of floating point.",),
         math.isqrt, _one_int(0, 2000)),
    Task(("next_prime", "smallest_prime_after", "prime_after"),
         [("n|number", "int", "any integer")], "int",
         ("Return the smallest prime number strictly greater than {a0}.",),
         lambda n: next(k for k in range(n + 1, n + 200) if is_prime_number(k)), _one_int(-3, 100)),
    Task(("count_distinct_prime_factors", "distinct_prime_divisors", "prime_factor_variety"),
         [("n|number", "int", "an integer greater than 1")], "int",
         ("Return how many different prime numbers divide {a0}.",),
         lambda n: sum(1 for p in range(2, n + 1) if n % p == 0 and is_prime_number(p)), _one_int(2, 400)),
    # --- recursion and combinatorics ---------------------------------------------------------
    Task(("all_subsets", "power_set", "subsets_of"),
         [("items|values", "list[int]", "distinct numbers")], "list[list[int]]",
         ("Return all subsets of {a0}, each keeping the original element order, sorted by length and then "
          "lexicographically.",),
         lambda xs: sorted((list(c) for k in range(len(xs) + 1) for c in combinations(xs, k)), key=lambda s: (len(s), s)),
         lambda r, v: (r.sample(range(1, 9), r.randint(0, 3)),)),
    Task(("string_permutations", "all_arrangements", "letter_orders"),
         [(WORD_ARG, "str", "a short string")], "list[str]",
         ("Return every distinct permutation of the characters of {a0}, sorted alphabetically. Solve it "
          "recursively.",),
         lambda s: sorted(set("".join(p) for p in permutations(s))),
         lambda r, v: (r.choice(["ab", "abc", "aab", "xyz", "dog", "aa", "a", "", "bob", "cat"]),)),
    Task(("nested_sum", "deep_sum", "sum_nested"),
         [("data|nested|tree", "list", "a list whose items are integers or further lists")], "int",
         ("Return the sum of all integers in {a0}, which may contain lists nested to any depth.",),
         _nested_sum, lambda r, v: (_nested(r),)),
    Task(("nesting_depth", "max_depth", "list_depth"),
         [("data|nested|tree", "list", "a list whose items are integers or further lists")], "int",
         ("Return the maximum nesting depth of the list {a0}: a list without inner lists (even an empty one) has "
          "depth 1.",),
         _depth, lambda r, v: (_nested(r, 3),)),
    Task(("count_grid_paths", "lattice_paths", "grid_routes"),
         [("rows|m|height", "int", "number of rows, at least 1"), ("cols|n|width", "int", "number of columns, at least 1")],
         "int",
         ("Count the paths from the top-left cell to the bottom-right cell of a grid with {a0} rows and {a1} "
          "columns when every move goes one cell right or one cell down.",),
         lambda m, n: math.comb(m + n - 2, m - 1), lambda r, v: (r.randint(1, 5), r.randint(1, 5))),
    Task(("hanoi_moves", "tower_of_hanoi", "solve_hanoi"),
         [("n|disks", "int", "the number of disks")], "list[tuple[str, str]]",
         ("Return the moves that transfer {a0} disks from peg 'A' to peg 'C' using peg 'B', as (from, to) pairs, "
          "following the classic recursive solution.",),
         _hanoi, _one_int(0, 2)),
    Task(("flatten_deep", "fully_flatten", "flatten_any_depth"),
         [("data|nested|tree", "list", "a list whose items are integers or further lists")], "list[int]",
         ("Return all integers of {a0}, which may be nested to any depth, as one flat list in left-to-right order.",),
         _flatten, lambda r, v: (_nested(r),)),
    Task(("count_stair_climbs", "ways_to_climb", "staircase_ways"),
         [("n|steps_total|height", "int", "the number of steps, at least 0")], "int",
         ("Return the number of distinct ways to climb a staircase of {a0} steps if each move climbs {steps_text} "
          "steps.",),
         _stairs, _one_int(0, 10),
         variants=[{"steps": (1, 2), "steps_text": "1 or 2"}, {"steps": (1, 2, 3), "steps_text": "1, 2 or 3"},
                   {"steps": (1, 3), "steps_text": "1 or 3"}]),
    Task(("count_no_adjacent_ones", "binary_strings_without_11", "sparse_bitstrings"),
         [("n|length", "int", "the string length")], "int",
         ("Count the binary strings of length {a0} that contain no two adjacent 1s.",),
         lambda n: sum("11" not in format(i, f"0{n}b") for i in range(2 ** n)) if n else 1, _one_int(0, 10)),
    Task(("binary_strings", "all_bit_strings", "bitstrings_of_length"),
         [("n|length", "int", "the string length")], "list[str]",
         ("Return all strings of {a0} characters made of '0' and '1', in increasing numeric order.",),
         lambda n: [format(i, f"0{n}b") for i in range(2 ** n)] if n else [""], _one_int(1, 3)),
    # --- dictionaries ------------------------------------------------------------------------
    Task(("group_keys_by_value", "invert_mapping", "reverse_lookup"),
         [("mapping|d|table", "dict[str, int]", "the dictionary to invert")], "dict[int, list[str]]",
         ("Invert {a0}: map each value to the list of keys that had that value, in the order the keys appear.",),
         lambda d: {v: [k for k in d if d[k] == v] for v in dict.fromkeys(d.values())},
         lambda r, v: ({w: r.randint(1, 3) for w in r.sample(WORDS, r.randint(1, 4))},)),
    Task(("merge_counts", "add_counters", "combine_tallies"),
         [("first|a", "dict[str, int]", "counts by key"), ("second|b", "dict[str, int]", "more counts by key")],
         "dict[str, int]",
         ("Combine two dictionaries of counts: keys from both appear in the result, and the counts of shared keys "
          "are added.",),
         lambda a, b: {k: a.get(k, 0) + b.get(k, 0) for k in dict.fromkeys([*a, *b])},
         lambda r, v: (_scores(r, 1, 3), _scores(r, 1, 3))),
    Task(("word_counts", "tally_words", "word_frequency"),
         [(TEXT_ARG, "str", "words separated by whitespace")], "dict[str, int]",
         ("Return a dictionary mapping each word of {a0} (lower-cased) to how many times it occurs.",),
         lambda s: dict(Counter(s.lower().split())),
         lambda r, v: (sentence(r, 2, 6, ["the", "cat", "The", "dog", "a", "sat", "ran"]),)),
    Task(("group_by_length", "bucket_by_length", "words_by_size"),
         [("words|strings", "list[str]", "the strings to group")], "dict[int, list[str]]",
         ("Group the strings in {a0} by length: return a dictionary from length to the list of strings of that "
          "length, in input order.",),
         lambda ws: {n: [w for w in ws if len(w) == n] for n in dict.fromkeys(map(len, ws))},
         lambda r, v: (sentence(r, 1, 5).split(),)),
    Task(("top_k_keys", "best_scorers", "highest_keys"),
         [("scores|ratings", "dict[str, int]", "a score for each name"), ("k|n|count", "int", "how many keys to return")],
         "list[str]",
         ("Return the {a1} keys of {a0} with the highest values, highest first; ties are broken alphabetically.",),
         lambda d, k: sorted(d, key=lambda x: (-d[x], x))[:k], lambda r, v: (_scores(r, 2, 5), r.randint(1, 3))),
    Task(("filter_by_value", "keep_entries", "select_items"),
         [("mapping|d|prices", "dict[str, int]", "the dictionary to filter"), ("threshold|limit", "int", "the cut-off")],
         "dict[str, int]",
         ("Return a new dictionary with only the entries of {a0} whose value is {cmp_text} {a1}.",),
         lambda d, t, op, cmp_text: {k: x for k, x in d.items() if {">=": x >= t, ">": x > t, "<": x < t}[op]},
         lambda r, v: (_scores(r, 2, 5), r.randint(5, 15)),
         variants=[{"op": ">=", "cmp_text": "at least"}, {"op": ">", "cmp_text": "greater than"},
                   {"op": "<", "cmp_text": "less than"}]),
    Task(("key_of_max", "argmax_key", "best_key"),
         [("mapping|d|scores", "dict[str, int]", "the dictionary to search")], "str | None",
         ("Return the key of {a0} with the largest value; if several keys share it, return the one that comes "
          "first alphabetically. Return None for an empty dictionary.",),
         lambda d: min(d, key=lambda k: (-d[k], k)) if d else None, lambda r, v: (_scores(r, 0, 4),)),
    Task(("get_path", "dig", "lookup_dotted"),
         [("data|config", "dict", "nested dictionaries"), ("path|key_path", "str", "keys joined by dots"),
          ("default|fallback", "object", "returned when a key is missing")], "object",
         ("Follow the dot-separated keys in {a1} through the nested dictionaries in {a0} and return the value "
          "found there, or {a2} if some key is missing.",),
         _get_path, lambda r, v: _dotted(r)),
    Task(("count_distinct_values", "distinct_value_count", "number_of_unique_values"),
         [("mapping|d", "dict[str, int]", "the dictionary to inspect")], "int",
         ("Return how many different values occur in {a0}.",),
         lambda d: len(set(d.values())), lambda r, v: ({w: r.randint(1, 3) for w in r.sample(WORDS, r.randint(0, 4))},)),
    Task(("zip_to_dict", "lists_to_dict", "pair_up"),
         [("keys|names", "list[str]", "the keys"), ("values|numbers", "list[int]", "the values")], "dict[str, int]",
         ("Build a dictionary that maps {a0}[i] to {a1}[i]. Extra items of the longer list are ignored; if a key "
          "repeats, the later value wins.",),
         lambda ks, vs: dict(zip(ks, vs)),
         lambda r, v: ([r.choice(["a", "b", "c", "d"]) for _ in range(r.randint(1, 4))], int_list(r, 0, 9, 1, 4))),
    Task(("totals_by_key", "sum_by_key", "aggregate_pairs"),
         [("pairs|records|entries", "list[tuple[str, int]]", "(key, amount) pairs")], "dict[str, int]",
         ("Add up the amounts in {a0} per key and return a dictionary from key to total, keys in order of first "
          "appearance.",),
         lambda ps: {k: sum(x for kk, x in ps if kk == k) for k in dict.fromkeys(k for k, _ in ps)},
         lambda r, v: ([(r.choice(["rent", "food", "fun"]), r.randint(1, 50)) for _ in range(r.randint(1, 4))],)),
    # --- parsing -----------------------------------------------------------------------------
    Task(("parse_key_values", "parse_settings", "parse_pairs"),
         [("text|spec|line", "str", "the encoded pairs")], "dict[str, int]",
         ("Parse a string like {example} into a dictionary from each key to its integer value. Pairs are separated "
          "by '{ps}' and each key is separated from its value by '{kvs}'. An empty string gives an empty "
          "dictionary.",),
         _key_values, _kv_text,
         variants=[{"ps": ";", "kvs": "=", "example": "'a=1;b=2'"}, {"ps": ",", "kvs": ":", "example": "'a:1,b:2'"},
                   {"ps": "&", "kvs": "=", "example": "'a=1&b=2'"}]),
    Task(("sum_csv_numbers", "total_of_csv", "add_comma_separated"),
         [("text|line|csv", "str", "integers separated by commas")], "int",
         ("{a0} contains integers separated by commas, possibly with spaces around them. Return their sum; an "
          "empty string sums to 0.",),
         lambda s: sum(int(p) for p in s.split(",") if p.strip()),
         lambda r, v: (r.choice([",", ", ", " , "]).join(map(str, int_list(r, -9, 50, 0, 5))),)),
    Task(("parse_duration", "duration_to_seconds", "seconds_in_duration"),
         [("text|duration|spec", "str", "for example '1h30m' or '45s'")], "int",
         ("Convert a duration such as '1h30m' or '45s' to a number of seconds. The duration is a sequence of "
          "integers each followed by h, m or s; each unit appears at most once.",),
         _duration, lambda r, v: (_duration_text(r),)),
    Task(("is_valid_ipv4", "check_ipv4", "valid_ip_address"),
         [("address|ip|text", "str", "the string to validate")], "bool",
         ("Return True if {a0} is a valid IPv4 address: four decimal numbers from 0 to 255 separated by dots, "
          "without leading zeros (except for 0 itself).",),
         _valid_ipv4,
         lambda r, v: (r.choice(["192.168.0.1", "255.255.255.255", "256.1.1.1", "1.2.3", "01.2.3.4", "10.0.0.0",
                                 "a.b.c.d", "1.2.3.4.5", "127.0.0.1", "8.8.8.08"]),)),
    Task(("extract_integers", "numbers_in_text", "find_numbers"),
         [(TEXT_ARG, "str", "free text")], "list[int]",
         ("Return all integers that appear in {a0}, in order. A '-' directly before digits makes the number "
          "negative.",),
         lambda s: [int(x) for x in re.findall(r"-?\d+", s)],
         lambda r, v: (" ".join(r.choice(WORDS + [str(r.randint(-50, 500))] * 3) for _ in range(r.randint(3, 7))),)),
    Task(("minutes_since_midnight", "clock_to_minutes", "time_to_minutes"),
         [("time|clock|hhmm", "str", "a 24-hour time 'HH:MM'")], "int",
         ("Convert the 24-hour time {a0}, written 'HH:MM', into the number of minutes since midnight.",),
         lambda t: int(t[:2]) * 60 + int(t[3:]), lambda r, v: (_clock(r),)),
    Task(("add_minutes", "advance_clock", "shift_time"),
         [("time|clock", "str", "a 24-hour time 'HH:MM'"), ("minutes|delta", "int", "minutes to add, may be negative")],
         "str",
         ("{a0} is a 24-hour time 'HH:MM'. Return the time {a1} minutes later in the same format, wrapping around "
          "midnight. {a1} may be negative.",),
         _add_minutes, lambda r, v: (_clock(r), r.randint(-200, 2000))),
    Task(("brackets_balanced", "is_balanced", "check_brackets"),
         [("text|code|expr", "str", "text that may contain brackets")], "bool",
         ("Return True if every bracket in {a0} — (), [] and {{}} — is closed by the matching bracket in the right "
          "order. Other characters are ignored.",),
         _balanced, lambda r, v: (_bracket_text(r),)),
    Task(("eval_rpn", "evaluate_postfix", "rpn_calculator"),
         [("tokens|expr", "list[str]", "operands and operators in postfix order")], "int",
         ("Evaluate an arithmetic expression in reverse Polish notation given as a list of tokens. The operators are "
          "+, - and *; operands are integers.",),
         _rpn, lambda r, v: (_rpn_tokens(r),)),
    Task(("hex_to_rgb", "parse_hex_color", "color_components"),
         [("color|code|hex_code", "str", "a colour written '#RRGGBB'")], "tuple[int, int, int]",
         ("Convert a colour written as '#RRGGBB' (hexadecimal digits, any case) into a tuple of its red, green and "
          "blue values.",),
         lambda s: tuple(int(s[i:i + 2], 16) for i in (1, 3, 5)),
         lambda r, v: ("#" + "".join(r.choice("0123456789abcdefABCDEF") for _ in range(6)),)),
    Task(("compare_versions", "version_cmp", "cmp_version"),
         [("a|left|v1", "str", "a version like '1.10.2'"), ("b|right|v2", "str", "another version")], "int",
         ("Compare two version strings made of dot-separated non-negative integers, like '1.10.2'. Return -1 if {a0} "
          "is older, 1 if it is newer and 0 if they are equal; missing parts count as 0.",),
         _compare_versions,
         lambda r, v: tuple(".".join(str(r.randint(0, 12)) for _ in range(r.randint(1, 3))) for _ in range(2))),
    Task(("parse_query", "query_params", "split_query_string"),
         [("url|link", "str", "a URL")], "dict[str, str]",
         ("Return the query parameters of {a0} (the part after '?') as a dictionary from name to value. Return an "
          "empty dictionary when there is no query.",),
         _query, lambda r, v: (_url(r),)),
    Task(("add_fractions", "fraction_sum", "sum_of_fractions"),
         [("a|x|first", "str", "a fraction 'p/q'"), ("b|y|second", "str", "a fraction 'p/q'")], "str",
         ("Add the fractions {a0} and {a1}, both written 'p/q' with positive integers, and return the sum in lowest "
          "terms in the same format.",),
         _add_fractions, lambda r, v: (_fraction(r), _fraction(r))),
    # --- sorting -----------------------------------------------------------------------------
    Task(("sort_by_length", "order_words", "length_then_alpha"),
         [("words|strings", "list[str]", "the words to sort")], "list[str]",
         ("Sort {a0} by length, {order}, and alphabetically among words of the same length.",),
         lambda ws, order: sorted(ws, key=lambda w: (len(w) * (1 if order.startswith("short") else -1), w)),
         lambda r, v: (sentence(r, 2, 6).split(),),
         variants=[{"order": "shortest first"}, {"order": "longest first"}]),
    Task(("sort_by_second", "rank_pairs", "order_by_score"),
         [("pairs|results", "list[tuple[str, int]]", "(name, score) pairs")], "list[tuple[str, int]]",
         ("Sort the (name, score) pairs in {a0} by score from highest to lowest; pairs with equal scores keep their "
          "original order.",),
         lambda ps: sorted(ps, key=lambda p: -p[1]), lambda r, v: (list(_scores(r, 2, 4).items()),)),
    Task(("sort_by_vowel_count", "order_by_vowels", "vowel_sorted"),
         [("words|strings", "list[str]", "the words to sort")], "list[str]",
         ("Return {a0} sorted by the number of vowels in each word, fewest first; words with the same count keep "
          "their original order.",),
         lambda ws: sorted(ws, key=lambda w: sum(c in "aeiou" for c in w)), lambda r, v: (sentence(r, 2, 5).split(),)),
    Task(("kth_smallest", "k_smallest_value", "select_kth"),
         [(NUMS, "list[int]", "the input numbers"), ("k|rank", "int", "1 for the minimum, at most len(numbers)")], "int",
         ("Return the {a1}-th smallest element of {a0} ({a1} = 1 means the minimum). Duplicates count separately.",),
         lambda xs, k: sorted(xs)[k - 1], lambda r, v: (lambda xs: (xs, r.randint(1, len(xs))))(int_list(r))),
    Task(("count_inversions", "inversion_count", "out_of_order_pairs"),
         [(NUMS, "list[int]", "the input numbers")], "int",
         ("Count the pairs (i, j) with i < j and {a0}[i] > {a0}[j].",),
         lambda xs: sum(a > b for a, b in combinations(xs, 2)), _some_ints(0, 9, 0, 6)),
    Task(("sort_people", "order_by_age", "sort_records"),
         [("people|records", "list[tuple[str, int]]", "(name, age) pairs")], "list[tuple[str, int]]",
         ("Sort the (name, age) records in {a0} {order}; people of the same age are ordered by name.",),
         lambda ps, order: sorted(ps, key=lambda p: (p[1] if order == "youngest first" else -p[1], p[0])),
         lambda r, v: _people(r), variants=[{"order": "youngest first"}, {"order": "oldest first"}]),
    Task(("dense_ranks", "rank_values", "rank_scores"),
         [("scores|" + NUMS, "list[int]", "the input numbers")], "list[int]",
         ("Replace each number in {a0} by its dense rank: the largest value gets rank 1, the next smaller distinct "
          "value rank 2, and equal values share a rank.",),
         _dense_ranks, _some_ints(0, 9, 1, 6)),
    Task(("sort_by_frequency", "frequency_sort", "order_by_count"),
         [(NUMS, "list[int]", "the input numbers")], "list[int]",
         ("Sort {a0} so that more frequent values come first; values with the same frequency are ordered from "
          "smallest to largest, and equal values stay together.",),
         lambda xs: sorted(xs, key=lambda x: (-xs.count(x), x)), _some_ints(0, 5, 2, 8)),
    Task(("sort_case_insensitive", "casefold_sort", "sort_ignoring_case"),
         [("words|names", "list[str]", "the strings to sort")], "list[str]",
         ("Sort {a0} alphabetically, ignoring case; strings that differ only in case keep their original order.",),
         lambda ws: sorted(ws, key=str.lower), lambda r, v: ([w.capitalize() if r.random() < 0.5 else w
                                                               for w in sentence(r, 2, 5).split()],)),
    Task(("merge_intervals", "union_of_intervals", "coalesce_ranges"),
         [("intervals|ranges|spans", "list[tuple[int, int]]", "(start, end) pairs with start <= end")],
         "list[tuple[int, int]]",
         ("Merge overlapping closed intervals given as (start, end) pairs and return the merged intervals sorted by "
          "start. Intervals that only touch (one's end equals the next one's start) are merged too.",),
         _merge_intervals, lambda r, v: (_intervals(r),)),
    Task(("covered_length", "total_coverage", "union_length"),
         [("intervals|ranges|spans", "list[tuple[int, int]]", "(start, end) pairs with start <= end")], "int",
         ("Return the total length of the number line covered by the half-open intervals [start, end) in {a0}; "
          "overlapping parts count once.",),
         lambda xs: sum(e - s for s, e in _merge_intervals(xs)), lambda r, v: (_intervals(r),)),
    # --- geometry ----------------------------------------------------------------------------
    Task(("euclidean_distance", "point_distance", "distance_between"),
         [("p|a|start", "tuple[float, float]", "the first point (x, y)"),
          ("q|b|end", "tuple[float, float]", "the second point (x, y)")], "float",
         ("Return the straight-line distance between the points {a0} and {a1}, rounded to two decimals.",),
         lambda p, q: round(math.dist(p, q), 2),
         lambda r, v: ((r.randint(-5, 5), r.randint(-5, 5)), (r.randint(-5, 5), r.randint(-5, 5))),
         imports=("import math",)),
    Task(("polygon_area", "shoelace_area", "area_of_polygon"),
         [("vertices|points|corners", "list[tuple[int, int]]", "the corners in order")], "float",
         ("Return the area of the simple polygon whose vertices are listed in order in {a0}, using the shoelace "
          "formula.",),
         _shoelace, lambda r, v: (_polygon(r),)),
    Task(("point_in_rectangle", "inside_box", "contains_point"),
         [("point|p", "tuple[int, int]", "the point (x, y)"),
          ("rect|box", "tuple[int, int, int, int]", "(x_min, y_min, x_max, y_max)")], "bool",
         ("Return True if {a0} lies inside or on the border of the axis-aligned rectangle {a1} = "
          "(x_min, y_min, x_max, y_max).",),
         lambda p, b: b[0] <= p[0] <= b[2] and b[1] <= p[1] <= b[3],
         lambda r, v: ((r.randint(-5, 8), r.randint(-5, 8)), _rect(r))),
    Task(("overlap_area", "rectangle_overlap", "shared_area"),
         [("a|first", "tuple[int, int, int, int]", "(x_min, y_min, x_max, y_max)"),
          ("b|second", "tuple[int, int, int, int]", "(x_min, y_min, x_max, y_max)")], "int",
         ("Return the area of the overlap of two axis-aligned rectangles given as (x_min, y_min, x_max, y_max), or 0 "
          "if they do not overlap.",),
         _overlap, lambda r, v: (_rect(r), _rect(r))),
    Task(("circle_{what}", "{what}_of_circle", "compute_circle_{what}"),
         [("radius|r", "float", "the radius")], "float",
         ("Return the {what} of a circle with radius {a0}, rounded to two decimals.",),
         lambda x, what: round(math.pi * x * x if what == "area" else 2 * math.pi * x, 2), _one_int(0, 10),
         variants=[{"what": "area"}, {"what": "circumference"}], imports=("import math",)),
    Task(("triangle_kind", "classify_triangle", "triangle_type"),
         [("a|x", "int", "a side length"), ("b|y", "int", "a side length"), ("c|z", "int", "a side length")], "str",
         ("Classify a triangle by its side lengths: return 'equilateral', 'isosceles' or 'scalene', or 'invalid' if "
          "the sides cannot form a triangle with positive area.",),
         _triangle_kind, lambda r, v: r.choice([(3, 3, 3), (2, 2, 3), (3, 4, 5), (1, 2, 3), (5, 5, 9), (0, 1, 1),
                                                (r.randint(1, 9), r.randint(1, 9), r.randint(1, 9))])),
    Task(("manhattan_distance", "taxicab_distance", "grid_distance"),
         [("p|a", "tuple[int, int]", "the first point"), ("q|b", "tuple[int, int]", "the second point")], "int",
         ("Return the Manhattan distance between {a0} and {a1}: the sum of the absolute differences of their "
          "coordinates.",),
         lambda p, q: abs(p[0] - q[0]) + abs(p[1] - q[1]),
         lambda r, v: ((r.randint(-9, 9), r.randint(-9, 9)), (r.randint(-9, 9), r.randint(-9, 9)))),
    Task(("slope", "line_slope", "gradient_between"),
         [("p|a", "tuple[int, int]", "the first point"), ("q|b", "tuple[int, int]", "the second point")], "float | None",
         ("Return the slope of the line through {a0} and {a1}, rounded to two decimals, or None if the line is "
          "vertical.",),
         lambda p, q: None if p[0] == q[0] else round((q[1] - p[1]) / (q[0] - p[0]), 2),
         lambda r, v: ((r.randint(-5, 5), r.randint(-5, 5)), (r.randint(-5, 5), r.randint(-5, 5)))),
    Task(("polygon_perimeter", "perimeter_of", "boundary_length"),
         [("vertices|points", "list[tuple[int, int]]", "the corners in order")], "float",
         ("Return the perimeter of the closed polygon whose corners are listed in order in {a0}, rounded to two "
          "decimals.",),
         lambda ps: round(sum(math.dist(a, b) for a, b in zip(ps, ps[1:] + ps[:1])), 2), lambda r, v: (_polygon(r),),
         imports=("import math",)),
    Task(("clock_angle", "hands_angle", "angle_between_hands"),
         [("hour|h", "int", "0 to 23"), ("minute|m", "int", "0 to 59")], "float",
         ("Return the smaller angle, in degrees, between the hour and minute hands of an analog clock showing "
          "{a0} hours and {a1} minutes.",),
         _clock_angle, lambda r, v: (r.randint(0, 23), r.choice([0, 15, 30, 45, r.randint(0, 59)]))),
    Task(("centroid", "center_of_points", "mean_point"),
         [("points|coords", "list[tuple[float, float]]", "a non-empty list of points")], "tuple[float, float]",
         ("Return the centroid (average x, average y) of {a0}, each coordinate rounded to two decimals.",),
         lambda ps: (round(sum(p[0] for p in ps) / len(ps), 2), round(sum(p[1] for p in ps) / len(ps), 2)),
         lambda r, v: ([(r.randint(-5, 5), r.randint(-5, 5)) for _ in range(r.randint(1, 4))],)),
    # --- dates and times ---------------------------------------------------------------------
    Task(("is_leap_year", "leap_year", "has_feb_29"),
         [("year|y", "int", "a year of the Gregorian calendar")], "bool",
         ("Return True if {a0} is a leap year in the Gregorian calendar: divisible by 4, except that century years "
          "must be divisible by 400.",),
         lambda y: y % 4 == 0 and (y % 100 != 0 or y % 400 == 0),
         lambda r, v: (r.choice([1900, 2000, 2024, 2023, 2100, 1996, r.randint(1800, 2200)]),)),
    Task(("days_in_month", "month_length", "number_of_days"),
         [("year|y", "int", "the year"), ("month|m", "int", "the month, 1 to 12")], "int",
         ("Return the number of days in month {a1} of year {a0}, taking leap years into account.",),
         lambda y, m: ((date(y + m // 12, m % 12 + 1, 1)) - date(y, m, 1)).days,
         lambda r, v: (r.choice([2023, 2024, 1900, 2000]), r.randint(1, 12))),
    Task(("day_of_year", "ordinal_day", "day_number"),
         [("day|date_text|iso", "str", "a date 'YYYY-MM-DD'")], "int",
         ("Return the day of the year (1 for January 1st) of the date {a0}, written 'YYYY-MM-DD'.",),
         lambda s: date.fromisoformat(s).timetuple().tm_yday, lambda r, v: (date_str(r),)),
    Task(("days_between", "date_difference", "days_apart"),
         [("start|first|a", "str", "a date 'YYYY-MM-DD'"), ("end|second|b", "str", "a date 'YYYY-MM-DD'")], "int",
         ("Return the number of days between two dates written 'YYYY-MM-DD'; the result is never negative.",),
         lambda a, b: abs((date.fromisoformat(b) - date.fromisoformat(a)).days), lambda r, v: _date_pair(r),
         imports=("from datetime import date",)),
    Task(("weekday_name", "day_of_week", "weekday_of"),
         [("day|date_text|iso", "str", "a date 'YYYY-MM-DD'")], "str",
         ("Return the English name of the weekday ('Monday' to 'Sunday') of the date {a0}, written 'YYYY-MM-DD'.",),
         lambda s: date.fromisoformat(s).strftime("%A"), lambda r, v: (date_str(r),),
         imports=("import datetime",)),
    Task(("format_hms", "seconds_to_clock", "as_hh_mm_ss"),
         [("seconds|total|secs", "int", "a non-negative number of seconds")], "str",
         ("Format {a0} seconds as 'HH:MM:SS' with at least two digits per field; hours may exceed 24.",),
         lambda s: f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}", _one_int(0, 200000)),
    Task(("add_days", "shift_date", "date_plus"),
         [("day|date_text|iso", "str", "a date 'YYYY-MM-DD'"), ("n|days|offset", "int", "days to add, may be negative")],
         "str",
         ("Return the date {a1} days after {a0}, both written 'YYYY-MM-DD'.",),
         lambda s, n: (date.fromisoformat(s) + timedelta(days=n)).isoformat(),
         lambda r, v: (date_str(r), r.randint(-400, 400)), imports=("from datetime import date, timedelta",)),
    Task(("to_24_hour", "convert_to_24h", "military_time"),
         [("time|clock|text", "str", "a 12-hour time like '7:05 PM'")], "str",
         ("Convert a 12-hour time such as '7:05 PM' or '12:30 AM' to the 24-hour format 'HH:MM'.",),
         _to_24h, lambda r, v: (f"{r.randint(1, 12)}:{r.randint(0, 59):02d} {r.choice(['AM', 'PM'])}",)),
    Task(("age_on", "age_at_date", "years_old_on"),
         [("birth|born|birthday", "str", "the birth date 'YYYY-MM-DD'"), ("on|day|when", "str", "a later date 'YYYY-MM-DD'")],
         "int",
         ("Return the age in whole years, on the date {a1}, of someone born on {a0}. Both dates are written "
          "'YYYY-MM-DD'.",),
         _age, lambda r, v: (date_str(r, 1950, 2000), date_str(r, 2001, 2030))),
    # --- matrices ----------------------------------------------------------------------------
    Task(("transpose", "swap_rows_and_columns", "transposed"),
         [("matrix|grid|rows", "list[list[int]]", "a rectangular matrix")], "list[list[int]]",
         ("Return the transpose of {a0}: row i of the result is column i of {a0}.",),
         lambda m: [list(c) for c in zip(*m)], lambda r, v: (_grid(r, r.randint(1, 3), r.randint(1, 3)),)),
    Task(("diagonal_sum", "both_diagonals_total", "x_sum"),
         [("matrix|grid", "list[list[int]]", "a square matrix")], "int",
         ("Return the sum of both diagonals of the square matrix {a0}; the centre element of an odd-sized matrix is "
          "counted only once.",),
         lambda m: sum(m[i][i] + m[i][len(m) - 1 - i] for i in range(len(m))) - (m[len(m) // 2][len(m) // 2]
                                                                                 if len(m) % 2 else 0),
         lambda r, v: (_square(r),)),
    Task(("spiral_order", "spiral_walk", "unroll_spiral"),
         [("matrix|grid", "list[list[int]]", "a rectangular matrix")], "list[int]",
         ("Return the elements of {a0} in clockwise spiral order, starting at the top-left corner.",),
         _spiral, lambda r, v: (_grid(r, r.randint(1, 3), r.randint(2, 3)),)),
    Task(("rotate_matrix", "rotate_grid", "quarter_turn"),
         [("matrix|grid", "list[list[int]]", "a rectangular matrix")], "list[list[int]]",
         ("Return {a0} rotated by 90 degrees {direction}.",),
         lambda m, direction: [list(row) for row in (zip(*m[::-1]) if direction == "clockwise"
                                                     else list(zip(*m))[::-1])],
         lambda r, v: (_grid(r, r.randint(1, 3), r.randint(2, 3)),),
         variants=[{"direction": "clockwise"}, {"direction": "counter-clockwise"}]),
    Task(("row_sums", "sum_each_row", "totals_per_row"),
         [("matrix|grid|table", "list[list[int]]", "a list of rows")], "list[int]",
         ("Return a list with the sum of every row of {a0}.",),
         lambda m: [sum(row) for row in m], lambda r, v: (_grid(r, r.randint(1, 3), r.randint(1, 4)),)),
    Task(("column_maxima", "max_per_column", "column_peaks"),
         [("matrix|grid|table", "list[list[int]]", "a non-empty rectangular matrix")], "list[int]",
         ("Return a list with the largest value of every column of {a0}.",),
         lambda m: [max(c) for c in zip(*m)], lambda r, v: (_grid(r, r.randint(1, 3), r.randint(1, 4)),)),
    Task(("count_islands", "island_count", "count_regions"),
         [("grid|cells|board", "list[list[int]]", "a grid of 0s and 1s")], "int",
         ("Count the groups of 1s in {a0} that are connected horizontally or vertically.",),
         _islands, lambda r, v: (_grid(r, 3, r.randint(3, 4), 1),)),
    Task(("matrix_product", "matmul", "mat_mult"),
         [("a|left", "list[list[int]]", "an n x m matrix"), ("b|right", "list[list[int]]", "an m x p matrix")],
         "list[list[int]]",
         ("Return the matrix product of {a0} and {a1}.",),
         lambda a, b: [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a],
         lambda r, v: (lambda n, m, p: (_grid(r, n, m, 4), _grid(r, m, p, 4)))(r.randint(1, 2), r.randint(1, 3),
                                                                                r.randint(1, 2))),
    Task(("is_identity", "identity_matrix_check", "is_unit_matrix"),
         [("matrix|grid", "list[list[int]]", "a square matrix")], "bool",
         ("Return True if {a0} is an identity matrix: 1 on the main diagonal and 0 everywhere else.",),
         lambda m: all(x == (i == j) for i, row in enumerate(m) for j, x in enumerate(row)),
         lambda r, v: (r.choice([[[1, 0], [0, 1]], [[1, 0, 0], [0, 1, 0], [0, 0, 1]], [[1, 1], [0, 1]], [[0]], [[1]],
                                 _square(r, 1)]),)),
    Task(("life_step", "next_generation", "game_of_life_tick"),
         [("grid|board|cells", "list[list[int]]", "a grid of 0s (dead) and 1s (alive)")], "list[list[int]]",
         ("Compute one step of Conway's Game of Life on {a0}: a live cell survives with 2 or 3 live neighbours, a "
          "dead cell comes alive with exactly 3, and cells outside the grid count as dead.",),
         _life, lambda r, v: (r.choice([[[0, 1, 0], [0, 1, 0], [0, 1, 0]], [[1, 1], [1, 1]], _grid(r, 3, 3, 1)]),)),
    # --- bits --------------------------------------------------------------------------------
    Task(("hamming_distance", "bit_difference", "differing_bits"),
         [("a|x", "int", "a non-negative integer"), ("b|y", "int", "a non-negative integer")], "int",
         ("Return the number of bit positions in which {a0} and {a1} differ.",),
         lambda a, b: bin(a ^ b).count("1"), lambda r, v: (r.randint(0, 64), r.randint(0, 64))),
    Task(("gray_code", "gray_sequence", "reflected_binary"),
         [("n|bits", "int", "the number of bits")], "list[int]",
         ("Return the {a0}-bit Gray code sequence as integers, starting at 0, where consecutive numbers differ in "
          "exactly one bit (use the reflected construction).",),
         _gray, _one_int(1, 3)),
    Task(("has_odd_parity", "odd_parity", "parity_is_odd"),
         [("n|value", "int", "a non-negative integer")], "bool",
         ("Return True if the binary representation of {a0} contains an odd number of 1 bits.",),
         lambda n: bin(n).count("1") % 2 == 1, _one_int(0, 255)),
]


TYPING_NAMES = {"list": "List", "dict": "Dict", "tuple": "Tuple"}


def render_type(t: str, typing_style: bool) -> tuple[str, list[str]]:
    """Render a builtin-style type; typing style uses List/Dict/Tuple/Optional and names them for import."""
    if not typing_style:
        return t, []
    used: list[str] = []

    def sub(m: re.Match) -> str:
        used.append(TYPING_NAMES[m.group(1)])
        return TYPING_NAMES[m.group(1)]
    out = re.sub(r"\b(list|dict|tuple)\b", sub, t)
    if out.endswith(" | None"):
        out = f"Optional[{out[:-len(' | None')]}]"
        used.append("Optional")
    return out, used


def render_docstring(desc: str, examples: list[tuple[str, str]], arg_docs: list[tuple[str, str]], returns: str,
                     r: Rng) -> str:
    """One docstring in one of several styles seen in real code (HumanEval's own, Google, 'Examples:')."""
    q = r.choices(['"""', "'''"], weights=[5, 1])[0]
    lines = textwrap.wrap(desc, r.choice([68, 76, 84]))
    chevrons = [line for call, out in examples for line in (f">>> {call}", out)]
    style = r.choice(["humaneval", "compact", "header", "header", "google"])
    if style == "humaneval":
        body = [f"{q} {lines[0]}", *lines[1:], *chevrons, q]
    elif style == "compact":
        body = [q + lines[0], *lines[1:], "", *chevrons, q]
    elif style == "header":
        body = [q, *lines, "", r.choice(["For example:", "Examples:", "Example:", "Examples"]), *chevrons, q]
    else:
        body = [q + lines[0], *lines[1:], "", "Args:", *[f"    {n}: {d[0].upper()}{d[1:]}." for n, d in arg_docs]]
        if returns:
            body += ["", "Returns:", f"    {returns}"]
        body += ["", "Examples:", *[f"    {line}" for line in chevrons], q]
    return "".join(f"    {line}\n" if line else "\n" for line in body)


def make_code_completion(r: Rng, task: Task, forbidden: frozenset[str]) -> str | None:
    """One function-completion prompt from `task`, or None when the draw is unusable."""
    variant = r.choice(task.variants)
    name = r.choice(task.names).format(**variant)
    if name in forbidden:
        return None
    arg_names = [r.choice(spec.split("|")) for spec, _, _ in task.args]
    if len(set(arg_names + [name])) != len(arg_names) + 1:
        return None
    wanted, examples = r.choice([1, 2, 2, 3]), []
    for _ in range(12):
        args = task.gen(r, variant)
        call = f"{name}({', '.join(map(repr, args))})"
        if call not in (c for c, _ in examples):
            examples.append((call, repr(task.fn(*copy.deepcopy(args), **variant))))
        if len(examples) == wanted:
            break
    fields = {f"a{i}": a for i, a in enumerate(arg_names)} | variant
    desc = r.choice(task.docs).format(**fields)
    arg_docs = [(a, d) for a, (_, _, d) in zip(arg_names, task.args)]
    # HumanEval mixes annotated and bare signatures, and typing.List with builtin list.
    annotation = r.choices(["typing", "builtin", "none"], weights=[4, 4, 2])[0]
    imported: list[str] = []
    params = []
    for a, (_, t, _) in zip(arg_names, task.args):
        rendered, used = render_type(t, annotation == "typing")
        imported += used
        params.append(a if annotation == "none" else f"{a}: {rendered}")
    ret, used = render_type(task.ret, annotation == "typing")
    imported += used
    signature = f"def {name}({', '.join(params)})" + ("" if annotation == "none" else f" -> {ret}") + ":\n"
    imports = list(task.imports)
    if imported:
        imports.append(f"from typing import {', '.join(sorted(dict.fromkeys(imported)))}")
    head = "\n".join(imports) + "\n\n\n" if imports else r.choices(["", "\n", "\n\n"], weights=[1, 3, 2])[0]
    code = head + signature + render_docstring(desc, examples, arg_docs, task.returns, r)
    return format_humaneval_prompt(code)


# =============================================================================================
# Other coding requests
# =============================================================================================

LANGS = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "C#", "Kotlin", "Ruby", "Swift"]
FUNCTION_REQUESTS = [
    "checks whether a string is a valid email address using a few simple rules",
    "returns the n most common words in a text, ignoring case and punctuation",
    "converts a temperature between Celsius, Fahrenheit and Kelvin",
    "computes the Levenshtein edit distance between two strings",
    "validates a credit card number with the Luhn algorithm",
    "deep-merges two nested dictionaries, with values from the second one winning",
    "retries a failing operation with exponential backoff and a maximum number of attempts",
    "parses an ISO 8601 date-time string into its components",
    "generates a random password of a given length with at least one digit, one upper-case letter and one symbol",
    "formats a byte count as a human-readable string such as '1.5 MB'",
    "finds the shortest path between two cells of a grid maze using breadth-first search",
    "topologically sorts the nodes of a dependency graph and reports a cycle if there is one",
    "merges k sorted arrays into one sorted array efficiently",
    "splits a CSV line into fields, handling quoted fields that contain commas",
    "reverses a singly linked list in place",
    "detects whether a linked list has a cycle",
    "converts a non-negative integer into English words, e.g. 123 -> 'one hundred twenty-three'",
    "flattens a nested JSON object into a flat map with dot-separated keys",
    "checks whether a binary tree is height-balanced",
    "performs binary search on a sorted array and returns the insertion point if the value is missing",
    "computes the median of two sorted arrays",
    "tokenizes an arithmetic expression into numbers, operators and parentheses",
    "paginates a list, returning the items of a given page and the total number of pages",
    "computes the SHA-256 hash of a large file by reading it in chunks",
    "checks whether two strings are one edit (insert, delete or replace) away from each other",
    "finds all pairs in an array that sum to a target value, without duplicates",
    "rounds a price to the nearest 0.05 and formats it with two decimals",
    "returns the longest palindromic substring of a string",
    "converts a Roman numeral to an integer and validates the input",
    "implements run-length encoding and decoding",
]
CLASS_REQUESTS = [
    "a stack that can also return its minimum element in constant time",
    "an LRU cache with a fixed capacity",
    "a bank account with deposits, withdrawals and a transaction history",
    "an in-memory key-value store whose entries expire after a time-to-live",
    "a 2D vector type with addition, scaling, length and dot product",
    "a rate limiter based on the token bucket algorithm",
    "a circular buffer of fixed size",
    "a trie that supports insert, exact lookup and prefix search",
    "an event emitter with on, off and emit methods",
    "a fraction type with arithmetic operations and automatic simplification",
    "a min-heap with push, pop and peek",
    "a to-do list that stores tasks with due dates and priorities",
    "an inventory that tracks products, quantities and low-stock alerts",
    "a matrix type with addition, multiplication and transpose",
    "a simple state machine for a traffic light",
]
SCRIPT_REQUESTS = [
    "renames every .jpg file in a folder so that its name starts with the date it was last modified",
    "reads a CSV file of sales (date, product, amount) and prints the total revenue per month",
    "backs up a directory into a timestamped zip archive and keeps only the five newest backups",
    "finds duplicate files in a directory tree by comparing content hashes",
    "counts word frequencies in a text file and prints the 20 most common words",
    "converts a JSON file containing a list of records into a CSV file",
    "splits a large log file into smaller files of 10,000 lines each",
    "merges several CSV files that share the same header into one file",
    "prints the size of each subdirectory of a folder, largest first",
    "turns a CSV file into a Markdown table",
    "parses a web server access log and reports the ten most frequent IP addresses",
    "deletes files older than 30 days from a temporary folder, with a dry-run option",
    "checks a folder of Markdown files for broken relative links",
    "prints a summary (count, mean, min, max) of a numeric column in a CSV file",
    "watches a directory and prints a message whenever a file is added or changed",
]
SCRIPT_LANGS = ["Python", "Bash", "PowerShell", "Node.js", "Go"]
SHELL_TASKS = [
    "find all files larger than 100 MB in my home directory",
    "count the lines in every .py file under the current directory and show the total",
    "replace the word 'foo' with 'bar' in all .txt files in a folder, recursively",
    "show the ten largest directories under /var",
    "find and stop the process that is listening on port 8080",
    "list the five most recently modified files in a directory",
    "extract a .tar.gz archive into a specific folder",
    "zip a project folder while excluding node_modules and .git",
    "follow a log file and show only the lines that contain ERROR",
    "find and delete all empty directories under the current one",
    "rename all .jpeg files in a folder to .jpg",
    "see which processes use the most memory",
    "copy a directory to a remote server with rsync and show progress",
    "print the unique IP addresses in an access log, sorted by how often they appear",
    "run a command every five seconds and watch its output",
    "search all files for a string, ignoring case, and show line numbers",
    "split a CSV file into files of 1,000 lines each while keeping the header in every file",
    "convert all .png images in a folder to .jpg with ImageMagick",
    "check the free disk space on every mounted filesystem",
    "schedule a script to run every day at 2 a.m. with cron",
    "count how many times each word appears in a text file",
    "verify the SHA-256 checksum of a downloaded file",
    "list all git branches sorted by the date of their last commit",
    "undo the last git commit but keep its changes in the working tree",
    "set an environment variable for a single command only",
]
SHELL_TEMPLATES = [
    "What is a shell command to {x}?",
    "How can I {x} from the Linux terminal?",
    "Write a bash one-liner to {x}, and explain each part of it.",
    "On macOS, how do I {x} in the terminal?",
]
JS_TASKS = [
    "debounce an input handler so it runs at most once every 300 ms",
    "fetch JSON from an API with async/await and handle network errors",
    "deep clone an object that contains dates and nested arrays",
    "group an array of objects by one of their properties",
    "remove duplicate objects from an array based on their id",
    "format a Date as YYYY-MM-DD in local time",
    "add a click handler to every button with a given class",
    "read the query parameters of the current page URL",
    "sort an array of objects by last name and then by first name",
    "turn a callback-based function into one that returns a promise",
    "animate an element's opacity with requestAnimationFrame",
    "validate a sign-up form before it is submitted",
    "store user settings in localStorage and load them on page load",
    "run an array of async tasks with at most three running at the same time",
    "compute the number of days between two dates",
]
JS_TEMPLATES = [
    "In JavaScript, how do I {x}? Show a short example.",
    "Write a JavaScript snippet to {x}.",
    "Show me how to {x} in modern JavaScript, and explain the code.",
]
SNIPPETS = [
    ("Python", "python", "def chunks(xs, n):\n    for i in range(0, len(xs), n):\n        yield xs[i:i + n]\n\n"
     "print(list(chunks(list(range(7)), 3)))"),
    ("Python", "python", "from collections import defaultdict\n\ngraph = defaultdict(list)\nfor a, b in [(1, 2), (2, 3), "
     "(1, 3)]:\n    graph[a].append(b)\n    graph[b].append(a)\nprint(dict(graph))"),
    ("Python", "python", "def memo(f):\n    cache = {}\n    def wrapper(n):\n        if n not in cache:\n"
     "            cache[n] = f(n)\n        return cache[n]\n    return wrapper\n\n@memo\ndef ways(n):\n"
     "    return 1 if n < 2 else ways(n - 1) + ways(n - 2)\n\nprint(ways(30))"),
    ("Python", "python", "matrix = [[1, 2, 3], [4, 5, 6]]\nprint([list(col) for col in zip(*matrix)])"),
    ("Python", "python", "words = ['pear', 'fig', 'banana', 'kiwi']\nprint(sorted(words, key=lambda w: (len(w), w)))"),
    ("Python", "python", "import re\n\ntext = 'Call 555-1234 or 555-9876 today'\nprint(re.findall(r'\\d{3}-\\d{4}', text))"),
    ("Python", "python", "x = [[0] * 3] * 3\nx[0][0] = 1\nprint(x)"),
    ("JavaScript", "javascript", "const counts = ['a', 'b', 'a', 'c', 'a'].reduce((acc, x) => {\n"
     "  acc[x] = (acc[x] || 0) + 1;\n  return acc;\n}, {});\nconsole.log(counts);"),
    ("JavaScript", "javascript", "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 0);\n}"),
    ("JavaScript", "javascript", "const pipe = (...fns) => (x) => fns.reduce((v, f) => f(v), x);\n"
     "const inc = (x) => x + 1;\nconst double = (x) => x * 2;\nconsole.log(pipe(inc, double)(5));"),
    ("SQL", "sql", "SELECT d.name, COUNT(e.id) AS staff, AVG(e.salary) AS avg_salary\nFROM departments d\n"
     "LEFT JOIN employees e ON e.department_id = d.id\nGROUP BY d.name\nHAVING COUNT(e.id) > 5\n"
     "ORDER BY avg_salary DESC;"),
    ("SQL", "sql", "SELECT customer_id, order_date, total,\n       SUM(total) OVER (PARTITION BY customer_id "
     "ORDER BY order_date) AS running_total\nFROM orders;"),
    ("Bash", "bash", "for f in *.log; do\n  gzip -9 \"$f\" && echo \"compressed $f\"\ndone"),
    ("Bash", "bash", "find . -name '*.tmp' -mtime +7 -print0 | xargs -0 rm -f"),
    ("Go", "go", "func sum(ch chan int, xs []int) {\n    total := 0\n    for _, x := range xs {\n        total += x\n"
     "    }\n    ch <- total\n}"),
    ("Rust", "rust", "fn longest<'a>(a: &'a str, b: &'a str) -> &'a str {\n    if a.len() >= b.len() { a } else { b }\n}"),
    ("C", "c", "int count_bits(unsigned int n) {\n    int c = 0;\n    while (n) {\n        n &= n - 1;\n        c++;\n"
     "    }\n    return c;\n}"),
    ("Java", "java", "Map<String, Integer> counts = new TreeMap<>();\nfor (String w : text.split(\"\\\\s+\")) {\n"
     "    counts.merge(w.toLowerCase(), 1, Integer::sum);\n}"),
]
EXPLAIN_TEMPLATES = [
    "Explain what this {lang} code does:\n\n```{tag}\n{code}\n```",
    "What does the following {lang} snippet output, and why?\n\n```{tag}\n{code}\n```",
    "Walk me through this {lang} code line by line:\n\n```{tag}\n{code}\n```",
    "Is there anything surprising or inefficient in this {lang} code? Explain.\n\n```{tag}\n{code}\n```",
]
BUGGY = [
    ("Python", "python", "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) - 1",
     "compute the average of a list", "it returns a value that is always off by one"),
    ("Python", "python", "def append_item(item, items=[]):\n    items.append(item)\n    return items",
     "return a new one-element list each time it is called without a list", "the lists keep growing between calls"),
    ("Python", "python", "def find_index(xs, target):\n    lo, hi = 0, len(xs)\n    while lo < hi:\n"
     "        mid = (lo + hi) // 2\n        if xs[mid] < target:\n            lo = mid\n        else:\n"
     "            hi = mid\n    return lo", "do a binary search on a sorted list", "it never finishes for some inputs"),
    ("Python", "python", "def count_words(path):\n    counts = {}\n    for line in open(path):\n"
     "        for word in line.split():\n            counts[word] += 1\n    return counts",
     "count the words in a file", "it crashes with a KeyError"),
    ("Python", "python", "def remove_negatives(xs):\n    for x in xs:\n        if x < 0:\n            xs.remove(x)\n"
     "    return xs", "remove every negative number from a list", "some negative numbers survive"),
    ("Python", "python", "import json\n\ndef load_config(path):\n    with open(path) as f:\n        data = json.loads(f)\n"
     "    return data.get('settings', {})", "read the settings section of a JSON file", "it raises a TypeError"),
    ("JavaScript", "javascript", "async function loadAll(urls) {\n  const results = [];\n  urls.forEach(async (u) => {\n"
     "    const r = await fetch(u);\n    results.push(await r.json());\n  });\n  return results;\n}",
     "return the JSON of every URL", "it always returns an empty array"),
    ("JavaScript", "javascript", "function isEmpty(obj) {\n  return obj == {};\n}",
     "tell whether an object has no keys", "it returns false even for {}"),
    ("JavaScript", "javascript", "const total = prices.map(p => p * 1.2).reduce((a, b) => a + b);",
     "sum the prices including 20% tax", "it throws a TypeError when the array is empty"),
    ("SQL", "sql", "SELECT department_id, name, MAX(salary)\nFROM employees\nGROUP BY department_id;",
     "show the best-paid employee of each department", "the names do not match the salaries"),
    ("SQL", "sql", "SELECT * FROM orders WHERE discount_code = NULL;",
     "list the orders without a discount code", "it returns no rows at all"),
    ("C", "c", "char *copy(const char *s) {\n    char *out = malloc(strlen(s));\n    strcpy(out, s);\n    return out;\n}",
     "return a heap copy of a string", "it sometimes corrupts memory"),
    ("Java", "java", "String a = new String(\"hi\");\nString b = new String(\"hi\");\nif (a == b) {\n"
     "    System.out.println(\"same\");\n}", "print 'same' when the two strings are equal", "nothing is printed"),
    ("Bash", "bash", "for f in $(ls *.txt); do\n  wc -l $f\ndone", "count lines in every .txt file",
     "it breaks on file names that contain spaces"),
    ("Go", "go", "var wg sync.WaitGroup\nfor _, u := range urls {\n    go func() {\n        wg.Add(1)\n"
     "        defer wg.Done()\n        fetch(u)\n    }()\n}\nwg.Wait()", "fetch every URL concurrently and wait for all",
     "it sometimes returns before the fetches finish"),
]
FIX_TEMPLATES = [
    "This {lang} code should {goal}, but {symptom}. Find and fix the bug:\n\n```{tag}\n{code}\n```",
    "Fix the bug in this {lang} code. It is supposed to {goal}, but {symptom}.\n\n```{tag}\n{code}\n```",
    "Can you debug this? The {lang} code below is meant to {goal}, yet {symptom}. Explain the cause before giving "
    "the fix.\n\n```{tag}\n{code}\n```",
]
SCHEMAS = [
    ("employees(id, name, department_id, salary, hired_on) and departments(id, name)",
     "CREATE TABLE departments (id INT PRIMARY KEY, name TEXT);\nCREATE TABLE employees (id INT PRIMARY KEY, name TEXT,\n"
     "  department_id INT REFERENCES departments(id), salary NUMERIC, hired_on DATE);",
     ["returns the three highest-paid employees in each department",
      "lists departments whose average salary is above the company-wide average",
      "counts how many people were hired in each year",
      "finds employees who earn more than the average of their own department",
      "shows each department with its newest employee",
      "lists departments that have no employees"]),
    ("customers(id, name, country) and orders(id, customer_id, created_at, total)",
     "CREATE TABLE customers (id INT PRIMARY KEY, name TEXT, country TEXT);\nCREATE TABLE orders (id INT PRIMARY KEY,\n"
     "  customer_id INT REFERENCES customers(id), created_at TIMESTAMP, total NUMERIC);",
     ["returns the total revenue per country for the last 30 days",
      "finds customers who have never placed an order",
      "shows each customer's first and most recent order dates",
      "lists the top five customers by lifetime spending",
      "computes the month-over-month change in revenue",
      "finds customers who ordered in every month of 2024"]),
    ("products(id, name, category, price) and order_items(order_id, product_id, quantity)",
     "CREATE TABLE products (id INT PRIMARY KEY, name TEXT, category TEXT, price NUMERIC);\n"
     "CREATE TABLE order_items (order_id INT, product_id INT REFERENCES products(id), quantity INT);",
     ["returns the best-selling product in each category by units sold",
      "lists products that have never been ordered",
      "computes the revenue of each category and its share of the total",
      "finds pairs of products that are often bought in the same order"]),
    ("students(id, name), courses(id, title) and enrollments(student_id, course_id, grade)",
     "CREATE TABLE students (id INT PRIMARY KEY, name TEXT);\nCREATE TABLE courses (id INT PRIMARY KEY, title TEXT);\n"
     "CREATE TABLE enrollments (student_id INT, course_id INT, grade NUMERIC);",
     ["lists students with their average grade, best first",
      "finds courses where nobody scored below 60",
      "shows the number of students per course, including courses with none",
      "finds students enrolled in more than three courses"]),
    ("page_views(user_id, url, viewed_at)",
     "CREATE TABLE page_views (user_id INT, url TEXT, viewed_at TIMESTAMP);",
     ["counts daily active users for the last two weeks",
      "finds, for each user, the first page they ever viewed",
      "splits each user's views into sessions separated by at least 30 minutes of inactivity",
      "returns the ten most viewed URLs of yesterday"]),
]
SQL_TEMPLATES = [
    "Given the tables {short}, write a SQL query that {q}.",
    "Here is a schema:\n\n```sql\n{ddl}\n```\n\nWrite a query that {q}.",
    "Write a PostgreSQL query that {q}. The tables are {short}.",
    "I have the tables {short}. I need a query that {q}. Can you write it and explain how it works?",
]


def make_coding(r: Rng, i: int) -> str:
    kind = ["function", "function", "class", "script", "explain", "fix", "sql", "shell", "js"][i % 9]
    if kind == "function":
        x, lang = r.choice(FUNCTION_REQUESTS), r.choice(LANGS)
        return r.choice([f"Write a {lang} function that {x}.",
                         f"In {lang}, implement a function that {x}. Include a short usage example.",
                         f"Can you write {lang} code that {x}? Please add comments.",
                         f"I need a {lang} function that {x}. Keep it idiomatic and mention the edge cases."])
    if kind == "class":
        x, lang = r.choice(CLASS_REQUESTS), r.choice(LANGS)
        return r.choice([f"Write a {lang} class for {x}.", f"Implement {x} in {lang}, with a few unit tests.",
                         f"Design {x} in {lang}. Show the code and a short example of using it."])
    if kind == "script":
        x, lang = r.choice(SCRIPT_REQUESTS), r.choice(SCRIPT_LANGS)
        return r.choice([f"Write a {lang} script that {x}.",
                         f"Create a small command-line {lang} script that {x}. It should take the path as an argument.",
                         f"I want a {lang} script that {x}. Please include error handling."])
    if kind == "explain":
        lang, tag, code = r.choice(SNIPPETS)
        return r.choice(EXPLAIN_TEMPLATES).format(lang=lang, tag=tag, code=code)
    if kind == "fix":
        lang, tag, code, goal, symptom = r.choice(BUGGY)
        return r.choice(FIX_TEMPLATES).format(lang=lang, tag=tag, code=code, goal=goal, symptom=symptom)
    if kind == "sql":
        short, ddl, questions = r.choice(SCHEMAS)
        return r.choice(SQL_TEMPLATES).format(short=short, ddl=ddl, q=r.choice(questions))
    if kind == "shell":
        return r.choice(SHELL_TEMPLATES).format(x=r.choice(SHELL_TASKS))
    return r.choice(JS_TEMPLATES).format(x=r.choice(JS_TASKS))


# =============================================================================================
# Math with worked steps
# =============================================================================================

STEPS = ["Show your steps.", "Show your work.", "Please show each step.", "Explain your reasoning step by step.",
         "Walk me through the solution step by step.", "Show all intermediate steps."]


def _money(x: float) -> str:
    return f"${x:,.2f}"


def _signs(text: str) -> str:
    return text.replace("+ -", "- ")


def _nonzero(r: Rng, lo: int, hi: int) -> int:
    return r.choice([k for k in range(lo, hi + 1) if k])


def _linear(r: Rng) -> str:
    x, a, b = r.randint(-12, 15), r.randint(2, 9), _nonzero(r, -20, 30)
    return _signs(f"Solve for x: {a}x + {b} = {a * x + b}.")


def _two_sided(r: Rng) -> str:
    x, a, c, b = r.randint(-10, 12), r.randint(3, 9), r.randint(1, 2), _nonzero(r, -15, 15)
    return _signs(f"Solve for x: {a}x + {b} = {c}x + {a * x + b - c * x}.")


def _system(r: Rng) -> str:
    x, y = r.randint(-6, 9), r.randint(-6, 9)
    a, b, c, d = r.randint(1, 5), r.randint(1, 5), r.randint(1, 5), -r.randint(1, 5)
    eq1 = f"{a}x + {b}y = {a * x + b * y}"
    eq2 = f"{c}x - {-d}y = {c * x + d * y}"
    return f"Solve the system of equations {eq1} and {eq2}."


def _quadratic(r: Rng) -> str:
    p, q = r.randint(-9, 9), r.randint(-9, 9)
    b, c = -(p + q), p * q
    terms = "x^2" + (f" + {b}x" if b > 0 else f" - {-b}x" if b < 0 else "") + \
        (f" + {c}" if c > 0 else f" - {-c}" if c < 0 else "")
    return r.choice([f"Solve {terms} = 0 by factoring.", f"Find the roots of {terms} = 0.",
                     f"Solve the quadratic equation {terms} = 0 using the quadratic formula."])


def _multiply(r: Rng) -> str:
    a, b = r.randint(12, 999), r.randint(11, 99)
    return r.choice([f"Compute {a} × {b} by hand.", f"What is {a} times {b}? Use long multiplication."])


def _divide(r: Rng) -> str:
    b = r.randint(3, 29)
    a = b * r.randint(12, 400) + r.randint(0, b - 1)
    return f"Divide {a} by {b} using long division. Give the quotient and the remainder."


def _order_of_ops(r: Rng) -> str:
    a, b, c, d, e = (r.randint(2, 12) for _ in range(5))
    return "Evaluate " + r.choice([f"{a} + {b} × ({c} - {d})^2 ÷ {e}", f"({a} + {b}) × {c} - {d}^2 + {e}",
                                   f"{a}^2 - {b} × {c} + ({d} + {e}) × 2", f"{a} × ({b} + {c} × {d}) - {e}"]) + "."


def _fractions(r: Rng) -> str:
    f1, f2 = _fraction(r), _fraction(r)
    op = r.choice([("add", "+"), ("subtract", "-"), ("multiply", "×"), ("divide", "÷")])
    return f"Compute {f1} {op[1]} {f2} and write the answer as a fraction in lowest terms."


def _percent(r: Rng) -> str:
    p, n = r.choice([5, 12, 15, 18, 25, 35, 40, 62.5, 7.5]), r.randint(40, 2000)
    old, new = r.randint(50, 500), r.randint(50, 500)
    return r.choice([f"What is {p}% of {n}?", f"{n} is what percent of {n * 4}?",
                     f"A price changes from {_money(old)} to {_money(new)}. By what percent did it change?"])


def _shopping(r: Rng) -> str:
    name, n1, n2 = r.choice(NAMES), r.randint(2, 6), r.randint(2, 8)
    p1, p2 = r.choice([1.25, 2.5, 2.75, 3.4, 4.5]), r.choice([0.65, 0.8, 1.15, 1.5])
    bill = next(b for b in (20, 50, 100) if b > n1 * p1 + n2 * p2)
    return (f"{name} buys {n1} notebooks at {_money(p1)} each and {n2} pens at {_money(p2)} each, and pays with a "
            f"${bill} bill. How much change does {name} get?")


def _speed(r: Rng) -> str:
    v, t, t2 = r.randint(40, 120), r.randint(2, 5), r.choice([1.5, 2.5, 3, 4.5, 6])
    return f"A train travels {v * t} km in {t} hours. At the same speed, how far does it go in {t2} hours?"


def _meeting(r: Rng) -> str:
    v1, v2, t = r.randint(10, 30), r.randint(10, 30), r.choice([1, 1.5, 2, 2.5, 3])
    return (f"Two cyclists start at the same time from towns {(v1 + v2) * t:g} km apart and ride toward each other at "
            f"{v1} km/h and {v2} km/h. When do they meet, and how far has each one ridden?")


def _work_rate(r: Rng) -> str:
    a, b = r.choice([(3, 6), (4, 12), (6, 3), (10, 15), (2, 3), (5, 20), (12, 24), (8, 8)])
    p, q = r.sample(NAMES, 2)
    return (f"{p} can paint a fence in {a} hours and {q} can paint it in {b} hours. How long does it take them "
            f"working together?")


def _ages(r: Rng) -> str:
    b, k, n = r.randint(4, 15), r.randint(2, 4), r.randint(2, 10)
    p, q = r.sample(NAMES, 2)
    return (f"{p} is {k} times as old as {q}, and together they are {b * (k + 1)} years old. How old will each of "
            f"them be in {n} years?")


def _interest(r: Rng) -> str:
    principal, rate, years = r.randrange(500, 10001, 100), r.choice([2, 3, 3.5, 4, 5, 6]), r.randint(2, 8)
    kind = r.choice(["simple", "compound"])
    extra = "" if kind == "simple" else ", compounded annually"
    return (f"You invest {_money(principal)} at {rate}% {kind} interest{extra}. How much is the investment worth "
            f"after {years} years?")


def _recipe(r: Rng) -> str:
    s, s2 = r.choice([4, 6, 8]), r.choice([3, 5, 10, 12, 14])
    flour, sugar = s * r.randint(40, 90), s * r.randint(10, 30)
    return (f"A recipe for {s} people uses {flour} g of flour and {sugar} g of sugar. How much of each do you need for "
            f"{s2} people?")


def _paint(r: Rng) -> str:
    length, width, height, cover = r.randint(3, 7), r.randint(3, 6), r.choice([2.4, 2.5, 2.7, 3]), r.choice([8, 10, 12])
    return (f"A room is {length} m long, {width} m wide and {height} m high. It has one door of 2 m × 0.9 m and one "
            f"window of 1.5 m × 1.2 m. One litre of paint covers {cover} m², and the walls need two coats. How many "
            f"litres of paint are needed for the walls?")


def _discount(r: Rng) -> str:
    price, d, tax = r.randrange(20, 400, 5), r.choice([10, 15, 20, 25, 30, 40]), r.choice([5, 7, 8, 13, 20])
    return (f"A jacket costs {_money(price)}. It is on sale for {d}% off, and then a {tax}% sales tax is added. What "
            f"is the final price?")


def _average_needed(r: Rng) -> str:
    while True:
        scores, target = [r.randint(60, 98) for _ in range(r.randint(3, 5))], r.choice([80, 85, 88, 90])
        need = target * (len(scores) + 1) - sum(scores)
        if 0 <= need <= 100:
            break
    return (f"A student's test scores so far are {', '.join(map(str, scores))}. What score does she need on the next "
            f"test to bring her average to exactly {target}?")


def _consecutive(r: Rng) -> str:
    k, kind = r.randint(3, 5), r.choice(["", "even ", "odd "])
    start = r.randint(3, 60)
    if kind:
        start += (start % 2) ^ (kind == "odd ")
    step = 2 if kind else 1
    return f"The sum of {k} consecutive {kind}integers is {sum(start + step * i for i in range(k))}. What are they?"


def _marbles(r: Rng) -> str:
    red, blue, green = r.randint(2, 8), r.randint(2, 8), r.randint(0, 5)
    bag = f"{red} red and {blue} blue marbles" if not green else f"{red} red, {blue} blue and {green} green marbles"
    return r.choice([f"A bag contains {bag}. Two marbles are drawn without replacement. What is the probability that "
                     f"both are red?",
                     f"A bag contains {bag}. If you draw one marble, put it back and draw again, what is the "
                     f"probability of getting one red and one blue marble in either order?"])


def _fuel(r: Rng) -> str:
    use, dist, price = r.choice([4.8, 5.5, 6.2, 7, 8.5]), r.randrange(120, 900, 10), r.choice([1.59, 1.72, 1.85, 1.9])
    return (f"A car uses {use} litres of fuel per 100 km. How much fuel does a {dist} km trip take, and what does it "
            f"cost at €{price} per litre?")


def _bill_split(r: Rng) -> str:
    total, tip, people = r.randrange(4000, 30000, 5) / 100, r.choice([10, 15, 18, 20]), r.randint(2, 7)
    return (f"A restaurant bill is {_money(total)}. The group adds a {tip}% tip and splits the total equally among "
            f"{people} people. How much does each person pay?")


def _mixture(r: Rng) -> str:
    while True:
        a, b, x, y = r.choice([10, 20, 30, 40]), r.choice([50, 60, 70, 80]), r.randint(2, 12), r.randint(2, 12)
        if (a * x + b * y) % (x + y) == 0:
            break
    return (f"How many litres of a {a}% salt solution and of a {b}% salt solution must be mixed to get {x + y} litres "
            f"of a {(a * x + b * y) // (x + y)}% solution?")


def _garden(r: Rng) -> str:
    length, width, w = r.randint(6, 20), r.randint(4, 12), r.choice([0.5, 1, 1.5, 2])
    return (f"A rectangular garden measures {length} m by {width} m. A path {w} m wide runs all the way around the "
            f"outside of it. What is the area of the path?")


def _better_deal(r: Rng) -> str:
    n1, n2 = r.choice([6, 8, 12]), r.choice([10, 15, 24])
    p1, p2 = round(n1 * r.uniform(0.6, 1.2), 2), round(n2 * r.uniform(0.6, 1.2), 2)
    return (f"Store A sells {n1} cans of soup for {_money(p1)} and store B sells {n2} cans for {_money(p2)}. Which is "
            f"the better deal, and by how much per can?")


def _duration_end(r: Rng) -> str:
    h, m, dh, dm = r.randint(1, 11), r.choice([0, 10, 15, 20, 35, 45, 50]), r.randint(1, 3), r.randint(5, 55)
    return (f"A film starts at {h}:{m:02d} p.m. and runs for {dh} hours and {dm} minutes. At what time does it end?")


def _exponents(r: Rng) -> str:
    a, b, c, d = r.randint(2, 5), r.randint(2, 4), r.randint(2, 3), r.randint(1, 5)
    return r.choice([f"Simplify ({a}x^{b})^{c} · {d}x^{a}.", f"Simplify ({a * d}x^{b + c} y^{a}) / ({d}x^{c} y).",
                     f"Simplify x^{a} · x^{b} / x^{c} and evaluate it at x = {d}."])


def _gcd_lcm(r: Rng) -> str:
    g = r.choice([4, 6, 8, 12, 14, 15, 18])
    a, b = g * r.randint(2, 9), g * r.randint(2, 9)
    return f"Find the greatest common divisor and the least common multiple of {a} and {b} using prime factorization."


def _base(r: Rng) -> str:
    n = r.randint(20, 500)
    return r.choice([f"Convert {n} to binary.", f"Convert the binary number {n:b} to decimal.",
                     f"Convert {n} to hexadecimal."])


def _sequence(r: Rng) -> str:
    a, d, n = r.randint(-5, 20), r.randint(2, 9), r.choice([15, 20, 25, 30, 40])
    return (f"Find the {n}th term and the sum of the first {n} terms of the arithmetic sequence {a}, {a + d}, "
            f"{a + 2 * d}, ...")


def _line(r: Rng) -> str:
    x1, y1, x2 = r.randint(-5, 5), r.randint(-5, 5), r.randint(-5, 5)
    x2 += x2 == x1
    y2 = y1 + r.randint(-3, 3) * (x2 - x1)
    return f"Find the equation of the line through the points ({x1}, {y1}) and ({x2}, {y2}) in slope-intercept form."


MATH_MAKERS = [_linear, _two_sided, _system, _quadratic, _multiply, _divide, _order_of_ops, _fractions, _percent,
               _shopping, _speed, _meeting, _work_rate, _ages, _interest, _recipe, _paint, _discount, _average_needed,
               _consecutive, _marbles, _fuel, _bill_split, _mixture, _garden, _better_deal, _duration_end, _exponents,
               _gcd_lcm, _base, _sequence, _line]


def make_math(r: Rng, i: int) -> str:
    problem, steps = MATH_MAKERS[i % len(MATH_MAKERS)](r), r.choice(STEPS)
    return r.choice([f"{problem} {steps}", f"Solve the following problem. {steps}\n\n{problem}",
                     f"{problem}\n\n{steps} Then state the final answer clearly."])


# =============================================================================================
# Explanations
# =============================================================================================

AUDIENCES = ["a ten-year-old", "a high-school student", "someone with no science background", "a busy manager",
             "a first-year university student", "my grandmother"]
CONCEPTS = """photosynthesis|the greenhouse effect|inflation|compound interest|natural selection|entropy|a black hole|
plate tectonics|the immune system|how vaccines train the immune system|supply and demand|opportunity cost|
the placebo effect|quantum entanglement|the theory of relativity|the water cycle|DNA replication|climate feedback loops|
the Doppler effect|osmosis|the carbon cycle|machine learning|overfitting in machine learning|public-key cryptography|
blockchain|the difference between weather and climate|cognitive dissonance|the scientific method|herd immunity|
the placebo-controlled trial|electric current and voltage|the Big Bang theory|continental drift|circadian rhythms|
antibiotic resistance|the law of diminishing returns|the tragedy of the commons|comparative advantage|
neural plasticity|the central limit theorem|Bayes' theorem|the Pythagorean theorem|the Fibonacci sequence in nature|
recursion in programming|the CAP theorem|garbage collection in programming languages|the speed of light limit|
ocean tides|the ozone layer|fermentation|the nitrogen cycle|exponential growth|the butterfly effect""".replace("\n", "").split("|")
CONCEPT_TEMPLATES = ["Explain {x} in simple terms.", "What is {x}? Give a concrete example.",
                     "Explain {x} to {aud}.", "Explain {x} in {n} sentences.",
                     "What are common misconceptions about {x}?", "Why does {x} matter? Keep it under {w} words."]
MACHINES = """a refrigerator|GPS|a microwave oven|noise-cancelling headphones|the gears on a bicycle|a search engine|
an electric motor|a pin tumbler lock|DNS on the internet|a credit card payment|a jet engine|a touchscreen|
a solar panel|a compiler|a nuclear power plant|a heat pump|Wi-Fi|an airplane wing|a camera lens|
a hybrid car|an elevator|a 3D printer|a vaccine's mRNA|a thermostat|an email from sender to inbox|
a hard drive versus an SSD|a barcode scanner|a hydroelectric dam|a smoke detector|a QR code""".replace("\n", "").split("|")
MACHINE_TEMPLATES = ["How does {x} work?", "Explain step by step how {x} works.", "Explain how {x} works to {aud}.",
                     "What are the main parts of {x}, and what does each one do?"]
EVENTS = """the fall of the Western Roman Empire|the French Revolution|the Industrial Revolution|
the invention of the printing press|the Apollo 11 Moon landing|the Black Death|the Silk Road|the Meiji Restoration|
the Cold War|the Renaissance|the construction of the Panama Canal|the collapse of the Soviet Union|
the abolition of the transatlantic slave trade|the American Civil War|the Protestant Reformation|
the Mongol Empire's expansion|the Great Depression|the partition of India|the Marshall Plan|
the Scientific Revolution|the fall of the Berlin Wall|the Norman conquest of England|the Age of Exploration|
the Green Revolution in agriculture|the founding of the United Nations""".replace("\n", "").split("|")
EVENT_TEMPLATES = ["What caused {x}?", "Summarize {x} in a short paragraph.", "What were the main consequences of {x}?",
                   "Give a brief timeline of {x}.", "Why do historians consider {x} important?"]
TERMS = """latency|throughput|a derivative in calculus|an integral|irony|a metaphor|a hash function|an API|
a prime number|a placebo|GDP|a mutual fund|a catalyst|an isotope|a sonnet|a peer-reviewed study|a p-value|
a median|a standard deviation|an ecosystem|a virus versus a bacterium|a recession|a monopoly|an index fund|
a firewall|an operating system|an algorithm|a hypothesis|a theorem|an allele""".replace("\n", "").split("|")
TERM_TEMPLATES = ["Define {x} and give an example.", "What does the term '{x}' mean?",
                  "Explain what {x} is in one paragraph, with an analogy."]
PAIRS = [("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("mass", "weight"),
         ("a simile", "a metaphor"), ("RAM", "storage"), ("a stock", "a bond"), ("a debit card", "a credit card"),
         ("mitosis", "meiosis"), ("an element", "a compound"), ("heat", "temperature"), ("TCP", "UDP"),
         ("correlation", "causation"), ("a democracy", "a republic"), ("a crocodile", "an alligator"),
         ("HTTP", "HTTPS"), ("a comet", "an asteroid"), ("affect", "effect"), ("a list", "a tuple in Python"),
         ("fission", "fusion"), ("a hurricane", "a tornado"), ("AC", "DC electricity"), ("an epidemic", "a pandemic"),
         ("a sprain", "a strain"), ("precision", "recall")]
WHY_QUESTIONS = """Why is the sky blue?|Why do we have seasons?|Why does ice float on water?|Why do cats purr?|
Why do onions make us cry?|Why is the ocean salty?|Why do leaves change colour in autumn?|Why do we dream?|
Why does bread rise?|Why is Mars red?|Why do planes leave white trails in the sky?|Why do we get goosebumps?|
Why does the Moon have phases?|Why do metals feel colder than wood at the same temperature?|
Why do stars twinkle but planets mostly do not?|Why does a spoon look bent in a glass of water?|
Why do we yawn?|Why do some materials conduct electricity and others do not?|Why is it hotter at the equator?|
Why does popcorn pop?|Why do batteries lose capacity over time?|Why do birds fly in a V formation?|
Why do our ears pop on an airplane?|Why does soap remove grease?|Why is the Dead Sea so easy to float in?|
Why do prices rise over time?|Why do we need sleep?|Why does a compass point north?|Why do rainbows form?|
Why do zebras have stripes?""".replace("\n", "").split("|")
WHY_SUFFIXES = ["", " Explain briefly.", " Answer for a curious ten-year-old.", " Include the science involved."]


def make_explanation(r: Rng, i: int) -> str:
    kind = i % 6
    aud, n, w = r.choice(AUDIENCES), r.choice([2, 3, 4, 5]), r.choice([80, 100, 150])
    if kind == 0:
        return r.choice(CONCEPT_TEMPLATES).format(x=r.choice(CONCEPTS), aud=aud, n=n, w=w)
    if kind == 1:
        return r.choice(MACHINE_TEMPLATES).format(x=r.choice(MACHINES), aud=aud)
    if kind == 2:
        return r.choice(EVENT_TEMPLATES).format(x=r.choice(EVENTS))
    if kind == 3:
        return r.choice(TERM_TEMPLATES).format(x=r.choice(TERMS))
    if kind == 4:
        a, b = r.choice(PAIRS)
        return r.choice([f"What is the difference between {a} and {b}?",
                         f"Explain the difference between {a} and {b} with an example of each.",
                         f"People often confuse {a} and {b}. How do they differ?"])
    return r.choice(WHY_QUESTIONS) + r.choice(WHY_SUFFIXES)


# =============================================================================================
# Everyday chat
# =============================================================================================

ADVICE = """How can I get better at waking up early?|I procrastinate on everything. Any practical tips?|
How do I politely decline a wedding invitation?|What should I pack for a week-long hiking trip?|
How can I make my small apartment feel bigger?|What is a good way to start learning to draw as an adult?|
How do I ask my manager for a raise?|My neighbour plays loud music late at night. How should I bring it up?|
How can I save money on groceries without eating badly?|What are good habits for studying for exams?|
I have a job interview tomorrow. How should I prepare tonight?|How do I keep houseplants alive when I travel a lot?|
How can I be more confident when speaking in meetings?|What should I consider when adopting a dog?|
How do I make friends in a new city?|How can I reduce my screen time in the evening?|
What is a sensible way to start running if I have never exercised?|How do I deal with a friend who is always late?|
How can I keep a conversation going on a first date?|What should I do if I feel burned out at work?|
How do I choose between two job offers?|How can I help my child enjoy reading?|
What are some tips for cooking for one person?|How do I stay focused when working from home?|
How should I prepare for my first marathon?|What can I do to sleep better in hot weather?|
How do I give constructive feedback to a colleague?|How can I learn a new language in my spare time?|
How do I organize a surprise party without the person finding out?|What should I do before selling my old phone?""".replace(
    "\n", "").split("|")
EMAILS = [
    ("landlord", ["reporting a leaking kitchen tap", "asking whether I may repaint the living room",
                  "giving notice that I will move out at the end of next month"]),
    ("manager", ["requesting two days off next month", "asking to reschedule our one-on-one to next week",
                 "announcing that I am leaving the company", "apologizing for missing a deadline"]),
    ("team", ["inviting everyone to a small celebration on Friday", "summarizing the decisions from today's meeting",
              "thanking them for their work on the product launch"]),
    ("professor", ["asking for a letter of recommendation", "asking for an extension on my essay",
                   "asking a question about last week's lecture"]),
    ("neighbour", ["asking them to keep the noise down after 11 p.m.", "inviting them to a garden barbecue",
                   "letting them know about building work at my house next week"]),
    ("client", ["following up on an invoice that is two weeks overdue", "proposing a new timeline for the project",
                "thanking them for choosing our company"]),
    ("internet provider", ["complaining about repeated outages this month", "asking to cancel my contract"]),
    ("new colleague", ["introducing myself and my role", "offering to show them around the office"]),
]
TONES = ["polite", "friendly", "formal", "short and direct", "warm but professional"]
CHARACTERS = ["a lighthouse keeper", "a retired astronaut", "a shy robot", "a girl who can talk to birds",
              "a baker in a tiny village", "an old dog", "a detective who is afraid of the dark",
              "a dragon who collects teacups", "two strangers stuck in an elevator", "a time-travelling librarian",
              "a street musician", "a farmer on Mars"]
SITUATIONS = ["One morning a mysterious letter arrives.", "A difficult choice has to be made.",
              "An unexpected friendship begins.", "Something important goes missing.",
              "A storm is coming and there is little time left.", "A hidden door appears where there was none.",
              "A surprising secret comes out.", "It is the first time they try something new."]
PARAGRAPHS = [
    "Honeybees communicate the location of food through the waggle dance. A forager returning to the hive moves in "
    "a figure-eight pattern, and the angle of the straight run relative to vertical encodes the direction of the "
    "food relative to the sun, while the duration of the waggle encodes distance. Other bees follow the dancer and "
    "then fly out to the indicated spot, which lets a colony quickly exploit rich flower patches.",
    "Remote work spread rapidly after 2020. Many companies found that productivity held up, and employees valued "
    "the time saved by not commuting. However, managers reported difficulties with onboarding new staff and "
    "building team culture, and some workers felt isolated. As a result, many organizations settled on hybrid "
    "arrangements with two or three office days per week.",
    "The Great Barrier Reef is the world's largest coral reef system, stretching over 2,300 kilometres along the "
    "coast of Australia. It supports thousands of species of fish, molluscs and coral. Rising sea temperatures "
    "have caused several mass bleaching events, in which corals expel the algae that give them colour and energy. "
    "Reefs can recover if temperatures return to normal, but repeated events leave less time for recovery.",
    "Our town council voted on Tuesday to convert the old railway line into a cycling and walking path. The project "
    "will cost about 4 million euros, half of which comes from a regional grant. Supporters say it will make "
    "commuting safer and boost local cafés, while some residents along the route worry about noise and privacy. "
    "Construction is expected to start next spring and take eighteen months.",
    "Sourdough bread is leavened by a starter, a mixture of flour and water colonized by wild yeasts and lactic acid "
    "bacteria. The yeasts produce carbon dioxide that makes the dough rise, and the bacteria produce acids that give "
    "the bread its tangy flavour and help it keep longer. Because the fermentation is slower than with commercial "
    "yeast, a sourdough loaf often takes a day or more from mixing to baking.",
    "In the quarterly report, the company said revenue grew 12 percent compared with last year, driven mainly by its "
    "subscription business. Hardware sales fell for the third quarter in a row. Operating costs rose because of "
    "investments in new data centres, so profit was flat. The company kept its forecast for the full year unchanged.",
    "Sleep researchers distinguish between several stages of sleep. During deep sleep the body repairs tissue and "
    "the brain consolidates some kinds of memories, while REM sleep is associated with vivid dreams and emotional "
    "processing. Adults typically cycle through these stages four to six times a night, and cutting sleep short "
    "mostly reduces the REM-rich cycles that come near morning.",
    "The library will change its opening hours from the first of next month. On weekdays it will open at 9 a.m. "
    "instead of 10 a.m. and close at 8 p.m. On Saturdays it will close at 4 p.m., and it will remain closed on "
    "Sundays. The self-service return box will stay available around the clock, and members can still renew "
    "books online.",
    "Electric scooters became common in many cities within a few years. They are cheap to rent and convenient for "
    "short trips, but they have also led to complaints about scooters blocking pavements and to a rise in injuries. "
    "Several cities now require parking in marked zones, limit speeds in pedestrian areas, and cap the number of "
    "scooters each operator may deploy.",
    "Octopuses are remarkable problem solvers. In laboratory studies they have opened screw-top jars, navigated "
    "mazes and recognized individual humans. Most of their neurons are located in their arms rather than their "
    "central brain, which allows each arm to react to touch and taste somewhat independently.",
]
SUMMARY_TEMPLATES = ["Summarize this paragraph in one sentence:\n\n{p}", "Give me three bullet points that capture "
                     "the key ideas of this text:\n\n{p}", "Write a short summary of the following for a busy "
                     "reader:\n\n{p}", "Explain this paragraph to a twelve-year-old in two or three sentences:\n\n{p}",
                     "TL;DR this:\n\n{p}", "What is the main point of this passage? Answer in one sentence.\n\n{p}",
                     "Rewrite this paragraph in plain language at half the length:\n\n{p}",
                     "List the facts stated in this paragraph as short bullet points:\n\n{p}"]
MISC_CHAT = ["Plan a relaxed three-day trip to {city} for someone who likes food and walking.",
             "Suggest a simple dinner I can cook with {a}, {b} and rice.",
             "Give me five ideas for a rainy Sunday afternoon with {who}.",
             "Write a short poem about {topic}.",
             "Write a birthday message for my {rel} who loves {hobby}.",
             "What are some good questions to ask at the end of a job interview for a {job} position?",
             "Help me write a toast for my {rel}'s wedding. Keep it under 150 words.",
             "Suggest a weekly workout plan for a beginner with {mins} minutes a day."]


def make_chat(r: Rng, i: int) -> str:
    kind = i % 5
    if kind == 0:
        return r.choice(ADVICE) + r.choice(["", "", " Please keep it short.", " Give me a step-by-step plan."])
    if kind == 1:
        recipient, purposes = r.choice(EMAILS)
        return (f"Write a {r.choice(TONES)} email to my {recipient} {r.choice(purposes)}."
                + r.choice(["", " Keep it under 120 words.", " Include a clear subject line."]))
    if kind == 2:
        return (f"Write a short story ({r.choice([100, 150, 200, 300])} words or less) about {r.choice(CHARACTERS)}. "
                f"{r.choice(SITUATIONS)}" + r.choice(["", " Give it a happy ending.", " Make it funny.",
                                                      " End with a twist."]))
    if kind == 3:
        return r.choice(SUMMARY_TEMPLATES).format(p=r.choice(PARAGRAPHS))
    return r.choice(MISC_CHAT).format(
        city=r.choice(CITIES), a=r.choice(["chicken", "chickpeas", "tofu", "salmon", "eggs"]),
        b=r.choice(["spinach", "tomatoes", "peppers", "mushrooms", "broccoli"]),
        who=r.choice(["two young kids", "my teenage son", "friends", "my partner"]),
        topic=r.choice(["the first snow of winter", "a cup of morning coffee", "an old bicycle", "city lights at night",
                        "a long train journey", "the sea in autumn"]),
        rel=r.choice(["sister", "brother", "best friend", "colleague", "cousin"]),
        hobby=r.choice(["gardening", "chess", "hiking", "photography", "baking"]),
        job=r.choice(["data analyst", "nurse", "software engineer", "teacher", "marketing"]),
        mins=r.choice([20, 30, 45]))


# =============================================================================================
# Assembly
# =============================================================================================

def humaneval_reference() -> tuple[frozenset[str], list[frozenset[str]]]:
    """Names no generated function may use (entry points and helpers) and the token sets of all problems."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    names = frozenset(p["entry_point"] for p in problems) | frozenset(
        n for p in problems for n in re.findall(r"\bdef\s+(\w+)", p["prompt"]))
    return names, [prompt_tokens(format_humaneval_prompt(p["prompt"])) for p in problems]


def generate(seed: int = SEED) -> list[dict]:
    r = random.Random(seed)
    forbidden, reference = humaneval_reference()
    seen: set[str] = set()

    def accept(text: str | None) -> bool:
        if text is None or text in seen:
            return False
        if set(re.findall(r"\b(?:def|function)\s+(\w+)", text)) & forbidden:
            return False
        tokens = prompt_tokens(text)
        if any(token_jaccard(tokens, ref) >= NEAR_COPY for ref in reference):
            return False
        seen.add(text)
        return True

    makers: dict[str, Callable[[Rng, int], str | None]] = {
        "code_completion": lambda rr, i: make_code_completion(rr, TASKS[i % len(TASKS)], forbidden),
        "coding": make_coding, "math": make_math, "explanation": make_explanation, "chat": make_chat,
    }
    records = []
    for category, count in COUNTS.items():
        texts: list[str] = []
        # Slot i keeps drawing from the same template until it yields a new acceptable prompt, so
        # templates stay balanced; a template that cannot do so is a bug and stops the run.
        for _ in range(count * 60):
            if len(texts) == count:
                break
            text = makers[category](r, len(texts))
            if accept(text):
                texts.append(text)
        if len(texts) < count:
            raise RuntimeError(f"{category}: only {len(texts)} of {count} distinct acceptable prompts; "
                               f"stuck at template slot {len(texts)}")
        records += [{"category": category, "content": t} for t in texts]
    # Interleave categories so that any prefix (load_prompts(..., limit=n)) is a mix.
    r.shuffle(records)
    return [{"id": f"builtin-{k:05d}", "messages": [{"role": "user", "content": rec["content"]}],
             "category": rec["category"]} for k, rec in enumerate(records, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "src" / "dflashkit" / "assets" / "train_prompts.jsonl")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    records = generate(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    counts = Counter(rec["category"] for rec in records)
    print(f"wrote {len(records)} prompts to {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
