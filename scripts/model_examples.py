"""Prints the greedy answers of a checkpoint to docs/model.md's example prompts, as a Markdown table.

.venv/bin/python scripts/model_examples.py [MODEL]      (default: tiny, the shipped checkpoint)
"""

from __future__ import annotations

import sys

from llm_backend import LLM, SamplingParams
from llm_backend.server.chat_template import load_chat_template
from mimo_epd.train.samples import TOOLS

PROMPTS = [
    ("Hello!", {}),
    ("What is the json module?", {}),
    ("How do I read a file line by line?", {}),
    ("What is a list comprehension?", {"enable_thinking": True}),
    ("Tell me about the collections module.", {"tools": TOOLS}),
    ('Describe the re module. Reply with a JSON object with the keys "topic" and "summary".', {}),
]


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    llm, template = LLM(model), load_chat_template(model)
    print("| prompt | answer |\n|---|---|")
    for prompt, extra in PROMPTS:
        text = template.render([{"role": "user", "content": prompt}], **extra)
        out = llm.generate([text], SamplingParams(max_tokens=60))[0]
        out = llm.tokenizer.tok.decode(out.output_token_ids, skip_special_tokens=False)
        note = " (`enable_thinking`)" if "enable_thinking" in extra else " (with the two tools)" if extra else ""
        shown = out.replace("\n", "\\n").replace("|", "\\|")
        print(f"| `{prompt}`{note} | `{shown}` |")


if __name__ == "__main__":
    main()
