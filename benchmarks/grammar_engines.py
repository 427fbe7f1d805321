"""llguidance against xgrammar as the host side of structured outputs, on GPT-2's 50257-token vocabulary:
the one-time tokenizer set-up, the cold compile of 20 JSON schemas, and the per-token mask.

    python benchmarks/grammar_engines.py                    # both engines, 4 rounds (pip install xgrammar)
    python benchmarks/grammar_engines.py --rounds 4 --pause 2
    python benchmarks/grammar_engines.py --side llguidance  # one engine once, its RESULT line only

Each engine runs in its own process (harness.py: the order alternates per round), so a cold compile is
cold: no cache of the other engine's, none of an earlier round's. "Compile" is what a request with a new
schema waits for before its first token: the grammar built for the vocabulary and its first mask
computed (llguidance builds its lexer lazily, xgrammar precomputes masks at compile time; counting the
first mask makes the two comparable). "Mask" is one later step: the next-token bitmask filled, then
the sampled token accepted, timed apart. The tokens are GPT-2's own encoding of a valid instance of each
schema (compact JSON, properties in declared order), the text a model would write; both engines must
accept every one of them (`rejected` counts those they did not).

The llguidance side is flaxgpt.serve.grammar itself (its JSON schema check, its compile pool, its row
fill); xgrammar is configured to match: whitespace allowed but bounded (grammar.py's whitespace pattern,
xgrammar's `max_whitespace_cnt`), additional properties refused by the schemas.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time

import harness  # first: the benchmarks' one sys.path rule, see harness.py
import numpy as np

ENGINES = ("llguidance", "xgrammar")
N_SCHEMAS = 20
VOCAB = 50257  # GPT-2's tokenizer, not the model's padded 50304: the mask's width is the same question
MAX_WHITESPACE = 16  # per place whitespace may go (the server's bound, flaxgpt/serve/grammar.py)
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "fox", "golf", "hotel", "india", "juliet"]


def field(rng: np.random.Generator, depth: int) -> tuple[dict, object]:
    """(schema, a valid value): one property of a realistic API schema."""
    kind = rng.choice(
        ["str", "int", "num", "bool", "enum", "null", "pattern", "list"] + ["obj"] * (depth < 2)
    )
    if kind == "str":
        words = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 6))))
        return {"type": "string", "maxLength": 60}, words
    if kind == "int":
        return {"type": "integer", "minimum": 0, "maximum": 1000}, int(rng.integers(0, 1001))
    if kind == "num":
        return {"type": "number", "minimum": -10, "maximum": 10}, round(float(rng.uniform(-10, 10)), 3)
    if kind == "bool":
        return {"type": "boolean"}, bool(rng.integers(2))
    if kind == "enum":
        return {"enum": ["low", "medium", "high"]}, str(rng.choice(["low", "medium", "high"]))
    if kind == "null":
        return {"type": ["string", "null"]}, None
    if kind == "pattern":
        return {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, f"ABC-{int(rng.integers(10000)):04d}"
    if kind == "list":
        n = int(rng.integers(1, 5))
        items = [str(w) for w in rng.choice(WORDS, size=n)]
        return {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4}, items
    return obj(rng, depth + 1, int(rng.integers(2, 5)))


def obj(rng: np.random.Generator, depth: int, n_fields: int) -> tuple[dict, dict]:
    props, value = {}, {}
    for i in range(n_fields):
        name = f"{rng.choice(WORDS)}_{i}"
        props[name], value[name] = field(rng, depth)
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return schema, value


def examples(n: int) -> list[tuple[dict, str]]:
    """n (schema, compact JSON instance) pairs, the same in every process."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        schema, value = obj(rng, 0, int(rng.integers(3, 9)))
        out.append((schema, json.dumps(value, separators=(",", ":"))))
    return out


class Llguidance:
    """flaxgpt.serve.grammar itself: the server's compile path (schema check, pool, first mask) and fill."""

    def __init__(self, tokenizer):
        from flaxgpt.serve import grammar

        self.grammar = grammar
        self.grammars = grammar.Grammars(tokenizer, VOCAB, cache_size=0)

    def matcher(self, schema: dict):
        spec = self.grammar.json_schema_spec(schema, "response_format")
        return self.grammars.matcher(self.grammars.compile(spec, "response_format"))

    def fill(self, m, row_W: np.ndarray) -> None:
        m.fill(row_W[None], 0)

    def accept(self, m, token: int) -> bool:
        m.accept(token)
        return True


