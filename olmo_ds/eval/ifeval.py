"""Instruction following with verifiable constraints, as IFEval (Zhou et al. 2023) states and scores them.

A row (the `google/IFEval` layout): `{"key": int, "prompt": str, "instruction_id_list": [id, ...], "kwargs":
[{...}, ...]}`, one kwargs object per instruction (the hub's rows carry every argument name, unused ones null).
The prompt goes to the model as it is (as a user turn where the checkpoint has a chat template); the response
is checked against each instruction:

- strict: the response as written;
- loose: IFEval's relaxed reading, the instruction counts as followed if any of eight variants passes (the
  response with its first line, its last line, both or neither removed, each with and without "*").

Metrics, as IFEval reports them: `prompt_level_strict_acc` / `prompt_level_loose_acc` (every instruction of
a prompt followed) and `inst_level_strict_acc` / `inst_level_loose_acc` (per instruction); the primary is
`prompt_level_loose_acc`, OLMES's. The checks below are the instructions this module verifies (`CHECKS`);
a row naming another is refused when read from a local file and left out, counted, when read from the hub
(`unsupported`), so a score says how many prompts it covers.

"All lowercase" and "all capitals" (`change_case:english_lowercase` / `english_capital`) follow the rule of
open-instruct's copy of IFEval, the reward OLMo 3's RLVR used (open_instruct/IFEvalG/instructions.py at e6c3044,
lines 1353-1362 and 1382-1391, as google's IFEval states them): `str.islower()` (`isupper()`) and langdetect's
verdict that the text is English; text langdetect finds no language in counts as English, as there. langdetect
draws at random: it is seeded here (`DetectorFactory.seed = 0`, as its documentation advises for repeatable
results) so a response gets the same verdict every time; open-instruct leaves it unseeded. Its verdict on a very
short text can be wrong ("all done here." reads as Italian), as it is in OLMo 3's reward.
"""

from __future__ import annotations

import json
import re

import langdetect

NAME = "ifeval"
HUB = ("google/IFEval", "default", "train")  # repo, config, split of the hub's rows
PRIMARY = "prompt_level_loose_acc"
MAX_NEW_TOKENS = 1024
STOP: tuple[str, ...] = ()
RELATIONS = ("less than", "at least")


def _compare(count: int, relation: str, n: int) -> bool:
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    return count < n if relation == "less than" else count >= n


def _words(text: str) -> int:
    return len(re.findall(r"\w+", text))


def _english(text: str) -> bool:
    """langdetect's verdict that `text` is English (module docstring)."""
    langdetect.DetectorFactory.seed = 0
    try:
        return langdetect.detect(text) == "en"
    except langdetect.LangDetectException:
        return True


def _keywords(response: str, keywords: list[str]) -> bool:
    return all(re.search(re.escape(k), response, re.IGNORECASE) for k in keywords)


def _forbidden(response: str, forbidden_words: list[str]) -> bool:
    return not any(re.search(r"\b" + re.escape(w) + r"\b", response, re.IGNORECASE) for w in forbidden_words)


def _bullets(response: str, num_bullets: int) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", response, re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", response, re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


def _json(response: str) -> bool:
    text = response.strip().removeprefix("```json").removeprefix("```Json").removeprefix("```JSON").removeprefix("```")
    try:
        json.loads(text.removesuffix("```").strip())
    except ValueError:
        return False
    return True


def _paragraphs(response: str, num_paragraphs: int) -> bool:
    """Paragraphs separated by "***"; an empty one counts against only at the very start or end (IFEval's rule)."""
    parts = re.split(r"\s?\*\*\*\s?", response)
    inner = [p.strip() for p in parts[1:-1]]
    if not all(inner):
        return False
    return len(parts) - (not parts[0].strip()) - (len(parts) > 1 and not parts[-1].strip()) == num_paragraphs


def _title(response: str) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", response))


