"""Per-token cost of a grammar's allowed-token mask at batch 32: xgrammar against llguidance.

For each schema, 32 matchers (one per sequence) walk the grammar together: each step fills the batch's
bitmask (the cost that sits between the forward pass and sampling), then every matcher takes one allowed token
drawn at random (seeded; a finished matcher starts again). Reported per step: the 32-row fill, one row at a
time in this thread and through the library's own parallel fill, plus the advance of all 32 and the schema's
compile time. Also: which JSON Schema features each one enforces (a valid instance must be accepted and an
invalid one refused, both fed as the tokenizer encodes them).

    python -m benchmarks.engine.grammar_mask [--steps 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llguidance as llg
import llguidance.hf as llg_hf
import llguidance.torch as llg_torch
import torch
import xgrammar as xgr

from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings
from shared.text.tokenization import load_tokenizer, model_info

BATCH = 32
ANY_OBJECT = {"type": "object"}  # response_format json_object: any JSON object

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                "kind": {"enum": ["book", "tool", "food"]},
            },
            "required": ["sku", "qty", "kind"],
            "additionalProperties": False,
        }
    },
    "properties": {
        "order": {"type": "string"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["order", "items", "note"],
    "additionalProperties": False,
}
TOOL_CALL = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "name": {"const": "search"},
                "arguments": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "top": {"type": "integer"}},
                    "required": ["query"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    ]
}
SCHEMAS = {
    "json_object": None,
    "person": PERSON,
    "nested ($ref, enum, anyOf, pattern, min/maxItems)": NESTED,
    "tool call (anyOf of 2 functions)": TOOL_CALL,
}

# feature -> (schema, a valid instance, an invalid instance); the invalid one breaks only that feature.
_OBJ = {"type": "object", "required": ["a"], "additionalProperties": False}
COVERAGE = {
    "$ref/$defs": (
        {**_OBJ, "$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n"}}},
        '{"a": 1}',
        '{"a": "x"}',
    ),
    "enum": ({**_OBJ, "properties": {"a": {"enum": ["x", "y"]}}}, '{"a": "x"}', '{"a": "z"}'),
    "anyOf": (
        {**_OBJ, "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
        '{"a": null}',
        '{"a": "s"}',
    ),
    "additionalProperties false": ({**_OBJ, "properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "pattern": (
        {**_OBJ, "properties": {"a": {"type": "string", "pattern": "^[0-9]{3}$"}}},
        '{"a": "123"}',
        '{"a": "12a"}',
    ),
    "minItems/maxItems": (
        {**_OBJ, "properties": {"a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}},
        '{"a": [1]}',
        '{"a": [1, 2, 3]}',
    ),
    "minimum/maximum": (
        {**_OBJ, "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 9}}},
        '{"a": 5}',
        '{"a": 12}',
    ),
    "minLength/maxLength": (
        {**_OBJ, "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 3}}},
        '{"a": "ab"}',
        '{"a": "abcd"}',
    ),
    "oneOf": (
        {**_OBJ, "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}}},
        '{"a": true}',
        '{"a": "s"}',
    ),
    "format date": (
        {**_OBJ, "properties": {"a": {"type": "string", "format": "date"}}},
        '{"a": "2024-01-31"}',
        '{"a": "yesterday"}',
    ),
}


class XGrammar:
    name = "xgrammar 0.2.9"

    def __init__(self, tok, vocab: int, threads: int):
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.vocab = vocab

    def compile(self, schema):
        # compact separators: with any whitespace allowed a small model can loop on it
        return self.compiler.compile_json_schema(
            json.dumps(schema or ANY_OBJECT), any_whitespace=False, strict_mode=schema is not None
        )

    def matcher(self, grammar):
        return xgr.GrammarMatcher(grammar)

    def bitmask(self):
        return xgr.allocate_token_bitmask(BATCH, self.vocab)

    def fill(self, m, mask, i):
        m.fill_next_token_bitmask(mask, i)

    def fill_par(self, ms, mask):
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m, t) -> bool:
        return m.accept_token(t)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance 1.9.1"

    def __init__(self, tok, vocab: int, threads: int):
        self.tok = llg_hf.from_tokenizer(tok, n_vocab=vocab)
        self.executor = llg.LLExecutor(threads)
        self.vocab = vocab

    def compile(self, schema):
        grammar = llg.LLMatcher.grammar_from_json_schema(
            schema or ANY_OBJECT, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        err = llg.LLMatcher.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        self.matcher(grammar)  # the grammar is processed lazily: the first matcher pays for it
        return grammar

    def matcher(self, grammar):
        m = llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self):
        return llg_torch.allocate_token_bitmask(BATCH, self.vocab)

    def fill(self, m, mask, i):
        llg_torch.fill_next_token_bitmask(m, mask, i)

    def fill_par(self, ms, mask):
        llg_torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)

    def accept(self, m, t) -> bool:
        return m.consume_token(t) and not m.is_error()

    def done(self, m) -> bool:
        return m.is_stopped()


def _allowed(mask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def walk(lib, grammar, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    ms = [lib.matcher(grammar) for _ in range(BATCH)]
    mask = lib.bitmask()
    seq_ms, par_ms, adv_ms = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        for i, m in enumerate(ms):
            lib.fill(m, mask, i)
        t1 = time.perf_counter()
        lib.fill_par(ms, mask)
        t2 = time.perf_counter()
        picks = [rng.choice(_allowed(mask[i], lib.vocab)) for i in range(BATCH)]
        t3 = time.perf_counter()
        for i, m in enumerate(ms):
            if not lib.accept(m, picks[i]) or lib.done(m):
                ms[i] = lib.matcher(grammar)
        t4 = time.perf_counter()
        seq_ms.append((t1 - t0) * 1e3)
        par_ms.append((t2 - t1) * 1e3)
        adv_ms.append((t4 - t3) * 1e3)
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {
        "fill32_ms_mean": statistics.mean(seq_ms),
        "fill32_ms_p99": q(seq_ms, 0.99),
        "fill32_par_ms_mean": statistics.mean(par_ms),
        "fill32_par_ms_p99": q(par_ms, 0.99),
        "advance32_ms_mean": statistics.mean(adv_ms),
    }


def enforces(lib, tok, schema, good: str, bad: str) -> str:
    try:
        grammar = lib.compile(schema)
    except Exception as e:  # the library refuses the schema: that is the finding
        return f"refused ({type(e).__name__})"

    def takes(text: str) -> bool:
        m = lib.matcher(grammar)
        ok = all(lib.accept(m, t) for t in tok.encode(text, add_special_tokens=False))
        return ok and (m.is_completed() if hasattr(m, "is_completed") else m.is_accepting())

    g, b = takes(good), takes(bad)
    return "yes" if g and not b else ("ignored" if g else "rejects valid")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    s = CommonSettings()
    info = model_info(resolve_model_dir(s.model, s.cache_dir))
    tok = load_tokenizer(info.model_dir)
    torch.set_num_threads(1)
    print(f"model {info.model_dir.name}, vocab {info.vocab_size}, batch {BATCH}, {args.steps} steps")
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        lib = cls(tok, info.vocab_size, args.threads)
        print(f"\n## {lib.name}: tokenizer setup {time.perf_counter() - t0:.2f} s")
        print(
            "| schema | compile ms | fill 32 rows, one by one: mean / p99 ms | parallel fill: mean / p99 ms "
            "| advance 32 ms |"
        )
        print("|---|---|---|---|---|")
        for name, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            grammar = lib.compile(schema)
            compile_ms = (time.perf_counter() - t0) * 1e3
            r = walk(lib, grammar, args.steps, seed=7)
            print(
                f"| {name} | {compile_ms:.1f} | {r['fill32_ms_mean']:.2f} / {r['fill32_ms_p99']:.2f} | "
                f"{r['fill32_par_ms_mean']:.2f} / {r['fill32_par_ms_p99']:.2f} | {r['advance32_ms_mean']:.2f} |"
            )
        print("\n| feature | enforced |\n|---|---|")
        for feature, (schema, good, bad) in COVERAGE.items():
            print(f"| {feature} | {enforces(lib, tok, schema, good, bad)} |")


if __name__ == "__main__":
    main()
