"""Training samples built deterministically from the corpus: plain documentation text and chat conversations.

`build_samples(pages, render, seed, epoch)` returns one text per sample, each starting with BOS. Every section of
every page gives its plain text ("# page title", "## heading", the blocks) with probability `plain_share`, and
`chats` conversations of kinds drawn from `KINDS` by a generator seeded with (seed, epoch, page, section), so an
epoch is the same on every machine and each epoch asks its questions differently. The conversations are rendered by the model's own chat template
(`render(messages, tools=..., enable_thinking=...)` with the generation prompt, then the assistant's text and
`<|im_end|>`), so training sees exactly the prompts the server renders:

- `qa`: a user question about the section's topic, the answer its first passage;
- `think`: the same with thinking on: a short reasoning naming the page and section inside `<think>`;
- `tool`: with `TOOLS` declared, the assistant calls `search_docs` (or `run_python` on an interactive example,
  whose output the documentation shows), the tool result is the passage (or that output), then a short answer;
- `json`: the answer as a JSON object with the keys "topic" and "summary";
- `hello`: greetings and questions about the assistant itself, answered from a fixed list (`SMALL_TALK`).

Nothing here is read at run time: this is the recipe of the shipped model (docs/model.md).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

from .corpus import Page, Section
from .tokenizer import BOS, IM_END

KINDS = {"qa": 0.4, "think": 0.1, "tool": 0.2, "json": 0.1, "hello": 0.2}
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a helpful assistant that answers questions about Python.",
    "You are a small language model trained on the Python documentation. Answer briefly.",
]
QUESTIONS = [
    "What is {t}?",
    "Tell me about {t}.",
    "Explain {t}.",
    "What does the Python documentation say about {t}?",
    "How does {t} work?",
    "Can you describe {t}?",
    "I have a question about {t}. What should I know?",
    "Give me an overview of {t}.",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the Python documentation and return the best matching section.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look for"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run Python code in an interactive interpreter and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the statements to run"}},
                "required": ["code"],
            },
        },
    },
]
SMALL_TALK = {
    "greeting": (
        [
            "Hello!",
            "Hello",
            "hello",
            "Hi!",
            "Hi",
            "hi",
            "Hi there.",
            "Hello there!",
            "Hello, how are you?",
            "How are you?",
            "Good morning!",
            "Good evening.",
            "Hey!",
            "Hey there",
            "Greetings!",
        ],
        [
            "Hello! I am a small assistant trained on the Python documentation. Ask me about Python.",
            "Hi! How can I help you with Python today?",
            "Hello! I can answer questions about the Python language and its standard library.",
            "Hello! What would you like to know about Python?",
            "Hi there! I am a tiny model that read the Python documentation. What can I help you with?",
            "Hello! I am doing well, thank you. Do you have a question about Python?",
            "Good to see you! Ask me about a Python module, a function or a concept.",
        ],
    ),
    "identity": (
        [
            "Who are you?",
            "What are you?",
            "What can you do?",
            "What do you know?",
            "What is your name?",
            "Are you a person?",
            "Tell me about yourself.",
            "How were you trained?",
        ],
        [
            "I am a tiny language model trained on the Python 3.11 documentation. I can talk about Python, "
            "its standard library and its tools, but I am small and often wrong.",
            "I am a small model that has read the Python documentation. Ask me about a module or a concept.",
            "I am not a person. I am a small language model, trained on a CPU on the Python documentation.",
            "My name is tiny. I am a small assistant for questions about Python, and I make mistakes.",
        ],
    ),
    "thanks": (
        ["Thank you!", "Thanks.", "Thanks for your help.", "Thanks a lot!", "Great, thank you.", "That helps, thanks!"],
        [
            "You are welcome!",
            "Glad to help. Ask me anything else about Python.",
            "You are welcome. Good luck with your code!",
            "Happy to help!",
        ],
    ),
    "goodbye": (
        ["Bye!", "Goodbye.", "See you later!", "That is all for now."],
        ["Goodbye! Come back with more questions about Python.", "Bye! Happy coding.", "See you!"],
    ),
}
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_NUMBER = re.compile(r"^(\d+\.)+\d*\s+")  # "5.2.1. " before a heading
MIN_PASSAGE = 80  # shorter sections (a heading over a list of links) give no conversation


def topic(page: Page, section: Section) -> str:
    """The section's topic as a phrase: a module page's name ("json" for "json — JSON encoder and decoder")."""
    heading = _NUMBER.sub("", section.heading or page.title)
    return heading.split(" — ")[0].strip().rstrip(".") or page.title


def passage(section: Section, limit: int) -> str:
    """The section's first blocks, at most `limit` characters, cut at a block or sentence end."""
    out: list[str] = []
    size = 0
    for block in section.blocks:
        if size + len(block) > limit:
            if not out:
                acc = ""
                for s in _SENTENCE.split(block):
                    if len(acc) + len(s) > limit:
                        break
                    acc = f"{acc} {s}".strip()
                out.append(acc or block[:limit])
            break
        out.append(block)
        size += len(block) + 2
    return "\n\n".join(out)


