"""What a simulated worker (CONVEYOR_ENGINE=sim) emits for a prompt: the stand-in for the model's greedy
reference in end-to-end tests whose subject is the control plane, not the model's numbers."""

from __future__ import annotations

from pathlib import Path

from services.worker.engine.sim.sim_model import load_vocab, sequence_key
from shared.text.tokenization import load_tokenizer

SIM = {"CONVEYOR_ENGINE": "sim"}  # a Cluster env entry: its workers run the simulated engine


def sim_greedy(model_dir: Path):
    """generate(ids, max_new_tokens) -> the tokens the simulator emits (greedy, no EOS), with .prompt_ids(prompt)
    and .tokenizer, like conftest's `hf_reference`."""
    vocab, tok = load_vocab(model_dir), load_tokenizer(model_dir)

    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        key = sequence_key(ids, 0)
        return [vocab.next_token(key, i, vocab.eos_token_ids, True, 0.0) for i in range(max_new_tokens)]

    generate.prompt_ids = lambda prompt: tok.encode(prompt)
    generate.tokenizer = tok
    return generate