def _letters(response: str, letter: str, let_frequency: int, let_relation: str) -> bool:
    return _compare(response.lower().count(letter.lower()), let_relation, let_frequency)


def _quoted(response: str) -> bool:
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def _postscript(response: str, postscript_marker: str) -> bool:
    """A postscript line: "P.S." and "P.P.S" match with optional spaces between their letters, as IFEval reads them."""
    marker = postscript_marker.strip().lower()
    pattern = {"p.p.s": r"\s*p\.\s?p\.\s?s.*$", "p.s.": r"\s*p\.\s?s\..*$"}.get(marker, r"\s*" + re.escape(marker) + r".*$")
    return re.search(pattern, response.lower(), re.MULTILINE) is not None


def _highlights(response: str, num_highlights: int) -> bool:
    marked = re.findall(r"\*[^\n\*]*\*", response) + re.findall(r"\*\*[^\n\*]*\*\*", response)
    return sum(bool(h.strip("*").strip()) for h in marked) >= num_highlights


def _sections(response: str, section_spliter: str, num_sections: int) -> bool:
    return len(re.split(r"\s?" + re.escape(section_spliter) + r"\s?\d+\s?", response)) - 1 >= num_sections


def _two_responses(response: str) -> bool:
    parts = response.split("******")
    if any(not p.strip() for p in parts[1:-1]):
        return False
    kept = [p for p in parts if p.strip()]
    return len(kept) == 2 and kept[0].strip() != kept[1].strip()


