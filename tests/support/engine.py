"""Shared data and helpers of the engine tests (imported by the test modules); their greedy reference is the suite's
(`hf_reference`, tests/support/references.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.engine import LLMEngine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three fruits.",
    "Hi!",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your steps.",
    "Give me a short tip for writing clean Python code.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue? Answer for a ten year old child who is curious about science and nature.",
    "Name a famous painter.",
    "Describe a cat to someone who has never seen one, using at least three senses, and keep it friendly.",
    "What does HTTP stand for?",
    "Tell me a fun fact about octopuses.",
    "How do I boil an egg? I want the yolk soft but the white fully set, and I only have a small pot.",
    "Recommend a book for learning about the history of mathematics, and say why it is good.",
]

PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from those used to make wine. Before "
    "his invention, books were copied by hand, usually by monks or professional scribes, which made them "
    "rare and expensive. The new machine could produce thousands of pages a day. Within fifty years, "
    "printing shops had spread to more than two hundred cities across Europe, and millions of books had "
    "been printed. Scholars argue that the press helped the Renaissance, the Reformation and the "
    "scientific revolution by letting ideas travel faster and further than ever before. It also changed "
    "languages, because printers standardised spelling and grammar to sell books to wider audiences. "
)


@dataclass
class Run:
    """What a request produced across steps, checked for index continuity as it arrives."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error_reason: str | None = None
    finished: bool = False
    cached_tokens: int = 0
    logprobs: list = field(default_factory=list)  # TokenLogprobs per token, when the request asked
    prompt_logprobs: list | None = None  # TokenLogprobs per prompt token from the second, when the request asked


def collect(result, runs: dict[str, Run]) -> None:
    """Fold one StepResult into runs, asserting no token is missing or repeated."""
    for out in result.outputs:
        run = runs.setdefault(out.request_id, Run())
        assert not run.finished, f"{out.request_id}: output after it finished"
        if out.new_token_ids:
            assert out.first_index == len(run.tokens), (
                f"{out.request_id}: first_index {out.first_index}, expected {len(run.tokens)}"
            )
        run.tokens.extend(out.new_token_ids)
        if out.logprobs is not None:
            assert len(out.logprobs) == len(out.new_token_ids), f"{out.request_id}: one TokenLogprobs per token"
            run.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            assert run.prompt_logprobs is None, f"{out.request_id}: prompt log probabilities twice"
            assert out.first_index == 0 and out.new_token_ids, f"{out.request_id}: not with the first token"
            run.prompt_logprobs = out.prompt_logprobs
        run.cached_tokens = max(run.cached_tokens, out.num_cached_tokens)
        if out.finished:
            run.finished, run.finish_reason, run.error_reason = True, out.finish_reason, out.error_reason


def run_to_completion(engine: LLMEngine, runs: dict[str, Run] | None = None, max_steps: int = 2000):
    runs = {} if runs is None else runs
    steps = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return runs, steps
        result = engine.step()
        collect(result, runs)
        steps.append(result)
    raise AssertionError(f"engine still busy after {max_steps} steps: {engine.stats()}")
