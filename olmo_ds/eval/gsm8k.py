"""GSM8K in OLMES's generative format: 8-shot chain of thought, the answer extracted and exact-matched.

The prompt (`prompt(question)`): the eight chain-of-thought exemplars of Wei et al. (2022), each as
"Question: ...\\nAnswer: <reasoning> So the answer is N.", separated by blank lines, then the question with
"Answer:". The model continues greedily until "Question:", a blank line, "</s>" or "<|im_end|>" as text, the
EOS or 512 new tokens (`STOP`, `MAX_NEW_TOKENS`: OLMES's settings for the task).

Scoring (`extract`, `normalize`): the answer is the number after the last "So the answer is", else after
"#### ", else the last number of the completion; numbers are compared after dropping thousands
separators, a leading "$", a trailing "." and trailing zeros of a decimal part ("18.00" is 18). The gold
is the number after "#### " in the dataset's `answer` field. Metric: `exact_match` (the primary).

Rows (`check_row`): the layout of the `openai/gsm8k` dataset, `{"question": str, "answer": str}` with the
gold after "#### "; a local JSON-lines file of such rows is a task as the hub's parquet files are.
"""

from __future__ import annotations

import re

NAME = "gsm8k"
HUB = ("openai/gsm8k", "main", "test")  # repo, config, split of the hub's rows
PRIMARY = "exact_match"
MAX_NEW_TOKENS = 512
STOP = ("Question:", "</s>", "<|im_end|>", "\n\n")

SHOTS = [
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, there will be "
     "21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have been "
     "21 - 15 = 6.", "6"),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5.", "5"),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, they "
     "had 74 - 35 = 39.", "39"),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did Jason give "
     "to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8.", "8"),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9.", "9"),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to thursday. "
     "How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers were "
     "added. 9 + 20 is 29.", "29"),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf balls did "
     "he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he had "
     "35 - 2 = 33 golf balls.", "33"),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars left. "
     "23 - 15 is 8.", "8"),
]

_NUMBER = r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?|-?\$?\.[0-9]+"
_SO_THE_ANSWER = re.compile(r"So the answer is\s*(" + _NUMBER + ")", re.IGNORECASE)
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def prompt(question: str) -> str:
    shots = "".join(f"Question: {q}\nAnswer: {reasoning} So the answer is {answer}.\n\n" for q, reasoning, answer in SHOTS)
    return f"{shots}Question: {question}\nAnswer:"


def normalize(number: str) -> str:
    """"$1,234.50" -> "1234.5", "18.00" -> "18", "-3." -> "-3": the form two equal answers share."""
    text = number.strip().rstrip(".").replace(",", "").replace("$", "")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("", "-", "-0") else text


def extract(completion: str) -> str | None:
    """The completion's answer (see the module docstring), normalised; None when it holds no number."""
    for pattern in (_SO_THE_ANSWER, _HASHES):
        found = pattern.findall(completion)
        if found:
            return normalize(found[-1])
    numbers = _ANY_NUMBER.findall(completion)
    return normalize(numbers[-1]) if numbers else None


def check_row(row: dict, where: str) -> tuple[str, str]:
    """(question, normalised gold) of a dataset row; a ValueError naming `where` for a row that is not one."""
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"{where}: a {NAME} row needs a non-empty string {key!r} (the openai/gsm8k layout)")
    gold = _HASHES.findall(row["answer"])
    if not gold:
        raise ValueError(f"{where}: 'answer' holds no '#### N' final answer")
    return row["question"], normalize(gold[-1])


def score(completion: str, gold: str) -> dict:
    answer = extract(completion)
    return {"extracted": answer, "gold": gold, "exact_match": float(answer is not None and answer == gold)}


def metrics(scores: list[dict]) -> dict:
    return {PRIMARY: sum(s[PRIMARY] for s in scores) / len(scores)}
