"""The varied prompts of the correctness tests (chat and raw text, short and long)."""

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? Answer briefly.",
    "Give me a Python function that reverses a string.",
]

RAW = [
    "The quick brown fox",
    "Once upon a time, in a small village by the mountains,",
    # Long enough to be prefilled in several chunks with a small token budget.
    "Summarize the following notes. " + " ".join(
        f"Note {i}: the meeting on day {i} discussed budget item {i * 7 % 13} and agreed to revisit it."
        for i in range(40)
    ),
]


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def all_prompt_ids(tokenizer) -> list[list[int]]:
    return [chat_prompt(tokenizer, t) for t in CHAT] + [tokenizer.encode(t) for t in RAW]