class Xgrammar:
    def __init__(self, enc, threads: int):
        import xgrammar

        self.xgr = xgrammar
        vocab = [enc.decode_single_token_bytes(i) for i in range(VOCAB)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[50256])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(
            schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE
        )
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, row_W: np.ndarray) -> None:
        m.fill_next_token_bitmask(row_W[None], 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


def side(engine: str, threads: int) -> dict:
    """One engine, one process: the figures its RESULT line carries."""
    t0 = time.perf_counter()
    from flaxgpt.data.tokenizers import get_tokenizer

    tokenizer = get_tokenizer("gpt2")
    enc = tokenizer.enc
    pairs = examples(N_SCHEMAS)
    t1 = time.perf_counter()
    e = Llguidance(tokenizer) if engine == "llguidance" else Xgrammar(enc, threads)
    setup_s = time.perf_counter() - t1
    import_s = t1 - t0  # flaxgpt's tokenizer; the engine's own import is in setup_s
    row_W = np.zeros((VOCAB + 31) // 32, np.int32)
    compile_ms, fill_us, accept_us, rejected = [], [], [], 0
    for schema, text in pairs:
        t = time.perf_counter()
        m = e.matcher(schema)
        e.fill(m, row_W)
        compile_ms.append(1e3 * (time.perf_counter() - t))
        for token in enc.encode_ordinary(text):
            t = time.perf_counter()
            e.fill(m, row_W)
            t2 = time.perf_counter()
            ok = bool((row_W[token // 32] >> (token % 32)) & 1) and e.accept(m, token)
            accept_us.append(1e6 * (time.perf_counter() - t2))
            fill_us.append(1e6 * (t2 - t))
            if not ok:
                rejected += 1
                break
    return {
        "version": importlib.metadata.version(engine),
        "setup_s": setup_s,
        "flaxgpt_tokenizer_s": import_s,
        "compile_ms_first": compile_ms[0],
        "compile_ms_median": statistics.median(compile_ms),
        "compile_ms_max": max(compile_ms),
        "compile_s_total": sum(compile_ms) / 1e3,
        "mask_us_mean": statistics.fmean(fill_us),
        "mask_us_p50": statistics.median(fill_us),
        "mask_us_p99": float(np.percentile(fill_us, 99)),
        "accept_us_mean": statistics.fmean(accept_us),
        "tokens": len(fill_us),
        "rejected": rejected,
    }


def table(report: harness.Report) -> str:
    """Each figure's median over the rounds, one column per engine."""
    rows = [
        ("engine version", "version", "{}"),
        ("tokenizer set-up, s (once per server)", "setup_s", "{:.2f}"),
        (f"compile, {N_SCHEMAS} schemas cold: total s", "compile_s_total", "{:.3f}"),
        ("compile: first schema, ms", "compile_ms_first", "{:.1f}"),
        ("compile: median, ms", "compile_ms_median", "{:.1f}"),
        ("compile: slowest, ms", "compile_ms_max", "{:.1f}"),
        ("mask per token: mean, us", "mask_us_mean", "{:.0f}"),
        ("mask per token: median, us", "mask_us_p50", "{:.0f}"),
        ("mask per token: p99, us", "mask_us_p99", "{:.0f}"),
        ("accept per token: mean, us", "accept_us_mean", "{:.1f}"),
        ("tokens replayed / rejected", None, "{}"),
    ]
    names = list(report.results[0])
    lines = ["| figure | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for label, key, fmt in rows:
        cells = []
        for name in names:
            values = [r[name] for r in report.results]
            if key is None:
                cells.append(f"{values[0]['tokens']} / {max(v['rejected'] for v in values)}")
            elif key == "version":
                cells.append(values[0][key])
            else:
                cells.append(fmt.format(statistics.median(v[key] for v in values)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=ENGINES, help="run one engine once and print its RESULT line")
    ap.add_argument("--engines", default=",".join(ENGINES), help="the engines to compare")
    ap.add_argument("--threads", type=int, default=1, help="xgrammar's compile threads (the server uses 1)")
    harness.add_arguments(ap)
    args = ap.parse_args()
    if args.side:
        harness.print_result(side(args.side, args.threads))
        return
    engines = args.engines.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"error: --engines {','.join(unknown)} unknown; choose from {','.join(ENGINES)}")
    sides = [
        harness.Side(e, [sys.executable, __file__, "--side", e, "--threads", str(args.threads)])
        for e in engines
    ]
    figures = []
    if len(engines) == 2:
        a, b = engines
        figures = [
            harness.Figure("compile, 20 schemas cold", a, "compile_s_total", b, "compile_s_total", False),
            harness.Figure("mask per token (mean)", a, "mask_us_mean", b, "mask_us_mean", False),
        ]
    report = harness.compare(sides, figures, rounds=args.rounds, pause=args.pause)
    print(table(report))
    print()
    print(report.table())


if __name__ == "__main__":
    main()