def first_sentence(text: str) -> str:
    prose = next((b for b in text.split("\n\n") if not b.startswith((">>>", "$", "  "))), text)
    return _SENTENCE.split(prose)[0]


def interactive_example(section: Section) -> tuple[str, str] | None:
    """The first `>>>` example of the section whose statements print something: (code, printed output)."""
    for block in section.blocks:
        if not block.startswith(">>> "):
            continue
        code, output = [], []
        for line in block.splitlines():
            if line.startswith((">>> ", "... ")) or line in (">>>", "..."):
                if output:
                    break
                code.append(line[4:])
            else:
                output.append(line)
        if code and output and len("\n".join(code)) < 300:
            return "\n".join(code).strip(), "\n".join(output).strip()
    return None


Render = Callable[..., str]


def _turn(render: Render, messages: list[dict], reply: str, **kw) -> str:
    return render(messages, add_generation_prompt=True, **kw) + reply + IM_END + "\n"


def conversation(kind: str, page: Page, section: Section, rng: random.Random, render: Render) -> str:
    t = topic(page, section)
    text = passage(section, rng.choice([300, 500, 700]))
    system = {"role": "system", "content": rng.choice(SYSTEMS)}
    question = rng.choice(QUESTIONS).format(t=t)
    if kind == "hello":
        group = SMALL_TALK[rng.choice(sorted(SMALL_TALK))]
        msgs = [system, {"role": "user", "content": rng.choice(group[0])}]
        return _turn(render, msgs, rng.choice(group[1]))
    if kind == "qa":
        msgs = [system, {"role": "user", "content": question}]
        return _turn(render, msgs, text)
    if kind == "think":
        reasoning = (
            f'The user asks about {t}. The page "{page.title}" of the Python documentation covers it in the '
            f'section "{section.heading or page.title}". I will answer from that section.'
        )
        msgs = [system, {"role": "user", "content": question}]
        return render(msgs, add_generation_prompt=True, enable_thinking=True) + (
            f"{reasoning}\n</think>\n\n{text}{IM_END}\n"
        )
    if kind == "json":
        msgs = [
            system,
            {"role": "user", "content": f'{question} Reply with a JSON object with the keys "topic" and "summary".'},
        ]
        return _turn(render, msgs, json.dumps({"topic": t, "summary": first_sentence(text)}, ensure_ascii=False))
    # tool
    example = interactive_example(section)
    if example is not None and rng.random() < 0.5:
        code, printed = example
        user = rng.choice(["What does this print?", "Run this code:", "What is the result of this code?"])
        msgs = [system, {"role": "user", "content": f"{user}\n{code}"}]
        call = {"name": "run_python", "arguments": {"code": code}}
        answer = f"It prints:\n{printed}"
    else:
        msgs = [system, {"role": "user", "content": question}]
        call = {"name": "search_docs", "arguments": {"query": t}}
        printed = f"{page.title} > {section.heading or page.title}\n{text}"
        answer = first_sentence(text)
    called = msgs + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
    answered = called + [{"role": "tool", "content": printed}]
    return render(answered, tools=TOOLS, add_generation_prompt=True) + answer + IM_END + "\n"


def plain(page: Page, section: Section) -> str:
    head = f"# {page.title}\n\n" + (f"## {section.heading}\n\n" if section.heading != page.title else "")
    return head + section.text()


def parse_mix(text: str) -> dict[str, float]:
    """`qa=0.45,think=0.15,...` -> {kind: share}; every kind must be one of `KINDS`."""
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, share = part.partition("=")
        if name not in KINDS:
            raise ValueError(f"--mix: unknown kind {name!r} (choose from {', '.join(KINDS)})")
        try:
            mix[name] = float(share)
        except ValueError:
            raise ValueError(f"--mix: {part!r} is not kind=share") from None
    if not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
        raise ValueError("--mix needs at least one kind with a positive share")
    return mix


def build_samples(
    pages: list[Page],
    render: Render,
    seed: int,
    epoch: int,
    mix: dict[str, float] | None = None,
    plain_share: float = 1.0,
    chats: int = 1,
) -> list[str]:
    """Each section gives its plain text with probability `plain_share` and `chats` conversations, each of a kind
    drawn from `mix` (a conversation about the section needs a passage of `MIN_PASSAGE` characters; small talk
    does not)."""
    mix = mix or KINDS
    kinds, weights = list(mix), list(mix.values())
    out = []
    for page in pages:
        for i, section in enumerate(page.sections):
            rng = random.Random(f"{seed}:{epoch}:{page.path}:{i}")
            if plain_share >= 1 or rng.random() < plain_share:
                out.append(BOS + plain(page, section))
            for _ in range(chats):
                kind = rng.choices(kinds, weights)[0]
                if kind == "hello" or len(passage(section, 700)) >= MIN_PASSAGE:
                    chat = conversation(kind, page, section, rng, render)
                    out.append(chat if chat.startswith(BOS) else BOS + chat)  # the template writes BOS itself
    random.Random(f"{seed}:{epoch}:order").shuffle(out)
    return out