def _nth_paragraph_first_word(response: str, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    """Paragraphs separated by blank lines; the nth's first word, lowercased, up to its first punctuation mark."""
    paragraphs = re.split(r"\n\n", response)
    count = sum(bool(p.strip()) for p in paragraphs)
    if nth_paragraph > count or not paragraphs[nth_paragraph - 1].strip():
        return False
    word = paragraphs[nth_paragraph - 1].strip().split()[0].strip().lstrip("'").lstrip('"')
    found = ""
    for letter in word:
        if letter in ".,?!'\"":
            break
        found += letter.lower()
    return count == num_paragraphs and found == first_word.strip().lower()


CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


# instruction id -> (check(response, **kwargs), the kwargs it takes)
CHECKS = {
    "punctuation:no_comma": (lambda r: "," not in r, ()),
    "change_case:english_lowercase": (lambda r: r.islower() and _english(r), ()),
    "change_case:english_capital": (lambda r: r.isupper() and _english(r), ()),
    "keywords:existence": (_keywords, ("keywords",)),
    "keywords:forbidden_words": (_forbidden, ("forbidden_words",)),
    "keywords:letter_frequency": (_letters, ("letter", "let_frequency", "let_relation")),
    "length_constraints:number_words": (lambda r, num_words, relation: _compare(_words(r), relation, num_words), ("num_words", "relation")),
    "length_constraints:number_paragraphs": (_paragraphs, ("num_paragraphs",)),
    "detectable_format:number_bullet_lists": (_bullets, ("num_bullets",)),
    "detectable_format:title": (_title, ()),
    "detectable_format:json_format": (_json, ()),
    "startend:end_checker": (lambda r, end_phrase: r.strip().strip('"').lower().endswith(end_phrase.strip().lower()), ("end_phrase",)),
    "startend:quotation": (_quoted, ()),
    "detectable_content:postscript": (_postscript, ("postscript_marker",)),
    "detectable_content:number_placeholders": (lambda r, num_placeholders: len(re.findall(r"\[.*?\]", r)) >= num_placeholders, ("num_placeholders",)),
    "detectable_format:number_highlighted_sections": (_highlights, ("num_highlights",)),
    "detectable_format:multiple_sections": (_sections, ("section_spliter", "num_sections")),
    "detectable_format:constrained_response": (lambda r: any(c in r for c in CONSTRAINED_RESPONSES), ()),
    "keywords:frequency": (lambda r, keyword, frequency, relation: _compare(len(re.findall(re.escape(keyword), r, re.IGNORECASE)), relation, frequency),
                           ("keyword", "frequency", "relation")),
    "combination:repeat_prompt": (lambda r, prompt_to_repeat: r.strip().lower().startswith(prompt_to_repeat.strip().lower()), ("prompt_to_repeat",)),
    "combination:two_responses": (_two_responses, ()),
    "length_constraints:nth_paragraph_first_word": (_nth_paragraph_first_word, ("num_paragraphs", "nth_paragraph", "first_word")),
}


def unsupported(row: dict) -> list[str]:
    return [i for i in row.get("instruction_id_list", []) if i not in CHECKS]


def check_row(row: dict, where: str) -> tuple[str, list[tuple[str, dict]]]:
    """(prompt, [(instruction id, its kwargs)]) of a row; a ValueError naming `where` for anything not checkable."""
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise ValueError(f"{where}: an {NAME} row needs a non-empty string 'prompt' (the google/IFEval layout)")
    return row["prompt"], check_instructions(row.get("instruction_id_list"), row.get("kwargs"), where, ids_key="instruction_id_list")


def check_instructions(ids, kwargs, where: str, ids_key: str = "instruction_id_list") -> list[tuple[str, dict]]:
    """[(instruction id, its kwargs)] of an instruction list and its kwargs list (a row's, or an RL prompt's ground
    truth, `olmo_ds.eval.verifiers`); a ValueError naming `where` and `ids_key` for anything not checkable. A null
    kwargs entry means no arguments (open-instruct's RLVR rows write it so)."""
    if not isinstance(ids, list) or not ids or not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise ValueError(f"{where}: {ids_key!r} must be a non-empty list and 'kwargs' a list of as many objects")
    instructions = []
    for instruction, given in zip(ids, kwargs):
        if not isinstance(instruction, str) or instruction not in CHECKS:
            raise ValueError(f"{where}: instruction {instruction!r} is not one this evaluation verifies ({', '.join(CHECKS)})")
        given = {} if given is None else given
        if not isinstance(given, dict):
            raise ValueError(f"{where}: the kwargs of {instruction!r} must be an object, got {given!r}")
        _, names = CHECKS[instruction]
        args = {k: v for k, v in given.items() if v is not None}
        missing, extra = [n for n in names if n not in args], sorted(set(args) - set(names))
        if missing or extra:
            raise ValueError(f"{where}: {instruction!r} takes {list(names) or 'no arguments'}"
                             + (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else ""))
        if "relation" in args or "let_relation" in args:
            relation = args.get("relation", args.get("let_relation"))
            if relation not in RELATIONS:
                raise ValueError(f"{where}: {instruction!r}: relation must be one of {RELATIONS}, got {relation!r}")
        instructions.append((instruction, args))
    return instructions


def _loose_variants(response: str) -> list[str]:
    lines = response.split("\n")
    cut = ["\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    variants = [response, *cut]
    return variants + [v.replace("*", "") for v in variants]


def score(response: str, instructions: list[tuple[str, dict]]) -> dict:
    """Per instruction, whether the response follows it strictly and loosely."""
    strict, loose = [], []
    variants = _loose_variants(response)
    for instruction, args in instructions:
        check, _ = CHECKS[instruction]
        strict.append(bool(response.strip()) and bool(check(response, **args)))
        loose.append(any(v.strip() and check(v, **args) for v in variants))
    return {"instructions": [i for i, _ in instructions], "strict": strict, "loose": loose}


def metrics(scores: list[dict]) -> dict:
    out = {}
    for mode in ("strict", "loose"):
        out[f"prompt_level_{mode}_acc"] = sum(all(s[mode]) for s in scores) / len(scores)
        flat = [ok for s in scores for ok in s[mode]]
        out[f"inst_level_{mode}_acc"] = sum(flat) / len(flat)
    return out
